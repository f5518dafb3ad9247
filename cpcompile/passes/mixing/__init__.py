"""Every op that mixes tokens along the sharded sequence: made exact across CP ranks, accounted for, or refused.

Under :func:`cpcompile.shard` a rank holds some tokens of every row. An op that combines values of different
tokens (a convolution along the sequence, a cumulative sum, a shift, a reduction, a matrix product over the
sequence) sees only this rank's tokens and is silently wrong unless something makes it see the others. The
attention pass rewrites SDPA, the one mixer it knows; this pass finds every other one, *on data*: it follows the
sequence dim of the sharded inputs (token ids, hidden states, masks) through the graph (views and reshapes that
split or merge it, transposes, element-wise ops; :func:`sequence_dims`) and looks at every op that reads a
tensor with a sequence dim (:mod:`cpcompile.passes.vocabulary` says which ops keep tokens apart). For each
mixing op (:class:`MixingOp`) :func:`check_op` decides:

* ``halo``: a causal region whose output tokens read at most ``h`` tokens before them and that pads with zeros
  (a causal depthwise ``conv1d`` with its trim, a pad-and-slice token shift): run on this rank's tokens with the
  ``h`` tokens before each of its runs, fetched with the sliding-window halo exchange (zeros before the first
  token, as the region's padding); the region's ops run once on ``c + MAX_RUNS * h`` tokens
  (:func:`rewrite_region`). Exact under every layout, packed documents included (the region does not restart at
  a document in one process either). Backward: the exchange returns the halo's gradients to their owners.
* ``gathered``: another causal region (:class:`CausalRegion`: a causal depthwise ``conv1d`` with its trim, a
  pad-and-slice token shift, a forward ``cumsum``, a ``diff`` whose ``prepend`` comes from the first token) is
  run on the whole sequence: its input is all-gathered in
  global token order, the original ops run on it, and this rank's tokens are taken back (:func:`rewrite_region`).
  Exact under every layout, packed documents included (the region does what the one-process model does on the
  whole row); padding tokens sit after every real token, so a causal region never lets them reach a real one.
  Backward: the all-gather's gradient is a sum reduce-scatter, which hands every token's owner the gradients
  all ranks computed for it.
* ``partial_sum``: a sum over the sequence (a loss with ``reduction="sum"``, a ``sum()``) whose result reaches
  the graph's output only through scaling by values that are not sharded data (``num_items_in_batch``, which
  ``shard`` passes) and additions of other partial sums: every rank's value is its tokens' share and the ranks'
  values add up to the one-process value, as ``shard``'s loss contract says. Partial sums may be added to each
  other. A mean over the sequence, a maximum or a sum used any other way is refused.
* ``mean_share``: a mean ``cross_entropy``/``nll_loss`` over the sequence (``reduction="mean"``, ``ignore_index``
  and ``label_smoothing`` included; not with class weights or probability targets) whose result reaches the
  output as a partial sum does: rewritten into this rank's share of the global mean, the loss summed over this
  rank's tokens divided by the targets that are not ``ignore_index`` counted on every rank (one int64 per rank,
  all-gathered in the graph and summed); the targets of padding tokens are made ``ignore_index`` first when the
  targets are a reshape of a per-token tensor. The loss the model returns is then this rank's share, as with
  transformers' loss; summed over the ranks it is the one-process mean (:func:`_share_of_mean`).
* ``dispatch``: MoE token bookkeeping (transformers' ``integrations/moe.py``): sorting the ``tokens x top_k``
  expert ids along the token dim, their histogram, moving rows by that permutation and back. Only expert ids
  (the indices of a ``topk`` or ``argmax`` over a dim that is not a sequence dim, reshaped, cast or sorted) and
  the permutation of a sort whose sorted values are not used (``_, perm = sort(scores)``) are bookkeeping; rows
  moved by any other index are a selection across tokens. That the rows are moved back before they leave the
  dispatch is not checked.
  A count of expert assignments over the tokens (``histc``/``bincount`` of expert ids, the ``sum`` of their
  one-hot map) is bookkeeping while it stays integer offsets and sizes of this rank's dispatch; a count that
  becomes a value (a cast to float, arithmetic with floats: a load-balancing loss) is refused.
* ``summed``: such a count also written in place into module state (torchtitan's running ``tokens_per_expert_E``
  for its load-balancing bias): the write gets the count summed over the CP group (a small all-gather of the
  per-expert counts, summed in rank order), so the state holds the whole sequence's count on every rank, as in
  the one-process model; the dispatch keeps this rank's count.
* ``pooled``: an ``argmax`` over the sequence whose result only picks the winning token's rows of per-token data
  (``x[rows, v.argmax(-1)]``: last-token pooling of transformers' ``*ForSequenceClassification``), and those
  picks: the ranks agree on the winner (largest value, the first in global order on ties, padding never) and every
  rank gets its rows; only the owner's row carries a gradient (:mod:`~cpcompile.passes.mixing.pooling`). An
  argmax used any other way (as a value, to index a table) is refused.
* ``per_token``: a custom op listed in :data:`cpcompile.passes.vocabulary.PER_TOKEN_OPS` or the backend's
  ``per_token_ops`` option.
* ``head_parallel``: the call of a known recurrent core (:mod:`cpcompile.cores`) that Dynamo traced through its
  head-parallel replacement: every node that reads a ``cpcompile::heads_from_sequence`` output, up to the
  ``cpcompile::sequence_from_heads`` that brings the result back, runs on the whole sequence of this rank's heads
  as the one-process model runs it; one report per ``sequence_from_heads``, named after the core. That the region
  is a map over the heads (channels) is proved, not trusted: the head dim is followed from the exchanges' outputs
  and the per-head parameters the replacement narrows, and a node that mixes along it (by the rules that decide
  the sequence dim) is refused, naming the op, the model's line and the fix
  (:func:`~cpcompile.passes.mixing.find._head_map_refusals`). A whole-sequence value that reaches the graph's
  output without the way back is refused.
* ``replicated``: a known layer that cannot be split by heads (MiniMax's lightning-attention layer, whose block
  loop sits between per-token projections and a norm across heads), traced through its replacement: its input is
  all-gathered in global token order through the heads exchange (``N`` copies), the library's layer runs on the
  whole sequence on every rank, and each rank keeps its own tokens' output: exact, at ``N`` times the layer's work.
  Its nodes are proved as a head-parallel region's are.
* ``state_passing``: the call of the gated delta rule, the SSD or the RG-LRU that Dynamo traced through its
  state-passing form (:mod:`cpcompile.cores`): every node that reads a ``cpcompile::state_runs`` or
  ``cpcompile::state_input`` output (the core on this rank's runs, the all-gather and fold of every run's state
  summary), up to the ``cpcompile::state_output`` of this rank's tokens' outputs, is exact and not a mixing op; one
  report per ``state_output``, named after the core.
* ``refused``: anything else that mixes: :class:`UnsupportedMixingError` at compile time, on every rank (each
  rank compiles the same graph), naming the layer, the op, the model's source line and the fix.

An op whose value nothing the graph returns or writes reads (:func:`~cpcompile.passes.positions.live_nodes`:
code Dynamo keeps, such as x-transformers' unused ``max_pos = t.max() + 1``) changes no result and is not
reported.

Masks the model builds from positions (they feed SDPA's ``attn_mask``) belong to the attention pass, which
replaces and checks them, and so do a BlockMask's block tables (the flex pass reads only the site's
``mask_mod``); this pass skips every node whose uses all end there.

find -> check -> rewrite: :func:`find_mixing_ops`, :func:`check_op`, :func:`rewrite_region`; :func:`mixing_pass` is
the entry point the backend runs on every graph (after the attention and positions passes) when the CP group
has more than one rank. ``cpcompile.passes.counters`` counts ``mixing_ops_found`` and ``mixing_<action>``.

Modules (every public name is importable from this package):

- :mod:`~cpcompile.passes.mixing.find`: :class:`MixingOp` and :func:`find_mixing_ops`, with the MoE dispatch
  bookkeeping (expert ids, the permutation that sorts them);
- :mod:`~cpcompile.passes.mixing.regions`: :class:`CausalRegion`, found (:func:`causal_region`) and run on the whole
  sequence (:func:`rewrite_region`);
- :mod:`~cpcompile.passes.mixing.pooling`: the ``pooled`` form, found (:func:`pooled_picks`) and exchanged
  (:func:`pool_across_ranks`);
- :mod:`~cpcompile.passes.mixing.check`: :func:`check_op` and the refusal message with its fix;
- :mod:`~cpcompile.passes.mixing.graph`: what the finder knows about one graph, read by find and regions;
- this module: :class:`MixingReport` and the entry point :func:`mixing_pass`.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.fx as fx

from cpcompile import _compat, ops  # noqa: F401 - ops registers cpcompile::real_tokens
from cpcompile.passes import vocabulary as vocab
from cpcompile.passes.common import PassContext, counters, finish, graph_modules, size_hint
from cpcompile.passes.common import node_value as _val
from cpcompile.passes.mixing.check import Action as Action
from cpcompile.passes.mixing.check import _refusal, check_op, count_uses
from cpcompile.passes.mixing.find import Kind as Kind
from cpcompile.passes.mixing.find import MixingOp, find_mixing_ops
from cpcompile.passes.mixing.pooling import pool_across_ranks, pooled_picks
from cpcompile.passes.mixing.regions import CausalRegion, rewrite_region
from cpcompile.passes.mixing.regions import causal_region as causal_region
from cpcompile.passes.positions import graph_facts, sequence_length

__all__ = [
    "EXCHANGED_ACTIONS",
    "REGION_ACTIONS",
    "CausalRegion",
    "MixingOp",
    "MixingReport",
    "check_op",
    "find_mixing_ops",
    "mixing_pass",
    "pool_across_ranks",
    "pooled_picks",
    "rewrite_region",
]


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
    #: ``gathered``, and the picks of ``pooled``: bytes this rank receives per call in the all-gather of the region's
    #: input or of the candidate rows (``(N - 1) * numel * itemsize``). ``0`` for ``halo``: its bytes depend on the
    #: batch's layout (``CommStats.sequence_halo_bytes``).
    all_gather_bytes_per_call: int = 0
    #: ``head_parallel``, ``replicated``: bytes this rank receives per call in the all-to-alls of the region's
    #: exchanges that the report counts (``(N - 1) / N * numel * itemsize`` each, into the heads and back). The
    #: backward receives the same again for each exchange whose input needs a gradient. ``state_passing`` counts
    #: its all-gather of state summaries in ``all_gather_bytes_per_call``: a size independent of the sequence.
    all_to_all_bytes_per_call: int = 0
    #: ``head_parallel``, ``replicated``, ``state_passing``: what each rank runs the region on
    #: (:data:`cpcompile.passes.mixing.find.SPLITS`: its heads and at which dim, or every head).
    split: str = ""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


#: The actions of a causal region (:func:`rewrite_region`), whose backward runs collectives.
REGION_ACTIONS = ("halo", "gathered")
#: The actions whose forward and backward exchange tokens or states across the CP ranks: the causal regions and the
#: recurrent cores' replacements (:mod:`cpcompile.cores`). A graph that holds one mixes tokens across ranks.
EXCHANGED_ACTIONS = (*REGION_ACTIONS, "head_parallel", "replicated", "state_passing")


def _bytes(region: CausalRegion, cp_size: int) -> int:
    v = _val(region.operand)
    if not isinstance(v, torch.Tensor):
        return 0
    return (cp_size - 1) * size_hint(math.prod(v.shape)) * v.element_size()


def _exchanged_bytes(exchanges: tuple[fx.Node, ...], cp_size: int) -> int:
    """Bytes this rank receives per call in ``exchanges``: ``(N - 1) / N`` of the input of each all-to-all between
    the sequence and the head split (:mod:`cpcompile.ops.heads`), ``N - 1`` copies of the summary of each
    all-gather of state summaries (:mod:`cpcompile.ops.state`)."""
    total = 0
    for n in exchanges:
        v = _val(n.args[0])
        if not isinstance(v, torch.Tensor):
            continue
        nbytes = size_hint(math.prod(v.shape)) * v.element_size()
        total += (cp_size - 1) * nbytes // (1 if vocab.op_name(n) == "cpcompile::state_gather" else cp_size)
    return total


def mixing_pass(gm: fx.GraphModule, ctx: PassContext, chunk_len: int | None) -> list[MixingReport]:
    """Find every mixing op of ``gm``, check it and rewrite the causal regions; return one report per op.

    ``ctx.refuse == "raise"`` raises :class:`UnsupportedMixingError` for the first op that cannot be made exact,
    before anything is rewritten; ``"report"`` only records it (inspection).
    """
    seq = sequence_length(gm, chunk_len, mixed=True)
    if seq is None:
        return []
    found = find_mixing_ops(gm, seq, ctx.options.per_token_ops)
    counters["mixing_ops_found"] += len(found)
    data = frozenset().union(*(graph_facts(g, seq).data for g in graph_modules(gm))) if found else frozenset()
    partials = frozenset(op.node for op in found if op.accounted in ("partial_sum", "mean_share"))
    decided = [(op, *check_op(op, data, partials)) for op in found]
    refused = [(op, reason) for op, action, reason in decided if action == "refused"]
    counters["mixing_refused"] += len(refused)
    if refused and ctx.refuse == "raise":
        raise _refusal(*refused[0])
    reports = []
    ends: dict[fx.Node, fx.Node] = {}  # the end of each region rewritten -> the node that replaced it
    for op, action, reason in decided:
        nbytes, a2a = 0, 0
        if action in REGION_ACTIONS:
            region = op.region
            if region.operand in ends:  # it reads a region rewritten before it (a scan after a conv's trim)
                region = dataclasses.replace(region, operand=ends[region.operand])
            try:
                ends[op.region.nodes[-1]] = rewrite_region(region, f"{ctx.site_prefix}:{op.where}", ctx, seq.symbols)
            except Exception as e:  # noqa: BLE001 - re-raised with the pass's name
                raise RuntimeError(f"cpcompile mixing pass failed while rewriting {op.where}: {e}") from e
            nbytes = _bytes(op.region, ctx.cp_size) if action == "gathered" else 0
        if action == "summed":
            for write in count_uses(op.node)[0]:
                _sum_over_ranks(op, write, ctx)
        if action == "mean_share":
            _share_of_mean(op, ctx)
        if action == "pooled" and op.picks:
            pool_across_ranks(op.node, list(op.picks), ctx, f"{ctx.site_prefix}:{op.where}")
        if action == "pooled" and not op.picks:
            nbytes = _pooled_bytes(op.node, ctx.cp_size)
        if action in ("head_parallel", "replicated"):
            a2a = _exchanged_bytes(op.exchanges, ctx.cp_size)
        if action == "state_passing":
            nbytes = _exchanged_bytes(op.exchanges, ctx.cp_size)
        if action != "refused":
            counters[f"mixing_{action}"] += 1
        reports.append(
            MixingReport(
                ctx.graph_id, op.node.name, op.layer, op.op, op.kind, action, reason, op.source, nbytes, a2a, op.split
            )
        )
    if any(r.action in (*REGION_ACTIONS, "summed", "mean_share", "pooled") for r in reports):
        finish(gm)
    return reports


def _pooled_bytes(pick: fx.Node, cp_size: int) -> int:
    """Bytes this rank receives per call in the all-gather of the candidate rows of a ``pooled`` pick."""
    v = _val(pick)
    if not isinstance(v, torch.Tensor):
        return 0
    return (cp_size - 1) * size_hint(math.prod(v.shape)) * v.element_size()


def _share_of_mean(op: MixingOp, ctx: PassContext) -> None:
    """Make ``op`` (``cross_entropy``/``nll_loss`` with ``reduction="mean"``) this rank's share of the mean over the
    whole sequence: its loss summed over this rank's tokens, divided by the number of targets that are not
    ``ignore_index`` on every CP rank (each rank counts its own; the counts are all-gathered, one int64 per rank,
    and summed). The ranks' shares add up to the one-process mean, and so do their gradients. When the targets are
    a reshape of a per-token tensor (``targets.view(-1)``), the targets of the padding tokens become
    ``ignore_index`` first (``cpcompile::real_tokens``), whatever ``shard`` padded them with; other targets count
    padding unless its target is ``ignore_index``."""
    from cpcompile.passes.mixing.find import MEAN_SHARE_LOSSES

    loss, graph = op.node, op.node.graph
    ignore_pos = 1 + MEAN_SHARE_LOSSES[op.op]
    target = loss.args[1] if len(loss.args) > 1 else loss.kwargs["target"]
    ignore_index = loss.kwargs.get("ignore_index", loss.args[ignore_pos] if len(loss.args) > ignore_pos else -100)
    reduction_pos = 1 + vocab.LOSSES[op.op][0]
    if len(loss.args) > reduction_pos:
        loss.update_arg(reduction_pos, "sum")
    else:
        loss.update_kwarg("reduction", "sum")
    if op.target_tokens is not None:  # padding tokens: ignored, whatever value shard padded them with
        base, dim = op.target_tokens
        ndim = _val(base).dim()
        with graph.inserting_before(loss):
            like = graph.call_method("detach", (base,))
            site = f"{ctx.site_prefix}:{op.where}"
            real = graph.call_function(torch.ops.cpcompile.real_tokens.default, (like, dim, site))
            real = graph.call_method("view", (real, [-1 if d == dim else 1 for d in range(ndim)]))
            real = graph.call_method("reshape_as", (graph.call_method("expand_as", (real, base)), target))
            kept = graph.call_function(torch.where, (real, target, ignore_index))
        loss.replace_input_with(target, kept)
        target = kept
    with graph.inserting_before(loss.next):
        counted = graph.call_function(operator.ne, (target, ignore_index))
        local = graph.call_method("sum", (counted,))
        row = graph.call_method("reshape", (local, (1,)))
        every = graph.call_function(_compat.all_gather_seq, (row, 0, ctx.cp_size, ctx.group_name))
        total = graph.call_method("sum", (every,))
        share = graph.call_function(operator.truediv, (loss, total))
    loss.replace_all_uses_with(share, delete_user_cb=lambda u: u is not share)


def _sum_over_ranks(op: MixingOp, write: fx.Node, ctx: PassContext) -> None:
    """Hand ``write`` (an in-place write into module state) the count of ``op`` (a ``sum`` of a one-hot map of
    expert ids over this rank's tokens) over the real tokens of every CP rank instead: every rank's state then
    holds the whole sequence's count, as the one-process model's does. The padding that makes ``T`` a multiple
    of the CP size is left out (``cpcompile::real_tokens``); the ranks' counts are all-gathered and summed in rank
    order, so every rank has the same value."""
    count, graph = op.node, write.graph
    onehot, (dim,) = count.args[0], op.seq_dims
    dtype, ndim = _val(count).dtype, _val(onehot).dim()
    with graph.inserting_before(write):
        like = graph.call_method("detach", (onehot,))
        site = f"{ctx.site_prefix}:{op.where}"
        real = graph.call_function(torch.ops.cpcompile.real_tokens.default, (like, dim, site))
        shape = [-1 if d == dim else 1 for d in range(ndim)]
        real = graph.call_method("view", (real, shape))
        masked = graph.call_function(torch.mul, (onehot, real))
        counted = graph.node_copy(count, lambda n: masked if n is onehot else n)
        row = graph.call_method("unsqueeze", (counted, 0))
        every = graph.call_function(_compat.all_gather_seq, (row, 0, ctx.cp_size, ctx.group_name))
        total = graph.call_method("sum", (every, 0), {"dtype": dtype})
    write.replace_input_with(count, total)
