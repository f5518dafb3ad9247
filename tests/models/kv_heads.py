"""Tiny grouped-query causal LMs (:class:`tests.models.tiny.TinyLM`) whose attention expands K/V to the query heads
in a chosen spelling.

``SPELLINGS`` are the ways model code outside transformers writes the expansion (see
:mod:`cpcompile.passes.kv_heads`); ``"tile"`` (``repeat``) is not grouped-query order and must not be taken for
it. The attention calls ``F.scaled_dot_product_attention(..., is_causal=True)``; with ``window`` it passes a
causal, same-document (documents from ``position_ids``), sliding-window bool mask instead. No position table.
"""

from __future__ import annotations

from functools import partial

import torch

from tests.models.attention import Mask
from tests.models.tiny import SDPA, TinyLM, causal, seeded

SPELLINGS = (
    "repeat_kv",  # k[:, :, None].expand(B, Hkv, n, T, D).reshape(B, H, T, D)
    "unsqueeze_flatten",  # k.unsqueeze(2).expand(B, Hkv, n, T, D).flatten(1, 2)
    "repeat_interleave",  # k.repeat_interleave(n, dim=1)
    "bthd_expand",  # on [B, T, Hkv, D]: unsqueeze(3).expand(...).reshape(B, T, H, D), then transpose(1, 2)
    "bthd_repeat_interleave",  # on [B, T, Hkv, D]: repeat_interleave(n, dim=2), then transpose(1, 2)
    "tile",  # k.repeat(1, n, 1, 1): query head h uses KV head h % Hkv (not GQA: gathered expanded)
)


def expand_heads(x: torch.Tensor, n: int, spelling: str) -> torch.Tensor:
    """``x`` ``[B, T, Hkv, D]`` as ``[B, H, T, D]`` with ``H = n * Hkv``, written in ``spelling``."""
    B, T, Hkv, D = x.shape
    if spelling.startswith("bthd"):
        if spelling == "bthd_expand":
            y = x.unsqueeze(3).expand(B, T, Hkv, n, D).reshape(B, T, Hkv * n, D)
        else:
            y = x.repeat_interleave(n, dim=2)
        return y.transpose(1, 2)
    x = x.transpose(1, 2)  # [B, Hkv, T, D]
    if spelling == "repeat_kv":
        return x[:, :, None, :, :].expand(B, Hkv, n, T, D).reshape(B, Hkv * n, T, D)
    if spelling == "unsqueeze_flatten":
        return x.unsqueeze(2).expand(B, Hkv, n, T, D).flatten(1, 2)
    if spelling == "repeat_interleave":
        return x.repeat_interleave(n, dim=1)
    if spelling == "tile":
        return x.repeat(1, n, 1, 1)
    raise ValueError(f"unknown spelling {spelling!r}; known: {SPELLINGS}")


def kv_heads_lm(spelling: str, *, seed: int = 0, layers: int = 2, window: int | None = None, **sizes) -> TinyLM:
    """A :class:`TinyLM` of ``layers`` attention layers (``layers.<i>.attn``) expanding K/V in ``spelling``, causal
    or (``window``) a sliding window of ``window`` tokens; weights drawn from ``seed``, in train mode; ``sizes``:
    TinyLM's ``vocab``, ``hidden``, ``heads``, ``kv_heads``."""
    if spelling not in SPELLINGS:
        raise ValueError(f"unknown spelling {spelling!r}; known: {SPELLINGS}")
    mask = causal if window is None else Mask("window", window=window)
    attention = partial(SDPA, mask=mask, expand=partial(expand_heads, spelling=spelling))
    return seeded(TinyLM, [attention] * layers, seed=seed, **sizes)
