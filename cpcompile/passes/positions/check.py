"""check: what to do with a position source (:func:`check_source`): leave it to the mask, leave it unchanged,
rewrite it, or refuse it with a one-line reason. Its uses are followed forward, each judged by
:func:`~cpcompile.passes.positions.uses.check_use`. Also the masks a graph proves and hands on
(:func:`proved_handed_masks`).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from cpcompile import _compat
from cpcompile.passes.aliasing import op_name
from cpcompile.passes.common import arg as _arg
from cpcompile.passes.common import node_located, node_value
from cpcompile.passes.mask_rules import prove_mask
from cpcompile.passes.positions.graph import has_seq, leaves_graph, pairwise, shape_of, value_inputs
from cpcompile.passes.positions.model import GraphFacts, PositionCheck, PositionSource, SequenceLength
from cpcompile.passes.positions.uses import check_use

#: Why an arange that only numbers this rank's own rows is left unchanged.
ROW_NUMBERS = (
    "it numbers this rank's own rows (token bookkeeping such as an MoE dispatch's inverse permutation), not positions"
)


def _indexes_rows_of(u: fx.Node, index: fx.Node, facts: GraphFacts, length: object) -> bool:
    """Whether ``u`` looks sharded data up at ``index`` along a dim of exactly ``length`` rows (all of them)."""
    name = op_name(u)
    if name == "getitem" and u.args[0] in facts.data:
        entries = u.args[1] if isinstance(u.args[1], tuple) else (u.args[1],)
        if entries and entries[0] is index and index not in entries[1:]:
            shape = shape_of(u.args[0])
            return shape is not None and _compat.statically_true(shape[0] == length)
    if name == "index_select" and u.args[0] in facts.data and _arg(u, 2, "index") is index:
        shape, dim = shape_of(u.args[0]), _arg(u, 1, "dim")
        return shape is not None and isinstance(dim, int) and _compat.statically_true(shape[dim] == length)
    return False


def _numbers_local_rows(src: PositionSource) -> bool:
    """Whether an ``arange``'s values only number the rows of this rank's own sharded data.

    Every use must be one of:

    * the value of ``target[index] = arange(n)`` where ``index`` is sharded data and ``target`` is a 1-d tensor of
      ``n`` elements used only to look sharded data up (``inv_perm[perm] = arange(perm.size(0))``, then
      ``x[inv_perm]``: transformers' MoE dispatch undoing its sort of tokens by expert);
    * the index of a lookup of all ``n`` rows of sharded data (``x[arange(n)]``, ``x.index_select(0, arange(n))``).

    Both only renumber the rank's own rows, so the local numbers are the right ones. Arithmetic on the numbers
    first (``arange(T) - 1``, a shift), a lookup of part of the rows or of a table, or any other use does not
    qualify.
    """
    node, facts = src.node, src.facts
    shape = shape_of(node)
    if shape is None or len(shape) != 1 or not node.users:
        return False
    length = shape[0]
    for u in node.users:
        if _indexes_rows_of(u, node, facts, length):
            continue
        if u.op != "call_function" or u.target is not operator.setitem or len(u.args) != 3 or u.args[2] is not node:
            return False
        target, index = u.args[0], u.args[1]
        target_shape = shape_of(target)
        if not (
            isinstance(index, fx.Node)
            and index in facts.data
            and target in facts.data
            and target_shape is not None
            and len(target_shape) == 1
            and _compat.statically_true(target_shape[0] == length)
        ):
            return False
        if not all(v is u or _indexes_rows_of(v, target, facts, length) for v in target.users):
            return False
    return True


#: Why a mask without a same-document condition is not handed to another graph.
HANDED_WITHOUT_DOCUMENTS = (
    "it builds a mask without a same-document condition (causal order or a window of the token index alone, which "
    "attends across packed documents) and hands it to another graph (a graph break before the attention, or a "
    "tensor kept on the module for a later call), where the attention cannot see how it was built and keeps "
    "documents apart: a rank's block of the mask looks the same either way when documents end at a chunk edge"
)


def _handed_mask_reason(src: PositionSource) -> str:
    """Why a mask built from ``src`` and handed to another graph (the graph's output: a graph break, one graph
    per layer, a tensor kept on the module) cannot be proved (:func:`cpcompile.passes.mask_rules.prove_mask`), or
    has no same-document condition (:data:`HANDED_WITHOUT_DOCUMENTS`), or ``""``. The graph that receives it does
    not analyse it and keeps documents apart (:attr:`~cpcompile.passes.mask_rules.MaskProof.documents`), which is
    exact only for a mask with a document condition: this graph is the one that knows, and Dynamo compiles it
    before the mask can reach any other. A mask used by an SDPA call of this graph or of a nested one is proved by
    the attention pass."""
    facts, seen, stack = src.facts, set(), [src.node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if u.op == "output" and pairwise(n, facts.seq):
                proof = prove_mask(n, shape_of(n)[-1])
                if proof.reason:
                    return f"it builds a mask handed to another graph: {proof.reason}"
                if not proof.documents:
                    return HANDED_WITHOUT_DOCUMENTS
            elif u in facts.mask_only and u in facts.live:
                stack.append(u)
    return ""


def proved_handed_masks(gm: fx.GraphModule, seq: SequenceLength) -> list[int]:
    """The positions, among ``gm``'s outputs, of the ``[.., T, T]`` masks this graph builds and proves to keep
    packed documents apart (:func:`cpcompile.passes.mask_rules.prove_mask`, not assumed from an input) before
    handing them on: the graph that receives one does not see how it was built, and the runtime lets it trust
    them (:func:`cpcompile.runtime.record_proved_masks`)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    found = []
    for i, n in enumerate(values):
        if isinstance(n, fx.Node) and n.op != "placeholder" and pairwise(n, seq):
            proof = prove_mask(n, shape_of(n)[-1])
            if not proof.reason and proof.documents and not proof.assumed:
                found.append(i)
    return found


def exact_outputs(gm: fx.GraphModule, seq: SequenceLength) -> list[tuple[int, tuple[int, ...]]]:
    """``(output position, input positions)`` for each output of ``gm`` with a dim of the local length: the
    graph's inputs with such a dim (not module state) that it is computed from.

    The passes make every value a graph computes exact at this rank's tokens when its inputs are, so the runtime
    trusts such an output when those inputs were trusted (:func:`cpcompile.runtime.record_exact`): a per-token
    tensor handed on through a graph break keeps its provenance."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sharded = {
        n: i
        for i, n in enumerate(placeholders)
        if has_seq(n, seq) and not _compat.is_module_state(n) and isinstance(node_value(n), torch.Tensor)
    }
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    found = []
    for i, n in enumerate(values):
        if not isinstance(n, fx.Node) or not isinstance(node_value(n), torch.Tensor) or not has_seq(n, seq):
            continue
        seen, stack, inputs = set(), [n], set()
        while stack:
            m = stack.pop()
            if m in seen:
                continue
            seen.add(m)
            if m in sharded:
                inputs.add(sharded[m])
            stack.extend(m.all_input_nodes)
        found.append((i, tuple(sorted(inputs))))
    return found


def check_source(src: PositionSource) -> PositionCheck:
    """What to do with ``src``: leave it to the mask, leave it unchanged, rewrite it, or refuse it (with why).

    The source's uses are followed forward through position computation (element-wise ops, layout and
    reshape ops that keep each position's elements together, lookups of a table at the positions, reductions
    and contractions over other dims) up to the ops where they meet sharded data or leave the graph; any other
    use, or a use that mixes positions along the sequence, refuses the source. Uses that only build attention
    masks are not followed.
    """
    facts = src.facts
    if src.node in facts.mask_only:
        reason = _handed_mask_reason(src)
        return PositionCheck("refuse", reason) if reason else PositionCheck("mask")
    if src.kind == "arange" and _numbers_local_rows(src):
        return PositionCheck("unchanged", ROW_NUMBERS)
    if src.kind in ("length", "other") or src.problem:
        return PositionCheck("refuse", f"it is {src.problem or 'a value of unknown form'}")
    tainted, queue = {src.node}, [src.node]
    while queue:
        t = queue.pop(0)
        for u in t.users:
            if u not in facts.live or u in facts.mask_only or (t not in value_inputs(u) and not leaves_graph(u)):
                continue
            reason = check_use(u, t, facts, tainted)
            if reason is not None:
                return PositionCheck("refuse", f"its use at {node_located(u)}: {reason}")
            if u not in facts.data and not leaves_graph(u) and u not in tainted:
                tainted.add(u)
                queue.append(u)
    return PositionCheck("unchanged" if src.kind == "factory" else "rewrite")
