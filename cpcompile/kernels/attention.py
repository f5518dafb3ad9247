"""``cpcompile::cp_attention``: one CP rank's attention that visits only the not fully masked blocks.

The queries are this rank's tokens at global indices ``q_pos`` (ascending), the keys/values any set of tokens
at global indices ``kv_pos`` (e.g. the whole sequence in the order an all-gather leaves it); key ``j`` is
visible to query ``i`` under :func:`cpcompile.plan.visible` with the document ids ``doc_ids[:, pos]``. No mask
larger than one block is ever built.

Implementations (``impl``, chosen by :attr:`cpcompile.options.BackendOptions.attention`):

* ``"loop"`` (``attention="auto"`` or ``"block"``, every device): a FlashAttention-2 style loop in pure torch.
  The keys are put in ascending order first (no copy when they already are); every query block
  (:func:`cpcompile.plan.query_blocks`) visits the key blocks of :func:`cpcompile.plan.visible_blocks` (start of
  the block's earliest document up to its last query); blocks that every query of the block sees are multiplied
  without a mask (in spans of up to :data:`SPAN_KEYS` keys), the others with a block-sized mask. Online softmax
  in fp32; the backward recomputes the scores per block from the saved logsumexp. GQA without expanding K/V:
  query head ``h`` uses KV head ``h // n_rep`` and the ``n_rep`` query heads of one KV head are stacked into one
  matmul. Memory per call: the inputs and outputs, the gradients' fp32 accumulators, and per query block a score
  buffer of at most ``block_q x SPAN_KEYS`` per head: nothing grows with ``c x T``.
* ``"flash_varlen"`` (CUDA, ``flash_attn`` installed, fp16/bf16): flash-attn's varlen kernel (one segment per run
  of local queries of one document, keys from the document's start: :func:`varlen_layout`).
* ``"flex"`` (CUDA): ``flex_attention`` (compiled once, with dynamic shapes after the first length) with a
  ``BlockMask`` whose ``mask_mod`` is :func:`cpcompile.mask.visible`.

  The backward of these two recomputes their forward under autograd. Each logs a warning on its first use that
  names ``benchmarks/gpu_attention.py`` (which checks it against dense SDPA); their status on GPUs is in
  BENCHMARKS.md. The varlen layout and flex's mask are checked on CPU.

Fully masked query rows (not produced by plan masks, where every token sees itself) give 0 output and zero
gradients, like CPU SDPA.

``cpcompile::flex_cp_attention`` (:mod:`cpcompile.kernels.flex_site`) runs the same loop for a rewritten
flex_attention site: its visibility is the site's ``mask_mod`` (:mod:`cpcompile.kernels.flex_mods`) instead of
:func:`cpcompile.mask.visible`, every key block is visited (blocks with no visible pair are skipped before the
matmul), its ``score_mod`` rewrites the scores, and the backward also takes the gradient of the returned
logsumexp. The library kernels live in :mod:`cpcompile.kernels.library`.

This module (about 480 lines) keeps the loop's forward and backward next to the block schedule they share and the
op that dispatches between the implementations: the backward recomputes exactly the blocks and masks the forward
visited, and reading one beside the other is how that is checked.

Why one module of about 470 lines: the loop's forward and backward, the op and its fake walk the same blocks in
the same order (the backward recomputes what the forward computed), so they are read and changed together.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import torch

from cpcompile import _compat
from cpcompile.kernels.library import _flash_varlen_available, _flash_varlen_forward, _flex_forward
from cpcompile.layouts import DEFAULT_BLOCK_SIZE
from cpcompile.mask import visible, visible_mask
from cpcompile.plan import VisibleBlocks, visible_blocks

__all__ = ["IMPLS", "SPAN_KEYS", "BlockPiece", "block_schedule", "computed_pairs", "cp_attention", "dense_cp_attention"]

#: Implementations of ``cpcompile::cp_attention`` (module docstring).
IMPLS = ("loop", "flex", "flash_varlen")

#: Longest run of unmasked keys multiplied in one matmul (bounds the score buffer to block_q x SPAN_KEYS).
SPAN_KEYS = 1024


@dataclasses.dataclass(frozen=True, slots=True)
class BlockPiece:
    """A sorted-key range ``[start, end)`` one query block is multiplied with; ``masked``: needs the block mask."""

    start: int
    end: int
    masked: bool


def block_schedule(vb: VisibleBlocks) -> tuple[list[int], list[list[list[BlockPiece]]]]:
    """``(q_bounds, schedule)``: the key pieces the CPU kernel visits for the block visibility ``vb``
    (:func:`cpcompile.plan.visible_blocks`); ``schedule[b][i]`` for query block ``i`` (local queries
    ``q_bounds[i]:q_bounds[i + 1]``) of row ``b``; keys by position in ascending order.

    Key blocks of ``vb.block_k`` that intersect the block's visible interval are visited; those inside the
    interval every query sees are merged into unmasked spans of at most ``max(block_k, SPAN_KEYS)`` keys.
    """
    block_k = vb.block_k
    K = vb.kv_len
    span = max(block_k, SPAN_KEYS // block_k * block_k)
    first, end = (t.tolist() for t in vb.key_blocks())
    full_lo, full_hi = vb.full_lo.tolist(), vb.full_hi.tolist()
    schedule = []
    for b in range(len(first)):
        row = []
        for i in range(len(first[b])):
            f, e = first[b][i], end[b][i]
            f_full = max(f, -(-full_lo[b][i] // block_k))  # first key block inside [full_lo, full_hi)
            e_full = min(e, full_hi[b][i] // block_k)
            if e_full <= f_full:
                f_full = e_full = e
            pieces = [BlockPiece(kb * block_k, min((kb + 1) * block_k, K), True) for kb in range(f, f_full)]
            pieces += [
                BlockPiece(s, min(s + span, e_full * block_k), False)
                for s in range(f_full * block_k, e_full * block_k, span)
            ]
            pieces += [BlockPiece(kb * block_k, min((kb + 1) * block_k, K), True) for kb in range(e_full, e)]
            row.append(pieces)
        schedule.append(row)
    return list(vb.q_bounds), schedule


def computed_pairs(q_bounds: list[int], schedule: list[list[list[BlockPiece]]]) -> int:
    """Number of (query, key) pairs the kernel computes for a :func:`block_schedule` (per head)."""
    total = 0
    for row in schedule:
        for i, pieces in enumerate(row):
            total += (q_bounds[i + 1] - q_bounds[i]) * sum(p.end - p.start for p in pieces)
    return total


def _check(q, k, v, q_pos, kv_pos, doc_ids, window, enable_gqa, block_q, block_k, impl) -> int:
    """Validate the op's inputs; return ``n_rep`` (query heads per KV head)."""
    if impl not in IMPLS:
        raise ValueError(f"cp_attention: impl={impl!r} is not one of {IMPLS}")
    if impl != "loop" and q.device.type != "cuda":
        raise ValueError(
            f"cp_attention: impl={impl!r} runs on CUDA tensors only, got {q.device.type}; use impl='loop' "
            "(cpcompile.backend(..., attention='auto'))"
        )
    if impl == "flash_varlen" and not _flash_varlen_available(q):
        raise ValueError(
            f"cp_attention: impl='flash_varlen' needs the flash_attn package and fp16/bf16 inputs, got {q.dtype}"
            f"{'' if importlib.util.find_spec('flash_attn') else ' without flash_attn installed'}; use "
            "attention='flex' or 'auto'"
        )
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"cp_attention expects [B, H, T, D] q/k/v, got {q.dim()}-D/{k.dim()}-D/{v.dim()}-D tensors")
    B, H, c, D = q.shape
    if k.shape[0] != B or v.shape[:3] != k.shape[:3] or k.shape[3] != D:
        raise ValueError(
            f"cp_attention: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not match; expected "
            "k [B, Hkv, T, D] and v [B, Hkv, T, Dv] with the batch and head dim D of q"
        )
    if tuple(q_pos.shape) != (c,) or tuple(kv_pos.shape) != (k.shape[2],):
        raise ValueError(
            f"cp_attention: q_pos {tuple(q_pos.shape)} and kv_pos {tuple(kv_pos.shape)} must hold one global index "
            f"per query ({c}) and per key ({k.shape[2]}); pass CPPlan.token_indices() and the keys' indices"
        )
    if doc_ids.dim() != 2 or doc_ids.shape[0] != B or doc_ids.dtype.is_floating_point:
        raise ValueError(
            f"cp_attention: doc_ids must be integer document ids [B, T_pad] with B = {B}, got {doc_ids.dtype} "
            f"{tuple(doc_ids.shape)}; pass CPPlan.doc_ids (or zeros for plain causal attention)"
        )
    T = doc_ids.shape[1]
    for name, pos, low in (("q_pos", q_pos, 0), ("kv_pos", kv_pos, -1)):
        if pos.numel() and (int(pos.min()) < low or int(pos.max()) >= T):
            raise ValueError(
                f"cp_attention: {name} holds indices outside [{low}, {T}) of doc_ids (-1: an empty key slot)"
            )
    if c > 1 and bool((q_pos[1:] <= q_pos[:-1]).any()):
        raise ValueError("cp_attention: q_pos must be strictly ascending (the plan's token indices of one rank)")
    if H % k.shape[1] or (not enable_gqa and H != k.shape[1]):
        raise ValueError(
            f"cp_attention: {H} query heads and {k.shape[1]} key/value heads; with enable_gqa=True the query heads "
            "must be a multiple of the KV heads, without it they must be equal"
        )
    if window is not None and window < 1:
        raise ValueError(f"cp_attention: window must be a positive number of tokens or None, got {window}")
    if block_q < 1 or block_k < 1:
        raise ValueError(f"cp_attention: block sizes must be positive, got block_q={block_q}, block_k={block_k}")
    if T > 1 and bool((doc_ids[:, 1:] < doc_ids[:, :-1]).any()):
        raise ValueError(
            "cp_attention: doc_ids must be non-decreasing along each row (contiguous documents, as "
            "cpcompile.plan.document_ids makes them)"
        )
    return H // k.shape[1]


def _key_order(kv_pos: torch.Tensor) -> torch.Tensor | None:
    """The permutation that sorts the keys by global index, or ``None`` when they already are sorted."""
    if kv_pos.shape[0] < 2 or bool((kv_pos[1:] >= kv_pos[:-1]).all()):
        return None
    return torch.argsort(kv_pos, stable=True)


def _sorted(order: torch.Tensor | None, *tensors: torch.Tensor, dim: int = 2) -> list[torch.Tensor]:
    return [t if order is None else t.index_select(dim, order) for t in tensors]


def _unsort(order: torch.Tensor | None, t: torch.Tensor, dim: int = 2) -> torch.Tensor:
    return t if order is None else torch.empty_like(t).index_copy_(dim, order, t)


def _block_mask(doc_row, q_pos, kv_pos, window) -> torch.Tensor:
    """``[len(q_pos), len(kv_pos)]`` bool mask of one row (:func:`cpcompile.plan.visible`)."""
    kv_doc = doc_row[kv_pos.clamp(min=0)]
    return visible(q_pos[:, None], kv_pos[None, :], doc_row[q_pos][:, None], kv_doc[None, :], window)


def _schedule(doc_ids, q_pos, ks, block_q, block_k, window, mods, B):
    """The loop's ``(q_bounds, schedule)``: the plan's visible blocks, or with ``mods`` (a flex site, whose
    mask only its ``mask_mod`` knows) every key block, masked; blocks without a visible pair are skipped."""
    if mods is None:
        return block_schedule(visible_blocks(doc_ids, q_pos, ks, block_q, block_k, window))
    K, first = int(ks.shape[0]), int((ks < 0).sum())  # empty key slots (-1) sort first and are never seen
    bounds = [*range(0, int(q_pos.shape[0]), block_q), int(q_pos.shape[0])]
    pieces = [BlockPiece(s, min(s + block_k, K), True) for s in range(first, K, block_k)]
    return bounds, [[pieces] * (len(bounds) - 1) for _ in range(B)]


def _piece_mask(p, b, q_pos, kv_pos, doc_ids, window, mods, Hkv, R):
    """The mask of one piece, shaped to mask ``[Hkv, R, rows, L]`` scores; ``None``: the piece is unmasked;
    ``False``: no pair of the piece is visible (flex sites)."""
    if not p.masked:
        return None
    if mods is None:
        return _block_mask(doc_ids[b], q_pos, kv_pos, window)
    mask = mods.mask(b, q_pos, kv_pos)
    if not bool(mask.any()):
        return False
    return mask.view(Hkv, R, *mask.shape[1:])


# -- the loop (every device) -----------------------------------------------------------------------------
def _loop_forward(q, k, v, q_pos, kv_pos, doc_ids, window, scale, block_q, block_k, mods=None):
    B, H, c, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    R = H // Hkv
    out = torch.empty((B, H, c, Dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, c), dtype=torch.float32, device=q.device)
    order = _key_order(kv_pos)
    (ks,) = _sorted(order, kv_pos, dim=0)
    kf, vf = _sorted(order, k.float(), v.float())
    bounds, schedule = _schedule(doc_ids, q_pos, ks, block_q, block_k, window, mods, B)
    for b in range(B):
        qb = q[b].view(Hkv, R, c, D)
        ob, lb = out[b].view(Hkv, R, c, Dv), lse[b].view(Hkv, R, c)
        for i, pieces in enumerate(schedule[b]):
            qs, qe = bounds[i], bounds[i + 1]
            rows = qe - qs
            qblk = qb[:, :, qs:qe].reshape(Hkv, R * rows, D).float() * scale
            m = torch.full((Hkv, R * rows), -math.inf, device=q.device)
            denom = torch.zeros((Hkv, R * rows), device=q.device)
            acc = torch.zeros((Hkv, R * rows, Dv), device=q.device)
            for p in pieces:
                mask = _piece_mask(p, b, q_pos[qs:qe], ks[p.start : p.end], doc_ids, window, mods, Hkv, R)
                if mask is False:
                    continue  # a flex site's block without a visible pair
                s = qblk @ kf[b, :, p.start : p.end].transpose(-1, -2)  # [Hkv, R*rows, L]
                if mods is not None and mods.score_mod is not None:
                    s = mods.score(s.view(Hkv * R, rows, -1), b, q_pos[qs:qe], ks[p.start : p.end]).view(s.shape)
                if mask is not None:
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


def _loop_backward(
    dout, q, k, v, q_pos, kv_pos, doc_ids, out, lse, window, scale, block_q, block_k, mods=None, dlse=None
):
    B, H, c, D = q.shape
    Hkv, K, Dv = k.shape[1], k.shape[2], v.shape[3]
    R = H // Hkv
    dq = torch.zeros((B, H, c, D), dtype=torch.float32, device=q.device)
    dk = torch.zeros((B, Hkv, K, D), dtype=torch.float32, device=q.device)
    dv = torch.zeros((B, Hkv, K, Dv), dtype=torch.float32, device=q.device)
    delta = (dout.float() * out.float()).sum(-1)  # [B, H, c]
    if dlse is not None:  # d lse / d score is the softmax probability: it joins the row's delta
        delta = delta - dlse.float()
    order = _key_order(kv_pos)
    (ks,) = _sorted(order, kv_pos, dim=0)
    kf, vf = _sorted(order, k.float(), v.float())
    bounds, schedule = _schedule(doc_ids, q_pos, ks, block_q, block_k, window, mods, B)
    for b in range(B):
        qb, dob = q[b].view(Hkv, R, c, D), dout[b].view(Hkv, R, c, Dv)
        lb, db = lse[b].view(Hkv, R, c), delta[b].view(Hkv, R, c)
        dqb = dq[b].view(Hkv, R, c, D)
        for i, pieces in enumerate(schedule[b]):
            qs, qe = bounds[i], bounds[i + 1]
            rows = qe - qs
            qblk = qb[:, :, qs:qe].reshape(Hkv, R * rows, D).float() * scale
            doblk = dob[:, :, qs:qe].reshape(Hkv, R * rows, Dv).float()
            lblk = lb[:, :, qs:qe].reshape(Hkv, R * rows, 1)
            dblk = db[:, :, qs:qe].reshape(Hkv, R * rows, 1)
            dq_acc = torch.zeros((Hkv, R * rows, D), device=q.device)
            for p in pieces:
                mask = _piece_mask(p, b, q_pos[qs:qe], ks[p.start : p.end], doc_ids, window, mods, Hkv, R)
                if mask is False:
                    continue
                kp, vp = kf[b, :, p.start : p.end], vf[b, :, p.start : p.end]
                s = qblk @ kp.transpose(-1, -2)
                raw = None
                if mods is not None and mods.score_mod is not None:  # keep d score_mod / d score for below
                    with _compat.autograd_inside_custom_op():
                        raw = s.view(Hkv * R, rows, -1).detach().requires_grad_()
                        modded = mods.score(raw, b, q_pos[qs:qe], ks[p.start : p.end])
                    s = modded.detach().view(s.shape)
                if mask is not None:
                    s.view(Hkv, R, rows, -1).masked_fill_(~mask, -math.inf)
                prob = s.sub_(lblk).exp_()  # softmax probabilities, recomputed from the saved logsumexp
                dv[b, :, p.start : p.end] += prob.transpose(-1, -2) @ doblk
                ds = prob.mul_((doblk @ vp.transpose(-1, -2)).sub_(dblk))  # dL/dscore
                if raw is not None:  # through score_mod: dL/d(q k^T * scale)
                    with _compat.autograd_inside_custom_op():
                        (ds,) = torch.autograd.grad(modded, raw, ds.view(modded.shape))
                    ds = ds.view(s.shape)
                dq_acc += ds @ kp
                dk[b, :, p.start : p.end] += ds.transpose(-1, -2) @ qblk
            dqb[:, :, qs:qe] = (dq_acc * scale).view(Hkv, R, rows, D)
    return dq.to(q.dtype), _unsort(order, dk).to(k.dtype), _unsort(order, dv).to(v.dtype)


# -- library kernels (CUDA): kernels/library.py runs them on sorted keys
def _library_forward(q, k, v, q_pos, kv_pos, doc_ids, window, scale, enable_gqa, impl):
    order = _key_order(kv_pos)
    (ks,) = _sorted(order, kv_pos, dim=0)
    k, v = _sorted(order, k, v)
    if impl == "flash_varlen":
        return _flash_varlen_forward(q, k, v, q_pos, ks, doc_ids, window, scale)
    return _flex_forward(q, k, v, q_pos, ks, doc_ids, window, scale, enable_gqa)


def _library_backward(dout, q, k, v, q_pos, kv_pos, doc_ids, window, scale, enable_gqa, impl):
    """Recomputes the forward under autograd (flex/flash-attn's own backward kernels run inside)."""
    with _compat.autograd_inside_custom_op():
        q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
        out, _ = _library_forward(q_, k_, v_, q_pos, kv_pos, doc_ids, window, scale, enable_gqa, impl)
        grads = torch.autograd.grad(out, (q_, k_, v_), dout)
    return tuple(g.contiguous() for g in grads)


# -- the op ---------------------------------------------------------------------------------------------
@torch.library.custom_op("cpcompile::cp_attention", mutates_args=())
def _cp_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
    doc_ids: torch.Tensor,
    window: int | None,
    scale: float | None,
    enable_gqa: bool,
    block_q: int,
    block_k: int,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(out [B, H, c, Dv] in q's dtype, logsumexp [B, H, c] fp32)``; see :func:`cp_attention`."""
    _check(q, k, v, q_pos, kv_pos, doc_ids, window, enable_gqa, block_q, block_k, impl)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if impl != "loop":
        return _library_forward(q, k, v, q_pos, kv_pos, doc_ids, window, scale, enable_gqa, impl)
    return _loop_forward(q, k, v, q_pos, kv_pos, doc_ids, window, scale, block_q, block_k)


@_cp_attention_op.register_fake
def _(q, k, v, q_pos, kv_pos, doc_ids, window, scale, enable_gqa, block_q, block_k, impl):
    B, H, c, _ = q.shape
    return q.new_empty((B, H, c, v.shape[3])), q.new_empty((B, H, c), dtype=torch.float32)


@torch.library.custom_op("cpcompile::cp_attention_backward", mutates_args=())
def _cp_attention_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
    doc_ids: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    window: int | None,
    scale: float | None,
    enable_gqa: bool,
    block_q: int,
    block_k: int,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`cp_attention`, shaped and typed like ``q``, ``k``, ``v``."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    dout = dout.contiguous()
    if impl != "loop":
        return _library_backward(dout, q, k, v, q_pos, kv_pos, doc_ids, window, scale, enable_gqa, impl)
    return _loop_backward(dout, q, k, v, q_pos, kv_pos, doc_ids, out, lse, window, scale, block_q, block_k)


@_cp_attention_backward_op.register_fake
def _(dout, q, k, v, q_pos, kv_pos, doc_ids, out, lse, window, scale, enable_gqa, block_q, block_k, impl):
    # contiguous, like the real outputs (inductor checks real strides against these)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, q_pos, kv_pos, doc_ids, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, q_pos, kv_pos, doc_ids, out, lse)
    ctx.args = args
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, q_pos, kv_pos, doc_ids, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.cpcompile.cp_attention_backward(dout, q, k, v, q_pos, kv_pos, doc_ids, out, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


_cp_attention_op.register_autograd(_backward, setup_context=_setup_context)


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
    doc_ids: torch.Tensor,
    *,
    window: int | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    block_q: int = DEFAULT_BLOCK_SIZE,
    block_k: int = DEFAULT_BLOCK_SIZE,
    impl: str = "loop",
) -> torch.Tensor:
    """Attention of local queries at global indices ``q_pos`` against keys at ``kv_pos``; differentiable.

    Args:
        q: ``[B, H, c, D]`` local queries.
        k, v: ``[B, Hkv, K, D]`` / ``[B, Hkv, K, Dv]``, e.g. the whole padded sequence all-gathered.
        q_pos: ``[c]`` int64, strictly ascending: the queries' global indices (``CPPlan.token_indices()``).
        kv_pos: ``[K]`` int64: the keys' global indices in the order of ``k``/``v`` (any order; e.g.
            ``CPPlan.gathered_indices()`` after an all-gather); ``-1`` marks an empty slot (never attended).
        doc_ids: ``[B, T_pad]`` integer document ids by global index, non-decreasing per row
            (``CPPlan.doc_ids``; all zeros for plain causal attention).
        window: sliding window in tokens (``None``: none).
        scale: softmax scale (default ``1/sqrt(D)``, like SDPA).
        enable_gqa: allow fewer KV heads than query heads (query head ``h`` uses KV head ``h // (H // Hkv)``).
        block_q, block_k: block sizes of the loop.
        impl: ``"loop"`` (every device), ``"flex"`` or ``"flash_varlen"`` (CUDA; module docstring).

    Same result as :func:`dense_cp_attention` (SDPA under the :func:`cpcompile.plan.visible_mask` mask).
    """
    op = torch.ops.cpcompile.cp_attention
    return op(q, k, v, q_pos, kv_pos, doc_ids, window, scale, enable_gqa, block_q, block_k, impl)[0]


def dense_cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
    doc_ids: torch.Tensor,
    *,
    window: int | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """The dense reference of :func:`cp_attention`: SDPA with the full ``[B, 1, c, K]`` bool mask."""
    mask = visible_mask(q_pos, kv_pos, doc_ids, window)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
