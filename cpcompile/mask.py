"""Who sees whom: the one visibility rule every attention path applies, and packed documents.

Visibility (:func:`visible`) follows transformers' index-based definitions exactly: query ``i`` may see key ``j``
iff ``j <= i`` (global causal order), and, for the document form, both lie in the same document, where a new
document starts wherever ``position_ids[t] - position_ids[t - 1] != 1``
(``transformers.masking_utils.find_packed_sequence_indices``); with a sliding window ``w`` additionally
``j > i - w``. The dense mask (:func:`visible_mask`), the block kernel's blocks and flex_attention's
``mask_mod`` are all built from :func:`visible`; :func:`first_visible` is the same rule in interval form.

The bottom layer of the package: ``mask`` -> ``layouts`` -> ``plan`` -> ``runtime`` -> ``passes`` -> ``backend``.
"""

from __future__ import annotations

import torch

__all__ = [
    "document_ids",
    "document_starts",
    "first_visible",
    "needed_key_counts",
    "needed_keys",
    "visible",
    "visible_mask",
]


def visible(
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
    q_doc: torch.Tensor | None,
    kv_doc: torch.Tensor | None,
    window: int | None,
) -> torch.Tensor:
    """The visibility rule: key at global index ``kv_pos`` is visible to the query at ``q_pos``.

    ``0 <= kv_pos <= q_pos`` (causal; a negative index marks an empty key slot, never visible), ``kv_doc == q_doc``
    (same document; skipped when the docs are ``None``) and ``kv_pos > q_pos - window`` (sliding window;
    ``None``: none). Arguments broadcast like any elementwise op, so the same function builds dense masks, block
    masks and flex_attention's ``mask_mod``.
    """
    m = (kv_pos <= q_pos) & (kv_pos >= 0)
    if q_doc is not None:
        m = m & (kv_doc == q_doc)
    if window is not None:
        m = m & (kv_pos > q_pos - window)
    return m


def visible_mask(q_pos: torch.Tensor, kv_pos: torch.Tensor, doc_ids: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[B, 1, len(q_pos), len(kv_pos)]`` bool mask of :func:`visible` for ``[B, T_pad]`` document ids.

    ``q_pos``/``kv_pos`` are global token indices (any order; a negative key index is an empty slot);
    ``doc_ids`` all zeros means no document condition.
    """
    q_doc = doc_ids[:, q_pos][:, :, None]
    kv_doc = doc_ids[:, kv_pos.clamp(min=0)][:, None, :]
    return visible(q_pos[:, None], kv_pos[None, :], q_doc, kv_doc, window)[:, None]


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document index of every token of ``[B, T]`` position ids (new document where the step is not +1).

    The same rule transformers uses to detect packed sequences, so that our masks agree with the model's.
    """
    first = position_ids[:, :1] - 1
    step = torch.diff(position_ids, prepend=first, dim=-1)
    return (step != 1).cumsum(-1)


def document_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: the global index of the first token of every token's document (docs contiguous per row)."""
    idx = torch.arange(doc_ids.shape[1], device=doc_ids.device)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values


def first_visible(doc_ids: torch.Tensor, q_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[B, len(q_pos)]``: the global index of the first key visible to each query at ``q_pos``.

    :func:`visible` in interval form, for document ids that are non-decreasing along each row: the keys
    visible to query ``q`` are exactly the global indices ``[first_visible, q]`` (its document's start, or the
    window's, whichever is later). Memory is O(B * T), never one entry per (query, key) pair.
    """
    lo = document_starts(doc_ids)[:, q_pos]
    if window is not None:
        lo = lo.clamp(min=q_pos - window + 1)
    return lo


def needed_keys(indices: torch.Tensor, doc_ids: torch.Tensor, window: int | None) -> torch.Tensor:
    """Bool ``[N, T_pad]``: key ``j`` is seen by some query of rank ``r`` in some row and another rank holds it.

    ``indices`` ``[N, c]``: the global indices every rank holds (a layout); ``doc_ids`` ``[B, T_pad]``
    non-decreasing per row (all zeros: plain causal). This is :func:`first_visible` applied to a layout: the keys
    query ``q`` sees are ``[lo(q), q]`` with ``lo`` non-decreasing in ``q`` (in every row, so also its minimum
    over the rows), so rank ``r`` needs key ``j`` iff its first query at or after ``j`` sees it. O(N * T_pad)
    time and memory, no mask.
    """
    N, c = indices.shape
    T = N * c
    device = indices.device
    pos = torch.arange(T, device=device)
    owner = torch.empty(T, dtype=torch.long, device=device)
    owner[indices.reshape(-1)] = torch.arange(N, device=device).repeat_interleave(c)
    held = owner[None, :] == torch.arange(N, device=device)[:, None]  # [N, T]
    nxt = torch.where(held, pos, T).flip(-1).cummin(-1).values.flip(-1)  # first own index >= j, T if none
    lo = first_visible(doc_ids, pos, window).amin(0)  # [T] earliest key any row's query t sees
    lo = torch.cat([lo, lo.new_full((1,), T)])
    return ~held & (lo[nxt] <= pos)


def needed_key_counts(indices: torch.Tensor, doc_ids: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[..., N]`` int64: the number of keys of :func:`needed_keys` per rank, for ``[..., N, c]`` layouts at once.

    The same sets counted from the runs of every rank, in O(N * c) per layout: with runs ``[a_k, b_k)`` in order
    and ``lo_k = lo(a_k)`` (the earliest key any row's query ``a_k`` sees), the keys rank ``r`` sees are the union
    of ``[lo_k, b_k)``; both ends of ``[lo_k, a_k)`` grow with ``k``, so the part before the runs adds up to
    ``sum_k max(0, a_k - max(lo_k, a_(k-1)))``, less the own tokens it covers, ``max(0, b_k - max(a_k,
    lo_(k+1)))`` of every run but the last.
    """
    T = indices.shape[-1] * indices.shape[-2]
    lo = first_visible(doc_ids, torch.arange(T, device=indices.device), window).amin(0)  # [T]
    idx = indices
    ones = torch.ones_like(idx[..., :1], dtype=torch.bool)
    step = torch.diff(idx, dim=-1) != 1
    starts = torch.cat([ones, step], dim=-1)
    ends = torch.cat([step, ones], dim=-1)
    a_cur = torch.where(starts, idx, -1).cummax(-1).values  # start of every token's run
    prev_a = torch.cat([torch.full_like(idx[..., :1], -1), a_cur[..., :-1]], dim=-1)  # previous run's start
    lo_here = lo[idx]
    before = torch.where(starts, (idx - torch.maximum(lo_here, prev_a)).clamp(min=0), 0).sum(-1)
    next_lo = torch.cat([lo_here[..., 1:], torch.full_like(idx[..., :1], T)], dim=-1)  # lo of the next run's start
    own = torch.where(ends, (idx + 1 - torch.maximum(a_cur, next_lo)).clamp(min=0), 0).sum(-1)
    return before - own
