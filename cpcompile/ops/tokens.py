"""Tokens: the ops that give the positions and mixing passes this rank's tokens.

``cpcompile::token_positions`` (the global index of every local token, for positions the model computes itself),
``cpcompile::real_tokens`` (which local tokens are not padding) and ``cpcompile::sequence_order`` (the order that
puts a tensor all-gathered along the sequence into global token order, for :mod:`cpcompile.passes.mixing`).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from cpcompile import _compat
from cpcompile.ops.check import exchange_round
from cpcompile.ops.sites import SiteSpec
from cpcompile.runtime.context import Active, active_context


def emit_buffer_gather(graph: fx.Graph, t: fx.Node, dim: int, spec: SiteSpec) -> fx.Node:
    """Insert the all-gather of a per-token tensor ``t`` (this rank's tokens along ``dim``) into global token
    order (:func:`emit_sequence_gather`; bools travel as uint8); returns the whole-sequence tensor."""
    value = t.meta.get("example_value", t.meta.get("val"))
    is_bool = isinstance(value, torch.Tensor) and value.dtype == torch.bool
    src = graph.call_method("to", (t, torch.uint8)) if is_bool else t
    whole, _ = emit_sequence_gather(graph, src, dim, spec.cp_size, spec.group_name, spec.site)
    return graph.call_method("to", (whole, torch.bool)) if is_bool else whole


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


def chunk_context(like: torch.Tensor, dim: int, cp_size: int, what: str) -> Active:
    """The active shard context, checked against an op compiled for a CP group of ``cp_size`` ranks whose input
    ``like`` has this rank's tokens along ``dim``; ``RuntimeError`` naming ``what`` when the group size or the
    local length differs from the active plan's."""
    context = active_context(what)
    plan = context.plan
    if plan.cp_size != cp_size:
        raise RuntimeError(
            f"{what} was compiled for a CP group of size {cp_size}, but the active shard context has size "
            f"{plan.cp_size}; pass the same cp_group to cpcompile.backend and cpcompile.shard"
        )
    if like.shape[dim] != plan.chunk_len:
        raise RuntimeError(
            f"{what} got {like.shape[dim]} tokens along dim {dim}, but the active plan expects this rank's chunk "
            f"length {plan.chunk_len}; call the model with the `local` batch of the active cpcompile.shard context"
        )
    return context


@torch.library.custom_op("cpcompile::sequence_order", mutates_args=())
def sequence_order(
    like: torch.Tensor, dim: int, cp_size: int, needs_grad: bool, site: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order [N * c], local [c])`` of the active plan for a region of :mod:`cpcompile.passes.mixing`.

    A tensor all-gathered over the CP group (rank-major chunks of ``c`` tokens along ``dim``) is in global token
    order after ``index_select(dim, order)``, padding tokens last; ``local`` are this rank's global token indices,
    which take its tokens back from a tensor in token order. ``like`` (detached) has this rank's ``c`` tokens
    along ``dim``: only its size and device are read, and its bytes are counted as one sequence all-gather
    (``CommStats.sequence_gathers``; with ``needs_grad``, one reduce-scatter in backward). Holds the region's
    control round first (:func:`~cpcompile.ops.check.exchange_round`).
    """
    context = chunk_context(like, dim, cp_size, f"the sequence-mixing op at {site}")
    exchange_round(context, site, "the sequence-mixing op")
    plan = context.plan
    context.comm.record_sequence_gather(like, cp_size, needs_grad)
    order = plan.gathered_order()
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
