"""rewrite: a position source replaced by its value at the global positions of this rank's tokens
(:func:`rewrite_source`), read from the active plan at run time by ``torch.ops.cpcompile.token_positions``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from cpcompile import ops
from cpcompile.passes.common import node_value as _val
from cpcompile.passes.positions.graph import shape_of
from cpcompile.passes.positions.model import PositionSource


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
            rows = shape_of(src.table)[src.dim] - src.start
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
