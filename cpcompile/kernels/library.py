"""Library attention kernels behind ``cpcompile::cp_attention`` on CUDA: flex_attention and flash-attn varlen.

Both take the keys sorted by global index (:func:`cpcompile.kernels.attention.cp_attention` sorts them) and give
the plan's mask exactly: flex through a ``BlockMask`` whose ``mask_mod`` is :func:`cpcompile.mask.visible`,
flash-attn through one varlen segment per run of local queries of one document (:func:`varlen_layout`). Each
logs a warning on its first use naming ``benchmarks/gpu_attention.py``, which checks it against dense SDPA on the
GPU at hand.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging

import torch

from cpcompile import _compat
from cpcompile.mask import visible
from cpcompile.plan import visible_blocks

__all__ = ["VarlenLayout", "varlen_layout"]

log = logging.getLogger(__name__)
_WARNED: set[str] = set()


def _warn_unvalidated(path: str) -> None:
    if path not in _WARNED:
        _WARNED.add(path)
        log.warning(
            "cpcompile: the CUDA %s path of cp_attention is checked against dense SDPA on one GPU and torch "
            "version only (BENCHMARKS.md, 'GPU'); run benchmarks/gpu_attention.py on yours, or use "
            "cpcompile.backend(..., attention='dense')",
            path,
        )


def _flex_block_mask(q_pos, kv_pos, doc_ids, window):
    def mask_mod(b, h, q_idx, kv_idx):
        qp, kp = q_pos[q_idx], kv_pos[kv_idx]
        return visible(qp, kp, doc_ids[b, qp], doc_ids[b, kp.clamp(min=0)], window)

    return _compat.flex_block_mask(mask_mod, doc_ids.shape[0], q_pos.shape[0], kv_pos.shape[0], doc_ids.device)


def _flex_forward(q, k, v, q_pos, kv_pos, doc_ids, window, scale, enable_gqa):
    _warn_unvalidated("flex_attention")
    block_mask = _flex_block_mask(q_pos, kv_pos, doc_ids, window)
    out, lse = _compat.flex_attention_with_lse(q, k, v, block_mask, scale, enable_gqa)
    return out.contiguous(), lse.float().contiguous()


@dataclasses.dataclass(frozen=True)
class VarlenLayout:
    """flash-attn varlen segments of one rank: every run of consecutive local queries of one document.

    Queries stay in their ``[B, c]`` order, so segment ``s`` is rows ``cu_q[s]:cu_q[s+1]`` of the flattened
    ``[B * c]`` queries; its keys are ``keys[s] = (b, start, end)``, sorted-key positions from the start of the
    document (or of the window) up to the segment's last query, so bottom-right causal alignment gives exactly
    the plan's mask.
    """

    cu_q: list[int]
    cu_k: list[int]
    keys: list[tuple[int, int, int]]
    max_q: int
    max_k: int


def varlen_layout(
    doc_ids: torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor, window: int | None = None
) -> VarlenLayout:
    """The :class:`VarlenLayout` of queries at ``q_pos`` against sorted keys at ``kv_pos`` (both ascending)."""
    # one-token query blocks: lo = first visible key of each query, hi = one past the query itself
    vb = visible_blocks(doc_ids, q_pos, kv_pos, 1, 1, window)
    lo, hi = vb.lo.tolist(), vb.hi.tolist()
    docs = doc_ids[:, q_pos].tolist()
    pos = q_pos.tolist()
    c = len(pos)
    cu_q, cu_k, keys = [0], [0], []
    for b in range(doc_ids.shape[0]):
        i = 0
        while i < c:
            j = i
            while j + 1 < c and docs[b][j + 1] == docs[b][i] and pos[j + 1] == pos[j] + 1:
                j += 1
            keys.append((b, lo[b][i], hi[b][j]))
            cu_q.append(cu_q[-1] + j + 1 - i)
            cu_k.append(cu_k[-1] + hi[b][j] - lo[b][i])
            i = j + 1
    max_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
    max_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))
    return VarlenLayout(cu_q, cu_k, keys, max_q, max_k)


def _flash_varlen_forward(q, k, v, q_pos, kv_pos, doc_ids, window, scale):
    from flash_attn import flash_attn_varlen_func

    _warn_unvalidated("flash-attn varlen")
    B, H, c, _ = q.shape
    layout = varlen_layout(doc_ids, q_pos, kv_pos, window)
    q_cat = q.transpose(1, 2).reshape(B * c, H, q.shape[3])
    k_cat = torch.cat([k[b, :, s:e].transpose(0, 1) for b, s, e in layout.keys])
    v_cat = torch.cat([v[b, :, s:e].transpose(0, 1) for b, s, e in layout.keys])
    cu_q, cu_k = (torch.tensor(x, dtype=torch.int32, device=q.device) for x in (layout.cu_q, layout.cu_k))
    out, lse, _ = flash_attn_varlen_func(
        q_cat,
        k_cat,
        v_cat,
        cu_q,
        cu_k,
        layout.max_q,
        layout.max_k,
        softmax_scale=scale,
        causal=True,
        window_size=(window - 1, 0) if window is not None else (-1, -1),
        return_attn_probs=True,
    )
    out = out.view(B, c, H, -1).transpose(1, 2).contiguous()
    return out, lse.float().view(H, B, c).transpose(0, 1).contiguous()


def _flash_varlen_available(q) -> bool:
    """Whether flash-attn's varlen kernel is installed and supports ``q``'s dtype."""
    return q.dtype in (torch.float16, torch.bfloat16) and importlib.util.find_spec("flash_attn") is not None
