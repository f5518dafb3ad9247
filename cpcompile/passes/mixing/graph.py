"""What the mixing finder knows about one graph (:class:`_Graph`: the sharded data, the sequence dims of every
node, the MoE dispatch tensors), with the helpers :mod:`~cpcompile.passes.mixing.find` and
:mod:`~cpcompile.passes.mixing.regions` both read it through. Package-internal: nothing here is public."""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from cpcompile.passes import vocabulary as vocab
from cpcompile.passes.positions import SequenceLength
from cpcompile.passes.sequence_dims import Tags, is_nested

__all__: list[str] = []


@dataclasses.dataclass(frozen=True)
class _Graph:
    """What the finder knows about one graph module."""

    seq: SequenceLength
    data: frozenset
    mask_only: frozenset
    tags: dict
    expert_ids: frozenset
    dispatch_index: frozenset
    per_token: frozenset
    #: The tags are head dims of a head-parallel region (:func:`~cpcompile.passes.mixing.find._head_map_refusals`),
    #: not the sequence: a rank holds a contiguous block of the heads, in order.
    heads: bool = False


def _seq_tags(n: object, g: _Graph) -> Tags:
    t = g.tags.get(n) if isinstance(n, fx.Node) else None
    return t if isinstance(t, tuple) and not is_nested(t) else ()


def _seq_operands(n: fx.Node, g: _Graph) -> list[fx.Node]:
    """The inputs of ``n`` whose values it reads, that are sharded data and have a sequence dim."""
    if vocab.op_name(n) in vocab.NO_VALUES:
        return []
    return [i for i in n.all_input_nodes if i in g.data and any(_seq_tags(i, g))]


#: Ops that change a tensor's dtype or memory, never which token a value belongs to.
_SHAPE_ONLY_CASTS = {"to", "float", "long", "int", "double", "half", "bfloat16", "type", "contiguous", "clone"}


def _index_entries(n: fx.Node) -> list[object]:
    index = n.args[1] if len(n.args) > 1 else None
    return list(index) if isinstance(index, (tuple, list)) else [index]
