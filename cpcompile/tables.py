"""Text tables of what the passes did, shared by ``TORCH_LOGS=cpcompile`` (:mod:`cpcompile._logging`) and
``cpcompile inspect`` (:mod:`cpcompile.inspect.report`): one rule for how a site or a mixing op shows.

:func:`site_cells` and :func:`mixing_cells` give a report's cells under :data:`SITE_HEADERS` and
:data:`MIXING_HEADERS`; each caller adds the columns only it knows (the log: the node and the bytes of this
compilation; inspect: the ranks, the graph and the bytes of the inspected batch) and renders with :func:`table`.
"""

from __future__ import annotations

from collections.abc import Sequence

from tabulate import tabulate

__all__ = [
    "MIXING_HEADERS",
    "SITE_HEADERS",
    "fmt_bytes",
    "fmt_ranks",
    "fmt_shape",
    "fmt_shapes",
    "mixing_cells",
    "site_cells",
    "table",
]

#: The columns of one attention site (:class:`cpcompile.passes.sdpa_cp.SiteReport`), in :func:`site_cells` order.
SITE_HEADERS = (
    "layer",
    "q",
    "k, v",
    "dtype",
    "heads q/kv",
    "mask found",
    "action",
    "attention",
    "exchange",
    "gathered K, V",
)
#: The columns of one op that mixes tokens (:class:`cpcompile.passes.mixing.MixingReport`), :func:`mixing_cells`.
MIXING_HEADERS = ("layer", "node", "op", "kind", "action", "each rank runs", "AG bytes/call", "A2A bytes/call")


def site_cells(report) -> list[str]:
    """The cells of one site report under :data:`SITE_HEADERS` (symbolic sizes show by name, e.g. ``s27``)."""
    action = report.action + (f": {report.reason}" if report.reason and report.action != "rewritten" else "")
    return [
        report.layer or "<top level>",
        fmt_shape(report.q_shape),
        fmt_shapes((report.k_shape, report.v_shape)),
        report.dtype,
        f"{report.q_heads}/{report.kv_heads}",
        report.mask_found,
        action,
        (report.kernel or "-") + (f", window {report.window}" if report.window is not None else ""),
        report.exchange.replace("_", "-") or "-",
        fmt_shapes(report.gathered_shapes),
    ]


def mixing_cells(report) -> list:
    """The cells of one mixing report under :data:`MIXING_HEADERS`."""
    gathered, exchanged = report.all_gather_bytes_per_call or "", report.all_to_all_bytes_per_call or ""
    where = [report.layer or "<top level>", report.node, report.op, report.kind, report.action]
    return [*where, report.split or "", gathered, exchanged]


def table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """``rows`` under ``headers`` as a plain text table (cells shown as given, numbers not reformatted)."""
    return tabulate(rows, headers=list(headers), tablefmt="simple", disable_numparse=True)


def fmt_shape(shape: Sequence) -> str:
    return "[" + ",".join(str(s) for s in shape) + "]"


def fmt_shapes(shapes: Sequence[Sequence]) -> str:
    if not shapes:
        return "-"
    if all(tuple(s) == tuple(shapes[0]) for s in shapes):
        return f"{len(shapes)} x {fmt_shape(shapes[0])}" if len(shapes) > 1 else fmt_shape(shapes[0])
    return " ".join(fmt_shape(s) for s in shapes)


def fmt_bytes(n: int) -> str:
    """Binary units with one decimal (exact byte counts are in summary.json and the rows)."""
    if n == 0:
        return "0"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def fmt_ranks(ranks: list[int], cp_size: int) -> str:
    """``all`` for every rank of the group, else the ranks joined by commas."""
    if ranks == list(range(cp_size)):
        return "all"
    return ",".join(map(str, ranks))
