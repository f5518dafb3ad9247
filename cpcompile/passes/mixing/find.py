"""Find: every op of a graph that reads a sequence-sharded tensor and mixes its tokens (:func:`find_mixing_ops`).

Each op becomes a :class:`MixingOp` of a kind read from its vocabulary entry
(:mod:`cpcompile.passes.vocabulary`). A sum over the sequence, MoE dispatch bookkeeping (expert ids, the
permutation that sorts them, rows moved by it) and listed per-token custom ops come marked as accounted for;
convolutions, scans and shifts come with the causal region that would run them on the whole sequence
(:func:`cpcompile.passes.mixing.regions.causal_region`), or the problem why there is none.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
import torch.fx as fx

from cpcompile import _compat, cores
from cpcompile.passes import vocabulary as vocab
from cpcompile.passes.common import FoundAt, arg, dim_set, graph_modules, index_dims, size_hint, source_line
from cpcompile.passes.common import node_value as _val
from cpcompile.passes.mixing.graph import _SHAPE_ONLY_CASTS, _Graph, _index_entries, _seq_operands, _seq_tags
from cpcompile.passes.mixing.pooling import pooled_picks
from cpcompile.passes.mixing.regions import CausalRegion, causal_region
from cpcompile.passes.positions import SequenceLength, graph_facts
from cpcompile.passes.positions.graph import scalar_value
from cpcompile.passes.sequence_dims import Tags, is_nested, sequence_dims, shape_of

__all__ = ["MixingOp", "find_mixing_ops"]

#: What an op does along the sequence.
Kind = Literal[
    "convolution", "scan", "shift", "reduction", "loss", "contraction", "order", "selection", "index", "custom",
    "head_parallel", "state_passing", "unknown",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class MixingOp(FoundAt):
    """One op that reads a tensor with a sequence dim and combines (or moves) values of different tokens."""

    node: fx.Node
    kind: Kind
    #: The op's vocabulary name (``conv1d``, ``cumsum``, ``mylib::scan``).
    op: str
    #: Qualified name of the module that made the call, or ``""``.
    layer: str
    #: What it does along the sequence, in words.
    what: str
    #: ``partial_sum``/``mean_share``/``dispatch``/``per_token``/``pooled``/``head_parallel``/``replicated``/
    #: ``state_passing`` when the finder already knows it is accounted for.
    accounted: str = ""
    region: CausalRegion | None = None
    #: Why it cannot be run on the whole sequence (when a region was looked for and not found).
    problem: str = ""
    #: The sequence dims of the tensor it reads, when they are plain dims (not merged with others).
    seq_dims: tuple[int, ...] = ()
    #: ``mean_share``: the per-token tensor the loss's targets are a reshape of and its sequence dim (where the
    #: rewrite marks padding tokens ignored), when the targets are one.
    target_tokens: tuple[fx.Node, int] | None = None
    #: ``pooled`` argmax: the getitems that pick rows of per-token data at the tokens it chose
    #: (:func:`~cpcompile.passes.mixing.pooling.pooled_picks`).
    picks: tuple[fx.Node, ...] = ()
    #: ``head_parallel``/``replicated``/``state_passing``: the exchanges of its region that it counts (its end, and
    #: the exchanges into the region that it reads and no op reported before it counts).
    exchanges: tuple[fx.Node, ...] = ()
    #: ``head_parallel``/``replicated``/``state_passing``: what each rank runs the region on (:data:`SPLITS`).
    split: str = ""

    @property
    def source(self) -> str:
        """The model's source line that made the op (``file:line: code``), from Dynamo's stack trace."""
        return source_line(self.node)


def _reduced_seq_dims(n: fx.Node, name: str, tags: Tags) -> set[int]:
    """The sequence dims (by ``tags``, of its input) that ``n``, one of the ops of
    :data:`~cpcompile.passes.vocabulary.DIM_REDUCTIONS`, runs along."""
    pos, kw, default, _ = vocab.DIM_REDUCTIONS[name]
    if name in ("histc", "bincount"):
        return {d for d, t in enumerate(tags) if t}
    dims = arg(n, 1 + pos, kw, default)
    if name in ("max", "min") and len(n.args) > 1 and isinstance(n.args[1], fx.Node):
        return set()  # the element-wise form max(a, b)
    reduced = dim_set(dims, len(tags))
    return {d for d, t in enumerate(tags) if t and (reduced is None or d in reduced)}


# -- MoE dispatch: expert ids and the index tensors that move rows by them -------------------------------------
def _expert_ids(g: fx.GraphModule, seq: SequenceLength, tags: dict) -> frozenset:
    """Nodes holding MoE expert ids: the indices of a ``topk``/``argmax`` over a dim that is not a sequence dim
    (of an input whose dims are known), what reshapes, casts and sorts (values) make of them, and their one-hot
    maps (``one_hot(ids)``, ``zeros(...).scatter_(expert_dim, ids, True)``)."""

    def reduces_seq(n: fx.Node, name: str) -> bool:
        t = tags.get(n.args[0]) if n.args and isinstance(n.args[0], fx.Node) else None
        return not isinstance(t, tuple) or is_nested(t) or bool(_reduced_seq_dims(n, name, t))

    ids: set[fx.Node] = set()
    for n in g.graph.nodes:
        name = vocab.op_name(n) if n.op in ("call_function", "call_method") else ""
        first = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        if name == "getitem" and first is not None and isinstance(n.args[1], int):
            src = vocab.op_name(first) if first.op in ("call_function", "call_method") else ""
            if src == "topk" and n.args[1] == 1 and not reduces_seq(first, "topk"):
                ids.add(n)
            elif src in ("sort",) and n.args[1] == 0 and first.args and first.args[0] in ids:
                ids.add(n)
        elif name in ("argmax", "argmin") and not reduces_seq(n, name):
            ids.add(n)
        elif name == "one_hot" and first in ids:
            ids.add(n)
        elif name in ("scatter", "scatter_") and arg(n, 2, "index") in ids:
            # a one-hot routing map: True at each token's experts, written along the expert dim (torchtitan)
            t = tags.get(first) if first is not None else None
            dim = arg(n, 1, "dim")
            if isinstance(t, tuple) and not is_nested(t) and isinstance(dim, int) and not t[dim % len(t)]:
                ids.add(n)
        elif (name in vocab.RESHAPE or name in _SHAPE_ONLY_CASTS) and first in ids:
            ids.add(n)
    return frozenset(ids)


def _sorts_for_dispatch(n: fx.Node, expert_ids: frozenset) -> bool:
    """Whether a ``sort``/``argsort`` only orders rows for a dispatch: it sorts expert ids, or only its permutation
    is used (the sorted values themselves never become data: ``_, perm = sort(router_scores)``)."""
    if (n.args and n.args[0] in expert_ids) or vocab.op_name(n) == "argsort":
        return True
    return all(vocab.op_name(u) == "getitem" and u.args[1] == 1 for u in n.users)


def _is_node_in(index_arg: object, nodes: set) -> bool:
    """Whether a setitem's index is one of ``nodes`` (an index may also be a slice, a tuple or a constant)."""
    return isinstance(index_arg, fx.Node) and index_arg in nodes


#: Ops that hand an index tensor on with the same values per row: casts, copies and broadcasts over the features
#: (``perm.reshape(-1, 1).expand(-1, D)``: a ``scatter_add`` index, torchtitan's MoE combine).
_INDEX_LAYOUT = _SHAPE_ONLY_CASTS | (vocab.LAYOUT - {"repeat", "tile", "repeat_interleave"})


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
            elif name in vocab.ELEMENTWISE or name in vocab.RESHAPE or name in _INDEX_LAYOUT:
                tensors = [i for i in n.all_input_nodes if isinstance(_val(i), torch.Tensor)]
                found = bool(tensors) and all(i in index for i in tensors)
            elif name == "setitem" and first is not None and len(n.args) > 1 and _is_node_in(n.args[1], index):
                if first not in index:
                    index.add(first)
                    changed = True
            if found:
                index.add(n)
                changed = True
    return frozenset(index)


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
    if name in vocab.ROW_MOVE_OPS:
        return _check_index(n, name, x, g, found)
    if "::" in name:
        if name in g.per_token:
            return found("custom", f"the custom op {name}, listed as per-token", accounted="per_token")
        return found("custom", f"the custom op {name} takes sequence-sharded tensors and cpcompile cannot see into it")
    if name in vocab.INDEX_MASKS:
        if seq_dims & {len(tags) - 2, len(tags) - 1}:
            return found("index", f"{name} zeroes elements by their index along the sequence (the local index)")
        return None
    if name in vocab.VMAP_DIMS:
        return None
    if g.heads and name in vocab.SPLITS:  # pieces of the rank's heads, by their local index: not the model's
        pos, kw, default = vocab.SPLITS[name]
        dim = arg(n, 1 + pos, kw, default)
        if not isinstance(dim, int) or (tags and tags[dim % len(tags)]):
            return found("selection", f"{name} splits the heads by their index on this rank")
        return None
    if name in vocab.ELEMENTWISE or name in vocab.LAYOUT or name in vocab.RESHAPE or name in vocab.SPLITS:
        if name in ("repeat", "tile") and n.args[0] is x:
            sizes = list(n.args[1:]) if not isinstance(n.args[1], (tuple, list)) else list(n.args[1])
            lead = len(sizes) - len(tags)
            if any(sizes[lead + d] != 1 for d in seq_dims if lead + d >= 0):
                return found("shift", f"{name} repeats the sequence")
        if name == "repeat_interleave":
            return _check_repeat_interleave(n, name, x, operands, tags, found, g.heads)
        return None
    if name in vocab.FEATURE_REDUCTIONS:
        return _check_feature(n, name, x, tags, found)
    if name in ("getitem", "setitem") or name in vocab.ROW_MOVES:
        return _check_index(n, name, x, g, found)
    if name in ("narrow", "slice"):
        return _check_narrow(n, x, tags, g, found)
    if name in vocab.LOSSES:
        return _check_loss(n, name, found, g)
    if name in vocab.DIM_REDUCTIONS:
        _, _, _, kind = vocab.DIM_REDUCTIONS[name]
        if not _reduced_seq_dims(n, name, tags):
            return None
        if name in vocab.DISPATCH and x in g.expert_ids:
            return found("order", f"{name} of MoE expert ids over tokens x top_k", accounted="dispatch")
        if name == "sum" and x in g.expert_ids:
            op = found("order", "sum of a one-hot map of MoE expert ids over tokens", accounted="dispatch")
            plain = () if any(is_nested(t) for t in tags if t) else tuple(sorted(seq_dims))
            return dataclasses.replace(op, seq_dims=plain)
        if name in ("sort", "argsort") and _sorts_for_dispatch(n, g.expert_ids):
            what = "sort of the rows for a dispatch (only the permutation is used)"
            return found("order", what, accounted="dispatch")
        if kind == "reduction" and name in ("sum", "nansum"):
            return found("reduction", f"{name} over the sequence", accounted="partial_sum")
        return found(kind, f"{name} along the sequence")
    if name in vocab.CONTRACTIONS:
        return _check_contraction(n, name, g, found)
    if name in vocab.MATRIX_OPS:
        matrices = any(any(_seq_tags(i, g)[-2:]) for i in operands)  # the dims it solves along
        return found("contraction", f"{name} solves along the sequence dim") if matrices else None
    if name in vocab.GROUPED_MATMULS:
        if n.args and n.args[0] is x and len(operands) == 1:
            return None  # this rank's dispatched rows, each times its expert's weight
        return found("contraction", f"{name} with sequence-sharded weights")
    if name in vocab.CONVOLUTIONS:
        spatial = {d for d in seq_dims if d >= 2}
        if n.args[0] is x and not spatial:
            return None
        return found("convolution", f"{name} along the sequence")
    if name == "pad":
        pads = list(arg(n, 1, "pad", ()))
        padded = {len(tags) - 1 - p // 2 for p, v in enumerate(pads) if v != 0}
        return found("shift", "pads the sequence") if padded & seq_dims else None
    if name in vocab.CONCATS:
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


def _check_repeat_interleave(n, name, x, operands, tags, found, blocks: bool = False) -> MixingOp | None:
    """``repeat_interleave(input, repeats, dim=None)`` keeps the tokens apart along a dim that is not a sequence
    dim (K/V heads); along the sequence (or with per-token ``repeats``) it moves every token after the first
    repeated one, and without a dim it flattens the sequence. ``blocks``: the tagged dims are held in contiguous
    blocks, one per rank, in order (the heads of a head-parallel region), so a constant number of repeats along one
    maps a rank's block onto its block of the output (key heads repeated to their value heads)."""
    dim = arg(n, 2, "dim")
    if not isinstance(dim, int):
        return found("selection", f"{name} without a dim flattens the sequence")
    if blocks and arg(n, 0, "input") is x and len(operands) == 1 and isinstance(arg(n, 1, "repeats"), int):
        return None
    if arg(n, 0, "input") is not x or len(operands) > 1 or tags[dim % len(tags)]:
        return found("selection", f"{name} repeats tokens along the sequence, which moves the tokens after them")
    return None


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
        if name == "setitem" and (base not in g.data or not seq_dims):
            return None
        # slices and ints: the whole sequence dim keeps every token's elements its own (a write of some features
        # of every token included); a part of it picks tokens by their local index
        verb = "writes" if name == "setitem" else "picks"
        for e, _, d, _ in index_dims(entries, len(tags)):
            if e is Ellipsis or d not in seq_dims:
                continue
            if not isinstance(e, slice):
                return found("selection", f"{verb} token {e!r} of the sequence")
            if not _full_slice(e, shape_of(base)[d], g.seq):
                if not any(g.seq.involves(s) for s in shape_of(n) or ()):  # a few tokens picked out
                    return found("selection", f"{verb} tokens {_slice_text(e)} of the sequence")
                return found("shift", f"slices the sequence dim with {_slice_text(e)}")
        return None
    move = vocab.row_move_args(n)  # index_put, take_along_dim: their own arguments, read positionally
    _, self_arg, dim, index, _ = move or (name, n.args[0], arg(n, 1, "dim"), arg(n, 2, "index"), None)
    if isinstance(index, fx.Node) and index in g.dispatch_index:
        return found("order", f"{name} of rows by the MoE dispatch permutation", accounted="dispatch")
    if isinstance(dim, int) and tags and dim % len(tags) not in seq_dims and self_arg in g.data:
        return None
    if self_arg not in g.data and isinstance(dim, int) and name in ("index_select", "gather"):
        return None  # a table (not data) looked up at per-token indices: torchtitan's rope_cache at positions
    return found("selection", f"{name} along the sequence")


def _check_narrow(n, x, tags, g: _Graph, found) -> MixingOp | None:
    """``x.narrow(dim, start, length)`` keeps the tokens apart along a dim that is not a sequence dim, and along
    one when it keeps the whole dim: start 0 and ``length`` the dim's size, also when written with sizes of other
    inputs of the local length (IBM fms's RoPE: ``freqs.narrow(1, freqs.size(1) - q.size(1), q.size(1))``, the
    cache looked up at ``position_ids`` and ``q`` from ``input_ids``: two symbols of one length, guarded equal by
    :func:`_same_length`). A part of the sequence picks tokens by their local index. ``aten.slice(x, dim, start,
    end, step)`` (traced from torch's own scans) is read as the index entry ``start:end:step`` along ``dim``
    (:func:`_full_slice`)."""
    name = vocab.op_name(n)
    dim = arg(n, 1, "dim", 0 if name == "slice" else None)
    if n.args[0] is not x or not isinstance(dim, int) or not tags:
        return found("selection", f"{name} of sharded data along an unknown dim")
    dim %= len(tags)
    if not tags[dim]:
        return None
    size = shape_of(x)[dim]
    if name == "slice":
        entry = slice(arg(n, 2, "start"), arg(n, 3, "end"), arg(n, 4, "step", 1))
        if _full_slice(entry, size, g.seq):
            return None
    else:
        start, length = scalar_value(arg(n, 2, "start")), scalar_value(arg(n, 3, "length"))
        if _same_length(start, 0, g.seq) and _same_length(length, size, g.seq):
            return None
    return found("selection", f"{name} picks tokens of the sequence by their local index")


def _same_length(a: object, b: object, seq: SequenceLength) -> bool:
    """Whether sizes ``a`` and ``b`` are equal at every call of the graph: statically, or, when every symbol they
    involve stands for the local length (every per-token tensor ``shard`` hands the model has it; Dynamo may give
    each input a symbol of its own), by a shape guard that they are equal (a call where they differ recompiles)."""
    if not isinstance(a, (int, torch.SymInt)) or not isinstance(b, (int, torch.SymInt)):
        return False
    if _compat.statically_true(a == b):
        return True
    symbols = _compat.free_symbols(a) | _compat.free_symbols(b)
    return bool(symbols) and symbols <= seq.symbols and _compat.guard_equal(a, b)


def _slice_text(e: slice) -> str:
    parts = [str(_val(p) if isinstance(p, fx.Node) else p) if p is not None else "" for p in (e.start, e.stop)]
    return "[" + ":".join(parts) + (f":{e.step}" if e.step not in (None, 1) else "") + "]"


def _full_slice(e: slice, size: object, seq: SequenceLength) -> bool:
    """Whether index entry ``e`` keeps every element of a dim of ``size`` in order: ``:``, ``0:T``, and the last
    ``T`` of ``T`` rows (x-transformers' ``freqs[:, -seq_len:]``), also when ``T`` is the size of another input
    of the local length (:func:`_same_length`)."""
    if e.step not in (None, 1):
        return False
    start, stop = scalar_value(e.start), scalar_value(e.stop)
    if not (start is None or _same_length(start, 0, seq)):
        ints = isinstance(start, (int, torch.SymInt))
        if not (ints and (_compat.statically_true(start + size <= 0) or _same_length(-start, size, seq))):
            return False
    return stop is None or _compat.statically_true(stop >= size) or _same_length(stop, size, seq)


#: Losses whose mean over tokens becomes this rank's share of the global mean (``mean_share``): their mean divides
#: by the number of targets that are not ``ignore_index``, so the share is the sum over this rank's tokens divided
#: by that count over every rank. name -> position of ``ignore_index`` among the arguments after the input.
MEAN_SHARE_LOSSES = {"cross_entropy": 3, "nll_loss": 3}


def _check_loss(n, name, found, g: _Graph) -> MixingOp | None:
    pos, kw = vocab.LOSSES[name]
    reduction = arg(n, 1 + pos, kw, "mean")
    if reduction == "none":
        return None
    if reduction == "sum":
        return found("loss", f"{name}(reduction='sum') over the tokens", accounted="partial_sum")
    if reduction == "mean" and name in MEAN_SHARE_LOSSES:
        problem = _mean_share_problem(n)
        if problem is None:
            op = found("loss", f"{name}(reduction='mean') over the tokens", accounted="mean_share")
            return dataclasses.replace(op, target_tokens=_target_tokens(arg(n, 1, "target"), g))
        return found("loss", f"{name}(reduction='mean') averages over this rank's tokens only, and {problem}")
    return found("loss", f"{name}(reduction={reduction!r}) averages over this rank's tokens only")


#: Ops that hand a tensor on with its elements in the same (row-major) order.
_SAME_ORDER = frozenset({"view", "reshape", "flatten", "contiguous", "long", "to", "int", "clone"})


def _target_tokens(target: object, g: _Graph) -> tuple[fx.Node, int] | None:
    """The per-token tensor ``target`` is a reshape of (``targets.view(-1)`` of ``[B, T]`` targets) and its one
    sequence dim, or ``None``."""
    t = target
    while isinstance(t, fx.Node):
        tags = _seq_tags(t, g)
        if sum(1 for x in tags if x) == 1 and len(tags) > 1:
            return t, tags.index(True)
        if t.op not in ("call_function", "call_method") or vocab.op_name(t) not in _SAME_ORDER or not t.args:
            return None
        t = t.args[0]
    return None


def _mean_share_problem(n: fx.Node) -> str | None:
    """Why the mean of a :data:`MEAN_SHARE_LOSSES` call cannot be counted over the ranks, or ``None``."""
    if arg(n, 2, "weight") is not None:
        return "its class weights make the mean's denominator a sum of the targets' weights"
    if arg(n, 3, "size_average") is not None or arg(n, 5, "reduce") is not None:
        return "it is called with the deprecated size_average/reduce arguments"
    target = _val(arg(n, 1, "target"))
    if not isinstance(target, torch.Tensor) or target.is_floating_point():
        return "its targets are class probabilities, whose mean counts every token"
    if not isinstance(arg(n, 4, "ignore_index", -100), int):
        return "its ignore_index is a run-time value"
    return None


#: Matrix products whose first argument is the bias added to the product of the next two.
_BIAS_FIRST = frozenset({"addmm", "addbmm", "baddbmm"})


def _check_contraction(n, name, g: _Graph, found) -> MixingOp | None:
    reason = found("contraction", f"{name} contracts the sequence dim")
    if name == "einsum":
        eq, *operands = n.args
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = list(operands[0])
        ranks = [len(shape_of(op)) if shape_of(op) is not None else None for op in operands]
        parsed = vocab.einsum_subscripts(eq, ranks)
        if parsed is None:
            return found("contraction", f"einsum {eq!r} of sequence-sharded operands (its subscripts cannot be read)")
        terms, out = parsed
        for term, op in zip(terms, operands):
            t = _seq_tags(op, g)
            if any(c not in out and d < len(t) and t[d] for d, c in enumerate(term)):
                return reason
        return None
    a, b = n.args[1:3] if name in _BIAS_FIRST else n.args[:2]  # the two factors, after the bias if any
    ta, tb = _seq_tags(a, g), _seq_tags(b, g)
    contracted = (len(ta) > 0 and ta[-1]) or (len(tb) >= 2 and tb[-2]) or (len(tb) == 1 and tb[0])
    return reason if contracted else None


def _pooling(ops: list[MixingOp], g: _Graph) -> list[MixingOp]:
    """``ops`` with every argmax over the sequence whose result only picks the winning token's rows of per-token
    data (:func:`~cpcompile.passes.mixing.pooling.pooled_picks`), and those picks, marked ``pooled``."""
    at = {op.node: i for i, op in enumerate(ops)}
    ops = list(ops)
    for op in list(ops):
        if op.op != "argmax" or op.accounted:
            continue
        picks = pooled_picks(op.node, g)
        if picks is None or any(p not in at for p in picks):
            continue
        what = "argmax along the sequence, whose result only picks the winning token's rows"
        ops[at[op.node]] = dataclasses.replace(op, accounted="pooled", what=what, picks=tuple(picks))
        for p in picks:
            pick = ops[at[p]]
            ops[at[p]] = dataclasses.replace(pick, accounted="pooled", what=f"{pick.what}, picked by {op.node.name}")
    return ops


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
        heads, whole = _head_parallel_regions(g)  # head-parallel regions: their ends are reported, not their ops
        in_region.update(whole)
        ops: list[MixingOp] = []
        for n in g.graph.nodes:
            if n.op not in ("call_function", "call_method", "call_module") or n in info.mask_only or n in in_region:
                continue
            if n not in facts.live:
                continue  # dead code Dynamo keeps (``max_pos = t.max() + 1`` never read): it changes no result
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
            ops.append(op)
        # a selection of the first token that a region found later reads (a diff's prepend) runs in that region
        kept = [op for op in _pooling(ops, info) if op.region is not None or op.node not in in_region]
        kept += [op for op in heads if op.node in facts.live]
        order = {n: i for i, n in enumerate(g.graph.nodes)}
        found.extend(sorted(kept, key=lambda op: order[op.node]))
    return found


_INTO_HEADS = ("cpcompile::heads_order", "cpcompile::heads_from_sequence")
_FROM_HEADS = "cpcompile::sequence_from_heads"
_INTO_STATE = ("cpcompile::state_runs", "cpcompile::state_input")
_FROM_STATE = "cpcompile::state_output"


def _exchange_name(n: fx.Node) -> str:
    return vocab.op_name(n) if n.op == "call_function" else ""


def _head_parallel_regions(g: fx.GraphModule) -> tuple[list[MixingOp], set[fx.Node]]:
    """The head-parallel regions of ``g`` (:func:`_heads_regions`) and its state-passing ones
    (:func:`_state_regions`): the ops that report them and the nodes they hold."""
    heads, whole = _heads_regions(g)
    state, whole_state = _state_regions(g)
    return heads + state, whole | whole_state


def _reach(
    sources: list[fx.Node],
    back: str,
    whole: set[fx.Node],
    ends: list[fx.Node],
    leaks: list[fx.Node],
    core: dict[fx.Node, str] | None = None,
) -> None:
    """Add to ``whole`` ``sources`` and every node that reads them, directly or through others, stopping at the op
    ``back`` (the region's way back: added to ``ends``) and at the graph's output (the value that reaches it added to
    ``leaks``). With ``core``, every node reached gets the core of the first node that reached it (for messages)."""
    whole.update(sources)
    queue = list(sources)
    while queue:
        t = queue.pop()
        for u in t.users:
            if u in whole:
                continue
            if _exchange_name(u) == back:
                if u not in ends:
                    ends.append(u)
                continue
            if u.op == "output":
                leaks.append(t)
                continue
            if core is not None and t in core:
                core.setdefault(u, core[t])
            whole.add(u)
            queue.append(u)


def _state_regions(g: fx.GraphModule) -> tuple[list[MixingOp], set[fx.Node]]:
    """The state-passing regions of ``g`` (:mod:`cpcompile.cores`): every node that reads a
    ``cpcompile::state_runs`` or ``cpcompile::state_input`` output (the core on this rank's runs, the all-gather and
    fold of every run's state summary), up to the ``cpcompile::state_output`` of this rank's tokens' outputs. They
    are exact and not mixing ops: one ``state_passing`` op per ``state_output``, named after the core; a region whose
    values reach anything else (the graph's output without the way back) is one refused op."""
    starts = [n for n in g.graph.nodes if _exchange_name(n) in _INTO_STATE]
    if not starts:
        return [], set()
    whole: set[fx.Node] = set()
    ends: list[fx.Node] = []
    leaks: list[fx.Node] = []
    _reach(starts, _FROM_STATE, whole, ends, leaks)
    ops = []
    counted: set[fx.Node] = set()
    for n in ends:
        site = n.args[1] if len(n.args) > 1 else ""
        what = (
            f"runs {site} on this rank's tokens, started from every earlier run's state (one all-gather of "
            "fixed-size state summaries)"
        )
        op = _head_op(n, what, "state_passing", "state_passing")
        exchanges = _exchanges_of_call(n, counted)
        name = str(site).rpartition(".")[2] or "core"
        ops.append(dataclasses.replace(op, op=name, exchanges=exchanges, split=SPLITS["state_passing"]))
    for n in leaks:
        what = (
            f"is a value of a state-passing region that leaves it without {_FROM_STATE}; return the core's outputs only"
        )
        op = _head_op(n, what, "", "state_passing")
        ops.append(dataclasses.replace(op, problem="it is not brought back to this rank's tokens"))
    whole.update(ends)
    return ops, whole


#: What each rank runs a region of the recurrent cores on, by the region's action (``{dim}``: the dim of the heads
#: in the core's outputs).
SPLITS = {
    "head_parallel": "its heads (dim {dim}), every token",
    "replicated": "every head and token",
    "state_passing": "every head, its tokens",
}


def _exchanges_of_call(end: fx.Node, counted: set[fx.Node]) -> tuple[fx.Node, ...]:
    """The exchanges into the region of the call that ``end`` brings back: for a head-parallel end, the
    ``heads_from_sequence`` that share its token order (each call of a core makes its own ``heads_order``); for a
    state-passing end, the ``state_gather`` before it in the graph. Data flow alone does not tell them (a core
    writes its outputs in place, ``out[:, :, i] = ...``). Each exchange is counted once (added to ``counted``), by
    the first end of its call."""
    if _exchange_name(end) == _FROM_STATE:
        found = []
        for n in end.graph.nodes:
            if n is end:
                break
            if _exchange_name(n) == "cpcompile::state_gather" and n not in counted:
                found.append(n)
    else:
        order = end.args[1] if len(end.args) > 1 and isinstance(end.args[1], fx.Node) else None
        users = order.users if order is not None else {}
        found = [u for u in users if _exchange_name(u) == "cpcompile::heads_from_sequence" and u not in counted]
    counted.update(found)
    return tuple(found)


def _heads_regions(g: fx.GraphModule) -> tuple[list[MixingOp], set[fx.Node]]:
    """The head-parallel regions of ``g`` (:mod:`cpcompile.cores`): every node that reads, directly or through
    others, a ``cpcompile::heads_from_sequence`` (or ``heads_order``) output or a per-head parameter the replacement
    narrowed to the rank's heads (:func:`_per_head_slices`), up to the ``cpcompile::sequence_from_heads`` that
    brings the result back to this rank's tokens. These nodes run on the whole sequence of this rank's heads, as
    the one-process model runs them, when they treat the head dim as a batch dim, which
    :func:`_head_map_refusals` proves. One op per ``sequence_from_heads`` (``head_parallel``); each node that mixes
    heads is one refused op, and so is a region whose whole-sequence values reach anything else (the graph's output
    without the way back)."""
    starts = [n for n in g.graph.nodes if _exchange_name(n) in _INTO_HEADS]
    if not starts:
        return [], set()
    exchanges = [n for n in starts if _exchange_name(n) == "cpcompile::heads_from_sequence"]
    core = {n: str(n.args[5]) for n in exchanges}  # region node -> the core it runs in (for messages)
    whole: set[fx.Node] = set()
    ends: list[fx.Node] = []
    leaks: list[fx.Node] = []

    _reach(starts, _FROM_HEADS, whole, ends, leaks, core)
    seeds = _per_head_slices(g, whole, core)
    _reach([n for n in seeds if n not in whole], _FROM_HEADS, whole, ends, leaks, core)
    for n in exchanges:  # the head dim of the exchange's output (its ``head_dim`` argument)
        ndim = _val(n).dim()
        seeds[n] = tuple(d == arg(n, 3, "head_dim") % ndim for d in range(ndim))
    ops = _head_map_refusals(g, whole, seeds, core)
    counted: set[fx.Node] = set()
    for n in ends:
        site = n.args[5] if len(n.args) > 5 else ""
        what = f"runs {site} on the whole sequence for this rank's heads (one all-to-all per tensor each way)"
        accounted = "head_parallel"
        if cores.replicated(str(site)):
            what = f"runs {site} on the whole sequence on every rank (its input all-gathered), each keeping its tokens"
            accounted = "replicated"
        exchanges = (*_exchanges_of_call(n, counted), n)
        op = _head_op(n, what, accounted)
        split = SPLITS[accounted].format(dim=arg(n, 3, "head_dim") % _val(n).dim())
        ops.append(dataclasses.replace(op, op=str(site).rpartition(".")[2] or "core", exchanges=exchanges, split=split))
    for n in leaks:
        what = (
            "is a whole-sequence value of a head-parallel region that leaves it without "
            "cpcompile::sequence_from_heads; return the core's outputs only"
        )
        ops.append(dataclasses.replace(_head_op(n, what, ""), problem="it is not brought back to this rank's tokens"))
    whole.update(ends)
    return ops, whole


#: No size says that a dim holds heads (a rank's ``H / N`` is a constant, and so is the region's sequence for
#: :func:`sequence_dims`' purpose): the head dim is followed from the region's seeds only.
_HEADS = SequenceLength(frozenset(), None)


def _per_head_slices(g: fx.GraphModule, region: set[fx.Node], core: dict[fx.Node, str]) -> dict[fx.Node, Tags]:
    """The per-head parameters a replacement narrows to the rank's heads (SSD's ``A``, ``D``, ``dt_bias``, the
    selective scan's ``A``, ``D``, ``delta_bias``, WKV's ``time_decay``, ``time_first``), with the narrowed dim
    tagged: every ``narrow`` made by :mod:`cpcompile.cores` itself (its innermost frame) of a value outside
    ``region``. Each is entered in ``core`` as the core of the ``heads_order`` before it (every replacement
    computes its order first)."""
    seeds, site = {}, ""
    for n in g.graph.nodes:
        if n.op != "call_function" and n.op != "call_method":
            continue
        name = vocab.op_name(n)
        if name == "cpcompile::heads_order":
            site = str(arg(n, 3, "site", ""))
        if name != "narrow" or n in region:
            continue
        value, dim = _val(n), arg(n, 1, "dim")
        if isinstance(value, torch.Tensor) and isinstance(dim, int) and _innermost_file(n) == _CORES_FILE:
            seeds[n] = tuple(d == dim % value.dim() for d in range(value.dim()))
            core[n] = site
    return seeds


_CORES_FILE = cores.__file__


def _innermost_file(n: fx.Node) -> str:
    """The file of the innermost frame of ``n``'s recorded stack trace (``""`` without one)."""
    files = [x.strip() for x in (n.meta.get("stack_trace") or "").splitlines() if x.strip().startswith('File "')]
    return files[-1][len('File "') :].partition('"')[0] if files else ""


def _head_map_refusals(
    g: fx.GraphModule, region: set[fx.Node], seeds: dict[fx.Node, Tags], core: dict[fx.Node, str]
) -> list[MixingOp]:
    """One refused op for every node of ``region`` that mixes values along the head dim.

    The head dim is followed from ``seeds`` (the ``heads_from_sequence`` outputs at their ``head_dim``, the
    per-head parameters at their narrowed dim) by the rules that follow the sequence dim
    (:func:`~cpcompile.passes.sequence_dims.sequence_dims`: reshapes that split or merge it, transposes,
    element-wise broadcasting, the leading dims an op keeps), and every node is decided by the rules that decide
    whether an op keeps tokens apart (:func:`_classify`, the tables of :mod:`cpcompile.passes.vocabulary`), read
    for heads: a rank holds a contiguous block of them in order, so anything those rules call mixing along the
    sequence (a reduction, scan or norm over the head dim, a matmul or einsum contracting it, a merge of it with a
    dim then contracted, a selection or move across it, an op not known to keep it apart) mixes heads, whatever
    the sequence rules would account it as (a sum is no partial sum here), while a constant repeat of each head
    (key heads to their value heads) keeps them apart. Ops on sizes only take no tagged operand. A node that reads
    the head dim and whose value the rules cannot tag with it is refused too (:func:`_loses_heads`): what follows it
    could not be checked. One pass over the region's nodes.

    DTensor's sharding propagation (``Shard(head_dim)`` kept by an op's strategies) was not used: these are
    Dynamo's torch-level nodes (functions, methods, before AOTAutograd), for which DTensor has no rules, and its
    propagation needs a device mesh."""
    nodes = [n for n in g.graph.nodes if n in region]
    tags = sequence_dims(g, _HEADS, seeds, nodes)
    info = _Graph(_HEADS, frozenset(region), frozenset(), tags, frozenset(), frozenset(), frozenset(), heads=True)
    refused = []
    for n in nodes:
        if n in seeds or n.op not in ("call_function", "call_method", "call_module"):
            continue
        operands = _seq_operands(n, info)
        if not operands:
            continue
        name = vocab.op_name(n) if n.op != "call_module" else f"module {n.target}"
        core_name = core.get(n, "").rpartition(".")[2] or "a core"
        if _classify(n, name, operands, info) is not None:
            what = (
                f"{name} combines values of different heads (channels) inside the head-parallel region of "
                f"{core_name}, whose heads cpcompile::heads_from_sequence splits over the CP ranks"
            )
            refused.append(_head_op(n, what, ""))
        elif _loses_heads(n, operands, tags):
            what = (
                f"cpcompile cannot follow the head dim through {name} inside the head-parallel region of {core_name}, "
                "so it cannot prove that the ops after it keep the heads apart"
            )
            refused.append(_head_op(n, what, ""))
    return refused


def _loses_heads(n: fx.Node, operands: list[fx.Node], tags: dict) -> bool:
    """Whether ``n`` reads a head dim of more than one head and no dim of its value is known to hold heads (the
    rules could not follow the dim through it). A dim of one head (``N`` copies exchanged, one per rank) may go."""
    if not isinstance(_val(n), (torch.Tensor, tuple, list)):
        return False
    got = tags.get(n)
    if isinstance(got, tuple) and any(x is True or (isinstance(x, tuple) and any(x)) for x in got):
        return False
    for i in operands:
        t, shape = tags.get(i), shape_of(i)
        if isinstance(t, tuple) and not is_nested(t) and shape is not None:
            if any(tagged and size_hint(size) != 1 for tagged, size in zip(t, shape, strict=False)):
                return True
    return False


def _head_op(n: fx.Node, what: str, accounted: str, kind: Kind = "head_parallel") -> MixingOp:
    return MixingOp(node=n, kind=kind, op=vocab.op_name(n), layer=_compat.node_module_path(n), what=what,
                    accounted=accounted)  # fmt: skip
