"""``cpcompile::cp_attention``: one CP rank's attention that visits only the not fully masked blocks.

The queries are rank ``r``'s chunk (global tokens ``[r*c, (r+1)*c)``), the keys/values the whole gathered
sequence; the mask is exactly :meth:`cpcompile.plan.CPPlan.mask`: key ``j`` is visible to query ``i`` iff
``j <= i``, both lie in the same document (``kv_doc``) and, with a window ``w``, ``j > i - w``. No mask larger
than one block is ever built.

Implementations, chosen by the device of ``q``:

* CPU: a FlashAttention-2 style loop in pure torch. For every query block it visits the key blocks of
  :meth:`~cpcompile.plan.CPPlan.visible_blocks` (start of the block's earliest document up to its last query);
  blocks that every query of the block sees are multiplied without a mask (in spans of up to
  :data:`SPAN_KEYS` keys), the others with a block-sized mask. Online softmax in fp32; the backward recomputes
  the scores per block from the saved logsumexp. GQA without expanding K/V: query head ``h`` uses KV head
  ``h // n_rep`` and the ``n_rep`` query heads of one KV head are stacked into one matmul.
* CUDA: flash-attn's varlen kernel when ``flash_attn`` is installed and q is fp16/bf16 (one segment per run of
  local queries of one document, keys from the document's start: :func:`varlen_layout`), else
  ``flex_attention`` (compiled) with a ``BlockMask`` built from the same doc ids and offset. The backward
  recomputes that forward under autograd. These paths have not been run yet (no GPU was available when they
  were written; the varlen layout and flex's mask are checked on CPU); ``benchmarks/gpu_attention.py``
  checks and times them.

Fully masked query rows (not produced by plan masks, where every token sees itself) give 0 output and zero
gradients, like CPU SDPA.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from cpcompile import _compat
from cpcompile.plan import visible_blocks

__all__ = [
    "SPAN_KEYS",
    "BlockPiece",
    "VarlenLayout",
    "block_schedule",
    "computed_pairs",
    "cp_attention",
    "dense_cp_attention",
    "varlen_layout",
]

#: Longest run of unmasked keys multiplied in one matmul (bounds the score buffer to block_q x SPAN_KEYS).
SPAN_KEYS = 1024


@dataclasses.dataclass(frozen=True, slots=True)
class BlockPiece:
    """A key range ``[start, end)`` one query block is multiplied with; ``masked``: needs the block mask."""

    start: int
    end: int
    masked: bool


def block_schedule(
    kv_doc: torch.Tensor, q_offset: int, q_len: int, block_q: int, block_k: int, window: int | None = None
) -> list[list[list[BlockPiece]]]:
    """The key pieces the CPU kernel visits: ``schedule[b][i]`` for query block ``i`` of row ``b``.

    Key blocks of ``block_k`` that intersect the block's visible interval are visited; those inside the
    interval every query sees are merged into unmasked spans of at most ``max(block_k, SPAN_KEYS)`` keys.
    """
    vb = visible_blocks(kv_doc, q_offset, q_len, block_q, block_k, window)
    T = kv_doc.shape[1]
    span = max(block_k, SPAN_KEYS // block_k * block_k)
    first, end = (t.tolist() for t in vb.key_blocks())
    full_lo, full_hi = vb.full_lo.tolist(), vb.full_hi.tolist()
    schedule = []
    for b in range(kv_doc.shape[0]):
        row = []
        for i in range(len(first[b])):
            f, e = first[b][i], end[b][i]
            f_full = max(f, -(-full_lo[b][i] // block_k))  # first key block inside [full_lo, full_hi)
            e_full = min(e, full_hi[b][i] // block_k)
            pieces = []
            if e_full <= f_full:
                f_full = e_full = e
            pieces += [BlockPiece(kb * block_k, min((kb + 1) * block_k, T), True) for kb in range(f, f_full)]
            pieces += [
                BlockPiece(s, min(s + span, e_full * block_k), False)
                for s in range(f_full * block_k, e_full * block_k, span)
            ]
            pieces += [BlockPiece(kb * block_k, min((kb + 1) * block_k, T), True) for kb in range(e_full, e)]
            row.append(pieces)
        schedule.append(row)
    return schedule


def computed_pairs(schedule: list[list[list[BlockPiece]]], q_len: int, block_q: int) -> int:
    """Number of (query, key) pairs the kernel computes for ``schedule`` (per head)."""
    total = 0
    for row in schedule:
        for i, pieces in enumerate(row):
            rows = min(block_q, q_len - i * block_q)
            total += rows * sum(p.end - p.start for p in pieces)
    return total


def _block_mask(doc: torch.Tensor, q_start: int, q_end: int, k_start: int, k_end: int, window: int) -> torch.Tensor:
    """``[q_end - q_start, k_end - k_start]`` bool mask of global queries against global keys of one row."""
    qi = torch.arange(q_start, q_end, device=doc.device)
    kj = torch.arange(k_start, k_end, device=doc.device)
    m = (kj[None, :] <= qi[:, None]) & (doc[k_start:k_end][None, :] == doc[q_start:q_end][:, None])
    if window >= 0:
        m &= kj[None, :] > qi[:, None] - window
    return m


def _check(q, k, v, kv_doc, cp_rank, window, enable_gqa, block_q, block_k) -> int:
    """Validate the op's inputs; return ``n_rep`` (query heads per KV head)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"cp_attention expects [B, H, T, D] q/k/v, got {q.dim()}-D/{k.dim()}-D/{v.dim()}-D tensors")
    B, H, c, D = q.shape
    if k.shape[0] != B or v.shape[:3] != k.shape[:3] or k.shape[3] != D:
        raise ValueError(
            f"cp_attention: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not match; expected "
            "k [B, Hkv, T, D] and v [B, Hkv, T, Dv] with the batch and head dim D of q"
        )
    T = k.shape[2]
    if tuple(kv_doc.shape) != (B, T) or kv_doc.dtype.is_floating_point:
        raise ValueError(
            f"cp_attention: kv_doc must be integer document ids [B, T] = [{B}, {T}], got {kv_doc.dtype} "
            f"{tuple(kv_doc.shape)}; pass CPPlan.doc_ids"
        )
    if not 0 <= cp_rank or (cp_rank + 1) * c > T:
        raise ValueError(
            f"cp_attention: cp_rank={cp_rank} with {c} local queries needs at least {(cp_rank + 1) * c} keys, got "
            f"{T}; pass the keys of the whole (padded) sequence and this rank's index"
        )
    if H % k.shape[1] or (not enable_gqa and H != k.shape[1]):
        raise ValueError(
            f"cp_attention: {H} query heads and {k.shape[1]} key/value heads; with enable_gqa=True the query heads "
            "must be a multiple of the KV heads, without it they must be equal"
        )
    if window == 0 or window < -1:
        raise ValueError(f"cp_attention: window must be a positive number of tokens or -1 (none), got {window}")
    if block_q < 1 or block_k < 1:
        raise ValueError(f"cp_attention: block sizes must be positive, got block_q={block_q}, block_k={block_k}")
    if T > 1 and bool((kv_doc[:, 1:] < kv_doc[:, :-1]).any()):
        raise ValueError(
            "cp_attention: kv_doc must be non-decreasing along each row (contiguous documents, as "
            "cpcompile.plan.document_ids makes them)"
        )
    return H // k.shape[1]


# -- CPU ------------------------------------------------------------------------------------------------
def _cpu_forward(q, k, v, kv_doc, q_offset, window, scale, block_q, block_k):
    B, H, c, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    R = H // Hkv
    out = torch.empty((B, H, c, Dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, c), dtype=torch.float32, device=q.device)
    schedule = block_schedule(kv_doc, q_offset, c, block_q, block_k, None if window < 0 else window)
    kf, vf = k.float(), v.float()
    for b in range(B):
        qb = q[b].view(Hkv, R, c, D)
        ob, lb = out[b].view(Hkv, R, c, Dv), lse[b].view(Hkv, R, c)
        for i, pieces in enumerate(schedule[b]):
            qs, qe = i * block_q, min((i + 1) * block_q, c)
            rows = qe - qs
            qblk = qb[:, :, qs:qe].reshape(Hkv, R * rows, D).float() * scale
            m = torch.full((Hkv, R * rows), -math.inf, device=q.device)
            denom = torch.zeros((Hkv, R * rows), device=q.device)
            acc = torch.zeros((Hkv, R * rows, Dv), device=q.device)
            for p in pieces:
                s = qblk @ kf[b, :, p.start : p.end].transpose(-1, -2)  # [Hkv, R*rows, L]
                if p.masked:
                    mask = _block_mask(kv_doc[b], q_offset + qs, q_offset + qe, p.start, p.end, window)
                    s.view(Hkv, R, rows, -1).masked_fill_(~mask, -math.inf)
                m_new = torch.maximum(m, s.amax(-1))
                m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)
                s.sub_(m_safe[..., None]).exp_()
                alpha = torch.exp(m - m_safe)
                denom = denom * alpha + s.sum(-1)
                acc = acc * alpha[..., None] + s @ vf[b, :, p.start : p.end]
                m = m_new
            seen = denom > 0
            o = torch.where(seen[..., None], acc / denom.clamp(min=1e-30)[..., None], 0.0)
            ob[:, :, qs:qe] = o.view(Hkv, R, rows, Dv).to(q.dtype)
            lb[:, :, qs:qe] = torch.where(seen, m + torch.log(denom.clamp(min=1e-30)), math.inf).view(Hkv, R, rows)
    return out, lse


def _cpu_backward(dout, q, k, v, kv_doc, out, lse, q_offset, window, scale, block_q, block_k):
    B, H, c, D = q.shape
    Hkv, T, Dv = k.shape[1], k.shape[2], v.shape[3]
    R = H // Hkv
    dq = torch.zeros((B, H, c, D), dtype=torch.float32, device=q.device)
    dk = torch.zeros((B, Hkv, T, D), dtype=torch.float32, device=q.device)
    dv = torch.zeros((B, Hkv, T, Dv), dtype=torch.float32, device=q.device)
    delta = (dout.float() * out.float()).sum(-1)  # [B, H, c]
    schedule = block_schedule(kv_doc, q_offset, c, block_q, block_k, None if window < 0 else window)
    kf, vf = k.float(), v.float()
    for b in range(B):
        qb, dob = q[b].view(Hkv, R, c, D), dout[b].view(Hkv, R, c, Dv)
        lb, db = lse[b].view(Hkv, R, c), delta[b].view(Hkv, R, c)
        dqb = dq[b].view(Hkv, R, c, D)
        for i, pieces in enumerate(schedule[b]):
            qs, qe = i * block_q, min((i + 1) * block_q, c)
            rows = qe - qs
            qblk = qb[:, :, qs:qe].reshape(Hkv, R * rows, D).float() * scale
            doblk = dob[:, :, qs:qe].reshape(Hkv, R * rows, Dv).float()
            lblk = lb[:, :, qs:qe].reshape(Hkv, R * rows, 1)
            dblk = db[:, :, qs:qe].reshape(Hkv, R * rows, 1)
            dq_acc = torch.zeros((Hkv, R * rows, D), device=q.device)
            for p in pieces:
                kp, vp = kf[b, :, p.start : p.end], vf[b, :, p.start : p.end]
                s = qblk @ kp.transpose(-1, -2)
                if p.masked:
                    mask = _block_mask(kv_doc[b], q_offset + qs, q_offset + qe, p.start, p.end, window)
                    s.view(Hkv, R, rows, -1).masked_fill_(~mask, -math.inf)
                prob = s.sub_(lblk).exp_()  # softmax probabilities, recomputed from the saved logsumexp
                dv[b, :, p.start : p.end] += prob.transpose(-1, -2) @ doblk
                ds = prob.mul_((doblk @ vp.transpose(-1, -2)).sub_(dblk))  # dL/dscore
                dq_acc += ds @ kp
                dk[b, :, p.start : p.end] += ds.transpose(-1, -2) @ qblk
            dqb[:, :, qs:qe] = (dq_acc * scale).view(Hkv, R, rows, D)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# -- CUDA (not run yet: see the module docstring) -------------------------------------------------------
def _flex_block_mask(kv_doc, q_offset, q_len, window):
    def mask_mod(b, h, q_idx, kv_idx):
        qg = q_idx + q_offset
        m = (kv_idx <= qg) & (kv_doc[b, kv_idx] == kv_doc[b, qg])
        if window >= 0:
            m = m & (kv_idx > qg - window)
        return m

    return _compat.flex_block_mask(mask_mod, kv_doc.shape[0], q_len, kv_doc.shape[1], kv_doc.device)


def _flex_forward(q, k, v, kv_doc, q_offset, window, scale, enable_gqa):
    block_mask = _flex_block_mask(kv_doc, q_offset, q.shape[2], window)
    out, lse = _compat.flex_attention_with_lse(q, k, v, block_mask, scale, enable_gqa)
    return out.contiguous(), lse.float().contiguous()


@dataclasses.dataclass(frozen=True)
class VarlenLayout:
    """flash-attn varlen segments of one rank: every run of local queries of one document, with its keys.

    Queries stay in their ``[B, c]`` order, so segment ``s`` is rows ``cu_q[s]:cu_q[s+1]`` of the flattened
    ``[B * c]`` queries; its keys are ``keys[s] = (b, start, end)``, from the start of the document up to the
    segment's last query, so bottom-right causal alignment gives exactly the plan's mask.
    """

    cu_q: list[int]
    cu_k: list[int]
    keys: list[tuple[int, int, int]]
    max_q: int
    max_k: int


def varlen_layout(kv_doc: torch.Tensor, q_offset: int, q_len: int) -> VarlenLayout:
    """The :class:`VarlenLayout` of queries ``[q_offset, q_offset + q_len)`` of every row of ``kv_doc``."""
    vb = visible_blocks(kv_doc, q_offset, q_len, 1, 1)  # one-token query blocks: lo = start of each query's document
    doc_start = vb.lo.tolist()
    cu_q, cu_k, keys = [0], [0], []
    for b, starts in enumerate(doc_start):
        i = 0
        while i < q_len:
            j = i
            while j + 1 < q_len and starts[j + 1] == starts[i]:
                j += 1
            keys.append((b, starts[i], q_offset + j + 1))
            cu_q.append(cu_q[-1] + j + 1 - i)
            cu_k.append(cu_k[-1] + q_offset + j + 1 - starts[i])
            i = j + 1
    max_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
    max_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))
    return VarlenLayout(cu_q, cu_k, keys, max_q, max_k)


def _flash_varlen_forward(q, k, v, kv_doc, q_offset, window, scale):
    from flash_attn import flash_attn_varlen_func

    B, H, c, _ = q.shape
    layout = varlen_layout(kv_doc, q_offset, c)
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
        window_size=(window - 1, 0) if window > 0 else (-1, -1),
        return_attn_probs=True,
    )
    out = out.view(B, c, H, -1).transpose(1, 2).contiguous()
    return out, lse.float().view(H, B, c).transpose(0, 1).contiguous()


def _use_flash_varlen(q) -> bool:
    """flash-attn's varlen kernel when it is installed and supports the dtype; flex_attention otherwise."""
    import importlib.util

    return q.dtype in (torch.float16, torch.bfloat16) and importlib.util.find_spec("flash_attn") is not None


def _cuda_forward(q, k, v, kv_doc, q_offset, window, scale, enable_gqa):
    if _use_flash_varlen(q):
        return _flash_varlen_forward(q, k, v, kv_doc, q_offset, window, scale)
    return _flex_forward(q, k, v, kv_doc, q_offset, window, scale, enable_gqa)


def _cuda_backward(dout, q, k, v, kv_doc, q_offset, window, scale, enable_gqa):
    """Recomputes the forward under autograd (flex/flash-attn's own backward kernels run inside)."""
    with _compat.autograd_inside_custom_op():
        q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
        out, _ = _cuda_forward(q_, k_, v_, kv_doc, q_offset, window, scale, enable_gqa)
        grads = torch.autograd.grad(out, (q_, k_, v_), dout)
    return tuple(g.contiguous() for g in grads)


# -- the op ---------------------------------------------------------------------------------------------
@torch.library.custom_op("cpcompile::cp_attention", mutates_args=())
def _cp_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_doc: torch.Tensor,
    cp_rank: int,
    window: int,
    scale: float | None,
    enable_gqa: bool,
    block_q: int,
    block_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(out [B, H, c, Dv] in q's dtype, logsumexp [B, H, c] fp32)``; see :func:`cp_attention`."""
    _check(q, k, v, kv_doc, cp_rank, window, enable_gqa, block_q, block_k)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q_offset = cp_rank * q.shape[2]
    if q.device.type == "cuda":
        return _cuda_forward(q, k, v, kv_doc, q_offset, window, scale, enable_gqa)
    return _cpu_forward(q, k, v, kv_doc, q_offset, window, scale, block_q, block_k)


@_cp_attention_op.register_fake
def _(q, k, v, kv_doc, cp_rank, window, scale, enable_gqa, block_q, block_k):
    B, H, c, _ = q.shape
    return q.new_empty((B, H, c, v.shape[3])), q.new_empty((B, H, c), dtype=torch.float32)


@torch.library.custom_op("cpcompile::cp_attention_backward", mutates_args=())
def _cp_attention_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_doc: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cp_rank: int,
    window: int,
    scale: float | None,
    enable_gqa: bool,
    block_q: int,
    block_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`cp_attention`, shaped and typed like ``q``, ``k``, ``v``."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q_offset = cp_rank * q.shape[2]
    dout = dout.contiguous()
    if q.device.type == "cuda":
        return _cuda_backward(dout, q, k, v, kv_doc, q_offset, window, scale, enable_gqa)
    return _cpu_backward(dout, q, k, v, kv_doc, out, lse, q_offset, window, scale, block_q, block_k)


@_cp_attention_backward_op.register_fake
def _(dout, q, k, v, kv_doc, out, lse, cp_rank, window, scale, enable_gqa, block_q, block_k):
    # contiguous, like the real outputs (inductor checks real strides against these)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, kv_doc, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, kv_doc, out, lse)
    ctx.args = args
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, kv_doc, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.cpcompile.cp_attention_backward(dout, q, k, v, kv_doc, out, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None


_cp_attention_op.register_autograd(_backward, setup_context=_setup_context)


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_doc: torch.Tensor,
    *,
    cp_rank: int = 0,
    window: int | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    block_q: int = 128,
    block_k: int = 128,
) -> torch.Tensor:
    """Attention of rank ``cp_rank``'s queries against all keys under the plan's mask; differentiable.

    Args:
        q: ``[B, H, c, D]`` local queries (global tokens ``[cp_rank*c, (cp_rank+1)*c)``).
        k, v: ``[B, Hkv, T, D]`` / ``[B, Hkv, T, Dv]``, the whole padded sequence (e.g. all-gathered).
        kv_doc: ``[B, T]`` integer document ids, non-decreasing per row (``CPPlan.doc_ids``; all zeros for
            plain causal attention).
        window: sliding window in tokens (``None``: none).
        scale: softmax scale (default ``1/sqrt(D)``, like SDPA).
        enable_gqa: allow fewer KV heads than query heads (query head ``h`` uses KV head ``h // (H // Hkv)``).
        block_q, block_k: block sizes of the CPU kernel.

    Same result as ``F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask(...), scale=scale,
    enable_gqa=enable_gqa)`` (see :func:`dense_cp_attention`).
    """
    w = -1 if window is None else window
    return torch.ops.cpcompile.cp_attention(q, k, v, kv_doc, cp_rank, w, scale, enable_gqa, block_q, block_k)[0]


def dense_cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_doc: torch.Tensor,
    *,
    cp_rank: int = 0,
    window: int | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """The dense reference of :func:`cp_attention`: SDPA with the full ``[B, 1, c, T]`` bool mask."""
    c, T = q.shape[2], k.shape[2]
    rows = [
        _block_mask(kv_doc[b], cp_rank * c, (cp_rank + 1) * c, 0, T, -1 if window is None else window)
        for b in range(q.shape[0])
    ]
    mask = torch.stack(rows)[:, None]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
