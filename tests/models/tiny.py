"""The one tiny causal LM of the tests, built from the parts a test chooses.

:class:`TinyLM` is: token embedding, plus the term of its model-level :class:`Positions` -> an optional ``mixer``
module -> one pre-norm block per entry of ``attention`` (``x + attn(norm(x))``, then ``x + mlp(norm(x))``) ->
final norm -> LM head. It takes the keyword arguments of a transformers causal LM (``input_ids``,
``position_ids``, ``labels``, ``shift_labels``, ``num_items_in_batch``, ``use_cache``, and ``document_ids``) and
returns a transformers ``CausalLMOutput`` (:func:`lm_output`), so the parity harness (:mod:`tests.harness.parity`)
and :func:`cpcompile.shard` treat it like an HF model; with ``logits_only=True`` it returns the logits tensor.

Plug points:

* the attention of each block: an :class:`Attention` subclass, whose :meth:`Attention.attend` computes attention
  from the projected heads (:class:`SDPA`: ``F.scaled_dot_product_attention`` under the keyword arguments of a
  ``mask`` function; ``flex_attention`` in :mod:`tests.models.flex`), or ``None``: a block of the MLP alone;
* positions inside attention: a :class:`Rope`, which rotates ``q`` and ``k`` (RoPE forms:
  :mod:`tests.models.positions`);
* the K/V head spelling: an ``expand(x, n)`` function that turns K or V ``[B, T, Hkv, D]`` into
  ``[B, Hkv * n, T, D]`` (:func:`repeat_kv`, or the spellings of :mod:`tests.models.kv_heads`), or ``None``: K/V
  keep their heads and :class:`SDPA` passes ``enable_gqa=True``;
* positions at the model level: a :class:`Positions` (none by default; :class:`LearnedPositions`; the library forms
  of :mod:`tests.models.positions`), which adds a term to the token embeddings and may hand tables to every
  attention layer;
* a ``mixer``: a module (named ``mixer``) applied to the embeddings before the blocks (:mod:`tests.models.mixing`).

Rope, positions and masks are plain objects, not modules: what they read (tables, parameters) is registered on
the module that runs them, so the names cpcompile reports are the model's own: ``layers.<i>.attn`` for
attention, its RoPE and its K/V, the top level (``""``) for model-level positions. Every part receives ``batch``,
the dict of the model's per-token inputs (``input_ids``, ``position_ids`` and ``document_ids``, ``None`` when not
given) and ``tables`` (what the model-level positions hand to attention).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

IGNORE_INDEX = -100


def causal_lm_loss(logits, labels, shift_labels, num_items_in_batch):
    """transformers' causal-LM loss: cross entropy summed over supervised tokens / ``num_items_in_batch``."""
    if shift_labels is None:
        shift_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    total = F.cross_entropy(
        logits.flatten(0, 1).float(), shift_labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    n = (shift_labels != IGNORE_INDEX).sum() if num_items_in_batch is None else num_items_in_batch
    return total / n


def lm_output(logits, labels=None, shift_labels=None, num_items_in_batch=None):
    """A transformers ``CausalLMOutput``: the logits and, when labels are given, :func:`causal_lm_loss`."""
    from transformers.modeling_outputs import CausalLMOutput

    loss = None
    if labels is not None or shift_labels is not None:
        loss = causal_lm_loss(logits, labels, shift_labels, num_items_in_batch)
    return CausalLMOutput(loss=loss, logits=logits)


def seeded(build, *args, seed: int = 0, **kwargs) -> nn.Module:
    """``build(*args, **kwargs)`` with weights drawn from ``seed``, in train mode."""
    torch.manual_seed(seed)
    return build(*args, **kwargs).train()


def batch_positions(batch: dict) -> torch.Tensor:
    """The batch's ``position_ids``, or ``0..T-1`` in every row when the model was called without them."""
    if batch["position_ids"] is not None:
        return batch["position_ids"]
    ids = batch["input_ids"]
    return torch.arange(ids.shape[1], device=ids.device).expand_as(ids)


def doc_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document index per token: a new document wherever the position does not step by +1."""
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    return (step != 1).cumsum(-1)


def repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """K or V ``[B, T, Hkv, D]`` as ``[B, Hkv * n, T, D]``: each KV head repeated for its ``n`` query heads."""
    return x.transpose(1, 2).repeat_interleave(n, dim=1)


def causal(attn: SDPA, q: torch.Tensor, batch: dict) -> dict:
    """The SDPA mask of plain causal attention over the whole row: ``is_causal=True``."""
    return {"is_causal": True}


class Rope:
    """Positions inside attention: rotates ``q`` and ``k`` (``[B, T, heads, D]``) before the heads are transposed.

    :meth:`build` registers the tables the form reads on the attention module, so that cpcompile reports them as
    that layer's; the base class leaves ``q`` and ``k`` as they are.
    """

    def build(self, attn: Attention, max_len: int) -> None:
        pass

    def __call__(self, attn: Attention, q: torch.Tensor, k: torch.Tensor, batch: dict):
        return q, k


class Positions:
    """Positions at the model level: a term added to the token embeddings and tables handed to every attention.

    :meth:`build` registers what the scheme reads on the model; :meth:`term` and :meth:`tables` run in the model's
    own forward (the top level of the graph). The base class adds nothing: a model without positions there.
    """

    def build(self, model: TinyLM, *, hidden: int, head_dim: int, max_len: int) -> None:
        pass

    def term(self, model: TinyLM, batch: dict) -> torch.Tensor | None:
        return None

    def tables(self, model: TinyLM, T: int):
        return None


class LearnedPositions(Positions):
    """A learned table ``wpe`` of ``max_len`` rows, looked up at the ``position_ids`` the model is given."""

    def build(self, model, *, hidden, head_dim, max_len):
        model.wpe = nn.Embedding(max_len, hidden)

    def term(self, model, batch):
        return model.wpe(batch_positions(batch))


class Attention(nn.Module):
    """Grouped-query attention: ``q`` and fused ``kv`` projections, ``rope`` on ``q`` and ``k``, K/V expanded by
    ``expand`` (or kept at their heads), :meth:`attend`, output projection ``o``."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        max_len: int,
        *,
        rope: Rope | None = None,
        expand: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.rope, self.expand = rope, expand
        self.q = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.kv = nn.Linear(hidden, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(heads * self.head_dim, hidden, bias=False)
        if rope is not None:
            rope.build(self, max_len)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: dict):
        """``(out, extra)``: the attention output ``[B, heads, T, D]`` of ``q`` ``[B, heads, T, D]`` and K/V
        ``[B, heads or kv_heads, T, D]``, and ``None`` or a term ``[B, T, hidden]`` added after ``o``."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, batch: dict) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.heads, self.head_dim)
        k, v = self.kv(x).view(B, T, 2, self.kv_heads, self.head_dim).unbind(2)
        if self.rope is not None:
            q, k = self.rope(self, q, k, batch)
        q = q.transpose(1, 2)
        if self.expand is None:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        else:
            n = self.heads // self.kv_heads
            k, v = self.expand(k, n), self.expand(v, n)
        out, extra = self.attend(q, k, v, batch)
        y = self.o(out.transpose(1, 2).reshape(B, T, -1))
        return y if extra is None else y + extra


class SDPA(Attention):
    """``F.scaled_dot_product_attention`` with the keyword arguments ``mask(attn, q, batch)`` returns (the mask,
    ``is_causal``, dropout), plus ``enable_gqa=True`` when K/V keep their heads. A ``mask`` with a
    ``build(attn, max_len)`` method registers what it reads (buffers, state) on the attention module, as
    :meth:`Rope.build` does."""

    def __init__(self, hidden, heads, kv_heads, max_len, *, mask=causal, rope=None, expand=None) -> None:
        super().__init__(hidden, heads, kv_heads, max_len, rope=rope, expand=expand)
        self.mask = mask
        if hasattr(mask, "build"):
            mask.build(self, max_len)

    def attend(self, q, k, v, batch):
        kwargs = self.mask(self, q, batch)
        if self.expand is None:
            kwargs = {**kwargs, "enable_gqa": True}
        return F.scaled_dot_product_attention(q, k, v, **kwargs), None


#: Builds a block's attention: called with ``(hidden, heads, kv_heads, max_len)``, e.g. ``partial(SDPA, mask=...)``.
AttentionFactory = Callable[[int, int, int, int], Attention]


class Block(nn.Module):
    """Pre-norm block: ``x + attn(attn_norm(x))`` (without ``attn``: skipped), then ``x + mlp(mlp_norm(x))``."""

    def __init__(self, hidden: int, attn: Attention | None) -> None:
        super().__init__()
        if attn is not None:
            self.attn_norm = nn.LayerNorm(hidden)
        self.attn = attn
        self.mlp_norm = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))

    def forward(self, x: torch.Tensor, batch: dict) -> torch.Tensor:
        if self.attn is not None:
            x = x + self.attn(self.attn_norm(x), batch)
        return x + self.mlp(self.mlp_norm(x))


class TinyLM(nn.Module):
    """Embedding (+ model-level positions) -> ``mixer`` -> a block per entry of ``attention`` -> norm -> LM head.

    ``attention``: one factory per block (``None``: a block without attention); the blocks are ``layers.<i>``
    and their attention ``layers.<i>.attn``. ``max_len`` is the number of rows of the position tables.
    """

    def __init__(
        self,
        attention: Sequence[AttentionFactory | None],
        *,
        vocab: int = 128,
        hidden: int = 32,
        heads: int = 4,
        kv_heads: int = 2,
        max_len: int = 128,
        positions: Positions | None = None,
        mixer: nn.Module | None = None,
        logits_only: bool = False,
    ) -> None:
        super().__init__()
        self.positions = Positions() if positions is None else positions
        self.logits_only = logits_only
        self.embed = nn.Embedding(vocab, hidden)
        self.positions.build(self, hidden=hidden, head_dim=hidden // heads, max_len=max_len)
        self.mixer = mixer
        self.layers = nn.ModuleList(
            Block(hidden, None if make is None else make(hidden, heads, kv_heads, max_len)) for make in attention
        )
        self.norm = nn.LayerNorm(hidden)
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
        batch = {"input_ids": input_ids, "position_ids": position_ids, "document_ids": document_ids}
        x = self.embed(input_ids)
        term = self.positions.term(self, batch)
        if term is not None:
            x = x + term
        batch["tables"] = self.positions.tables(self, input_ids.shape[1])
        if self.mixer is not None:
            x = self.mixer(x, batch)
        for layer in self.layers:
            x = layer(x, batch)
        logits = self.head(self.norm(x))
        if self.logits_only:
            return logits
        return lm_output(logits, labels, shift_labels, num_items_in_batch)
