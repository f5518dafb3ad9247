"""Per-rank graph dumps, shared by the backend (``dump_dir`` option) and ``cpcompile inspect``.

One folder per rank, names from a counter, no uuids, so two runs of the same model write the same bytes::

    DIR/rank{r}/graph{n}_before.py   # graph n as Dynamo traced it (GraphModule.print_readable)
    DIR/rank{r}/graph{n}_after.py    # the same graph after the cp_attention pass
    DIR/rank{r}/summary.json         # every dumped graph of this rank, what the passes did with each SDPA site
                                     # ("sites") and each position source ("positions")

``n`` counts the graphs dumped into ``DIR`` for rank ``r`` by this process, in compile order.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import types

import torch
import torch.fx as fx

from cpcompile.passes.positions import PositionReport
from cpcompile.passes.sdpa_cp import SiteReport, find_sdpa_sites

__all__ = ["RankDumpWriter", "graph_source", "site_grad_flags", "site_record", "write_json", "writer_for"]


def graph_source(gm: fx.GraphModule, title: str) -> str:
    """The readable code of ``gm`` (``print_readable``) under a comment line ``title``.

    The file starts with the imports of every global name the code uses (functions such as cpcompile's
    all-gather, ``device``, ``inf``), so ``exec`` of the file defines a runnable ``GraphModule`` class.
    """
    lines = [
        f"# {title}",
        "# Readable code of a torch.fx GraphModule (print_readable).",
        "import torch",
        "import cpcompile  # registers torch.ops.cpcompile.plan_mask",
    ]
    lines += _global_imports(gm)
    return "\n".join(lines) + "\n\n" + gm.print_readable(print_output=False).rstrip() + "\n"


def _global_imports(gm: fx.GraphModule) -> list[str]:
    out = []
    for name, obj in sorted(gm.graph.python_code(root_module="self").globals.items()):
        if name == "torch":
            continue
        if isinstance(obj, float):
            out.append(f"{name} = float({str(obj)!r})")
        elif obj is type(None):
            out.append(f"{name} = type(None)")
        elif isinstance(obj, types.ModuleType):
            out.append(f"import {obj.__name__} as {name}")
        else:
            module, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
            if module and qual and "<" not in qual:
                head, _, attr = qual.rpartition(".")
                source = f"{module}.{head}" if head else module
                out.append(
                    f"from {module} import {qual} as {name}"
                    if not head
                    else f"import {module}; {name} = {source}.{attr}"
                )
            else:
                out.append(f"# {name}: {obj!r} (not importable by name)")
    return out


def site_grad_flags(gm: fx.GraphModule) -> dict[str, tuple[bool, bool]]:
    """For every SDPA node of ``gm`` (before the pass): whether its key and value require grad.

    A gathered tensor that requires grad is reduce-scattered in backward, so this decides the backward bytes.
    """
    flags = {}
    for site in find_sdpa_sites(gm):
        k, v = site.meta(site.key), site.meta(site.value)
        flags[site.node.name] = (bool(k is not None and k.requires_grad), bool(v is not None and v.requires_grad))
    return flags


def _static_numel(shape: tuple) -> int | None:
    return math.prod(shape) if all(isinstance(s, int) for s in shape) else None


def site_record(report: SiteReport, cp_size: int, needs_grad: tuple[bool, bool] = (False, False)) -> dict:
    """A JSON-ready record of one site: the report's fields and the bytes one call moves on this rank.

    ``all_gather_bytes_per_call``: bytes this rank receives per call, ``(N - 1) * numel * itemsize`` summed
    over the gathered shapes (K then V). ``reduce_scatter_bytes_per_call``: bytes it sends in backward, the
    same amount for every gathered tensor that requires grad. ``None`` when a shape is symbolic.
    """
    record = dataclasses.asdict(report)
    record["gathered_shapes"] = [list(s) for s in report.gathered_shapes]
    for key in ("q_shape", "k_shape", "v_shape"):
        record[key] = list(record[key])
    itemsize = getattr(torch, report.dtype).itemsize if hasattr(torch, report.dtype) else None
    gathered = [_static_numel(s) for s in report.gathered_shapes]
    if itemsize is None or any(n is None for n in gathered):
        record["all_gather_bytes_per_call"] = record["reduce_scatter_bytes_per_call"] = None
        return record
    per_tensor = [(cp_size - 1) * n * itemsize for n in gathered]
    record["all_gather_bytes_per_call"] = sum(per_tensor)
    record["reduce_scatter_bytes_per_call"] = sum(b for b, g in zip(per_tensor, needs_grad) if g)
    return record


def write_json(path: str, data: object) -> None:
    """Write ``data`` as sorted, indented JSON with a final newline (byte-identical for equal data)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=2, sort_keys=True) + "\n")


class RankDumpWriter:
    """Writes ``rank{r}/graph{n}_before.py``, ``graph{n}_after.py`` and ``summary.json`` under ``root``.

    ``summary.json`` is rewritten after every graph, so it is complete whenever training stops.
    """

    def __init__(self, root: str, rank: int, cp_size: int) -> None:
        self.folder = os.path.join(root, f"rank{rank}")
        self.rank = rank
        self.cp_size = cp_size
        self.graphs: list[dict] = []
        self._lock = threading.Lock()

    def add_graph(
        self,
        before: str,
        after: str,
        reports: list[SiteReport],
        grad_flags: dict[str, tuple[bool, bool]],
        *,
        calls_per_forward: int | None = None,
        positions: list[PositionReport] | tuple[PositionReport, ...] = (),
    ) -> list[str]:
        """Write graph ``n`` (the next counter value) and the updated summary; return the paths written."""
        with self._lock:
            os.makedirs(self.folder, exist_ok=True)
            n = len(self.graphs)
            names = (f"graph{n}_before.py", f"graph{n}_after.py")
            for name, text in zip(names, (before, after)):
                with open(os.path.join(self.folder, name), "w", encoding="utf-8") as f:
                    f.write(text)
            self.graphs.append(
                {
                    "graph": n,
                    "before": names[0],
                    "after": names[1],
                    "calls_per_forward": calls_per_forward,
                    "sites": [site_record(r, self.cp_size, grad_flags.get(r.node, (False, False))) for r in reports],
                    "positions": [dataclasses.asdict(p) for p in positions],
                }
            )
            summary = os.path.join(self.folder, "summary.json")
            write_json(summary, {"rank": self.rank, "cp_size": self.cp_size, "graphs": self.graphs})
            return [os.path.join(self.folder, name) for name in names] + [summary]


_WRITERS: dict[tuple[str, int], RankDumpWriter] = {}
_WRITERS_LOCK = threading.Lock()


def writer_for(root: str, rank: int, cp_size: int) -> RankDumpWriter:
    """The process's one writer of ``root``/rank{rank} (backends of one process share its graph counter)."""
    key = (os.path.abspath(root), rank)
    with _WRITERS_LOCK:
        if key not in _WRITERS:
            _WRITERS[key] = RankDumpWriter(root, rank, cp_size)
        return _WRITERS[key]
