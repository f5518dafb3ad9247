"""Small hand-written causal LMs for tests: each calls ``F.scaled_dot_product_attention`` in one chosen form.

They take the keyword arguments of a transformers causal LM (``input_ids``, ``position_ids``, ``labels``,
``shift_labels``, ``num_items_in_batch``, ``use_cache``) and return a transformers ``CausalLMOutput``, so the
parity helper (:mod:`tests.harness.parity`) and :func:`cpcompile.shard` treat them like HF models.

Attention forms (``ATTENTION_FORMS``):

* ``causal_gqa``: ``is_causal=True, enable_gqa=True`` with fewer KV heads than query heads (HF's call with the
  KV cache on); rewritten by cpcompile, plain global causal attention (documents are not separated).
* ``packed_docs``: a bool mask "causal and same document" built from ``position_ids`` (transformers' training
  mask); rewritten, and checked against cpcompile's mask on the first call.
* ``bidirectional``: a bool mask "same document", without causality: not the mask cpcompile applies.
* ``window``: a bool mask "causal, same document, within 4 tokens": not the mask cpcompile applies.
* ``float_bias``: the causal mask as a float additive bias (0 / -inf).
* ``no_mask``: neither a mask nor ``is_causal``: bidirectional attention over the whole row.
* ``dropout``: ``is_causal=True`` with ``dropout_p=0.1``.
* ``head_expanded``: the ``packed_docs`` mask expanded to every head, ``mask.expand(B, H, T, T)`` (the same for
  each head): rewritten like ``packed_docs``.
* ``head_windows``: a causal same-document ``[B, H, T, T]`` mask whose window differs per head: refused.
* ``document_ids``: causal and same document, read from a per-token ``document_ids`` input (the model's
  ``document_ids=`` keyword; ``position_ids`` still give the learned positions): one document stays whole
  across a rank's runs of tokens.
* ``window_diff``: causal, same document, and a sliding window of ``LONG_WINDOW`` tokens written as a difference
  of indices, ``(q - k) < LONG_WINDOW``: rewritten with that window.
* ``chunked``: causal, same document, and chunked attention (Llama-4 style) ``k // CHUNK == q // CHUNK``: refused
  (attention within fixed blocks of absolute indices is not a rule cpcompile applies).
* ``position_lookup``: transformers' packed-sequence mask as Jamba builds it: causal order of the position ids and
  equal document ids, both looked up at the token index (``position_ids[batch_idx, q_idx]``), in a model without
  learned positions, so that ``position_ids`` reach the mask alone and Dynamo traces their length as a symbol of
  its own (rewritten).
* ``causal_mask``: a bool mask of causal order alone, ``k <= q`` of ``arange(T)`` (a hand-written causal mask): no
  document condition, so attention crosses packed documents, as with ``causal_gqa`` (rewritten without one).
* ``causal_window``: ``causal_mask`` within ``WINDOW`` tokens, ``(k <= q) & (k > q - WINDOW)`` of ``arange(T)``:
  a sliding window across packed documents (rewritten with that window and without documents).
* ``causal_mask_break``: ``causal_mask`` with a graph break (``torch._dynamo.graph_break()``) between the mask and
  the attention: one graph builds the mask and hands it on, the attention's graph gets it as an input.
* ``packed_docs_break``: ``packed_docs`` with the same graph break: a handed mask with a document condition.
* ``causal_cached``: ``causal_mask`` built on the first call of a length and kept on the module, which later calls
  read (module state made by a compiled graph).
* ``causal_buffer``: ``causal_mask`` read from a buffer made at construction, ``causal[:T, :T]`` (module state made
  outside any graph).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.models.tiny import doc_ids, lm_output, seeded

WINDOW = 4
#: The window of the ``window_diff`` form: at least the chunk length of the tests that use it.
LONG_WINDOW = 24
#: The block of the ``chunked`` form.
CHUNK = 8

ATTENTION_FORMS = (
    "causal_gqa",
    "packed_docs",
    "bidirectional",
    "window",
    "float_bias",
    "no_mask",
    "dropout",
    "head_expanded",
    "head_windows",
    "document_ids",
    "window_diff",
    "chunked",
    "position_lookup",
    "causal_mask",
    "causal_window",
    "causal_mask_break",
    "packed_docs_break",
    "causal_cached",
    "causal_buffer",
)


class Attention(nn.Module):
    def __init__(self, form: str, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.form, self.heads, self.kv_heads = form, heads, kv_heads
        self.head_dim = hidden // heads
        self.q = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.kv = nn.Linear(hidden, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.cached_mask: torch.Tensor | None = None  # causal_cached
        if form == "causal_buffer":
            self.register_buffer("causal", torch.ones(512, 512, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(B, T, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.form != "causal_gqa":  # every other form uses plain multi-head attention
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        kwargs: dict = {}
        idx = torch.arange(T, device=x.device)
        causal = idx[None, :] <= idx[:, None]
        if self.form == "causal_gqa":
            kwargs = {"is_causal": True, "enable_gqa": True}
        elif self.form in (
            "bidirectional", "window", "packed_docs", "head_expanded", "head_windows", "document_ids", "window_diff",
            "chunked", "packed_docs_break",
        ):  # fmt: skip
            doc = position_ids if self.form == "document_ids" else doc_ids(position_ids)  # ids given as they are
            mask = doc[:, :, None] == doc[:, None, :]
            if self.form in ("packed_docs", "head_expanded", "document_ids", "packed_docs_break"):
                mask = mask & causal
            elif self.form == "window":
                mask = mask & causal & (idx[None, :] > idx[:, None] - WINDOW)
            elif self.form == "window_diff":
                mask = mask & causal & ((idx[:, None] - idx[None, :]) < LONG_WINDOW)
            elif self.form == "chunked":
                mask = mask & causal & (idx[None, :] // CHUNK == idx[:, None] // CHUNK)
            mask = mask[:, None]
            if self.form == "head_expanded":
                mask = mask.expand(B, self.heads, T, T)
            elif self.form == "head_windows":  # head h sees the 2 + h tokens up to itself
                window = torch.arange(2, 2 + self.heads, device=x.device)[None, :, None, None]
                mask = mask & causal & (idx[None, None, None, :] > idx[None, None, :, None] - window)
            kwargs = {"attn_mask": mask}
        elif self.form == "position_lookup":
            b = torch.arange(B, device=x.device)[:, None, None, None]
            q_idx, kv_idx = idx[None, None, :, None], idx[None, None, None, :]
            doc = _doc_ids(position_ids)
            mask = (position_ids[b, kv_idx] <= position_ids[b, q_idx]) & (doc[b, q_idx] == doc[b, kv_idx])
            kwargs = {"attn_mask": mask}
        elif self.form in ("causal_mask", "causal_mask_break"):
            kwargs = {"attn_mask": causal[None, None]}
        elif self.form == "causal_cached":
            if self.cached_mask is None or self.cached_mask.shape[-1] != T:
                self.cached_mask = causal[None, None]
            kwargs = {"attn_mask": self.cached_mask}
        elif self.form == "causal_buffer":
            kwargs = {"attn_mask": self.causal[:T, :T][None, None]}
        elif self.form == "causal_window":
            kwargs = {"attn_mask": (causal & (idx[None, :] > idx[:, None] - WINDOW))[None, None]}
        elif self.form == "float_bias":
            bias = torch.zeros(T, T, device=x.device).masked_fill(~causal, float("-inf"))
            kwargs = {"attn_mask": bias}
        elif self.form == "dropout":
            kwargs = {"is_causal": True, "dropout_p": 0.1}
        elif self.form != "no_mask":
            raise ValueError(f"unknown attention form {self.form!r}; known: {ATTENTION_FORMS}")
        if self.form.endswith("_break"):  # the mask is handed to the attention's graph
            torch._dynamo.graph_break()
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        return self.o(out.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, form: str, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.attn = Attention(form, hidden, heads, kv_heads)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x), position_ids)
        return x + self.mlp(x)


class TinyAttentionLM(nn.Module):
    """Embedding + learned positions (none with the ``position_lookup`` form) + ``layers`` blocks whose attention
    uses ``form`` + LM head.

    The attention modules are ``layers.<i>.attn`` (the names cpcompile reports).
    """

    def __init__(
        self,
        form: str,
        *,
        vocab: int = 128,
        hidden: int = 32,
        heads: int = 4,
        kv_heads: int = 2,
        layers: int = 2,
        max_positions: int = 512,
    ) -> None:
        super().__init__()
        if form not in ATTENTION_FORMS:
            raise ValueError(f"unknown attention form {form!r}; known: {ATTENTION_FORMS}")
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = None if form == "position_lookup" else nn.Embedding(max_positions, hidden)
        self.layers = nn.ModuleList(Block(form, hidden, heads, kv_heads) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(
        self,
        input_ids,
        position_ids=None,
        labels=None,
        shift_labels=None,
        num_items_in_batch=None,
        use_cache=None,
        document_ids=None,
    ):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x = self.embed(input_ids)
        if self.pos is not None:
            x = x + self.pos(position_ids)
        # the attention reads documents from position_ids, or from document_ids when the model is given them
        position_ids = position_ids if document_ids is None else document_ids
        for layer in self.layers:
            x = layer(x, position_ids)
        logits = self.head(x)
        return lm_output(logits, labels, shift_labels, num_items_in_batch)


class TinyMLPLM(nn.Module):
    """A causal LM without attention (token-wise MLP): a model in which cpcompile has nothing to rewrite."""

    def __init__(self, vocab: int = 128, hidden: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(
        self, input_ids, position_ids=None, labels=None, shift_labels=None, num_items_in_batch=None, use_cache=None
    ):
        x = self.embed(input_ids)
        logits = self.head(x + self.mlp(x))
        return lm_output(logits, labels, shift_labels, num_items_in_batch)


def attention_lm(form: str, *, seed: int = 0, **kwargs) -> TinyAttentionLM:
    """A :class:`TinyAttentionLM` with weights drawn from ``seed``, in train mode."""
    return seeded(TinyAttentionLM, form, **kwargs, seed=seed)


def mlp_lm(*, seed: int = 0, **kwargs) -> TinyMLPLM:
    """A :class:`TinyMLPLM` with weights drawn from ``seed``, in train mode."""
    return seeded(TinyMLPLM, **kwargs, seed=seed)
