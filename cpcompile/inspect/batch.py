"""The synthetic packed batch ``cpcompile inspect`` traces with (:func:`packed_batch`), also the batch of the
tests, examples and benchmarks (re-exported by :mod:`cpcompile.testing`)."""

from __future__ import annotations

import torch

from cpcompile.plan import IGNORE_INDEX

__all__ = ["packed_batch"]


def packed_batch(
    doc_lens: list[list[int]],
    *,
    vocab_size: int = 128,
    seed: int = 0,
    mask_first_label: bool = True,
) -> dict[str, torch.Tensor]:
    """A packed ``[B, T]`` batch: row ``b`` concatenates documents of lengths ``doc_lens[b]``.

    Every row must have the same total length. ``position_ids`` restart at 0 at every document; ``labels``
    are the input ids (unshifted, transformers convention) with the first token of every document set to
    ``-100`` when ``mask_first_label`` (so no label crosses a document boundary after the shift).
    """
    totals = {sum(row) for row in doc_lens}
    if len(totals) != 1:
        raise ValueError(f"every row must have the same total length, got {[sum(r) for r in doc_lens]}")
    g = torch.Generator().manual_seed(seed)
    T = totals.pop()
    ids = torch.randint(1, vocab_size, (len(doc_lens), T), generator=g)
    pos = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in doc_lens])
    labels = ids.clone()
    if mask_first_label:
        labels[pos == 0] = IGNORE_INDEX
    return {"input_ids": ids, "position_ids": pos, "labels": labels}
