"""Head-parallel exchanges: the all-to-alls between the sequence split and the head split of a tensor.

Under a plan every rank holds ``c`` tokens of every head (``plan.token_indices()``). A head-parallel region runs
on the whole sequence for ``H / N`` heads instead: rank ``r`` holds heads ``[r * H/N, (r + 1) * H/N)`` of all
``N * c`` tokens, in global token order with the padding last, as the one-process model holds its padded
sequence::

    order = cpcompile::heads_order(x.detach(), seq_dim, cp_size, site)      # [N * c]: plan.gathered_order()
    y = cpcompile::heads_from_sequence(x, order, seq_dim, head_dim, group_name, site, needs_grad)
    ...                                                                      # y: N * c tokens, H / N heads
    x2 = cpcompile::sequence_from_heads(y2, order, seq_dim, head_dim, group_name, site, needs_grad)

Each exchange is one ``all_to_all_single`` of ``N`` equal chunks over the group named ``group_name``, then (into
heads) or before it (back to the sequence split) the permutation between rank-major chunks and token order:
:meth:`cpcompile.plan.CPPlan.gathered_order`, the permutation :func:`~cpcompile.ops.tokens.sequence_order` gives
the all-gathered regions. The backward of each exchange is the other. The permutation is an input, made by
``heads_order`` while the plan is active, so neither exchange reads the plan: a backward that runs after the
shard context ended needs none. ``H`` must be a multiple of ``N`` (``ValueError`` otherwise, the same on every
rank before anything is sent).

Both count their all-to-all in the active context's :class:`~cpcompile.runtime.comm.CommStats` (``heads_*``): the
bytes received from the other ranks, ``(N - 1) / N`` of the tensor, and with ``needs_grad`` (the input needs a
gradient) the same again for the reverse all-to-all of its backward, which is counted there and not when it runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx

from cpcompile import _compat
from cpcompile.ops.check import exchange_round
from cpcompile.ops.tokens import chunk_context
from cpcompile.runtime.context import active_context, current_plan


def _what(site: str) -> str:
    return f"the head-parallel exchange at {site}"


def _dims(t: torch.Tensor, seq_dim: int, head_dim: int, site: str) -> tuple[int, int]:
    n = t.dim()
    if not (-n <= seq_dim < n and -n <= head_dim < n) or seq_dim % n == head_dim % n:
        raise ValueError(
            f"{_what(site)} got seq_dim={seq_dim} and head_dim={head_dim} for a tensor of {n} dims "
            f"(shape {tuple(t.shape)}), but expected two different dims of it; pass the dims of its tokens and heads"
        )
    return seq_dim % n, head_dim % n


def _group(group_name: str, site: str) -> dist.ProcessGroup:
    group = _compat.resolve_group(group_name)
    if group is None:
        raise RuntimeError(f"the CP group {group_name!r} of {_what(site)} is not registered in this process")
    return group


def _heads_per_rank(heads: int, cp_size: int, site: str) -> int:
    if heads % cp_size != 0:
        raise ValueError(
            f"{_what(site)} got {heads} heads, but a CP group of {cp_size} ranks needs a number of heads that is a "
            f"multiple of {cp_size} (every rank takes H / {cp_size} of them); pad the heads to a multiple of "
            f"{cp_size} before the exchange (as cpcompile.cores does) or use a CP size that divides {heads}"
        )
    return heads // cp_size


def _check_order(order: torch.Tensor, tokens: int, site: str) -> None:
    if order.dim() != 1 or order.shape[0] != tokens:
        raise RuntimeError(
            f"{_what(site)} got a token order of shape {tuple(order.shape)}, but its tensor has {tokens} tokens in "
            "all ranks; pass the order cpcompile::heads_order gave for this tensor's local length"
        )


def _count(recv: torch.Tensor, cp_size: int, needs_grad: bool, site: str) -> None:
    """Record one all-to-all that received ``recv`` (``[N, ...]``, one chunk per rank, this rank's own kept) in the
    active context's CommStats. In the autograd engine's backward, a call without ``needs_grad`` is the gradient of
    the other exchange (counted with it) and counts nothing; a call with it is a forward run again (activation
    checkpointing), whose bytes move again and whose gradient was counted once."""
    in_backward = _compat.in_backward()
    if in_backward and not needs_grad:
        return
    nbytes = (cp_size - 1) * recv[0].numel() * recv.element_size()
    active_context(_what(site)).comm.record_heads(nbytes, needs_grad and not in_backward, site)


@torch.library.custom_op("cpcompile::heads_order", mutates_args=())
def heads_order(like: torch.Tensor, seq_dim: int, cp_size: int, site: str) -> torch.Tensor:
    """Int64 ``[N * c]``: the active plan's permutation from rank-major chunks to token order
    (:meth:`~cpcompile.plan.CPPlan.gathered_order`), for the exchanges of a tensor whose local tokens ``like``
    (detached; only its size and device are read) has along ``seq_dim``. ``RuntimeError`` when the group size or the
    local length is not the active plan's. Holds the exchanges' control round first
    (:func:`~cpcompile.ops.check.exchange_round`)."""
    context = chunk_context(like, seq_dim, cp_size, _what(site))
    exchange_round(context, site, "the head-parallel exchange")
    return context.plan.gathered_order().to(like.device)


@heads_order.register_fake
def _(like, seq_dim, cp_size, site):
    _check_traced_length(like, seq_dim, site)
    return like.new_empty((cp_size * like.shape[seq_dim],), dtype=torch.long)


def _check_traced_length(like: torch.Tensor, seq_dim: int, site: str) -> None:
    """While a graph is traced under a :func:`cpcompile.shard` context: ``ValueError`` when ``like``'s size along
    ``seq_dim`` (its value at this trace, no guard taken) is not the plan's chunk length, so that a core registered
    with the wrong dims is refused naming them rather than failing in its own code on exchanged shapes."""
    plan = current_plan()
    n = like.dim()
    if plan is None or not -n <= seq_dim < n:
        return
    tokens = _compat.sym_hint(like.shape[seq_dim])
    if tokens is not None and tokens != plan.chunk_len:
        raise ValueError(
            f"{_what(site)} got a per-token tensor of shape {tuple(like.shape)} with {tokens} along seq_dim={seq_dim}, "
            f"but this rank holds {plan.chunk_len} tokens of the sequence; {_registration_fix(site)}"
        )


def _registration_fix(site: str) -> str:
    """How to register the core ``site`` with the dims of its layout."""
    from cpcompile import cores

    if cores.CORES.get(site) == "replicated":
        return "pass the dim of the sequence as seq_dim to cpcompile.cores.register_replicated"
    return (
        "pass the dim of the sequence as seq_dim (and the dim of the heads as head_dim) to "
        "cpcompile.cores.register_head_parallel"
    )


@torch.library.custom_op("cpcompile::heads_from_sequence", mutates_args=())
def heads_from_sequence(
    x: torch.Tensor, order: torch.Tensor, seq_dim: int, head_dim: int, group_name: str, site: str, needs_grad: bool
) -> torch.Tensor:
    """The whole sequence for this rank's heads: ``x`` has this rank's ``c`` tokens along ``seq_dim`` and all ``H``
    heads along ``head_dim``; the result has the ``N * c`` tokens of every rank in token order (``order``, from
    :func:`heads_order`; padding last) and heads ``[r * H/N, (r + 1) * H/N)`` of rank ``r``, the other dims
    unchanged. One all-to-all; the backward is :func:`sequence_from_heads`."""
    sd, hd = _dims(x, seq_dim, head_dim, site)
    group = _group(group_name, site)
    n = group.size()
    h = _heads_per_rank(x.shape[hd], n, site)
    _check_order(order, n * x.shape[sd], site)
    send = x.unflatten(hd, (n, h)).movedim(hd, 0).contiguous()  # send[s]: rank s's heads of this rank's tokens
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[s]: rank s's tokens of this rank's heads
    _count(recv, n, needs_grad, site)
    rank_major = recv.movedim(0, sd).flatten(sd, sd + 1)
    return rank_major.index_select(sd, order).contiguous()


@heads_from_sequence.register_fake
def _(x, order, seq_dim, head_dim, group_name, site, needs_grad):
    sd, hd = _dims(x, seq_dim, head_dim, site)
    n = _group(group_name, site).size()
    shape = list(x.shape)
    shape[hd] = _heads_per_rank(shape[hd], n, site)
    shape[sd] = n * shape[sd]
    return x.new_empty(shape)


@torch.library.custom_op("cpcompile::sequence_from_heads", mutates_args=())
def sequence_from_heads(
    y: torch.Tensor, order: torch.Tensor, seq_dim: int, head_dim: int, group_name: str, site: str, needs_grad: bool
) -> torch.Tensor:
    """The inverse of :func:`heads_from_sequence`: ``y`` has the ``N * c`` tokens of the sequence in token order
    along ``seq_dim`` (``order`` as there) and this rank's ``H / N`` heads along ``head_dim``; the result has this
    rank's ``c`` tokens and all ``H`` heads (rank ``r``'s at ``[r * H/N, (r + 1) * H/N)``). One all-to-all; the
    backward is :func:`heads_from_sequence`."""
    sd, hd = _dims(y, seq_dim, head_dim, site)
    group = _group(group_name, site)
    n = group.size()
    tokens = y.shape[sd]
    if tokens % n != 0:
        raise ValueError(
            f"{_what(site)} got {tokens} tokens along dim {sd}, but the whole sequence of a CP group of {n} ranks "
            f"has a multiple of {n} (N chunks of c); pass the output of cpcompile::heads_from_sequence"
        )
    _check_order(order, tokens, site)
    rank_major = y.index_select(sd, torch.argsort(order))  # the inverse permutation: rank-major chunks
    send = rank_major.unflatten(sd, (n, tokens // n)).movedim(sd, 0).contiguous()  # send[s]: rank s's tokens
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[s]: rank s's heads of this rank's tokens
    _count(recv, n, needs_grad, site)
    return recv.movedim(0, hd).flatten(hd, hd + 1).contiguous()


@sequence_from_heads.register_fake
def _(y, order, seq_dim, head_dim, group_name, site, needs_grad):
    sd, hd = _dims(y, seq_dim, head_dim, site)
    n = _group(group_name, site).size()
    shape = list(y.shape)
    shape[hd] = n * shape[hd]
    shape[sd] = shape[sd] // n
    return y.new_empty(shape)


@torch.library.custom_op("cpcompile::heads_refusal", mutates_args=())
def heads_refusal(like: torch.Tensor, message: str) -> torch.Tensor:
    """Raise ``ValueError(message)``: a head-parallel core's refusal, put in the graph by the core's replacement
    while Dynamo traces it. Its fake implementation raises too, so the refusal stops the compile on every rank
    (Dynamo reports it as a ``TorchRuntimeError`` with the message); a ``raise`` in traced Python code would
    make Dynamo run the frame without the graph instead."""
    raise ValueError(message)


@heads_refusal.register_fake
def _(like, message):
    raise ValueError(message)


def _setup_context(ctx, inputs, output):
    _, order, seq_dim, head_dim, group_name, site, _ = inputs
    ctx.save_for_backward(order)
    ctx.args = (seq_dim, head_dim, group_name, site)


def _backward_by(op):
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return op(grad, order, *ctx.args, False), None, None, None, None, None, None

    return backward


heads_from_sequence.register_autograd(
    _backward_by(torch.ops.cpcompile.sequence_from_heads.default), setup_context=_setup_context
)
sequence_from_heads.register_autograd(
    _backward_by(torch.ops.cpcompile.heads_from_sequence.default), setup_context=_setup_context
)


def _needs_grad(t: fx.Node) -> bool:
    value = t.meta.get("example_value", t.meta.get("val"))
    return bool(isinstance(value, torch.Tensor) and value.requires_grad)


def emit_heads_from_sequence(
    graph: fx.Graph, t: fx.Node, seq_dim: int, head_dim: int, cp_size: int, group_name: str, site: str
) -> tuple[fx.Node, fx.Node]:
    """Insert :func:`heads_order` and :func:`heads_from_sequence` of ``t``; returns ``(heads, order)``, ``order`` for
    the way back (:func:`emit_sequence_from_heads`)."""
    ref = graph.call_method("detach", (t,))
    order = graph.call_function(torch.ops.cpcompile.heads_order.default, (ref, seq_dim, cp_size, site))
    args = (t, order, seq_dim, head_dim, group_name, site, _needs_grad(t))
    return graph.call_function(torch.ops.cpcompile.heads_from_sequence.default, args), order


def emit_sequence_from_heads(
    graph: fx.Graph, y: fx.Node, order: fx.Node, seq_dim: int, head_dim: int, group_name: str, site: str
) -> fx.Node:
    """Insert :func:`sequence_from_heads` of ``y`` under the ``order`` of :func:`emit_heads_from_sequence`."""
    args = (y, order, seq_dim, head_dim, group_name, site, _needs_grad(y))
    return graph.call_function(torch.ops.cpcompile.sequence_from_heads.default, args)
