"""Which dims of every tensor of a Dynamo graph hold the sharded sequence: the map the mixing pass reads.

Main API: :func:`sequence_dims` (per node, one bool per dim), with :func:`shape_of`, :func:`size_hint` and
:func:`is_nested`. The sequence dim is followed from the graph's inputs (the dims of the local length ``shard``
marks dynamic; in a static graph, dim 1 of ``shard``'s ``[B, T, ...]`` tensors) through reshapes that split or
merge it, transposes, element-wise ops, slices and pads, concatenations and einsums; in a dynamic graph every size
that involves the length's symbol is a sequence dim too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import sympy
import torch
import torch.fx as fx

from cpcompile import _compat
from cpcompile.passes import vocabulary as vocab
from cpcompile.passes.common import arg, index_dims, node_value, shape_of, size_hint
from cpcompile.passes.positions import SequenceLength

__all__ = ["Tags", "is_nested", "sequence_dims", "shape_of", "size_hint"]

Tags = tuple  # per dim: True where the dim holds (part of) the sharded sequence


def _val(n: object) -> object:
    return node_value(n)


def _expr(size: object) -> object:
    return sympy.Integer(size) if isinstance(size, int) else _compat.sym_expr(size)


def _size_is_seq(size: object, seq: SequenceLength) -> bool:
    """Whether a size alone says its dim holds the sequence: it involves the length's symbol. A constant size
    never says so (a hidden size may equal the chunk length): dims are followed from the inputs instead."""
    return bool(seq.symbols) and bool(_compat.free_symbols(size) & seq.symbols)


def _involved(shape: tuple, seq: SequenceLength) -> Tags:
    return tuple(_size_is_seq(s, seq) for s in shape)


def _input_tags(shape: tuple, seq: SequenceLength) -> Tags:
    """Tags of a graph input: the dims of the local length; in a static graph the sequence dim ``shard`` gives
    ``[B, T, ...]`` tensors (dim 1) when it has the chunk length, else the first dim that has it."""
    tags = _involved(shape, seq)
    if any(tags) or not seq.by_size:
        return tags
    dims = [d for d, size in enumerate(shape) if seq.involves(size)]
    pick = 1 if 1 in dims else (dims[0] if dims else None)
    return tuple(d == pick for d in range(len(shape)))


def _same_size(a: object, b: object) -> bool:
    return a == b if isinstance(a, int) and isinstance(b, int) else _compat.statically_true(a == b)


#: Values given to a ratio's free symbols to show that it varies (:func:`_depends_on_length`).
_PROBES = (3, 17, 64, 130)


def _depends_on_length(ratio) -> bool:
    """Whether a ratio of sizes still has a free symbol once simplified. ``sympy.simplify`` is slow on the sizes a
    padded length gives (``Mod``, ``FloorDiv``), so a ratio that takes two different values at the probe lengths
    depends on them without it; ``sympy.cancel`` and then ``simplify`` decide the others."""
    ratio = sympy.cancel(ratio)
    symbols = ratio.free_symbols
    if not symbols:
        return False
    values = set()
    for probe in _PROBES:
        try:
            value = ratio.subs({s: probe for s in symbols})
        except (ZeroDivisionError, TypeError, ValueError):
            continue
        if value.is_number and value.is_finite:
            values.add(value)
        if len(values) > 1:
            return True
    return bool(sympy.simplify(ratio).free_symbols)


def _reshape_tags(src: tuple, tags: Tags, out: tuple, seq: SequenceLength) -> Tags:
    """Tags of a reshape's output: dims are grouped by equal element counts; in a group holding a sequence dim,
    an output dim is a sequence dim when its size involves the local length, and a piece of constant size is
    one when the sequence was divided into it (``[T] -> [T // 64, 64]``: chunks of the sequence), not when the
    group multiplied the length by a constant (``[k * T] -> [T, k]``: top-k slots of every token). In a static
    graph, by sizes: the pieces that hold whole multiples of the chunk length, else every piece."""
    a, b = [size_hint(s) for s in src], [size_hint(s) for s in out]
    if -1 in a or -1 in b or math.prod(a) != math.prod(b):
        return _involved(out, seq)
    res = [False] * len(out)
    i = j = 0
    while i < len(a) or j < len(b):
        if j < len(b) and b[j] == 1 and (i >= len(a) or a[i] != 1):
            j += 1  # a new dim of size 1 holds no tokens
            continue
        if i < len(a) and a[i] == 1 and (j >= len(b) or b[j] != 1):
            i += 1
            continue
        if i >= len(a) or j >= len(b):
            return _involved(out, seq)
        gi, gj, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                pa, i = pa * a[i], i + 1
                gi.append(i - 1)
            elif pb < pa and j < len(b):
                pb, j = pb * b[j], j + 1
                gj.append(j - 1)
            else:
                return _involved(out, seq)
        if not any(tags[k] for k in gi):
            continue
        if not any(_size_is_seq(src[k], seq) for k in gi):  # constant sizes (a static graph, or a mixed
            # graph's constant-length tensor): the pieces holding whole multiples of the chunk, else all
            whole = [k for k in gj if seq.chunk_len and b[k] % seq.chunk_len == 0]
            for k in gj:
                res[k] = b[k] != 1 and (k in whole or not whole)
            continue
        symbolic = [k for k in gj if _size_is_seq(out[k], seq)]
        pieces_are_seq = not symbolic or _depends_on_length(
            math.prod(_expr(src[k]) for k in gi) / math.prod(_expr(out[k]) for k in symbolic)
        )
        for k in gj:
            res[k] = k in symbolic or (pieces_are_seq and b[k] != 1)
    return tuple(res)


def _layout_tags(n: fx.Node, name: str, tags: Tags, out: tuple, seq: SequenceLength) -> Tags | None:
    ndim = len(tags)
    if name in ("transpose", "swapaxes", "swapdims"):
        d0, d1 = (arg(n, 1, "dim0") % ndim, arg(n, 2, "dim1") % ndim) if ndim else (0, 0)
        t = list(tags)
        t[d0], t[d1] = t[d1], t[d0]
        return tuple(t)
    if name == "t":
        return tuple(reversed(tags))
    if name == "permute":
        dims = n.args[1:] if not isinstance(n.args[1], (tuple, list)) else n.args[1]
        return tuple(tags[d % ndim] for d in dims)
    if name in ("movedim", "moveaxis") and isinstance(n.args[1], int) and isinstance(n.args[2], int):
        t = list(tags)
        t.insert(n.args[2] % ndim, t.pop(n.args[1] % ndim))
        return tuple(t)
    if name == "squeeze":  # only dims of size 1 go: a sequence dim after them keeps its tag
        shape = shape_of(n.args[0])
        dims = n.args[1:] if len(n.args) > 1 else tuple(v for k, v in n.kwargs.items() if k == "dim")
        dims = tuple(dims[0]) if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else tuple(dims)
        if shape is None or not all(isinstance(d, int) for d in dims):
            return None
        picked = range(ndim) if not dims else {d % ndim for d in dims}
        gone = {d for d in picked if size_hint(shape[d]) == 1}
        return tuple(t for d, t in enumerate(tags) if d not in gone)
    if name == "unsqueeze":
        d = arg(n, 1, "dim")
        t = list(tags)
        t.insert(d % (ndim + 1), False)
        return tuple(t)
    if len(out) >= ndim:  # casts, copies, expand (new leading dims)
        lead = len(out) - ndim
        return tuple(False for _ in range(lead)) + tuple(
            t or _size_is_seq(s, seq) for t, s in zip(tags, out[lead:], strict=True)
        )
    return None


def _vmap_tags(n: fx.Node, name: str, first_tags: Tags, tags: dict) -> Tags:
    """Tags through ``vmap``'s batch dims (traced from torch's own scans): ``_add_batch_dim(x, dim, level)`` hides
    ``dim`` from the ops inside, and ``_remove_batch_dim(x, level, size, dim)`` puts the dims of that level back at
    ``dim``, holding the sequence when a dim the level hid did (kept in ``tags`` under ``("vmap", level)``)."""
    if name == "_add_batch_dim":
        dim, level = arg(n, 1, "dim") % len(first_tags), arg(n, 2, "level")
        tags[("vmap", level)] = tags.get(("vmap", level), False) or first_tags[dim]
        return first_tags[:dim] + first_tags[dim + 1 :]
    level, dim = arg(n, 1, "level"), arg(n, 3, "out_dim")
    t = list(first_tags)
    t.insert(dim % (len(t) + 1), tags.get(("vmap", level), False))
    return tuple(t)


def _joined_tags(n: fx.Node, name: str, out: tuple, tags: dict, seq: SequenceLength) -> Tags | None:
    """Tags of ``cat(tensors, dim)`` (every dim a dim of each input: where any of them holds the sequence) and
    ``stack(tensors, dim)`` (the same, with the new dim holding none); ``None`` when an input's dims are unknown."""
    tensors = arg(n, 0, "tensors")
    if not isinstance(tensors, (tuple, list)) or not tensors:
        return None
    ndim = len(out) - (name == "stack")
    joined = list(_involved(out, seq)) if name != "stack" else [False] * ndim
    for t in tensors:
        t_tags = tags.get(t) if isinstance(t, fx.Node) else None
        if t_tags is None and isinstance(_val(t), torch.Tensor) and t not in tags:
            continue  # outside the nodes followed (``sequence_dims``' ``nodes``): holds none of it
        if not isinstance(t_tags, tuple) or is_nested(t_tags) or len(t_tags) != ndim:
            return None
        joined = [a or b for a, b in zip(joined, t_tags, strict=True)]
    if name == "stack":
        dim = arg(n, 1, "dim", 0) % len(out)
        joined.insert(dim, False)
        joined = [a or b for a, b in zip(joined, _involved(out, seq), strict=True)]
    return tuple(joined)


def _einsum_tags(n: fx.Node, out: tuple, tags: dict, seq: SequenceLength) -> Tags | None:
    """Tags of an ``einsum``'s output: each output letter's dim holds the sequence where a dim of that letter of an
    operand does (:func:`~cpcompile.passes.vocabulary.einsum_subscripts`); ``None`` when the equation cannot be
    read."""
    eq, *operands = n.args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    parsed = vocab.einsum_subscripts(eq, [len(shape_of(o)) if shape_of(o) is not None else None for o in operands])
    if parsed is None or len(parsed[1]) != len(out):
        return None
    terms, letters = parsed
    held = set()
    for term, o in zip(terms, operands, strict=True):
        t = tags.get(o) if isinstance(o, fx.Node) else None
        if isinstance(t, tuple) and not is_nested(t) and len(t) == len(term):
            held.update(c for c, tagged in zip(term, t, strict=True) if tagged)
    return tuple(c in held or s for c, s in zip(letters, _involved(out, seq), strict=True))


def _getitem_tags(n: fx.Node, base_tags: Tags, out: tuple, seq: SequenceLength, tags: dict) -> Tags:
    index = n.args[1]
    entries = index if isinstance(index, tuple) else (index,)
    if len(entries) == 1 and isinstance(entries[0], fx.Node) and isinstance(_val(entries[0]), torch.Tensor):
        index_tags = tags.get(entries[0])  # rows picked by an index tensor: its dims, then the rows' dims
        if isinstance(index_tags, tuple) and not is_nested(index_tags) and _val(entries[0]).dtype != torch.bool:
            got = tuple(t or (d == 0 and bool(base_tags) and base_tags[0]) for d, t in enumerate(index_tags))
            got += base_tags[1:]
            if len(got) == len(out):
                return tuple(g or s for g, s in zip(got, _involved(out, seq), strict=True))
    if any(isinstance(e, fx.Node) and isinstance(_val(e), torch.Tensor) for e in entries) or any(
        isinstance(e, (list, torch.Tensor)) for e in entries
    ):
        return _involved(out, seq)
    res = [
        base_tags[d] if d is not None and d < len(base_tags) else False
        for _, _, d, o in index_dims(entries, len(base_tags))
        if o is not None
    ]
    return tuple(res) if len(res) == len(out) else _involved(out, seq)


def sequence_dims(
    g: fx.GraphModule,
    seq: SequenceLength,
    seeds: dict[fx.Node, Tags] | None = None,
    nodes: Iterable[fx.Node] | None = None,
) -> dict[fx.Node, object]:
    """For every node of ``g`` with a tensor value: a tuple telling for each dim whether it holds the sequence
    (a tuple of such tuples for ops returning several tensors, e.g. ``chunk``).

    ``seeds`` and ``nodes`` follow another dim by the same rules: the nodes of ``seeds`` hold it where their tags
    say, and only ``nodes`` (in graph order) are tagged, from their inputs among them (inputs outside hold none of
    it). With a :class:`SequenceLength` without symbols and without a chunk length no size says a dim holds it:
    the head-parallel regions' proof (:func:`cpcompile.passes.mixing.find._head_map_refusals`) follows the head
    dim of ``cpcompile::heads_from_sequence`` outputs this way."""
    seeds = seeds or {}
    tags: dict[fx.Node, object] = {}
    for n in g.graph.nodes if nodes is None else nodes:
        if n in seeds:
            tags[n] = seeds[n]
            continue
        v = _val(n)
        if isinstance(v, (tuple, list)):
            base = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
            base_tags = tags.get(base)
            if n.op in ("call_function", "call_method") and vocab.op_name(n) == "unbind":
                dim = arg(n, 1, "dim", 0)
                if isinstance(base_tags, tuple) and not is_nested(base_tags) and isinstance(dim, int):
                    base_tags = tuple(t for d, t in enumerate(base_tags) if d != dim % len(base_tags))
            out = []
            for x in v:
                if not isinstance(x, torch.Tensor):
                    out.append(None)
                elif isinstance(base_tags, tuple) and len(base_tags) == x.dim() and not is_nested(base_tags):
                    out.append(tuple(t or _size_is_seq(s, seq) for t, s in zip(base_tags, x.shape, strict=True)))
                else:
                    out.append(_involved(tuple(x.shape), seq))
            tags[n] = tuple(out)
            continue
        if not isinstance(v, torch.Tensor):
            continue
        out = tuple(v.shape)
        tags[n] = _node_tags(n, out, tags, seq)
    return tags


#: Matrix products whose first argument is a bias and whose leading dims are those of the next (the first factor).
_BIAS_FIRST = frozenset({"addmm", "baddbmm"})


def is_nested(t: object) -> bool:
    """Whether ``t`` is the tags of an op returning several tensors (a tuple of tags)."""
    return isinstance(t, tuple) and any(isinstance(x, tuple) or x is None for x in t)


def _node_tags(n: fx.Node, out: tuple, tags: dict, seq: SequenceLength) -> Tags:
    if n.op == "get_attr" or (n.op == "placeholder" and _compat.is_module_state(n)):
        return _involved(out, seq)  # parameters and buffers hold no tokens
    if n.op == "placeholder":
        return _input_tags(out, seq)
    name = vocab.op_name(n)
    first = n.args[0] if n.args else None
    first_tags = tags.get(first) if isinstance(first, fx.Node) else None
    if name == "getitem" and isinstance(first_tags, tuple) and is_nested(first_tags) and isinstance(n.args[1], int):
        got = first_tags[n.args[1]]
        return got if isinstance(got, tuple) and len(got) == len(out) else _involved(out, seq)
    if name in vocab.CONCATS or name == "stack":
        got = _joined_tags(n, name, out, tags, seq)
        if got is not None:
            return got
    if name == "einsum":
        got = _einsum_tags(n, out, tags, seq)
        if got is not None:
            return got
    if not isinstance(first_tags, tuple) or is_nested(first_tags):
        first_tags = None
    if first_tags is not None:
        if name in vocab.RESHAPE:
            return _reshape_tags(shape_of(first), first_tags, out, seq)
        if name == "getitem":
            return _getitem_tags(n, first_tags, out, seq, tags)
        if name in ("narrow", "slice", "pad") and len(first_tags) == len(out):  # every dim where it was
            return tuple(t or s for t, s in zip(first_tags, _involved(out, seq), strict=True))
        if name in vocab.CONVOLUTIONS and len(first_tags) == len(out):  # batch and spatial dims where they were
            kept = (first_tags[0], False, *first_tags[2:])
            return tuple(t or s for t, s in zip(kept, _involved(out, seq), strict=True))
        if name in vocab.VMAP_DIMS:
            got = _vmap_tags(n, name, first_tags, tags)
            if len(got) == len(out):
                return got
        if name in vocab.LAYOUT:
            got = _layout_tags(n, name, first_tags, out, seq)
            if got is not None and len(got) == len(out):
                return got
    # every op: dims whose size involves the local length; the leading dims it keeps from its first input keep
    # their tags (a linear keeps [B, T], a scan of sequence chunks keeps them all; ``addmm`` and ``baddbmm`` keep
    # those of their first factor, after the bias); element-wise ops broadcast their inputs' tags (right-aligned)
    res = list(_involved(out, seq))
    if name in _BIAS_FIRST and len(n.args) > 1 and isinstance(n.args[1], fx.Node):
        first = n.args[1]
        first_tags = tags.get(first)
        first_tags = first_tags if isinstance(first_tags, tuple) and not is_nested(first_tags) else None
    first_shape = shape_of(first)
    if first_tags is not None and first_shape is not None:
        for d in range(min(len(first_shape), len(out))):
            if not _same_size(first_shape[d], out[d]):
                break
            res[d] = res[d] or first_tags[d]
    if name not in vocab.ELEMENTWISE:
        return tuple(res)
    for i in n.all_input_nodes:
        t = tags.get(i)
        if not isinstance(t, tuple) or is_nested(t) or len(t) > len(out):
            continue
        shape = shape_of(i)
        lead = len(out) - len(t)
        for d, tagged in enumerate(t):
            if tagged and shape is not None and _same_size(shape[d], out[lead + d]):
                res[lead + d] = True
    return tuple(res)
