"""What the positions pass knows about a graph before it looks for sources: how the local length appears in it
(:func:`sequence_length`), which nodes hold sharded data, which only build attention masks and which can change
a result at all (:func:`graph_facts`, :func:`live_nodes`). The mixing pass reads the same facts.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from cpcompile import _compat
from cpcompile.passes import vocabulary as vocab
from cpcompile.passes.aliasing import mutated, op_name, viewed_bases
from cpcompile.passes.common import node_value as _val
from cpcompile.passes.positions.graph import (
    block_mask_table,
    has_seq,
    is_tensorish,
    leaves_graph,
    mask_args,
    pairwise,
    value_inputs,
)
from cpcompile.passes.positions.model import GraphFacts, SequenceLength


def sequence_length(gm: fx.GraphModule, chunk_len: int | None, mixed: bool = False) -> SequenceLength | None:
    """The local length of ``gm``: the symbols of its inputs' sizes that stand for it, else ``chunk_len``.

    A symbol is the local length when it is a whole dim of a tensor input that is not module state (token
    ids, hidden states, ``position_ids``), or a size input of its own, and the size it had when the graph was
    traced equals ``chunk_len`` (the backend compiles inside the shard context whose plan fixes ``c``). Without
    a plan, the symbols of dim 1 (the sequence dim of ``[B, T, ...]`` inputs, the one ``shard`` marks dynamic)
    are taken. ``None`` when the graph has no symbol and no plan tells ``c``.

    ``mixed``: also say whether the graph has such symbols and a ``[B, c, ...]`` input with the constant
    length ``c`` (:attr:`SequenceLength.mixed`).
    """
    symbols, constant = set(), False
    for n in gm.graph.nodes:
        v = _val(n)
        if n.op == "placeholder" and isinstance(v, torch.SymInt) and chunk_len is not None:
            # a size handed in on its own: the length of a tensor outside the graph (transformers' mask graph
            # under FSDP2 gets the hidden states' length so, apart from its position_ids' own symbol)
            if _compat.free_symbols(v) == {_compat.sym_expr(v)} and _compat.sym_hint(v) == chunk_len:
                symbols.add(_compat.sym_expr(v))
            continue
        if n.op != "placeholder" or not isinstance(v, torch.Tensor) or _compat.is_module_state(n):
            continue
        dims = range(v.dim()) if chunk_len is not None else ([1] if v.dim() >= 2 else [])
        constant = constant or (
            v.dim() >= 2 and not _compat.free_symbols(v.shape[1]) and _compat.sym_hint(v.shape[1]) == chunk_len
        )
        for d in dims:
            size = v.shape[d]
            if not isinstance(size, torch.SymInt) or _compat.free_symbols(size) != {_compat.sym_expr(size)}:
                continue
            if chunk_len is None or _compat.sym_hint(size) == chunk_len:
                symbols.add(_compat.sym_expr(size))
    if not symbols and chunk_len is None:
        return None
    return SequenceLength(frozenset(symbols), chunk_len, mixed=mixed and bool(symbols) and constant)


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
                    is_data = is_tensorish(n) and not _compat.is_module_state(n) and has_seq(n, seq)
                else:
                    is_data = n.op in ("call_function", "call_method", "call_module") and any(
                        i in data for i in value_inputs(n)
                    )
                if is_data:
                    data.add(n)
                    changed = True
            target = mutated(n)
            if target is not None and any(i in data for i in value_inputs(n)):
                for written in viewed_bases(target):  # writing data into a view writes it into its base
                    if written not in data:
                        data.add(written)
                        changed = True
    live = live_nodes(gm)
    mask_only: set[fx.Node] = _block_tables(nodes, live)
    for n in reversed(nodes):
        if n in mask_only:
            continue
        users = [u for u in n.users if u in live]
        if users and all(_mask_use(n, u, seq, mask_only) for u in users):
            mask_only.add(n)
    return GraphFacts(gm, seq, frozenset(data), frozenset(mask_only), live)


def _block_tables(nodes: list[fx.Node], live: frozenset) -> set[fx.Node]:
    """The nodes of torch's BlockMask construction (:func:`block_mask_table`) whose values reach only other such
    nodes (in-place writes into its buffers included) and the graph's output: they compute block tables, which
    the flex pass never reads (:data:`~cpcompile.passes.vocabulary.BLOCK_MASK_MAKERS`)."""
    tables = {n for n in nodes if n.op in ("call_function", "call_method") and block_mask_table(n)}
    changed = True
    while changed:
        changed = False
        for n in list(tables):
            if any(u in live and u not in tables and u.op != "output" for u in n.users):
                tables.discard(n)
                changed = True
    return tables


def _has_side_effect(n: fx.Node) -> bool:
    """A call whose effect is not only its value: an op FX calls impure (collectives, asserts, random ops), a call
    of a nested graph or a module, a call of an op the pass does not know (a ``cpcompile::`` op)."""
    if n.op == "call_module" or leaves_graph(n):
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
    return name == "arange" or name in vocab.FRESH_OPS


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
    mask, others = mask_args(u)
    if mask is not None or others:
        return mask is n and all(o is not n for o in others)
    if leaves_graph(u):
        return pairwise(n, seq)  # a [.., T, T] value: the receiving graph checks it as its mask
    if n not in value_inputs(u):
        return True  # read for its shape only
    return u in mask_only
