"""Per-rank graph dumps, shared by the backend (``dump_dir`` option) and ``cpcompile inspect``.

One folder per rank, names from a counter, no uuids, so two runs of the same model write the same bytes::

    DIR/rank{r}/graph{n}_before.py   # graph n as Dynamo traced it (GraphModule.print_readable)
    DIR/rank{r}/graph{n}_after.py    # the same graph after the cpcompile passes
    DIR/rank{r}/summary.json         # every dumped graph of this rank, what the passes did with each SDPA site
                                     # ("sites"), each position source ("positions") and each op
                                     # that mixes tokens outside attention ("mixing"); for a graph cpcompile
                                     # refused, the refusal ("refused") and no graph{n}_after.py

``n`` counts the graphs dumped into ``DIR`` for rank ``r`` by this process, in compile order.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import types

import torch.fx as fx

from cpcompile.passes.mixing import MixingReport
from cpcompile.passes.positions import PositionReport
from cpcompile.passes.sdpa_cp import SiteReport

__all__ = ["RankDumpWriter", "graph_source", "write_json", "writer_for"]


def graph_source(gm: fx.GraphModule, title: str) -> str:
    """The readable code of ``gm`` (``print_readable``) under a comment line ``title``.

    The file starts with the imports of every global name the code uses (functions such as cpcompile's
    all-gather, ``device``, ``inf``), so ``exec`` of the file defines a runnable ``GraphModule`` class.
    """
    lines = [
        f"# {title}",
        "# Readable code of a torch.fx GraphModule (print_readable).",
        "import torch",
        "import cpcompile  # registers the torch.ops.cpcompile ops",
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
        *,
        calls_per_forward: int | None = None,
        positions: list[PositionReport] | tuple[PositionReport, ...] = (),
        mixing: list[MixingReport] | tuple[MixingReport, ...] = (),
        refused: str | None = None,
    ) -> list[str]:
        """Write graph ``n`` (the next counter value) and the updated summary; return the paths written.

        ``refused``: the message of the refusal that stopped the compile of this graph (only the graph before
        the passes is written then)."""
        with self._lock:
            os.makedirs(self.folder, exist_ok=True)
            n = len(self.graphs)
            names = (f"graph{n}_before.py",) if refused is not None else (f"graph{n}_before.py", f"graph{n}_after.py")
            for name, text in zip(names, (before, after)):
                with open(os.path.join(self.folder, name), "w", encoding="utf-8") as f:
                    f.write(text)
            self.graphs.append(
                {
                    "graph": n,
                    "before": names[0],
                    "after": names[1] if len(names) > 1 else None,
                    "calls_per_forward": calls_per_forward,
                    "sites": [r.to_json() for r in reports],
                    "positions": [dataclasses.asdict(p) for p in positions],
                    "mixing": [m.to_json() for m in mixing],
                    **({"refused": refused} if refused is not None else {}),
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
