"""What the backend did, in torch.compile's own tooling: ``TORCH_LOGS`` and the structured trace (``tlparse``).

- ``TORCH_LOGS="cpcompile"`` (or ``torch._logging.set_logs(modules={"cpcompile": logging.INFO})``): as every graph
  compiles, each rank logs one line for the graph and a table of its attention sites (layer, shapes, mask found,
  what the backend did, bytes all-gathered per call), on the ``cpcompile.sites`` logger.
- ``TORCH_LOGS="+cpcompile"`` (level DEBUG): also the graph before and after the pass (``cpcompile.graphs``).
- ``TORCH_TRACE=dir`` (then ``tlparse dir/...log``): every compiled graph adds three artifacts under its compile id:
  ``cpcompile_graph_before`` and ``cpcompile_graph_after`` (the code of ``cpcompile.dump.graph_source``) and
  ``cpcompile_sites`` (JSON: rank, CP size, and one :func:`cpcompile.dump.site_record` per site).

torch itself routes ``TORCH_LOGS`` names that are importable modules to the Python loggers of that module tree,
so the loggers here are plain ``logging`` loggers under ``cpcompile``; nothing is printed unless asked for.
"""

from __future__ import annotations

import dataclasses
import logging

import torch.fx as fx
from tabulate import tabulate

from cpcompile import _compat, dump

__all__ = ["GraphTrace", "format_sites"]

#: One summary line and a table of sites per compiled graph (INFO).
sites_log = logging.getLogger("cpcompile.sites")
#: The graph before and after the pass (DEBUG).
graphs_log = logging.getLogger("cpcompile.graphs")

_COLUMNS = (
    ("layer", "layer"),
    ("node", "node"),
    ("q", "q_shape"),
    ("k", "k_shape"),
    ("dtype", "dtype"),
    ("mask found", "mask_form"),
    ("action", "action"),
    ("kernel / reason", None),
    ("AG bytes/call", "all_gather_bytes_per_call"),
)


def _shape(value) -> str:
    return "[" + ",".join(str(s) for s in value) + "]" if isinstance(value, (list, tuple)) else str(value)


def format_sites(reports: list, cp_size: int) -> str:
    """A text table of site reports (:class:`cpcompile.SiteReport`), one row per site.

    Fields are read from :func:`cpcompile.dump.site_record` (the report's fields plus the bytes one call
    all-gathers on this rank); a field a report does not have shows as empty.
    """
    rows = []
    for report in reports:
        record = dump.site_record(report, cp_size)
        row = []
        for _title, key in _COLUMNS:
            if key is None:
                value = record.get("reason") or record.get("kernel") or ""
            else:
                value = record.get(key, "")
            row.append(_shape(value) if key and key.endswith("shape") else ("" if value is None else value))
        rows.append(row)
    return tabulate(rows, headers=[title for title, _ in _COLUMNS], disable_numparse=True)


@dataclasses.dataclass
class GraphTrace:
    """The logs and trace artifacts of one graph through the backend: :meth:`start` before the pass, then
    :meth:`finish` after it. Does nothing (and renders no graph) when no log or trace is listening."""

    title: str
    before: str | None

    @classmethod
    def start(cls, gm: fx.GraphModule, title: str) -> GraphTrace:
        wants_code = graphs_log.isEnabledFor(logging.DEBUG) or _compat.structured_trace_enabled()
        return cls(title, dump.graph_source(gm, f"{title}: as Dynamo traced it") if wants_code else None)

    def finish(self, gm: fx.GraphModule, reports: list, *, rank: int, cp_size: int) -> None:
        if sites_log.isEnabledFor(logging.INFO):
            counts = {a: sum(r.action == a for r in reports) for a in ("rewritten", "refused", "untouched")}
            summary = ", ".join(f"{n} {a}" for a, n in counts.items() if n) or "no attention"
            text = f"{self.title}: {len(reports)} SDPA site(s): {summary}"
            sites_log.info("%s", f"{text}\n{format_sites(reports, cp_size)}" if reports else text)
        if self.before is None:
            return
        after = dump.graph_source(gm, f"{self.title}: after the cpcompile cp_attention pass")
        graphs_log.debug("%s\n%s", self.before, after)
        _compat.trace_artifact("cpcompile_graph_before", "string", lambda: self.before)
        _compat.trace_artifact("cpcompile_graph_after", "string", lambda: after)
        _compat.trace_artifact(
            "cpcompile_sites",
            "json",
            lambda: {
                "title": self.title,
                "rank": rank,
                "cp_size": cp_size,
                "sites": [dump.site_record(r, cp_size) for r in reports],
            },
        )
