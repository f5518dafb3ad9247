"""Every op that mixes tokens along the sharded sequence: made exact across CP ranks, accounted for, or refused.

Under :func:`cpcompile.shard` a rank holds some tokens of every row. An op that combines values of different
tokens (a convolution along the sequence, a cumulative sum, a shift, a reduction, a matrix product over the
sequence) sees only this rank's tokens and is silently wrong unless something makes it see the others. The
attention pass rewrites SDPA, the one mixer it knows; this pass finds every other one, *on data*: it follows the
sequence dim of the sharded inputs (token ids, hidden states, masks) through the graph (views and reshapes that
split or merge it, transposes, element-wise ops; :func:`sequence_dims`) and looks at every op that reads a
tensor with a sequence dim (:mod:`cpcompile.passes.vocabulary` says which ops keep tokens apart). For each
mixing op (:class:`MixingOp`) :func:`check_op` decides:

* ``gathered``: a causal region (:class:`CausalRegion`: a causal depthwise ``conv1d`` with its trim, a
  pad-and-slice token shift, a forward ``cumsum``) is run on the whole sequence: its input is all-gathered in
  global token order, the original ops run on it, and this rank's tokens are taken back (:func:`rewrite_region`).
  Exact under every layout, packed documents included (the region does what the one-process model does on the
  whole row); padding tokens sit after every real token, so a causal region never lets them reach a real one.
  Backward: the all-gather's gradient is a sum reduce-scatter, which hands every token's owner the gradients
  all ranks computed for it.
* ``partial_sum``: a sum over the sequence (a loss with ``reduction="sum"``, a ``sum()``) whose result reaches
  the graph's output only through scaling by values that are not sharded data (``num_items_in_batch``, which
  ``shard`` passes) and additions of other partial sums: every rank's value is its tokens' share and the ranks'
  values add up to the one-process value, as ``shard``'s loss contract says. A mean over the sequence, a
  maximum, a loss with ``reduction="mean"`` or a sum used any other way is refused.
* ``dispatch``: MoE token bookkeeping (transformers' ``integrations/moe.py``): sorting the ``tokens x top_k``
  expert ids along the token dim, their histogram, moving rows by that permutation and back. Only expert ids
  (the indices of a ``topk`` or ``argmax`` over a dim that is not a sequence dim, reshaped, cast or sorted) and
  the permutation of a sort whose sorted values are not used (``_, perm = sort(scores)``) are bookkeeping; rows
  moved by any other index are a selection across tokens. That the rows are moved back before they leave the
  dispatch is not checked.
* ``per_token``: a custom op listed in :data:`cpcompile.passes.vocabulary.PER_TOKEN_OPS` or the backend's
  ``per_token_ops`` option.
* ``refused``: anything else that mixes: :class:`UnsupportedMixingError` at compile time, on every rank (each
  rank compiles the same graph), naming the layer, the op, the model's source line and the fix.

Masks the model builds from positions (they feed SDPA's ``attn_mask``) belong to the attention pass, which
replaces and checks them; this pass skips every node whose uses all end there.

find -> check -> rewrite: :func:`find_mixing_ops`, :func:`check_op`, :func:`rewrite_region`; :func:`mixing_pass` is
the entry point the backend runs on every graph (after the attention and positions passes) when the CP group
has more than one rank. ``cpcompile.passes.counters`` counts ``mixing_ops_found`` and ``mixing_<action>``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch
import torch.fx as fx

from cpcompile import _compat, ops
from cpcompile.errors import UnsupportedMixingError
from cpcompile.passes import vocabulary as vocab
from cpcompile.passes.common import PassContext, arg, counters, finish, graph_modules, node_value, source_line
from cpcompile.passes.positions import SequenceLength, graph_facts, sequence_length
from cpcompile.passes.sequence_dims import Tags, is_nested, sequence_dims, shape_of, size_hint

__all__ = [
    "CausalRegion",
    "MixingOp",
    "MixingReport",
    "check_op",
    "find_mixing_ops",
    "mixing_pass",
    "rewrite_region",
]

#: What an op does along the sequence.
Kind = Literal[
    "convolution", "scan", "shift", "reduction", "loss", "contraction", "order", "selection", "custom", "unknown"
]  # fmt: skip
#: What became of it (see the module docstring).
Action = Literal["gathered", "partial_sum", "dispatch", "per_token", "refused"]


@dataclasses.dataclass(frozen=True)
class CausalRegion:
    """Ops that run on the whole sequence: from ``operand`` (``dim`` of the local length) to ``nodes[-1]``
    (``out_dim`` of the local length again), every output token reading only input tokens at or before it."""

    operand: fx.Node
    dim: int
    nodes: tuple[fx.Node, ...]
    out_dim: int
    #: ``(node, index entry)`` of slices whose stop is the static chunk length (a static graph's trim): they stop
    #: at the gathered length instead.
    trims: tuple[tuple[fx.Node, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class MixingOp:
    """One op that reads a tensor with a sequence dim and combines (or moves) values of different tokens."""

    node: fx.Node
    kind: Kind
    #: The op's vocabulary name (``conv1d``, ``cumsum``, ``mylib::scan``).
    op: str
    #: Qualified name of the module that made the call, or ``""``.
    layer: str
    #: What it does along the sequence, in words.
    what: str
    #: ``partial_sum``/``dispatch``/``per_token`` when the finder already knows it is accounted for.
    accounted: str = ""
    region: CausalRegion | None = None
    #: Why it cannot be run on the whole sequence (when a region was looked for and not found).
    problem: str = ""

    @property
    def where(self) -> str:
        return f"{self.layer or '<top level>'} (node {self.node.name})"

    @property
    def source(self) -> str:
        """The model's source line that made the op (``file:line: code``), from Dynamo's stack trace."""
        return source_line(self.node)


@dataclasses.dataclass(frozen=True)
class MixingReport:
    """What the pass did with one mixing op (``backend.mixing_reports``, ``cpcompile inspect``, dumps, logs)."""

    graph_id: int
    node: str
    layer: str
    op: str
    kind: str
    action: str
    reason: str = ""
    source: str = ""
    #: ``gathered``: bytes this rank receives per call in the all-gather (``(N - 1) * numel * itemsize``).
    all_gather_bytes_per_call: int = 0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _val(n: object) -> object:
    return node_value(n)


# -- find ------------------------------------------------------------------------------------------------------
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


def _seq_tags(n: object, g: _Graph) -> Tags:
    t = g.tags.get(n) if isinstance(n, fx.Node) else None
    return t if isinstance(t, tuple) and not is_nested(t) else ()


def _seq_operands(n: fx.Node, g: _Graph) -> list[fx.Node]:
    """The inputs of ``n`` whose values it reads, that are sharded data and have a sequence dim."""
    if vocab.op_name(n) in vocab.NO_VALUES:
        return []
    return [i for i in n.all_input_nodes if i in g.data and any(_seq_tags(i, g))]


def _norm_dims(dims: object, ndim: int) -> set[int] | None:
    if dims is None or dims == "all" or dims == () or dims == []:
        return None
    if isinstance(dims, int):
        dims = (dims,)
    if not isinstance(dims, (tuple, list)) or not all(isinstance(d, int) for d in dims):
        return None
    return {d % ndim for d in dims} if ndim else set()


def _reduced_seq_dims(n: fx.Node, name: str, x: fx.Node, g: _Graph) -> set[int]:
    pos, kw, default, _ = vocab.DIM_REDUCTIONS[name]
    tags = _seq_tags(x, g)
    if name in ("histc", "bincount"):
        return {d for d, t in enumerate(tags) if t}
    dims = arg(n, 1 + pos, kw, default)
    if name in ("max", "min") and len(n.args) > 1 and isinstance(n.args[1], fx.Node):
        return set()  # the element-wise form max(a, b)
    reduced = _norm_dims(dims, len(tags))
    return {d for d, t in enumerate(tags) if t and (reduced is None or d in reduced)}


_SHAPE_ONLY_CASTS = {"to", "float", "long", "int", "double", "half", "bfloat16", "type", "contiguous", "clone"}


def _expert_ids(g: fx.GraphModule, seq: SequenceLength, tags: dict) -> frozenset:
    """Nodes holding MoE expert ids: the indices of a ``topk``/``argmax`` over a dim that is not a sequence dim,
    and what reshapes, casts and sorts (values) make of them."""
    ids: set[fx.Node] = set()
    for n in g.graph.nodes:
        name = vocab.op_name(n) if n.op in ("call_function", "call_method") else ""
        first = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        if name == "getitem" and first is not None and isinstance(n.args[1], int):
            src = vocab.op_name(first) if first.op in ("call_function", "call_method") else ""
            if src == "topk" and n.args[1] == 1 and not _reduces_seq(first, "topk", tags):
                ids.add(n)
            elif src in ("sort",) and n.args[1] == 0 and first.args and first.args[0] in ids:
                ids.add(n)
        elif name in ("argmax", "argmin") and not _reduces_seq(n, name, tags):
            ids.add(n)
        elif (name in vocab.RESHAPE or name in _SHAPE_ONLY_CASTS) and first in ids:
            ids.add(n)
    return frozenset(ids)


def _reduces_seq(n: fx.Node, name: str, tags: dict) -> bool:
    x = n.args[0] if n.args else None
    t = tags.get(x) if isinstance(x, fx.Node) else None
    if not isinstance(t, tuple) or is_nested(t):
        return True
    pos, kw, default, _ = vocab.DIM_REDUCTIONS[name]
    reduced = _norm_dims(arg(n, 1 + pos, kw, default), len(t))
    return any(tagged and (reduced is None or d in reduced) for d, tagged in enumerate(t))


def _sorts_for_dispatch(n: fx.Node, expert_ids: frozenset) -> bool:
    """Whether a ``sort``/``argsort`` only orders rows for a dispatch: it sorts expert ids, or only its permutation
    is used (the sorted values themselves never become data: ``_, perm = sort(router_scores)``)."""
    if (n.args and n.args[0] in expert_ids) or vocab.op_name(n) == "argsort":
        return True
    return all(vocab.op_name(u) == "getitem" and u.args[1] == 1 for u in n.users)


def _dispatch_index(g: fx.GraphModule, expert_ids: frozenset) -> frozenset:
    """Index tensors of the MoE dispatch: the permutation that sorts expert ids (``sort(ids)[1]``,
    ``argsort(ids)``), what element-wise arithmetic with constants makes of it (``perm // top_k``), and a tensor
    written at those indices (``inv_perm[perm] = arange(...)``, the inverse permutation)."""
    index: set[fx.Node] = set()
    changed = True
    while changed:
        changed = False
        for n in g.graph.nodes:
            if n in index or n.op not in ("call_function", "call_method"):
                continue
            name = vocab.op_name(n)
            first = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
            found = False
            if name == "getitem" and first is not None and isinstance(n.args[1], int) and n.args[1] == 1:
                found = vocab.op_name(first) == "sort" and _sorts_for_dispatch(first, expert_ids)
            elif name == "argsort":
                found = _sorts_for_dispatch(n, expert_ids)
            elif name in vocab.ELEMENTWISE or name in vocab.RESHAPE or name in _SHAPE_ONLY_CASTS:
                tensors = [i for i in n.all_input_nodes if isinstance(_val(i), torch.Tensor)]
                found = bool(tensors) and all(i in index for i in tensors)
            elif name == "setitem" and first is not None and len(n.args) > 1 and n.args[1] in index:
                if first not in index:
                    index.add(first)
                    changed = True
            if found:
                index.add(n)
                changed = True
    return frozenset(index)


def _index_entries(n: fx.Node) -> list[object]:
    index = n.args[1] if len(n.args) > 1 else None
    return list(index) if isinstance(index, (tuple, list)) else [index]


def _classify(n: fx.Node, name: str, operands: list[fx.Node], g: _Graph) -> MixingOp | None:
    """The mixing op ``n`` is, or ``None`` when it keeps the tokens of its sequence operands apart."""
    layer = _compat.node_module_path(n)

    def found(kind: Kind, what: str, accounted: str = "") -> MixingOp:
        return MixingOp(n, kind, name, layer, what, accounted)

    x = operands[0]
    tags = _seq_tags(x, g)
    seq_dims = {d for d, t in enumerate(tags) if t}
    if name == "scaled_dot_product_attention" or name.startswith("cpcompile::"):
        return None  # attention: the attention pass's business
    if "::" in name:
        if name in g.per_token:
            return found("custom", f"the custom op {name}, listed as per-token", accounted="per_token")
        return found("custom", f"the custom op {name} takes sequence-sharded tensors and cpcompile cannot see into it")
    if name in vocab.ELEMENTWISE or name in vocab.LAYOUT or name in vocab.RESHAPE or name in vocab.SPLITS:
        if name in ("repeat", "tile") and n.args[0] is x:
            sizes = list(n.args[1:]) if not isinstance(n.args[1], (tuple, list)) else list(n.args[1])
            lead = len(sizes) - len(tags)
            if any(sizes[lead + d] != 1 for d in seq_dims if lead + d >= 0):
                return found("shift", f"{name} repeats the sequence")
        return None
    if name in vocab.FEATURE_REDUCTIONS:
        return _check_feature(n, name, x, tags, found)
    if name in ("getitem", "setitem") or name in vocab.ROW_MOVES:
        return _check_index(n, name, x, g, found)
    if name in vocab.LOSSES:
        return _check_loss(n, name, found)
    if name in vocab.DIM_REDUCTIONS:
        _, _, _, kind = vocab.DIM_REDUCTIONS[name]
        if not _reduced_seq_dims(n, name, x, g):
            return None
        if name in vocab.DISPATCH and x in g.expert_ids:
            return found("order", f"{name} of MoE expert ids over tokens x top_k", accounted="dispatch")
        if name in ("sort", "argsort") and _sorts_for_dispatch(n, g.expert_ids):
            what = "sort of the rows for a dispatch (only the permutation is used)"
            return found("order", what, accounted="dispatch")
        if kind == "reduction" and name in ("sum", "nansum"):
            return found("reduction", f"{name} over the sequence", accounted="partial_sum")
        return found(kind, f"{name} along the sequence")
    if name in vocab.CONTRACTIONS:
        return _check_contraction(n, name, g, found)
    if name in vocab.CONVOLUTIONS:
        spatial = {d for d in seq_dims if d >= 2}
        if n.args[0] is x and not spatial:
            return None
        return found("convolution", f"{name} along the sequence")
    if name == "pad":
        pads = list(arg(n, 1, "pad", ()))
        padded = {len(tags) - 1 - p // 2 for p, v in enumerate(pads) if v != 0}
        return found("shift", "pads the sequence") if padded & seq_dims else None
    if name in ("cat", "concat", "concatenate"):
        dim = arg(n, 1, "dim", 0)
        out_tags = _seq_tags(n, g)
        return found("shift", f"{name} along the sequence") if out_tags and out_tags[dim % len(out_tags)] else None
    if name == "stack":
        return None
    if n.op == "call_function" and (n.target in _ATTENTION_HELPERS or _compat.is_higher_order_op(n.target)):
        return None  # the rewritten attention's collectives; a nested graph, searched on its own
    return found("unknown", f"{name} is not known to keep the tokens of the sequence apart")


_ATTENTION_HELPERS = frozenset({_compat.all_gather_start, _compat.all_gather_wait, _compat.all_gather_seq})


def _check_feature(n, name, x, tags, found) -> MixingOp | None:
    seq_dims = {d for d, t in enumerate(tags) if t}
    if name == "embedding":
        weight = n.args[1] if len(n.args) > 1 else n.kwargs.get("weight")
        return found("selection", "embedding of sharded data used as the table") if weight is x else None
    if name == "linear":
        if n.args[0] is x and (len(tags) - 1) not in seq_dims:
            return None
        return found("contraction", "linear over the sequence dim")
    shape = arg(n, 1, "normalized_shape", ())
    k = len(shape) if isinstance(shape, (tuple, list)) else 1
    if n.args[0] is x and not any(d >= len(tags) - k for d in seq_dims):
        return None
    return found("reduction", f"{name} normalises over the sequence dim")


def _check_index(n, name, x, g: _Graph, found) -> MixingOp | None:
    """Indexing and row moves: whole slices keep tokens apart; a partial slice of the sequence is a shift; rows
    moved by MoE dispatch indices are bookkeeping; anything else indexed along the sequence is a selection."""
    tags = _seq_tags(n.args[0], g) if n.args else ()
    seq_dims = {d for d, t in enumerate(tags) if t}
    if name in ("getitem", "setitem"):
        base = n.args[0]
        if isinstance(_val(base), (tuple, list)):
            return None
        entries = _index_entries(n)
        tensor_entries = [e for e in entries if isinstance(e, fx.Node) and isinstance(_val(e), torch.Tensor)]
        if tensor_entries:
            if all(e in g.dispatch_index for e in tensor_entries):
                return found("order", "rows moved by the MoE dispatch permutation", accounted="dispatch")
            if base not in g.data and all(not any(_seq_tags(e, g)) for e in tensor_entries):
                return None  # a table looked up at token ids (or other per-token indices)
            if base not in g.data and name == "getitem":
                return None  # a table (not data) looked up by per-token indices
            return found("selection", f"{name} of sharded data at indices along the sequence")
        if name == "setitem":
            return found("selection", "setitem into sharded data") if base in g.data and seq_dims else None
        d, consumed = 0, sum(1 for e in entries if e is not None and e is not Ellipsis)
        for e in entries:
            if e is None:
                continue
            if e is Ellipsis:
                d += len(tags) - consumed
                continue
            if d in seq_dims:
                size = shape_of(base)[d]
                if isinstance(e, slice):
                    if not _full_slice(e, size):
                        if not any(g.seq.involves(s) for s in shape_of(n) or ()):  # a few tokens picked out
                            return found("selection", f"picks tokens {_slice_text(e)} of the sequence")
                        return found("shift", f"slices the sequence dim with {_slice_text(e)}")
                else:
                    return found("selection", f"picks token {e!r} of the sequence")
            d += 1
        return None
    dim = arg(n, 1, "dim")
    index = arg(n, 2, "index")
    if isinstance(index, fx.Node) and index in g.dispatch_index:
        return found("order", f"{name} of rows by the MoE dispatch permutation", accounted="dispatch")
    if isinstance(dim, int) and tags and dim % len(tags) not in seq_dims and n.args[0] in g.data:
        return None
    if n.args[0] not in g.data and isinstance(dim, int) and name == "index_select":
        return None
    return found("selection", f"{name} along the sequence")


def _slice_text(e: slice) -> str:
    parts = [str(_val(p) if isinstance(p, fx.Node) else p) if p is not None else "" for p in (e.start, e.stop)]
    return "[" + ":".join(parts) + (f":{e.step}" if e.step not in (None, 1) else "") + "]"


def _full_slice(e: slice, size: object) -> bool:
    if e.start not in (None, 0) or e.step not in (None, 1):
        return False
    stop = _val(e.stop) if isinstance(e.stop, fx.Node) else e.stop
    return stop is None or _compat.statically_true(stop >= size)


def _check_loss(n, name, found) -> MixingOp | None:
    pos, kw = vocab.LOSSES[name]
    reduction = arg(n, pos, kw, "mean")
    if reduction == "none":
        return None
    if reduction == "sum":
        return found("loss", f"{name}(reduction='sum') over the tokens", accounted="partial_sum")
    return found("loss", f"{name}(reduction={reduction!r}) averages over this rank's tokens only")


def _check_contraction(n, name, g: _Graph, found) -> MixingOp | None:
    reason = found("contraction", f"{name} contracts the sequence dim")
    if name == "einsum":
        eq, *operands = n.args
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = list(operands[0])
        if not isinstance(eq, str) or "." in eq:
            return reason
        lhs, _, out = eq.replace(" ", "").partition("->")
        terms = lhs.split(",")
        if "->" not in eq:
            out = "".join(sorted(c for c in set(lhs) - {","} if lhs.count(c) == 1))
        for term, op in zip(terms, operands):
            t = _seq_tags(op, g)
            if any(c not in out and d < len(t) and t[d] for d, c in enumerate(term)):
                return reason
        return None
    a, b = n.args[0], n.args[1]
    ta, tb = _seq_tags(a, g), _seq_tags(b, g)
    contracted = (len(ta) > 0 and ta[-1]) or (len(tb) >= 2 and tb[-2]) or (len(tb) == 1 and tb[0])
    return reason if contracted else None


def find_mixing_ops(gm: fx.GraphModule, seq: SequenceLength, per_token_ops: tuple[str, ...] = ()) -> list[MixingOp]:
    """Every op of ``gm`` and of its nested graphs that mixes tokens of a sharded sequence, in graph order.

    Causal candidates (convolutions, scans, shifts) come with the :class:`CausalRegion` that would run them on
    the whole sequence, or the ``problem`` why there is none.
    """
    per_token = frozenset((*vocab.PER_TOKEN_OPS, *per_token_ops))
    found = []
    for g in graph_modules(gm):
        facts = graph_facts(g, seq)
        tags = sequence_dims(g, seq)
        expert_ids = _expert_ids(g, seq, tags)
        info = _Graph(seq, facts.data, facts.mask_only, tags, expert_ids, _dispatch_index(g, expert_ids), per_token)
        in_region: set[fx.Node] = set()  # ops of a region found at an earlier op: run on the whole sequence with it
        for n in g.graph.nodes:
            if n.op not in ("call_function", "call_method", "call_module") or n in info.mask_only or n in in_region:
                continue
            operands = _seq_operands(n, info)
            if not operands:
                continue
            name = vocab.op_name(n) if n.op != "call_module" else f"module {n.target}"
            op = _classify(n, name, operands, info)
            if op is None:
                continue
            if op.kind in ("convolution", "scan", "shift") and not op.accounted:
                region, problem = causal_region(n, info)
                op = dataclasses.replace(op, region=region, problem=problem)
                in_region.update(region.nodes if region is not None else ())
            found.append(op)
    return found


# -- causal regions --------------------------------------------------------------------------------------------
_SCANS = {"cumsum", "cumprod", "logcumsumexp"}


def causal_region(start: fx.Node, g: _Graph) -> tuple[CausalRegion | None, str]:
    """The causal region that begins at the mixing op ``start``, or ``(None, why not)``.

    The region follows ``start``'s single use while the sequence dim does not have the local length: a causal
    ``conv1d`` (padding ``>= (kernel - 1) * dilation``) then the slice that trims it, a pad on the left then a
    slice, a slice then a ``cat`` after constants, a forward scan. Each step moves the window of input tokens an
    output token reads (``out[i]`` reads ``in[i + lo .. i + hi]``); the region is causal when ``hi <= 0``.
    """
    seq = g.seq
    operands = _seq_operands(start, g)
    x = operands[0]
    tags = _seq_tags(x, g)
    dims = [d for d, t in enumerate(tags) if t and seq.is_length(shape_of(x)[d])]
    if len(operands) != 1 or len(dims) != 1:
        return None, "it reads more than one sequence-sharded tensor or sequence dim"
    dim, operand, n, cur = dims[0], x, start, x
    nodes: list[fx.Node] = []
    trims: list[tuple[fx.Node, int]] = []
    hi = 0
    while True:
        step = _region_step(n, cur, dim, g)
        if isinstance(step, str):
            return None, f"{n.name}: {step}"
        dim, dhi, trim = step
        hi += dhi
        if trim is not None:
            trims.append((n, trim))
        nodes.append(n)
        shape = shape_of(n)
        if shape is not None and seq.is_length(shape[dim]):
            break
        users = [u for u in n.users if vocab.op_name(u) not in vocab.NO_VALUES]
        if len(users) != 1:
            return None, f"{n.name} has a sequence of {shape[dim] if shape else '?'} tokens and {len(users)} uses"
        cur, n = n, users[0]
    if hi > 0:
        return None, f"each output token reads up to {hi} token(s) after it (not causal)"
    return CausalRegion(operand, dims[0], tuple(nodes), dim, tuple(trims)), ""


def _region_step(n: fx.Node, cur: fx.Node, dim: int, g: _Graph) -> tuple[int, int, int | None] | str:
    """``(dim of the sequence in n's output, shift of the last input token read, index entry of a static trim)``
    for one op of a region, or why it cannot be part of one."""
    name = vocab.op_name(n)
    others = [i for i in n.all_input_nodes if i is not cur and i in g.data and any(_seq_tags(i, g))]
    if others:
        return f"{name} combines it with another sequence-sharded tensor"
    for a in _flat_args(n):
        if isinstance(a, fx.Node) and a is not cur and _is_length_scalar(a, g.seq) is False:
            return f"{name} uses a size computed from the local sequence length"
    ndim = len(shape_of(cur) or ())
    if name == "conv1d":
        weight = arg(n, 1, "weight")
        w = shape_of(weight)
        stride, padding, dilation = (arg(n, i, k, 1 if k != "padding" else 0) for i, k in
                                     ((3, "stride"), (4, "padding"), (5, "dilation")))  # fmt: skip
        stride, padding, dilation = (v[0] if isinstance(v, (tuple, list)) else v for v in (stride, padding, dilation))
        if n.args[0] is not cur or dim != ndim - 1 or w is None or stride != 1 or not isinstance(padding, int):
            return "only a conv1d over the last dim, stride 1 and an int padding runs on the whole sequence"
        return dim, -padding + (int(w[-1]) - 1) * int(dilation), None
    if name == "pad":
        pads = list(arg(n, 1, "pad", ()))
        mode = arg(n, 2, "mode", "constant")
        p = 2 * (ndim - 1 - dim)
        if mode != "constant" or n.args[0] is not cur or len(pads) <= p:
            return "only a constant pad runs on the whole sequence"
        return dim, -int(pads[p]), None
    if name == "getitem":
        entries = _index_entries(n)
        if any(not (isinstance(e, slice) or e is Ellipsis) for e in entries) or n.args[0] is not cur:
            return "only slices run on the whole sequence"
        d, consumed, e_dim, entry = 0, len([e for e in entries if e is not Ellipsis]), None, None
        for i, e in enumerate(entries):
            if e is Ellipsis:
                d += ndim - consumed
                continue
            if d == dim:
                e_dim, entry = e, i
            d += 1
        if e_dim is None:
            return dim, 0, None
        if e_dim.step not in (None, 1) or not (e_dim.start is None or isinstance(e_dim.start, int)):
            return "a slice with a step or a run-time start"
        start = e_dim.start or 0
        if start < 0:
            return "a slice that starts from the end"
        stop, trim = e_dim.stop, None
        if isinstance(stop, int) and stop > 0:
            if not (g.seq.static and stop == g.seq.chunk_len):
                return f"a slice to the fixed length {stop}"
            trim = entry  # a static graph's trim to the local length
        return dim, start, trim
    if name in ("cat", "concat", "concatenate"):
        tensors = n.args[0]
        cat_dim = arg(n, 1, "dim", 0)
        if not isinstance(cat_dim, int) or cat_dim % ndim != dim or cur not in tensors:
            return "only a cat along the sequence dim runs on the whole sequence"
        before = tensors[: list(tensors).index(cur)]
        sizes = [shape_of(t)[dim] if shape_of(t) is not None else None for t in before]
        if any(not isinstance(s, int) for s in sizes):
            return "a cat after tensors of run-time length"
        return dim, -sum(sizes), None
    if name in _SCANS:
        sdim = arg(n, 1, "dim")
        if n.args[0] is not cur or not isinstance(sdim, int) or sdim % ndim != dim:
            return f"{name} along another dim"
        return dim, 0, None
    if name in vocab.ELEMENTWISE or name in _SHAPE_ONLY_CASTS:
        if len(shape_of(n) or ()) != ndim:
            return f"{name} changes the number of dims"
        return dim, 0, None
    return f"{name} is not one of the ops a causal region is built from"


def _flat_args(n: fx.Node) -> list[object]:
    out: list[object] = []
    for a in [*n.args, *n.kwargs.values()]:
        fx.node.map_aggregate(a, out.append)
    return out


def _is_length_scalar(a: fx.Node, seq: SequenceLength) -> bool | None:
    """``True``: ``a`` is exactly the local length; ``False``: a scalar computed from it; ``None``: neither."""
    v = _val(a)
    if not isinstance(v, (torch.SymInt, torch.SymFloat)) or not seq.involves(v):
        return None
    return seq.is_length(v)


# -- check -----------------------------------------------------------------------------------------------------
_SCALES = {"truediv", "div", "mul", "neg", "to", "float", "double", "type", "clone", "detach", "contiguous"}


def _partial_sum_reason(n: fx.Node, data: frozenset) -> str | None:
    """``None`` when every path from ``n`` to the graph's output only scales it by values that are not sharded
    data (or adds other partial sums, or leaves unchanged), else why the sum is not a partial sum."""
    seen, queue = {n}, [n]
    while queue:
        t = queue.pop()
        for u in t.users:
            if u.op == "output":
                continue
            name = vocab.op_name(u)
            others = [i for i in u.all_input_nodes if i is not t]
            if name in _SCALES and not (name in ("truediv", "div") and u.args and u.args[0] is not t):
                if all(i not in data for i in others):
                    if u not in seen:
                        seen.add(u)
                        queue.append(u)
                    continue
            operands = [a for a in (*u.args, *u.kwargs.values()) if a is not t]
            if name in ("add", "sub", "iadd", "isub") and all(isinstance(a, fx.Node) and a in seen for a in operands):
                if u not in seen:
                    seen.add(u)
                    queue.append(u)
                continue
            return (
                f"its result is used by {name} (node {u.name}), not only scaled into the graph's output, so the "
                "ranks' values would not add up to the one-process value"
            )
    return None


def check_op(op: MixingOp, data: frozenset) -> tuple[Action, str]:
    """``(action, reason)`` for a mixing op: how it is accounted for, or why it is refused."""
    if op.accounted == "partial_sum":
        reason = _partial_sum_reason(op.node, data)
        return ("partial_sum", "") if reason is None else ("refused", f"{op.what}: {reason}")
    if op.accounted:
        return op.accounted, ""
    if op.region is not None:
        return "gathered", ""
    reason = op.what + (f"; it cannot run on the whole sequence: {op.problem}" if op.problem else "")
    return "refused", reason


#: Where transformers builds a flex_attention BlockMask from packed sequences it detects in ``position_ids``.
_TRANSFORMERS_MASKS = "transformers/masking_utils.py"


def _fix(op: MixingOp) -> str:
    if op.source and _TRANSFORMERS_MASKS in op.source.replace("\\", "/"):
        return (
            "this is transformers' mask code for attn_implementation='flex_attention', which reads the packed "
            "documents from this rank's position_ids only: load the model with attn_implementation='sdpa' (the "
            "same causal same-document masks, which cpcompile makes exact across ranks)"
        )
    if op.kind == "custom":
        return (
            f"if {op.op} computes every token's output from that token's inputs, list it: "
            f'cpcompile.backend(cp_group, per_token_ops=("{op.op}",)); otherwise compute it with torch ops '
            "cpcompile can see, or run this model without context parallelism"
        )
    if op.kind in ("reduction", "loss", "selection"):
        return (
            "compute per-token outputs in the model and reduce them outside it over the whole sequence "
            "(cpcompile.gather(out, dim=1), or a loss summed over tokens divided by the num_items_in_batch "
            "cpcompile.shard passes), or run this model without context parallelism"
        )
    return (
        "write the op as a causal conv1d (padding kernel-1, then [..., :T]), a left pad then a slice, or a forward "
        "cumsum, which cpcompile runs on the whole sequence; or run this model without context parallelism"
    )


def _refusal(op: MixingOp, reason: str) -> UnsupportedMixingError:
    code = f" Model code: {op.source}." if op.source else ""
    return UnsupportedMixingError(
        f"cpcompile cannot run {op.op} at {op.where} across CP ranks: {reason}.{code} Under context parallelism "
        f"each rank holds only some tokens of the sequence, and this op would combine them without the others'. "
        f"Fix: {_fix(op)}"
    )


# -- rewrite ---------------------------------------------------------------------------------------------------
def rewrite_region(region: CausalRegion, site: str, ctx: PassContext, lengths: frozenset) -> fx.Node:
    """Run ``region`` on the whole sequence and keep this rank's tokens; return the node that replaces its end.

    Before (LFM2's short conv)::

        y = conv1d(x, w, padding=k - 1, groups=C)[..., :T]      # x: [B, C, T_local]

    After::

        order, local = cpcompile::sequence_order(x.detach(), dim, N, site)    # plan: global order, own tokens
        x_all = all_gather_seq(x, dim, N, group).index_select(dim, order)      # [B, C, N * T_local], token order
        y_all = conv1d(x_all, w, padding=k - 1, groups=C)[..., :x_all.size(dim)]
        y = y_all.index_select(dim, local)                                     # this rank's tokens

    ``lengths``: the symbols of the local length; arguments of the region that are exactly the local length
    (the trim), and in a static graph the trims of :attr:`CausalRegion.trims`, become the gathered length.
    """
    graph = region.nodes[0].graph
    first, last = region.nodes[0], region.nodes[-1]
    with graph.inserting_before(first):
        full, local = ops.emit_sequence_gather(graph, region.operand, region.dim, ctx.cp_size, ctx.group_name, site)
        full_len = graph.call_method("size", (full, region.dim))
    env: dict[fx.Node, fx.Node] = {region.operand: full}

    def remap(a: fx.Node) -> fx.Node:
        if a in env:
            return env[a]
        v = _val(a)
        if isinstance(v, torch.SymInt) and _compat.sym_expr(v) in lengths:
            return full_len
        return a

    trims = dict(region.trims)
    for n in region.nodes:
        with graph.inserting_before(n):
            new = graph.node_copy(n, remap)
        for key in ("example_value", "val"):
            new.meta.pop(key, None)
        if n in trims:  # a static trim [..., :c] stops at the gathered length
            index = list(new.args[1]) if isinstance(new.args[1], tuple) else [new.args[1]]
            e = index[trims[n]]
            index[trims[n]] = slice(e.start, full_len, e.step)
            new.args = (new.args[0], tuple(index))
        env[n] = new
    with graph.inserting_after(env[last]):
        out = graph.call_method("index_select", (env[last], region.out_dim, local))
    out.meta.update({k: v for k, v in last.meta.items() if k in ("stack_trace", "nn_module_stack")})
    last.replace_all_uses_with(out)
    for n in reversed(region.nodes):
        graph.erase_node(n)
    return out


# -- entry point -----------------------------------------------------------------------------------------------
def _bytes(region: CausalRegion, cp_size: int) -> int:
    v = _val(region.operand)
    if not isinstance(v, torch.Tensor):
        return 0
    return (cp_size - 1) * size_hint(math.prod(v.shape)) * v.element_size()


def mixing_pass(gm: fx.GraphModule, ctx: PassContext, chunk_len: int | None) -> list[MixingReport]:
    """Find every mixing op of ``gm``, check it and rewrite the causal regions; return one report per op.

    ``ctx.refuse == "raise"`` raises :class:`UnsupportedMixingError` for the first op that cannot be made exact,
    before anything is rewritten; ``"report"`` only records it (inspection).
    """
    seq = sequence_length(gm, chunk_len)
    if seq is None:
        return []
    found = find_mixing_ops(gm, seq, ctx.options.per_token_ops)
    counters["mixing_ops_found"] += len(found)
    data = frozenset().union(*(graph_facts(g, seq).data for g in graph_modules(gm))) if found else frozenset()
    decided = [(op, *check_op(op, data)) for op in found]
    refused = [(op, reason) for op, action, reason in decided if action == "refused"]
    counters["mixing_refused"] += len(refused)
    if refused and ctx.refuse == "raise":
        raise _refusal(*refused[0])
    reports = []
    for op, action, reason in decided:
        nbytes = 0
        if action == "gathered":
            try:
                rewrite_region(op.region, f"{ctx.site_prefix}:{op.where}", ctx, seq.symbols)
            except Exception as e:  # noqa: BLE001 - re-raised with the pass's name
                raise RuntimeError(f"cpcompile mixing pass failed while rewriting {op.where}: {e}") from e
            nbytes = _bytes(op.region, ctx.cp_size)
        if action != "refused":
            counters[f"mixing_{action}"] += 1
        reports.append(
            MixingReport(ctx.graph_id, op.node.name, op.layer, op.op, op.kind, action, reason, op.source, nbytes)
        )
    if any(r.action == "gathered" for r in reports):
        finish(gm)
    return reports
