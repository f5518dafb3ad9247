"""Causal regions: ops that together run across this rank's tokens and those before them (a causal depthwise
``conv1d`` with its trim, a pad-and-slice token shift, a forward scan, a ``diff`` after the sequence's first token).
:func:`causal_region` finds the region that begins at a mixing op; :func:`rewrite_region` runs it on this rank's
tokens with a halo of the tokens before each of its runs when the region reads a bounded window that it pads with
zeros (a conv, a token shift), else on the all-gathered sequence in global token order, and takes this rank's
tokens back."""

from __future__ import annotations

import dataclasses
import hashlib
import math

import torch
import torch.fx as fx

from cpcompile import _compat, ops
from cpcompile.layouts import MAX_RUNS
from cpcompile.passes import vocabulary as vocab
from cpcompile.passes.common import PassContext, arg, index_dims
from cpcompile.passes.common import node_value as _val
from cpcompile.passes.mixing.graph import _SHAPE_ONLY_CASTS, _Graph, _index_entries, _seq_operands, _seq_tags
from cpcompile.passes.positions import SequenceLength
from cpcompile.passes.sequence_dims import shape_of

__all__ = ["CausalRegion", "causal_region", "rewrite_region"]


@dataclasses.dataclass(frozen=True)
class CausalRegion:
    """Ops that run on the whole sequence: from ``operand`` (``dim`` of the local length) to ``nodes[-1]``
    (``out_dim`` of the local length again), every output token reading only input tokens at or before it."""

    operand: fx.Node
    dim: int
    nodes: tuple[fx.Node, ...]
    out_dim: int
    #: ``(node, index entry)`` of slices whose stop is the static chunk length (a static graph's trim): they stop
    #: at the length the region runs on instead.
    trims: tuple[tuple[fx.Node, int], ...] = ()
    #: The number of tokens before it that an output token reads (``-lo`` of the window ``lo..hi``) when the region
    #: can run on this rank's tokens with a halo of that many tokens before each run (:func:`_halo_tokens`), else
    #: ``0``: the region runs on the whole sequence.
    halo: int = 0


_SCANS = {"cumsum", "cumprod", "logcumsumexp"}


def causal_region(start: fx.Node, g: _Graph) -> tuple[CausalRegion | None, str]:
    """The causal region that begins at the mixing op ``start``, or ``(None, why not)``.

    The region follows ``start``'s single use while the sequence dim does not have the local length: a causal
    ``conv1d`` (padding ``>= (kernel - 1) * dilation``) then the slice that trims it, a pad on the left then a
    slice, a slice then a ``cat`` after constants, a forward scan. Each step moves the window of input tokens an
    output token reads (``out[i]`` reads ``in[i + lo .. i + hi]``; a scan makes ``lo`` unbounded); the region is
    causal when ``hi <= 0``, and takes a halo of ``-lo`` tokens when :func:`_halo_tokens` allows.
    """
    seq = g.seq
    operands = _seq_operands(start, g)
    heads = {o: _first_token(o, g) for o in operands}
    operands = [o for o in operands if heads[o] is None or heads[o][0] not in operands]
    x = operands[0]
    tags = _seq_tags(x, g)
    dims = [d for d, t in enumerate(tags) if t and seq.is_length(shape_of(x)[d])]
    if len(operands) != 1 or len(dims) != 1:
        return None, "it reads more than one sequence-sharded tensor or sequence dim"
    dim, operand, n, cur = dims[0], x, start, x
    nodes: list[fx.Node] = []
    trims: list[tuple[fx.Node, int]] = []
    hi, los, heads_read = 0, [], False
    while True:
        head = _prepended_head(n, cur, dim, g)
        heads_read = heads_read or bool(head)
        step = _region_step(n, cur, dim, g, head[-1] if head else None)
        if isinstance(step, str):
            return None, f"{n.name}: {step}"
        dim, dlo, dhi, trim = step
        hi += dhi
        los.append((n, dlo))
        if trim is not None:
            trims.append((n, trim))
        nodes.extend(head)
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
    halo = 0 if heads_read else _halo_tokens(los, len(shape_of(operand) or ()), dims[0])
    return CausalRegion(operand, dims[0], tuple(nodes), dim, tuple(trims), halo), ""


#: ``(rank, sequence dim)`` of a region's input that takes a halo -> the dims to unsqueeze it at, in order, to the
#: ``[B, H, c, D]`` form of :func:`cpcompile.ops.halo_exchange` (the batch first, as every region's input has it).
_HALO_VIEWS = {(2, 1): (1, 3), (3, 1): (1,), (3, 2): (3,), (4, 2): ()}


def _halo_tokens(los: list[tuple[fx.Node, float]], ndim: int, dim: int) -> int:
    """The halo of a region whose ops, in order, move the first input token an output token reads by ``los``; ``0``
    when it must run on the whole sequence.

    A halo of ``-sum(los)`` tokens before each of this rank's runs gives every output token of the run what it
    reads in one process, except before global token 0, where the one-process model reads the region's padding:
    the halo holds zeros there. That is exact when the first op is the only one that reads before its input's
    start and pads with zeros (``conv1d``'s padding, a constant ``pad`` of value 0): every later op then sees the
    zeros as it sees the padding. A scan (unbounded window), a ``cat`` after constants, a ``diff``'s prepend, a pad
    of another value, or a second op that pads, run on the whole sequence; so does an input of another rank than
    :data:`_HALO_VIEWS` holds."""
    (first, lo0), rest = los[0], los[1:]
    if any(lo < 0 for _, lo in rest) or not math.isfinite(sum(lo for _, lo in los)) or lo0 >= 0:
        return 0
    name = vocab.op_name(first)
    if name == "pad" and arg(first, 3, "value", None) not in (None, 0, 0.0):
        return 0
    if name not in ("conv1d", "pad") or (ndim, dim) not in _HALO_VIEWS:
        return 0
    return int(-sum(lo for _, lo in los))


def _first_token(h: fx.Node, g: _Graph) -> tuple[fx.Node, int, list[fx.Node]] | None:
    """``(x, dim, nodes)`` when ``h`` is computed from the first token of ``x`` alone: ``x[..., :1]`` along its
    sequence dim ``dim``, then element-wise ops with values that are not sharded data (``position_ids[:, :1] - 1``),
    each used once. On the whole sequence these nodes read the global first token, which is never padding."""
    chain = []
    while vocab.op_name(h) != "getitem":
        if vocab.op_name(h) not in vocab.ELEMENTWISE and vocab.op_name(h) not in _SHAPE_ONLY_CASTS:
            return None
        inputs = [i for i in h.all_input_nodes if i in g.data]
        if len(inputs) != 1 or len(h.users) != 1:
            return None
        chain.append(h)
        h = inputs[0]
    x = h.args[0] if h.args else None
    if not isinstance(x, fx.Node) or x not in g.data or len(h.users) != 1:
        return None
    entries = _index_entries(h)
    tags, shape = _seq_tags(x, g), shape_of(x)
    if shape is None or any(not (isinstance(e, slice) or e is Ellipsis) for e in entries):
        return None
    rows = [r for r in index_dims(entries, len(shape)) if r.dim is not None and r.entry not in (Ellipsis, slice(None))]
    if len(rows) != 1 or not tags[rows[0].dim] or not g.seq.is_length(shape[rows[0].dim]):
        return None
    e = rows[0].entry
    if e.start not in (None, 0) or e.stop != 1 or e.step not in (None, 1):
        return None
    return x, rows[0].dim, [h, *reversed(chain)]


def _prepended_head(n: fx.Node, cur: fx.Node, dim: int, g: _Graph) -> list[fx.Node]:
    """The nodes of ``diff(cur, prepend=p)``'s ``p`` when ``p`` is computed from ``cur``'s first token along
    ``dim`` (:func:`_first_token`); they run on the whole sequence with the region. Else ``[]``."""
    if vocab.op_name(n) != "diff":
        return []
    prepend = arg(n, 3, "prepend")
    head = _first_token(prepend, g) if isinstance(prepend, fx.Node) else None
    return head[2] if head is not None and head[0] is cur and head[1] == dim else []


def _region_step(
    n: fx.Node, cur: fx.Node, dim: int, g: _Graph, head: fx.Node | None = None
) -> tuple[int, float, int, int | None] | str:
    """``(dim of the sequence in n's output, shift of the first and of the last input token read, index entry of a
    static trim)`` for one op of a region (the first shift ``-inf`` for a scan), or why it cannot be part of one.
    ``head``: an input computed from ``cur``'s first token (:func:`_prepended_head`), which runs in the region
    too."""
    name = vocab.op_name(n)
    others = [i for i in n.all_input_nodes if i is not cur and i is not head and i in g.data and any(_seq_tags(i, g))]
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
        return dim, -padding, -padding + (int(w[-1]) - 1) * int(dilation), None
    if name == "pad":
        pads = list(arg(n, 1, "pad", ()))
        mode = arg(n, 2, "mode", "constant")
        p = 2 * (ndim - 1 - dim)
        if mode != "constant" or n.args[0] is not cur or len(pads) <= p:
            return "only a constant pad runs on the whole sequence"
        return dim, -int(pads[p]), -int(pads[p]), None
    if name == "getitem":
        entries = _index_entries(n)
        if any(not (isinstance(e, slice) or e is Ellipsis) for e in entries) or n.args[0] is not cur:
            return "only slices run on the whole sequence"
        row = next((r for r in index_dims(entries, ndim) if r.dim == dim), None)
        if row is None or row.entry is Ellipsis:
            return dim, 0, 0, None  # the sequence dim is not indexed
        e_dim, entry = row.entry, row.position
        if e_dim.step not in (None, 1) or not (e_dim.start is None or isinstance(e_dim.start, int)):
            return "a slice with a step or a run-time start"
        start = e_dim.start or 0
        if start < 0:
            return "a slice that starts from the end"
        stop, trim = _constant(e_dim.stop), None
        if isinstance(stop, int) and stop > 0:
            if not (g.seq.by_size and stop == g.seq.chunk_len):
                return f"a slice to the fixed length {stop}"
            trim = entry  # a static graph's trim to the local length
        return dim, start, start, trim
    if name in vocab.CONCATS:
        tensors = n.args[0]
        cat_dim = arg(n, 1, "dim", 0)
        if not isinstance(cat_dim, int) or cat_dim % ndim != dim or cur not in tensors:
            return "only a cat along the sequence dim runs on the whole sequence"
        before = tensors[: list(tensors).index(cur)]
        sizes = [shape_of(t)[dim] if shape_of(t) is not None else None for t in before]
        if any(not isinstance(s, int) for s in sizes):
            return "a cat after tensors of run-time length"
        return dim, -sum(sizes), -sum(sizes), None
    if name == "diff":
        ddim, order, prepend = arg(n, 2, "dim", -1), arg(n, 1, "n", 1), arg(n, 3, "prepend")
        if n.args[0] is not cur or not isinstance(ddim, int) or ddim % ndim != dim or not isinstance(order, int):
            return "only a diff along the sequence dim runs on the whole sequence"
        if arg(n, 4, "append") is not None:
            return "a diff with append reads past the last token"
        before = 0
        if prepend is not None:
            p = shape_of(prepend)
            if p is None or not isinstance(p[dim], int) or (prepend in g.data and prepend is not head):
                return "a diff with a prepend of run-time length or of other sharded data"
            before = p[dim]
        return dim, -before, order - before, None
    if name in _SCANS:
        sdim = arg(n, 1, "dim")
        if n.args[0] is not cur or not isinstance(sdim, int) or sdim % ndim != dim:
            return f"{name} along another dim"
        return dim, -math.inf, 0, None
    if name in vocab.ELEMENTWISE or name in _SHAPE_ONLY_CASTS:
        if len(shape_of(n) or ()) != ndim:
            return f"{name} changes the number of dims"
        return dim, 0, 0, None
    return f"{name} is not one of the ops a causal region is built from"


def _constant(a: object) -> object:
    """``a``, or the int a node stands for when its value is a constant size (``x.shape[-1]`` of a tensor whose
    length Dynamo specialised)."""
    v = _val(a) if isinstance(a, fx.Node) else a
    if isinstance(v, torch.SymInt) and not _compat.free_symbols(v):
        return _compat.sym_hint(v)
    return v if isinstance(a, fx.Node) and type(v) is int else a


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


def rewrite_region(region: CausalRegion, site: str, ctx: PassContext, lengths: frozenset) -> fx.Node:
    """Run ``region`` across this rank's tokens and those before them and keep this rank's tokens; return the node
    that replaces its end. With :attr:`CausalRegion.halo` it runs on this rank's tokens and a halo before each run
    (:func:`_rewrite_with_halo`), else on the whole sequence.

    Before (LFM2's short conv)::

        y = conv1d(x, w, padding=k - 1, groups=C)[..., :T]      # x: [B, C, T_local]

    After, on the whole sequence (a region without a halo: a scan, a ``diff`` after the first token)::

        order, local = cpcompile::sequence_order(x.detach(), dim, N, site)    # plan: global order, own tokens
        x_all = all_gather_seq(x, dim, N, group).index_select(dim, order)      # [B, C, N * T_local], token order
        y_all = conv1d(x_all, w, padding=k - 1, groups=C)[..., :x_all.size(dim)]
        y = y_all.index_select(dim, local)                                     # this rank's tokens

    ``lengths``: the symbols of the local length; arguments of the region that are exactly the local length
    (the trim), and in a static graph the trims of :attr:`CausalRegion.trims`, become the length the region runs
    on.
    """
    graph = region.nodes[0].graph
    if region.halo:
        return _rewrite_with_halo(region, site, ctx, lengths)
    with graph.inserting_before(region.nodes[0]):
        full, local = ops.emit_sequence_gather(graph, region.operand, region.dim, ctx.cp_size, ctx.group_name, site)
    return _run_region_on(region, full, local, lengths)


def _rewrite_with_halo(region: CausalRegion, site: str, ctx: PassContext, lengths: frozenset) -> fx.Node:
    """Run ``region`` on this rank's tokens with the ``h = region.halo`` tokens before each of its runs.

    The halo is the sliding-window halo of attention sites (``cpcompile::halo_routing`` for a window of ``h + 1``
    tokens without documents, ``cpcompile::halo_exchange``: one all-to-all of only the tokens other ranks hold,
    from as many ranks as a run shorter than ``h`` needs; its backward returns their gradients to their owners),
    into ``MAX_RUNS * h`` slots so that the graph's shapes do not depend on the batch. ``cpcompile::
    region_halo_order`` then lays out ``[halo_1 | run_1 | halo_2 | run_2 | ... | unused]`` (zeros before global
    token 0 and in the unused places; a halo token this rank holds itself is read from its own tokens) and the
    region's own ops run once on it (``c + MAX_RUNS * h`` tokens instead of ``N * c``): an output token of a run
    reads only its run and the ``h`` tokens before it. Packed documents do not cut the halo: the region does not
    restart at a document in one process either. After (LFM2's short conv, ``h = k - 1``)::

        x4 = x.unsqueeze(3)                                                    # [B, C, c, 1]
        send_slots, counts = cpcompile::halo_routing(x4.detach(), site)
        halo = cpcompile::halo_exchange(x4, send_slots, counts, site).squeeze(3)          # [B, C, S]
        order, keep = cpcompile::region_halo_order(x4.detach(), site)
        x_h = cat([x, halo, zeros_like(x[..., :1])], 2).index_select(2, order)  # [B, C, c + S]
        y_h = conv1d(x_h, w, padding=k - 1, groups=C)[..., :x_h.size(2)]
        y = y_h.index_select(2, keep)                                          # this rank's tokens

    Cost: the halo's bytes (at most ``h`` tokens per run, ``CommStats.sequence_halo_bytes``) instead of an
    all-gather of ``(N - 1) * c`` tokens.
    """
    graph, x, dim = region.nodes[0].graph, region.operand, region.dim
    value = _val(x)
    ndim = value.dim()
    spec = ops.SiteSpec(
        site="",
        layer=site,
        group_name=ctx.group_name,
        cp_size=ctx.cp_size,
        cp_rank=ctx.cp_rank,
        documents=False,
        window=region.halo + 1,
        kernel="dense",
        needs_grad=bool(value.requires_grad),
        exchange="sequence_halo",
        halo_slots=MAX_RUNS * region.halo,
    )
    digest = hashlib.sha1(repr(spec).encode()).hexdigest()[:8]
    spec = dataclasses.replace(spec, site=f"{site}#{digest}")
    ops.register_site(spec)
    unsqueezed = _HALO_VIEWS[(ndim, dim)]
    with graph.inserting_before(region.nodes[0]):
        x4 = x
        for d in unsqueezed:
            x4 = graph.call_method("unsqueeze", (x4, d))
        halo, order, keep = ops.emit_region_halo(graph, x4, spec)
        for d in reversed(unsqueezed):
            halo = graph.call_method("squeeze", (halo, d))
        zero = graph.call_function(torch.zeros_like, (graph.call_method("narrow", (x, dim, 0, 1)),))
        buffer = graph.call_function(torch.cat, ([x, halo, zero],), {"dim": dim})
        arranged = graph.call_method("index_select", (buffer, dim, order))
    return _run_region_on(region, arranged, keep, lengths)


def _run_region_on(region: CausalRegion, source: fx.Node, keep: fx.Node, lengths: frozenset) -> fx.Node:
    """Copy ``region``'s ops onto ``source`` (its input laid out along ``region.dim``), the local length made
    ``source``'s, take the tokens at ``keep`` of the copy's end, and erase the original ops; return that node."""
    graph = region.nodes[0].graph
    last = region.nodes[-1]
    with graph.inserting_before(region.nodes[0]):
        full_len = graph.call_method("size", (source, region.dim))
    env: dict[fx.Node, fx.Node] = {region.operand: source}

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
        if n in trims:  # a static trim [..., :c] stops at the length the region runs on
            index = list(new.args[1]) if isinstance(new.args[1], tuple) else [new.args[1]]
            e = index[trims[n]]
            index[trims[n]] = slice(e.start, full_len, e.step)
            new.args = (new.args[0], tuple(index))
        env[n] = new
    with graph.inserting_after(env[last]):
        out = graph.call_method("index_select", (env[last], region.out_dim, keep))
    # the value of the end it replaces (this rank's tokens, the same shape): a region that reads it next sees it
    out.meta.update(
        {k: v for k, v in last.meta.items() if k in ("stack_trace", "nn_module_stack", "example_value", "val")}
    )
    last.replace_all_uses_with(out)
    for n in reversed(region.nodes):
        graph.erase_node(n)
    return out
