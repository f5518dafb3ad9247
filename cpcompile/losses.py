"""Per-token outputs for RL-style losses under context parallelism: log-probs, entropy, per-sample means.

Every CP rank holds one chunk of each sequence (inside :func:`cpcompile.shard`). Two ways to write a loss:

1. **Gather, then compute on full sequences** (any loss)::

       logp = cpcompile.gather(cpcompile.token_logprobs(out.logits, local["shift_labels"]))   # [B, T], differentiable
       loss = my_policy_loss(logp, ...)            # the SAME full-sequence loss on every CP rank

   ``gather``'s backward hands each rank the gradient of its own chunk, so the CP ranks' parameter gradients add up
   to the full loss's gradient (sum them: FSDP2 via :func:`cpcompile.fully_shard_dp_cp`, or
   :func:`cpcompile.sync_grads`). Every CP rank holds the whole loss value: do not add the values over CP.

2. **Local numerator, full-sample denominator** (losses that are means, no gather of per-token tensors)::

       mask = local["shift_labels"] != -100
       loss = cpcompile.per_sample_mean(-logp_local * local["advantages"], mask, dp_group=dp_group)

   Each rank's value is its share; the values and the gradients add up over the CP (and DP) ranks.

Targets follow ``shard``'s ``shift_labels``: position ``t`` holds the id of token ``t + 1`` (``-100``: no target).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cpcompile.plan import IGNORE_INDEX
from cpcompile.runtime import active_context

__all__ = ["token_logprobs", "token_entropy", "per_sample_mean"]


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """``log softmax(logits / temperature)[..., target]`` per token, in float32; 0 where ``target == ignore_index``.

    ``logits`` ``[B, c, V]`` and ``targets`` ``[B, c]`` (e.g. ``out.logits`` and ``local["shift_labels"]``).
    Differentiable with respect to ``logits``. Works on any chunk (no collective): gather the result with
    :func:`cpcompile.gather` for full sequences.
    """
    _check_logits(logits, targets, temperature)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    ignored = targets == ignore_index
    picked = logp.gather(-1, targets.masked_fill(ignored, 0).unsqueeze(-1)).squeeze(-1)
    return picked.masked_fill(ignored, 0.0)


def token_entropy(logits: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """Entropy ``-sum_v p log p`` of the next-token distribution at every position, ``[B, c]``, in float32."""
    _check_logits(logits, None, temperature)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def per_sample_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    dp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """This rank's share of the mean over samples of each sample's masked token mean.

    A sample is a packed document of the active :func:`cpcompile.shard` batch (a whole row when rows are not
    packed). With ``values`` and ``mask`` this rank's ``[B, c]`` chunks, the result is
    ``sum_s (sum_{t in s, this rank} mask * values) / (sum_{t in s, all ranks} mask) / S``: a local numerator
    over the full sample's denominator, so the results of the CP ranks add up to
    ``mean_s (masked mean of values over sample s)`` exactly, and their gradients too. ``S`` counts the samples
    with a non-zero mask, summed over ``dp_group`` when given (each DP rank holds different rows), so that the
    results of all DP and CP ranks add up to the mean over the global batch's samples.

    Padding tokens added by ``shard`` are never counted. At most two small all-reduces (the per-sample token
    counts over the CP group, the sample count over ``dp_group``); differentiable with respect to ``values``.

    Args:
        values: ``[B, c]`` per-token values on this rank's chunk (e.g. ``-logp * advantages``).
        mask: ``[B, c]`` bool or 0/1 weights: which tokens count (e.g. ``local["shift_labels"] != -100``).
        dp_group: the data-parallel group, when the global batch is split over DP ranks.
    """
    context = active_context("cpcompile.per_sample_mean")
    plan = context.plan
    shape = (plan.batch_size, plan.chunk_len)
    for name, t in (("values", values), ("mask", mask)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"per_sample_mean: {name} must be a tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape:
            raise ValueError(
                f"per_sample_mean: {name} has shape {tuple(t.shape)}, expected this rank's chunk [B, c] = "
                f"{list(shape)}; pass per-token tensors of the active shard context's `local` batch"
            )
    doc = plan.local(plan.doc_ids).to(values.device)
    real = (plan.token_indices().to(values.device) < plan.seq_len).expand(shape)
    weight = mask.to(torch.float32) * real
    num_docs = int(plan.doc_ids.max()) + 1
    den = torch.zeros(shape[0], num_docs, device=values.device).scatter_add_(1, doc, weight)
    if plan.cp_size > 1:
        dist.all_reduce(den, group=context.group)
    num = torch.zeros(shape[0], num_docs, device=values.device).scatter_add(1, doc, values.float() * weight)
    present = den > 0
    count = present.sum().to(torch.float32)
    if dp_group is not None:
        dist.all_reduce(count, group=dp_group)
    per_sample = torch.where(present, num / den.clamp(min=1e-30), torch.zeros_like(num))
    return per_sample.sum() / count.clamp(min=1.0)


def _check_logits(logits: torch.Tensor, targets: torch.Tensor | None, temperature: float) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() < 2 or not logits.dtype.is_floating_point:
        raise TypeError(
            f"logits must be a floating-point [..., V] tensor, got "
            f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}"
        )
    if targets is not None and tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"targets have shape {tuple(targets.shape)}, expected logits' shape without the vocabulary dim "
            f"{tuple(logits.shape[:-1])}; pass local['shift_labels'] with the logits of the same local batch"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature!r}")
