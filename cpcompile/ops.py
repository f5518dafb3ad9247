"""The contract between the pass and the runtime: every op the rewritten graph calls, and how it is emitted.

The pass (:mod:`cpcompile.passes.sdpa_cp`) describes every site it rewrites with a frozen :class:`SiteSpec`,
registers it (:func:`register_site`) and inserts the calls below with the ``emit_*`` helpers; at run time the
ops read the active :func:`cpcompile.shard` context through :func:`cpcompile.runtime.context.active_context`.

Ops and graph calls of a site whose keys are all-gathered (``spec.exchange == "all_gather"``)::

    ok = cpcompile::site_check(first_of_k_v.detach(), model_mask | None, site)   # before any exchange
    k_h = all_gather_start(k_src)        # _compat: functional all-gather (autograd: reduce-scatter in backward)
    q_pos, kv_pos, docs = cpcompile::site_plan(k_src.detach(), v_src.detach(), ok, site)
    k_all = all_gather_wait(k_h)         # [B, Hkv, N*c, D], rank-major slots: global indices kv_pos
    # dense path                                      # block path
    mask = visible_mask(q_pos, kv_pos, docs, window)  out = cpcompile::cp_attention(q, k_all, v_all, q_pos,
    out = sdpa(q, k_all, v_all, attn_mask=mask)                               kv_pos, docs, window, ...)[0]

and of a sliding-window site that exchanges only its halo (``spec.exchange == "halo"``), or a full-attention site
that exchanges only the keys its queries see (``spec.exchange == "selective"``, the same ops)::

    q_pos, kv_pos, docs = cpcompile::site_plan(...)          # kv_pos: local indices, then the halo slots'
    send_slots, counts = cpcompile::halo_routing(k_src.detach(), site)
    k_all = cat([k_src, cpcompile::halo_exchange(k_src, send_slots, counts, site)], dim=2)   # [B, Hkv, c+S, D]
    ...                                                      # attention as above

``cpcompile::site_check`` runs what can fail, before the site's exchange is issued: find and check the active plan
(:func:`_site_context`) and hold the site's control rounds: its first call, and the model's own mask against the
plan's local rule on every new batch (:func:`_check_site`). ``cpcompile::site_plan`` counts the site's all-gathers
(:func:`_count_collectives`) and hands out the positions (:func:`_site_positions`). ``cpcompile::cp_attention``
is the block kernel (:mod:`cpcompile.kernels`).

Why the halo is an all-to-all inside an op: which keys a rank needs depends on the batch (the layout, and
where documents start), so the sizes of a functional collective would be data-dependent and recompile or need
unbacked sizes. Inside ``cpcompile::halo_exchange`` the sizes are plain ints from the plan, the bytes sent are
exactly the keys the receiving rank's queries can see, and the graph keeps a static shape: ``S = MAX_RUNS *
(window - 1)`` key slots per rank (empty slots carry index ``-1`` and are never attended). The exchange runs when
attention needs it (it is not overlapped with the work before it, unlike the all-gathers); its backward sends
the gradients of the received keys back to their owners.

The selective exchange (``backend(..., exchange="selective")``) is the same exchange for full-attention sites: ``S =
exchange_slots`` key slots, by default ``(N - 1) * c``, the all-gather's size, which holds every batch's needs, so
the graph's shapes never depend on the documents and a new batch never recompiles. What moves on the wire is only
the needed keys (the all-to-all's counts come from the plan); the unused slots cost memory (zeros, never attended):
the block kernel skips them (their index is ``-1``, sorted before every real key, outside every query block's
interval), the dense path masks them. A smaller ``exchange_slots`` bounds the buffer kept for backward at ``S`` keys
instead of ``(N - 1) * c``; a batch that needs more raises ``ValueError`` on every rank (the plan is the same on
every rank) before anything is sent. The alternative, a receive buffer sized per batch, would make the attention's
key length data-dependent: a recompile per distinct size, or unbacked sizes through the whole attention. The
all-gather stays the default: it starts as soon as K/V exist and overlaps the work before attention; the exchange
runs when attention needs it, and never moves more than the all-gather (a rank's needs are a subset of the other
ranks' keys; one long document under the contiguous layout needs them all on the last rank).

A flex_attention site's selective exchange routes by its ``mask_mod`` instead of the plan's rule
(:func:`flex_routing`: each rank evaluates it for its queries, and the group all-gathers the bitmaps of keys seen),
then moves the keys with the same :func:`halo_exchange`.

``cpcompile::sequence_order`` serves :mod:`cpcompile.passes.mixing`: the permutation that puts a tensor
all-gathered along the sequence into global token order, and this rank's token indices to take its tokens back
(:func:`emit_sequence_gather`).

``cpcompile::token_positions`` serves :mod:`cpcompile.passes.positions`: the global index of every token this
rank holds, for position sources (``arange`` of the local length, tables sliced by it) the model computes itself.

Why one module of about 750 lines: every op sits next to its fake implementation and the ``emit_*`` helper that
inserts it, so what the pass puts in a graph and what runs at run time are read, and changed, together.
"""

from __future__ import annotations

import dataclasses
import operator
import sys
import threading

import torch
import torch.distributed as dist
import torch.fx as fx

from cpcompile import _compat, failsafe
from cpcompile import kernels as _kernels  # noqa: F401 - registers torch.ops.cpcompile.cp_attention
from cpcompile.errors import MaskMismatchError, UnsupportedAttentionError
from cpcompile.mask import visible_mask
from cpcompile.plan import SELECTIVE_SLOTS_FIX, CPPlan
from cpcompile.runtime.context import Active, active_context, is_exact, is_proved_mask

__all__ = [
    "SiteSpec",
    "emit_attention",
    "emit_buffer_gather",
    "emit_exact_input",
    "emit_flex_attention",
    "emit_flex_site_plan",
    "flex_site_plan",
    "emit_gather_start",
    "emit_halo_exchange",
    "emit_sequence_gather",
    "emit_site_check",
    "emit_site_plan",
    "emit_token_positions",
    "exact_input",
    "token_positions",
    "last_of",
    "register_site",
    "site_check",
    "sequence_order",
    "site_spec",
]


@dataclasses.dataclass(frozen=True, slots=True)
class SiteSpec:
    """What the rewritten graph of one SDPA site needs at run time (decided at compile time)."""

    #: Unique id of the site (``backend{b}/graph{g}:<layer> (node <name>)``), the ops' only argument about it.
    site: str
    #: Qualified name of the module that calls the attention (``model.layers.0.self_attn``), for messages.
    layer: str
    #: CP process group (registered name) and size the site was compiled for, and this process's rank in it.
    group_name: str
    cp_size: int
    cp_rank: int
    #: Same-document condition (the model's bool mask has one, or was not analysed: see
    #: :attr:`cpcompile.passes.mask_rules.MaskProof.documents`) or plain global causal order. Every path reads it
    #: here: the step check's local rule, the document ids attention gets, the halo and selective exchange.
    documents: bool
    #: Sliding window in tokens, or ``None``.
    window: int | None
    #: Attention emitted: ``"dense"`` (SDPA under the whole mask), or ``cpcompile::cp_attention`` with its
    #: ``"block"`` loop, ``"flex"`` or ``"flash_varlen"`` (:mod:`cpcompile.kernels`).
    kernel: str
    #: Whether the gathered K/V require grad (each is then reduce-scattered in backward).
    needs_grad: bool
    #: How the site gets the keys of other ranks: ``"all_gather"`` (every rank's K/V), ``"halo"`` (a
    #: sliding-window site: only the keys its queries see, into ``halo_slots`` key slots) or ``"selective"`` (a
    #: full-attention or flex site: the same, into ``halo_slots`` slots, ``0`` meaning ``(N - 1) * c``; a flex
    #: site routes by its mask_mod, :func:`flex_routing`).
    exchange: str = "all_gather"
    halo_slots: int = 0
    #: The same-document condition was assumed, not proved (the model's mask was made outside the compiled graphs:
    #: :attr:`cpcompile.passes.mask_rules.MaskProof.assumed`): the step check must have seen it on a batch before a
    #: batch on which it cannot see it runs (:func:`_hidden_documents`).
    documents_assumed: bool = False


#: The exchanges that move only the keys a rank's queries see (:func:`halo_exchange`).
EXCHANGES_OF_NEEDED_KEYS = ("halo", "selective")


def exchange_slots(spec: SiteSpec, chunk_len):
    """Key slots of the site's exchange of needed keys for a local length ``chunk_len`` (an int, or a SymInt
    in fake tensors): ``spec.halo_slots``, or for a selective site without a bound the all-gather's ``(N - 1) * c``.
    """
    return spec.halo_slots or (spec.cp_size - 1) * chunk_len


#: Query rows of the model's mask compared at a time (bounds the memory of the mask check).
MASK_CHECK_ROWS = 1024

_SITES: dict[str, SiteSpec] = {}
_SITES_LOCK = threading.Lock()
#: Sites that ran their first-call control round (written only by _check_site).
_VERIFIED: set[str] = set()
#: Sites whose assumed document condition the step check saw on some batch (written only by _check_site).
_DOCUMENTS_SEEN: set[str] = set()


def register_site(spec: SiteSpec) -> str:
    """Make ``spec`` known to the ops under ``spec.site`` (the pass calls this before emitting the site)."""
    with _SITES_LOCK:
        known = _SITES.setdefault(spec.site, spec)
    if known != spec:
        raise RuntimeError(f"site id {spec.site!r} is already registered with another description: {known}")
    return spec.site


def site_spec(site: str) -> SiteSpec:
    """The :class:`SiteSpec` registered under ``site``."""
    try:
        return _SITES[site]
    except KeyError:
        raise RuntimeError(
            f"the compiled graph calls a cpcompile site {site!r} that this process never compiled; compile the "
            "model with cpcompile.backend in the process that runs it"
        ) from None


# -- cpcompile::site_check and cpcompile::site_plan --------------------------------------------------------
@torch.library.custom_op("cpcompile::site_check", mutates_args=())
def site_check(like: torch.Tensor, model_mask: torch.Tensor | None, site: str) -> torch.Tensor:
    """The checks of the site ``site``, run before its K/V exchange is issued; returns an empty tensor that the
    site's plan op takes (so the check stays in the graph, ahead of the exchange).

    ``like`` is the first of the site's K and V to be final (detached; only its rows and local length are read).
    The active shard context must be the one the site was compiled for, and the site's control round runs
    (:func:`_check_site`): when ``model_mask`` (the mask the model built on its local inputs) is given, it is
    compared with :meth:`CPPlan.local_rule_mask` on every new batch and :class:`MaskMismatchError` is raised when
    they differ. A check that fails raises on every rank with none of the site's collectives in flight, and a
    peer that failed elsewhere is seen in the round instead of in a collective.
    """
    spec = site_spec(site)
    _check_site(spec, _site_context(spec, like), model_mask)
    return like.new_empty((0,))


@site_check.register_fake
def _(like, model_mask, site):
    return like.new_empty((0,))


@torch.library.custom_op("cpcompile::site_plan", mutates_args=())
def site_plan(
    k: torch.Tensor, v: torch.Tensor, checked: torch.Tensor, site: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q_pos [c], kv_pos [N*c], doc_ids [B, T_pad])`` of the active plan for the site ``site``.

    ``k``/``v`` are the local tensors the site exchanges (detached; only their sizes are read: the local
    length, and the bytes counted in :func:`cpcompile.comm_stats`); ``checked`` is the output of the site's
    :func:`site_check`. ``q_pos`` are this rank's global token indices, ``kv_pos`` the global index of every
    gathered slot, ``doc_ids`` the plan's document ids (all zeros when the site has no document condition).
    """
    spec = site_spec(site)
    context = _site_context(spec, k)
    context.ran.sites += 1
    _count_collectives(context, spec, k, v)
    return _site_positions(context.plan, spec)


@site_plan.register_fake
def _(k, v, checked, site):
    spec = site_spec(site)
    c = k.shape[2]
    keys = c + exchange_slots(spec, c) if spec.exchange in EXCHANGES_OF_NEEDED_KEYS else c * spec.cp_size
    return (
        k.new_empty((c,), dtype=torch.long),
        k.new_empty((keys,), dtype=torch.long),
        k.new_empty((k.shape[0], c * spec.cp_size), dtype=torch.long),
    )


def _site_context(spec: SiteSpec, k: torch.Tensor) -> Active:
    """The active shard context, checked against the group, rank and chunk shape the site was compiled for."""
    try:
        context = active_context(f"the CP attention at {spec.layer or spec.site}")
    except RuntimeError as e:  # this rank is outside shard: its peers may be inside, waiting in a collective
        where = f"the CP attention at {spec.layer or spec.site} (called outside cpcompile.shard)"
        failsafe.on_failure(spec.group_name, e, where=where)
        raise
    plan = context.plan
    if plan.group_name != spec.group_name or plan.cp_size != spec.cp_size:
        raise RuntimeError(
            f"the CP attention at {spec.site} was compiled for group {spec.group_name!r} of size {spec.cp_size}, "
            f"but the active shard context uses group {plan.group_name!r} of size {plan.cp_size}; pass the same "
            "cp_group to cpcompile.backend and cpcompile.shard"
        )
    if plan.cp_rank != spec.cp_rank:
        raise RuntimeError(
            f"the CP attention at {spec.site} was compiled for CP rank {spec.cp_rank}, but the active shard context "
            f"is rank {plan.cp_rank} of its group; compile the model in the process that runs it"
        )
    if k.shape[0] != plan.batch_size or k.shape[2] != plan.chunk_len:
        raise ValueError(
            f"the CP attention at {_site_name(spec)} got {k.shape[0]} rows of {k.shape[2]} tokens, but this step's "
            f"cpcompile.shard holds {plan.batch_size} rows of {plan.chunk_len} tokens per rank (global length "
            f"{plan.seq_len}, CP size {plan.cp_size}): the model was called with a batch sliced for another CP "
            "size, by hand, or with the global batch; call the model with the `local` batch that the active "
            "cpcompile.shard context yields"
        )
    return context


def _site_name(spec: SiteSpec) -> str:
    """The site's layer, or its id without the digest (which differs between ranks): the same on every rank."""
    return spec.layer or spec.site.rsplit("#", 1)[0]


def _count_collectives(context: Active, spec: SiteSpec, k: torch.Tensor, v: torch.Tensor) -> None:
    """Record the site's K and V all-gathers (and their backward reduce-scatters) in the context's CommStats."""
    if spec.cp_size > 1 and spec.exchange == "all_gather":
        context.comm.record_gather(k, spec.cp_size, spec.needs_grad)
        context.comm.record_gather(v, spec.cp_size, spec.needs_grad)


def _check_site(spec: SiteSpec, context: Active, model_mask: torch.Tensor | None) -> None:
    """The site's control rounds, decided together with the other CP ranks (:func:`cpcompile.failsafe.agree`).

    One round on the site's first call, then one per step for every distinct model mask tensor and attention
    form (the layers of a transformers model share one mask: one round per step for the whole model):

    * ranks that reach different attention calls (a data-dependent branch, a recompile on one rank) meet in
      different rounds and raise :class:`~cpcompile.failsafe.RanksDivergedError` at once, instead of waiting in
      different collectives;
    * the model's own mask is compared with the mask its rule gives on the local inputs
      (:meth:`CPPlan.local_rule_mask`) on every step, so a mask that ignores the documents or depends on another
      input is caught on the batch where it starts to differ: every rank raises the same
      :class:`MaskMismatchError`, naming the ranks whose mask differs.
    """
    form = (spec.documents, spec.window)
    if spec.site in _VERIFIED and _mask_checked(context, model_mask, form):
        return
    layer = _site_name(spec)
    seen = None
    if model_mask is None:
        error, what = None, f"the step check of the CP attention at {layer} (no model mask)"
    else:
        error, what = _mask_mismatch(spec, context.plan, model_mask), f"the mask check of the CP attention at {layer}"
        proved = is_proved_mask(context, model_mask)  # proved with documents by the graph that handed it on
        if error is None and spec.documents_assumed and spec.site not in _DOCUMENTS_SEEN and not proved:
            seen = context.plan.documents_in_blocks(spec.window)
            error = _hidden_documents(spec) if seen == "hidden" else None
    failsafe.agree(context.group, "site", error, what=what, kinds=(MaskMismatchError,), stats=context.comm)
    _VERIFIED.add(spec.site)
    if seen == "shown":  # every rank passed a check that a mask without the condition would have failed
        _DOCUMENTS_SEEN.add(spec.site)
    if model_mask is None:
        context.checked_forms.add(form)
    else:
        context.checked_masks.add(model_mask, form)


def _mask_checked(context: Active, model_mask: torch.Tensor | None, form: tuple) -> bool:
    """Whether this step already held the round for ``model_mask`` (still alive, unwritten: a tensor that took a
    freed mask's address is a new mask) under the attention form ``form``, or for a site of that form without a
    model mask. Decided by what the program did, never by where the allocator put a tensor, so every rank holds
    the same rounds."""
    if model_mask is None:
        return form in context.checked_forms
    return context.checked_masks.contains(model_mask, form)


def _hidden_documents(spec: SiteSpec) -> MaskMismatchError:
    """The error of a site whose document condition was assumed (:attr:`SiteSpec.documents_assumed`) on a batch
    whose documents the step check cannot see, before any batch showed them."""
    return MaskMismatchError(
        f"the attention mask of the CP attention at {spec.layer or spec.site} was made outside the compiled graphs "
        "(in eager code, or in a graph that cpcompile did not compile), so whether it keeps packed documents apart "
        "was not proved when the site was compiled, and the step check, which compares each rank's own block of "
        "the mask with the same-document rule, cannot tell on this batch: every rank's tokens lie within one "
        "document in every row (the documents end at chunk edges), where a mask without that condition looks "
        "the same; cpcompile refuses to guess, since the two differ on the keys other ranks hold. Build the mask "
        "inside the compiled model (compile the module that builds it, with no graph break or "
        "torch.compiler.disable between it and the attention), or run first a batch whose documents cross a "
        "chunk edge: once the check has seen the condition there, batches like this one run"
    )


def _mask_mismatch(spec: SiteSpec, plan: CPPlan, model_mask: torch.Tensor) -> MaskMismatchError | None:
    """The error describing where ``model_mask`` differs from :meth:`CPPlan.local_rule_mask`, or ``None``.

    Both rules give every query ``i`` an interval of local keys ``[first_i, i]`` (:meth:`CPPlan.local_first_visible`),
    so no mask of the rule is built: the model's mask is read eight keys at a time (:func:`_rows_differ`) and
    compared with the words the intervals give. The dense rows are made only for the error's first difference.
    """
    # With several runs per rank, a mask built from document ids or per-document positions keeps a document
    # whole across the runs: the whole-sequence mask among this rank's tokens (no new document at a run
    # boundary). The model's mask must be one of the two rules on every row.
    several_runs = plan.runs() > 1
    kwargs = {"documents": spec.documents, "window": spec.window}
    bad = _rows_differ(model_mask, plan.local_first_visible(**kwargs))
    if not bad.any():
        return None
    if several_runs and not _rows_differ(model_mask, plan.local_first_visible(**kwargs, whole_sequence=True)).any():
        return None
    i = int(bad.nonzero()[0, -1])
    ours = plan.local_rule_mask(**kwargs, rows=slice(i, i + 1))
    theirs = model_mask[..., i : i + 1, :].to(torch.bool).expand_as(ours)
    return _mismatch_error(spec, theirs, ours, i, plan.layout if several_runs else None)


#: ``_BYTES_UP_TO[n]``: an int64 word whose first ``n`` bytes (in memory order) are 1, the others 0.
_BYTES_UP_TO = [sum(1 << (8 * (k if sys.byteorder == "little" else 7 - k)) for k in range(n)) for n in range(9)]


def _rows_differ(mask: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """``[..., c]`` bool: the rows of a bool ``[..., c, c]`` mask (``[B or 1, 1, c, c]``) that differ from the
    intervals ``[first_i, i]`` (``first`` ``[B, c]``).

    The mask's bytes are read as int64 words of eight keys and compared with the words the intervals give: whole
    words of ones inside an interval, zeros outside, two partial words at its ends. One pass over ``c^2 / 8``
    words per comparison instead of several passes over ``c^2`` bools; :data:`MASK_CHECK_ROWS` query rows at a
    time bound the memory. A mask whose rows cannot be viewed as words (a length not a multiple of 8, an odd
    offset) is copied into zero-padded rows first.
    """
    c = mask.shape[-1]
    words = -(-c // 8)
    j = torch.arange(words, device=mask.device)
    table = torch.tensor(_BYTES_UP_TO, dtype=torch.int64, device=mask.device)
    first = first.to(mask.device)[:, None, :]  # [B, 1, c]
    out = []
    for start in range(0, mask.shape[-2], MASK_CHECK_ROWS):
        block = mask[..., start : start + MASK_CHECK_ROWS, :].to(torch.bool)
        try:
            w = block.view(torch.int64)
        except RuntimeError:  # not viewable as words: zero-padded contiguous rows
            w = torch.nn.functional.pad(block, (0, words * 8 - c)).contiguous().view(torch.int64)
        lo = first[..., start : start + block.shape[-2]]
        hi = torch.arange(start + 1, start + 1 + block.shape[-2], device=mask.device)  # one past the query
        lo, hi = torch.broadcast_tensors(lo, hi)
        full = (j >= (lo[..., None] + 7) // 8) & (j < hi[..., None] // 8)
        expected = -full.to(torch.int64) & _BYTES_UP_TO[8]  # whole words of ones inside the interval
        for edge in (lo // 8, (hi - 1) // 8):  # the words holding the interval's ends (may be the same word)
            a = torch.maximum(lo, edge * 8) - edge * 8
            b = torch.minimum(hi, edge * 8 + 8) - edge * 8
            expected.scatter_(-1, edge[..., None], (table[b] - table[a])[..., None])
        out.append((w != expected).any(-1))
    return torch.cat(out, -1)


def _mismatch_error(
    spec: SiteSpec, theirs: torch.Tensor, ours: torch.Tensor, first_row: int, plan_layout: str | None = None
) -> MaskMismatchError:
    """The :class:`MaskMismatchError` naming the first differing entry of a block of query rows (``plan_layout``:
    the layout, when it gives this rank several runs of tokens)."""
    b, _, i, j = (theirs != ours).nonzero()[0].tolist()
    form = (
        "global causal"
        + (" same-document" if spec.documents else "")
        + (f" sliding-window({spec.window})" if spec.window is not None else "")
    )
    return MaskMismatchError(
        f"the attention mask built by the model at {spec.layer or spec.site} differs from the {form} mask "
        f"cpcompile applies, as the model's rule gives it on this rank's tokens (first difference: row {b}, "
        f"local query {first_row + i}, key {j}: model {bool(theirs[b, 0, i, j])}, expected "
        f"{bool(ours[b, 0, i, j])}); cpcompile refuses to run attention under a different mask. Build a causal "
        "mask (packed documents marked by position ids that restart at 0; with transformers: "
        "attn_implementation='sdpa' and use_cache=False), or run this model without context parallelism"
        + (
            f"; this rank holds several runs of tokens (the {plan_layout!r} layout), and neither the local "
            "rule nor the whole-sequence mask among this rank's tokens matches: a mask the model builds from "
            "per-token inputs in another way cannot be checked across runs, so call cpcompile.shard(..., "
            "layout='contiguous')"
            if plan_layout is not None
            else ""
        )
    )


def _site_positions(plan: CPPlan, spec: SiteSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh copies of the query indices, the key slots' indices (all-gathered slots, or the local tokens then
    the halo slots) and the site's document ids."""
    q_pos = plan.token_indices()
    if spec.exchange in EXCHANGES_OF_NEEDED_KEYS:
        kv_pos = torch.cat([q_pos, _routing(plan, spec).recv_pos])
    else:
        kv_pos = plan.gathered_indices().clone()
    return q_pos.clone(), kv_pos, plan.attention_docs(spec.documents).clone()


# -- the halo exchange of sliding-window sites ------------------------------------------------------------
@torch.library.custom_op("cpcompile::halo_routing", mutates_args=())
def halo_routing(k: torch.Tensor, site: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(send_slots [N * S], counts [2, N])`` of this rank for the halo site ``site``
    (:class:`cpcompile.plan.HaloRouting`; ``k`` only carries the local length for the checks)."""
    spec = site_spec(site)
    routing = _routing(_site_context(spec, k).plan, spec)
    return routing.send_slots.clone(), routing.counts.clone()


@halo_routing.register_fake
def _(k, site):
    spec = site_spec(site)
    slots = exchange_slots(spec, k.shape[2])
    return k.new_empty((spec.cp_size * slots,), dtype=torch.long), k.new_empty((2, spec.cp_size), dtype=torch.long)


def _routing(plan: CPPlan, spec: SiteSpec):
    """The plan's :class:`~cpcompile.plan.HaloRouting` of the site (window ``None``: the selective exchange)."""
    return plan.halo_routing(spec.window, exchange_slots(spec, plan.chunk_len), documents=spec.documents)


def _site_group(spec: SiteSpec) -> dist.ProcessGroup:
    """The process group the site was compiled for (registered under ``spec.group_name`` in this process)."""
    group = _compat.resolve_group(spec.group_name)
    if group is None:
        raise RuntimeError(f"the CP group {spec.group_name!r} of the attention at {spec.site} is not registered here")
    return group


def _all_to_all(send: torch.Tensor, send_counts: list[int], recv_counts: list[int], spec: SiteSpec) -> torch.Tensor:
    """Exchange the rows of ``send`` (``[sum(send_counts), ...]``, grouped by receiving rank) over the site's group."""
    group = _site_group(spec)
    recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
    dist.all_to_all_single(recv, send, recv_counts, send_counts, group=group)
    return recv


@torch.library.custom_op("cpcompile::halo_exchange", mutates_args=())
def halo_exchange(t: torch.Tensor, send_slots: torch.Tensor, counts: torch.Tensor, site: str) -> torch.Tensor:
    """The ``[B, H, S, D]`` halo keys (or values) of this rank: for every rank, the local rows of ``t``
    (``[B, H, c, D]``) its queries see, exchanged in one all-to-all; empty slots are zero."""
    spec = site_spec(site)
    send_counts, recv_counts = counts.tolist()
    seq_first = t.permute(2, 0, 1, 3)  # [c, B, H, D]
    send = seq_first.index_select(0, send_slots[: sum(send_counts)]).contiguous()
    recv = _all_to_all(send, send_counts, recv_counts, spec)
    out = t.new_zeros((exchange_slots(spec, t.shape[2]), *seq_first.shape[1:]))
    out[: recv.shape[0]] = recv
    nbytes = recv.numel() * recv.element_size()
    _count_halo(spec, nbytes)
    return out.permute(1, 2, 0, 3).contiguous()


@halo_exchange.register_fake
def _(t, send_slots, counts, site):
    B, H, c, D = t.shape
    return t.new_empty((B, H, exchange_slots(site_spec(site), c), D))


def _count_halo(spec: SiteSpec, nbytes: int) -> None:
    """Record one halo exchange of ``nbytes`` received bytes in the active context's CommStats (an exchange run
    again in backward, ``regather_kv_in_backward``, moves its bytes again; its gradients were counted once)."""
    needs_grad = spec.needs_grad and not _compat.in_backward()
    active_context(f"the CP attention at {spec.layer or spec.site}").comm.record_halo(nbytes, needs_grad)


@torch.library.custom_op("cpcompile::halo_exchange_backward", mutates_args=())
def halo_exchange_backward(
    grad: torch.Tensor, send_slots: torch.Tensor, counts: torch.Tensor, site: str, local_len: int
) -> torch.Tensor:
    """The gradient of :func:`halo_exchange`'s input: the halo slots' gradients sent back to the ranks that own
    those keys and added at the local rows they came from (``[B, H, local_len, D]``)."""
    spec = site_spec(site)
    send_counts, recv_counts = counts.tolist()
    seq_first = grad.permute(2, 0, 1, 3)  # [S, B, H, D]
    back = _all_to_all(seq_first[: sum(recv_counts)].contiguous(), recv_counts, send_counts, spec)
    out = grad.new_zeros((local_len, *seq_first.shape[1:]))
    out.index_add_(0, send_slots[: sum(send_counts)], back)
    return out.permute(1, 2, 0, 3).contiguous()


@halo_exchange_backward.register_fake
def _(grad, send_slots, counts, site, local_len):
    B, H, _, D = grad.shape
    return grad.new_empty((B, H, local_len, D))


def _halo_setup_context(ctx, inputs, output):
    t, send_slots, counts, site = inputs
    ctx.save_for_backward(send_slots, counts)
    ctx.site, ctx.local_len = site, t.shape[2]


def _halo_backward(ctx, grad):
    send_slots, counts = ctx.saved_tensors
    dt = torch.ops.cpcompile.halo_exchange_backward(grad.contiguous(), send_slots, counts, ctx.site, ctx.local_len)
    return dt, None, None, None


halo_exchange.register_autograd(_halo_backward, setup_context=_halo_setup_context)


# -- emitting ---------------------------------------------------------------------------------------------
def emit_gather_start(graph: fx.Graph, t: fx.Node, spec: SiteSpec, ready: fx.Node | None = None) -> fx.Node:
    """Insert the all-gather of ``t`` right after ``ready`` (default ``t``): the node after which ``t``'s value is
    final, so the transfer overlaps the work until attention."""
    with graph.inserting_after(_after_placeholders(graph, t if ready is None else ready)):
        return graph.call_function(_compat.all_gather_start, (t, spec.cp_size, spec.group_name))


def last_of(nodes: list[fx.Node]) -> fx.Node:
    """The last of ``nodes`` in their graph's order."""
    order = {n: i for i, n in enumerate(nodes[0].graph.nodes)}
    return max(nodes, key=order.__getitem__)


def emit_site_check(
    graph: fx.Graph, ready: list[tuple[fx.Node, fx.Node]], model_mask: fx.Node | None, spec: SiteSpec
) -> fx.Node:
    """Insert ``cpcompile::site_check`` as early as it can run: right after the first of the site's K and V to be
    final (``ready``: each with the node after which it is; K and V may be one tensor) and the model's mask;
    returns its output, which the site's exchange must come after (:func:`emit_gather_start` with
    ``ready=last_of([..., check])``) and its plan op takes."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    first, final = min(ready, key=lambda pair: order[pair[1]])
    after = max([final] + ([model_mask] if isinstance(model_mask, fx.Node) else []), key=order.__getitem__)
    with graph.inserting_after(_after_placeholders(graph, after)):
        ref = graph.call_method("detach", (first,))
    with graph.inserting_after(ref):
        return graph.call_function(torch.ops.cpcompile.site_check.default, (ref, model_mask, spec.site))


def emit_site_plan(
    graph: fx.Graph, k: fx.Node, v: fx.Node, checked: fx.Node, spec: SiteSpec
) -> tuple[fx.Node, fx.Node, fx.Node]:
    """Insert ``cpcompile::site_plan`` at the current insertion point; returns the (q_pos, kv_pos, docs) nodes."""
    return _emit_plan_call(graph, torch.ops.cpcompile.site_plan.default, k, v, checked, spec.site)


def _emit_plan_call(graph: fx.Graph, op: object, k: fx.Node, v: fx.Node, *args: object) -> tuple[fx.Node, ...]:
    """Insert ``op(k.detach(), v.detach(), *args)``, a plan op of a site (it reads K and V for their shapes and
    device, never for a gradient), and the getitems of its three outputs; returns them."""
    refs = [graph.call_method("detach", (n,)) for n in (k, v)]
    out = graph.call_function(op, (*refs, *args))
    return tuple(graph.call_function(operator.getitem, (out, i)) for i in range(3))


def emit_halo_exchange(graph: fx.Graph, k: fx.Node, v: fx.Node, spec: SiteSpec) -> tuple[fx.Node, fx.Node]:
    """Insert the halo routing and the exchange of ``k`` and ``v``; returns ``[local, halo]`` K and V nodes."""
    ref = graph.call_method("detach", (k,))
    routing = graph.call_function(torch.ops.cpcompile.halo_routing.default, (ref, spec.site))
    send_slots, counts = (graph.call_function(operator.getitem, (routing, i)) for i in range(2))
    return emit_exchange(graph, k, v, send_slots, counts, spec)


def emit_exchange(
    graph: fx.Graph, k: fx.Node, v: fx.Node, send_slots: fx.Node, counts: fx.Node, spec: SiteSpec
) -> tuple[fx.Node, fx.Node]:
    """Insert :func:`halo_exchange` of ``k`` and ``v`` under a routing; returns ``[local, received]`` K and V."""
    out = []
    for t in (k, v):
        halo = graph.call_function(torch.ops.cpcompile.halo_exchange.default, (t, send_slots, counts, spec.site))
        out.append(graph.call_function(torch.cat, ([t, halo],), {"dim": 2}))
    return out[0], out[1]


def recompute_exchange(k_all: fx.Node, v_all: fx.Node) -> None:
    """Tag the exchanges behind ``k_all``/``v_all`` (:func:`emit_exchange`) for recomputation in backward: the
    received keys are fetched again instead of saved; the routing stays saved."""
    for n in (k_all, v_all):
        n.meta.update(_compat.must_recompute_meta())
        for exchanged in n.all_input_nodes:
            if exchanged.target is torch.ops.cpcompile.halo_exchange.default:
                exchanged.meta.update(_compat.must_recompute_meta())


def emit_attention(
    graph: fx.Graph,
    spec: SiteSpec,
    q: fx.Node,
    k: fx.Node,
    v: fx.Node,
    positions: tuple[fx.Node, fx.Node, fx.Node],
    *,
    scale: object,
    enable_gqa: bool,
    block_size: int,
) -> fx.Node:
    """Insert the attention of ``spec.kernel`` over keys at ``positions`` (from :func:`emit_site_plan`)."""
    q_pos, kv_pos, docs = positions
    if spec.kernel != "dense":
        impl = "loop" if spec.kernel == "block" else spec.kernel
        att = graph.call_function(
            torch.ops.cpcompile.cp_attention.default,
            (q, k, v, q_pos, kv_pos, docs, spec.window, scale, enable_gqa, block_size, block_size, impl),
        )
        return graph.call_function(operator.getitem, (att, 0))
    mask = graph.call_function(visible_mask, (q_pos, kv_pos, docs, spec.window))
    return graph.call_function(
        torch.nn.functional.scaled_dot_product_attention,
        (q, k, v),
        {"attn_mask": mask, "dropout_p": 0.0, "is_causal": False, "scale": scale, "enable_gqa": enable_gqa},
    )


# -- flex_attention sites (cpcompile.passes.flex_cp) --------------------------------------------------------
@torch.library.custom_op("cpcompile::flex_site_plan", mutates_args=())
def flex_site_plan(
    k: torch.Tensor, v: torch.Tensor, checked: torch.Tensor, site: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q_pos [c], kv_pos [N*c], seq_len [])`` of the active plan for the flex site ``site``: the positions of
    :func:`site_plan` (same counts; its :func:`site_check` has no model mask to compare) and the batch's
    unpadded length, past which the kernel masks every index (padding)."""
    spec = site_spec(site)
    context = _site_context(spec, k)
    context.ran.sites += 1
    _count_collectives(context, spec, k, v)
    q_pos, kv_pos, _ = _site_positions(context.plan, spec)
    return q_pos, kv_pos, torch.tensor(context.plan.seq_len, dtype=torch.long, device=q_pos.device)


@flex_site_plan.register_fake
def _(k, v, checked, site):
    spec = site_spec(site)
    c = k.shape[2]
    long = dict(dtype=torch.long)
    return k.new_empty((c,), **long), k.new_empty((c * spec.cp_size,), **long), k.new_empty((), **long)


def emit_flex_site_plan(
    graph: fx.Graph, k: fx.Node, v: fx.Node, checked: fx.Node, spec: SiteSpec
) -> tuple[fx.Node, fx.Node, fx.Node]:
    """Insert ``cpcompile::flex_site_plan`` at the current insertion point; returns (q_pos, kv_pos, seq_len)."""
    return _emit_plan_call(graph, torch.ops.cpcompile.flex_site_plan.default, k, v, checked, spec.site)


@torch.library.custom_op("cpcompile::flex_routing", mutates_args=())
def flex_routing(
    k: torch.Tensor,
    q_pos: torch.Tensor,
    seq_len: torch.Tensor,
    tensors: list[torch.Tensor],
    heads: int,
    block: int,
    site: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(send_slots [N * S], counts [2, N], kv_pos [c + S])`` of the selective exchange of the flex site ``site``.

    Which keys a flex site's queries see only its ``mask_mod`` knows: this rank evaluates it at global indices
    (:meth:`~cpcompile.kernels.BoundMods.keys_seen`, with the site's mod ``tensors`` and ``heads`` query heads,
    ``block`` queries at a time) for its real queries ``q_pos`` against every real key other ranks hold, and
    the CP group all-gathers these bitmaps (one byte per global token and rank), so every rank knows every
    rank's needs: the :class:`~cpcompile.plan.HaloRouting` of :meth:`CPPlan.routing`, and ``ValueError`` on
    every rank when one needs more than the ``S`` key slots. ``kv_pos``: this rank's tokens, then the received
    slots (``-1``: empty). ``k`` carries the local shape for the checks.
    """
    spec = site_spec(site)
    context = _site_context(spec, k)
    plan = context.plan
    bound = _kernels.bind_mods(site, tensors, int(seq_len), heads)
    r = plan.cp_rank
    others = torch.cat([plan.indices[:r], plan.indices[r + 1 :]]).flatten()
    seen = bound.keys_seen(plan.batch_size, q_pos, others, block, ROUTING_KEYS)
    mine = torch.zeros(plan.padded_len, dtype=torch.uint8, device=q_pos.device)
    mine[others[seen]] = 1
    every = mine.new_empty((plan.cp_size * plan.padded_len,))
    _compat.all_gather_into(every, mine, _site_group(spec))
    every = every.view(plan.cp_size, plan.padded_len)
    context.comm.record_routing((plan.cp_size - 1) * mine.numel())
    needs = [torch.nonzero(row).flatten().to(torch.long) for row in every]
    routing = plan.routing(
        needs, exchange_slots(spec, plan.chunk_len), what="keys of other ranks", fix=SELECTIVE_SLOTS_FIX
    )
    return routing.send_slots.clone(), routing.counts.clone(), torch.cat([q_pos, routing.recv_pos])


@flex_routing.register_fake
def _(k, q_pos, seq_len, tensors, heads, block, site):
    spec = site_spec(site)
    c = k.shape[2]
    slots = exchange_slots(spec, c)
    long = dict(dtype=torch.long)
    return (
        k.new_empty((spec.cp_size * slots,), **long),
        k.new_empty((2, spec.cp_size), **long),
        k.new_empty((c + slots,), **long),
    )


#: Keys per evaluation of a flex site's mask_mod in :func:`flex_routing` (by the site's block of queries).
ROUTING_KEYS = 1024


def emit_flex_exchange(
    graph: fx.Graph,
    k: fx.Node,
    v: fx.Node,
    q_pos: fx.Node,
    seq_len: fx.Node,
    tensors: list[fx.Node],
    heads: int,
    block: int,
    spec: SiteSpec,
) -> tuple[fx.Node, fx.Node, fx.Node]:
    """Insert :func:`flex_routing` and the exchange of ``k`` and ``v`` it routes; returns ``(k_all, v_all,
    kv_pos)``: this rank's keys then the received ones, and their global indices."""
    ref = graph.call_method("detach", (k,))
    routing = graph.call_function(
        torch.ops.cpcompile.flex_routing.default, (ref, q_pos, seq_len, list(tensors), heads, block, spec.site)
    )
    send_slots, counts, kv_pos = (graph.call_function(operator.getitem, (routing, i)) for i in range(3))
    k_all, v_all = emit_exchange(graph, k, v, send_slots, counts, spec)
    return k_all, v_all, kv_pos


@torch.library.custom_op("cpcompile::exact_input", mutates_args=())
def exact_input(t: torch.Tensor, site: str, what: str) -> torch.Tensor:
    """A copy of the graph input ``t``, a per-token tensor a flex site's mods read, after checking that it holds
    the whole-sequence run's values at this rank's tokens: the local batch :func:`cpcompile.shard` made, or what
    a compiled graph of the CP group computed from such tensors (:func:`~cpcompile.runtime.context.is_exact`).

    A tensor computed in eager code from this rank's tokens (document ids from a ``cumsum`` of the local
    positions, torchtitan's masks made by its trainer) holds this rank's values only, which no all-gather makes
    the whole sequence's: :class:`~cpcompile.errors.UnsupportedAttentionError`, on every rank (each rank runs
    the same code on its own tokens), before the site communicates anything.
    """
    context = active_context(f"the flex_attention site {site}")
    if t.is_inference():  # no version counter: an in-place write since it was computed could not be seen
        raise UnsupportedAttentionError(
            f"cpcompile cannot run the flex_attention call at {_site_name(site_spec(site))} across CP ranks under "
            f"torch.inference_mode: its {what} reads a tensor of shape {tuple(t.shape)} handed on from another graph "
            "or from eager code, and an inference tensor keeps no record of in-place writes, so cpcompile cannot "
            "tell that it still holds what the compiled model computed. Fix: run forward-only calls under "
            "torch.no_grad() instead of torch.inference_mode()"
        )
    if not is_exact(context, t):
        raise UnsupportedAttentionError(
            f"cpcompile cannot run the flex_attention call at {_site_name(site_spec(site))} across CP ranks: its "
            f"{what} reads a tensor of "
            f"shape {tuple(t.shape)} with this rank's tokens that was computed outside the compiled model (in eager "
            "code, or from such a tensor), so it holds this rank's values only, not the whole sequence's. Fix: "
            "compute it inside the compiled model from the batch cpcompile.shard passes (document ids as "
            "(position_ids == 0).cumsum(-1), which cpcompile runs on the whole sequence), and build the BlockMask "
            "there too"
        )
    return t.clone()


@exact_input.register_fake
def _(t, site, what):
    return torch.empty_like(t)


def emit_exact_input(graph: fx.Graph, t: fx.Node, spec: SiteSpec, what: str) -> fx.Node:
    """Insert :func:`exact_input` of the graph input ``t`` before the first op of ``graph`` (before any
    collective of the graph); returns the checked copy."""
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        return graph.call_function(torch.ops.cpcompile.exact_input.default, (t, spec.site, what))


def emit_buffer_gather(graph: fx.Graph, t: fx.Node, dim: int, spec: SiteSpec) -> fx.Node:
    """Insert the all-gather of a per-token tensor ``t`` (this rank's tokens along ``dim``) into global token
    order (:func:`emit_sequence_gather`; bools travel as uint8); returns the whole-sequence tensor."""
    value = t.meta.get("example_value", t.meta.get("val"))
    is_bool = isinstance(value, torch.Tensor) and value.dtype == torch.bool
    src = graph.call_method("to", (t, torch.uint8)) if is_bool else t
    whole, _ = emit_sequence_gather(graph, src, dim, spec.cp_size, spec.group_name, spec.site)
    return graph.call_method("to", (whole, torch.bool)) if is_bool else whole


def emit_flex_attention(
    graph: fx.Graph,
    spec: SiteSpec,
    q: fx.Node,
    k: fx.Node,
    v: fx.Node,
    positions: tuple[fx.Node, fx.Node, fx.Node],
    *,
    tensors: list[fx.Node],
    mods: _kernels.FlexMods,
    scale: float,
    block_size: int,
) -> tuple[fx.Node, fx.Node]:
    """Register the site's ``mods`` and insert ``cpcompile::flex_cp_attention``; returns the (out, lse) nodes
    (``lse`` in natural log)."""
    _kernels.register_flex_mods(spec.site, mods)
    q_pos, kv_pos, seq_len = positions
    att = graph.call_function(
        torch.ops.cpcompile.flex_cp_attention.default,
        (q, k, v, q_pos, kv_pos, seq_len, list(tensors), spec.site, scale, block_size, block_size),
    )
    return graph.call_function(operator.getitem, (att, 0)), graph.call_function(operator.getitem, (att, 1))


def _after_placeholders(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """``node``, or the last placeholder when ``node`` is one (nothing may be inserted between placeholders)."""
    if node.op != "placeholder":
        return node
    return [n for n in graph.nodes if n.op == "placeholder"][-1]


# -- positions the model computes itself ------------------------------------------------------------------
@torch.library.custom_op("cpcompile::token_positions", mutates_args=())
def token_positions(like: torch.Tensor, table_rows: int, site: str) -> torch.Tensor:
    """Int64 ``[c]``: the global index of each of this rank's ``c`` local tokens, on ``like``'s device.

    ``like`` is any tensor with the local length ``c`` along dim 0 (only its size and device are read).
    Padding tokens (global index ``>= T``, the batch's unpadded length) get ``T - 1``: they are ignored
    tokens, and the clamp keeps a table lookup in range. ``table_rows >= 0`` is the number of rows of the
    table the indices will select from (counted from the slice's start); ``ValueError`` when it is smaller
    than ``T``, the same on every rank (the check reads only the plan, which every rank shares).
    ``site`` names the position source in errors.
    """
    plan = active_context(f"the position source at {site}").plan
    if like.shape[0] != plan.chunk_len:
        raise RuntimeError(
            f"the position source at {site} has {like.shape[0]} local positions, but the active plan expects "
            f"this rank's chunk length {plan.chunk_len}; call the model with the `local` batch of the active "
            "cpcompile.shard context"
        )
    if 0 <= table_rows < plan.seq_len:
        raise ValueError(
            f"the position table sliced at {site} has {table_rows} rows, but the global sequence has "
            f"{plan.seq_len} tokens (CP size {plan.cp_size}, {plan.chunk_len} tokens per rank): cpcompile selects "
            f"the rows of the global positions of every rank's tokens, so the table needs at least {plan.seq_len} "
            "rows; build the model with a maximum sequence length of at least the global length and pass the "
            "whole table (a table cut to one rank's rows, as torch's context_parallel(buffers=...) asks for, "
            "is not needed with cpcompile)"
        )
    idx = plan.token_indices().clamp(max=plan.seq_len - 1)
    return idx.to(like.device)


@token_positions.register_fake
def _(like: torch.Tensor, table_rows: int, site: str) -> torch.Tensor:
    return like.new_empty((like.shape[0],), dtype=torch.long)


def emit_token_positions(graph: fx.Graph, like: fx.Node, table_rows: int, site: str) -> fx.Node:
    """Insert ``token_positions(like.detach(), table_rows, site)`` at the graph's insertion point; return it.

    ``like`` is detached first: the op reads only its size, and its int64 output never carries a gradient.
    """
    detached = graph.call_method("detach", (like,))
    return graph.call_function(torch.ops.cpcompile.token_positions.default, (detached, table_rows, site))


@torch.library.custom_op("cpcompile::real_tokens", mutates_args=())
def real_tokens(like: torch.Tensor, dim: int, site: str) -> torch.Tensor:
    """Bool ``[c]``: which of this rank's ``c`` local tokens (``like``'s ``dim``; only its size and device are
    read) are tokens of the batch, False for the padding that makes ``T`` a multiple of the CP size (the same in
    every row). ``site`` names the op that needs it in errors."""
    plan = active_context(f"the op at {site}").plan
    if like.shape[dim] != plan.chunk_len:
        raise RuntimeError(
            f"the op at {site} got {like.shape[dim]} tokens along dim {dim}, but the active plan expects this "
            f"rank's chunk length {plan.chunk_len}; call the model with the `local` batch of the active "
            "cpcompile.shard context"
        )
    return (plan.token_indices() < plan.seq_len).to(like.device)


@real_tokens.register_fake
def _(like: torch.Tensor, dim: int, site: str) -> torch.Tensor:
    return like.new_empty((like.shape[dim],), dtype=torch.bool)


# -- ops that mix tokens outside attention, run on the whole sequence -------------------------------------------
@torch.library.custom_op("cpcompile::sequence_order", mutates_args=())
def sequence_order(
    like: torch.Tensor, dim: int, cp_size: int, needs_grad: bool, site: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order [N * c], local [c])`` of the active plan for a region of :mod:`cpcompile.passes.mixing`.

    A tensor all-gathered over the CP group (rank-major chunks of ``c`` tokens along ``dim``) is in global token
    order after ``index_select(dim, order)``, padding tokens last; ``local`` are this rank's global token indices,
    which take its tokens back from a tensor in token order. ``like`` (detached) has this rank's ``c`` tokens
    along ``dim``: only its size and device are read, and its bytes are counted as one sequence all-gather
    (``CommStats.sequence_gathers``; with ``needs_grad``, one reduce-scatter in backward).
    """
    context = active_context(f"the sequence-mixing op at {site}")
    plan = context.plan
    if plan.cp_size != cp_size:
        raise RuntimeError(
            f"the sequence-mixing op at {site} was compiled for a CP group of size {cp_size}, but the active shard "
            f"context has size {plan.cp_size}; pass the same cp_group to cpcompile.backend and cpcompile.shard"
        )
    if like.shape[dim] != plan.chunk_len:
        raise RuntimeError(
            f"the sequence-mixing op at {site} got {like.shape[dim]} tokens along dim {dim}, but the active plan "
            f"expects this rank's chunk length {plan.chunk_len}; call the model with the `local` batch of the "
            "active cpcompile.shard context"
        )
    context.comm.record_sequence_gather(like, cp_size, needs_grad)
    order = torch.argsort(plan.gathered_indices())
    return order.to(like.device), plan.token_indices().clone().to(like.device)


@sequence_order.register_fake
def _(like, dim, cp_size, needs_grad, site):
    c = like.shape[dim]
    return like.new_empty((cp_size * c,), dtype=torch.long), like.new_empty((c,), dtype=torch.long)


def emit_sequence_gather(
    graph: fx.Graph, t: fx.Node, dim: int, cp_size: int, group_name: str, site: str
) -> tuple[fx.Node, fx.Node]:
    """Insert the all-gather of ``t`` along ``dim`` into global token order; returns ``(whole, local)``: the
    gathered tensor and this rank's token indices (take its tokens back with ``index_select(dim, local)``).

    Autograd: the all-gather's backward is a sum reduce-scatter, so every rank gets, for its own tokens, the
    gradients every rank's copy of the whole-sequence computation sent them.
    """
    value = t.meta.get("example_value", t.meta.get("val"))
    needs_grad = bool(isinstance(value, torch.Tensor) and value.requires_grad)
    ref = graph.call_method("detach", (t,))
    args = (ref, dim, cp_size, needs_grad, site)
    order_local = graph.call_function(torch.ops.cpcompile.sequence_order.default, args)
    order, local = (graph.call_function(operator.getitem, (order_local, i)) for i in range(2))
    gathered = graph.call_function(_compat.all_gather_seq, (t, dim, cp_size, group_name))
    whole = graph.call_method("index_select", (gathered, dim, order))
    return whole, local
