"""A small grouped-query causal LM whose attention expands K/V to the query heads in a chosen spelling.

``SPELLINGS`` are the ways model code outside transformers writes the expansion (see
:mod:`cpcompile.passes.kv_heads`); ``"tile"`` (``repeat``) is not grouped-query order and must not be taken for
it. The model takes ``input_ids``/``labels``/``shift_labels``/``num_items_in_batch``/``position_ids`` like
:mod:`tests.models.attention` and calls ``F.scaled_dot_product_attention(..., is_causal=True)``; with ``window`` it
passes a causal, same-document (documents from ``position_ids``), sliding-window bool mask instead.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.models.tiny import doc_ids, lm_output, seeded

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


class KVAttention(nn.Module):
    def __init__(self, spelling: str, hidden: int, heads: int, kv_heads: int, window: int | None) -> None:
        super().__init__()
        self.spelling, self.heads, self.kv_heads, self.window = spelling, heads, kv_heads, window
        self.head_dim = hidden // heads
        self.q = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        n = self.heads // self.kv_heads
        k = expand_heads(self.k(x).view(B, T, self.kv_heads, self.head_dim), n, self.spelling)
        v = expand_heads(self.v(x).view(B, T, self.kv_heads, self.head_dim), n, self.spelling)
        if self.window is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            idx = torch.arange(T, device=x.device)
            causal = (idx[None, :] <= idx[:, None]) & (idx[None, :] > idx[:, None] - self.window)
            doc = doc_ids(position_ids)
            mask = causal[None] & (doc[:, :, None] == doc[:, None, :])
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return self.o(out.transpose(1, 2).reshape(B, T, -1))


class KVHeadsLM(nn.Module):
    """Embedding + ``layers`` blocks of :class:`KVAttention` + LM head; modules ``layers.<i>.attn``."""

    def __init__(
        self,
        spelling: str,
        *,
        vocab: int = 128,
        hidden: int = 32,
        heads: int = 4,
        kv_heads: int = 2,
        layers: int = 2,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {"norm": nn.LayerNorm(hidden), "attn": KVAttention(spelling, hidden, heads, kv_heads, window)}
            )
            for _ in range(layers)
        )
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(
        self, input_ids, position_ids=None, labels=None, shift_labels=None, num_items_in_batch=None, use_cache=None
    ):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + layer["attn"](layer["norm"](x), position_ids)
        logits = self.head(x)
        return lm_output(logits, labels, shift_labels, num_items_in_batch)


def kv_heads_lm(spelling: str, *, seed: int = 0, **kwargs) -> KVHeadsLM:
    """A :class:`KVHeadsLM` with weights drawn from ``seed``, in train mode."""
    return seeded(KVHeadsLM, spelling, **kwargs, seed=seed)
