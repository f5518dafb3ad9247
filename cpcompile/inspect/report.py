"""The result of ``cpcompile inspect``: :class:`Inspection` (settings, one :class:`RankSite` per site per traced
rank, :class:`RankTotals` per rank, the traced graphs) and the text tables it prints (:meth:`Inspection.report`).

The site and mixing columns are the ones ``TORCH_LOGS=cpcompile`` shows (:mod:`cpcompile.tables`).
"""

from __future__ import annotations

import dataclasses

from cpcompile.backend import TracedGraph
from cpcompile.layouts import Workload
from cpcompile.options import BackendOptions
from cpcompile.passes.sdpa_cp import SiteReport
from cpcompile.plan import CPPlan
from cpcompile.tables import (
    MIXING_HEADERS,
    SITE_HEADERS,
    fmt_bytes,
    fmt_ranks,
    mixing_cells,
    site_cells,
    table,
)

__all__ = ["Inspection", "RankSite", "RankTotals"]


@dataclasses.dataclass(frozen=True)
class RankSite:
    """One SDPA site as traced on one rank: the pass's report (sizes resolved) and its graph's calls per forward."""

    rank: int
    #: How many times the site's graph ran in one forward.
    calls_per_forward: int
    report: SiteReport
    #: Bytes of K and V this rank receives per call in a halo or selective exchange (``report.exchange`` ``"halo"``
    #: or ``"selective"``: one all-to-all of the keys the plan routes), from the plan of the inspected batch.
    halo_bytes_per_call: int = 0
    #: Bytes of the K and V this rank's queries see that other ranks hold, summed over the batch rows: the least
    #: any exchange must deliver (an all-gather delivers all of the other ranks' keys by design).
    needed_bytes_per_call: int = 0

    @property
    def all_gather_bytes_per_step(self) -> int:
        return self.report.all_gather_bytes_per_call * self.calls_per_forward

    @property
    def backward_bytes_per_step(self) -> int:
        """Bytes this rank sends in backward: reduce-scatters of dK/dV, or the halo keys' gradients returned."""
        halo_back = self.halo_bytes_per_call * self.calls_per_forward if self.report.needs_grad else 0
        return self.reduce_scatter_bytes_per_step + halo_back

    @property
    def received_bytes_per_call(self) -> int:
        """K and V bytes this rank receives per call, whatever the exchange."""
        return self.report.all_gather_bytes_per_call + self.halo_bytes_per_call

    @property
    def reduce_scatters_per_step(self) -> int:
        """Backward reduce-scatters of one step: one per gathered tensor that requires grad, per call."""
        return len(self.report.gathered_shapes) * self.report.needs_grad * self.calls_per_forward

    @property
    def reduce_scatter_bytes_per_step(self) -> int:
        return self.report.reduce_scatter_bytes_per_call * self.calls_per_forward

    def __getattr__(self, name: str):
        """The report's fields (``row.layer``, ``row.action``, ...) read through the row."""
        if name == "report":  # not set yet (copying, unpickling)
            raise AttributeError(name)
        return getattr(self.report, name)

    def to_json(self) -> dict:
        return {
            "rank": self.rank,
            "graph": self.report.graph_id,
            "calls_per_forward": self.calls_per_forward,
            **self.report.to_json(),
            "all_gather_bytes_per_step": self.all_gather_bytes_per_step,
            "reduce_scatters_per_step": self.reduce_scatters_per_step,
            "reduce_scatter_bytes_per_step": self.reduce_scatter_bytes_per_step,
            "halo_bytes_per_call": self.halo_bytes_per_call,
            "halo_bytes_per_step": self.halo_bytes_per_call * self.calls_per_forward,
            "needed_bytes_per_call": self.needed_bytes_per_call,
        }


@dataclasses.dataclass(frozen=True)
class RankTotals:
    """What one rank gathers and computes in one training step (forward + backward)."""

    rank: int
    rewritten: int
    refused: int
    all_gathers: int
    all_gather_bytes: int
    reduce_scatters: int
    reduce_scatter_bytes: int
    #: Halo exchanges (K and V of sliding-window sites) and the bytes received in them, one step.
    halo_exchanges: int
    halo_bytes: int
    #: Bytes of the K and V its queries see that other ranks hold, one step (``RankSite.needed_bytes_per_call``).
    needed_bytes: int
    #: Query/key pairs of this rank's rows that the plan's masks let attend, summed over the batch and over the
    #: rewritten attention layers (each with its documents and window).
    visible_pairs: int
    #: Query/key pairs the block kernel computes for this rank (its not fully masked blocks), same sums.
    computed_pairs: int


@dataclasses.dataclass(frozen=True)
class Inspection:
    """The result of :func:`inspect_model`: the settings, one row per site per traced rank, the graphs.

    The batch's sizes and layout (``cp_size``, ``seq_len``, ``padded_len``, ``chunk_len``, ``layout``) are read
    from :attr:`plan`.
    """

    model: str
    model_class: str
    ranks: tuple[int, ...]
    doc_lens: tuple[tuple[int, ...], ...]
    dtype: str
    device: str
    #: The options the backend traced with (those a training run with the same options uses).
    options: BackendOptions
    #: What the ``"balanced"`` layout balanced: the rewritten layers' attention forms, the backend's block size.
    workload: Workload
    rows: tuple[RankSite, ...]
    totals: tuple[RankTotals, ...]
    #: The plan of the global batch (rank 0's view; ``plan.token_indices(r)`` gives any rank's tokens).
    plan: CPPlan
    #: Whether the rewritten sites keep packed documents apart (``SiteReport.documents``) or plain causal order.
    documents: bool
    #: Every graph traced, of every traced rank.
    graphs: tuple[TracedGraph, ...] = dataclasses.field(repr=False)
    #: How the recurrent cores that support both run (``shard(recurrence=...)``: ``"heads"`` or ``"state"``).
    recurrence: str = "heads"

    @property
    def batch_size(self) -> int:
        return len(self.doc_lens)

    cp_size = property(lambda self: self.plan.cp_size, doc="CP group size ``N``.")
    seq_len = property(lambda self: self.plan.seq_len, doc="Global sequence length ``T`` before padding.")
    padded_len = property(lambda self: self.plan.padded_len, doc="``T`` padded to a multiple of ``N``.")
    chunk_len = property(lambda self: self.plan.chunk_len, doc="Tokens per rank, ``T_pad / N``.")
    layout = property(lambda self: self.plan.layout, doc="The layout's name (:data:`cpcompile.plan.LAYOUTS`).")

    def site_table(self) -> str:
        """The per-site table (one row per site, whose byte columns give the largest rank's; a site that differs
        between ranks gets one row per rank)."""
        headers = ["ranks", "graph", *SITE_HEADERS, "recv/call", "needed/call", "recv/step", "bwd/step"]
        body = [
            [
                ranks,
                row.graph_id,
                *site_cells(row.report),
                fmt_bytes(row.received_bytes_per_call),
                fmt_bytes(row.needed_bytes_per_call),
                fmt_bytes(row.received_bytes_per_call * row.calls_per_forward),
                fmt_bytes(row.backward_bytes_per_step),
            ]
            for ranks, row in self._merged_rows()
        ]
        return table(headers, body)

    def rank_table(self) -> str:
        """The per-rank totals of one training step."""
        headers = [
            "rank",
            "rewritten",
            "refused",
            "all-gathers",
            "AG/step",
            "reduce-scatters (bwd)",
            "RS/step",
            "halo exchanges",
            "halo/step",
            "needed/step",
            "visible (q,k) pairs",
            "computed (q,k) pairs",
        ]
        body = [
            [
                t.rank,
                t.rewritten,
                t.refused,
                t.all_gathers,
                fmt_bytes(t.all_gather_bytes),
                t.reduce_scatters,
                fmt_bytes(t.reduce_scatter_bytes),
                t.halo_exchanges,
                fmt_bytes(t.halo_bytes),
                fmt_bytes(t.needed_bytes),
                t.visible_pairs,
                t.computed_pairs,
            ]
            for t in self.totals
        ]
        return table(headers, body)

    def headline(self) -> str:
        docs = "; ".join(",".join(map(str, row)) for row in self.doc_lens)
        pad = f", padded to {self.padded_len}" if self.padded_len != self.seq_len else ""
        return (
            f"{self.model} ({self.model_class}): CP size {self.cp_size}, batch {self.batch_size} x {self.seq_len} "
            f"tokens{pad} (documents {docs}), {self.chunk_len} tokens per rank, {self.dtype}, traced on "
            f"{self.device}, {self.layout} layout, attention={self.options.attention}, "
            f"recurrence={self.recurrence}; "
            f"{len({(r.graph_id, r.node) for r in self.rows})} SDPA site(s) in "
            f"{len({g.graph for g in self.graphs})} graph(s)"
        )

    def position_table(self) -> str:
        """One row per position source (a source found alike on several ranks gets one row)."""
        rows: dict[tuple, list[int]] = {}
        for g in self.graphs:
            for p in g.positions:
                key = (g.graph, p.layer or "<top level>", p.node, p.kind, p.action, p.reason)
                rows.setdefault(key, []).append(g.rank)
        body = [[fmt_ranks(ranks, self.cp_size), *key] for key, ranks in rows.items()]
        headers = ["ranks", "graph", "layer", "node", "kind", "action", "reason"]
        return table(headers, body)

    def mixing_table(self) -> str:
        """One row per op that mixes tokens outside attention (an op found alike on several ranks gets one row)."""
        rows: dict[tuple, list[int]] = {}
        for g in self.graphs:
            for m in g.mixing:
                rows.setdefault((g.graph, *mixing_cells(m), g.calls, m.reason), []).append(g.rank)
        body = [[fmt_ranks(ranks, self.cp_size), *key] for key, ranks in rows.items()]
        return table(["ranks", "graph", *MIXING_HEADERS, "calls/forward", "reason"], body)

    def report(self) -> str:
        """The text ``cpcompile inspect`` prints."""
        lines = [self.headline(), ""]
        if not self.rows:
            lines.append(
                "no scaled_dot_product_attention call found in the traced graphs: the backend passes them "
                "through unchanged and context parallelism does not split attention (does the model use "
                "attn_implementation='sdpa'?)"
            )
        else:
            lines += [
                self.site_table(),
                "",
                "per rank, one step (forward all-gathers, backward reduce-scatters):",
                self.rank_table(),
            ]
        if any(g.positions for g in self.graphs):
            lines += [
                "",
                "positions computed from the local sequence length (rewritten to global token indices, left to "
                "the attention mask, unchanged, or refused):",
                self.position_table(),
            ]
        if any(g.mixing for g in self.graphs):
            lines += [
                "",
                "ops that mix tokens along the sequence outside attention (gathered: run on the whole sequence; "
                "partial_sum: a sum the ranks' values add up to; dispatch: MoE token bookkeeping; summed: an MoE "
                "count written into module state, summed over the ranks; pooled: the winning token's rows of an argmax "
                "over the sequence, handed to every rank; per_token: a listed custom op; head_parallel: a recurrent "
                "core run on the whole sequence for this rank's heads; replicated: a layer run whole on every rank; "
                "state_passing: a recurrent core run on this rank's tokens from the state the other ranks' summaries "
                "give; refused):",
                self.mixing_table(),
            ]
        return "\n".join(lines) + "\n"

    def _merged_rows(self) -> list[tuple[str, RankSite]]:
        by_site: dict[tuple[int, str], list[RankSite]] = {}
        for row in self.rows:
            by_site.setdefault((row.graph_id, row.node), []).append(row)
        out = []
        for rows in by_site.values():
            same = all(r.report == rows[0].report and r.calls_per_forward == rows[0].calls_per_forward for r in rows)
            if same:  # one row; the bytes that depend on the rank's tokens: the largest over the ranks
                largest = dataclasses.replace(
                    rows[0],
                    halo_bytes_per_call=max(r.halo_bytes_per_call for r in rows),
                    needed_bytes_per_call=max(r.needed_bytes_per_call for r in rows),
                )
                out.append((fmt_ranks([r.rank for r in rows], self.cp_size), largest))
            else:
                out += [(str(r.rank), r) for r in rows]
        return out

    def to_json(self) -> dict:
        """The table's data as plain JSON types (what ``summary.json`` holds, without the file list)."""
        return {
            "model": self.model,
            "model_class": self.model_class,
            "cp_size": self.cp_size,
            "ranks": list(self.ranks),
            "doc_lens": [list(r) for r in self.doc_lens],
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "padded_len": self.padded_len,
            "chunk_len": self.chunk_len,
            "dtype": self.dtype,
            "device": self.device,
            "documents": self.documents,
            "layout": self.layout,
            "workload": dataclasses.asdict(self.workload),
            "attention": self.options.attention,
            "recurrence": self.recurrence,
            "sites": [row.to_json() for row in self.rows],
            "positions": [{"rank": g.rank, **dataclasses.asdict(p)} for g in self.graphs for p in g.positions],
            "mixing": [{"rank": g.rank, **m.to_json()} for g in self.graphs for m in g.mixing],
            "rank_totals": [dataclasses.asdict(t) for t in self.totals],
        }
