"""Positions a model computes from the local sequence length: made global in the graph, or refused.

Under :func:`cpcompile.shard` a rank holds ``c`` tokens of the sequence (``[r*c, (r+1)*c)`` in the contiguous
layout, a few runs of tokens in the balanced one) but the model sees a sequence of length ``c``. A value the
model derives from that length (``arange(T)``, ``table[:T]``) gives every rank the positions of tokens
``[0, c)``: silently wrong for every token held elsewhere. This pass finds such values (*position
sources*) in a Dynamo graph and, for each one:

* **rewrites** it so that every local token gets what the whole-sequence run gives that token: ``arange`` becomes
  the global token indices of this rank (read from the active plan at run time by
  ``torch.ops.cpcompile.token_positions``), ``table[a:a+T]`` / ``narrow`` become an ``index_select`` of the
  table at those indices; whatever the model then computes element-wise from them follows;
* leaves it to the attention mask (**mask**) when every use ends in an SDPA ``attn_mask`` (the attention pass
  replaces those masks and checks them against the plan at run time; the backend runs this pass after it, so
  the model's mask then feeds the ``model_mask`` argument of a ``cpcompile::`` op);
* leaves it **unchanged** when it holds the same value at every position (``ones(T)``) and is only used
  element-wise;
* **refuses** it (:class:`UnsupportedPositionError` at compile time) when it mixes positions along the sequence
  before it meets the sharded data (``cumsum``, a sum, a matmul over the sequence, a shift), when it uses the
  local length itself as a value, or whenever the pass cannot prove that the value is computed per position.

find -> check -> rewrite: :func:`sequence_length` (how the local length appears in the graph),
:func:`find_position_sources` (typed :class:`PositionSource` matches), :func:`check_source` (a
:class:`PositionCheck` with a one-line reason), :func:`rewrite_source`; :func:`positions_pass` is the entry point
the backend runs on every graph when the CP group has more than one rank. ``cpcompile.passes.counters`` counts
``position_sources_found`` and, by what became of them, ``position_sources_rewritten``, ``_refused``, ``_mask``
and ``_unchanged``.

*Sharded data* are the graph inputs whose shape contains the local length (token ids, hidden states of a
per-layer graph, the global ``position_ids`` that ``shard`` passes) and everything computed from their values;
the pass follows a source forward through pure position computation and stops where it meets sharded data.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections import Counter
from typing import Literal

import torch
import torch.fx as fx

from cpcompile import _compat, ops
from cpcompile.errors import UnsupportedPositionError
from cpcompile.passes.aliasing import INPLACE_OPERATORS, is_inplace, mutated, op_name, viewed_bases
from cpcompile.passes.common import PassContext, counters, finish, graph_modules, node_value, source_line
from cpcompile.passes.common import arg as _arg
from cpcompile.passes.mask_rules import prove_mask

__all__ = [
    "PositionCheck",
    "PositionReport",
    "PositionSource",
    "SequenceLength",
    "check_source",
    "find_position_sources",
    "positions_pass",
    "rewrite_source",
    "sequence_length",
    "source_line",
]

#: What the pass does with a source: see the module docstring.
Action = Literal["rewritten", "refused", "mask", "unchanged"]
#: How a source derives from the local length.
Kind = Literal["arange", "table_slice", "narrow", "factory", "length", "other"]

#: The fix every refusal ends with: positions as an input are sharded data, exact in every case.
FIX = (
    "make the model take its positions as an input (a positions= or position_ids= argument of its forward) and "
    'pass the global ones cpcompile.shard provides, e.g. model(tokens, positions=local["position_ids"])'
)
#: The fix for the code at hand, by the words of the refusal's reason (first match), before :data:`FIX`.
REASON_FIXES = (
    (
        "mixes the values of different positions",
        "this reduction sees only this rank's positions; compute what it needs from the global sequence length "
        "or positions, or remove it if its result is not needed",
    ),
    (
        "contracts the sequence dim",
        "this product sums over this rank's positions only; compute it per position (outer, einsum keeping the "
        "position index) or from positions passed as an input",
    ),
    (
        "(a shift or a selection)",
        "a shifted or selected position is another token's, which may live on another rank; index the whole "
        "range (table[:T], table[k - q:k] with k = q the local length, x[..., -T:, :] of T rows) or pass "
        "positions as an input",
    ),
    (
        "joins position-derived values along the sequence",
        "build the positions of the local tokens in one range (arange(T), table[:T]) instead of joining pieces",
    ),
    (
        "the local sequence length used as a value",
        "the local length is not the global one; pass the global length or positions as an input",
    ),
    (
        "an index computed from the local sequence length",
        "the local length is not the global one; pass the global length or positions as an input",
    ),
    (
        "a slice at an offset that is only known at run time",
        "slice the table from a constant first row (table[:T], table[a:a + T] with an int a); a slice relative "
        "to the end of a longer table (table[-T:]) selects rows that depend on the local length",
    ),
    (
        "that outlives this call (a cache that later calls read)",
        "fill the cache for every row once, outside the training call (at init, for the longest sequence), so "
        "that the training call only slices it (cache[:T]), which cpcompile rewrites",
    ),
)


def _fix_for(reason: str) -> str:
    return next((f"{fix}; or " for words, fix in REASON_FIXES if words in reason), "")


@dataclasses.dataclass(frozen=True)
class SequenceLength:
    """How the local sequence length appears in a graph.

    ``symbols``: the sympy symbols of the local length (a dynamic graph: ``shard`` marks the sequence dim
    dynamic). Empty in a static graph, where sizes equal to ``chunk_len`` stand for the local length.
    """

    symbols: frozenset
    #: The active plan's chunk length (``None`` when the graph was compiled outside a shard context).
    chunk_len: int | None

    @property
    def static(self) -> bool:
        """True when the graph has no symbol for the length (sizes are compared with ``chunk_len`` instead)."""
        return not self.symbols

    def involves(self, size: object) -> bool:
        """Whether a size (or a symbolic scalar) depends on the local length."""
        if self.symbols:
            return bool(_compat.free_symbols(size) & self.symbols)
        return type(size) is int and size == self.chunk_len

    def is_length(self, size: object) -> bool:
        """Whether a size is exactly the local length."""
        if self.symbols:
            return isinstance(size, torch.SymInt) and _compat.sym_expr(size) in self.symbols
        return type(size) is int and size == self.chunk_len


@dataclasses.dataclass(frozen=True)
class GraphFacts:
    """What the pass knows about one graph module: which nodes hold sharded data, which only build masks."""

    graph_module: fx.GraphModule
    seq: SequenceLength
    #: Nodes whose values depend on sharded data.
    data: frozenset
    #: Nodes every use of which ends in an SDPA ``attn_mask`` (or, for a pairwise ``[.., T, T]`` value, leaves
    #: the graph: the graph that receives it checks it as a mask).
    mask_only: frozenset
    #: Nodes whose value reaches the graph's output or a side effect (see :func:`live_nodes`); the others are
    #: dead code Dynamo keeps (``max_pos = t.max() + 1`` never used) and cannot change a result.
    live: frozenset


@dataclasses.dataclass(frozen=True)
class PositionSource:
    """One value derived from the local sequence length and not from sharded data."""

    node: fx.Node
    kind: Kind
    #: Qualified name of the module that made it (``layers.0.attention.rope``), or ``""``.
    layer: str
    facts: GraphFacts = dataclasses.field(repr=False)
    #: ``table_slice``/``narrow``: the sliced table, its sliced dim and the first row; ``arange``: start, step.
    table: fx.Node | None = None
    dim: int = 0
    start: object = 0
    step: object = 1
    #: ``table_slice``: dim of the node's output that holds the sequence, and the index entry that slices it.
    out_dim: int = 0
    entry: int = 0
    #: Why the source cannot be rewritten as found (``""``: it can, if its uses allow).
    problem: str = ""

    @property
    def where(self) -> str:
        return f"{self.layer or '<top level>'} (node {self.node.name})"

    @property
    def located(self) -> str:
        """:attr:`where`, after the model's source line when the graph recorded it."""
        line = source_line(self.node)
        return f"{line}, {self.where}" if line else self.where


@dataclasses.dataclass(frozen=True)
class PositionCheck:
    """The outcome of :func:`check_source`: what to do and, when refused, why and at which node."""

    action: Literal["rewrite", "refuse", "mask", "unchanged"]
    reason: str = ""
    #: Refused only because the graph has no symbol for the length (the fix then also names dynamic shapes).
    static: bool = False


@dataclasses.dataclass(frozen=True)
class PositionReport:
    """What the pass did with one position source (``backend.position_reports``, inspect, dumps)."""

    graph_id: int
    node: str
    layer: str
    kind: Kind
    action: Action
    reason: str = ""


# -- graph vocabulary ------------------------------------------------------------------------------------
_val = node_value  # the fake value of a node (short name: used on nearly every line of the pass)


def _shape(n: object) -> tuple | None:
    v = _val(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _is_tensorish(n: object) -> bool:
    v = _val(n)
    return isinstance(v, torch.Tensor) or (isinstance(v, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in v))


def _may_be_tensor(n: object) -> bool:
    """A tensor, or a node without a recorded value (inserted by an earlier pass): it may carry data."""
    return isinstance(n, fx.Node) and (_val(n) is None or _is_tensorish(n))


def _is_sdpa(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target in _compat.SDPA_TARGETS


def _mask_args(u: fx.Node) -> tuple[object, tuple]:
    """``(mask, other tensor args)`` of an op that consumes the model's attention mask: SDPA's ``attn_mask``, or
    the ``model_mask`` argument of the ``cpcompile::`` op to which the attention pass hands the model's mask (to
    check it against the plan's at run time). ``(None, ())`` for any other op."""
    if _is_sdpa(u):
        bound = dict(zip(("query", "key", "value", "attn_mask"), u.args))
        bound.update({k: v for k, v in u.kwargs.items() if k in ("query", "key", "value", "attn_mask")})
        return bound.get("attn_mask"), tuple(bound.get(k) for k in ("query", "key", "value"))
    names = _compat.op_argument_names(u.target, "cpcompile") if u.op == "call_function" else None
    if names is None or "model_mask" not in names:
        return None, ()
    bound = dict(zip(names, u.args))
    bound.update(u.kwargs)
    others = tuple(v for k, v in bound.items() if k != "model_mask" and isinstance(v, fx.Node))
    return bound.get("model_mask"), others


def _leaves_graph(n: fx.Node) -> bool:
    """The graph's output, or a call of a nested graph (activation checkpointing), which sees its inputs as data."""
    return n.op == "output" or (n.op == "call_function" and _compat.is_higher_order_op(n.target))


def _seq_dims(n: object, seq: SequenceLength) -> list[int]:
    shape = _shape(n)
    return [] if shape is None else [d for d, s in enumerate(shape) if seq.involves(s)]


def _has_seq(n: object, seq: SequenceLength) -> bool:
    """Whether a tensor (or any tensor of a tuple, e.g. a split's outputs) has a dim of the local length."""
    v = _val(n)
    values = v if isinstance(v, (tuple, list)) else (v,)
    return any(isinstance(x, torch.Tensor) and any(seq.involves(s) for s in x.shape) for x in values)


def _is_seq_scalar(n: object, seq: SequenceLength) -> bool:
    v = _val(n)
    return isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) and seq.involves(v)


# Ops whose tensor arguments past the first are read for their dtype, device or shape only.
_FIRST_ONLY = {"type_as", "expand_as", "view_as", "reshape_as", "to"}
# Ops that read no tensor value at all (shape queries, factories shaped like a tensor).
_NO_VALUES = {
    "size", "dim", "numel", "stride", "element_size", "is_contiguous", "get_device", "is_floating_point",
    "is_complex", "nelement", "ndimension", "sym_size", "sym_numel", "sym_stride", "sym_storage_offset",
    "ones_like", "zeros_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
    "new_ones", "new_zeros", "new_empty", "new_full",
}  # fmt: skip
_FACTORIES = {
    "ones", "zeros", "empty", "full", "empty_strided", "ones_like", "zeros_like", "empty_like", "full_like",
    "new_ones", "new_zeros", "new_empty", "new_full", "expand", "broadcast_to", "expand_as",
}  # fmt: skip
# Ops whose symbolic-size arguments are sizes, not values (``full``'s fill value excepted).
_SIZE_ARGS = _FACTORIES | {
    "view", "reshape", "rand", "randn", "randint", "repeat", "tile", "unflatten", "split", "split_with_sizes",
    "chunk", "tensor_split", "pad", "topk", "kthvalue", "as_strided", "eye", "linspace", "logspace",
    "tril_indices", "triu_indices", "interpolate", "movedim", "permute", "transpose", "flatten", "unsqueeze",
    "squeeze",
}  # fmt: skip
_FILL_ARG = {"full": (1, "fill_value"), "full_like": (1, "fill_value"), "new_full": (2, "fill_value")}
_ELEMENTWISE = {
    "add", "sub", "rsub", "mul", "truediv", "div", "floordiv", "floor_divide", "mod", "remainder", "fmod", "pow",
    "float_power", "neg", "pos", "abs", "absolute", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sin",
    "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "tanh", "sigmoid", "sqrt", "rsqrt",
    "reciprocal", "square", "floor", "ceil", "round", "trunc", "frac", "sign", "sgn", "clamp", "clip",
    "clamp_min", "clamp_max", "maximum", "minimum", "fmax", "fmin", "where", "masked_fill", "lerp", "addcmul",
    "addcdiv", "hypot", "copysign", "logaddexp", "eq", "ne", "lt", "le", "gt", "ge", "logical_and",
    "logical_or", "logical_not", "logical_xor", "and_", "or_", "xor", "invert", "bitwise_and", "bitwise_or",
    "bitwise_xor", "bitwise_not", "lshift", "rshift", "polar", "complex", "real", "imag", "angle", "conj",
    "conj_physical", "resolve_conj", "silu", "gelu", "relu", "softplus", "erf", "erfc", "nan_to_num", "isnan",
    "isinf", "isfinite", "deg2rad", "rad2deg", "outer", "ger",
}  # fmt: skip
_LAYOUT = {
    "transpose", "permute", "movedim", "moveaxis", "swapaxes", "swapdims", "t", "unsqueeze", "squeeze", "expand",
    "broadcast_to", "expand_as", "contiguous", "clone", "detach", "to", "type", "float", "double", "half",
    "bfloat16", "int", "long", "short", "bool", "char", "byte", "type_as", "cpu", "cuda",
}  # fmt: skip
_RESHAPE = {"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "view_as_complex", "view_as_real"}
_SPLITS = {"split": (1, "dim", 0), "split_with_sizes": (1, "dim", 0), "chunk": (1, "dim", 0),
           "tensor_split": (1, "dim", 0), "unbind": (0, "dim", 0)}  # fmt: skip
_ALL = "all"
# name -> (position of the dim argument after the tensor, keyword, default when absent)
_REDUCE = {
    **{name: (0, "dim", _ALL) for name in (
        "sum", "mean", "nansum", "nanmean", "prod", "amax", "amin", "max", "min", "argmax", "argmin", "any",
        "all", "count_nonzero", "logsumexp", "std", "var", "median", "nanmedian", "softmax", "log_softmax",
        "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "unique", "unique_consecutive", "msort",
    )},
    "sort": (0, "dim", -1), "argsort": (0, "dim", -1), "topk": (1, "dim", -1), "kthvalue": (1, "dim", -1),
    "norm": (1, "dim", _ALL), "normalize": (1, "dim", 1), "flip": (0, "dims", _ALL), "roll": (1, "dims", _ALL),
    "diff": (1, "dim", -1),
}  # fmt: skip
_CONCAT = {"cat", "concat", "concatenate"}
_MATMUL = {"matmul", "mm", "bmm", "linear", "einsum"}
# Ops that always return a newly allocated tensor (never an alias of an argument).
_FRESH_OPS = (
    (_ELEMENTWISE - {"real", "imag", "conj", "resolve_conj", "pos"})
    | (_FACTORIES - {"expand", "broadcast_to", "expand_as"})
    | (set(_REDUCE) - {"max", "min", "sort", "topk", "kthvalue", "cummax", "cummin", "unique"})
    | _MATMUL
    | _CONCAT
    | {"stack", "clone", "embedding", "index_select", "gather", "outer"}
)


def _value_inputs(n: fx.Node) -> list[fx.Node]:
    """The inputs whose values ``n`` reads (not those it reads only for a dtype, device or shape)."""
    name = op_name(n)
    if name in _NO_VALUES:
        return []
    if name in _FIRST_ONLY:
        first = n.args[0] if n.args else None
        return [first] if _may_be_tensor(first) else []
    return [i for i in n.all_input_nodes if _may_be_tensor(i)]


# -- find ------------------------------------------------------------------------------------------------
def sequence_length(gm: fx.GraphModule, chunk_len: int | None) -> SequenceLength | None:
    """The local length of ``gm``: the symbols of its inputs' sizes that stand for it, else ``chunk_len``.

    A symbol is the local length when it is a whole dim of a tensor input that is not module state (token
    ids, hidden states, ``position_ids``) and the size it had when the graph was traced equals ``chunk_len``
    (the backend compiles inside the shard context whose plan fixes ``c``). Without a plan, the symbols of
    dim 1 (the sequence dim of ``[B, T, ...]`` inputs, the one ``shard`` marks dynamic) are taken. ``None``
    when the graph has no symbol and no plan tells ``c``.
    """
    symbols = set()
    for n in gm.graph.nodes:
        v = _val(n)
        if n.op != "placeholder" or not isinstance(v, torch.Tensor) or _compat.is_module_state(n):
            continue
        dims = range(v.dim()) if chunk_len is not None else ([1] if v.dim() >= 2 else [])
        for d in dims:
            size = v.shape[d]
            if not isinstance(size, torch.SymInt) or _compat.free_symbols(size) != {_compat.sym_expr(size)}:
                continue
            if chunk_len is None or _compat.sym_hint(size) == chunk_len:
                symbols.add(_compat.sym_expr(size))
    if not symbols and chunk_len is None:
        return None
    return SequenceLength(frozenset(symbols), chunk_len)


def graph_facts(gm: fx.GraphModule, seq: SequenceLength) -> GraphFacts:
    """Sharded data and mask-only nodes of one graph module (see :class:`GraphFacts`)."""
    nodes = list(gm.graph.nodes)
    data: set[fx.Node] = set()
    changed = True
    while changed:  # an in-place write of data into a tensor makes that tensor data: iterate to a fixed point
        changed = False
        for n in nodes:
            if n not in data:
                if n.op == "placeholder":
                    is_data = _is_tensorish(n) and not _compat.is_module_state(n) and _has_seq(n, seq)
                else:
                    is_data = n.op in ("call_function", "call_method", "call_module") and any(
                        i in data for i in _value_inputs(n)
                    )
                if is_data:
                    data.add(n)
                    changed = True
            target = mutated(n)
            if target is not None and any(i in data for i in _value_inputs(n)):
                for written in viewed_bases(target):  # writing data into a view writes it into its base
                    if written not in data:
                        data.add(written)
                        changed = True
    live = live_nodes(gm)
    mask_only: set[fx.Node] = set()
    for n in reversed(nodes):
        users = [u for u in n.users if u in live]
        if users and all(_mask_use(n, u, seq, mask_only) for u in users):
            mask_only.add(n)
    return GraphFacts(gm, seq, frozenset(data), frozenset(mask_only), live)


def _has_side_effect(n: fx.Node) -> bool:
    """A call whose effect is not only its value: an op FX calls impure (collectives, asserts, random ops), a call
    of a nested graph or a module, a call of an op the pass does not know (a ``cpcompile::`` op)."""
    if n.op == "call_module" or _leaves_graph(n):
        return True
    if n.op != "call_function":
        return False
    try:
        return n.is_impure()
    except Exception:  # noqa: BLE001 - a target FX cannot judge is kept
        return True


def _fresh(n: fx.Node) -> bool:
    """Whether ``n`` is a tensor the graph allocates itself (not an input, not a possible alias of another
    tensor): a write into it is seen only through it and its views."""
    if n.op not in ("call_function", "call_method") or mutated(n) is not None:
        return False
    name = op_name(n)
    return name == "arange" or name in _FRESH_OPS


def live_nodes(gm: fx.GraphModule) -> frozenset:
    """The nodes of ``gm`` whose value can change what the graph returns or writes.

    Live are the output, every call with a side effect, every in-place write (``add_``, ``setitem``, ``copy_``,
    ``out=``) into a tensor that is a graph input (module state, an argument: the caller sees the write) or
    whose base is live, and every input of a live node. A write into a view is a write into the viewed tensors,
    so it is live when any of them is. What is left is dead: Dynamo keeps such nodes (a value computed for an
    option that is off), and no result depends on them.
    """
    nodes = list(gm.graph.nodes)
    live: set[fx.Node] = set()
    changed = True
    while changed:  # a write into a tensor becomes live once the tensor is: iterate to a fixed point
        changed = False
        for n in reversed(nodes):
            if n in live:
                continue
            target = mutated(n)
            alive = n.op == "output" or any(u in live for u in n.users)
            if not alive and target is not None:
                bases = viewed_bases(target)
                alive = not _fresh(bases[-1]) or any(b in live for b in bases)
            elif not alive:
                alive = _has_side_effect(n)
            if alive:
                changed = True
                stack = [n]
                while stack:
                    m = stack.pop()
                    if m not in live:
                        live.add(m)
                        stack.extend(m.all_input_nodes)
    return frozenset(live)


def _mask_use(n: fx.Node, u: fx.Node, seq: SequenceLength, mask_only: set) -> bool:
    mask, others = _mask_args(u)
    if mask is not None or others:
        return mask is n and all(o is not n for o in others)
    if _leaves_graph(u):
        return _pairwise(n, seq)  # a [.., T, T] value: the receiving graph checks it as its mask
    if n not in _value_inputs(u):
        return True  # read for its shape only
    return u in mask_only


def _pairwise(n: fx.Node, seq: SequenceLength) -> bool:
    """Whether ``n`` is a ``[.., T, T]`` value of the local length: two sequence dims, or a bool ``[.., c, c]`` whose
    last two sizes are the plan's chunk length as constants (transformers builds the mask it hands to per-layer
    graphs with concrete sizes even when the graph's inputs have a symbolic length, e.g. under FSDP2)."""
    if len(_seq_dims(n, seq)) >= 2:
        return True
    v = _val(n)
    if not isinstance(v, torch.Tensor) or v.dtype != torch.bool or v.dim() < 2 or seq.chunk_len is None:
        return False
    return all(type(s) is int and s == seq.chunk_len for s in v.shape[-2:])


def _flat_args(n: fx.Node) -> list[tuple[object, fx.Node]]:
    """``(position or keyword, node)`` of every node among ``n``'s arguments, nested containers included."""
    out = []
    for key, arg in [*enumerate(n.args), *n.kwargs.items()]:
        fx.node.map_arg(arg, lambda a, key=key: out.append((key, a)))
    return out


def _length_values(n: fx.Node, name: str, seq: SequenceLength) -> list[fx.Node]:
    """Arguments of ``n`` that are the local length (or computed from it) used as a value, not as a size."""
    found = [(key, a) for key, a in _flat_args(n) if _is_seq_scalar(a, seq)]
    if not found or name in ("arange", "getitem", "narrow", "select"):
        return []  # these are classified by what they produce
    if name in _SIZE_ARGS:
        fill = _FILL_ARG.get(name)
        return [a for key, a in found if fill is not None and key in fill]
    return [a for _, a in found]


def _arange_source(n: fx.Node, facts: GraphFacts, layer: str) -> PositionSource | None:
    seq = facts.seq
    args = list(n.args)
    start, end, step = 0, None, 1
    if len(args) == 1:
        end = args[0]
    elif args:
        start, end, step = args[0], args[1], args[2] if len(args) > 2 else 1
    start, end, step = n.kwargs.get("start", start), n.kwargs.get("end", end), n.kwargs.get("step", step)
    shape = _shape(n)
    length = shape[0] if shape else None
    scalars = [a for a in (start, end, step) if isinstance(a, fx.Node)]
    if length is None or not seq.involves(length):
        if any(_is_seq_scalar(a, seq) for a in scalars):
            return PositionSource(n, "length", layer, facts, problem="a range offset by the local sequence length")
        return None
    problem = ""
    if not seq.is_length(length):
        problem = f"an arange of {length} elements, not of the local sequence length"
    elif any(_is_seq_scalar(a, seq) for a in (start, step) if isinstance(a, fx.Node)):
        problem = "an arange whose start or step is computed from the local sequence length"
    return PositionSource(n, "arange", layer, facts, start=start, step=step, problem=problem)


def _slice_source(n: fx.Node, name: str, facts: GraphFacts, layer: str) -> PositionSource | None:
    seq = facts.seq
    base = n.args[0] if n.args else None
    base_shape, out_shape = _shape(base), _shape(n)
    if base_shape is None or out_shape is None or base in facts.data:
        return None
    if name == "select":  # table.select(dim, i): a row picked by an index computed from the length?
        index = _arg(n, 2, "index")
        if _is_seq_scalar(index, seq):
            return PositionSource(n, "length", layer, facts, problem="an index computed from the local sequence length")
        return None
    if name == "narrow":
        dim, start, length = (_arg(n, 1, "dim"), _arg(n, 2, "start"), _arg(n, 3, "length"))
        length = _val(length) if isinstance(length, fx.Node) else length
        if not isinstance(dim, int) or not seq.involves(length) or seq.involves(base_shape[dim % len(base_shape)]):
            return None
        dim = dim % len(base_shape)
        start = 0 if _is_zero(start) else start
        problem = "" if seq.is_length(out_shape[dim]) else "a narrow that is not of the local sequence length"
        if not (isinstance(start, int) and start >= 0):
            problem = problem or "a narrow at an offset that is only known at run time"
        elif type(base_shape[dim]) is not int:
            problem = problem or "a narrow of a table whose length is only known at run time"
        return PositionSource(n, "narrow", layer, facts, table=base, dim=dim, start=start, out_dim=dim, problem=problem)
    if name != "getitem" or not isinstance(_val(base), torch.Tensor):
        return None
    index = n.args[1]
    entries = index if isinstance(index, tuple) else (index,)
    if any(isinstance(e, fx.Node) and isinstance(_val(e), torch.Tensor) for e in entries):
        return None  # a lookup with a tensor index: followed as position computation, not a new source
    consumed = sum(1 for e in entries if e is not None and e is not Ellipsis)
    in_d = out_d = 0
    sliced, uses_length = [], False
    for i, e in enumerate(entries):
        if e is None:
            out_d += 1
            continue
        if e is Ellipsis:
            k = len(base_shape) - consumed
            in_d, out_d = in_d + k, out_d + k
            continue
        parts = (e.start, e.stop, e.step) if isinstance(e, slice) else (e,)
        uses_length |= any(_is_seq_scalar(p, seq) for p in parts)
        if isinstance(e, slice):
            if seq.involves(out_shape[out_d]) and not seq.involves(base_shape[in_d]):
                sliced.append((i, e, in_d, out_d))
            out_d += 1
        in_d += 1
    if not sliced:
        # a table indexed by the length; a base with a sequence dim is position computation, checked where used
        if uses_length and not _has_seq(base, seq):
            return PositionSource(n, "length", layer, facts, problem="an index computed from the local sequence length")
        return None
    (i, e, in_d, out_d), problem = sliced[0], ""
    start = 0 if _is_zero(e.start) else e.start
    if len(sliced) > 1:
        problem = "a slice of several dims by the local sequence length"
    elif not seq.is_length(out_shape[out_d]):
        problem = f"a slice of {out_shape[out_d]} rows, not of the local sequence length"
    elif e.step not in (None, 1):
        problem = f"a slice with step {e.step}"
    elif not (isinstance(start, int) and start >= 0):
        problem = "a slice at an offset that is only known at run time"
    elif type(base_shape[in_d]) is not int:
        problem = "a slice of a table whose length is only known at run time"
    return PositionSource(
        n, "table_slice", layer, facts, table=base, dim=in_d, start=start, out_dim=out_d, entry=i, problem=problem
    )


def _classify(n: fx.Node, facts: GraphFacts) -> PositionSource | None:
    seq, name = facts.seq, op_name(n)
    if _leaves_graph(n):
        return None  # a call of a nested graph: its body is searched on its own
    layer = _compat.node_module_path(n)
    length_values = _length_values(n, name, seq)
    if n in facts.data:
        if length_values:
            return PositionSource(n, "length", layer, facts, problem="the local sequence length used as a value")
        return None
    if name == "arange":
        return _arange_source(n, facts, layer)
    if name in ("getitem", "narrow", "select"):
        found = _slice_source(n, name, facts, layer)
        if found is not None or name != "getitem":
            return found
    if length_values:
        return PositionSource(n, "length", layer, facts, problem="the local sequence length used as a value")
    if seq.static and seq.chunk_len == 1:
        return None  # one token per rank: every broadcast dim has the chunk length; only aranges and slices count
    if not _has_seq(n, seq) or any(_has_seq(i, seq) for i in _value_inputs(n)):
        return None  # no sequence dim, or one it inherits from a value it reads (followed from that value)
    if name in _FACTORIES:
        return PositionSource(n, "factory", layer, facts)
    return PositionSource(n, "other", layer, facts, problem=f"a tensor of the local sequence length made by {name}")


def find_position_sources(gm: fx.GraphModule, seq: SequenceLength) -> list[PositionSource]:
    """Every position source of ``gm`` and of its nested graphs (e.g. checkpointed layers), in graph order.

    A source is a node that is not computed from sharded data and either gives a tensor a dim of the local
    length from values that have none (``arange(T)``, ``table[:T]``, ``ones(T)``) or uses the local length
    itself as a value (``x / T``, ``table[T - 1]``).
    """
    sources = []
    for g in graph_modules(gm):
        facts = graph_facts(g, seq)
        for n in g.graph.nodes:
            if n.op in ("call_function", "call_method") and n in facts.live and _is_tensorish(n):  # dead: no effect
                found = _classify(n, facts)
                if found is not None:
                    sources.append(found)
    return sources


# -- check -----------------------------------------------------------------------------------------------
def _norm_dims(dims: object, ndim: int) -> set[int] | None:
    """A dim argument as a set of non-negative dims; ``None`` for every dim."""
    if dims is None or dims == () or dims == []:
        return None
    if isinstance(dims, int):
        dims = (dims,)
    if not isinstance(dims, (tuple, list)) or not all(isinstance(d, int) for d in dims):
        return None
    return {d % ndim for d in dims} if ndim else set()


def _check_reduce(u: fx.Node, t: fx.Node, name: str, seq: SequenceLength) -> str | None:
    shape = _shape(t)
    if name in ("max", "min") and len(u.args) > 1 and isinstance(u.args[1], fx.Node) and _is_tensorish(u.args[1]):
        return None  # the element-wise form max(a, b)
    if u.args and u.args[0] is not t:
        return f"{name} takes the position-derived value as other than its input"
    pos, kw, default = _REDUCE[name]
    dims = _arg(u, 1 + pos, kw, default)
    reduced = _norm_dims(None if dims == _ALL else dims, len(shape)) if shape is not None else None
    seq_dims = set(_seq_dims(t, seq))
    if reduced is None and seq_dims or (reduced is not None and reduced & seq_dims):
        return f"{name} mixes the values of different positions along the sequence"
    return None


def _contracted_seq(a: object, da: int, seq: SequenceLength) -> bool:
    shape = _shape(a)
    return shape is not None and len(shape) > 0 and seq.involves(shape[da % len(shape)])


def _check_matmul(u: fx.Node, name: str, seq: SequenceLength) -> str | None:
    reason = f"{name} contracts the sequence dim of a position-derived value"
    if name == "einsum":
        eq, *operands = u.args
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = list(operands[0])
        parsed = _einsum_subscripts(eq, operands)
        if parsed is None:
            return f"einsum {eq!r} with a position-derived operand (its subscripts could not be read)"
        terms, out = parsed
        for term, op in zip(terms, operands):
            if any(c not in out and _contracted_seq(op, d, seq) for d, c in enumerate(term)):
                return reason
        return None
    a, b = u.args[0], u.args[1]
    if name == "linear":
        return reason if _contracted_seq(a, -1, seq) or _contracted_seq(b, -1, seq) else None
    b_shape = _shape(b)
    db = -2 if b_shape is not None and len(b_shape) >= 2 else 0
    return reason if _contracted_seq(a, -1, seq) or _contracted_seq(b, db, seq) else None


def _einsum_subscripts(eq: object, operands: list) -> tuple[list[str], str] | None:
    """An einsum equation as explicit subscripts, one letter per dim: ``(terms, output)``.

    ``...`` stands for the dims no letter names, right-aligned across operands as they broadcast; it becomes
    letters that the equation does not use (``'..., f -> ... f'`` on a ``[T]`` and an ``[F]`` operand reads
    ``'A,f->Af'``). Without ``->`` the output is the broadcast dims followed by the letters used once, in
    alphabetical order. ``None`` when the equation cannot be read (a non-string, a shape missing).
    """
    if not isinstance(eq, str):
        return None
    eq = eq.replace(" ", "")
    lhs, arrow, out = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(operands) or any(t.count("...") > 1 for t in (*terms, out)):
        return None
    spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in eq]
    widest = 0
    for i, (term, op) in enumerate(zip(terms, operands)):
        if "..." not in term:
            continue
        shape = _shape(op)
        if shape is None:
            return None
        k = len(shape) - (len(term) - 3)
        if k < 0 or k > len(spare):
            return None
        widest = max(widest, k)
        terms[i] = term.replace("...", "".join(spare[len(spare) - k :]))  # right-aligned broadcast dims
    broadcast = "".join(spare[len(spare) - widest :]) if widest else ""
    if not arrow:
        singles = sorted(c for c in set("".join(terms)) if "".join(terms).count(c) == 1 and c not in broadcast)
        out = broadcast + "".join(singles)
    else:
        out = out.replace("...", broadcast)
    if any("." in t for t in (*terms, out)):
        return None
    return terms, out


def _check_reshape(u: fx.Node, t: fx.Node, seq: SequenceLength) -> str | None:
    """A reshape keeps positions apart when every sequence dim keeps its size and the number of elements
    before it (so each position keeps its own elements)."""
    src, out = _shape(t), _shape(u)
    if src is None or out is None:
        return f"{op_name(u)} of a position-derived value has no recorded shape"
    ds, do = _seq_dims(t, seq), [d for d, s in enumerate(out) if seq.involves(s)]
    ok = len(ds) == len(do) and all(
        _compat.statically_true(src[a] == out[b]) and _compat.statically_true(math.prod(src[:a]) == math.prod(out[:b]))
        for a, b in zip(ds, do)
    )
    return None if ok else f"{op_name(u)} from {list(src)} to {list(out)} moves positions across the sequence dim"


def _check_getitem(u: fx.Node, t: fx.Node, facts: GraphFacts, tainted: set) -> str | None:
    seq, base, index = facts.seq, u.args[0], u.args[1]
    if isinstance(_val(base), (tuple, list)):
        return None  # one output of split/chunk
    entries = index if isinstance(index, tuple) else (index,)
    tensor_entries = [e for e in entries if isinstance(e, fx.Node) and _is_tensorish(e)]
    if any(e in tainted for e in tensor_entries):
        if base is t or base in facts.data or base in tainted:
            return "indexes sharded data (or positions) with position-derived indices"
        return None  # a table looked up at every position
    shape = _shape(base)
    if shape is None:
        return "indexing of a position-derived value without a recorded shape"
    consumed = sum(1 for e in entries if e is not None and e is not Ellipsis)
    d = 0
    for e in entries:
        if e is None:
            continue
        if e is Ellipsis:
            d += len(shape) - consumed
            continue
        if d < len(shape) and seq.involves(shape[d]):
            if not _is_full_slice(e, shape[d]):
                return f"indexes the sequence dim of a position-derived value with {e!r} (a shift or a selection)"
        if isinstance(e, fx.Node) and isinstance(_val(e), torch.Tensor) and _val(e).dtype == torch.bool:
            return "indexes a position-derived value with a boolean mask"
        d += 1
    return None


def _scalar(x: object) -> object:
    """An index or size argument's value: a node's recorded (possibly symbolic) value, else ``x``."""
    return _val(x) if isinstance(x, fx.Node) else x


def _is_zero(x: object) -> bool:
    """Whether an offset is 0, also when written as a symbolic difference (``k_len - q_len`` of one length)."""
    v = _scalar(x)
    return v is None or (isinstance(v, (int, torch.SymInt)) and _compat.statically_true(v == 0))


def _is_full_slice(e: object, size: object) -> bool:
    """Whether index entry ``e`` keeps every element of a dim of ``size`` in order (``:``, ``0:T``, ``:T``,
    ``k - q:k`` with ``k`` and ``q`` the same length, ``-T:`` of ``T`` rows)."""
    if not isinstance(e, slice) or _scalar(e.step) not in (None, 1):
        return False
    start, stop = _scalar(e.start), _scalar(e.stop)
    from_first = _is_zero(start) or (
        isinstance(start, (int, torch.SymInt)) and _compat.statically_true(start + size <= 0)
    )
    return from_first and (stop is None or _compat.statically_true(stop >= size))


def _is_full_narrow(n: fx.Node, size: object) -> bool:
    """Whether ``x.narrow(dim, start, length)`` keeps every element of the narrowed dim of ``size``."""
    start, length = _scalar(_arg(n, 2, "start")), _scalar(_arg(n, 3, "length"))
    return _is_zero(start) and length is not None and _compat.statically_true(length >= size)


def _check_repeat(u: fx.Node, t: fx.Node, name: str, seq: SequenceLength) -> str | None:
    """``repeat_interleave`` along a dim that is not the sequence; ``repeat`` by 1 along the sequence dims."""
    shape = _shape(t)
    if name == "repeat_interleave":
        dim = _arg(u, 2, "dim")
        if isinstance(dim, int) and dim % len(shape) not in _seq_dims(t, seq):
            return None
        return "repeat_interleave repeats positions along the sequence (or flattens it)"
    sizes = list(u.args[1:])
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = list(sizes[0])
    lead = len(sizes) - len(shape)
    if lead >= 0 and all(sizes[lead + d] == 1 for d in _seq_dims(t, seq)):
        return None
    return "repeat repeats positions along the sequence"


def _check_lookup(u: fx.Node, t: fx.Node, name: str, facts: GraphFacts, tainted: set) -> str | None:
    """``embedding``/``index_select``/``gather``: positions may index a table; a position-derived tensor may be
    indexed along a dim that is not the sequence."""
    seq = facts.seq
    if name == "embedding":
        tensors = [a for a in u.args[:2] if isinstance(a, fx.Node)]
        weight = next((a for a in tensors if isinstance(_val(a), torch.Tensor) and _val(a).is_floating_point()), None)
        index = next((a for a in tensors if a is not weight), None)
        if index is t and weight is not None and weight not in facts.data and weight not in tainted:
            return None
        return "embedding of position-derived weights or of sharded data"
    self_arg, dim = u.args[0], _arg(u, 1, "dim")
    index = _arg(u, 2, "index")
    if index is t and self_arg not in facts.data and self_arg not in tainted:
        if name == "index_select" or not _seq_dims(self_arg, seq):
            return None
    along = dim % len(_shape(t)) if isinstance(dim, int) else None
    if self_arg is t and index not in tainted and along is not None and along not in _seq_dims(t, seq):
        return None
    return f"{name} of a position-derived value along the sequence, or of sharded data at positions"


def _check_use(u: fx.Node, t: fx.Node, facts: GraphFacts, tainted: set) -> str | None:
    """``None`` when ``u`` keeps the values of different positions apart, else a one-line reason."""
    seq = facts.seq
    if _leaves_graph(u):
        return None  # handed on as a per-token tensor
    if _mask_args(u)[1]:
        return "is used as the query, key or value of the attention"
    name = op_name(u)
    written = mutated(u)
    if written is not None and written is not t:
        kept = viewed_bases(written)[-1]
        if kept.op in ("placeholder", "get_attr"):
            what = "a buffer or parameter" if _compat.is_module_state(kept) else "an input"
            return (
                f"{name} writes it in place into {kept.name}, {what} that outlives this call (a cache that "
                "later calls read): this rank would store rows for its own tokens where the cache expects rows "
                "0..T-1, and a later call could not tell them apart"
            )
    base = name.rstrip("_") if is_inplace(name) and name != "setitem" else name
    if base in _ELEMENTWISE or name in INPLACE_OPERATORS or base in _LAYOUT:
        return None
    if name in _RESHAPE:
        return _check_reshape(u, t, seq)
    if name == "getitem":
        return _check_getitem(u, t, facts, tainted)
    if name in ("embedding", "index_select", "gather", "take_along_dim"):
        return _check_lookup(u, t, name, facts, tainted)
    if name == "narrow" and u.args and u.args[0] is t:
        shape, dim = _shape(t), _arg(u, 1, "dim")
        if shape is None or not isinstance(dim, int):
            return "narrow of a position-derived value without a recorded shape or a constant dim"
        dim %= len(shape)
        if dim not in _seq_dims(t, seq) or _is_full_narrow(u, shape[dim]):
            return None
        return "narrow of the sequence dim of a position-derived value (a shift or a selection)"
    if name in _SPLITS:
        pos, kw, default = _SPLITS[name]
        dim = _arg(u, 1 + pos, kw, default)
        ok = isinstance(dim, int) and dim % len(_shape(t)) not in _seq_dims(t, seq)
        return None if ok else f"{name} splits a position-derived value along the sequence"
    if name in _CONCAT or name == "stack":
        dim = _arg(u, 1, "dim", 0)
        if name == "stack" or (isinstance(dim, int) and dim % len(_shape(u)) not in _seq_dims(u, seq)):
            return None
        return f"{name} joins position-derived values along the sequence"
    if name in _REDUCE:
        return _check_reduce(u, t, name, seq)
    if name in ("repeat", "repeat_interleave") and u.args and u.args[0] is t:
        return _check_repeat(u, t, name, seq)
    if name in _MATMUL:
        return _check_matmul(u, name, seq)
    return f"{name} is not known to keep the values of different positions apart"


#: Why an arange that only numbers this rank's own rows is left unchanged.
ROW_NUMBERS = (
    "it numbers this rank's own rows (token bookkeeping such as an MoE dispatch's inverse permutation), not positions"
)


def _indexes_rows_of(u: fx.Node, index: fx.Node, facts: GraphFacts, length: object) -> bool:
    """Whether ``u`` looks sharded data up at ``index`` along a dim of exactly ``length`` rows (all of them)."""
    name = op_name(u)
    if name == "getitem" and u.args[0] in facts.data:
        entries = u.args[1] if isinstance(u.args[1], tuple) else (u.args[1],)
        if entries and entries[0] is index and index not in entries[1:]:
            shape = _shape(u.args[0])
            return shape is not None and _compat.statically_true(shape[0] == length)
    if name == "index_select" and u.args[0] in facts.data and _arg(u, 2, "index") is index:
        shape, dim = _shape(u.args[0]), _arg(u, 1, "dim")
        return shape is not None and isinstance(dim, int) and _compat.statically_true(shape[dim] == length)
    return False


def _numbers_local_rows(src: PositionSource) -> bool:
    """Whether an ``arange``'s values only number the rows of this rank's own sharded data.

    Every use must be one of:

    * the value of ``target[index] = arange(n)`` where ``index`` is sharded data and ``target`` is a 1-d tensor of
      ``n`` elements used only to look sharded data up (``inv_perm[perm] = arange(perm.size(0))``, then
      ``x[inv_perm]``: transformers' MoE dispatch undoing its sort of tokens by expert);
    * the index of a lookup of all ``n`` rows of sharded data (``x[arange(n)]``, ``x.index_select(0, arange(n))``).

    Both only renumber the rank's own rows, so the local numbers are the right ones. Arithmetic on the numbers
    first (``arange(T) - 1``, a shift), a lookup of part of the rows or of a table, or any other use does not
    qualify.
    """
    node, facts = src.node, src.facts
    shape = _shape(node)
    if shape is None or len(shape) != 1 or not node.users:
        return False
    length = shape[0]
    for u in node.users:
        if _indexes_rows_of(u, node, facts, length):
            continue
        if u.op != "call_function" or u.target is not operator.setitem or len(u.args) != 3 or u.args[2] is not node:
            return False
        target, index = u.args[0], u.args[1]
        target_shape = _shape(target)
        if not (
            isinstance(index, fx.Node)
            and index in facts.data
            and target in facts.data
            and target_shape is not None
            and len(target_shape) == 1
            and _compat.statically_true(target_shape[0] == length)
        ):
            return False
        if not all(v is u or _indexes_rows_of(v, target, facts, length) for v in target.users):
            return False
    return True


def _handed_mask_reason(src: PositionSource) -> str:
    """Why a mask built from ``src`` and handed to another graph (the graph's output: a graph break, one graph
    per layer) cannot be proved (:func:`cpcompile.passes.mask_rules.prove_mask`), or ``""``. A mask used by an
    SDPA call of this graph or of a nested one is proved by the attention pass."""
    facts, seen, stack = src.facts, set(), [src.node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if u.op == "output" and _pairwise(n, facts.seq):
                proof = prove_mask(n, _shape(n)[-1])
                if proof.reason:
                    return f"it builds a mask handed to another graph: {proof.reason}"
            elif u in facts.mask_only and u in facts.live:
                stack.append(u)
    return ""


def check_source(src: PositionSource) -> PositionCheck:
    """What to do with ``src``: leave it to the mask, leave it unchanged, rewrite it, or refuse it (with why).

    The source's uses are followed forward through position computation (element-wise ops, layout and
    reshape ops that keep each position's elements together, lookups of a table at the positions, reductions
    and contractions over other dims) up to the ops where they meet sharded data or leave the graph; any other
    use, or a use that mixes positions along the sequence, refuses the source. Uses that only build attention
    masks are not followed.
    """
    facts = src.facts
    if src.node in facts.mask_only:
        reason = _handed_mask_reason(src)
        return PositionCheck("refuse", reason) if reason else PositionCheck("mask")
    if src.kind == "arange" and _numbers_local_rows(src):
        return PositionCheck("unchanged", ROW_NUMBERS)
    if src.kind in ("length", "other") or src.problem:
        return PositionCheck("refuse", f"it is {src.problem or 'a value of unknown form'}")
    tainted, queue = {src.node}, [src.node]
    while queue:
        t = queue.pop(0)
        for u in t.users:
            if u not in facts.live or u in facts.mask_only or (t not in _value_inputs(u) and not _leaves_graph(u)):
                continue
            reason = _check_use(u, t, facts, tainted)
            if reason is not None:
                where = f"{_compat.node_module_path(u) or '<top level>'} (node {u.name})"
                line = source_line(u)
                return PositionCheck("refuse", f"its use at {line + ', ' if line else ''}{where}: {reason}")
            if u not in facts.data and not _leaves_graph(u) and u not in tainted:
                tainted.add(u)
                queue.append(u)
    return PositionCheck("unchanged" if src.kind == "factory" else "rewrite")


# -- rewrite ---------------------------------------------------------------------------------------------
def _copy_meta(new: fx.Node, old: fx.Node) -> None:
    for key in ("nn_module_stack", "stack_trace"):
        if key in old.meta:
            new.meta[key] = old.meta[key]


def rewrite_source(src: PositionSource, site: str) -> fx.Node:
    """Replace ``src`` by its value at the global positions of this rank's tokens; return the new node.

    ``arange``::

        p = arange(start, start + T * step, step)          # T: the local length
        ->  idx = cpcompile.token_positions(p, -1, site)    # global index of every local token (plan, run time)
            p' = (start + step * idx).to(p.dtype)

    ``table_slice`` / ``narrow`` (``dim``: the sliced dim of the table)::

        rows = table[..., a:a + T, ...]                     # or table.narrow(dim, a, T)
        ->  idx = cpcompile.token_positions(rows, table.shape[dim] - a, site)
            rows' = table.index_select(dim, a + idx)[...]   # the slice's other index entries kept

    ``token_positions`` raises ``ValueError`` at run time when the table has fewer rows (from ``a``) than the
    global sequence. The original node stays in the graph as the op's size reference.
    """
    node, graph = src.node, src.node.graph
    before = set(graph.nodes)
    with graph.inserting_before(node.next):  # in order, right after the source
        if src.kind == "arange":
            idx = ops.emit_token_positions(graph, node, -1, site)
            new = idx
            if not (isinstance(src.step, int) and src.step == 1):
                new = graph.call_function(operator.mul, (new, src.step))
            if not (isinstance(src.start, int) and src.start == 0):
                new = graph.call_function(operator.add, (new, src.start))
            dtype = _val(node).dtype
            if dtype != torch.long or new is not idx:
                new = graph.call_method("to", (new,), {"dtype": dtype})
        else:
            like = node if src.out_dim == 0 else graph.call_method("movedim", (node, src.out_dim, 0))
            rows = _shape(src.table)[src.dim] - src.start
            idx = ops.emit_token_positions(graph, like, rows, site)
            if src.start:
                idx = graph.call_function(operator.add, (idx, src.start))
            new = graph.call_method("index_select", (src.table, src.dim, idx))
            if src.kind == "table_slice" and isinstance(node.args[1], tuple):
                kept = tuple(slice(None) if i == src.entry else e for i, e in enumerate(node.args[1]))
                new = graph.call_function(operator.getitem, (new, kept))
    created = set(graph.nodes) - before
    node.replace_all_uses_with(new, delete_user_cb=lambda user: user not in created)
    for n in created:
        _copy_meta(n, node)
    return new


# -- entry point -----------------------------------------------------------------------------------------
def _static_reason(seq: SequenceLength) -> str:
    return (
        f"the graph has a static sequence length ({seq.chunk_len} tokens per rank: cpcompile.shard(..., "
        "dynamic=False), a graph break, or one graph per layer under FSDP2 compile with concrete sizes first), so "
        f"a size of {seq.chunk_len} here cannot be told apart from a constant of the same value"
    )


#: Added to the fix of a refusal in a static graph.
STATIC_FIX = (
    "; or compile the model in one graph and call it under cpcompile.shard with its default dynamic=True, so "
    "that the local length is a symbol"
)


def _refusal(src: PositionSource, reason: str, static: bool) -> UnsupportedPositionError:
    return UnsupportedPositionError(
        f"cpcompile cannot make the positions computed at {src.located} ({src.kind}) global across CP ranks: "
        f"{reason}. Fix: {'' if static else _fix_for(reason)}{FIX}{STATIC_FIX if static else ''}"
    )


def positions_pass(gm: fx.GraphModule, ctx: PassContext, chunk_len: int | None) -> list[PositionReport]:
    """Find, check and rewrite every position source of ``gm`` in place; return one report per source.

    ``chunk_len`` is the active plan's chunk length (identifies the length's symbol; in a static graph, the
    sizes that stand for it). ``ctx.refuse == "raise"`` raises :class:`UnsupportedPositionError` for the first
    source that cannot be made exact, before rewriting anything; ``"report"`` only records it (inspection,
    never for running). In a static graph (no symbol for the length) a source that would be rewritten is
    refused instead, since its size may be a constant that merely equals the chunk length; with ``"report"``
    it is rewritten as a dynamic graph would be, and the report says it was found by its size.
    """
    refuse, graph_id, site_prefix = ctx.refuse, ctx.graph_id, ctx.site_prefix
    seq = sequence_length(gm, chunk_len)
    if seq is None:
        return []
    sources = find_position_sources(gm, seq)
    counters["position_sources_found"] += len(sources)
    decided: list[tuple[PositionSource, PositionCheck]] = []
    for src in sources:
        check = check_source(src)
        if check.action == "rewrite" and seq.static:
            if refuse == "raise":
                check = PositionCheck("refuse", _static_reason(seq), static=True)
            else:
                check = PositionCheck("rewrite", f"found by its size ({seq.chunk_len}) in a static trace")
        decided.append((src, check))
    refused = [(src, check) for src, check in decided if check.action == "refuse"]
    counters["position_sources_refused"] += len(refused)
    if refused and refuse == "raise":  # before anything is rewritten: the graph is left as it was
        src, check = refused[0]
        raise _refusal(src, check.reason, check.static)
    reports, done = [], Counter()
    for src, check in decided:
        action, reason = check.action, check.reason
        if action == "rewrite":
            try:
                rewrite_source(src, f"{site_prefix}:{src.where}")
            except Exception as e:  # noqa: BLE001 - re-raised with the pass's name
                raise RuntimeError(f"cpcompile positions pass failed while rewriting {src.where}: {e}") from e
        action = {"rewrite": "rewritten", "refuse": "refused"}.get(action, action)
        if action != "refused":
            counters[f"position_sources_{action}"] += 1
        done[action] += 1
        reports.append(PositionReport(graph_id, src.node.name, src.layer, src.kind, action, reason))
    if done["rewritten"]:
        finish(gm)
    return reports
