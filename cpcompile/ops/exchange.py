"""Exchanges: the ops that move keys and values between the CP ranks, and how they are emitted.

The all-gather of a site's K and V (:func:`emit_gather_start`, a functional collective from :mod:`cpcompile._compat`),
and the exchange of only the keys a rank's queries see: ``cpcompile::halo_routing`` (sliding-window and
selective SDPA sites: the plan's routing) or ``cpcompile::flex_routing`` (selective flex sites: the mask_mod's),
then ``cpcompile::halo_exchange`` (one all-to-all; its backward returns the keys' gradients to their owners).
The same routing and exchange give a causal region of the mixing pass the tokens before each of this rank's runs
(:func:`emit_region_halo`, with ``cpcompile::region_halo_order``: where the region reads them).
"""

from __future__ import annotations

import operator

import torch
import torch.distributed as dist
import torch.fx as fx

from cpcompile import _compat
from cpcompile import kernels as _kernels
from cpcompile.ops.check import exchange_round
from cpcompile.ops.sites import (
    SiteSpec,
    after_placeholders,
    exchange_slots,
    site_context,
    site_group,
    site_routing,
    site_spec,
)
from cpcompile.plan import SELECTIVE_SLOTS_FIX
from cpcompile.runtime.context import active_context


@torch.library.custom_op("cpcompile::halo_routing", mutates_args=())
def halo_routing(k: torch.Tensor, site: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(send_slots [N * S], counts [2, N])`` of this rank for the halo site ``site``
    (:class:`cpcompile.plan.HaloRouting`; ``k`` only carries the local length for the checks). For a causal
    region's halo (a ``"sequence_halo"`` site) it holds the region's control round first
    (:func:`~cpcompile.ops.check.exchange_round`); an attention site held its own in ``cpcompile::site_check``."""
    spec = site_spec(site)
    context = site_context(spec, k)
    if spec.exchange == "sequence_halo":  # an attention site held its round in its site_check
        exchange_round(context, site, "the sequence-mixing op")
    routing = site_routing(context.plan, spec)
    return routing.send_slots.clone(), routing.counts.clone()


@halo_routing.register_fake
def _(k, site):
    spec = site_spec(site)
    slots = exchange_slots(spec, k.shape[2])
    return k.new_empty((spec.cp_size * slots,), dtype=torch.long), k.new_empty((2, spec.cp_size), dtype=torch.long)


def _all_to_all(send: torch.Tensor, send_counts: list[int], recv_counts: list[int], spec: SiteSpec) -> torch.Tensor:
    """Exchange the rows of ``send`` (``[sum(send_counts), ...]``, grouped by receiving rank) over the site's group."""
    group = site_group(spec)
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
    again in backward, ``regather_kv_in_backward``, moves its bytes again; its gradients were counted once): an
    attention site's in ``halo_*``, a causal region's (``spec.exchange == "sequence_halo"``) in
    ``sequence_halo_*``."""
    needs_grad = spec.needs_grad and not _compat.in_backward()
    if spec.exchange == "sequence_halo":
        comm = active_context(f"the sequence-mixing op at {spec.layer or spec.site}").comm
        comm.record_sequence_halo(nbytes, needs_grad)
        return
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


@torch.library.custom_op("cpcompile::region_halo_order", mutates_args=())
def region_halo_order(like: torch.Tensor, site: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order [c + S], keep [c])`` of the active plan for the causal region ``site`` (a ``"sequence_halo"``
    site: ``window - 1`` halo tokens, ``S`` halo slots): :meth:`cpcompile.plan.CPPlan.region_halo`. ``like``
    (``[B, H, c, D]``, as :func:`halo_exchange` gets it) only carries the local length for the checks."""
    spec = site_spec(site)
    order, keep = site_context(spec, like).plan.region_halo(spec.window - 1, spec.halo_slots)
    return order.clone().to(like.device), keep.clone().to(like.device)


@region_halo_order.register_fake
def _(like, site):
    spec, c = site_spec(site), like.shape[2]
    return like.new_empty((c + spec.halo_slots,), dtype=torch.long), like.new_empty((c,), dtype=torch.long)


def emit_region_halo(graph: fx.Graph, t: fx.Node, spec: SiteSpec) -> tuple[fx.Node, fx.Node, fx.Node]:
    """Insert the halo of a causal region: ``t`` (``[B, H, c, D]``, this rank's tokens along dim 2), its routing
    and order; returns ``(halo, order, keep)``: the ``[B, H, S, D]`` halo slots (:func:`halo_exchange`, zeros
    where empty) and :func:`region_halo_order`'s outputs."""
    ref = graph.call_method("detach", (t,))
    routing = graph.call_function(torch.ops.cpcompile.halo_routing.default, (ref, spec.site))
    send_slots, counts = (graph.call_function(operator.getitem, (routing, i)) for i in range(2))
    halo = graph.call_function(torch.ops.cpcompile.halo_exchange.default, (t, send_slots, counts, spec.site))
    order_keep = graph.call_function(torch.ops.cpcompile.region_halo_order.default, (ref, spec.site))
    order, keep = (graph.call_function(operator.getitem, (order_keep, i)) for i in range(2))
    return halo, order, keep


def emit_gather_start(graph: fx.Graph, t: fx.Node, spec: SiteSpec, ready: fx.Node | None = None) -> fx.Node:
    """Insert the all-gather of ``t`` right after ``ready`` (default ``t``): the node after which ``t``'s value is
    final, so the transfer overlaps the work until attention."""
    with graph.inserting_after(after_placeholders(graph, t if ready is None else ready)):
        return graph.call_function(_compat.all_gather_start, (t, spec.cp_size, spec.group_name))


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
    context = site_context(spec, k)
    plan = context.plan
    bound = _kernels.bind_mods(site, tensors, int(seq_len), heads)
    r = plan.cp_rank
    others = torch.cat([plan.indices[:r], plan.indices[r + 1 :]]).flatten()
    seen = bound.keys_seen(plan.batch_size, q_pos, others, block, ROUTING_KEYS)
    mine = torch.zeros(plan.padded_len, dtype=torch.uint8, device=q_pos.device)
    mine[others[seen]] = 1
    every = mine.new_empty((plan.cp_size * plan.padded_len,))
    _compat.all_gather_into(every, mine, site_group(spec))
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
