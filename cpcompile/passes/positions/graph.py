"""What the positions pass reads off a graph node: its shape, its dims of the local length, the tensors whose
values it reads (by the op tables of :mod:`cpcompile.passes.vocabulary`), the attention mask it hands on, and
the value of an index or size argument.
"""

from __future__ import annotations

import re

import torch
import torch.fx as fx
import torch.nn.attention.flex_attention as flex_attention_module

from cpcompile import _compat
from cpcompile.passes import vocabulary as vocab
from cpcompile.passes.aliasing import op_name
from cpcompile.passes.common import node_value as _val
from cpcompile.passes.common import shape_of as shape_of
from cpcompile.passes.positions.model import SequenceLength


def is_tensorish(n: object) -> bool:
    v = _val(n)
    return isinstance(v, torch.Tensor) or (isinstance(v, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in v))


def _may_be_tensor(n: object) -> bool:
    """A tensor, or a node without a recorded value (inserted by an earlier pass): it may carry data."""
    return isinstance(n, fx.Node) and (_val(n) is None or is_tensorish(n))


def _is_sdpa(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target in _compat.SDPA_TARGETS


def mask_args(u: fx.Node) -> tuple[object, tuple]:
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


_FLEX_FILE = flex_attention_module.__file__.removesuffix("c")  # the .py, also when loaded from a .pyc
_BLOCK_MASK_FRAME = re.compile(
    r'File "(?P<file>[^"]+)", line \d+, in (?:torch_dynamo_resume_in_)?(?P<fn>{})(?:_at_\d+)?$'.format(
        "|".join(vocab.BLOCK_MASK_MAKERS)
    )
)


def block_mask_table(n: fx.Node) -> bool:
    """Whether ``n`` was computed inside torch's BlockMask construction (:data:`~cpcompile.passes.vocabulary.
    BLOCK_MASK_MAKERS`), by the stack Dynamo recorded for it: a block table, when the graph hands it on."""
    trace = n.meta.get("stack_trace") or ""
    if not any(name in trace for name in vocab.BLOCK_MASK_MAKERS):  # most nodes: no line to parse
        return False
    for line in trace.splitlines():
        m = _BLOCK_MASK_FRAME.search(line.strip())
        if m is not None and m["file"] == _FLEX_FILE:
            return True
    return False


def leaves_graph(n: fx.Node) -> bool:
    """The graph's output, or a call of a nested graph (activation checkpointing), which sees its inputs as data."""
    return n.op == "output" or (n.op == "call_function" and _compat.is_higher_order_op(n.target))


def seq_dims(n: object, seq: SequenceLength) -> list[int]:
    shape = shape_of(n)
    return [] if shape is None else [d for d, s in enumerate(shape) if seq.involves(s)]


def has_seq(n: object, seq: SequenceLength) -> bool:
    """Whether a tensor (or any tensor of a tuple, e.g. a split's outputs) has a dim of the local length."""
    v = _val(n)
    values = v if isinstance(v, (tuple, list)) else (v,)
    return any(isinstance(x, torch.Tensor) and any(seq.involves(s) for s in x.shape) for x in values)


def is_seq_scalar(n: object, seq: SequenceLength) -> bool:
    v = _val(n)
    return isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) and seq.involves(v)


def value_inputs(n: fx.Node) -> list[fx.Node]:
    """The inputs whose values ``n`` reads (not those it reads only for a dtype, device or shape)."""
    name = op_name(n)
    if name in vocab.POSITION_NO_VALUES:
        return []
    if name in vocab.SHAPE_ONLY_ARGS:
        first = n.args[0] if n.args else None
        return [first] if _may_be_tensor(first) else []
    return [i for i in n.all_input_nodes if _may_be_tensor(i)]


def pairwise(n: fx.Node, seq: SequenceLength) -> bool:
    """Whether ``n`` is a ``[.., T, T]`` value of the local length: two sequence dims, or a bool ``[.., c, c]`` whose
    last two sizes are the plan's chunk length as constants (transformers builds the mask it hands to per-layer
    graphs with concrete sizes even when the graph's inputs have a symbolic length, e.g. under FSDP2)."""
    if len(seq_dims(n, seq)) >= 2:
        return True
    v = _val(n)
    if not isinstance(v, torch.Tensor) or v.dtype != torch.bool or v.dim() < 2 or seq.chunk_len is None:
        return False
    return all(type(s) is int and s == seq.chunk_len for s in v.shape[-2:])


def scalar_value(x: object) -> object:
    """An index or size argument's value: a node's recorded (possibly symbolic) value, else ``x``."""
    return _val(x) if isinstance(x, fx.Node) else x


def is_zero(x: object) -> bool:
    """Whether an offset is 0, also when written as a symbolic difference (``k_len - q_len`` of one length)."""
    v = scalar_value(x)
    return v is None or (isinstance(v, (int, torch.SymInt)) and _compat.statically_true(v == 0))
