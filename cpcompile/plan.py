"""The per-batch context-parallel plan: which tokens of a global batch every CP rank holds, and who sees whom.

A :class:`CPPlan` is pure tensor bookkeeping with no collectives, so everything in this module can be
unit-tested in one process. The runtime shim (:mod:`cpcompile.runtime`) builds one plan per batch and the
compiled graph reads it while it runs.

Layout: the sequence dimension ``T`` of every row is padded to ``T_pad``, a multiple of the CP size ``N``; rank
``r`` holds the ``c = T_pad // N`` tokens whose global indices are ``plan.indices[r]`` (ascending), the same
for every row, placed by one of :data:`cpcompile.layouts.LAYOUTS` (default ``"balanced"``: every rank computes the
same attention work). Who sees whom is :func:`cpcompile.mask.visible`, the one visibility rule.

Padding tokens form a separate document (their position ids restart at 0) and carry the ignore label, so they
never influence a real token. All-gathering a per-token tensor over the CP group puts rank ``r``'s tokens at
slots ``[r * c, (r + 1) * c)``: the gathered order is ``plan.indices.flatten()``.

Layers: :mod:`cpcompile.mask` -> :mod:`cpcompile.layouts` -> this module (the names of both are importable from
here too).

Why one module of about 570 lines: it is :class:`CPPlan` and the functions that derive from one plan what the
kernels and ops read (query blocks, visible blocks, halo routing); they share its index conventions, stated once
above.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from cpcompile.layouts import DEFAULT_LAYOUT, LAYOUTS, MAX_RUNS, AttentionForm, Workload, check_layout, count_runs
from cpcompile.mask import document_ids, document_starts, first_visible, needed_keys, visible, visible_mask

__all__ = [
    "IGNORE_INDEX",
    "LAYOUTS",
    "MAX_RUNS",
    "AttentionForm",
    "CPPlan",
    "HaloRouting",
    "VisibleBlocks",
    "Workload",
    "build_plan",
    "count_runs",
    "document_ids",
    "document_starts",
    "first_visible",
    "query_blocks",
    "visible",
    "visible_blocks",
    "visible_mask",
]

#: The label value that transformers' cross entropy ignores.
IGNORE_INDEX = -100


# -- blocks ---------------------------------------------------------------------------------------------
def query_blocks(q_pos: torch.Tensor, block_q: int) -> list[int]:
    """Boundaries ``[0, ..., c]`` of the query blocks of local queries at global indices ``q_pos`` (ascending).

    A block never spans two runs of consecutive indices (so its queries are contiguous tokens, which keeps
    its visible keys one interval) nor a multiple of ``block_q`` (so it lies inside one block-aligned piece of
    the whole sequence, whichever layout put it on this rank) and holds at most ``block_q`` queries.
    """
    c = int(q_pos.shape[0])
    cut = (torch.diff(q_pos) != 1) | (q_pos[1:] % block_q == 0)
    breaks = [0, *(torch.nonzero(cut).flatten() + 1).tolist(), c]
    bounds = [s for a, b in zip(breaks, breaks[1:]) for s in range(a, b, block_q)]
    return [*bounds, c]


@dataclasses.dataclass(frozen=True)
class VisibleBlocks:
    """Which (query block, key block) pairs of one rank's attention hold at least one visible pair.

    Queries are the local tokens cut at ``q_bounds`` (:func:`query_blocks`); keys are sorted by global index
    and cut into blocks of ``block_k``. For query block ``i`` of row ``b`` the visible keys are the sorted-key
    interval ``[lo[b, i], hi[b, i])`` (from the start of the block's earliest document, or of the window, up to
    the block's last query), and every query of the block sees every key of ``[full_lo[b, i], full_hi[b, i])``
    (empty when ``full_lo >= full_hi``). A key block is computed iff it intersects ``[lo, hi)``; it needs no
    mask iff it lies inside ``[full_lo, full_hi)``. All four are ``[B, num_q_blocks]`` int64 tensors.
    """

    q_bounds: tuple[int, ...]
    block_k: int
    #: Number of keys.
    kv_len: int
    lo: torch.Tensor
    hi: torch.Tensor
    full_lo: torch.Tensor
    full_hi: torch.Tensor

    def key_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(first, end)``: the computed key blocks of query block ``i`` are ``range(first[b, i], end[b, i])``."""
        return self.lo // self.block_k, -(-self.hi // self.block_k)

    def computed_pairs(self) -> int:
        """Number of (query, key) pairs a kernel computes when it visits exactly the computed block pairs."""
        first, end = self.key_blocks()
        keys = (end * self.block_k).clamp(max=self.kv_len) - first * self.block_k  # [B, nQ]
        keys = keys.clamp(min=0)
        rows = torch.tensor(self.q_bounds, device=keys.device).diff()
        return int((keys * rows).sum())


def visible_blocks(
    doc_ids: torch.Tensor,
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
    block_q: int,
    block_k: int,
    window: int | None = None,
) -> VisibleBlocks:
    """Block visibility of queries at global indices ``q_pos`` against keys at ``kv_pos``, both ascending.

    ``doc_ids`` ``[B, T_pad]`` are the document ids by global index (non-decreasing along each row; all zeros:
    no document condition). Semantics are those of :func:`visible`.
    """
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be positive, got block_q={block_q}, block_k={block_k}")
    bounds = query_blocks(q_pos, block_q)
    start = torch.tensor(bounds[:-1], device=q_pos.device)
    first_q = q_pos[start]  # [nQ] global index of each block's first query
    last_q = q_pos[torch.tensor(bounds[1:], device=q_pos.device) - 1]
    lo = first_visible(doc_ids, first_q, window)
    full_lo = first_visible(doc_ids, last_q, window)
    B = doc_ids.shape[0]
    hi = (last_q + 1).expand(B, -1)
    full_hi = (first_q + 1).expand(B, -1)

    def to_keys(p: torch.Tensor) -> torch.Tensor:  # global index -> position in the sorted keys
        return torch.searchsorted(kv_pos, p.contiguous())

    return VisibleBlocks(
        tuple(bounds), block_k, int(kv_pos.shape[0]), to_keys(lo), to_keys(hi), to_keys(full_lo), to_keys(full_hi)
    )


def runs(indices: torch.Tensor) -> list[tuple[int, int]]:
    """The runs ``[start, end)`` of consecutive global indices in one rank's ascending ``indices``."""
    idx = indices.tolist()
    out, start = [], 0
    for i in range(1, len(idx) + 1):
        if i == len(idx) or idx[i] != idx[i - 1] + 1:
            out.append((idx[start], idx[i - 1] + 1))
            start = i
    return out


#: What to do when a rank needs more keys than a selective exchange's receive buffer holds.
SELECTIVE_SLOTS_FIX = "; raise cpcompile.backend(..., exchange_slots=...) or use exchange='all_gather'"


@dataclasses.dataclass(frozen=True)
class HaloRouting:
    """Who sends which keys to whom for one rank's sliding-window attention (see :meth:`CPPlan.halo_routing`).

    ``recv_pos`` ``[slots]``: the global index of every halo key slot of this rank, grouped by the rank that
    sends it (in rank order, ascending within a rank), ``-1`` for the empty slots at the end. ``send_slots``
    ``[N * slots]``: this rank's local token slots to send, grouped by receiving rank, padded with 0.
    ``counts`` ``[2, N]``: row 0 the number of keys this rank sends to every rank, row 1 the number it receives
    from every rank. All int64, on the plan's device.
    """

    recv_pos: torch.Tensor
    send_slots: torch.Tensor
    counts: torch.Tensor


# -- the plan ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class CPPlan:
    """Everything the shim and the rewritten attention need to know about one global batch.

    Built by :func:`build_plan`; the fields are read-only.
    """

    #: CP group size (number of ranks).
    cp_size: int
    #: This rank's index inside the CP group.
    cp_rank: int
    #: Batch size.
    batch_size: int
    #: Global sequence length before padding.
    seq_len: int
    #: Global sequence length after padding to a multiple of ``cp_size``.
    padded_len: int
    #: Name of the layout (a key of :data:`LAYOUTS`).
    layout: str
    #: ``[cp_size, chunk_len]`` int64: the global indices of the tokens every rank holds, ascending per rank.
    indices: torch.Tensor
    #: Global position ids, ``[B, padded_len]`` (padding restarts at 0).
    position_ids: torch.Tensor
    #: Global document ids, ``[B, padded_len]`` (padding is its own document).
    doc_ids: torch.Tensor
    #: Name of the CP process group (``""`` when built without a group, e.g. in unit tests).
    group_name: str = ""
    #: Masks and halo routings built so far for this batch (every layer of a step shares them).
    _cache: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def chunk_len(self) -> int:
        """Number of tokens of every row held by one rank."""
        return self.padded_len // self.cp_size

    @property
    def num_padding(self) -> int:
        """Number of padding tokens appended to every row."""
        return self.padded_len - self.seq_len

    def token_indices(self, rank: int | None = None) -> torch.Tensor:
        """``[c]`` int64: the global indices of the tokens ``rank`` (this rank by default) holds, ascending."""
        return self.indices[self.cp_rank if rank is None else rank]

    def real_tokens(self, rank: int | None = None) -> torch.Tensor:
        """Bool ``[B, c]``: True where ``rank``'s local token is a token of the batch, False on padding."""
        real = self.token_indices(rank) < self.seq_len
        return real.expand(self.batch_size, -1).contiguous()

    def gathered_indices(self) -> torch.Tensor:
        """``[T_pad]`` int64: the global index at every slot of a tensor all-gathered over the CP group."""
        return self.indices.reshape(-1)

    def gathered_order(self) -> torch.Tensor:
        """``[T_pad]`` int64: the permutation that puts a tensor gathered over the CP group (rank-major chunks of
        ``c`` tokens, slot ``i`` holding global index ``gathered_indices()[i]``) into token order, padding last:
        ``gathered.index_select(dim, order)``. Its inverse permutation is :meth:`gathered_indices`."""
        return torch.argsort(self.gathered_indices())

    # -- slicing ---------------------------------------------------------------------------------------
    def pad(self, t: torch.Tensor, value: int | float | bool) -> torch.Tensor:
        """Pad the sequence dim (dim 1) of a global ``[B, T, ...]`` tensor to ``padded_len`` with ``value``."""
        if self.num_padding == 0:
            return t
        shape = (t.shape[0], self.num_padding, *t.shape[2:])
        return torch.cat([t, t.new_full(shape, value)], dim=1)

    def local(self, t: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """The tokens ``rank`` holds of an already padded global ``[B, padded_len, ...]`` tensor (contiguous)."""
        return t.index_select(1, self.token_indices(rank).to(t.device))

    def restore_order(self, gathered: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """A tensor gathered over the CP group (``padded_len`` slots along ``dim``) in token order, unpadded."""
        order = self.gathered_order()[: self.seq_len]
        return gathered.index_select(dim, order.to(gathered.device))

    def unpad(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Drop the padding from a ``padded_len`` dimension in token order."""
        return t.narrow(dim, 0, self.seq_len)

    # -- masks -----------------------------------------------------------------------------------------
    def attention_docs(self, documents: bool) -> torch.Tensor:
        """``[B, padded_len]`` document ids for the attention: the plan's, or all zeros without ``documents``."""
        return self.doc_ids if documents else torch.zeros_like(self.doc_ids)

    def mask(self, *, documents: bool, window: int | None = None, rank: int | None = None) -> torch.Tensor:
        """Boolean ``[B, 1, c, padded_len]`` mask of ``rank``'s local queries against all keys in token order.

        ``documents`` adds the same-document condition (transformers' packed-document mask); ``window`` a
        sliding window of that many tokens. Cached on the plan per ``(documents, window, rank)``.
        """
        r = self.cp_rank if rank is None else rank
        key = ("mask", documents, window, r)
        if key not in self._cache:
            keys = torch.arange(self.padded_len, device=self.doc_ids.device)
            self._cache[key] = visible_mask(self.token_indices(r), keys, self.attention_docs(documents), window)
        return self._cache[key]

    def local_rule_mask(self, *, documents: bool, window: int | None = None, rows: slice = slice(None)) -> torch.Tensor:
        """The ``[B, 1, c, c]`` mask a transformers model builds on this rank's local inputs (``rows``: only
        those local query rows, ``[B, 1, len(rows), c]``).

        The model sees the local tokens as a sequence ``0..c-1`` with this rank's global ``position_ids``: causal
        in local order, a new document wherever the position ids do not step by +1 (between this rank's runs of
        tokens as well), the window counted in local indices. With the contiguous layout this is the diagonal
        block of :meth:`mask`. The first call of every rewritten site compares the model's mask with it.
        """
        idx = torch.arange(self.chunk_len, device=self.doc_ids.device)
        docs = document_ids(self.local(self.position_ids)) if documents else torch.zeros_like(self.doc_ids[:, idx])
        return visible_mask(idx[rows], idx, docs, window)

    def local_global_mask(
        self, *, documents: bool, window: int | None = None, rows: slice = slice(None)
    ) -> torch.Tensor:
        """The ``[B, 1, len(rows), c]`` block of :meth:`mask` among this rank's own tokens: the mask a model builds
        on its local inputs from per-token document ids or per-document positions (a document starts where the
        position is 0), which keep a document whole across this rank's runs of tokens. Equal to
        :meth:`local_rule_mask` with the contiguous layout (one run)."""
        idx = self.token_indices()
        return visible_mask(idx[rows], idx, self.attention_docs(documents), window)

    def local_first_visible(
        self, *, documents: bool, window: int | None = None, whole_sequence: bool = False, rank: int | None = None
    ):
        """``[B, c]``: the local index of the first key visible to every local query of ``rank`` (this rank by
        default), under :meth:`local_rule_mask` (or, with ``whole_sequence``, :meth:`local_global_mask`).

        Both masks are intervals in local order: query ``i`` sees exactly the local keys ``[first, i]`` (documents
        are contiguous, and the rank's tokens are in ascending global order). The interval form of those masks
        (:func:`cpcompile.mask.first_visible`), O(B * c) memory: what the per-step mask check compares with.
        """
        if not whole_sequence:
            idx = torch.arange(self.chunk_len, device=self.doc_ids.device)
            if documents:
                docs = document_ids(self.local(self.position_ids, rank))
            else:
                docs = torch.zeros_like(self.doc_ids[:, idx])
            return first_visible(docs, idx, window)
        g = self.token_indices(rank)
        lo = first_visible(self.attention_docs(documents), g, window)  # global index of the first visible key
        return torch.searchsorted(g, lo.contiguous())

    def documents_in_blocks(self, window: int | None) -> str:
        """What the per-step mask check, which sees each rank's own block of the mask, can see of the same-document
        condition on this batch (the same on every rank).

        ``"shown"`` when a mask that passes the check with the condition is told apart from the same mask without
        it: for either rule the check accepts (:meth:`local_rule_mask`, and with several runs
        :meth:`local_global_mask`), that rule without documents fails the check on some rank. ``"hidden"`` when
        not, although the condition changes the keys a real query sees in the whole sequence (documents that end
        at chunk edges: only keys of other ranks tell the two apart); ``"irrelevant"`` when it changes none.
        Interval forms only (:meth:`local_first_visible`) for every rank: O(B * T), cached on the plan.
        """
        key = ("documents_in_blocks", window)
        if key not in self._cache:
            self._cache[key] = self._documents_in_blocks(window)
        return self._cache[key]

    def _documents_in_blocks(self, window: int | None) -> str:
        def first(rank: int, documents: bool, whole: bool) -> torch.Tensor:
            return self.local_first_visible(documents=documents, window=window, whole_sequence=whole, rank=rank)

        def passes(rank: int, mask: torch.Tensor) -> bool:
            if torch.equal(mask, first(rank, True, False)):
                return True
            return self.runs(rank) > 1 and torch.equal(mask, first(rank, True, True))

        ranks = range(self.cp_size)
        if all(any(not passes(r, first(r, False, whole)) for r in ranks) for whole in (False, True)):
            return "shown"
        q = self.indices.reshape(-1)
        q = q[q < self.seq_len]
        with_docs = first_visible(self.doc_ids, q, window)
        without = first_visible(torch.zeros_like(self.doc_ids), q, window)
        return "irrelevant" if torch.equal(with_docs, without) else "hidden"

    def runs(self, rank: int | None = None) -> int:
        """Number of runs of consecutive tokens ``rank`` (this rank by default) holds (1 with the contiguous
        layout)."""
        return int((torch.diff(self.token_indices(rank)) != 1).sum()) + 1

    def visible_blocks(
        self, block_q: int, block_k: int, *, documents: bool = True, window: int | None = None, rank: int | None = None
    ) -> VisibleBlocks:
        """The (query block, key block) pairs of ``rank``'s attention over all keys that are not fully masked.

        Same visibility as :meth:`mask`, at block granularity; no ``[c, padded_len]`` mask is built.
        """
        keys = torch.arange(self.padded_len, device=self.doc_ids.device)
        return visible_blocks(self.attention_docs(documents), self.token_indices(rank), keys, block_q, block_k, window)

    def visible_pairs(self, *, documents: bool = True, window: int | None = None, rank: int | None = None) -> int:
        """Number of visible (query, key) pairs of ``rank``'s queries, summed over the batch, in O(c) memory."""
        q = self.token_indices(rank)
        return int((q + 1 - first_visible(self.attention_docs(documents), q, window)).sum())

    def work(self, workload: Workload, rank: int | None = None) -> int:
        """The (query, key) pairs ``rank``'s block kernel computes for ``workload``: the pairs of its not fully
        masked blocks (:meth:`visible_blocks`) at the workload's block size, summed over its attention forms,
        each times its number of layers. What the ``"balanced"`` layout evens out."""
        bs = workload.block_size
        return sum(
            f.layers * self.visible_blocks(bs, bs, documents=f.documents, window=f.window, rank=rank).computed_pairs()
            for f in workload.forms
        )

    def needs(self, window: int | None, *, documents: bool = True, row: int | None = None) -> torch.Tensor:
        """Bool ``[N, T_pad]``: rank ``r``'s queries see key ``j`` and another rank holds it (in batch row ``row``,
        or in any row: one layout serves every row, so an exchange covers the union of the rows' needs).

        :func:`cpcompile.mask.needed_keys` on this plan's layout, cached per ``(window, documents, row)``."""
        if window is not None and window < 1:
            raise ValueError(f"window must be a positive number of tokens or None, got {window}")
        key = ("needs", window, documents, row)
        if key not in self._cache:
            docs = self.attention_docs(documents)
            self._cache[key] = needed_keys(self.indices, docs if row is None else docs[row : row + 1], window)
        return self._cache[key]

    def keys_needed(
        self, window: int | None, rank: int | None = None, row: int | None = None, *, documents: bool = True
    ) -> torch.Tensor:
        """The global indices, ascending, of the keys other ranks hold that some query of ``rank`` sees (causal,
        same document unless ``documents=False``, within ``window`` tokens; ``None``: no window) in batch row
        ``row``, or in any row.

        For a run of tokens ``[a, b)`` of the rank these are ``[max(start of a's document, a - window + 1), a)``
        less the rank's own tokens: at most ``window - 1`` per run (:meth:`needs`).
        """
        r = self.cp_rank if rank is None else rank
        return torch.nonzero(self.needs(window, documents=documents, row=row)[r]).flatten()

    def key_sources(
        self, window: int | None = None, rank: int | None = None, *, documents: bool = True
    ) -> list[tuple[int, int, int]]:
        """``(source rank, start, end)`` for every run ``[start, end)`` of consecutive keys that some query of
        ``rank`` sees in some row and rank ``source`` holds: :meth:`keys_needed` grouped by owner, in token order."""
        keys = self.keys_needed(window, rank, documents=documents)
        if keys.numel() == 0:
            return []
        owner = self._owner()[keys]
        cut = (torch.diff(keys) != 1) | (torch.diff(owner) != 0)
        starts = [0, *(torch.nonzero(cut).flatten() + 1).tolist()]
        ends = [*starts[1:], keys.numel()]
        k, o = keys.tolist(), owner.tolist()
        return [(o[a], k[a], k[b - 1] + 1) for a, b in zip(starts, ends)]

    def _owner(self) -> torch.Tensor:
        """``[T_pad]``: the rank that holds every global index."""
        owner = torch.empty(self.padded_len, dtype=torch.long, device=self.indices.device)
        owner[self.gathered_indices()] = torch.arange(self.cp_size, device=owner.device).repeat_interleave(
            self.chunk_len
        )
        return owner

    def halo_needs(self, window: int, rank: int | None = None, *, documents: bool = True) -> torch.Tensor:
        """The keys the halo of ``rank`` receives under a sliding ``window``: :meth:`keys_needed` in any row (one
        layout serves every row of the batch, so the halo covers the union of the rows' needs)."""
        if window is None or window < 1:
            raise ValueError(f"window must be a positive number of tokens, got {window}")
        return self.keys_needed(window, rank, documents=documents)

    def exchange_needs(self, window: int | None, rank: int | None = None, *, documents: bool = True) -> torch.Tensor:
        """The keys an exchange of ``rank`` receives: the halo under a sliding ``window``, else (full attention,
        the selective exchange) every key its queries see on other ranks; :meth:`keys_needed` in any row."""
        if window is not None:
            return self.halo_needs(window, rank, documents=documents)
        return self.keys_needed(None, rank, documents=documents)

    def halo_routing(self, window: int | None, slots: int, *, documents: bool = True) -> HaloRouting:
        """This rank's :class:`HaloRouting` for a sliding ``window`` (``None``: full attention, the selective
        exchange) with ``slots`` key slots per rank; ``documents``: the site's same-document condition.

        Every rank computes every rank's needs from the plan alone (the same on every rank), so the exchange
        needs no prior communication. Cached on the plan. ``ValueError`` when a rank needs more than ``slots`` keys.
        """
        key = ("halo", window, slots, documents)
        if key not in self._cache:
            self._cache[key] = self._halo_routing(window, slots, documents)
        return self._cache[key]

    def _halo_routing(self, window: int | None, slots: int, documents: bool) -> HaloRouting:
        what = f"halo keys for a window of {window} tokens" if window is not None else "keys of other ranks"
        fix = "" if window is not None else SELECTIVE_SLOTS_FIX
        needs = [self.exchange_needs(window, dst, documents=documents) for dst in range(self.cp_size)]
        return self.routing(needs, slots, what=what, fix=fix)

    def region_halo(self, halo: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(order [c + slots], keep [c])`` of this rank for a causal region whose output tokens read at most
        ``halo`` tokens before them (:func:`cpcompile.passes.mixing.regions.rewrite_region`).

        The region runs on ``buffer.index_select(dim, order)``, where ``buffer`` is this rank's ``c`` tokens, then
        the ``slots`` halo slots of :meth:`halo_routing` for a window of ``halo + 1`` tokens without documents
        (the ``halo`` tokens before each run, those other ranks hold), then one zero: for every run in order, the
        ``halo`` global indices before it (its own tokens where the rank holds them, the zero before global index
        0), then the run; unused places at the end read the zero. ``keep``: where this rank's tokens sit in that
        order, ascending. ``ValueError`` when the rank has more runs than ``slots`` holds halos. Cached."""
        key = ("region_halo", halo, slots)
        if key not in self._cache:
            self._cache[key] = self._region_halo(halo, slots)
        return self._cache[key]

    def _region_halo(self, halo: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        routing = self.halo_routing(halo + 1, slots, documents=False)
        c, device = self.chunk_len, self.indices.device
        idx = self.token_indices()
        starts = torch.cat([torch.ones(1, dtype=torch.bool, device=device), torch.diff(idx) != 1])
        run = torch.cumsum(starts.long(), 0) - 1  # the run of every local token
        if (int(run[-1]) + 1) * halo > slots:
            raise ValueError(f"{int(run[-1]) + 1} runs of tokens need halos of {halo} tokens in {slots} slots")
        zero = c + slots
        source = torch.full((self.padded_len,), -1, dtype=torch.long, device=device)  # global index -> buffer
        got = routing.recv_pos >= 0
        source[routing.recv_pos[got]] = c + torch.nonzero(got).flatten()
        source[idx] = torch.arange(c, device=device)
        before = idx[starts][:, None] - halo + torch.arange(halo, device=device)  # [runs, halo] global indices
        halo_src = torch.where(before >= 0, source[before.clamp(min=0)], zero)
        if bool((halo_src < 0).any()):
            raise RuntimeError(f"halo of {halo} tokens: the routing misses {before[halo_src < 0].tolist()}")
        keep = torch.arange(c, device=device) + (run + 1) * halo
        order = torch.full((c + slots,), zero, dtype=torch.long, device=device)
        order[keep] = torch.arange(c, device=device)
        order[(keep[starts][:, None] - halo + torch.arange(halo, device=device)).flatten()] = halo_src.flatten()
        return order, keep

    def routing(self, needs: Sequence[torch.Tensor], slots: int, *, what: str, fix: str = "") -> HaloRouting:
        """This rank's :class:`HaloRouting` when rank ``dst`` receives the keys at the global indices ``needs[dst]``
        (ascending, held by other ranks) into ``slots`` key slots. ``needs`` must be the same on every rank (every
        rank's needs): ``ValueError``, naming the rank, ``what`` it needs and ``fix``, when one exceeds ``slots``."""
        N, r = self.cp_size, self.cp_rank
        device = self.indices.device
        owner = self._owner()
        slot = torch.empty(self.padded_len, dtype=torch.long, device=device)
        slot[self.gathered_indices()] = torch.arange(self.chunk_len, device=device).repeat(N)
        counts = torch.zeros(2, N, dtype=torch.long, device=device)
        send = []
        for dst, need in enumerate(needs):
            if need.numel() > slots:
                raise ValueError(f"rank {dst} needs {need.numel()} {what} but the exchange has {slots} key slots{fix}")
            if dst == r:
                recv = need[torch.argsort(owner[need], stable=True)]  # grouped by sending rank
                counts[1] = torch.bincount(owner[need], minlength=N)
            mine = need[owner[need] == r]
            counts[0, dst] = mine.numel()
            send.append(slot[mine])
        recv_pos = torch.full((slots,), -1, dtype=torch.long, device=device)
        recv_pos[: recv.numel()] = recv
        send_slots = torch.zeros(N * slots, dtype=torch.long, device=device)
        flat = torch.cat(send)
        send_slots[: flat.numel()] = flat
        return HaloRouting(recv_pos, send_slots, counts)

    def labels_shifted(self, labels: torch.Tensor) -> torch.Tensor:
        """Shift ``[B, T]`` labels left by one over the whole row (transformers' convention), then pad.

        ``shifted[:, t] = labels[:, t + 1]``; the last real token and all padding get ``IGNORE_INDEX``.
        """
        shifted = torch.full_like(labels, IGNORE_INDEX)
        shifted[:, :-1] = labels[:, 1:]
        return self.pad(shifted, IGNORE_INDEX)


def _check_batch(batch: Mapping[str, object]) -> tuple[int, int, torch.device]:
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"batch must be a dict of [B, T] tensors, got {type(batch).__name__}; "
            "pass e.g. {'input_ids': ids, 'position_ids': pos, 'labels': labels}"
        )
    if "input_ids" not in batch:
        raise ValueError(
            f"batch has no 'input_ids' (keys: {sorted(batch)}); cpcompile.shard needs the token ids of the "
            "whole global batch under 'input_ids'"
        )
    ids = batch["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"batch['input_ids'] must be a [B, T] tensor, got {shape}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"batch['input_ids'] must hold integer token ids, got dtype {ids.dtype}")
    B, T = ids.shape
    if B == 0 or T == 0:
        raise ValueError(
            f"batch['input_ids'] has shape {tuple(ids.shape)}: an empty batch (B = {B} rows, T = {T} tokens) has "
            "nothing to split across the CP ranks; skip the step on every rank when the data loader yields an "
            "empty batch, or drop empty batches from the data set"
        )
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            continue
        if value.dim() < 2 or value.shape[0] != B or value.shape[1] != T:
            raise ValueError(
                f"batch[{key!r}] has shape {tuple(value.shape)}, expected [B, T, ...] = [{B}, {T}, ...] like "
                "input_ids; every per-token tensor of the batch must have the same batch size and length"
            )
        if value.device != ids.device:
            raise ValueError(
                f"batch[{key!r}] is on {value.device} but input_ids is on {ids.device}; move the whole batch "
                "to one device"
            )
    return B, T, ids.device


def _check_document_starts(pos: torch.Tensor) -> None:
    """Packed documents restart at 0: wherever the positions do not step by +1 (a new document, the rule the
    masks follow), the new position must be 0. The first document of a row may start anywhere (a row that
    continues a document cut by the packer)."""
    step = torch.diff(pos, dim=-1)
    bad = (step != 1) & (pos[:, 1:] != 0)
    if bool(bad.any()):
        b, t = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"batch['position_ids'] row {b} goes from {int(pos[b, t])} to {int(pos[b, t + 1])} at token {t + 1}: "
            "a position that does not step by +1 starts a new packed document (the rule of transformers' "
            "packed-sequence masks, and cpcompile's), and a new document must restart at 0. Pass positions that "
            "count 0, 1, 2, ... within each document (only a row's first document may start above 0)"
        )


def build_plan(
    batch: Mapping[str, torch.Tensor],
    cp_size: int,
    cp_rank: int,
    *,
    layout: str = DEFAULT_LAYOUT,
    workload: Workload | None = None,
    group_name: str = "",
) -> CPPlan:
    """Validate a global batch and build the plan of rank ``cp_rank`` of ``cp_size`` with ``layout``.

    ``workload`` is what the ``"balanced"`` layout balances (default :class:`Workload`: full causal attention
    over packed documents, block 128); the other layouts ignore it. Raises ``ValueError``/``TypeError`` for
    malformed batches (before any collective can run).
    """
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    if not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank!r}")
    check_layout(layout)
    if workload is None:
        workload = Workload()
    elif not isinstance(workload, Workload):
        raise TypeError(f"workload must be a cpcompile.plan.Workload or None, got {type(workload).__name__}")
    B, T, device = _check_batch(batch)
    if T < cp_size:
        raise ValueError(
            f"sequence length {T} is shorter than the CP size {cp_size}: every rank needs at least one token; "
            "use a smaller CP group or a longer (packed) sequence"
        )
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.arange(T, device=device).expand(B, T)
    else:
        if not isinstance(pos, torch.Tensor) or pos.dim() != 2:
            raise ValueError(
                f"batch['position_ids'] must be a [B, T] = [{B}, {T}] tensor, "
                f"got {getattr(pos, 'shape', type(pos).__name__)}"
            )
        if pos.dtype.is_floating_point or pos.dtype == torch.bool:
            raise TypeError(f"batch['position_ids'] must be an integer tensor, got dtype {pos.dtype}")
        if bool((pos < 0).any()):
            raise ValueError(
                f"batch['position_ids'] holds negative values (min {int(pos.min())}); positions count from 0 "
                "and restart at 0 at each packed document"
            )
        _check_document_starts(pos)
    labels = batch.get("labels")
    if labels is not None:
        if labels.dtype.is_floating_point or labels.dtype == torch.bool:
            raise TypeError(f"batch['labels'] must be an integer tensor, got dtype {labels.dtype}")
        if labels.dim() != 2:
            raise ValueError(f"batch['labels'] must be [B, T] = [{B}, {T}], got {tuple(labels.shape)}")
    padded = -(-T // cp_size) * cp_size
    num_pad = padded - T
    pos = pos.to(torch.long)
    if num_pad:
        pad_pos = torch.arange(num_pad, device=device, dtype=torch.long).expand(B, num_pad)
        pos = torch.cat([pos, pad_pos], dim=1)
    pos = pos.contiguous()
    doc_ids = document_ids(pos)
    return CPPlan(
        cp_size=cp_size,
        cp_rank=cp_rank,
        batch_size=B,
        seq_len=T,
        padded_len=padded,
        layout=layout,
        indices=LAYOUTS[layout](padded, cp_size, doc_ids, workload).contiguous(),
        position_ids=pos,
        doc_ids=doc_ids,
        group_name=group_name,
    )
