"""The dump of ``cpcompile inspect --dump``: :func:`write_dump` writes an :class:`Inspection` to a folder.

The per-rank graph files come from :class:`cpcompile.dump.RankDumpWriter`, the writer the backend's ``dump_dir``
option uses too (so it lives below the backend, outside this package).
"""

from __future__ import annotations

import dataclasses
import os

from cpcompile.dump import RankDumpWriter, write_json
from cpcompile.inspect.picture import attention_pattern_image, pattern_geometry
from cpcompile.inspect.report import Inspection

__all__ = ["write_dump"]


def write_dump(inspection: Inspection, directory: str) -> list[str]:
    """Write the inspection under ``directory`` (created; must be empty) and return the paths written.

    Files, the same bytes for the same model and arguments::

        summary.json              settings, every site row of every traced rank, per-rank totals, file list
        attention_pattern.png     every rank's (query, key) pattern under the plan (attention_pattern_image)
        rank{r}/graph{n}_before.py  graph n as Dynamo traced it for rank r (runnable print_readable code)
        rank{r}/graph{n}_after.py   the same graph after the cpcompile passes (refused sites left as they were)
        rank{r}/summary.json      what the pass did in rank r's graphs (the schema the backend's dump_dir writes)

    for every traced rank ``r`` and graph ``n``.
    """
    directory = os.fspath(directory)
    if os.path.isdir(directory) and os.listdir(directory):
        raise ValueError(
            f"dump folder {directory!r} is not empty; pass a new folder (files are never mixed with an older dump)"
        )
    os.makedirs(directory, exist_ok=True)
    written = []
    for rank in inspection.ranks:
        writer = RankDumpWriter(directory, rank, inspection.cp_size)
        for g in (g for g in inspection.graphs if g.rank == rank):
            written += writer.add_graph(
                g.before, g.after, list(g.reports), calls_per_forward=g.calls, positions=g.positions, mixing=g.mixing
            )
    written = list(dict.fromkeys(written))
    png = os.path.join(directory, "attention_pattern.png")
    attention_pattern_image(inspection.plan, documents=inspection.documents).save(png, format="PNG")
    written.append(png)
    summary = os.path.join(directory, "summary.json")
    written.append(summary)
    data = inspection.to_json()
    data["attention_pattern"] = dataclasses.asdict(pattern_geometry(inspection.padded_len, inspection.batch_size))
    data["files"] = sorted(os.path.relpath(p, directory).replace(os.sep, "/") for p in written)
    write_json(summary, data)
    return written
