"""Layouts: which global tokens every CP rank holds (:data:`LAYOUTS`), and the balancer behind ``"balanced"``.

The sequence of every row is padded to ``T_pad``, a multiple of the CP size ``N``; a layout gives rank ``r`` the
``c = T_pad // N`` global indices ``indices[r]`` (ascending), the same for every row, in at most
:data:`MAX_RUNS` runs of consecutive indices:

* ``"contiguous"``: rank ``r`` holds ``[r * c, (r + 1) * c)``;
* ``"head_tail"``: the sequence is cut into ``2N`` pieces and rank ``r`` holds piece ``r`` and piece
  ``2N - 1 - r`` (the classic load-balanced layout for causal attention);
* ``"balanced"`` (:data:`DEFAULT_LAYOUT`): the tokens are placed so that every rank computes the same attention
  work (:class:`Workload`) for this batch's documents (:func:`balance`, below).

The balancer: :func:`balance` (``LAYOUTS["balanced"]`` returns its ``indices``) and :func:`token_work`, the work
model it balances. Layers: :mod:`cpcompile.mask` -> this module -> :mod:`cpcompile.plan`.

**Work.** The block kernel cuts a rank's queries into blocks that never span a run of consecutive indices
nor a multiple of the block size (:func:`cpcompile.plan.query_blocks`), so every query block lies inside one
block-aligned piece of the sequence, and computes its rows against every key block from its earliest
document's start (or window start) to its last query (:meth:`cpcompile.plan.CPPlan.visible_blocks`).
:func:`token_work` gives every token the keys its whole aligned block computes, summed over the batch rows
(all rows share one layout). A rank's computed pairs are at most the sum of its tokens' work, with equality
when its runs start and end on block boundaries, so balancing the sums balances the kernel.

**Layouts tried.** ``balance`` builds candidate layouts, each with at most :data:`MAX_RUNS`
runs per rank and exactly ``c`` tokens per rank, and keeps the one whose slowest rank has the least work:

* ``contiguous`` and ``head_tail`` (1 and 2 runs);
* ``bands``: the *level bands* of the work's excess ``E(x) = work of tokens [0, x) - x * mean work``, i.e. rank
  ``r`` takes the ``c`` tokens of rank ``r*c..(r+1)*c-1`` when all tokens are sorted by ``E``. Between two
  levels of ``E`` every stretch enters and leaves at one of the two levels, so every band's excess adds up to
  (nearly) zero: the work is equal up to one token's work per run end, for any documents. A single document
  gives head/tail bands (2 runs). Each rank gets two runs for every valley of ``E`` its levels cut, one valley
  per long document, so this candidate is kept only when it has at most ``MAX_RUNS`` runs;
* ``atoms{K}``: the sequence cut into ``K`` block-aligned pieces per rank, given out largest first to the rank
  with the least work that still has room (at most ``K`` runs), for ``K = 2..MAX_RUNS``;
* ``halves`` (:func:`_halves`): the sequence read as a circle and halved recursively, each half an arc of
  exactly its ranks' tokens and their share of the work. Every rank ends within a few tokens' work of the mean
  for any documents, in at most ``ceil(log2 N) + 1`` runs: 4 up to N = 8; beyond, cuts that fall where the
  order already jumps keep it at 4 in most batches, and it is kept only where it does, like every candidate.
  Packed mixes with a few long documents among many short ones (log-normal lengths), which ``bands`` balance only
  with more runs and the fixed pieces of ``atoms`` too coarsely, need it.

Candidates are built for every attention form of the :class:`Workload` (full causal, each
window) and for their layer-weighted sum. The objective is the work every layer waits for: the sum over forms
of ``layers x`` the slowest rank's work. Among the candidates within 0.5% of the best, the one with the fewest
runs wins (one document: ``head_tail``; no imbalance to fix: ``contiguous``).

**Keeping documents whole.** With ``Workload(split_keys=True)`` (what a selective K/V exchange wants, which
moves only the keys a rank's queries see on other ranks), the candidates within 5% of the best objective and
4% of perfectly even work (or within 0.5% of the best) are
compared by the keys they split across ranks (:func:`split_keys`: summed over ranks, the keys of other ranks
some local query sees), and the one splitting the fewest wins (then fewest runs). A document that lies whole on
one rank costs no exchange at all. Two more candidates are built for it: ``pairs`` (:func:`_pairs`), a head and
a tail piece per rank like ``head_tail`` but with free cut points, each chosen among those that keep the rank's
work within 1% of the mean as the one splitting the fewest keys; and ``halves+keys``, ``halves`` whose cuts,
among those as balanced, split the fewest keys.

Cost: O(T log T) on the batch's device (sorts of ``T`` keys; ``halves`` O(T) per halving level; with
``split_keys``, O(T) more per candidate), plus one device-to-host copy of the pieces' work (``N * K`` numbers per
form) for the greedy assignment, which runs on the host. Integer arithmetic, so every rank computes the same
layout from the same batch.

Why one module of about 520 lines: the layouts and the balancer are one choice; the balancer builds its
candidates from the other layouts and compares them all by one work model (:func:`token_work`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from cpcompile.mask import document_starts, needed_key_counts

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_LAYOUT",
    "LAYOUTS",
    "MAX_RUNS",
    "AttentionForm",
    "Balance",
    "Workload",
    "balance",
    "check_layout",
    "count_runs",
    "split_keys",
    "token_work",
]

#: The most runs of consecutive global indices one rank holds, in every layout (``contiguous`` 1, ``head_tail``
#: 2, ``balanced`` at most 4). A compile-time bound: the halo exchange of sliding-window layers gives every rank
#: ``MAX_RUNS * (window - 1)`` key slots. Two runs (head and tail) balance one document, but a rank that takes a
#: slice of a long document's expensive tail must fill up with cheap tokens from elsewhere; how often 2, 3, 4 and
#: 6 runs reach an even split is measured in BENCHMARKS.md (``benchmarks/layouts.py --sweep``).
MAX_RUNS = 4

#: The layout :func:`cpcompile.shard`, :func:`cpcompile.plan.build_plan` and ``cpcompile inspect`` use by default.
DEFAULT_LAYOUT = "balanced"
#: Query and key block size of the block attention kernel (``cpcompile.backend(..., block_size=...)``), and the
#: block the balanced layout counts work in, unless told otherwise.
DEFAULT_BLOCK_SIZE = 128


@dataclasses.dataclass(frozen=True)
class AttentionForm:
    """One kind of attention layer of a model, as the ``"balanced"`` layout weighs it."""

    #: Packed documents are kept apart (transformers' bool mask) or plain causal order over the whole row.
    documents: bool = True
    #: Sliding window in tokens, or ``None`` (full causal attention).
    window: int | None = None
    #: Number of layers of this form (each layer waits for its slowest rank).
    layers: int = 1

    def __post_init__(self) -> None:
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"AttentionForm window={self.window!r} must be a positive int or None")
        if not isinstance(self.layers, int) or self.layers < 1:
            raise ValueError(f"AttentionForm layers={self.layers!r} must be a positive int")


@dataclasses.dataclass(frozen=True)
class Workload:
    """The attention work the ``"balanced"`` layout evens out across ranks.

    Work is what the block kernel computes: (query, key) pairs of the not fully masked blocks
    (:meth:`CPPlan.visible_blocks`), for every form of attention layer, weighted by its number of layers.
    """

    #: The model's attention forms (default: one full-causal, packed-document form).
    forms: tuple[AttentionForm, ...] = (AttentionForm(),)
    #: Query and key block size of the block kernel (``cpcompile.backend(..., block_size=...)``).
    block_size: int = DEFAULT_BLOCK_SIZE
    #: Keep documents whole: among the candidates within :data:`SPLIT_TOLERANCE` (5%) of the best objective and
    #: :data:`EVEN_TOLERANCE` (4%) of perfectly even work (or within :data:`TOLERANCE` of the best),
    #: choose the one whose ranks need the fewest keys of other ranks (:func:`split_keys`, the keys a selective
    #: exchange moves for full-attention layers). ``False`` (default): fewest runs within :data:`TOLERANCE`,
    #: which is what an all-gather, moving every key anyway, wants.
    split_keys: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.split_keys, bool):
            raise TypeError(f"Workload split_keys={self.split_keys!r} must be a bool")
        if not self.forms or not all(isinstance(f, AttentionForm) for f in self.forms):
            raise ValueError(f"Workload forms must be a non-empty tuple of AttentionForm, got {self.forms!r}")
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size < 1:
            raise ValueError(f"Workload block_size={self.block_size!r} must be a positive int (e.g. 128)")


def _contiguous(padded_len: int, cp_size: int, doc_ids: torch.Tensor, workload: Workload) -> torch.Tensor:
    return torch.arange(padded_len, device=doc_ids.device).view(cp_size, -1)


def _head_tail(padded_len: int, cp_size: int, doc_ids: torch.Tensor, workload: Workload) -> torch.Tensor:
    c = padded_len // cp_size
    head = c // 2  # tokens of each rank's first piece; the second piece has c - head
    r = torch.arange(cp_size, device=doc_ids.device)[:, None]
    first = r * head + torch.arange(head, device=doc_ids.device)
    tail_start = padded_len - (r + 1) * (c - head)
    second = tail_start + torch.arange(c - head, device=doc_ids.device)
    return torch.cat([first, second], dim=1)


def _balanced(padded_len: int, cp_size: int, doc_ids: torch.Tensor, workload: Workload) -> torch.Tensor:
    return balance(padded_len, cp_size, doc_ids, workload).indices


#: Layout name -> ``fn(padded_len, cp_size, doc_ids [B, T_pad], workload) -> [N, c]`` global indices, ascending
#: per rank, every rank in at most :data:`MAX_RUNS` runs of consecutive indices.
LAYOUTS: dict[str, Callable[[int, int, torch.Tensor, Workload], torch.Tensor]] = {
    "contiguous": _contiguous,
    "head_tail": _head_tail,
    "balanced": _balanced,
}


def check_layout(layout: object) -> None:
    """``ValueError`` naming ``layout`` and the choices unless it is a key of :data:`LAYOUTS`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not a known layout; choose one of {sorted(LAYOUTS)}")


def count_runs(indices: torch.Tensor) -> torch.Tensor:
    """``[N]``: the number of runs of consecutive global indices of every rank of ``[N, c]`` ascending indices."""
    return 1 + (torch.diff(indices, dim=-1) != 1).sum(-1)


#: A candidate with fewer runs is preferred when its objective is within this factor of the best (0.5%).
TOLERANCE = (1000, 1005)
#: With ``Workload(split_keys=True)``: a candidate that splits fewer keys across ranks is preferred when its
#: objective is within this factor of the best (5%) and within :data:`EVEN_TOLERANCE` of a perfectly even
#: layout's, or within :data:`TOLERANCE` of the best.
SPLIT_TOLERANCE = (100, 105)
#: The most a layout that keeps documents whole may cost over perfectly even work (4%), when a candidate that
#: close exists: its slowest rank stays within the 1.05 x mean the balanced layout aims for.
EVEN_TOLERANCE = (100, 104)


def split_keys(indices: torch.Tensor, doc_ids: torch.Tensor, workload: Workload) -> torch.Tensor:
    """``[M]`` int64: for each of ``[M, N, c]`` layouts, the keys summed over ranks that a rank's queries see and
    another rank holds, in some row (:func:`cpcompile.mask.needed_key_counts`), for the workload's full-attention
    layers (packed documents kept apart unless none of its full-attention forms does; all forms windowed: the
    first form's window)."""
    full = [f for f in workload.forms if f.window is None] or [workload.forms[0]]
    form = max(full, key=lambda f: (not f.documents, f.layers))  # the form that needs the most keys
    docs = doc_ids if form.documents else torch.zeros_like(doc_ids)
    return needed_key_counts(indices, docs, form.window).sum(-1)


def token_work(doc_ids: torch.Tensor, block_q: int, block_k: int, window: int | None = None) -> torch.Tensor:
    """``[T]`` int64: every token's (query, key) pairs as the block kernel computes them, summed over rows.

    Token ``t`` in the aligned query block ``[j*block_q, (j+1)*block_q)`` gets the keys that block computes:
    from the key block holding the start of its first token's document (or window) to the key block holding
    its last token. ``doc_ids`` ``[B, T]`` as in :class:`~cpcompile.plan.CPPlan` (all zeros: plain causal).
    """
    B, T = doc_ids.shape
    device = doc_ids.device
    first = torch.arange(0, T, block_q, device=device)
    last = (first + block_q).clamp(max=T) - 1
    lo = document_starts(doc_ids)[:, first]
    if window is not None:
        lo = torch.maximum(lo, first - window + 1)
    end = ((last + block_k) // block_k * block_k).clamp(max=T)
    keys = (end - lo // block_k * block_k).sum(0)  # [num blocks]
    return keys.repeat_interleave(block_q, output_size=first.numel() * block_q)[:T]


@dataclasses.dataclass(frozen=True)
class Balance:
    """What :func:`balance` tried and chose (tensors on the batch's device; reading them synchronises)."""

    #: ``[N, c]`` the chosen layout: global indices per rank, ascending.
    indices: torch.Tensor
    #: Names of the candidate layouts, e.g. ``"bands[doc]"``, ``"atoms4[doc,w512]"``, ``"head_tail"``.
    names: tuple[str, ...]
    #: ``[M, N, c]`` every candidate layout.
    candidates: torch.Tensor
    #: ``[M]`` int64: sum over the workload's forms of ``layers x`` the slowest rank's work.
    objective: torch.Tensor
    #: ``[M]``: the most runs one rank holds in each candidate.
    runs: torch.Tensor
    #: ``[M]`` int64: :func:`split_keys` of every candidate, with ``Workload(split_keys=True)``; else ``None``.
    split: torch.Tensor | None
    #: Index of the chosen candidate (0-dim tensor).
    choice: torch.Tensor

    @property
    def chosen(self) -> str:
        """Name of the chosen candidate."""
        return self.names[int(self.choice)]


def balance(padded_len: int, cp_size: int, doc_ids: torch.Tensor, workload: Workload) -> Balance:
    """The layout of ``padded_len`` tokens over ``cp_size`` ranks that evens out ``workload`` (module docstring).

    ``doc_ids`` ``[B, padded_len]``: the plan's document ids. Every rank gets ``padded_len // cp_size`` tokens
    in at most :data:`MAX_RUNS` runs.
    """
    T, N, device = padded_len, cp_size, doc_ids.device
    forms = workload.forms
    works = torch.stack([_form_work(doc_ids, workload.block_size, f) for f in forms])  # [F, T]
    weights = torch.tensor([f.layers for f in forms], device=device)
    vectors = [(_form_name(f), works[i]) for i, f in enumerate(forms)]
    if len(forms) > 1:
        vectors.append(("sum", (weights[:, None] * works).sum(0)))
    names = ["contiguous", "head_tail"]
    candidates = [LAYOUTS[n](T, N, doc_ids, workload) for n in names]
    if N > 1:
        for vname, work in vectors:
            level = _excess(work)
            names += [f"bands[{vname}]", f"segments[{vname}]"]
            candidates += [_bands(level, N), _segment_bands(level, N)]
        atoms_names, atoms = _atoms(T, N, workload.block_size, vectors)
        names += atoms_names
        candidates += atoms
        names += [f"halves[{vname}]" for vname, _ in vectors]
        candidates += [_halves(work, N) for _, work in vectors]
    plain = len(candidates)  # what the default workload builds; the ones below aim at fewer split keys
    if N > 1 and workload.split_keys:
        cut_cost = _cut_cost(doc_ids)
        names += [f"pairs[{vname}]" for vname, _ in vectors]
        candidates += [_pairs(work, N, cut_cost) for _, work in vectors]
        names += [f"halves+keys[{vname}]" for vname, _ in vectors]
        candidates += [_halves(work, N, cut_cost) for _, work in vectors]
    stack = torch.stack(candidates)  # [M, N, c]
    loads = works[:, stack].sum(-1)  # [F, M, N]
    objective = (weights[:, None] * loads.amax(-1)).sum(0)  # [M]
    runs = count_runs(stack).amax(-1)
    split = split_keys(stack, doc_ids, workload) if workload.split_keys else None
    even = (weights * works.sum(-1)).sum()  # N x the objective of perfectly even work
    choice = _choose(objective, runs, split, (even, N), plain)
    return Balance(stack.index_select(0, choice.view(1))[0], tuple(names), stack, objective, runs, split, choice)


def _form_name(form: AttentionForm) -> str:
    return ("doc" if form.documents else "causal") + ("" if form.window is None else f",w{form.window}")


def _form_work(doc_ids: torch.Tensor, block: int, form: AttentionForm) -> torch.Tensor:
    docs = doc_ids if form.documents else torch.zeros_like(doc_ids)
    return token_work(docs, block, block, form.window)


def _choose(
    objective: torch.Tensor,
    runs: torch.Tensor,
    split: torch.Tensor | None,
    even: tuple[torch.Tensor, int],
    plain: int,
) -> torch.Tensor:
    """Fewest runs among the candidates within :data:`TOLERANCE` of the best objective; first on ties. With
    ``split`` (keys split across ranks per candidate): fewest split keys among those and the ones within both
    :data:`SPLIT_TOLERANCE` of the best and :data:`EVEN_TOLERANCE` of perfectly even work (``even``: ``N`` x its
    objective, and ``N``), then fewest runs, then first. The best is that of the first ``plain`` candidates
    (those built without ``split_keys``), so that the layout chosen without it stays among the choices and
    keeping documents whole never splits more keys."""
    big = torch.iinfo(torch.int64).max
    valid = runs <= MAX_RUNS
    best = torch.where(valid, objective, big)[:plain].min()
    num, den = TOLERANCE
    near = objective * num <= best * den
    if split is not None:
        (snum, sden), (enum, eden), (total, N) = SPLIT_TOLERANCE, EVEN_TOLERANCE, even
        near |= (objective * snum <= best * sden) & (objective * N * enum <= total * eden)
    near &= valid
    M = objective.numel()
    order = torch.arange(M, device=objective.device)
    rank = runs * M + order
    if split is not None:
        rank = rank + split * (MAX_RUNS + 1) * M
    return torch.where(near, rank, big).argmin()


def _excess(work: torch.Tensor) -> torch.Tensor:
    """``[T]`` float64: the excess ``E`` in the middle of every token (``E(x)`` = work of ``[0, x)`` - x * mean)."""
    T = work.shape[0]
    after = torch.cumsum(work, 0)  # work of tokens [0, t]
    mean = after[-1].double() / T
    pos = torch.arange(T, device=work.device, dtype=torch.float64)
    return (after - work + after).double() / 2 - mean * (pos + 0.5)


def _bands(level: torch.Tensor, N: int) -> torch.Tensor:
    """``[N, c]``: rank ``r`` takes the tokens of ranks ``r*c..(r+1)*c-1`` in the order of their excess."""
    return torch.argsort(level, stable=True).view(N, -1).sort(dim=1).values


def _segment_bands(level: torch.Tensor, N: int) -> torch.Tensor:
    """``[N, c]``: bands inside the stretches between zero crossings of the excess, stretch after stretch.

    The excess is zero where a stretch starts and ends, so each stretch's own bands have (nearly) zero
    excess, and a rank at the seam of two stretches takes a band of each. Stretches are ordered along the
    sequence; inside one, tokens go by distance from zero, deepest first in even stretches and last in odd
    ones, so that at every seam the two bands meet: deep meets deep (one run each), edges meet edges (the
    edges at the seam merge into one run).
    """
    negative = level < 0
    stretch = torch.cumsum(torch.cat([negative[:1], negative[1:] != negative[:-1]]).long(), 0)
    depth = level.abs()
    oriented = torch.where(stretch % 2 == 0, -depth, depth)
    by_depth = torch.argsort(oriented, stable=True)
    order = by_depth[torch.argsort(stretch[by_depth], stable=True)]
    return order.view(N, -1).sort(dim=1).values


@dataclasses.dataclass(frozen=True)
class _Grid:
    """``N * K`` block-aligned pieces: ``N * (K - 1)`` of ``size`` tokens, then ``N`` of ``last`` tokens."""

    starts: list[int]
    lens: list[int]
    #: Piece class (0: ``size`` tokens, 1: ``last`` tokens) and how many pieces of each class a rank takes.
    classes: list[int]
    caps: tuple[int, int]


def _grid(T: int, N: int, K: int, block: int) -> _Grid:
    c = T // N
    K = min(K, c)
    size = c // K
    if size >= block:
        size = size // block * block
    last = c - (K - 1) * size
    lens = [size] * (N * (K - 1)) + [last] * N
    starts = [sum(lens[:i]) for i in range(len(lens))]
    if last == size:
        return _Grid(starts, lens, [0] * len(lens), (K, 0))
    return _Grid(starts, lens, [0] * (N * (K - 1)) + [1] * N, (K - 1, 1))


def _atoms(T: int, N: int, block: int, vectors: list[tuple[str, torch.Tensor]]):
    """``atoms{K}`` candidates for every work vector: greedy largest-first assignment of grid pieces."""
    device = vectors[0][1].device
    grids = {K: _grid(T, N, K, block) for K in range(2, MAX_RUNS + 1)}
    bounds = torch.tensor([s for g in grids.values() for s in (*g.starts, T)], device=device)
    work = torch.stack([w for _, w in vectors])  # [V, T]
    prefix = torch.nn.functional.pad(torch.cumsum(work, 1), (1, 0))  # [V, T + 1]
    edges = prefix[:, bounds]  # [V, sum over grids of (pieces + 1)]
    values = edges.tolist()  # the one device-to-host copy of the balancer
    names, layouts, owners = [], [], []
    for v, (vname, _) in enumerate(vectors):
        offset = 0
        for K, g in grids.items():
            e = values[v][offset : offset + len(g.lens) + 1]
            offset += len(g.lens) + 1
            costs = [e[i + 1] - e[i] for i in range(len(g.lens))]
            names.append(f"atoms{K}[{vname}]")
            owners.append((g, _largest_first(costs, g, N)))
    flat = torch.tensor([o for _, owner in owners for o in owner], device=device)
    offset = 0
    for g, owner in owners:
        piece_owner = flat[offset : offset + len(owner)]
        offset += len(owner)
        lens = torch.tensor(g.lens, device=device)
        token_owner = piece_owner.repeat_interleave(lens, output_size=T)
        layouts.append(torch.argsort(token_owner, stable=True).view(N, -1))
    return names, layouts


def _cut_cost(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[T + 1]`` int64: the keys a cut before global index ``p`` splits off (``p`` less the start of its
    document, earliest over the rows; 0 at a document start and at both ends)."""
    T = doc_ids.shape[1]
    starts = document_starts(doc_ids).amin(0)
    pos = torch.arange(T, device=doc_ids.device)
    return torch.cat([pos - starts, pos.new_zeros(1)])


def _pairs(work: torch.Tensor, N: int, cut_cost: torch.Tensor) -> torch.Tensor:
    """``[N, c]``: every rank a head piece and a tail piece (head_tail with free cuts) whose cuts avoid documents.

    Rank ``r`` holds ``[x_r, x_(r+1))`` and ``[x_(r+1) + T - (r+1) c, x_r + T - r c)``: ``c`` tokens for any
    ``x_0 = 0 <= x_1 <= ... `` with ``x_(r+1) - x_r <= c`` (the last rank one run ``[x_(N-1), x_(N-1) + c)``).
    Rank by rank, ``x_(r+1)`` is chosen among the positions where the rank's work is within 1% of the remaining
    work's mean as the one whose two cuts split the fewest keys (:func:`_cut_cost`), else as the one whose work
    is nearest that mean. At most 2 runs per rank; one device-to-host copy per rank.
    """
    T = work.shape[0]
    c = T // N
    device = work.device
    prefix = torch.nn.functional.pad(torch.cumsum(work, 0), (1, 0))  # [T + 1]
    owner = torch.full((T,), -1, dtype=torch.long, device=device)
    x, remaining = 0, int(prefix[-1])
    for r in range(N - 1):
        xs = torch.arange(x, x + c + 1, device=device)  # the next cut x_(r+1)
        ys = xs + T - (r + 1) * c  # the tail's start
        end = x + T - r * c  # the tail's end
        load = prefix[xs] - prefix[x] + prefix[end] - prefix[ys]
        target = remaining / (N - r)
        near = (load - target).abs() * 100 <= target
        cost = cut_cost[xs] + cut_cost[ys]
        miss = (load - target).abs().double()
        key = torch.where(near, cost.double(), float("inf"))
        pick = int(key.argmin()) if bool(near.any()) else int(miss.argmin())
        nxt = x + pick
        owner[x:nxt] = r
        owner[nxt + T - (r + 1) * c : end] = r
        remaining -= int(load[pick])
        x = nxt
    owner[x : x + c] = N - 1
    return torch.argsort(owner, stable=True).view(N, -1)


#: ``halves``: a cut is chosen among those within this factor of the best reachable work split (0.2%).
HALVES_TOLERANCE = (1000, 1002)


def _halves(work: torch.Tensor, N: int, cut_cost: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, c]``: recursive halving of the sequence read as a circle, each half an arc of exactly its tokens.

    A group of ``n`` ranks holds ``n * c`` tokens in a circular order (at first the sequence, its end joined to
    its start). It is cut into an arc of ``n // 2 * c`` consecutive tokens of that order for the first
    ``n // 2`` ranks and the rest of the circle for the others, each again a circle. An arc of that length whose
    work is ``n // 2 / n`` of the group's exists up to one token's work (sliding it by one token changes its
    work by at most one token's, and its mean over all starts is exactly that share), so every rank ends
    within a few tokens' work of the mean, for any documents. Among the starts within
    :data:`HALVES_TOLERANCE` of the best split, the one whose two cuts fall on the most *seams* (places where
    the circle's order jumps in the sequence) wins, then, with ``cut_cost`` (:func:`_cut_cost`), the one that
    splits the fewest keys. An arc holding ``j`` seams is ``j + 1`` runs and a circle of ``j + 1`` seams, so
    ``ceil(log2 N)`` halvings leave at most that plus one run per rank: 2 runs at N=2, 3 at N<=4, 4 at
    N<=8. No device-to-host copy: the cuts stay on the device.
    """
    T = work.shape[0]
    c = T // N
    device = work.device
    num, den = HALVES_TOLERANCE
    big = torch.iinfo(torch.int64).max
    groups, leaves = [(torch.arange(T, device=device), N)], []
    while groups:
        order, n = groups.pop()
        if n == 1:
            leaves.append(order)
            continue
        L, n1 = order.numel(), n // 2
        arc_len = n1 * c
        w = work[order]
        prefix = torch.nn.functional.pad(torch.cumsum(torch.cat([w, w]), 0), (1, 0))
        starts = torch.arange(L, device=device)
        ends = (starts + arc_len) % L
        total = prefix[L]
        miss = ((prefix[starts + arc_len] - prefix[starts]) * n - total * n1).abs()  # n x |arc work - share|
        near = miss * num <= miss.min() * num + total * n1 * (den - num)
        seam = order != torch.roll(order, 1) + 1  # a cut before circle position p falls on a seam
        rank = (2 - seam[starts].long() - seam[ends].long()) * (2 * T + 1) ** 2
        if cut_cost is not None:
            rank = rank + (cut_cost[order[starts]] + cut_cost[order[ends]]) * (2 * T + 1)
        rank = rank + starts
        x = torch.where(near, rank, big).argmin()
        arc = (x + torch.arange(L, device=device)) % L
        groups += [(order[arc[:arc_len]], n1), (order[arc[arc_len:]], n - n1)]
    layout = torch.stack(leaves).sort(dim=1).values
    return layout[layout[:, 0].argsort()]  # ranks in the order of their first tokens: one order on every rank


def _largest_first(costs: list[int], grid: _Grid, N: int) -> list[int]:
    """Owner of every piece: largest piece first, to the least loaded rank with room for its class."""
    load = [0] * N
    used = [[0, 0] for _ in range(N)]
    owner = [0] * len(costs)
    for piece in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        k = grid.classes[piece]
        r = min((r for r in range(N) if used[r][k] < grid.caps[k]), key=lambda r: (load[r], r))
        owner[piece] = r
        load[r] += costs[piece]
        used[r][k] += 1
    return owner
