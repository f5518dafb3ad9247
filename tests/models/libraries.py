"""Tiny models that reproduce how model libraries outside transformers write a loss, positions and masks, for the
tests of what the mixing pass accepts and refuses (``tests/test_library_patterns.py`` and its parity tests).

:func:`nanogpt_lm`: nanoGPT's ``GPT`` as its ``train.py`` calls it, ``logits, loss = model(X, Y)``, with ``Y`` the
targets shifted by the data loader and ``-1`` where a token has none. Its ``forward(idx, targets)`` looks up
learned positions at ``arange(t)``, runs causal SDPA blocks and computes ``F.cross_entropy(logits.view(-1, V),
targets.view(-1), ignore_index=-1)``, a mean over the supervised tokens. Forms (``LOSS_FORMS``):

* ``mean``: the mean is the loss the model returns (nanoGPT);
* ``mean_scaled``: the mean divided by the gradient accumulation steps, plus a z-loss summed over the supervised
  tokens and scaled by a constant (``loss / accum + z``): still a loss summed over ranks;
* ``mean_in_forward``: a mean cross-entropy of an early head scales the hidden states (a mean over this rank's
  tokens used inside the forward): refused;
* ``weighted``: the mean with class weights (``weight=``): its denominator sums the weights of the targets, refused.

The adapter :class:`NanoGPTAdapter` takes the keyword arguments the parity harness passes
(``input_ids``, ``targets``) and returns ``.logits``/``.loss``; it calls the model as ``model(X, Y)``.

:func:`rope_lm`: a :class:`~tests.models.tiny.TinyLM` whose attention rotates ``q`` and ``k`` by positions the
model is given (``model(x, pos=...)``: here ``position_ids``), in a library's spelling (``ROPE_FORMS``):

* ``xtransformers``: x-transformers' ``RotaryEmbedding.forward(t)``: ``max_pos = t.max() + 1`` (never used without
  xpos), ``einsum('b i , j -> b i j', t, inv_freq)``; ``apply_rotary_pos_emb`` takes the last ``T`` rows,
  ``freqs[:, -seq_len:, :]`` (all of them; ``seq_len`` from ``q``, of another input than the positions);
* ``xtransformers_xpos``: the same with xpos: ``max_pos`` sets every token's scale (``(t - max_pos // 2) /
  scale_base``), so the maximum over this rank's positions reaches a token's output: refused;
* ``fms``: IBM fms's ``RotaryEmbedding.adjusted_qk``: ``max_start_pos = torch.max(position_ids[:, 0])`` sizes the
  RoPE cache (``compute_freqs_cis(device, max_start_pos + seq_len)``, which for plain RoPE reads only a cache made
  at construction), then the cache is looked up at ``position_ids`` and narrowed to the query's rows,
  ``freqs.narrow(1, freqs.size(1) - q.size(1), q.size(1))`` (all of them: the sizes of two inputs of one length);
* ``rotary_torch``: rotary-embedding-torch's ``RotaryEmbedding.forward(t)`` with positions passed:
  ``einsum('..., f -> ... f', t, freqs)`` (an outer product), ``einops.repeat(freqs, '... n -> ... (n r)', r=2)``.

The real packages (optional test dependencies): :func:`rotary_torch_lm` (rotary-embedding-torch's
``RotaryEmbedding`` over passed positions) and :func:`fms_lm` (IBM fms's ``LLaMA``).

The attention masks of libraries that broadcast one mask to every head are forms of
:mod:`tests.models.attention` (``head_expand_causal``, ``head_repeat``, ``head_einops``, ``head_none_expand``).
"""

from __future__ import annotations

import einops
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.models.attention import sdpa
from tests.models.tiny import Rope, TinyLM, lm_output, seeded

LOSS_FORMS = ("mean", "mean_scaled", "mean_in_forward", "weighted")
ROPE_FORMS = ("xtransformers", "xtransformers_xpos", "fms", "rotary_torch")
#: nanoGPT's ignore index for targets without a next token.
NANOGPT_IGNORE = -1
#: Gradient accumulation steps of the ``mean_scaled`` form.
ACCUM = 4


class _Block(nn.Module):
    """nanoGPT's block: pre-norm causal self-attention (``is_causal=True``) and an MLP."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's ``GPT``: ``forward(idx, targets=None) -> (logits, loss)``, the loss a mean cross-entropy."""

    def __init__(self, form: str = "mean", *, vocab: int = 128, hidden: int = 32, heads: int = 4, block: int = 128):
        super().__init__()
        if form not in LOSS_FORMS:
            raise ValueError(f"unknown loss form {form!r}; known: {LOSS_FORMS}")
        self.form = form
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(block, hidden)
        self.h = nn.ModuleList([_Block(hidden, heads), _Block(hidden, heads)])
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.register_buffer("class_weight", torch.linspace(0.5, 1.5, vocab))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for i, block in enumerate(self.h):
            x = block(x)
            if i == 0 and self.form == "mean_in_forward":  # an early-exit loss that scales the hidden states
                early = self.lm_head(self.ln_f(x))
                x = x * F.cross_entropy(early.view(-1, early.size(-1)), targets.view(-1), ignore_index=-1)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        flat, goal = logits.view(-1, logits.size(-1)), targets.view(-1)
        if self.form == "weighted":
            return logits, F.cross_entropy(flat, goal, weight=self.class_weight, ignore_index=-1)
        loss = F.cross_entropy(flat, goal, ignore_index=-1)
        if self.form == "mean_scaled":
            loss = loss / ACCUM + 1e-3 * _summed_z_loss(logits, targets)
        return logits, loss


def _summed_z_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A z-loss summed over the supervised tokens, scaled by a constant: a partial sum over ranks."""
    z = logits.float().logsumexp(-1) ** 2
    return (z * (targets != NANOGPT_IGNORE)).sum() / 64.0


class NanoGPTAdapter(nn.Module):
    """:class:`NanoGPT` for the parity harness: ``forward(input_ids, targets)`` calls ``model(X, Y)`` and returns a
    transformers ``CausalLMOutput`` (``.logits``, ``.loss``)."""

    def __init__(self, form: str = "mean") -> None:
        super().__init__()
        self.gpt = NanoGPT(form)

    def forward(self, input_ids, targets=None, **_):
        logits, loss = self.gpt(input_ids, targets)
        out = lm_output(logits)
        out.loss = loss
        return out


def nanogpt_lm(*, seed: int = 0, form: str = "mean") -> NanoGPTAdapter:
    """:class:`NanoGPTAdapter` of loss ``form``, weights drawn from ``seed``, in train mode (``ParityCase`` factory)."""
    return seeded(NanoGPTAdapter, form, seed=seed)


def nanogpt_targets(batch: dict) -> dict:
    """The batch entry nanoGPT's data loader gives: ``targets``, the next token of every token (``-1`` where the
    label is ``-100`` and after the last token), the ``Y`` of ``model(X, Y)`` (``ParityCase.batch_extras``)."""
    labels = batch["labels"]
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    return {"targets": shifted.masked_fill(shifted == -100, NANOGPT_IGNORE)}


# -- positions passed to the model ------------------------------------------------------------------------------
class LibraryRope(Rope):
    """RoPE over the positions the model is given (``position_ids``), in the spelling of a library."""

    def __init__(self, form: str) -> None:
        if form not in ROPE_FORMS:
            raise ValueError(f"unknown rope form {form!r}; known: {ROPE_FORMS}")
        self.form = form

    def build(self, attn, max_len: int) -> None:
        half = attn.head_dim // 2
        attn.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, half).float() / half)), persistent=False)
        attn.register_buffer("xpos_scale", (torch.arange(0, half).float() + 0.4 * half) / (1.4 * half))
        # fms: the cache compute_freqs_cis fills for max_expected_seq_len rows at construction
        angles = torch.outer(torch.arange(max_len).float(), attn.inv_freq)
        attn.register_buffer("cached_freqs", torch.stack((angles.cos(), angles.sin()), -1), persistent=False)

    def __call__(self, attn, q, k, batch):
        t = batch["position_ids"]  # [B, T]: the pos= the model is called with
        if self.form == "fms":
            return self._fms(attn, q, k, t)
        scale = 1.0
        if self.form in ("xtransformers", "xtransformers_xpos"):
            max_pos = t.max() + 1
            freqs = torch.einsum("b i , j -> b i j", t.type_as(attn.inv_freq), attn.inv_freq)
            if self.form == "xtransformers_xpos":
                power = (t - (max_pos // 2)) / 512
                scale = attn.xpos_scale ** power[..., None]  # [B, T, D/2]
                scale = scale[:, :, None]
        else:  # rotary_torch
            freqs = torch.einsum("..., f -> ... f", t.type(attn.inv_freq.dtype), attn.inv_freq)
        if self.form != "rotary_torch":  # x-transformers' apply_rotary_pos_emb: the last T rows (all of them)
            seq_len = q.shape[1]
            freqs = freqs[:, -seq_len:, :]
        freqs = freqs[:, :, None]  # [B, T, 1, D/2]: every head
        cos, sin = freqs.cos() * scale, freqs.sin() * scale
        if self.form == "rotary_torch":
            cos = einops.repeat(cos, "... n -> ... (n r)", r=2)[..., ::2]
            sin = einops.repeat(sin, "... n -> ... (n r)", r=2)[..., ::2]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def _fms(self, attn, q, k, position_ids):
        seq_len = max(k.size(1), q.size(1))
        max_start_pos = torch.max(position_ids[:, 0])  # the max first position of each sequence
        _compute_freqs_cis(attn, max_start_pos + seq_len)
        freqs = attn.cached_freqs[position_ids]  # [B, T, D/2, 2]
        q_start = freqs.size(1) - q.size(1)  # 0: the cache rows of this call's tokens (no KV cache)
        freqs = freqs.narrow(1, q_start, q.size(1))[:, :, None]  # [B, T, 1, D/2, 2]
        return _rotate(q, freqs[..., 0], freqs[..., 1]), _rotate(k, freqs[..., 0], freqs[..., 1])


def _compute_freqs_cis(attn, max_seq_len) -> int:
    """fms's plain RoPE: ``get_alpha(max_seq_len)`` is 1 whatever the length, and the cache exists already."""
    return 1


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, -1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).type_as(x)


def rope_lm(*, seed: int = 0, form: str = "xtransformers", layers: int = 2) -> TinyLM:
    """A :class:`TinyLM` of ``layers`` packed-document SDPA layers with :class:`LibraryRope` ``form``, weights drawn
    from ``seed``, in train mode (``ParityCase`` factory)."""
    from functools import partial

    from tests.models.tiny import SDPA

    make = partial(SDPA, mask=sdpa("packed_docs").keywords["mask"], rope=LibraryRope(form), expand=None)
    return seeded(TinyLM, [make] * layers, seed=seed)


# -- the real packages (optional test dependencies, installed by scripts/setup.sh) -------------------------------
class RotaryTorchRope(Rope):
    """rotary-embedding-torch's ``RotaryEmbedding`` called with the positions the model is given, as its README
    shows: ``freqs = rotary_emb(positions)``, then ``apply_rotary_emb(freqs, q)`` (module
    ``layers.<i>.attn.rotary``)."""

    def build(self, attn, max_len: int) -> None:
        from rotary_embedding_torch import RotaryEmbedding

        attn.rotary = RotaryEmbedding(dim=attn.head_dim)

    def __call__(self, attn, q, k, batch):
        from rotary_embedding_torch import apply_rotary_emb

        freqs = attn.rotary(batch["position_ids"])[:, :, None]  # [B, T, 1, D]: every head
        return apply_rotary_emb(freqs, q), apply_rotary_emb(freqs, k)


def rotary_torch_lm(*, seed: int = 0, layers: int = 2) -> TinyLM:
    """A :class:`TinyLM` of ``layers`` packed-document SDPA layers whose RoPE is rotary-embedding-torch's
    (:class:`RotaryTorchRope`), weights drawn from ``seed``, in train mode (``ParityCase`` factory)."""
    from functools import partial

    from tests.models.tiny import SDPA

    make = partial(SDPA, mask=sdpa("packed_docs").keywords["mask"], rope=RotaryTorchRope(), expand=None)
    return seeded(TinyLM, [make] * layers, seed=seed)


class FmsLLaMA(nn.Module):
    """IBM fms's ``LLaMA`` called as ``model(x, position_ids=...)`` (its RoPE sizes its cache from
    ``torch.max(position_ids[:, 0])``), with transformers' causal-LM loss on its logits for the parity harness."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        from fms.models.llama import LLaMA, LLaMAConfig

        config = LLaMAConfig(
            src_vocab_size=128, emb_dim=32, nheads=4, kvheads=2, nlayers=layers, max_expected_seq_len=128
        )
        self.model = LLaMA(config)
        self.model.reset_parameters()

    def forward(self, input_ids, position_ids=None, labels=None, shift_labels=None, num_items_in_batch=None, **_):
        logits = self.model(input_ids, position_ids=position_ids)
        return lm_output(logits, labels, shift_labels, num_items_in_batch)


def fms_lm(*, seed: int = 0, layers: int = 2) -> FmsLLaMA:
    """:class:`FmsLLaMA`, weights drawn from ``seed``, in train mode (``ParityCase`` factory)."""
    return seeded(FmsLLaMA, layers, seed=seed)
