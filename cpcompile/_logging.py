"""What the backend did, in torch.compile's own tooling: ``TORCH_LOGS`` and the structured trace (``tlparse``).

- ``TORCH_LOGS="cpcompile"`` (or ``torch._logging.set_logs(modules={"cpcompile": logging.INFO})``): as every graph
  compiles, each rank logs one line for the graph and a table of its attention sites (layer, shapes, mask found,
  what the backend did, bytes all-gathered per call), on the ``cpcompile.sites`` logger, then a table of the ops
  that mix tokens outside attention (layer, op, kind, what the backend did, the model's line), on
  ``cpcompile.mixing``.
- ``TORCH_LOGS="+cpcompile"`` (level DEBUG): also the graph before and after the pass (``cpcompile.graphs``).
- ``TORCH_TRACE=dir`` (then ``tlparse dir/...log``): every compiled graph adds three artifacts under its compile id:
  ``cpcompile_graph_before`` and ``cpcompile_graph_after`` (the code of ``cpcompile.dump.graph_source``) and
  ``cpcompile_sites`` (JSON: rank, CP size, and the record of every site, ``SiteReport.to_json``).

torch itself routes ``TORCH_LOGS`` names that are importable modules to the Python loggers of that module tree,
so the loggers here are plain ``logging`` loggers under ``cpcompile``; nothing is printed unless asked for.
"""

from __future__ import annotations

import dataclasses
import logging

from cpcompile import _compat
from cpcompile.tables import MIXING_HEADERS, SITE_HEADERS, mixing_cells, site_cells, table

__all__ = ["GraphTrace", "format_mixing", "format_sites"]

#: One summary line and a table of sites per compiled graph (INFO).
sites_log = logging.getLogger("cpcompile.sites")
#: One table of the ops that mix tokens outside attention per compiled graph that has any (INFO).
mixing_log = logging.getLogger("cpcompile.mixing")
#: The graph before and after the pass (DEBUG).
graphs_log = logging.getLogger("cpcompile.graphs")


def format_sites(reports: list) -> str:
    """A text table of site reports (:class:`cpcompile.passes.sdpa_cp.SiteReport`), one row per site: the columns
    ``cpcompile inspect`` shows (:mod:`cpcompile.tables`), the node, and the bytes all-gathered per call.

    Shapes show symbolic sizes by name (``s27``); the bytes use their values at this compilation.
    """
    rows = [[*site_cells(r), r.node, r.all_gather_bytes_per_call] for r in reports]
    return table([*SITE_HEADERS, "node", "AG bytes/call"], rows)


def format_mixing(reports: list) -> str:
    """A text table of mixing reports (:class:`cpcompile.passes.mixing.MixingReport`), one row per op, with the
    model's line that made it."""
    return table([*MIXING_HEADERS, "model code"], [[*mixing_cells(r), r.source] for r in reports])


@dataclasses.dataclass
class GraphTrace:
    """The logs and trace artifacts of one graph through the backend, titled ``title``."""

    title: str

    def wants_code(self) -> bool:
        """Whether a log or trace is listening for the graphs' code (so the backend renders it)."""
        return graphs_log.isEnabledFor(logging.DEBUG) or _compat.structured_trace_enabled()

    def emit(
        self, before: str, after: str, reports: list, *, rank: int, cp_size: int, mixing: list | tuple = ()
    ) -> None:
        """Log the site table and the mixing table (INFO) and, when :meth:`wants_code`, the graphs (DEBUG) and
        the trace artifacts.

        ``before``/``after``: the graph's code before and after the pass (``""`` when it was not rendered);
        ``mixing``: the graph's :class:`cpcompile.MixingReport` records.
        """
        if mixing and mixing_log.isEnabledFor(logging.INFO):
            mixing_log.info(
                "%s",
                f"{self.title}: {len(mixing)} op(s) mixing tokens outside attention\n{format_mixing(list(mixing))}",
            )
        if sites_log.isEnabledFor(logging.INFO):
            counts = {a: sum(r.action == a for r in reports) for a in ("rewritten", "refused", "untouched")}
            summary = ", ".join(f"{n} {a}" for a, n in counts.items() if n) or "no attention"
            text = f"{self.title}: {len(reports)} SDPA site(s): {summary}"
            sites_log.info("%s", f"{text}\n{format_sites(reports)}" if reports else text)
        if not (before and self.wants_code()):
            return
        graphs_log.debug("%s\n%s", before, after)
        _compat.trace_artifact("cpcompile_graph_before", "string", lambda: before)
        _compat.trace_artifact("cpcompile_graph_after", "string", lambda: after)
        _compat.trace_artifact(
            "cpcompile_sites",
            "json",
            lambda: {
                "title": self.title,
                "rank": rank,
                "cp_size": cp_size,
                "sites": [r.to_json() for r in reports],
                "mixing": [m.to_json() for m in mixing],
            },
        )
