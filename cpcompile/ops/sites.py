"""Sites: what the pass knows of every attention site it rewrites, and the ops that give a site its positions.

:class:`SiteSpec` describes a site (decided at compile time); :func:`register_site` makes it known under its id, the
only argument the ops take about it. ``cpcompile::site_plan`` (SDPA sites) and ``cpcompile::flex_site_plan``
(flex sites) give a site the global indices of this rank's queries and of every key slot, counting the site's
all-gathers; :func:`emit_attention` and :func:`emit_flex_attention` insert the attention over those keys. The
helpers the other ops modules share (the active context checked against the site, the site's group and routing)
live here too.
"""

from __future__ import annotations

import dataclasses
import operator
import threading

import torch
import torch.distributed as dist
import torch.fx as fx

from cpcompile import _compat, failsafe
from cpcompile import kernels as _kernels
from cpcompile.mask import visible_mask
from cpcompile.plan import CPPlan
from cpcompile.runtime.context import Active, active_context


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
    #: site routes by its mask_mod, :func:`.flex_routing`); ``"sequence_halo"``: not an attention site but a
    #: causal region of the mixing pass, whose output tokens read ``window - 1`` tokens before them
    #: (:func:`.emit_region_halo`).
    exchange: str = "all_gather"
    halo_slots: int = 0
    #: The same-document condition was assumed, not proved (the model's mask was made outside the compiled graphs:
    #: :attr:`cpcompile.passes.mask_rules.MaskProof.assumed`): the step check must have seen it on a batch before a
    #: batch on which it cannot see it runs (:func:`.check._hidden_documents`).
    documents_assumed: bool = False


#: The exchanges that move only the keys a rank's queries see (:func:`.halo_exchange`).
EXCHANGES_OF_NEEDED_KEYS = ("halo", "selective")


def exchange_slots(spec: SiteSpec, chunk_len):
    """Key slots of the site's exchange of needed keys for a local length ``chunk_len`` (an int, or a SymInt
    in fake tensors): ``spec.halo_slots``, or for a selective site without a bound the all-gather's ``(N - 1) * c``.
    """
    return spec.halo_slots or (spec.cp_size - 1) * chunk_len


_SITES: dict[str, SiteSpec] = {}


_SITES_LOCK = threading.Lock()


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


@torch.library.custom_op("cpcompile::site_plan", mutates_args=())
def site_plan(
    k: torch.Tensor, v: torch.Tensor, checked: torch.Tensor, site: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q_pos [c], kv_pos [N*c], doc_ids [B, T_pad])`` of the active plan for the site ``site``.

    ``k``/``v`` are the local tensors the site exchanges (detached; only their sizes are read: the local
    length, and the bytes counted in :func:`cpcompile.comm_stats`); ``checked`` is the output of the site's
    :func:`.site_check`. ``q_pos`` are this rank's global token indices, ``kv_pos`` the global index of every
    gathered slot, ``doc_ids`` the plan's document ids (all zeros when the site has no document condition).
    """
    spec = site_spec(site)
    context = site_context(spec, k)
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


def site_context(spec: SiteSpec, k: torch.Tensor) -> Active:
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
            f"the CP attention at {site_name(spec)} got {k.shape[0]} rows of {k.shape[2]} tokens, but this step's "
            f"cpcompile.shard holds {plan.batch_size} rows of {plan.chunk_len} tokens per rank (global length "
            f"{plan.seq_len}, CP size {plan.cp_size}): the model was called with a batch sliced for another CP "
            "size, by hand, or with the global batch; call the model with the `local` batch that the active "
            "cpcompile.shard context yields"
        )
    return context


def site_name(spec: SiteSpec) -> str:
    """The site's layer, or its id without the digest (which differs between ranks): the same on every rank."""
    return spec.layer or spec.site.rsplit("#", 1)[0]


def _count_collectives(context: Active, spec: SiteSpec, k: torch.Tensor, v: torch.Tensor) -> None:
    """Record the site's K and V all-gathers (and their backward reduce-scatters) in the context's CommStats."""
    if spec.cp_size > 1 and spec.exchange == "all_gather":
        context.comm.record_gather(k, spec.cp_size, spec.needs_grad)
        context.comm.record_gather(v, spec.cp_size, spec.needs_grad)


def _site_positions(plan: CPPlan, spec: SiteSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh copies of the query indices, the key slots' indices (all-gathered slots, or the local tokens then
    the halo slots) and the site's document ids."""
    q_pos = plan.token_indices()
    if spec.exchange in EXCHANGES_OF_NEEDED_KEYS:
        kv_pos = torch.cat([q_pos, site_routing(plan, spec).recv_pos])
    else:
        kv_pos = plan.gathered_indices().clone()
    return q_pos.clone(), kv_pos, plan.attention_docs(spec.documents).clone()


def site_routing(plan: CPPlan, spec: SiteSpec):
    """The plan's :class:`~cpcompile.plan.HaloRouting` of the site (window ``None``: the selective exchange)."""
    return plan.halo_routing(spec.window, exchange_slots(spec, plan.chunk_len), documents=spec.documents)


def site_group(spec: SiteSpec) -> dist.ProcessGroup:
    """The process group the site was compiled for (registered under ``spec.group_name`` in this process)."""
    group = _compat.resolve_group(spec.group_name)
    if group is None:
        raise RuntimeError(f"the CP group {spec.group_name!r} of the attention at {spec.site} is not registered here")
    return group


def last_of(nodes: list[fx.Node]) -> fx.Node:
    """The last of ``nodes`` in their graph's order."""
    order = {n: i for i, n in enumerate(nodes[0].graph.nodes)}
    return max(nodes, key=order.__getitem__)


def emit_site_plan(
    graph: fx.Graph, k: fx.Node, v: fx.Node, checked: fx.Node, spec: SiteSpec
) -> tuple[fx.Node, fx.Node, fx.Node]:
    """Insert ``cpcompile::site_plan`` at the current insertion point; returns the (q_pos, kv_pos, docs) nodes."""
    return emit_plan_call(graph, torch.ops.cpcompile.site_plan.default, k, v, checked, spec.site)


def emit_plan_call(graph: fx.Graph, op: object, k: fx.Node, v: fx.Node, *args: object) -> tuple[fx.Node, ...]:
    """Insert ``op(k.detach(), v.detach(), *args)``, a plan op of a site (it reads K and V for their shapes and
    device, never for a gradient), and the getitems of its three outputs; returns them."""
    refs = [graph.call_method("detach", (n,)) for n in (k, v)]
    out = graph.call_function(op, (*refs, *args))
    return tuple(graph.call_function(operator.getitem, (out, i)) for i in range(3))


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


@torch.library.custom_op("cpcompile::flex_site_plan", mutates_args=())
def flex_site_plan(
    k: torch.Tensor, v: torch.Tensor, checked: torch.Tensor, site: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q_pos [c], kv_pos [N*c], seq_len [])`` of the active plan for the flex site ``site``: the positions of
    :func:`site_plan` (same counts; its :func:`.site_check` has no model mask to compare) and the batch's
    unpadded length, past which the kernel masks every index (padding)."""
    spec = site_spec(site)
    context = site_context(spec, k)
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
    return emit_plan_call(graph, torch.ops.cpcompile.flex_site_plan.default, k, v, checked, spec.site)


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


def after_placeholders(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """``node``, or the last placeholder when ``node`` is one (nothing may be inserted between placeholders)."""
    if node.op != "placeholder":
        return node
    return [n for n in graph.nodes if n.op == "placeholder"][-1]
