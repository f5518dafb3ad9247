"""Pooling one token per row: an ``argmax`` over the sequence whose only use is to pick that token's rows of a
per-token tensor (last-token pooling of transformers' ``*ForSequenceClassification``), made exact across ranks.

The form (:func:`pooled_picks`)::

    last = v.argmax(seq_dim)           # v: [B, T] sharded data, one row per batch row
    pooled = x[rows, last]             # x: [B, T, ...] per-token data, rows: [B] batch indices -> [B, ...]

In the one-process model ``last[b]`` is the first token of row ``b``, in global order, where ``v`` is largest. The
winning token lives on one rank, so the pick is exact once the ranks agree on the winner (:func:`pool_across_ranks`):

1. each rank takes its own candidate: the local ``argmax`` of ``v`` with the padding tokens that make ``T`` a
   multiple of the CP size set to the lowest value (``cpcompile::real_tokens``); a rank's tokens are in ascending
   global order under every layout, so the local first maximum is the globally first among this rank's tokens;
2. the ranks all-gather one value and one key per row: the candidate's value and its global token index
   (``cpcompile::token_positions``; padding: a key after every real token);
3. the winner is the candidate of largest value (NaN above everything, as ``argmax`` takes it), ties going to the
   smallest global index: ``argmax``'s first occurrence, in global order;
4. the candidate rows ``x[rows, local_last]`` are all-gathered and every rank takes the winner's: every rank ends
   with the same pooled rows. Backward: only the owner's row carries a gradient
   (``where(owner, own_row, winner_row.detach())``): the value is whole on every rank, as with
   :func:`cpcompile.gather`, so a loss computed from it is the same on every rank, and the ranks' gradients, summed
   over the CP group (``sync_grads``, FSDP2), are the one-process gradient. Such a loss is not a share: do not add
   its values over the CP ranks.

Cost: three small all-gathers per pick and step (``B`` values, ``B`` int64 keys, ``B`` pooled rows).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from cpcompile import _compat
from cpcompile.passes import vocabulary as vocab
from cpcompile.passes.common import PassContext, arg
from cpcompile.passes.common import node_value as _val
from cpcompile.passes.mixing.graph import _Graph, _index_entries, _seq_tags
from cpcompile.passes.sequence_dims import shape_of

__all__ = ["pool_across_ranks", "pooled_picks"]

#: The key of a padding candidate: after every real token's global index.
_PADDING_KEY = 2**62


def pooled_picks(a: fx.Node, g: _Graph) -> list[fx.Node] | None:
    """The getitems that pick rows of per-token data at the tokens ``a`` (an ``argmax``) chose, when ``a`` runs
    along the one sequence dim of a ``[B, T]`` tensor (``keepdim=False``) and every use of its result is such a
    pick: ``x[rows, a]`` with ``x`` a ``[B, T, ...]`` tensor of sharded data whose dim 1 is the sequence and
    ``rows`` a ``[B]`` index tensor that is not sharded data. ``None`` otherwise (the argmax is then refused)."""
    if vocab.op_name(a) != "argmax" or not a.args or not isinstance(a.args[0], fx.Node):
        return None
    v, dim, keepdim = a.args[0], arg(a, 1, "dim"), arg(a, 2, "keepdim", False)
    if _seq_tags(v, g) != (False, True) or not isinstance(dim, int) or dim % 2 != 1 or keepdim:
        return None
    if not isinstance(_val(v), torch.Tensor) or _val(v).dtype in (torch.bool, torch.complex64, torch.complex128):
        return None
    picks = []
    for u in a.users:
        if u.op != "call_function" or u.target is not operator.getitem or u.args[0] is a:
            return None
        x, entries = u.args[0], _index_entries(u)
        tags = _seq_tags(x, g)
        if len(entries) != 2 or entries[1] is not a or len(tags) < 2 or tags[:2] != (False, True) or any(tags[2:]):
            return None
        rows = entries[0]
        if not isinstance(rows, fx.Node) or rows in g.data or any(_seq_tags(rows, g)) or x not in g.data:
            return None
        if not isinstance(_val(rows), torch.Tensor) or shape_of(rows) != shape_of(a):
            return None
        picks.append(u)
    return picks or None


def pool_across_ranks(a: fx.Node, picks: list[fx.Node], ctx: PassContext, site: str) -> None:
    """Rewrite ``a`` (an argmax of :func:`pooled_picks`) and its ``picks`` so that every rank's picks hold the rows
    of the token the one-process ``argmax`` chooses (module docstring); ``site`` names the op in errors."""
    graph = a.graph
    v = a.args[0]
    dtype = _val(v).dtype
    lowest = float("-inf") if dtype.is_floating_point else torch.iinfo(dtype).min
    with graph.inserting_before(a):
        like = graph.call_method("detach", (v,))
        real = graph.call_function(torch.ops.cpcompile.real_tokens.default, (like, 1, site))  # [c]
        pos = graph.call_function(torch.ops.cpcompile.token_positions.default, (real, -1, site))
        key = graph.call_function(torch.where, (real, pos, _PADDING_KEY))
        candidates = graph.call_function(torch.where, (graph.call_method("view", (real, [1, -1])), v, lowest))
        local = graph.node_copy(a, lambda n: candidates if n is v else n)
        value = graph.call_method("gather", (candidates, 1, graph.call_method("unsqueeze", (local, 1))))
        value = graph.call_method("squeeze", (value, 1))
        own_key = graph.call_function(operator.getitem, (key, local))
        values = _gather_rows(graph, value, ctx)  # [N, B]
        keys = _gather_rows(graph, own_key, ctx)
        best = _winner(graph, values)
        winner_key = _first(graph, best, keys)
        owner = _owner(graph, own_key, winner_key)
        held = graph.call_method("int", (graph.call_function(operator.eq, (keys, winner_key)),))  # [N, B]
        winner_rank = graph.call_method("argmax", (held, 0))
    for pick in picks:
        ndim = _val(pick).dim()
        with graph.inserting_before(pick):
            own = graph.node_copy(pick, lambda n: local if n is a else n)
            rows = _gather_rows(graph, graph.call_method("detach", (own,)), ctx)  # [N, B, ...]
            index = graph.call_method("reshape", (winner_rank, [1, -1] + [1] * (ndim - 1)))
            index = graph.call_method("expand_as", (index, graph.call_method("unsqueeze", (own, 0))))
            theirs = graph.call_method("squeeze", (graph.call_method("gather", (rows, 0, index)), 0))
            mine = graph.call_method("view", (owner, [-1] + [1] * (ndim - 1)))
            pooled = _deliver(graph, mine, own, theirs)
        pick.replace_all_uses_with(pooled)
        graph.erase_node(pick)
    graph.erase_node(a)


def _gather_rows(graph: fx.Graph, t: fx.Node, ctx: PassContext) -> fx.Node:
    """``[N, ...]``: every rank's ``t``, rank-major (one all-gather over the CP group)."""
    row = graph.call_method("unsqueeze", (t, 0))
    return graph.call_function(_compat.all_gather_seq, (row, 0, ctx.cp_size, ctx.group_name))


def _winner(graph: fx.Graph, values: fx.Node) -> fx.Node:
    """Bool ``[N, B]``: which ranks' candidates hold the row's largest value (NaN, where any, above the rest)."""
    nan = graph.call_function(torch.isnan, (values,))
    top = graph.call_function(operator.eq, (values, graph.call_method("amax", (values, 0, True))))
    return graph.call_function(torch.where, (graph.call_method("any", (nan, 0, True)), nan, top))


def _first(graph: fx.Graph, best: fx.Node, keys: fx.Node) -> fx.Node:
    """Int64 ``[B]``: the winner's global index, the smallest key among the ``best`` candidates (argmax's first
    occurrence, in global order)."""
    return graph.call_method("amin", (graph.call_function(torch.where, (best, keys, _PADDING_KEY + 1)), 0))


def _deliver(graph: fx.Graph, mine: fx.Node, own: fx.Node, theirs: fx.Node) -> fx.Node:
    """The winner's rows on every rank: this rank's own rows where it owns the winner (the only rows that carry a
    gradient), the gathered winner's rows (detached) elsewhere."""
    return graph.call_function(torch.where, (mine, own, theirs))


def _owner(graph: fx.Graph, own_key: fx.Node, winner_key: fx.Node) -> fx.Node:
    """Bool ``[B]``: whether this rank's candidate is the winner (its global index is the winner's)."""
    return graph.call_function(operator.eq, (own_key, winner_key))
