"""Tiny causal LMs that mix tokens outside attention, one mixer each, for tests of the mixing pass.

:func:`mixer_lm` is a :class:`tests.models.tiny.TinyLM`: embedding -> :class:`Mixer` (module ``mixer``) -> one
attention block (``layers.0``, the ``packed_docs`` mask of :mod:`tests.models.attention`) -> LM head. Mixers
(``MIXERS``):

* ``conv``: LFM2's short conv: depthwise ``conv1d(padding=k-1, groups=C)`` over ``[B, C, T]``, then ``[..., :T]``;
* ``conv_cumsum``: the conv, then a cumulative sum along the sequence (a scan: refused);
* ``merged_rows_cumsum``: a ``baddbmm`` of the tokens with the batch and sequence merged into its rows
  (``[1, B*T, C]``, as RG-LRU's gate), then a cumulative sum along the sequence (refused);
* ``squeezed_conv``: the same conv on channels that reach it as Zamba's Mamba mixer hands them on: a
  ``view(B, C, 1, T)`` then ``squeeze(2)`` in front of the conv (the sequence dim must stay tagged through the
  squeeze, or the conv would run on this rank's tokens only);
* ``shift``: token shift, ``F.pad(x, (0, 0, 1, 0))[:, :-1]`` mixed into ``x`` (RWKV-style);
* ``first_diff``: the change from the previous token, the first token's from itself minus one,
  ``torch.diff(x, dim=1, prepend=x[:, :1] - 1)`` (transformers' packed-sequence detection on ``position_ids``);
* ``next_diff``: the change to the next token, ``F.pad(torch.diff(x, dim=1), (0, 0, 0, 1))`` (not causal);
* ``mask_cumsum``: positions from a mask inside the model, ``(input_ids > 0).cumsum(-1) - 1``, looked up in a
  learned position table;
* ``mean_pool``: adds the mean over the sequence to every token (a reduction over the sequence);
* ``last_token``: adds the last token's state to every token (a selection at a position);
* ``chunked_scan``: a linear recurrence in plain torch in the style of the gated delta rule: the sequence in
  chunks of 4, ``q k^T`` within chunks (causal), ``k^T v`` states summed over earlier chunks;
* ``custom_per_token``: ``cpcompile_tests::softsign`` (a custom op, per token);
* ``custom_scan``: ``cpcompile_tests::prefix_sum`` (a custom op, a cumulative sum over the sequence);
* ``norm_pool``: adds the 2-norm over the sequence, ``x.norm(2, 1)`` (the dim after ``p``);
* ``sort_tokens``: ``msort`` along the sequence (``msort`` sorts along the first dim and takes no dim argument);
* ``tril_tokens``: adds ``x.tril()`` of ``[B, T, H]``, which zeroes elements by their (local) token index;
* ``token_norm``: scales every token by its own 2-norm, ``x.norm(2, -1)``, and sorts the batch rows at every
  token (``msort`` along the batch dim) and adds ``tril`` of per-token ``[H, H]`` outer products: per token;
* ``feature_setitem``: zeroes the first features of every token in place, ``y[:, :, :8] = 0`` (an index that is a
  slice, not a tensor): per token;
* ``token_setitem``: zeroes the first tokens in place, ``y[:, :4] = 0`` (by their local index on a CP rank);
* ``head_repeat``: GQA's expansion of 2 groups of features to 4 heads, ``torch.repeat_interleave(g, 2, dim=2)``
  of ``[B, T, 2, H/2]``, summed in pairs of heads: per token;
* ``token_repeat``: the first half of the sequence with every token twice, ``y.repeat_interleave(2, 1)[:, :T]``
  (token ``i`` becomes token ``i // 2``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.models.attention import sdpa
from tests.models.tiny import TinyLM, seeded

MIXERS = (
    "conv", "shift", "first_diff", "next_diff", "mask_cumsum", "mean_pool", "last_token", "chunked_scan",
    "custom_per_token", "custom_scan", "norm_pool", "sort_tokens", "tril_tokens", "token_norm", "feature_setitem",
    "token_setitem", "head_repeat", "token_repeat", "squeezed_conv", "conv_cumsum", "merged_rows_cumsum",
)  # fmt: skip
KERNEL = 3
CHUNK = 4


@torch.library.custom_op("cpcompile_tests::softsign", mutates_args=())
def softsign(x: torch.Tensor) -> torch.Tensor:
    """``x / (1 + |x|)``, element-wise: every token's output from its own input."""
    return x / (1 + x.abs())


@softsign.register_fake
def _(x):
    return torch.empty_like(x)


def _softsign_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _softsign_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad / (1 + x.abs()) ** 2


softsign.register_autograd(_softsign_backward, setup_context=_softsign_setup)


@torch.library.custom_op("cpcompile_tests::prefix_sum", mutates_args=())
def prefix_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``cumsum(x, dim)``: a fused scan over the sequence that the mixing pass cannot see into."""
    return x.cumsum(dim)


@prefix_sum.register_fake
def _(x, dim):
    return torch.empty_like(x)


def _prefix_setup(ctx, inputs, output):
    ctx.dim = inputs[1]


def _prefix_backward(ctx, grad):
    return grad.flip(ctx.dim).cumsum(ctx.dim).flip(ctx.dim), None


prefix_sum.register_autograd(_prefix_backward, setup_context=_prefix_setup)


class Mixer(nn.Module):
    """The mixer ``form`` on the embeddings ``[B, T, hidden]`` (``max_positions``: rows of its position table)."""

    def __init__(self, form: str, hidden: int, max_positions: int) -> None:
        super().__init__()
        if form not in MIXERS:
            raise ValueError(f"unknown mixer {form!r}; known: {MIXERS}")
        self.form = form
        self.conv = nn.Conv1d(hidden, hidden, KERNEL, groups=hidden, padding=KERNEL - 1, bias=True)
        self.mix = nn.Linear(hidden, hidden, bias=False)
        self.pos = nn.Embedding(max_positions, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)

    def forward(self, x: torch.Tensor, batch: dict) -> torch.Tensor:
        B, T, H = x.shape
        input_ids = batch["input_ids"]
        if self.form == "conv":
            y = self.conv(self.mix(x).transpose(1, 2))[..., :T]
            return x + y.transpose(1, 2)
        if self.form == "conv_cumsum":  # a cumulative sum along the sequence after the conv
            return x + self.conv(self.mix(x).transpose(1, 2))[..., :T].cumsum(-1).transpose(1, 2)
        if self.form == "merged_rows_cumsum":  # one row per token, batch and sequence merged, through baddbmm
            weight = self.mix.weight.t().unsqueeze(0)
            rows = torch.baddbmm(self.conv.bias.view(1, 1, H), x.reshape(1, B * T, H), weight)
            return x + rows.reshape(B, T, H).cumsum(1)
        if self.form == "squeezed_conv":
            y = self.conv(self.mix(x).transpose(1, 2).reshape(B, H, 1, T).squeeze(2))[..., :T]
            return x + y.transpose(1, 2)
        if self.form == "shift":
            shifted = F.pad(x, (0, 0, 1, 0))[:, :-1]
            return x + self.mix(shifted)
        if self.form == "first_diff":
            return x + self.mix(torch.diff(x, dim=1, prepend=x[:, :1] - 1))
        if self.form == "next_diff":
            return x + self.mix(F.pad(torch.diff(x, dim=1), (0, 0, 0, 1)))
        if self.form == "mask_cumsum":
            return x + self.pos((input_ids > 0).long().cumsum(-1) - 1)
        if self.form == "mean_pool":
            return x + self.mix(x.mean(1, keepdim=True))
        if self.form == "last_token":
            return x + self.mix(x[:, -1:])
        if self.form == "custom_per_token":
            return x + torch.ops.cpcompile_tests.softsign(self.mix(x))
        if self.form == "custom_scan":
            return x + torch.ops.cpcompile_tests.prefix_sum(self.mix(x), 1)
        if self.form == "norm_pool":
            return x + self.mix(x.norm(2, 1, keepdim=True))
        if self.form == "sort_tokens":
            return x + self.mix(torch.msort(x.transpose(0, 1)).transpose(0, 1))
        if self.form == "tril_tokens":
            return x + self.mix(x.tril())
        if self.form in ("feature_setitem", "token_setitem"):
            y = self.mix(x)
            if self.form == "feature_setitem":
                y[:, :, :8] = 0.0
            else:
                y[:, :4] = 0.0
            return x + y
        if self.form == "head_repeat":
            g = self.mix(x).view(B, T, 2, H // 2)
            heads = torch.repeat_interleave(g, 2, dim=2)  # [B, T, 4, H/2]: heads 0, 1 of group 0, heads 2, 3 of 1
            return x + heads.reshape(B, T, 2, H).sum(2)
        if self.form == "token_repeat":
            return x + self.mix(x).repeat_interleave(2, 1)[:, :T]
        if self.form == "token_norm":
            outer = (x[..., :, None] * x[..., None, :]).tril()  # [B, T, H, H]: one matrix per token
            return x / x.norm(2, -1, keepdim=True) + torch.msort(x) + self.mix(outer.sum(-1))
        q, k, v = self.qkv(x).view(B, T // CHUNK, CHUNK, 3, H).unbind(3)  # chunked_scan
        causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=x.device).tril()  # a chunk's own causal mask
        within = (q @ k.transpose(-1, -2)).masked_fill(~causal, 0.0) @ v
        states = k.transpose(-1, -2) @ v  # [B, chunks, H, H]
        carried = states.cumsum(1) - states
        return x + (within + q @ carried).reshape(B, T, H)


def mixer_lm(
    *, seed: int = 0, mixer: str = "conv", vocab: int = 128, hidden: int = 32, max_positions: int = 512
) -> TinyLM:
    """A :class:`TinyLM` with ``mixer`` before one packed-document attention layer (modules ``mixer``,
    ``layers.0``), weights drawn from ``seed``, in train mode (``ParityCase`` factory); ``max_positions``: the rows
    of the ``mask_cumsum`` mixer's position table."""

    def build() -> TinyLM:
        return TinyLM([sdpa("packed_docs")], vocab=vocab, hidden=hidden, mixer=Mixer(mixer, hidden, max_positions))

    return seeded(build, seed=seed)
