"""The rule for each op a position-derived value meets: :func:`check_use` says whether a use keeps the values of
different positions apart (element-wise, layout and reshape ops that keep each position's elements together,
lookups of a table at the positions, reductions, splits, joins and products along other dims), by the op tables
of :mod:`cpcompile.passes.vocabulary`, and if not, why.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from cpcompile import _compat
from cpcompile.passes import vocabulary as vocab
from cpcompile.passes.aliasing import INPLACE_OPERATORS, is_inplace, mutated, op_name, viewed_bases
from cpcompile.passes.common import arg as _arg
from cpcompile.passes.common import dim_set, index_dims
from cpcompile.passes.common import node_value as _val
from cpcompile.passes.positions.graph import (
    is_tensorish,
    is_zero,
    leaves_graph,
    mask_args,
    scalar_value,
    seq_dims,
    shape_of,
)
from cpcompile.passes.positions.model import GraphFacts, SequenceLength


def _check_reduce(u: fx.Node, t: fx.Node, name: str, seq: SequenceLength) -> str | None:
    shape = shape_of(t)
    if name in ("max", "min") and len(u.args) > 1 and isinstance(u.args[1], fx.Node) and is_tensorish(u.args[1]):
        return None  # the element-wise form max(a, b)
    if u.args and u.args[0] is not t:
        return f"{name} takes the position-derived value as other than its input"
    pos, kw, default = vocab.POSITION_REDUCTIONS[name]
    dims = _arg(u, 1 + pos, kw, default)
    reduced = dim_set(dims, len(shape)) if shape is not None else None
    along = set(seq_dims(t, seq))
    if reduced is None and along or (reduced is not None and reduced & along):
        return f"{name} mixes the values of different positions along the sequence"
    return None


def _contracted_seq(a: object, da: int, seq: SequenceLength) -> bool:
    shape = shape_of(a)
    return shape is not None and len(shape) > 0 and seq.involves(shape[da % len(shape)])


def _check_matmul(u: fx.Node, name: str, seq: SequenceLength) -> str | None:
    reason = f"{name} contracts the sequence dim of a position-derived value"
    if name == "einsum":
        eq, *operands = u.args
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = list(operands[0])
        parsed = vocab.einsum_subscripts(eq, [_rank(op) for op in operands])
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
    b_shape = shape_of(b)
    db = -2 if b_shape is not None and len(b_shape) >= 2 else 0
    return reason if _contracted_seq(a, -1, seq) or _contracted_seq(b, db, seq) else None


def _rank(x: object) -> int | None:
    shape = shape_of(x)
    return None if shape is None else len(shape)


def _check_reshape(u: fx.Node, t: fx.Node, seq: SequenceLength) -> str | None:
    """A reshape keeps positions apart when every sequence dim keeps its size and the number of elements
    before it (so each position keeps its own elements)."""
    src, out = shape_of(t), shape_of(u)
    if src is None or out is None:
        return f"{op_name(u)} of a position-derived value has no recorded shape"
    ds, do = seq_dims(t, seq), [d for d, s in enumerate(out) if seq.involves(s)]
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
    tensor_entries = [e for e in entries if isinstance(e, fx.Node) and is_tensorish(e)]
    if any(e in tainted for e in tensor_entries):
        if base is t or base in facts.data or base in tainted:
            return "indexes sharded data (or positions) with position-derived indices"
        return None  # a table looked up at every position
    shape = shape_of(base)
    if shape is None:
        return "indexing of a position-derived value without a recorded shape"
    for e, _, d, _ in index_dims(entries, len(shape)):
        if e is None or e is Ellipsis:
            continue
        if d < len(shape) and seq.involves(shape[d]):
            if not _is_full_slice(e, shape[d]):
                return f"indexes the sequence dim of a position-derived value with {e!r} (a shift or a selection)"
        if isinstance(e, fx.Node) and isinstance(_val(e), torch.Tensor) and _val(e).dtype == torch.bool:
            return "indexes a position-derived value with a boolean mask"
    return None


def _is_full_slice(e: object, size: object) -> bool:
    """Whether index entry ``e`` keeps every element of a dim of ``size`` in order (``:``, ``0:T``, ``:T``,
    ``k - q:k`` with ``k`` and ``q`` the same length, ``-T:`` of ``T`` rows)."""
    if not isinstance(e, slice) or scalar_value(e.step) not in (None, 1):
        return False
    start, stop = scalar_value(e.start), scalar_value(e.stop)
    from_first = is_zero(start) or (
        isinstance(start, (int, torch.SymInt)) and _compat.statically_true(start + size <= 0)
    )
    return from_first and (stop is None or _compat.statically_true(stop >= size))


def _is_full_narrow(n: fx.Node, size: object) -> bool:
    """Whether ``x.narrow(dim, start, length)`` keeps every element of the narrowed dim of ``size``."""
    start, length = scalar_value(_arg(n, 2, "start")), scalar_value(_arg(n, 3, "length"))
    return is_zero(start) and length is not None and _compat.statically_true(length >= size)


def _check_repeat(u: fx.Node, t: fx.Node, name: str, seq: SequenceLength) -> str | None:
    """``repeat_interleave`` along a dim that is not the sequence; ``repeat`` by 1 along the sequence dims."""
    shape = shape_of(t)
    if name == "repeat_interleave":
        dim = _arg(u, 2, "dim")
        if isinstance(dim, int) and dim % len(shape) not in seq_dims(t, seq):
            return None
        return "repeat_interleave repeats positions along the sequence (or flattens it)"
    sizes = list(u.args[1:])
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = list(sizes[0])
    lead = len(sizes) - len(shape)
    if lead >= 0 and all(sizes[lead + d] == 1 for d in seq_dims(t, seq)):
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
        if name == "index_select" or not seq_dims(self_arg, seq):
            return None
    along = dim % len(shape_of(t)) if isinstance(dim, int) else None
    if self_arg is t and index not in tainted and along is not None and along not in seq_dims(t, seq):
        return None
    return f"{name} of a position-derived value along the sequence, or of sharded data at positions"


def check_use(u: fx.Node, t: fx.Node, facts: GraphFacts, tainted: set) -> str | None:
    """``None`` when ``u`` keeps the values of different positions apart, else a one-line reason."""
    seq = facts.seq
    if leaves_graph(u):
        return None  # handed on as a per-token tensor
    if mask_args(u)[1]:
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
    if base in vocab.POSITION_ELEMENTWISE or name in INPLACE_OPERATORS or base in vocab.POSITION_LAYOUT:
        return None
    if name in vocab.POSITION_RESHAPE:
        return _check_reshape(u, t, seq)
    if name == "getitem":
        return _check_getitem(u, t, facts, tainted)
    if name in ("embedding", "index_select", "gather", "take_along_dim"):
        return _check_lookup(u, t, name, facts, tainted)
    if base in vocab.ROW_WRITES or vocab.op_name(u) in vocab.ROW_MOVE_OPS:
        _, self_arg, _, index, src = vocab.row_move_args(u)
        if self_arg is t and index not in tainted and src not in tainted:
            return None  # rows written into it at rows an index gives (an MoE combine): its own elements stay put
        return f"{name} moves position-derived rows, or writes rows at positions"
    if name == "narrow" and u.args and u.args[0] is t:
        shape, dim = shape_of(t), _arg(u, 1, "dim")
        if shape is None or not isinstance(dim, int):
            return "narrow of a position-derived value without a recorded shape or a constant dim"
        dim %= len(shape)
        if dim not in seq_dims(t, seq) or _is_full_narrow(u, shape[dim]):
            return None
        return "narrow of the sequence dim of a position-derived value (a shift or a selection)"
    if name in vocab.SPLITS:
        pos, kw, default = vocab.SPLITS[name]
        dim = _arg(u, 1 + pos, kw, default)
        ok = isinstance(dim, int) and dim % len(shape_of(t)) not in seq_dims(t, seq)
        return None if ok else f"{name} splits a position-derived value along the sequence"
    if name in vocab.CONCATS or name == "stack":
        dim = _arg(u, 1, "dim", 0)
        if name == "stack" or (isinstance(dim, int) and dim % len(shape_of(u)) not in seq_dims(u, seq)):
            return None
        return f"{name} joins position-derived values along the sequence"
    if name in vocab.POSITION_REDUCTIONS:
        return _check_reduce(u, t, name, seq)
    if name in ("repeat", "repeat_interleave") and u.args and u.args[0] is t:
        return _check_repeat(u, t, name, seq)
    if name in vocab.POSITION_CONTRACTIONS:
        return _check_matmul(u, name, seq)
    return f"{name} is not known to keep the values of different positions apart"
