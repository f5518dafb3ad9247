"""``cpcompile::flex_cp_attention``: a rewritten flex_attention site run by the block loop of
:mod:`cpcompile.kernels.attention`, with the site's ``mask_mod`` and ``score_mod`` (:mod:`cpcompile.kernels.flex_mods`)
evaluated at global indices instead of the plan's visibility rule. It runs on every device.
"""

from __future__ import annotations

import math

import torch

from cpcompile.kernels.attention import _loop_backward, _loop_forward
from cpcompile.kernels.flex_mods import bind_mods
from cpcompile.layouts import DEFAULT_BLOCK_SIZE

__all__ = ["flex_cp_attention"]


def _check_flex(q, k, v, q_pos, kv_pos, block_q, block_k) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"flex_cp_attention expects [B, H, T, D] q/k/v, got {q.dim()}-D/{k.dim()}-D/{v.dim()}-D")
    if k.shape[0] != q.shape[0] or v.shape[:3] != k.shape[:3] or k.shape[3] != q.shape[3] or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"flex_cp_attention: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not match; expected "
            "k [B, Hkv, T, D], v [B, Hkv, T, Dv] with Hkv dividing the query heads"
        )
    if tuple(q_pos.shape) != (q.shape[2],) or tuple(kv_pos.shape) != (k.shape[2],):
        raise ValueError(
            f"flex_cp_attention: q_pos {tuple(q_pos.shape)} and kv_pos {tuple(kv_pos.shape)} must hold one global "
            f"index per query ({q.shape[2]}) and per key ({k.shape[2]})"
        )
    if block_q < 1 or block_k < 1:
        raise ValueError(f"flex_cp_attention: block sizes must be positive, got {block_q}, {block_k}")


@torch.library.custom_op("cpcompile::flex_cp_attention", mutates_args=())
def _flex_cp_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
    seq_len: torch.Tensor,
    tensors: list[torch.Tensor],
    mods: str,
    scale: float,
    block_q: int,
    block_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, H, c, Dv], logsumexp [B, H, c] fp32, natural log)``; see :func:`flex_cp_attention`."""
    _check_flex(q, k, v, q_pos, kv_pos, block_q, block_k)
    bound = bind_mods(mods, tensors, int(seq_len), q.shape[1])
    return _loop_forward(q, k, v, q_pos, kv_pos, None, None, scale, block_q, block_k, mods=bound)


@_flex_cp_attention_op.register_fake
def _(q, k, v, q_pos, kv_pos, seq_len, tensors, mods, scale, block_q, block_k):
    B, H, c, _ = q.shape
    return q.new_empty((B, H, c, v.shape[3])), q.new_empty((B, H, c), dtype=torch.float32)


@torch.library.custom_op("cpcompile::flex_cp_attention_backward", mutates_args=())
def _flex_cp_attention_backward_op(
    dout: torch.Tensor,
    dlse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
    seq_len: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    tensors: list[torch.Tensor],
    mods: str,
    scale: float,
    block_q: int,
    block_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`flex_cp_attention` (``dlse``: the gradient of its logsumexp)."""
    bound = bind_mods(mods, tensors, int(seq_len), q.shape[1])
    return _loop_backward(
        dout.contiguous(), q, k, v, q_pos, kv_pos, None, out, lse, None, scale, block_q, block_k, bound, dlse
    )


@_flex_cp_attention_backward_op.register_fake
def _(dout, dlse, q, k, v, q_pos, kv_pos, seq_len, out, lse, tensors, mods, scale, block_q, block_k):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _flex_setup_context(ctx, inputs, output):
    q, k, v, q_pos, kv_pos, seq_len, tensors, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, q_pos, kv_pos, seq_len, out, lse, *tensors)
    ctx.args = args


def _flex_backward(ctx, dout, dlse):
    q, k, v, q_pos, kv_pos, seq_len, out, lse, *tensors = ctx.saved_tensors
    dlse = torch.zeros_like(lse) if dlse is None else dlse
    dq, dk, dv = torch.ops.cpcompile.flex_cp_attention_backward(
        dout, dlse, q, k, v, q_pos, kv_pos, seq_len, out, lse, tensors, *ctx.args
    )
    return dq, dk, dv, None, None, None, [None] * len(tensors), None, None, None, None


_flex_cp_attention_op.register_autograd(_flex_backward, setup_context=_flex_setup_context)


def flex_cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
    seq_len: torch.Tensor,
    mods: str,
    *,
    tensors: list[torch.Tensor] = (),
    scale: float | None = None,
    block_q: int = DEFAULT_BLOCK_SIZE,
    block_k: int = DEFAULT_BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flex_attention of local queries at global indices ``q_pos`` against keys at ``kv_pos``; differentiable.

    The block loop of :func:`cp_attention` with the :class:`FlexMods` registered under ``mods``
    (:func:`register_flex_mods`): every (query block, key block) pair's ``mask_mod`` is evaluated at the global
    indices (the block is skipped when nothing in it is visible), ``score_mod`` rewrites the scaled scores of
    the blocks computed, and the backward differentiates through ``score_mod`` block by block. ``seq_len``
    (0-d int64) is the batch's unpadded length: indices at or past it are padding (:class:`BoundMods`); ``tensors``
    are the mods' tensor arguments. Returns ``(out, lse)``, ``lse`` in natural log (``+inf`` for a
    query that sees no key, whose output is 0). Memory: one block of scores and masks per head at a time.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    op = torch.ops.cpcompile.flex_cp_attention
    return op(q, k, v, q_pos, kv_pos, seq_len, list(tensors), mods, scale, block_q, block_k)
