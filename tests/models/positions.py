"""Tiny causal LMs that compute their own positions, the ways non-transformers model code does.

The hand-written models are :class:`tests.models.tiny.TinyLM`: their RoPE forms are a :class:`Rope` of each
attention layer, their learned positions and litgpt's model-level tables a :class:`ModelPositions`. Except
:func:`explicit_positions`, they ignore ``position_ids``: like ``model(tokens)`` in torchtitan, litgpt or nanoGPT,
they derive the position of every token from the length of the sequence they are given. Attention is SDPA with
``is_causal=True`` (global causal order over the whole row, as those libraries' plain training call). Factories
(``factory(seed=0, **kwargs)``, models in train mode):

* :func:`titan_style`: complex RoPE table per attention layer sliced by length, ``cache[0:T]`` (torchtitan's
  ``ComplexRoPE``: ``view_as_complex``/``view_as_real``), ``enable_gqa=True``;
* :func:`lit_style`: model-level ``cos``/``sin`` buffers sliced by length, ``cos[:T]`` (litgpt's ``GPT``), K/V
  expanded with ``repeat_interleave``;
* :func:`arange_rope`: RoPE computed in the graph from ``arange(T)`` (``outer`` with the inverse frequencies);
* :func:`learned_positions`: learned absolute positions ``wpe(arange(0, T))`` (nanoGPT);
* :func:`explicit_positions`: the same RoPE table indexed with the ``position_ids`` it is given (needs no rewrite);
* :func:`library_style`: RoPE as model libraries outside transformers write it in their plain training call: an
  unused ``max_pos = t.max() + 1``, frequencies from an ellipsis einsum ``einsum("..., f -> ... f", t, inv_freq)``,
  the last ``T`` of ``T`` rows ``emb[:, -T:, :]``, and ``narrow(1, k - q, q)`` with ``k`` and ``q`` the same
  local length (no KV cache);
* :func:`all_forms`: one attention layer of each RoPE form (``ALL_FORMS_LAYERS``) and learned positions at the
  embedding: one compile covers every form (the inductor case);
* :func:`mixed_positions`: positions from ``ones_like(input_ids).cumsum(-1) - 1``, which mixes along the sequence
  before it meets the data: refused;
* :func:`llama_without_positions`: a transformers Llama called without ``position_ids``, which then computes
  them from ``cache_position = arange(past, past + T)`` in the graph;
* :func:`torchtitan_llama3` and :func:`litgpt_gpt`: the real packages' models (optional test dependencies,
  installed by ``scripts/setup.sh``), called as ``model(tokens)``.

:func:`position_only_lm` models have no blocks: a position term (:class:`OnlyPositions`, ``POSITION_ONLY_FORMS``
and the near misses ``POSITION_ONLY_REFUSED``) added to the token embeddings, then the LM head.
"""

from __future__ import annotations

import sys
import types
from functools import partial

import torch
import torch.nn as nn

from tests.models import tiny
from tests.models.tiny import lm_output

#: Forms of :func:`position_lm` that cpcompile makes exact (``all_forms`` combines them).
FORMS = ("titan_style", "lit_style", "arange_rope", "learned_positions", "explicit_positions", "library_style")
#: Attention form of each layer of the ``all_forms`` model (which adds learned positions at the embedding).
ALL_FORMS_LAYERS = ("titan_style", "lit_style", "arange_rope", "explicit_positions", "library_style")
#: Forms cpcompile refuses (each mixes positions, or uses the length, in its own way).
REFUSED_FORMS = (
    "mixed_positions",
    "arange_cumsum",
    "table_sum",
    "arange_matmul",
    "shifted_arange",
    "length_value",
    "linspace",
)


def _rope_inv_freq(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rope(tiny.Rope):
    """RoPE of ``form`` on ``q`` and ``k`` ``[B, T, H, D]`` (``learned_positions`` and the refused forms: none)."""

    def __init__(self, form: str) -> None:
        self.form = form

    def build(self, attn, max_len):
        if self.form in ("titan_style", "explicit_positions"):
            freqs = torch.outer(torch.arange(max_len).float(), _rope_inv_freq(attn.head_dim))
            attn.register_buffer("cache", torch.polar(torch.ones_like(freqs), freqs), persistent=False)
        if self.form in ("arange_rope", "library_style"):
            attn.register_buffer("inv_freq", _rope_inv_freq(attn.head_dim), persistent=False)

    @staticmethod
    def _complex_rope(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs_cis).flatten(3).type_as(x)

    def __call__(self, attn, q, k, batch):
        T = q.shape[1]
        if self.form == "titan_style":  # torchtitan: rope_cache[0:seqlen].view(1, seqlen, 1, D/2)
            freqs_cis = attn.cache[0:T].view(1, T, 1, -1)
            return self._complex_rope(q, freqs_cis), self._complex_rope(k, freqs_cis)
        if self.form == "explicit_positions":  # torchtitan's path with positions: cache[positions]
            freqs_cis = attn.cache[batch["position_ids"]].unsqueeze(2)
            return self._complex_rope(q, freqs_cis), self._complex_rope(k, freqs_cis)
        if self.form == "arange_rope":  # RoPE computed on the fly from arange(T)
            t = torch.arange(T, device=q.device).type_as(attn.inv_freq)
            freqs = torch.outer(t, attn.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]
        elif self.form == "library_style":
            t = torch.arange(T, device=q.device).type_as(attn.inv_freq)
            max_pos = t.max() + 1  # noqa: F841 - computed for an option that is off
            freqs = torch.einsum("..., f -> ... f", t, attn.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)[None]
            k_len, q_len = emb.shape[1], q.shape[1]  # one length: no KV cache
            cos, sin = emb.cos()[:, -q_len:, :], emb.sin().narrow(1, k_len - q_len, q_len)
            cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        elif self.form == "lit_style":  # litgpt: cos[:T], sin[:T] from the model, (1, T, D)
            cos, sin = batch["tables"]
            cos, sin = cos.view(1, T, 1, -1), sin.view(1, T, 1, -1)
        else:
            return q, k
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class ModelPositions(tiny.Positions):
    """The model-level positions of a :func:`position_lm` model: the absolute position embeddings of the learned
    and refused forms (``wpe``), and litgpt's ``cos``/``sin`` tables (``rope_tables``) sliced to ``[:T]``."""

    def __init__(self, form: str, rope_tables: bool) -> None:
        self.form, self.rope_tables = form, rope_tables

    def build(self, model, *, hidden, head_dim, max_len):
        if self.form in ("learned_positions", "all_forms", *REFUSED_FORMS):
            model.wpe = nn.Embedding(max_len, hidden)
        if self.rope_tables:
            freqs = torch.outer(torch.arange(max_len).float(), _rope_inv_freq(head_dim))
            emb = torch.cat((freqs, freqs), dim=-1)
            model.register_buffer("cos", emb.cos(), persistent=False)
            model.register_buffer("sin", emb.sin(), persistent=False)

    def tables(self, model, T):
        return (model.cos[:T].unsqueeze(0), model.sin[:T].unsqueeze(0)) if self.rope_tables else None

    def term(self, model, batch):
        """Absolute position embeddings ``[B or 1, T, hidden]`` of the learned / refused forms."""
        ids = batch["input_ids"]
        T = ids.shape[1]
        if self.form in ("learned_positions", "all_forms"):  # nanoGPT
            return model.wpe(torch.arange(0, T, dtype=torch.long, device=ids.device))
        if self.form == "mixed_positions":
            return model.wpe(torch.ones_like(ids).cumsum(-1) - 1)
        if self.form == "arange_cumsum":
            return model.wpe(torch.arange(T, device=ids.device).cumsum(0) % 64)
        if self.form == "table_sum":  # every position gets the sum over the local positions
            return model.wpe.weight[:T].sum(0, keepdim=True)
        if self.form == "arange_matmul":  # contracts the sequence dim of a position-derived value
            t = torch.arange(T, device=ids.device, dtype=torch.float32)
            return (t @ model.wpe.weight[:T])[None, None, :]
        if self.form == "shifted_arange":  # the positions of the next tokens
            return model.wpe(torch.arange(T + 1, device=ids.device)[1:])
        if self.form == "length_value":  # relative position i / T: the local length used as a value
            rel = torch.arange(T, device=ids.device).float() / T
            return rel[:, None] * model.wpe.weight[0]
        if self.form == "linspace":
            return torch.linspace(0, 1, T, device=ids.device)[:, None] * model.wpe.weight[0]
        return None


def position_lm(form: str, *, seed: int = 0, layers: int = 2, **sizes) -> tiny.TinyLM:
    """A :class:`tests.models.tiny.TinyLM` with positions as ``form`` says (see the module docstring), weights drawn
    from ``seed``, in train mode; the attention modules are ``layers.<i>.attn``. ``sizes``: TinyLM's ``vocab``,
    ``hidden``, ``heads``, ``kv_heads`` and ``max_len``, the rows of the position tables (RoPE caches, learned
    positions)."""
    if form not in (*FORMS, "all_forms", *REFUSED_FORMS):
        raise ValueError(f"unknown position form {form!r}; known: {(*FORMS, 'all_forms', *REFUSED_FORMS)}")
    layer_forms = ALL_FORMS_LAYERS if form == "all_forms" else (form,) * layers
    # litgpt expands K/V itself; the others attend with enable_gqa=True
    attention = [
        partial(tiny.SDPA, rope=Rope(f), expand=tiny.repeat_kv if f == "lit_style" else None) for f in layer_forms
    ]
    positions = ModelPositions(form, rope_tables="lit_style" in layer_forms)
    return tiny.seeded(tiny.TinyLM, attention, positions=positions, seed=seed, **sizes)


def titan_style(*, seed: int = 0, **kwargs) -> tiny.TinyLM:
    return position_lm("titan_style", seed=seed, **kwargs)


def lit_style(*, seed: int = 0, **kwargs) -> tiny.TinyLM:
    return position_lm("lit_style", seed=seed, **kwargs)


def arange_rope(*, seed: int = 0, **kwargs) -> tiny.TinyLM:
    return position_lm("arange_rope", seed=seed, **kwargs)


def learned_positions(*, seed: int = 0, **kwargs) -> tiny.TinyLM:
    return position_lm("learned_positions", seed=seed, **kwargs)


def explicit_positions(*, seed: int = 0, **kwargs) -> tiny.TinyLM:
    return position_lm("explicit_positions", seed=seed, **kwargs)


def library_style(*, seed: int = 0, **kwargs) -> tiny.TinyLM:
    return position_lm("library_style", seed=seed, **kwargs)


def all_forms(*, seed: int = 0, **kwargs) -> tiny.TinyLM:
    return position_lm("all_forms", seed=seed, **kwargs)


def mixed_positions(*, seed: int = 0, **kwargs) -> tiny.TinyLM:
    return position_lm("mixed_positions", seed=seed, **kwargs)


#: Position forms of :func:`position_only_lm` (each rewritten by cpcompile).
POSITION_ONLY_FORMS = (
    "arange",  # wpe(arange(T))
    "arange_offset",  # wpe(arange(3, 3 + T))
    "arange_step_float",  # arange(0, 2T, 2, dtype=float) * w
    "table_slice",  # wpe.weight[:T]
    "table_offset",  # wpe.weight[2:2 + T]
    "table_narrow",  # wpe.weight.narrow(0, 1, T)
    "table_columns",  # a [hidden, max_len] table sliced along dim 1, then transposed
    "table_none_index",  # wpe.weight[None, 0:T]
    "complex_table",  # a complex cache[0:T], view_as_real, flattened
    "interleaved_rope",  # outer(arange(T), inv_freq).repeat_interleave(2, dim=-1).cos() (GPT-J-style pairs)
    "full_slice",  # wpe(arange(T)[:T]): a slice that keeps every position
    "checkpointed",  # wpe.weight[:T] inside an activation-checkpointed function (a nested graph)
    "dead_max",  # wpe(t) with max_pos = t.max() + 1 computed and never used
    "dead_first_position",  # torch.max(position_ids[:, 0]) of an arange expanded to the batch, never used
    "dead_inplace",  # a dead value written in place into a tensor that is itself dead
    "tail_slice",  # outer(arange(T), inv_freq)[None][:, -T:, :]: the last T of T rows
    "difference_slice",  # wpe(arange(k))[k - q : k] with k and q the same local length
    "difference_narrow",  # outer(arange(k), inv_freq).narrow(0, k - q, q)
    "ellipsis_einsum",  # einsum("..., f -> ... f", arange(T), inv_freq)
    "length_branch_same",  # wpe(arange(T)), doubled when T > 8: the same decision for a rank's and the whole length
    "cache_filled",  # the code of cache_written (below) after a call on max_len tokens filled every row
)
#: Near misses of the forms above that still mix or select positions: refused.
POSITION_ONLY_REFUSED = (
    "live_max",  # t.max() + 1 added to every position
    "live_inplace",  # t.max() written in place into the position embedding that is returned
    "table_tail",  # wpe.weight[-T:]: the last T rows of a longer table (an offset)
    "partial_slice",  # outer(arange(T), inv_freq)[-(T - 1):]: a shift
    "ellipsis_contraction",  # einsum("...f -> f", outer(arange(T), inv_freq)): a sum over positions
    "cache_written",  # RoPE rows written into a buffer on a call that finds it short (cached[:T] = freqs), read
    "length_branch",  # wpe(arange(T)), doubled when T > 24: taken for the whole length, not for a rank's
    "repeated_positions",  # wpe(arange(T).repeat_interleave(2)[:T]): every position twice, the first half
)


class OnlyPositions(tiny.Positions):
    """The position term of a :func:`position_only_lm` model: ``form`` over the model's tables ``wpe``,
    ``columns``, ``cache`` (complex RoPE), ``inv_freq`` and ``cached`` (filled on a call, ``cached_rows`` rows)."""

    def __init__(self, form: str) -> None:
        self.form = form

    def build(self, model, *, hidden, head_dim, max_len):
        model.wpe = nn.Embedding(max_len, hidden)
        model.columns = nn.Parameter(torch.randn(hidden, max_len))
        freqs = torch.outer(torch.arange(max_len).float(), _rope_inv_freq(hidden))
        model.register_buffer("cache", torch.polar(torch.ones_like(freqs), freqs), persistent=False)
        model.register_buffer("inv_freq", _rope_inv_freq(hidden), persistent=False)
        model.register_buffer("cached", torch.zeros(max_len, hidden), persistent=False)
        model.cached_rows = 0

    def term(self, model, batch):
        ids = batch["input_ids"]
        T, dev, w = ids.shape[1], ids.device, model.wpe.weight
        if self.form == "arange":
            return model.wpe(torch.arange(T, device=dev))
        if self.form == "arange_offset":
            return model.wpe(torch.arange(3, 3 + T, device=dev))
        if self.form == "arange_step_float":
            return torch.arange(0, 2 * T, 2, device=dev, dtype=torch.float32)[:, None] * w[0] / 50
        if self.form == "table_slice":
            return w[:T]
        if self.form == "table_offset":
            return w[2 : 2 + T]
        if self.form == "table_narrow":
            return w.narrow(0, 1, T)
        if self.form == "table_columns":
            return model.columns[:, :T].t()
        if self.form == "table_none_index":
            return w[None, 0:T]
        if self.form == "interleaved_rope":
            t = torch.arange(T, device=dev).type_as(model.inv_freq)
            return torch.outer(t, model.inv_freq).repeat_interleave(2, dim=-1).cos()
        if self.form == "full_slice":
            return model.wpe(torch.arange(T, device=dev)[:T])
        if self.form == "checkpointed":
            from torch.utils.checkpoint import checkpoint

            return checkpoint(lambda i: w[: i.shape[1]] * 2.0, ids, use_reentrant=False)
        if self.form in ("complex_table",):
            return torch.view_as_real(model.cache[0:T]).flatten(1)
        return self._library_term(model, ids)

    def _library_term(self, model, ids: torch.Tensor) -> torch.Tensor:
        """The forms written the ways model libraries outside transformers write them."""
        B, T, dev = ids.shape[0], ids.shape[1], ids.device
        t = torch.arange(T, device=dev)
        if self.form == "dead_max":
            max_pos = t.max() + 1  # noqa: F841 - kept for an option that is off
            return model.wpe(t)
        if self.form == "dead_first_position":
            position_ids = t.unsqueeze(0).expand(B, T)
            first = torch.max(position_ids[:, 0])  # noqa: F841 - freed right after
            del first
            return model.wpe(position_ids)
        if self.form == "dead_inplace":
            scratch = t.float() * 2
            scratch.add_(t.max())
            return model.wpe(t)
        freqs = torch.outer(t.type_as(model.inv_freq), model.inv_freq)  # [T, hidden / 2]
        if self.form == "tail_slice":
            return torch.cat((freqs, freqs), -1)[None][:, -T:, :].cos()
        if self.form == "difference_slice":
            k_len, q_len = T, ids.size(1)
            return model.wpe(t)[k_len - q_len : k_len]
        if self.form == "difference_narrow":
            k, q = T, ids.size(1)
            return torch.cat((freqs, freqs), -1).narrow(0, k - q, q).sin()
        if self.form == "ellipsis_einsum":
            f = torch.einsum("..., f -> ... f", t.type_as(model.inv_freq), model.inv_freq)
            return torch.cat((f, f), -1).cos()
        if self.form == "live_max":
            return model.wpe(t) + (t.max() + 1)
        if self.form == "live_inplace":
            pe = model.wpe(t)
            pe.add_(t.max())
            return pe
        if self.form == "table_tail":
            return model.wpe.weight[-T:]
        if self.form == "partial_slice":
            e = torch.cat((freqs, freqs), -1)
            return torch.cat((e[-(T - 1) :], e[:1]), 0).cos()  # a roll of the positions
        if self.form in ("cache_written", "cache_filled"):  # filled on the call that finds it short, then read
            if model.cached_rows < T:
                model.cached[:T] = torch.cat((freqs, freqs), -1).cos()
                model.cached_rows = T
            return model.cached[:T]
        if self.form == "repeated_positions":
            return model.wpe(t.repeat_interleave(2)[:T])
        if self.form in ("length_branch", "length_branch_same"):
            pe = model.wpe(t)
            if T > (24 if self.form == "length_branch" else 8):
                pe = pe * 2
            return pe
        if self.form == "ellipsis_contraction":
            return torch.einsum("...f -> f", freqs).repeat(2)[None, :].expand(T, -1) / 64
        raise AssertionError(self.form)


def position_only_lm(form: str, *, seed: int = 0, vocab: int = 64, hidden: int = 16, max_len: int = 80):
    """A :class:`tests.models.tiny.TinyLM` without blocks: token embedding + the position term of ``form`` -> norm
    -> LM head, returning the logits. Without attention the local rows of a rank must equal the whole model's
    rows of that rank's tokens, which one process can check for any rank."""
    if form not in (*POSITION_ONLY_FORMS, *POSITION_ONLY_REFUSED):
        raise ValueError(f"unknown form {form!r}; known: {(*POSITION_ONLY_FORMS, *POSITION_ONLY_REFUSED)}")
    positions = OnlyPositions(form)
    model = tiny.seeded(
        tiny.TinyLM, [], vocab=vocab, hidden=hidden, max_len=max_len, positions=positions, logits_only=True, seed=seed
    )
    if form == "cache_filled":  # one eager call on the longest sequence fills every row of the cache
        with torch.no_grad():
            model(torch.zeros(1, max_len, dtype=torch.long))
    return model


def length_branch(*, seed: int = 0, **kwargs) -> tiny.TinyLM:
    """:func:`position_only_lm` ``"length_branch"``: doubles its position embeddings when ``T > 24``."""
    return position_only_lm("length_branch", seed=seed, **kwargs)


class WithoutPositions(nn.Module):
    """A transformers causal LM called without ``position_ids`` (it derives them from the sequence length)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.layers = model.model.layers

    def forward(self, input_ids, position_ids=None, **kwargs):
        return self.model(input_ids=input_ids, **kwargs)


def llama_without_positions(*, seed: int = 0) -> WithoutPositions:
    from cpcompile.testing import tiny_model

    return WithoutPositions(tiny_model("llama", seed=seed))


# -- the real packages -------------------------------------------------------------------------------------
class TokensLM(nn.Module):
    """A model called as ``model(tokens) -> logits`` (torchtitan, litgpt) behind a transformers causal LM's
    keyword arguments; ``position_ids`` are ignored, as in those libraries' plain training call."""

    def __init__(self, model: nn.Module, layers: int) -> None:
        super().__init__()
        self.model = model
        self.num_layers = layers

    @property
    def layers(self) -> list:
        return [None] * self.num_layers  # the attention layer count tests.harness.parity expects rewritten

    def forward(
        self, input_ids, position_ids=None, labels=None, shift_labels=None, num_items_in_batch=None, use_cache=None
    ):
        logits = self.model(input_ids)
        return lm_output(logits, labels, shift_labels, num_items_in_batch)


def _stub_triton_only_modules() -> None:
    """torchtitan 0.3.0's ``models.common`` imports ``distributed.minimal_async_ep``, whose kernels import triton
    at module level; Llama 3 never uses it, so an empty module stands in for it where triton is missing."""
    name = "torchtitan.distributed.minimal_async_ep"
    try:
        import triton  # noqa: F401
    except ImportError:
        if name not in sys.modules:
            stub = types.ModuleType(name)
            for attr in ("combine_op", "dispatch_op", "init_buffer", "maybe_update_minimal_async_ep_config"):
                setattr(stub, attr, None)
            stub.MinimalAsyncEPDispatchMetadata = None
            sys.modules[name] = stub


def torchtitan_llama3(*, seed: int = 0, max_len: int = 128) -> TokensLM:
    """torchtitan's ``Llama3Model`` (2 layers, dim 64, 4 heads, 2 KV heads, complex RoPE with llama scaling)
    with its ``ScaledDotProductAttention`` inner attention (``is_causal=True, enable_gqa=True``)."""
    return TokensLM(torchtitan_llama3_model(seed=seed, layers=2, max_len=max_len, flex=False), layers=2).train()


def torchtitan_llama3_model(*, seed: int, layers: int, max_len: int, flex: bool, varlen: bool = False) -> nn.Module:
    """torchtitan's ``Llama3Model`` (dim 64, 4 heads, 2 KV heads, complex RoPE with llama scaling, ``layers``
    layers), weights drawn from ``seed``, on its ``FlexAttention`` inner attention (``flex``: its default), its
    ``VarlenAttention`` (``varlen``) or its ``ScaledDotProductAttention``."""
    _stub_triton_only_modules()
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention

    dim, heads, vocab = 64, 4, 128
    # torchtitan 0.3.0 maps every attn_backend name of its language models to flex/varlen attention; its SDPA
    # inner attention is built directly, as torchtitan's own Flux model does.
    original = llama3.get_attention_config
    if not flex and not varlen:
        llama3.get_attention_config = lambda backend: ScaledDotProductAttention.Config()
    try:
        built = llama3._build_llama3_layers(
            n_layers=layers,
            dim=dim,
            n_heads=heads,
            n_kv_heads=2,
            hidden_dim=128,
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=max_len, theta=500000, scaling="llama"),
            attn_backend="varlen" if varlen else "flex" if flex else "sdpa",
        )
    finally:
        llama3.get_attention_config = original
    config = llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
        layers=built,
    )
    torch.manual_seed(seed)
    return config.build()


def torchtitan_qwen3_moe_model(*, seed: int, layers: int, max_len: int) -> nn.Module:
    """torchtitan's ``Qwen3Model`` with MoE layers (dim 64, 4 heads, 2 KV heads, head dim 16, 4 experts, top 2,
    its load-balancing ``tokens_per_expert_E`` counts), ``layers`` layers, weights drawn from ``seed``, on its
    default ``FlexAttention``. Its MoE dispatch sorts the tokens by expert, multiplies them with
    ``torch._grouped_mm`` and combines them with ``torchtitan::deterministic_scatter_add``."""
    _stub_triton_only_modules()
    import torchtitan.models.qwen3 as qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    dim, vocab = 64, 128
    built = qwen3._build_qwen3_moe_layers(
        fuse_qkv=True,
        n_layers=layers,
        dim=dim,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        moe_hidden_dim=32,
        num_experts=4,
        top_k=2,
        attn_backend="flex",
        rope=CosSinRoPE.Config(dim=16, max_seq_len=max_len, theta=1e6),
        moe_comm_backend="standard",
    )
    config = qwen3.Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=qwen3._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=qwen3._LINEAR_INIT),
        layers=built,
    )
    torch.manual_seed(seed)
    model = config.build()
    model.init_states()  # its experts are made with torch.empty; torchtitan's trainer initialises them so
    return model


def litgpt_gpt(*, seed: int = 0, max_len: int = 128) -> TokensLM:
    """litgpt's ``GPT`` (2 layers, n_embd 64, 4 heads, 2 query groups, RMSNorm, LLaMA MLP, full RoPE)."""
    from litgpt import GPT, Config

    config = Config(
        n_layer=2,
        n_head=4,
        n_query_groups=2,
        n_embd=64,
        block_size=max_len,
        vocab_size=128,
        padded_vocab_size=128,
        bias=False,
        rotary_percentage=1.0,
        parallel_residual=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        intermediate_size=128,
    )
    torch.manual_seed(seed)
    return TokensLM(GPT(config), layers=2).train()


def package_missing(name: str) -> str | None:
    """Why the optional package ``name`` cannot be imported here (``None`` when it can)."""
    import importlib.util

    if importlib.util.find_spec(name) is None:
        return f"{name} is not installed (scripts/setup.sh installs it with pip install --no-deps, see constraints.txt)"
    return None


__all__ = [
    "FORMS",
    "REFUSED_FORMS",
    "ALL_FORMS_LAYERS",
    "POSITION_ONLY_FORMS",
    "POSITION_ONLY_REFUSED",
    "ModelPositions",
    "OnlyPositions",
    "Rope",
    "TokensLM",
    "all_forms",
    "arange_rope",
    "explicit_positions",
    "learned_positions",
    "library_style",
    "lit_style",
    "llama_without_positions",
    "litgpt_gpt",
    "mixed_positions",
    "package_missing",
    "position_lm",
    "position_only_lm",
    "titan_style",
    "torchtitan_llama3",
    "torchtitan_llama3_model",
]
