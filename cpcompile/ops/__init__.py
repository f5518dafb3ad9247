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
(:func:`~cpcompile.ops.sites.site_context`) and hold the site's control rounds: its first call, and the model's own
mask against the plan's local rule on every new batch (:func:`~cpcompile.ops.check._check_site`).
``cpcompile::site_plan`` counts the site's all-gathers (:func:`~cpcompile.ops.sites._count_collectives`) and hands
out the positions (:func:`~cpcompile.ops.sites._site_positions`). ``cpcompile::cp_attention`` is the block kernel
(:mod:`cpcompile.kernels`).

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
(:func:`emit_sequence_gather`). A region whose output tokens read a bounded number of tokens before them (a causal
conv, a token shift) takes a halo instead: ``cpcompile::halo_routing`` and ``cpcompile::halo_exchange`` of a
``"sequence_halo"`` site fetch the tokens before each of this rank's runs, ``cpcompile::region_halo_order`` says
where the region reads them (:func:`emit_region_halo`).

``cpcompile::heads_from_sequence`` and ``cpcompile::sequence_from_heads`` (:mod:`~cpcompile.ops.heads`) move a
tensor between the sequence split and a head split (the whole sequence in token order for ``H / N`` heads per
rank): one all-to-all each way, under the permutation ``cpcompile::heads_order`` takes from the plan.

``cpcompile::token_positions`` serves :mod:`cpcompile.passes.positions`: the global index of every token this
rank holds, for position sources (``arange`` of the local length, tables sliced by it) the model computes itself.

The package splits by concern, each op next to its fake implementation and the ``emit_*`` helper that inserts
it, so that what the pass puts in a graph and what runs at run time are read, and changed, together:
:mod:`~cpcompile.ops.sites` (:class:`SiteSpec`, the registry, the site's plan ops and its attention),
:mod:`~cpcompile.ops.check` (the checks before a site communicates), :mod:`~cpcompile.ops.exchange` (the
all-gather, the halo and selective exchanges and their routing), :mod:`~cpcompile.ops.heads` (the exchanges
between the sequence and head splits) and :mod:`~cpcompile.ops.tokens` (the ops of the positions and mixing
passes). Every name below is importable from ``cpcompile.ops``.
"""

from __future__ import annotations

from cpcompile import kernels as _kernels  # noqa: F401 - registers torch.ops.cpcompile.cp_attention
from cpcompile.ops.check import (
    MASK_CHECK_ROWS,
    emit_exact_input,
    emit_site_check,
    exact_input,
    mask_mismatch,
    site_check,
)
from cpcompile.ops.exchange import (
    ROUTING_KEYS,
    emit_exchange,
    emit_flex_exchange,
    emit_gather_start,
    emit_halo_exchange,
    emit_region_halo,
    flex_routing,
    halo_exchange,
    halo_routing,
    recompute_exchange,
    region_halo_order,
)
from cpcompile.ops.heads import (
    emit_heads_from_sequence,
    emit_sequence_from_heads,
    heads_from_sequence,
    heads_order,
    sequence_from_heads,
)
from cpcompile.ops.sites import (
    EXCHANGES_OF_NEEDED_KEYS,
    SiteSpec,
    emit_attention,
    emit_flex_attention,
    emit_flex_site_plan,
    emit_site_plan,
    exchange_slots,
    flex_site_plan,
    last_of,
    register_site,
    site_plan,
    site_spec,
)
from cpcompile.ops.state import state_gather, state_input, state_output, state_reduce_scatter, state_runs
from cpcompile.ops.tokens import (
    emit_buffer_gather,
    emit_sequence_gather,
    emit_token_positions,
    real_tokens,
    sequence_order,
    token_positions,
)

__all__ = [
    "emit_attention",
    "emit_buffer_gather",
    "emit_exact_input",
    "emit_exchange",
    "emit_flex_attention",
    "emit_flex_exchange",
    "emit_flex_site_plan",
    "emit_gather_start",
    "emit_halo_exchange",
    "emit_heads_from_sequence",
    "emit_region_halo",
    "emit_sequence_from_heads",
    "emit_sequence_gather",
    "emit_site_check",
    "emit_site_plan",
    "emit_token_positions",
    "exact_input",
    "exchange_slots",
    "EXCHANGES_OF_NEEDED_KEYS",
    "flex_routing",
    "flex_site_plan",
    "halo_exchange",
    "halo_routing",
    "heads_from_sequence",
    "heads_order",
    "last_of",
    "MASK_CHECK_ROWS",
    "mask_mismatch",
    "real_tokens",
    "recompute_exchange",
    "region_halo_order",
    "register_site",
    "ROUTING_KEYS",
    "sequence_from_heads",
    "sequence_order",
    "state_gather",
    "state_input",
    "state_output",
    "state_reduce_scatter",
    "state_runs",
    "site_check",
    "site_plan",
    "site_spec",
    "SiteSpec",
    "token_positions",
]
