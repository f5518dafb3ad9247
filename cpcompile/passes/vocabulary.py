"""Which graph ops keep the tokens of a sequence apart and which mix them: the op tables of every pass.

Names are those :func:`op_name` gives a Dynamo graph node: a ``call_method`` target (``"view"``), a function's
``__name__`` (``"conv1d"``), an ``OpOverload``'s operator name, ``"getitem"``, or ``"ns::name"`` for a custom op
(:data:`PER_TOKEN_OPS`). Each table says how an op treats the sequence dim of a tensor it reads:

* :data:`ELEMENTWISE`, :data:`LAYOUT`, :data:`RESHAPE`, :data:`SPLITS`: every output element comes from the
  elements at the same token (broadcasting, casts, dim moves, reshapes that keep each token's elements
  together; a reshape that splits the sequence dim keeps every piece a sequence dim);
* :data:`FEATURE_REDUCTIONS`: reduce over the trailing (feature) dims only (norms);
* :data:`DIM_REDUCTIONS`: reduce, scan, sort or shift along the dims of their ``dim`` argument: mixing when that
  is a sequence dim (``"scan"`` kinds run forward: a causal prefix);
* :data:`CONTRACTIONS`: matrix products, mixing when they contract a sequence dim;
* :data:`CONVOLUTIONS`: mixing when a sequence dim is a spatial dim;
* :data:`INDEX_MASKS`: ``tril``/``triu``, which read an element's (local) index: mixing when a sequence dim is one of
  the last two;
* :data:`LOSSES`: cross entropy and its kin over tokens (see :mod:`cpcompile.passes.mixing` for when a loss is a
  partial sum);
* :data:`DISPATCH`: the ops transformers' MoE dispatch runs over ``tokens x top_k`` expert ids (sort, histogram):
  token bookkeeping when their input is expert ids (see the mixing pass);
* :data:`ROW_MOVES`: ops that move whole rows by an index tensor (:data:`ROW_WRITES`: those that write a
  source's rows into ``self``, whose own elements stay put), and :data:`ROW_MOVE_OPS`: custom ops that are one of
  them under another name (torchtitan's MoE combine), read through :func:`row_move_args`;
* :data:`PER_TOKEN_OPS`: custom ops the pass cannot see into that are known to compute every token's output from
  that token's inputs (extended with the backend's ``per_token_ops`` option); :data:`ATTENTION_OPS`: custom ops
  that are attention, refused with the model's SDPA or flex path as the fix.

The positions pass (:mod:`cpcompile.passes.positions`) follows values computed from positions instead of
sharded data. It reads these tables, some as they are (:data:`SPLITS`), some through a table of its own defined
here from a shared one with the differences and why: :data:`POSITION_ELEMENTWISE`, :data:`POSITION_LAYOUT`,
:data:`POSITION_RESHAPE`, :data:`POSITION_NO_VALUES`, :data:`POSITION_REDUCTIONS` and
:data:`POSITION_CONTRACTIONS`; and the tables only it needs: :data:`FACTORIES`, :data:`SIZE_ARGS`,
:data:`FILL_ARGS`, :data:`SHAPE_ONLY_ARGS`, :data:`CONCATS` and :data:`FRESH_OPS`.

The mask prover (:mod:`cpcompile.passes.mask_rules`) reads the ops that hand a mask's or a position's values on
through tables defined here the same way: :data:`MASK_LAYOUT` and :data:`MASK_RESHAPE`.

PyTorch's DTensor sharding rules were considered as this vocabulary: they are registered for ATen ops, while the
pass reads Dynamo graphs of ``torch`` functions and ``Tensor`` methods before AOTAutograd, where a ``Shard(seq)``
strategy cannot be looked up by name; these tables follow the same split (ops that propagate a shard of a dim,
ops that need it replicated).

Why one module of about 430 lines: it is the one copy of the op vocabulary; every pass reads these tables, and
a table defined from another says next to it what differs and why, which a split would put in two places.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from cpcompile import _compat
from cpcompile.passes import aliasing

__all__ = [
    "ATTENTION_OPS",
    "BLOCK_MASK_MAKERS",
    "CONCATS",
    "CONTRACTIONS",
    "CONVOLUTIONS",
    "DIM_REDUCTIONS",
    "DISPATCH",
    "ELEMENTWISE",
    "FACTORIES",
    "FEATURE_REDUCTIONS",
    "INDEX_MASKS",
    "FILL_ARGS",
    "FRESH_OPS",
    "GROUPED_MATMULS",
    "LAYOUT",
    "LOSSES",
    "MASKS_BUILT_OUTSIDE",
    "MASK_LAYOUT",
    "MASK_RESHAPE",
    "NO_VALUES",
    "PER_TOKEN_OPS",
    "POSITION_CONTRACTIONS",
    "POSITION_ELEMENTWISE",
    "POSITION_LAYOUT",
    "POSITION_NO_VALUES",
    "POSITION_REDUCTIONS",
    "POSITION_RESHAPE",
    "RESHAPE",
    "ROW_MOVES",
    "ROW_MOVE_OPS",
    "ROW_WRITES",
    "SHAPE_ONLY_ARGS",
    "SIZE_ARGS",
    "SPLITS",
    "attention_op_fix",
    "einsum_subscripts",
    "masks_built_outside_fix",
    "op_name",
    "row_move_args",
]

#: Element-wise ops (broadcasting): output element ``i`` from input elements at ``i`` (no op here reads an
#: element's index: ``tril``/``triu`` do, :data:`INDEX_MASKS`).
ELEMENTWISE = frozenset({
    "add", "sub", "rsub", "mul", "truediv", "div", "floordiv", "floor_divide", "mod", "remainder", "fmod", "pow",
    "float_power", "neg", "pos", "abs", "absolute", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sin",
    "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "tanh", "sigmoid", "sqrt", "rsqrt",
    "reciprocal", "square", "floor", "ceil", "round", "trunc", "frac", "sign", "sgn", "clamp", "clip",
    "clamp_min", "clamp_max", "maximum", "minimum", "fmax", "fmin", "where", "masked_fill", "lerp", "addcmul",
    "addcdiv", "hypot", "copysign", "logaddexp", "eq", "ne", "lt", "le", "gt", "ge", "logical_and",
    "logical_or", "logical_not", "logical_xor", "and_", "or_", "xor", "invert", "bitwise_and", "bitwise_or",
    "bitwise_xor", "bitwise_not", "lshift", "rshift", "polar", "complex", "real", "imag", "angle", "conj",
    "conj_physical", "resolve_conj", "silu", "gelu", "relu", "relu6", "leaky_relu", "elu", "selu", "celu", "mish",
    "hardswish", "hardsigmoid", "hardtanh", "softplus", "softsign", "logsigmoid", "tanhshrink", "erf", "erfc",
    "erfinv", "nan_to_num", "isnan", "isinf", "isfinite", "deg2rad", "rad2deg", "dropout", "alpha_dropout",
    "feature_alpha_dropout", "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior",
    "ixor", "not_", "truth", "type_as", "masked_fill_", "add_", "mul_", "sub_", "div_", "clamp_", "copy_",
    "fill_", "zero_", "bernoulli", "_set_grad_enabled", "requires_grad_",
})  # fmt: skip

#: Ops that only move dims, copy or cast: each token's elements stay its own. ``repeat``, ``tile`` and
#: ``repeat_interleave`` copy elements along the dims they repeat: they keep the tokens apart along the other dims
#: only (GQA's ``k.repeat_interleave(n, dim=1)`` of ``[B, H, T, D]`` K/V heads), and the passes check those dims
#: (``repeat_interleave(input, repeats, dim=None)`` without a dim flattens its input).
LAYOUT = frozenset({
    "transpose", "permute", "movedim", "moveaxis", "swapaxes", "swapdims", "t", "unsqueeze", "squeeze", "expand",
    "broadcast_to", "expand_as", "contiguous", "clone", "detach", "to", "type", "float", "double", "half",
    "bfloat16", "int", "long", "short", "bool", "char", "byte", "cpu", "cuda", "repeat", "tile",
    "repeat_interleave", "_assert_tensor_metadata",
})  # fmt: skip

#: ``vmap``'s batch dims as Dynamo traces them (torch's own scans vmap their combine function): a dim hidden from
#: the ops inside (``_add_batch_dim``) and put back after them (``_remove_batch_dim``). Every slice along it runs
#: the same ops on its own, so they keep values apart along every dim.
VMAP_DIMS = frozenset({"_add_batch_dim", "_remove_batch_dim"})

#: Reshapes: regrouping dims. A reshape that splits a sequence dim keeps every piece a sequence dim.
RESHAPE = frozenset({"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "view_as_complex",
                     "view_as_real", "ravel"})  # fmt: skip

#: Splits: name -> (position of the dim argument after the tensor, keyword, default).
SPLITS = {"split": (1, "dim", 0), "split_with_sizes": (1, "dim", 0), "chunk": (1, "dim", 0),
          "tensor_split": (1, "dim", 0), "unbind": (0, "dim", 0)}  # fmt: skip

#: Ops that read no tensor value (shape queries, factories shaped like a tensor).
NO_VALUES = frozenset({
    "size", "dim", "numel", "stride", "element_size", "is_contiguous", "get_device", "is_floating_point",
    "is_complex", "nelement", "ndimension", "sym_size", "sym_numel", "sym_stride", "sym_storage_offset",
    "ones_like", "zeros_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
    "new_ones", "new_zeros", "new_empty", "new_full", "_check_is_size", "sym_size_int",
})  # fmt: skip

#: Per-token normalisations over trailing dims (``normalized_shape``) and look-ups of a table by token ids.
FEATURE_REDUCTIONS = frozenset({"layer_norm", "rms_norm", "embedding", "linear"})

#: name -> (position of the dim argument after the tensor, keyword, default, kind). ``"all"``: every dim.
#: kinds: ``reduction`` (a value from all tokens), ``scan`` (a forward prefix: causal), ``order`` (a sort or a
#: selection by rank), ``shift`` (values moved along the dim).
DIM_REDUCTIONS: dict[str, tuple[int, str, object, str]] = {
    **{name: (0, "dim", "all", "reduction") for name in (
        "sum", "mean", "nansum", "nanmean", "prod", "amax", "amin", "max", "min", "argmax", "argmin", "any",
        "all", "count_nonzero", "logsumexp", "std", "var", "median", "nanmedian", "softmax", "log_softmax",
        "aminmax", "var_mean", "std_mean",
    )},
    "norm": (1, "dim", "all", "reduction"),  # torch.norm(input, p, dim), x.norm(p, dim)
    **{name: (0, "dim", "all", "scan") for name in ("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp")},
    **{name: (0, "dim", -1, "order") for name in ("sort", "argsort")},
    "msort": (0, "dim", 0, "order"),  # along the first dim; no dim argument
    "topk": (1, "dim", -1, "order"), "kthvalue": (1, "dim", -1, "order"),
    # unique(input, sorted, return_inverse, return_counts, dim), unique_consecutive(input, return_inverse,
    # return_counts, dim); no dim: over the flattened input
    "unique": (3, "dim", "all", "order"), "unique_consecutive": (2, "dim", "all", "order"),
    "flip": (0, "dims", "all", "shift"), "roll": (1, "dims", "all", "shift"), "diff": (1, "dim", -1, "shift"),
    "histc": (0, "dim", "all", "reduction"), "bincount": (0, "dim", "all", "reduction"),
}  # fmt: skip

#: Matrix products: mixing when a contracted dim is a sequence dim.
CONTRACTIONS = frozenset({"matmul", "mm", "bmm", "einsum", "baddbmm", "addmm", "addbmm", "__matmul__", "tensordot"})

#: Linear algebra on the last two dims of each operand (``[..., n, n]`` matrices, ``[..., n, k]`` right-hand
#: sides), batched over the dims before them: mixing when one of the last two dims is a sequence dim (the chunked
#: delta rule's ``solve_triangular`` within a chunk, batched over heads and chunks).
MATRIX_OPS = frozenset({
    "linalg_solve_triangular", "triangular_solve", "linalg_solve", "linalg_inv", "inverse", "linalg_cholesky",
    "cholesky", "linalg_matrix_exp", "matrix_exp", "linalg_det", "det", "linalg_slogdet", "slogdet",
})  # fmt: skip


def einsum_subscripts(eq: object, ranks: list[int | None]) -> tuple[list[str], str] | None:
    """An einsum equation as explicit subscripts, one letter per dim of each operand: ``(terms, output)``; how
    every pass reads an einsum (a contracted letter is one missing from the output).

    ``ranks`` are the operands' numbers of dims. ``...`` stands for the dims no letter names, right-aligned across
    operands as they broadcast; it becomes letters that the equation does not use (``'..., f -> ... f'`` on a
    ``[B, T]`` and an ``[F]`` operand reads ``'YZ,f->YZf'``: an outer product, nothing contracted). Without
    ``->`` the output is the broadcast dims followed by the letters used once, in alphabetical order. ``None``
    when the equation cannot be read (a non-string, a rank missing, more than one ``...`` in a term).
    """
    if not isinstance(eq, str):
        return None
    eq = eq.replace(" ", "")
    lhs, arrow, out = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks) or any(t.count("...") > 1 for t in (*terms, out)):
        return None
    spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in eq]
    widest = 0
    for i, (term, rank) in enumerate(zip(terms, ranks)):
        if "..." not in term:
            continue
        if rank is None:
            return None
        k = rank - (len(term) - 3)
        if k < 0 or k > len(spare):
            return None
        widest = max(widest, k)
        terms[i] = term.replace("...", "".join(spare[len(spare) - k :]))  # right-aligned broadcast dims
    broadcast = "".join(spare[len(spare) - widest :]) if widest else ""
    if not arrow:
        joined = "".join(terms)
        out = broadcast + "".join(sorted(c for c in set(joined) if joined.count(c) == 1 and c not in broadcast))
    else:
        out = out.replace("...", broadcast)
    if any("." in t for t in (*terms, out)):
        return None
    return terms, out


#: Convolutions (input ``[B, C, *spatial]``): mixing along a sequence dim among the spatial dims.
CONVOLUTIONS = frozenset({"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "convolution"})

#: Ops that zero elements by their index along the last two dims (``tril``, ``triu``): an element's index along a
#: sequence dim is its local index on a CP rank, not its global position, so they keep the tokens apart only when
#: no sequence dim is one of the last two.
INDEX_MASKS = frozenset({"tril", "triu"})

#: Losses over tokens: name -> position of their ``reduction`` argument after the input.
LOSSES = {"cross_entropy": (5, "reduction"), "nll_loss": (5, "reduction"), "mse_loss": (3, "reduction"),
          "l1_loss": (3, "reduction"), "binary_cross_entropy_with_logits": (4, "reduction"),
          "kl_div": (4, "reduction"), "smooth_l1_loss": (4, "reduction")}  # fmt: skip

#: Ops transformers' MoE dispatch applies to the ``tokens x top_k`` expert ids along the token dim.
DISPATCH = frozenset({"sort", "argsort", "histc", "bincount"})

#: Ops that move whole rows (tokens) by an index tensor without combining values.
ROW_MOVES = frozenset({"index_select", "gather", "take_along_dim", "index_add", "index_add_", "index_copy",
                       "index_copy_", "scatter", "scatter_", "scatter_add", "scatter_add_", "index_put",
                       "index_put_", "setitem", "getitem"})  # fmt: skip

#: Ops that write the rows of a source into ``self`` at the rows an index gives (``self.op(dim, index, src)``):
#: ``self``'s own elements stay where they are.
ROW_WRITES = frozenset({"index_add", "index_add_", "index_copy", "index_copy_", "scatter", "scatter_",
                        "scatter_add", "scatter_add_"})  # fmt: skip

#: Custom ops that are a torch row move under another name, by ``namespace::name``: the torch op and the dim it
#: moves rows along. torchtitan's MoE combine ``deterministic_scatter_add(out, index, src)`` is
#: ``out.scatter_add(0, index, src)`` under ``torch.use_deterministic_algorithms`` (torchtitan/ops/scatter_add.py).
ROW_MOVE_OPS = {"torchtitan::deterministic_scatter_add": ("scatter_add", 0)}


def row_move_args(n: fx.Node) -> tuple[str, object, object, object, object] | None:
    """``(torch op, self, dim, index, src)`` of a row move ``self.op(dim, index, src)``: an op of
    :data:`ROW_WRITES`, ``index_select``/``gather`` (``src`` ``None``), or a custom op of :data:`ROW_MOVE_OPS`;
    else ``None``."""
    name = op_name(n)

    def get(pos: int, key: str) -> object:
        return n.kwargs[key] if key in n.kwargs else n.args[pos] if len(n.args) > pos else None

    if name in ROW_MOVE_OPS:
        torch_op, dim = ROW_MOVE_OPS[name]
        return torch_op, get(0, "out"), dim, get(1, "index"), get(2, "src")
    if name in ROW_WRITES or name in ("index_select", "gather"):
        src = None if name in ("index_select", "gather") else get(3, "source" if "index_" in name else "src")
        if src is None and name in ("scatter", "scatter_"):
            src = get(3, "value")
        return name, get(0, "self" if n.op == "call_method" else "input"), get(1, "dim"), get(2, "index"), src
    return None


#: Grouped matrix products ``op(x, w, offs=...)``: row ``i`` of ``x`` times the weight of the group its place
#: among the offsets falls in (an MoE's experts over the dispatch's sorted rows, torchtitan's GroupedExperts):
#: every output row from its own input row, when the rows are ``x``'s and not ``w``'s.
GROUPED_MATMULS = frozenset({"_grouped_mm", "grouped_mm", "_scaled_grouped_mm"})

#: Custom ops that compute every token's output rows from that token's input rows, by ``namespace::name``.
#: transformers' MoE ``grouped_mm_fallback(x, w, offs=...)`` multiplies each row by its expert's weight, the
#: expert given by the row's place among the offsets (the dispatch's sorted layout).
PER_TOKEN_OPS = ("transformers::grouped_mm_fallback",)

#: The torch functions (in ``torch/nn/attention/flex_attention.py``) that compute a BlockMask's block tables.
#: A graph output computed inside one of them is a block table, which only lets flex skip blocks: the flex pass
#: evaluates the site's ``mask_mod`` at global indices and never reads the tables, so the ops that compute them
#: (the ``mask_mod`` evaluated on a grid of local indices, transformers' ``create_block_mask(..., _compile=True)``
#: in a graph of its own) belong to the attention pass like an SDPA mask. Dynamo names the frame it resumes after
#: a graph break in one of them ``torch_dynamo_resume_in_<name>_at_<line>``.
BLOCK_MASK_MAKERS = ("create_block_mask",)
#: Functions of model libraries that build a whole sequence's attention masks from its positions, meant to run
#: outside the model (torchtitan's trainer calls them on the batch), and what to do instead when one runs
#: inside a compiled graph on a rank's tokens.
MASKS_BUILT_OUTSIDE = (
    (
        ("get_attention_masks", "get_efficient_causal_mask_mod_for_packed_document"),
        "build torchtitan's attention masks outside the compiled model, on the global batch "
        "(model.get_attention_masks(batch['position_ids']) before cpcompile.shard), and pass them in the batch "
        "handed to cpcompile.shard (docs/flex.md)",
    ),
)


#: Custom ops that are attention, which cpcompile does not rewrite (it rewrites SDPA and flex_attention calls):
#: words of the op's ``namespace::name`` -> what to use instead. The mixing pass refuses them with this fix, and
#: ``backend(per_token_ops=...)`` refuses to treat one as an op that keeps tokens apart.
ATTENTION_OPS = (
    (
        ("varlen_attn",),
        "it is variable-length attention (torchtitan's VarlenAttention, flash-attn's varlen kernel), which cpcompile "
        "does not rewrite: use the model's flex_attention or SDPA path instead (torchtitan: attn_backend='flex', "
        "its masks built outside the model and passed in the batch handed to cpcompile.shard; transformers: "
        "attn_implementation='sdpa' or 'flex_attention')",
    ),
    (
        ("flash_attn", "flash_attention", "_efficient_attention", "xformers", "sageattention"),
        "it is an attention kernel cpcompile does not rewrite: use the model's SDPA or flex_attention path "
        "instead (transformers: attn_implementation='sdpa' or 'flex_attention'; torchtitan: attn_backend='flex')",
    ),
)


def attention_op_fix(op: str) -> str | None:
    """The fix of :data:`ATTENTION_OPS` when the custom op named ``op`` (``namespace::name``) is attention."""
    return next((fix for words, fix in ATTENTION_OPS if any(w in op for w in words)), None)


def masks_built_outside_fix(node: object) -> str | None:
    """The fix of :data:`MASKS_BUILT_OUTSIDE` when ``node`` (an FX node) was traced inside one of its functions."""
    trace = getattr(node, "meta", {}).get("stack_trace") or ""
    return next((fix for names, fix in MASKS_BUILT_OUTSIDE if any(n in trace for n in names)), None)


# -- the positions pass ------------------------------------------------------------------------------------------
# A position-derived value is a tensor indexed by position (``arange(T)``, ``table[:T]``, and what the model
# computes from them) that the pass rewrites to the global positions of this rank's tokens. Its tables name the
# ops it has a rule for; a use by any other op is refused, so an op the mixing pass accepts and the positions
# pass has no rule for stays out of them.

#: Element-wise ops on position-derived values: :data:`ELEMENTWISE`, with
#:
#: * ``outer`` and ``ger`` added: for a position vector ``t``, ``outer(t, inv_freq)`` (RoPE's angles) computes
#:   row ``i`` from ``t[i]`` alone;
#: * the in-place ops left out: the pass looks an in-place op up by its out-of-place name (``add_`` as ``add``,
#:   the ``operator`` ones by :data:`~cpcompile.passes.aliasing.INPLACE_OPERATORS`) and :data:`FRESH_OPS`,
#:   built from this table, holds no op that returns its argument;
#: * ``type_as`` left out: a cast, in :data:`POSITION_LAYOUT`; it returns its input when the dtypes agree, so it
#:   is not one of :data:`FRESH_OPS`;
#: * the random ops left out (``dropout``, ``alpha_dropout``, ``feature_alpha_dropout``, ``bernoulli``): a draw
#:   at a local position is not the draw of the whole-sequence run at that token;
#: * ``not_``, ``truth`` (a tensor's truth as a Python bool) and ``_set_grad_enabled`` (no tensor) left out;
#: * the activations the positions pass has no rule for left out (a use of one is refused as not known):
#:   ``elu``, ``selu``, ``celu``, ``mish``, ``hardswish``, ``hardsigmoid``, ``hardtanh``, ``relu6``,
#:   ``leaky_relu``, ``softsign``, ``logsigmoid``, ``tanhshrink``, ``erfinv``.
POSITION_ELEMENTWISE = (
    (ELEMENTWISE | {"outer", "ger"})
    - {name for name in ELEMENTWISE if aliasing.is_inplace(name)}
    - {"type_as"}
    - {"dropout", "alpha_dropout", "feature_alpha_dropout", "bernoulli"}
    - {"not_", "truth", "_set_grad_enabled"}
    - {"elu", "selu", "celu", "mish", "hardswish", "hardsigmoid", "hardtanh", "relu6", "leaky_relu", "softsign",
       "logsigmoid", "tanhshrink", "erfinv"}
)  # fmt: skip

#: Layout ops on position-derived values: :data:`LAYOUT`, with ``type_as`` added (a cast, as ``to``), and left
#: out ``repeat``/``tile``/``repeat_interleave`` (along the sequence they repeat positions: the pass checks
#: ``repeat``'s sizes and ``repeat_interleave``'s dim by rules of its own and refuses ``tile``) and
#: ``_assert_tensor_metadata`` (no rule in the positions pass).
POSITION_LAYOUT = (LAYOUT | {"type_as"}) - {"repeat", "tile", "repeat_interleave", "_assert_tensor_metadata"}

#: Reshapes of position-derived values (each checked to keep every position's elements together):
#: :data:`RESHAPE` without ``ravel`` (no rule in the positions pass).
POSITION_RESHAPE = RESHAPE - {"ravel"}

#: Ops that read no value of a position-derived tensor: :data:`NO_VALUES` without ``_check_is_size`` and
#: ``sym_size_int``, which the positions pass has no entry for (their size arguments are not tensors it follows).
POSITION_NO_VALUES = NO_VALUES - {"_check_is_size", "sym_size_int"}

#: Reductions, scans, sorts and shifts along a ``dim`` argument, checked not to run along the sequence: name ->
#: (position of the dim argument after the tensor, keyword, default), :data:`DIM_REDUCTIONS` without its kind,
#: with
#:
#: * ``normalize`` added (``F.normalize(input, p, dim=1)``: a norm along ``dim``);
#: * left out: ``histc`` and ``bincount`` (their arguments after the tensor are bins, a range or weights, not a
#:   dim: the mixing pass reads them by a rule of its own) and ``aminmax``, ``var_mean``, ``std_mean`` (no rule in
#:   the positions pass).
POSITION_REDUCTIONS: dict[str, tuple[int, str, object]] = {
    **{
        name: (pos, kw, default)
        for name, (pos, kw, default, _) in DIM_REDUCTIONS.items()
        if name not in {"histc", "bincount", "aminmax", "var_mean", "std_mean"}
    },
    "normalize": (1, "dim", 1),
}

#: Matrix products, checked not to contract a sequence dim of a position-derived factor: :data:`CONTRACTIONS`
#: with ``linear`` added (it contracts the last dim of its input and of its weight, either of which may be
#: position-derived; the mixing pass reads it as a per-token :data:`FEATURE_REDUCTIONS` op) and without the
#: products the pass's rule (the last dim of the first argument against the second argument's row dim) does not
#: describe (``addmm``, ``addbmm``, ``baddbmm``: a bias first; ``tensordot``: the contracted dims given as an
#: argument) or that it has no rule for (``__matmul__``).
POSITION_CONTRACTIONS = (CONTRACTIONS | {"linear"}) - {"addmm", "addbmm", "baddbmm", "tensordot", "__matmul__"}

#: Factories: tensors that hold the same value at every position (``ones(T)``, a value broadcast to ``T`` rows).
FACTORIES = frozenset({
    "ones", "zeros", "empty", "full", "empty_strided", "ones_like", "zeros_like", "empty_like", "full_like",
    "new_ones", "new_zeros", "new_empty", "new_full", "expand", "broadcast_to", "expand_as",
})  # fmt: skip

#: Ops whose symbolic-size arguments are sizes, not values (``full``'s fill value excepted: :data:`FILL_ARGS`).
SIZE_ARGS = FACTORIES | {
    "view", "reshape", "rand", "randn", "randint", "repeat", "tile", "unflatten", "split", "split_with_sizes",
    "chunk", "tensor_split", "pad", "topk", "kthvalue", "as_strided", "eye", "linspace", "logspace",
    "tril_indices", "triu_indices", "interpolate", "movedim", "permute", "transpose", "flatten", "unsqueeze",
    "squeeze",
}  # fmt: skip

#: The fill value of a factory: name -> (its position among the op's arguments, keyword).
FILL_ARGS = {"full": (1, "fill_value"), "full_like": (1, "fill_value"), "new_full": (2, "fill_value")}

#: Ops whose tensor arguments past the first are read for their dtype, device or shape only.
SHAPE_ONLY_ARGS = frozenset({"type_as", "expand_as", "view_as", "reshape_as", "to"})

#: Concatenations along a ``dim`` argument (``stack`` makes a new dim and is not one of them).
CONCATS = frozenset({"cat", "concat", "concatenate"})

#: Ops that always return a newly allocated tensor, never an alias of an argument (a write into one is seen only
#: through it and its views): the positions pass's element-wise ops (no in-place op: it returns its argument)
#: but those that may return a view of their input (``real``, ``imag``, ``conj``, ``resolve_conj``, ``pos``),
#: the factories but the broadcasts (views), the reductions but those that may return a ``(values, indices)``
#: pair, the products, the concatenations, and a few copies and lookups.
FRESH_OPS = frozenset(
    (POSITION_ELEMENTWISE - {"real", "imag", "conj", "resolve_conj", "pos"})
    | (FACTORIES - {"expand", "broadcast_to", "expand_as"})
    | (POSITION_REDUCTIONS.keys() - {"max", "min", "sort", "topk", "kthvalue", "cummax", "cummin", "unique"})
    | POSITION_CONTRACTIONS
    | CONCATS
    | {"stack", "clone", "embedding", "index_select", "gather"}
)


# -- the mask prover ---------------------------------------------------------------------------------------------
# The prover reads the subgraph that builds an attention mask as a formula over query and key positions; a value
# built from positions that meets an op it has no rule for is refused.

#: Ops that hand a value on with every element in its place, counted from the last dim (the prover tells a token's
#: dim by its place from the right): :data:`LAYOUT` with ``type_as`` (a cast, as ``to``) and ``alias`` added, and
#: left out
#:
#: * the dim moves (``transpose``, ``permute``, ``movedim``, ``moveaxis``, ``swapaxes``, ``swapdims``, ``t``):
#:   they move a token's dim; ``unsqueeze`` and ``squeeze`` are read as reshapes (:data:`MASK_RESHAPE`);
#: * ``repeat``, ``tile`` and ``repeat_interleave``: they copy elements along a dim;
#: * the casts to ``double``, ``half``, ``bfloat16``, ``short``, ``char``, ``byte``, the moves to ``cpu`` and
#:   ``cuda``, and ``_assert_tensor_metadata``: no rule in the prover.
MASK_LAYOUT = (LAYOUT | {"type_as", "alias"}) - {
    "transpose", "permute", "movedim", "moveaxis", "swapaxes", "swapdims", "t", "unsqueeze", "squeeze",
    "repeat", "tile", "repeat_interleave",
    "double", "half", "bfloat16", "short", "char", "byte", "cpu", "cuda", "_assert_tensor_metadata",
}  # fmt: skip

#: Reshapes the prover checks to keep a token's dim whole (the same size, the same number of elements after it):
#: :data:`RESHAPE` with ``unsqueeze`` and ``squeeze`` added (a dim of size 1 in or out), without ``flatten``,
#: ``unflatten`` and ``ravel`` (no rule in the prover) and ``view_as_complex``, ``view_as_real`` (they change the
#: element type: a mask or a position is not complex).
MASK_RESHAPE = (RESHAPE | {"unsqueeze", "squeeze"}) - {
    "flatten",
    "unflatten",
    "ravel",
    "view_as_complex",
    "view_as_real",
}


def op_name(n: fx.Node) -> str:
    """The vocabulary name of a graph node's operation (see the module docstring): :func:`aliasing.op_name
    <cpcompile.passes.aliasing.op_name>`, with ``"setitem"``, ``"ns::name"`` for a custom op and
    ``"scaled_dot_product_attention"``."""
    if n.op == "call_function":
        if n.target is operator.setitem:
            return "setitem"
        qualified = _compat.custom_op_name(n.target)
        if qualified is not None and qualified.split("::")[0] not in ("aten", "prims"):
            return qualified
        if n.target in _compat.SDPA_TARGETS:
            return "scaled_dot_product_attention"
    return aliasing.op_name(n)
