"""find: the position sources of a graph (:func:`find_position_sources`), each a :class:`PositionSource` typed
by how it derives from the local length (an ``arange``, a slice or ``narrow`` of a table, a factory, the length
used as a value, another op) and carrying what :func:`~cpcompile.passes.positions.rewrite_source` needs.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from cpcompile import _compat, cores
from cpcompile.passes import vocabulary as vocab
from cpcompile.passes.aliasing import op_name
from cpcompile.passes.common import arg as _arg
from cpcompile.passes.common import graph_modules
from cpcompile.passes.common import node_value as _val
from cpcompile.passes.positions.facts import graph_facts
from cpcompile.passes.positions.graph import (
    has_seq,
    is_seq_scalar,
    is_tensorish,
    is_zero,
    leaves_graph,
    shape_of,
    value_inputs,
)
from cpcompile.passes.positions.model import GraphFacts, PositionSource, SequenceLength


def _flat_args(n: fx.Node) -> list[tuple[object, fx.Node]]:
    """``(position or keyword, node)`` of every node among ``n``'s arguments, nested containers included."""
    out = []
    for key, arg in [*enumerate(n.args), *n.kwargs.items()]:
        fx.node.map_arg(arg, lambda a, key=key: out.append((key, a)))
    return out


def _length_values(n: fx.Node, name: str, seq: SequenceLength) -> list[fx.Node]:
    """Arguments of ``n`` that are the local length (or computed from it) used as a value, not as a size."""
    found = [(key, a) for key, a in _flat_args(n) if is_seq_scalar(a, seq)]
    if not found or name in ("arange", "getitem", "narrow", "select"):
        return []  # these are classified by what they produce
    if name in vocab.SIZE_ARGS:
        fill = vocab.FILL_ARGS.get(name)
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
    shape = shape_of(n)
    length = shape[0] if shape else None
    scalars = [a for a in (start, end, step) if isinstance(a, fx.Node)]
    if length is None or not seq.involves(length):
        if any(is_seq_scalar(a, seq) for a in scalars):
            return PositionSource(n, "length", layer, facts, problem="a range offset by the local sequence length")
        return None
    problem = ""
    if not seq.is_length(length):
        problem = f"an arange of {length} elements, not of the local sequence length"
    elif any(is_seq_scalar(a, seq) for a in (start, step) if isinstance(a, fx.Node)):
        problem = "an arange whose start or step is computed from the local sequence length"
    return PositionSource(n, "arange", layer, facts, start=start, step=step, problem=problem)


def _slice_source(n: fx.Node, name: str, facts: GraphFacts, layer: str) -> PositionSource | None:
    seq = facts.seq
    base = n.args[0] if n.args else None
    base_shape, out_shape = shape_of(base), shape_of(n)
    if base_shape is None or out_shape is None or base in facts.data:
        return None
    if name == "select":  # table.select(dim, i): a row picked by an index computed from the length?
        index = _arg(n, 2, "index")
        if is_seq_scalar(index, seq):
            return PositionSource(n, "length", layer, facts, problem="an index computed from the local sequence length")
        return None
    if name == "narrow":
        dim, start, length = (_arg(n, 1, "dim"), _arg(n, 2, "start"), _arg(n, 3, "length"))
        length = _val(length) if isinstance(length, fx.Node) else length
        if not isinstance(dim, int) or not seq.involves(length) or seq.involves(base_shape[dim % len(base_shape)]):
            return None
        dim = dim % len(base_shape)
        start = 0 if is_zero(start) else start
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
        uses_length |= any(is_seq_scalar(p, seq) for p in parts)
        if isinstance(e, slice):
            if seq.involves(out_shape[out_d]) and not seq.involves(base_shape[in_d]):
                sliced.append((i, e, in_d, out_d))
            out_d += 1
        in_d += 1
    if not sliced:
        # a table indexed by the length; a base with a sequence dim is position computation, checked where used
        if uses_length and not has_seq(base, seq):
            return PositionSource(n, "length", layer, facts, problem="an index computed from the local sequence length")
        return None
    (i, e, in_d, out_d), problem = sliced[0], ""
    start = 0 if is_zero(e.start) else e.start
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
    if leaves_graph(n):
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
    if not has_seq(n, seq) or any(has_seq(i, seq) for i in value_inputs(n)):
        return None  # no sequence dim, or one it inherits from a value it reads (followed from that value)
    if name in vocab.FACTORIES:
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
            if n.op in ("call_function", "call_method") and n in facts.live and is_tensorish(n):  # dead: no effect
                if cores.traced_in_core(n):
                    continue  # a head-parallel core's whole sequence: its sizes and positions are global
                found = _classify(n, facts)
                if found is not None:
                    sources.append(found)
    return sources
