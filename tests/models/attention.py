"""Tiny causal LMs (:class:`tests.models.tiny.TinyLM`) whose attention calls ``F.scaled_dot_product_attention`` in
one chosen form, with learned positions looked up at the given ``position_ids`` (none with ``position_lookup``).

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
* one mask for every head in the spellings of model libraries, rewritten like ``packed_docs``:

  * ``head_expand_causal``: x-transformers: the same-document mask ``[B, 1, T, T]`` negated twice (``masks =
    [~attn_mask]``, then ``~or_reduce(masks)``), expanded to the heads, ``mask.expand(B, H, T, T)``, then ``mask &
    ~causal_mask`` (``causal_mask = ones((i, j)).triu(j - i + 1)``: True above the diagonal);
  * ``head_repeat``: ``mask.repeat(1, H, 1, 1)`` of the causal same-document ``[B, 1, T, T]`` mask;
  * ``head_einops``: ``einops.repeat(mask, 'b i j -> b h i j', h=H)`` of the causal same-document ``[B, T, T]``;
  * ``head_none_expand``: ``doc_mask[:, None].expand(-1, H, -1, -1) & causal`` (indexing with ``None``, expanding,
    then the causal condition).
* ``head_written``: ``head_none_expand`` with head 0 then written in place, ``mask[:, 0] = causal`` (that head
  attends across documents): a mask that differs per head, refused.
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
* ``causal_mask_eager`` / ``packed_docs_eager``: ``causal_mask`` / ``packed_docs`` built in eager code (a
  ``torch.compiler.disable`` function): no compiled graph builds the mask, the attention's graph gets it as an input.
* ``causal_cached``: ``causal_mask`` built on the first call of a length and kept on the module, which later calls
  read (module state made by a compiled graph).
* ``causal_buffer``: ``causal_mask`` read from a buffer made at construction, ``causal[:T, :T]`` (module state made
  outside any graph).

Every form but ``causal_gqa`` expands K/V to the query heads (:func:`tests.models.tiny.repeat_kv`).
"""

from __future__ import annotations

from functools import partial

import einops
import torch

from tests.models.tiny import (
    SDPA,
    AttentionFactory,
    LearnedPositions,
    Positions,
    TinyLM,
    batch_positions,
    doc_ids,
    repeat_kv,
    seeded,
)

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
    "head_expand_causal",
    "head_repeat",
    "head_einops",
    "head_none_expand",
    "head_written",
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
    "causal_mask_eager",
    "packed_docs_eager",
)
#: The forms whose bool mask is built from the documents of the batch.
_DOCUMENT_FORMS = (
    "bidirectional", "window", "packed_docs", "head_expanded", "head_windows", "document_ids", "window_diff", "chunked",
    "packed_docs_break", "packed_docs_eager", "head_expand_causal", "head_repeat", "head_einops", "head_none_expand",
    "head_written",
)  # fmt: skip
#: The forms that broadcast one mask to every head in a library's spelling (:func:`_head_broadcast`).
_HEAD_BROADCAST_FORMS = ("head_expand_causal", "head_repeat", "head_einops", "head_none_expand", "head_written")
#: The forms whose model has no learned positions: ``position_ids`` reach the mask alone.
_WITHOUT_POSITIONS = ("position_lookup",)


def _document_source(batch: dict) -> torch.Tensor:
    """What the masks read documents from: the batch's ``document_ids`` when the model is given them, else its
    position ids."""
    return batch["document_ids"] if batch["document_ids"] is not None else batch_positions(batch)


class Mask:
    """The SDPA keyword arguments of ``form`` (a mask of :class:`tests.models.tiny.SDPA`); ``window``: the window of
    the ``window`` and ``causal_window`` forms.

    Documents come from ``position_ids``, or from ``document_ids`` when the model is given them (taken as they
    are by the ``document_ids`` form, split where they do not step by +1 by the others).
    """

    def __init__(self, form: str, window: int = WINDOW) -> None:
        if form not in ATTENTION_FORMS:
            raise ValueError(f"unknown attention form {form!r}; known: {ATTENTION_FORMS}")
        self.form, self.window = form, window

    def build(self, attn: SDPA, max_len: int) -> None:
        """The state the ``causal_cached`` and ``causal_buffer`` forms read, on the attention module: the mask kept
        by the last call (``cached_mask``), a ``[max_len, max_len]`` causal buffer (``causal``)."""
        if self.form == "causal_cached":
            attn.cached_mask = None
        if self.form == "causal_buffer":
            attn.register_buffer("causal", torch.ones(max_len, max_len, dtype=torch.bool).tril(), persistent=False)

    def __call__(self, attn: SDPA, q: torch.Tensor, batch: dict) -> dict:
        if self.form.endswith("_eager"):  # no compiled graph builds the mask
            return _eager_kwargs(self, attn, q, batch)
        kwargs = self._kwargs(attn, q, batch)
        if self.form.endswith("_break"):  # the mask is handed to the attention's graph
            torch._dynamo.graph_break()
        return kwargs

    def _kwargs(self, attn: SDPA, q: torch.Tensor, batch: dict) -> dict:
        B, H, T, _ = q.shape
        idx = torch.arange(T, device=q.device)
        causal = idx[None, :] <= idx[:, None]
        if self.form == "causal_gqa":
            return {"is_causal": True}
        if self.form in _DOCUMENT_FORMS:
            ids = _document_source(batch)
            doc = ids if self.form == "document_ids" else doc_ids(ids)
            mask = doc[:, :, None] == doc[:, None, :]
            if self.form in _HEAD_BROADCAST_FORMS:
                return {"attn_mask": _head_broadcast(self.form, mask, idx, H)}
            if self.form in ("packed_docs", "head_expanded", "document_ids", "packed_docs_break", "packed_docs_eager"):
                mask = mask & causal
            elif self.form == "window":
                mask = mask & causal & (idx[None, :] > idx[:, None] - self.window)
            elif self.form == "window_diff":
                mask = mask & causal & ((idx[:, None] - idx[None, :]) < LONG_WINDOW)
            elif self.form == "chunked":
                mask = mask & causal & (idx[None, :] // CHUNK == idx[:, None] // CHUNK)
            mask = mask[:, None]
            if self.form == "head_expanded":
                mask = mask.expand(B, H, T, T)
            elif self.form == "head_windows":  # head h sees the 2 + h tokens up to itself
                window = torch.arange(2, 2 + H, device=q.device)[None, :, None, None]
                mask = mask & causal & (idx[None, None, None, :] > idx[None, None, :, None] - window)
            return {"attn_mask": mask}
        if self.form == "position_lookup":  # both looked up at the token index, as transformers' packed mask
            ids = _document_source(batch)
            doc = doc_ids(ids)
            b = torch.arange(B, device=q.device)[:, None, None, None]
            q_idx, kv_idx = idx[None, None, :, None], idx[None, None, None, :]
            return {"attn_mask": (ids[b, kv_idx] <= ids[b, q_idx]) & (doc[b, q_idx] == doc[b, kv_idx])}
        if self.form in ("causal_mask", "causal_mask_break", "causal_mask_eager"):
            return {"attn_mask": causal[None, None]}
        if self.form == "causal_cached":
            if attn.cached_mask is None or attn.cached_mask.shape[-1] != T:
                attn.cached_mask = causal[None, None]
            return {"attn_mask": attn.cached_mask}
        if self.form == "causal_buffer":
            return {"attn_mask": attn.causal[:T, :T][None, None]}
        if self.form == "causal_window":
            return {"attn_mask": (causal & (idx[None, :] > idx[:, None] - self.window))[None, None]}
        if self.form == "float_bias":
            return {"attn_mask": torch.zeros(T, T, device=q.device).masked_fill(~causal, float("-inf"))}
        if self.form == "dropout":
            return {"is_causal": True, "dropout_p": 0.1}
        return {}  # no_mask


def _head_broadcast(form: str, same_doc: torch.Tensor, idx: torch.Tensor, H: int) -> torch.Tensor:
    """The ``[B, H, T, T]`` causal same-document mask of ``form``, one mask for every head, from the
    same-document ``[B, T, T]`` mask and the token index ``idx``."""
    B, T, _ = same_doc.shape
    causal = idx[None, :] <= idx[:, None]
    if form == "head_expand_causal":  # x-transformers' AttentionLayers, Attend and create_causal_mask
        masks = [~same_doc[:, None]]  # the positions each query must not see
        mask = ~masks[0]  # ~or_reduce(masks)
        i = j = T
        causal_mask = torch.ones((i, j), device=same_doc.device, dtype=torch.bool).triu(j - i + 1)
        return mask.expand(B, H, i, j) & ~causal_mask
    if form == "head_repeat":
        return (same_doc & causal)[:, None].repeat(1, H, 1, 1)
    if form == "head_einops":
        return einops.repeat(same_doc & causal, "b i j -> b h i j", h=H)
    mask = same_doc[:, None].expand(-1, H, -1, -1) & causal  # head_none_expand
    if form == "head_written":
        mask[:, 0] = causal
    return mask


@torch.compiler.disable
def _eager_kwargs(mask: Mask, attn: SDPA, q: torch.Tensor, batch: dict) -> dict:
    return mask._kwargs(attn, q, batch)


def sdpa(form: str) -> AttentionFactory:
    """The attention factory of ``form`` for :class:`TinyLM`: SDPA under :class:`Mask` ``form``, K/V expanded to
    the query heads except for ``causal_gqa``."""
    return partial(SDPA, mask=Mask(form), expand=None if form == "causal_gqa" else repeat_kv)


def attention_lm(form: str, *, seed: int = 0, layers: int = 2, max_positions: int = 512, **sizes) -> TinyLM:
    """A :class:`TinyLM` of ``layers`` attention layers in ``form`` (modules ``layers.<i>.attn``) and learned
    positions (``max_positions`` rows; none for ``position_lookup``, whose ``position_ids`` reach the mask alone),
    weights drawn from ``seed``, in train mode; ``sizes``: TinyLM's ``vocab``, ``hidden``, ``heads``, ``kv_heads``."""
    positions = Positions() if form in _WITHOUT_POSITIONS else LearnedPositions()
    return seeded(TinyLM, [sdpa(form)] * layers, max_len=max_positions, positions=positions, seed=seed, **sizes)


def mlp_lm(*, seed: int = 0, **sizes) -> TinyLM:
    """A causal LM without attention (one token-wise MLP block): a model in which cpcompile has nothing to rewrite;
    weights drawn from ``seed``, in train mode; ``sizes``: TinyLM's ``vocab``, ``hidden``."""
    return seeded(TinyLM, [None], seed=seed, **sizes)
