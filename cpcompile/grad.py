"""Gradients under CP: ``sync_grads`` sums plain gradients over the CP group, ``clip_grad_norm_`` takes the global
norm of FSDP2 (DTensor) and plain gradients in one reduction.

Main API::

    cpcompile.sync_grads(model.parameters(), cp_group)                   # models not wrapped in FSDP/DDP
    norm = cpcompile.clip_grad_norm_(model.parameters(), max_norm=1.0)   # true pre-clip global norm
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from cpcompile import _compat, failsafe

__all__ = ["clip_grad_norm_", "sync_grads"]


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip gradients to a global norm of ``max_norm`` and return the norm before clipping.

    Same meaning as ``torch.nn.utils.clip_grad_norm_`` on the whole unsharded model: the ``norm_type``-norm of
    all gradients concatenated, scaling every gradient by ``max_norm / (norm + 1e-6)`` when that is below 1.

    - DTensor gradients (FSDP2): each rank adds ``|g|^p`` of its local shard (``max`` for the inf norm), and the
      parts are reduced over the mesh dimensions the gradient is ``Shard``-ed on; a ``Replicate`` dimension is
      not reduced, so a replicated gradient is counted once. ``Partial`` (unreduced) gradients are refused.
    - Plain gradients are taken to be identical on every rank (replicated: DDP, or after
      :func:`cpcompile.sync_grads`) and are counted once, without communication.

    The sum is accumulated on the device and reduced once per group the gradients are sharded over (one
    all-reduce for an FSDP2 model; an all-gather of one scalar for the inf norm), with no host synchronisation.
    Parameters without a gradient count as zeros; a sharded (DTensor) parameter without a gradient on this rank
    still takes part in its mesh's reduction, so ranks whose gradients exist on different parameters (MoE
    experts reached on some ranks only) issue the same collectives.

    Non-finite norms are reported, not hidden: the returned norm is ``inf``/``nan`` and the gradients are left
    unscaled (skip the optimizer step when ``not torch.isfinite(norm)``); with ``error_if_nonfinite=True`` a
    ``RuntimeError`` is raised instead (this checks the value on the host).

    Returns:
        the total norm as a plain 0-dim float tensor (the full value on every rank, not a DTensor), on the
        gradients' device.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    norm_type = _check_norm_type(norm_type)
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm >= 0:
        raise ValueError(f"max_norm must be a non-negative number, got {max_norm!r}")
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    # a sharded parameter without a gradient on this rank (an MoE expert no local token reached) still takes
    # part in its mesh's reduction with a zero part, so every rank issues the same reductions
    absent = [p for p in parameters if p.grad is None and isinstance(p, DTensor)]
    if not grads and not absent:
        return torch.tensor(0.0)
    first = grads[0] if grads else absent[0]
    device = (first.to_local() if isinstance(first, DTensor) else first).device
    inf = math.isinf(norm_type)

    replicated: list[torch.Tensor] = []
    sharded: dict[tuple[dist.ProcessGroup, ...], list[torch.Tensor]] = {}
    locals_: list[torch.Tensor] = []
    with torch.no_grad():
        for p in absent:
            groups = tuple(p.device_mesh.get_group(d) for d, pl in enumerate(p.placements) if pl.is_shard())
            if groups:
                sharded.setdefault(groups, []).append(p.to_local().new_zeros(0))
        for g in grads:
            if isinstance(g, DTensor):
                local = g.to_local()
                groups = []
                for dim, placement in enumerate(g.placements):
                    if placement.is_partial():
                        raise ValueError(
                            f"a DTensor gradient of shape {tuple(g.shape)} has a Partial placement {g.placements} "
                            "(its ranks hold unreduced parts); reduce it first (FSDP2 does so in backward) or "
                            "redistribute it to Shard/Replicate before clipping"
                        )
                    if placement.is_shard():
                        groups.append(g.device_mesh.get_group(dim))
                (sharded.setdefault(tuple(groups), []) if groups else replicated).append(local)
            else:
                local = g
                replicated.append(local)
            locals_.append(local)

        total = _local_part(replicated, norm_type, device)
        # the same order on every rank, whichever parameters have a gradient here
        for groups, tensors in sorted(sharded.items(), key=lambda kv: [_compat.group_name_of(g) for g in kv[0]]):
            part = _local_part(tensors, norm_type, device)
            for group in groups:
                part = _reduce(part, group, inf)
            total = torch.maximum(total, part) if inf else total + part
        norm = total if inf else total ** (1.0 / norm_type)

        if error_if_nonfinite and not bool(torch.isfinite(norm)):
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is non-finite ({norm.item()}), so it cannot "
                "be clipped; find the inf/nan gradient (anomaly detection, a lower learning rate, loss scaling) or "
                "pass error_if_nonfinite=False to get the norm back and skip the step"
            )
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        coef = torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))
        for local in locals_:
            local.mul_(coef.to(local.device))
    return norm


def _check_norm_type(norm_type: float) -> float:
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise TypeError(f"norm_type must be a number (e.g. 2.0 or float('inf')), got {type(norm_type).__name__}")
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type must be positive or inf, got {norm_type}; use 2.0 or float('inf')")
    return norm_type


def _local_part(tensors: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """``sum |t|^p`` (``max |t|`` for the inf norm) over this rank's ``tensors``, as a float32+ 0-dim tensor."""
    acc = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    parts = [torch.linalg.vector_norm(t, norm_type, dtype=acc).to(device) for t in tensors if t.numel() > 0]
    if not parts:
        return torch.zeros((), dtype=acc, device=device)
    norms = torch.stack(parts)
    if math.isinf(norm_type):
        return norms.max()
    return (norms**norm_type).sum()


def _reduce(part: torch.Tensor, group: dist.ProcessGroup, inf: bool) -> torch.Tensor:
    """Sum (``max`` for the inf norm) of ``part`` over ``group``, keeping a NaN on any rank a NaN on every rank."""
    if not inf:
        part = part.clone()
        dist.all_reduce(part, group=group)  # a sum: inf and nan propagate
        return part
    # MAX reductions may drop NaN (comparisons with NaN are false); gathering and taking amax keeps it.
    gathered = part.new_empty(dist.get_world_size(group))
    _compat.all_gather_into(gathered, part.reshape(1), group)
    return gathered.amax()


def sync_grads(parameters, cp_group: dist.ProcessGroup) -> None:
    """Sum the gradients of ``parameters`` over ``cp_group`` (for models not wrapped in FSDP/DDP).

    Each CP rank's gradient is the partial sum over its own tokens; after this call every rank holds the
    gradient of the whole sequence. A parameter whose gradient is ``None`` on some ranks only (an MoE expert
    that only some ranks' tokens were routed to) contributes zeros there and gets the sum everywhere; one that
    has no gradient on any rank stays ``None``. Every rank must pass the same parameters in the same order
    (``ValueError`` on every rank otherwise). Two small all-reduces (the number of parameters, which gradients
    exist), then one flat all-reduce per dtype.
    """
    if isinstance(parameters, torch.nn.Module):  # the same on every rank: raised before any collective
        raise TypeError(
            f"cpcompile.sync_grads expects the parameters to sum, got the module {type(parameters).__name__}; "
            "pass model.parameters()"
        )
    with failsafe.scope(cp_group, "cpcompile.sync_grads"):
        _sum_grads(list(parameters), cp_group)


def _sum_grads(params: list[torch.Tensor], cp_group: dist.ProcessGroup) -> None:
    if not params:
        return
    device = params[0].device
    n = len(params)
    # every rank passes as many parameters (a fixed-size all-reduce first), then which gradients exist anywhere
    count = torch.tensor([n, -n], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=cp_group)
    if int(count[0]) != n or int(count[1]) != -n:
        raise ValueError(
            f"cpcompile.sync_grads: the CP ranks passed different numbers of parameters (between "
            f"{-int(count[1])} and {int(count[0])}); pass the same model's parameters, in the same order, on "
            "every rank"
        )
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    dist.all_reduce(present, op=dist.ReduceOp.MAX, group=cp_group)
    grads = []
    for p, anywhere in zip(params, present.tolist()):
        if not anywhere:
            continue
        if p.grad is None:  # another rank's tokens reached this parameter: this rank's part is zero
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for group in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in group])
        dist.all_reduce(flat, group=cp_group)
        offset = 0
        for g in group:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
