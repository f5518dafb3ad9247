"""Tiny causal LMs (:class:`tests.models.tiny.TinyLM`, learned positions at ``position_ids``) whose attention is
``flex_attention``, written the way torchtitan writes it.

Attention builds its mask from a ``mask_mod`` over per-token tensors of the batch it is given, as torchtitan's
document BlockMask does (document ids are ``(position_ids == 0).cumsum(-1)``: packed documents restart their
positions at 0):

* ``document``: causal and same document (torchtitan's ``and_masks(causal_mask, document_mask)``);
* ``sliding``: ``document`` within a sliding window of :data:`WINDOW` tokens;
* ``softcap``: ``document`` with a soft-capping ``score_mod`` (``cap * tanh(score / cap)``, Gemma 2's form) and
  an ALiBi-style per-head bias, and ``return_lse=True``: the logsumexp feeds the residual stream, so its
  gradient matters.

``document_eager`` (:data:`EAGER_FORMS`) is ``document`` with the document ids made in eager code
(``torch.compiler.disable``) from the positions the model is given, as torchtitan's trainer makes its masks:
under CP they are one rank's ids, which the flex site refuses at run time.

Refused forms (:data:`REFUSED_FORMS`): ``dense_mask`` (its mask_mod reads a ``[B, T, T]`` mask precomputed over the
tokens the model is given) and ``learned_bias`` (its score_mod reads a learned per-head bias, a parameter).

``impl`` chooses the attention: ``"flex"`` calls ``flex_attention`` with ``create_block_mask``; ``"reference"``
computes the same attention densely (SDPA under ``create_mask``'s bool mask, or the explicit softmax when a
score_mod or the logsumexp is needed), which runs forward and backward on CPU, where flex has no backward;
``"auto"`` (default) is flex inside ``torch.compile`` (the CP side) and the reference in eager mode (the
one-process side of a parity test). K/V have fewer heads than Q (``enable_gqa=True``).
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, create_mask, flex_attention

from tests.models.positions import TokensLM, torchtitan_llama3_model, torchtitan_qwen3_moe_model
from tests.models.tiny import Attention, LearnedPositions, TinyLM, batch_positions, lm_output, seeded

FORMS = ("document", "sliding", "softcap")
#: Forms whose document ids are computed outside the compiled graphs, from the positions the model is given.
EAGER_FORMS = ("document_eager",)
REFUSED_FORMS = ("dense_mask", "learned_bias")
#: Sliding window of the ``sliding`` form, in tokens.
WINDOW = 7
#: Soft-cap of the ``softcap`` form's scores.
CAP = 2.0


def mods(form: str, docs: torch.Tensor, heads: int, bias: torch.Tensor | None = None):
    """``(mask_mod, score_mod)`` of ``form`` over the ``[B, T]`` document ids ``docs``."""

    def document(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (docs[b, q_idx] == docs[b, kv_idx])

    def sliding(b, h, q_idx, kv_idx):
        return document(b, h, q_idx, kv_idx) & (q_idx - kv_idx < WINDOW)

    def softcap(score, b, h, q_idx, kv_idx):
        slope = 2.0 ** (-(h + 1).float() / heads)
        return CAP * torch.tanh(score / CAP) - slope * (q_idx - kv_idx).float() * 0.1

    if form == "dense_mask":
        same = docs[:, :, None] == docs[:, None, :]  # [B, T, T] over the tokens given

        def dense(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & same[b, q_idx, kv_idx]

        return dense, None
    if form == "learned_bias":

        def learned(score, b, h, q_idx, kv_idx):
            return score + bias[h]

        return document, learned
    return (sliding if form == "sliding" else document), (softcap if form == "softcap" else None)


class FlexAttention(Attention):
    """``flex_attention`` of ``form`` (``enable_gqa=True``: K/V keep their heads); ``impl`` (an attribute a test
    may set): ``"flex"``, ``"reference"`` or ``"auto"`` (see the module docstring)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, max_len: int, *, form: str, impl: str) -> None:
        super().__init__(hidden, heads, kv_heads, max_len)
        self.form, self.impl = form, impl
        if form == "softcap":
            self.lse_proj = nn.Linear(heads, hidden, bias=False)
        self.bias = nn.Parameter(torch.zeros(heads)) if form == "learned_bias" else None

    def attend(self, q, k, v, batch):
        B, _, T, _ = q.shape
        if self.form in EAGER_FORMS:
            docs = _eager_document_ids(batch_positions(batch))
        else:
            docs = (batch_positions(batch) == 0).cumsum(-1)  # torchtitan: document ids from the document starts
        mask_mod, score_mod = mods(self.form.removesuffix("_eager"), docs, self.heads, self.bias)
        want_lse = self.form == "softcap"
        flex = self.impl == "flex" or (self.impl == "auto" and torch.compiler.is_compiling())
        if flex:
            block_mask = create_block_mask(mask_mod, B, None, T, T, device=q.device)
            # the lse through return_aux: the deprecated return_lse=True warns once, and the warning's state is a
            # Dynamo guard (one recompile on the second call)
            aux = AuxRequest(lse=True) if want_lse else None
            res = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True, return_aux=aux)
            out, lse = (res[0], res[1].lse) if want_lse else (res, None)
        else:
            out, lse = reference_attention(q, k, v, mask_mod, score_mod, want_lse)
        return out, None if lse is None else self.lse_proj(lse.transpose(1, 2))


@torch.compiler.disable
def _eager_document_ids(positions: torch.Tensor) -> torch.Tensor:
    """Document ids made in eager code (as torchtitan's trainer makes its masks, outside the model)."""
    return (positions == 0).cumsum(-1)


def reference_attention(q, k, v, mask_mod, score_mod, want_lse: bool):
    """The attention flex computes, densely: ``create_mask``'s bool mask, SDPA when nothing else is needed."""
    B, H, T, D = q.shape
    mask = create_mask(mask_mod, B, 1, T, T, device=q.device)
    if score_mod is None and not want_lse:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), None
    rep = H // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    if score_mod is not None:
        idx = torch.arange(T, device=q.device)
        b, h = torch.arange(B)[:, None, None, None], torch.arange(H)[None, :, None, None]
        s = score_mod(s, b, h, idx[:, None], idx[None, :])
    s = s.masked_fill(~mask, -math.inf)
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def flex_lm(form: str, *, seed: int = 0, layers: int = 2, impl: str = "auto", **sizes) -> TinyLM:
    """A :class:`TinyLM` of ``layers`` flex attention layers in ``form`` (modules ``layers.<i>.attn``) and learned
    positions, weights drawn from ``seed``, in train mode; ``sizes``: TinyLM's ``vocab``, ``hidden``, ``heads``,
    ``kv_heads``, ``max_len`` (rows of the position table)."""
    if form not in (*FORMS, *REFUSED_FORMS, *EAGER_FORMS) or impl not in ("auto", "flex", "reference"):
        raise ValueError(f"unknown form {form!r} or impl {impl!r}; forms {FORMS}, impls auto/flex/reference")
    attention = partial(FlexAttention, form=form, impl=impl)
    return seeded(TinyLM, [attention] * layers, positions=LearnedPositions(), seed=seed, **sizes)


def document(*, seed: int = 0, **kwargs) -> TinyLM:
    return flex_lm("document", seed=seed, **kwargs)


def sliding(*, seed: int = 0, **kwargs) -> TinyLM:
    return flex_lm("sliding", seed=seed, **kwargs)


def softcap(*, seed: int = 0, **kwargs) -> TinyLM:
    return flex_lm("softcap", seed=seed, **kwargs)


class EagerReferenceSDPA(nn.Module):
    """A transformers model with ``attn_implementation="flex_attention"`` that runs its SDPA path in eager mode.

    Compiled (the CP side), the model runs transformers' flex path: ``flex_attention`` with the BlockMask its
    masking utilities build. In eager mode (the one-process reference) it runs ``"sdpa"`` with the same weights
    and the equivalent mask, because CPU flex has no backward. ``config`` is the model's.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config = model.config

    def forward(self, **kwargs):
        if torch.compiler.is_compiling():
            return self.model(**kwargs)
        self.config._attn_implementation = "sdpa"
        try:
            return self.model(**kwargs)
        finally:
            self.config._attn_implementation = "flex_attention"


def hf_flex(*, seed: int = 0, family: str = "llama", **overrides) -> EagerReferenceSDPA:
    """A tiny transformers ``family`` model (``cpcompile.testing.tiny_model``) on transformers' flex path."""
    from cpcompile.testing import tiny_model

    return EagerReferenceSDPA(tiny_model(family, seed=seed, attn_implementation="flex_attention", **overrides))


def document_eager(*, seed: int = 0, **kwargs) -> TinyLM:
    return flex_lm("document_eager", seed=seed, **kwargs)


class TorchtitanFlexLM(TokensLM):
    """torchtitan's ``Llama3Model`` with its ``FlexAttention`` inner attention (its default), called as
    ``model(tokens, positions=..., attention_masks=...)`` with the BlockMask built inside the forward from
    torchtitan's own mask mods, ``and_masks(get_causal_mask_mod(), get_document_mask_mod(position_ids))``, and
    its ``create_attention_mask``. In eager mode (the one-process reference, where CPU flex has no backward) its
    ``FlexAttention.compiled_flex_attn`` is SDPA under ``create_mask`` of the same mask_mod."""

    def forward(
        self, input_ids, position_ids=None, labels=None, shift_labels=None, num_items_in_batch=None, use_cache=None
    ):
        from torch.nn.attention.flex_attention import and_masks
        from torchtitan.models.common import attention as tt

        B, T = input_ids.shape
        mask_mod = and_masks(tt.get_causal_mask_mod(), tt.get_document_mask_mod(position_ids))
        if torch.compiler.is_compiling():
            masks = tt.create_attention_mask(mask_mod, B, None, T, T, device=input_ids.device)
        else:
            masks = create_block_mask(mask_mod, B, None, T, T, device=input_ids.device)
        logits = _torchtitan_call(self.model, input_ids, position_ids, masks)
        return lm_output(logits, labels, shift_labels, num_items_in_batch)


def _torchtitan_call(model, tokens, positions, masks):
    """``model(tokens, positions=..., attention_masks=...)``: compiled, as it is (its flex sites are rewritten);
    in eager mode (the one-process reference, where CPU flex has no backward) with torchtitan's
    ``FlexAttention.compiled_flex_attn`` replaced by :func:`_dense_flex`."""
    from torchtitan.models.common import attention as tt

    if torch.compiler.is_compiling():
        return model(tokens, positions=positions, attention_masks=masks)
    original = tt.FlexAttention.compiled_flex_attn
    tt.FlexAttention.compiled_flex_attn = staticmethod(_dense_flex)
    try:
        return model(tokens, positions=positions, attention_masks=masks)
    finally:
        tt.FlexAttention.compiled_flex_attn = original


class TorchtitanTrainerLM(TokensLM):
    """A torchtitan decoder (``Llama3Model``, ``Qwen3Model``) on its default FlexAttention, called as torchtitan's
    trainer calls it: the masks come from outside the model, ``model.get_attention_masks(positions)`` on the
    *global* batch (:func:`torchtitan_trainer_masks`), so its default document mask
    (``get_efficient_causal_mask_mod_for_packed_document``: document starts or ends by token, ``scatter_`` by
    document id) is built once for the whole sequence, and ``cpcompile.shard`` hands each rank a BlockMask of the
    same ``mask_mod``. In eager mode (the one-process reference) flex is SDPA under the mask's ``create_mask``."""

    def forward(
        self,
        input_ids,
        position_ids=None,
        attention_masks=None,
        labels=None,
        shift_labels=None,
        num_items_in_batch=None,
        use_cache=None,
    ):
        logits = _torchtitan_call(self.model, input_ids, position_ids, attention_masks)
        return lm_output(logits, labels, shift_labels, num_items_in_batch)


def torchtitan_trainer(*, seed: int = 0, layers: int = 1, max_len: int = 128) -> TorchtitanTrainerLM:
    """torchtitan's Llama 3 on its default flex attention, as :class:`TorchtitanTrainerLM`."""
    model = torchtitan_llama3_model(seed=seed, layers=layers, max_len=max_len, flex=True)
    return TorchtitanTrainerLM(model, layers).train()


class TorchtitanMasksInForwardLM(TorchtitanFlexLM):
    """torchtitan's Llama 3 with its default masks built inside the compiled forward from the positions it is
    given (``model.get_attention_masks(position_ids)``): under CP, this rank's positions and local length."""

    def forward(
        self, input_ids, position_ids=None, labels=None, shift_labels=None, num_items_in_batch=None, use_cache=None
    ):
        masks = self.model.get_attention_masks(position_ids)
        logits = self.model(input_ids, positions=position_ids, attention_masks=masks)
        return lm_output(logits, labels, shift_labels, num_items_in_batch)


def torchtitan_masks_in_forward(*, seed: int = 0, layers: int = 1) -> TorchtitanMasksInForwardLM:
    model = torchtitan_llama3_model(seed=seed, layers=layers, max_len=128, flex=True)
    return TorchtitanMasksInForwardLM(model, layers).train()


def torchtitan_trainer_moe(*, seed: int = 0, layers: int = 2, max_len: int = 128) -> TorchtitanTrainerLM:
    """torchtitan's Qwen3-MoE (:func:`tests.models.positions.torchtitan_qwen3_moe_model`), as
    :class:`TorchtitanTrainerLM`."""
    return TorchtitanTrainerLM(torchtitan_qwen3_moe_model(seed=seed, layers=layers, max_len=max_len), layers).train()


def torchtitan_trainer_masks(batch: dict) -> dict:
    """``{"attention_masks": ...}``: torchtitan's default masks of the global ``batch``, from its own
    ``Llama3Model.get_attention_masks(positions)`` (causal and its efficient packed-document mask_mod; for one
    row it reads document starts by document id, for several document ends by token)."""
    model = torchtitan_llama3_model(seed=0, layers=1, max_len=128, flex=True)
    return {"attention_masks": model.get_attention_masks(batch["position_ids"])}


def _dense_flex(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    """torchtitan's ``FlexAttention.compiled_flex_attn`` densely: SDPA under the BlockMask's mask_mod."""
    assert score_mod is None and not return_aux.lse
    B, _, L, _ = q.shape
    mask = create_mask(block_mask.mask_mod, B, 1, L, L, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa), None


def torchtitan_flex(*, seed: int = 0, layers: int = 1, max_len: int = 128) -> TorchtitanFlexLM:
    """torchtitan's Llama 3 (:func:`tests.models.positions.torchtitan_llama3_model`) on its default flex
    attention, as :class:`TorchtitanFlexLM`."""
    model = torchtitan_llama3_model(seed=seed, layers=layers, max_len=max_len, flex=True)
    return TorchtitanFlexLM(model, layers).train()
