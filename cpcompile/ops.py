"""The contract between the pass and the runtime: every op the rewritten graph calls, and how it is emitted.

The pass (:mod:`cpcompile.passes.sdpa_cp`) describes every site it rewrites with a frozen :class:`SiteSpec`,
registers it (:func:`register_site`) and inserts the calls below with the ``emit_*`` helpers; at run time the
ops read the active :func:`cpcompile.shard` context through :func:`cpcompile.runtime.active_context`.

Ops and graph calls::

    k_h = all_gather_start(k_src)        # _compat: functional all-gather (autograd: reduce-scatter in backward)
    q_pos, kv_pos, docs = cpcompile::site_plan(k_src.detach(), v_src.detach(), model_mask | None, site)
    k_all = all_gather_wait(k_h)         # [B, Hkv, N*c, D], rank-major slots: global indices kv_pos
    # dense path                                      # block path
    mask = visible_mask(q_pos, kv_pos, docs, window)  out = cpcompile::cp_attention(q, k_all, v_all, q_pos,
    out = sdpa(q, k_all, v_all, attn_mask=mask)                               kv_pos, docs, window, ...)[0]

``cpcompile::site_plan`` does four separate things, each a named function here: find and check the active plan
(:func:`_site_context`), count the site's collectives (:func:`_count_collectives`), compare the model's own mask
with the plan's local rule on the site's first call (:func:`_verify_model_mask_once`) and hand out the positions
(:func:`_site_positions`). ``cpcompile::cp_attention`` is the block kernel (:mod:`cpcompile.kernels`).
"""

from __future__ import annotations

import dataclasses
import operator
import threading

import torch
import torch.fx as fx

from cpcompile import _compat, failsafe
from cpcompile import kernels as _kernels  # noqa: F401 - registers torch.ops.cpcompile.cp_attention
from cpcompile.plan import CPPlan, visible_mask
from cpcompile.runtime import Active, MaskMismatchError, active_context

__all__ = [
    "SiteSpec",
    "emit_attention",
    "emit_gather_start",
    "emit_site_plan",
    "register_site",
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
    #: Same-document condition (the model built a packed-document bool mask) or plain global causal order.
    documents: bool
    #: Sliding window in tokens, or ``None``.
    window: int | None
    #: Attention emitted: ``"dense"`` (SDPA under the whole mask) or ``"block"`` (``cpcompile::cp_attention``).
    kernel: str
    #: Whether the gathered K/V require grad (each is then reduce-scattered in backward).
    needs_grad: bool


_SITES: dict[str, SiteSpec] = {}
_SITES_LOCK = threading.Lock()
#: Sites whose model mask was already compared with the plan's (written only by _verify_model_mask_once).
_VERIFIED: set[str] = set()


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


# -- cpcompile::site_plan ---------------------------------------------------------------------------------
@torch.library.custom_op("cpcompile::site_plan", mutates_args=())
def site_plan(
    k: torch.Tensor, v: torch.Tensor, model_mask: torch.Tensor | None, site: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q_pos [c], kv_pos [N*c], doc_ids [B, T_pad])`` of the active plan for the site ``site``.

    ``k``/``v`` are the local tensors the site all-gathers (detached; only their sizes are read: the local
    length, and the bytes counted in :func:`cpcompile.comm_stats`). ``q_pos`` are this rank's global token
    indices, ``kv_pos`` the global index of every gathered slot, ``doc_ids`` the plan's document ids (all zeros
    when the site has no document condition). When ``model_mask`` (the mask the model built on its local
    inputs) is given, the first call of the site compares it with :meth:`CPPlan.local_rule_mask` and raises
    :class:`MaskMismatchError` when they differ.
    """
    spec = site_spec(site)
    context = _site_context(spec, k)
    _count_collectives(context, spec, k, v)
    if model_mask is not None:
        _verify_model_mask_once(spec, context, model_mask)
    return _site_positions(context.plan, spec)


@site_plan.register_fake
def _(k, v, model_mask, site):
    spec = site_spec(site)
    c = k.shape[2]
    return (
        k.new_empty((c,), dtype=torch.long),
        k.new_empty((c * spec.cp_size,), dtype=torch.long),
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
        raise RuntimeError(
            f"the CP attention at {spec.site} got a chunk of batch {k.shape[0]} and length {k.shape[2]}, but the "
            f"active plan expects batch {plan.batch_size} and chunk length {plan.chunk_len}; call the model "
            "with the `local` batch of the active cpcompile.shard context"
        )
    return context


def _count_collectives(context: Active, spec: SiteSpec, k: torch.Tensor, v: torch.Tensor) -> None:
    """Record the site's K and V all-gathers (and their backward reduce-scatters) in the context's CommStats."""
    if spec.cp_size > 1:
        context.comm.record_gather(k, spec.cp_size, spec.needs_grad)
        context.comm.record_gather(v, spec.cp_size, spec.needs_grad)


def _verify_model_mask_once(spec: SiteSpec, context: Active, model_mask: torch.Tensor) -> None:
    """On the site's first call: the model's local mask must be the mask its rule gives on the local inputs.

    Decided together with the other CP ranks (one control round, :func:`cpcompile.failsafe.agree`): every rank
    raises the same :class:`MaskMismatchError`, naming the ranks whose mask differs.
    """
    if spec.site in _VERIFIED:
        return
    error = _mask_mismatch(spec, context.plan, model_mask)
    what = f"the first-call mask check of the CP attention at {spec.layer or spec.site}"
    failsafe.agree(context.group, "mask", error, what=what, kinds=(MaskMismatchError,), stats=context.comm)
    _VERIFIED.add(spec.site)


def _mask_mismatch(spec: SiteSpec, plan: CPPlan, model_mask: torch.Tensor) -> MaskMismatchError | None:
    """The error describing where ``model_mask`` differs from :meth:`CPPlan.local_rule_mask`, or ``None``."""
    ours = plan.local_rule_mask(documents=spec.documents, window=spec.window)
    theirs = model_mask.to(torch.bool).expand_as(ours)
    if torch.equal(theirs, ours):
        return None
    b, _, i, j = (theirs != ours).nonzero()[0].tolist()
    form = (
        "global causal"
        + (" same-document" if spec.documents else "")
        + (f" sliding-window({spec.window})" if spec.window is not None else "")
    )
    return MaskMismatchError(
        f"the attention mask built by the model at {spec.layer or spec.site} differs from the {form} mask "
        f"cpcompile applies, as the model's rule gives it on this rank's tokens (first difference: row {b}, "
        f"local query {i}, key {j}: model {bool(theirs[b, 0, i, j])}, expected {bool(ours[b, 0, i, j])}); "
        "cpcompile refuses to run attention under a different mask. Build a causal mask (packed documents "
        "marked by position ids that restart at 0; with transformers: attn_implementation='sdpa' and "
        "use_cache=False), or run this model without context parallelism"
    )


def _site_positions(plan: CPPlan, spec: SiteSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh copies of the query indices, the gathered slots' indices and the site's document ids."""
    return plan.token_indices().clone(), plan.gathered_indices().clone(), plan.attention_docs(spec.documents).clone()


# -- emitting ---------------------------------------------------------------------------------------------
def emit_gather_start(graph: fx.Graph, t: fx.Node, spec: SiteSpec) -> fx.Node:
    """Insert the all-gather of ``t`` right after ``t`` exists (so the transfer overlaps the work until attention)."""
    with graph.inserting_after(_after_placeholders(graph, t)):
        return graph.call_function(_compat.all_gather_start, (t, spec.cp_size, spec.group_name))


def emit_site_plan(
    graph: fx.Graph, k: fx.Node, v: fx.Node, model_mask: fx.Node | None, spec: SiteSpec
) -> tuple[fx.Node, fx.Node, fx.Node]:
    """Insert ``cpcompile::site_plan`` at the current insertion point; returns the (q_pos, kv_pos, docs) nodes."""
    refs = [graph.call_method("detach", (n,)) for n in (k, v)]
    out = graph.call_function(torch.ops.cpcompile.site_plan.default, (*refs, model_mask, spec.site))
    q_pos, kv_pos, docs = (graph.call_function(operator.getitem, (out, i)) for i in range(3))
    return q_pos, kv_pos, docs


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
    if spec.kernel == "block":
        att = graph.call_function(
            torch.ops.cpcompile.cp_attention.default,
            (q, k, v, q_pos, kv_pos, docs, spec.window, scale, enable_gqa, block_size, block_size),
        )
        return graph.call_function(operator.getitem, (att, 0))
    mask = graph.call_function(visible_mask, (q_pos, kv_pos, docs, spec.window))
    return graph.call_function(
        torch.nn.functional.scaled_dot_product_attention,
        (q, k, v),
        {"attn_mask": mask, "dropout_p": 0.0, "is_causal": False, "scale": scale, "enable_gqa": enable_gqa},
    )


def _after_placeholders(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """``node``, or the last placeholder when ``node`` is one (nothing may be inserted between placeholders)."""
    if node.op != "placeholder":
        return node
    return [n for n in graph.nodes if n.op == "placeholder"][-1]
