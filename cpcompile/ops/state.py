"""State passing: the ops that let a recurrence affine in its state run on each rank's own tokens.

A rank's tokens are runs of consecutive global indices (one with the contiguous layout, up to
:data:`cpcompile.layouts.MAX_RUNS` with the others). A recurrent core run on each run alone from a known start
state gives, per run, a fixed-size summary of its effect on the state (:mod:`cpcompile.cores`); the summaries of
every run of every rank, folded in global token order, give each run the state it starts from::

    slots, order = cpcompile::state_runs(x.detach(), seq_dim, cp_size, runs, site)  # [c], [N * runs]
    x = cpcompile::state_input(x, site)      # each input of the core: a contiguous copy (and gradient)
    ...                                      # the core once per run slot, on the tokens of that run only
    every = cpcompile::state_gather(summary, group_name, site, needs_grad)  # [N, *summary.shape]
    ...                                      # fold in ``order``, correct this rank's outputs
    out = cpcompile::state_output(y, site)   # the end of the region (a copy)

``state_runs`` reads the active plan: ``slots[i]`` is the run (``0 .. runs - 1``, in ascending global order) of
local token ``i``, and ``order`` lists the ``N * runs`` slots of all ranks (``rank * runs + slot``) by the global
index their run starts at; a rank with fewer runs than ``runs`` has empty slots, listed last. ``runs`` is the
number of slots the graph was traced for, at least the plan's largest number of runs per rank (``RuntimeError``
otherwise). ``state_gather`` is one all-gather over the group (its backward, ``state_reduce_scatter``: the
gradients of every rank's copy, summed, each rank keeping its own slice); both count their bytes in the active
context's :class:`~cpcompile.runtime.comm.CommStats` (``state_*``), as the heads exchanges do: the bytes received
from the other ranks, ``(N - 1) / N`` of the gathered tensor, and with ``needs_grad`` the same again for the
backward, counted there and not when it runs. ``state_output`` marks where the values computed from other ranks'
summaries are back to this rank's tokens (:mod:`cpcompile.passes.mixing` reports the region as ``state_passing``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cpcompile import _compat
from cpcompile.ops.check import exchange_round
from cpcompile.ops.tokens import chunk_context
from cpcompile.runtime.context import active_context


def _what(site: str) -> str:
    return f"the state passing of {site}"


def _group(group_name: str, site: str) -> dist.ProcessGroup:
    group = _compat.resolve_group(group_name)
    if group is None:
        raise RuntimeError(f"the CP group {group_name!r} of {_what(site)} is not registered in this process")
    return group


@torch.library.custom_op("cpcompile::state_runs", mutates_args=())
def state_runs(
    like: torch.Tensor, seq_dim: int, cp_size: int, runs: int, site: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slots [c], order [N * runs])``, int64, of the active plan for a tensor whose local tokens ``like``
    (detached; only its size and device are read) has along ``seq_dim`` (see the module docstring). Holds the
    state exchange's control round first (:func:`~cpcompile.ops.check.exchange_round`)."""
    context = chunk_context(like, seq_dim, cp_size, _what(site))
    exchange_round(context, site, "the state passing")
    plan = context.plan
    starts = []
    slots = None
    for rank in range(plan.cp_size):
        idx = plan.token_indices(rank)
        new_run = torch.ones_like(idx, dtype=torch.bool)
        new_run[1:] = torch.diff(idx) != 1
        count = int(new_run.sum())
        if count > runs:
            raise RuntimeError(
                f"{_what(site)} was traced for {runs} runs per rank, but rank {rank} holds {count} runs of the "
                "active plan; the number of runs is part of what the compiled graph is guarded on, so call the "
                "model inside the cpcompile.shard context of this batch"
            )
        if rank == plan.cp_rank:
            slots = torch.cumsum(new_run.long(), 0) - 1
        first = idx[new_run].tolist()
        starts += first + [plan.padded_len + rank * runs + j for j in range(runs - count)]  # empty slots: last
    order = torch.argsort(torch.tensor(starts, dtype=torch.long))
    return slots.to(like.device), order.to(like.device)


@state_runs.register_fake
def _(like, seq_dim, cp_size, runs, site):
    return like.new_empty((like.shape[seq_dim],), dtype=torch.long), like.new_empty((cp_size * runs,), dtype=torch.long)


def _count(t: torch.Tensor, cp_size: int, needs_grad: bool, site: str) -> None:
    """Record one all-gather of ``t`` (this rank's part) in the active context's CommStats; a call in the autograd
    engine's backward (activation checkpointing runs the forward again) counts its bytes but not its gradient."""
    nbytes = (cp_size - 1) * t.numel() * t.element_size()
    active_context(_what(site)).comm.record_state(nbytes, needs_grad and not _compat.in_backward(), site)


@torch.library.custom_op("cpcompile::state_gather", mutates_args=())
def state_gather(x: torch.Tensor, group_name: str, site: str, needs_grad: bool) -> torch.Tensor:
    """``[N, *x.shape]``: every rank's ``x``, rank-major. One all-gather; the backward is
    :func:`state_reduce_scatter`."""
    group = _group(group_name, site)
    n = group.size()
    part = x.contiguous()
    out = part.new_empty((n * part.shape[0], *part.shape[1:]))  # rank-major along dim 0
    _compat.all_gather_into(out, part, group)
    _count(part, n, needs_grad, site)
    return out.view(n, *part.shape)


@state_gather.register_fake
def _(x, group_name, site, needs_grad):
    return x.new_empty((_group(group_name, site).size(), *x.shape))


@torch.library.custom_op("cpcompile::state_reduce_scatter", mutates_args=())
def state_reduce_scatter(grad: torch.Tensor, group_name: str, site: str) -> torch.Tensor:
    """The backward of :func:`state_gather`: ``grad`` (``[N, ...]``, this rank's gradient of every rank's part)
    summed over the ranks, this rank's part kept (an all-to-all, then the sum in rank order)."""
    group = _group(group_name, site)
    send = grad.contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[s]: rank s's gradient of this rank's part
    return recv.sum(0)


@state_reduce_scatter.register_fake
def _(grad, group_name, site):
    return grad.new_empty(grad.shape[1:])


def _gather_context(ctx, inputs, output):
    _, group_name, site, _ = inputs
    ctx.args = (group_name, site)


def _gather_backward(ctx, grad):
    return torch.ops.cpcompile.state_reduce_scatter(grad, *ctx.args), None, None, None


state_gather.register_autograd(_gather_backward, setup_context=_gather_context)


@torch.library.custom_op("cpcompile::state_input", mutates_args=())
def state_input(x: torch.Tensor, site: str) -> torch.Tensor:
    """A contiguous copy of ``x``, an input of a state-passing region; its backward is this op again, so the
    gradient the model gets back is contiguous at run time as Dynamo traced it (the core's padding to whole chunks
    gives its gradients other strides at run time when the length needs none: pytorch/pytorch#144187)."""
    return x.clone(memory_format=torch.contiguous_format)


@state_input.register_fake
def _(x, site):
    return x.new_empty(x.shape)


def _input_context(ctx, inputs, output):
    ctx.site = inputs[1]


state_input.register_autograd(
    lambda ctx, grad: (torch.ops.cpcompile.state_input(grad, ctx.site), None), setup_context=_input_context
)


@torch.library.custom_op("cpcompile::state_output", mutates_args=())
def state_output(y: torch.Tensor, site: str) -> torch.Tensor:
    """A contiguous copy of ``y``: the end of a state-passing region (``y`` holds this rank's tokens' outputs).
    Contiguous whatever ``y``'s strides, in the fake implementation too, so that the views the model takes of it
    hold at every length (the strides of ``y`` at run time need not be those Dynamo traced)."""
    return y.clone(memory_format=torch.contiguous_format)


@state_output.register_fake
def _(y, site):
    return y.new_empty(y.shape)


state_output.register_autograd(lambda ctx, grad: (grad, None), setup_context=lambda ctx, inputs, output: None)
