"""Check: what becomes of a mixing op (:func:`check_op`: a halo, gathered, a partial sum, MoE dispatch, per-token, or
refused), and the refusal that names the layer, the op, the model's line and the fix."""

from __future__ import annotations

from typing import Literal

import torch
import torch.fx as fx

from cpcompile.errors import UnsupportedMixingError
from cpcompile.passes import vocabulary as vocab
from cpcompile.passes.aliasing import mutated, viewed_bases
from cpcompile.passes.common import mixer_functions, node_value, registration_fix
from cpcompile.passes.mixing.find import MixingOp

__all__ = ["check_op", "count_uses"]

#: What became of a mixing op (see :mod:`cpcompile.passes.mixing`).
Action = Literal[
    "halo",
    "gathered",
    "partial_sum",
    "mean_share",
    "dispatch",
    "summed",
    "per_token",
    "pooled",
    "head_parallel",
    "replicated",
    "state_passing",
    "refused",
]

#: Dispatch ops that count expert assignments over this rank's tokens.
_COUNTS = frozenset({"histc", "bincount", "sum"})


_SCALES = {"truediv", "div", "mul", "neg", "to", "float", "double", "type", "clone", "detach", "contiguous"}


def _partial_sum_reason(n: fx.Node, data: frozenset, partials: frozenset = frozenset()) -> str | None:
    """``None`` when every path from ``n`` to the graph's output only scales it by values that are not sharded
    data (or adds other partial sums: ``partials`` are the graph's sums over the sequence and means made shares,
    each checked on its own; or leaves unchanged), else why the sum is not a partial sum."""
    seen, queue = {n}, [n]
    from_partial: dict = {}
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
            if name in ("add", "sub", "iadd", "isub") and all(
                isinstance(a, fx.Node) and (a in seen or _scaled_partial(a, data, partials, from_partial))
                for a in operands
            ):
                if u not in seen:
                    seen.add(u)
                    queue.append(u)
                continue
            return (
                f"its result is used by {name} (node {u.name}), not only scaled into the graph's output, so the "
                "ranks' values would not add up to the one-process value"
            )
    return None


def _scaled_partial(a: fx.Node, data: frozenset, partials: frozenset, memo: dict) -> bool:
    """Whether ``a`` is one of ``partials`` only scaled by values that are not sharded data, or a sum of such."""
    if a in partials:
        return True
    if a in memo:
        return memo[a]
    memo[a] = False
    name = vocab.op_name(a) if a.op in ("call_function", "call_method") else ""
    inputs = a.all_input_nodes
    if name in _SCALES:
        # the scaled value: a divisor is not (a sum divided by a partial sum is no partial sum)
        scaled = inputs if name not in ("truediv", "div") else [i for i in inputs if a.args and i is a.args[0]]
        memo[a] = any(
            _scaled_partial(c, data, partials, memo) and all(i not in data for i in inputs if i is not c)
            for c in scaled
        )
    elif name in ("add", "sub"):
        memo[a] = bool(inputs) and all(_scaled_partial(i, data, partials, memo) for i in inputs)
    return memo[a]


def check_op(op: MixingOp, data: frozenset, partials: frozenset = frozenset()) -> tuple[Action, str]:
    """``(action, reason)`` for a mixing op: how it is accounted for, or why it is refused. ``partials``: the nodes
    of the graph's other sums over the sequence and means (a partial sum may be added to them)."""
    if op.accounted in ("partial_sum", "mean_share"):
        # a mean's share is a partial sum too: it must reach the output the same way
        reason = _partial_sum_reason(op.node, data, partials)
        if reason is None:
            return op.accounted, ""
        if op.accounted == "mean_share":
            return "refused", f"{op.op}(reduction='mean') averages over this rank's tokens only: {reason}"
        return "refused", f"{op.what}: {reason}"
    if op.accounted == "dispatch" and op.op in _COUNTS:
        writes, reason = count_uses(op.node)
        if reason is None and writes and len(op.seq_dims) != 1:
            reason = (
                f"it is written into module state at {writes[0].name}, and cpcompile sums only a count over one "
                "token dim of a one-hot map (``routing_map[B, T, E].sum((0, 1))``) across ranks"
            )
        if reason is not None:
            return "refused", f"{op.what}: {reason}"
        return ("summed" if writes else "dispatch"), ""
    if op.accounted:
        return op.accounted, ""
    if op.region is not None:
        return ("halo" if op.region.halo else "gathered"), ""
    reason = op.what + (f"; it cannot run on the whole sequence: {op.problem}" if op.problem else "")
    return "refused", reason


def count_uses(n: fx.Node) -> tuple[list[fx.Node], str | None]:
    """How a count of expert assignments over this rank's tokens is used: ``(writes, None)`` when it is only
    bookkeeping of this rank's dispatch (integer offsets, sizes, the index-like argument of an op whose values
    come from elsewhere) and the in-place ``writes`` into module state it feeds (running statistics such as
    torchtitan's ``tokens_per_expert_E``, which must hold the whole sequence's count); ``([], why)`` when its
    values become data (a cast to float, arithmetic with floats: a load-balancing loss over this rank's count)."""
    writes: list[fx.Node] = []
    seen, queue = {n}, [n]
    while queue:
        t = queue.pop()
        for u in t.users:
            if u.op == "output" or u in seen:
                continue
            target = mutated(u)
            if target is not None and target is not t and _is_state(target):
                writes.append(u)
                continue
            value = node_value(u)
            floating = isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())
            name = vocab.op_name(u)
            if floating and (name in vocab.ELEMENTWISE or name in vocab.LAYOUT or name in vocab.CONTRACTIONS):
                return [], (
                    f"the count over this rank's tokens becomes a value at {name} (node {u.name}), where the "
                    "one-process model has the whole sequence's count"
                )
            if not floating:
                seen.add(u)
                queue.append(u)
    return writes, None


def _is_state(t: fx.Node) -> bool:
    """Whether ``t`` is (a view of) a module's buffer or parameter, or a graph input: state that outlives the call."""
    base = viewed_bases(t)[-1]
    return base.op in ("placeholder", "get_attr")


#: Where transformers builds a flex_attention BlockMask from packed sequences it detects in ``position_ids``.
_TRANSFORMERS_MASKS = "transformers/masking_utils.py"


#: Kinds of refused ops that a sequence mixer of the model's own code makes (a scan, a product over the sequence, a
#: loop over its tokens): their fix names :func:`cpcompile.cores.register_head_parallel` when the code is a
#: module-level function (:func:`~cpcompile.passes.common.registration_fix`).
_MIXER_KINDS = frozenset({"convolution", "scan", "shift", "contraction", "selection", "order", "unknown"})


def _fix(op: MixingOp) -> str:
    fix = _fix_of_kind(op)
    register = registration_fix(op.node) if op.kind in _MIXER_KINDS else ""
    return f"{register}; or {fix}" if register else fix


def _fix_of_kind(op: MixingOp) -> str:
    if op.kind == "head_parallel":
        if op.problem:  # a whole-sequence value that leaves the region: its ``what`` says what to return
            return "return only the core's outputs from the head-parallel region"
        return (
            "this core mixes heads, so it cannot run head-parallel: if it is a function registered with "
            "cpcompile.cores.register_head_parallel, move the op that mixes heads out of it (apply it to what the "
            "function returns); otherwise run this model (or this layer) without context parallelism, or report "
            "the model with the graphs cpcompile.backend(..., dump_dir=...) writes"
        )
    outside = vocab.masks_built_outside_fix(op.node)
    if outside is not None:
        return outside
    if op.source and _TRANSFORMERS_MASKS in op.source.replace("\\", "/"):
        return (
            "this is transformers' mask code, reading the packed documents from this rank's position_ids in a "
            "way cpcompile could not tie to an attention mask. Under attn_implementation='flex_attention' that is "
            "expected: load the model with attn_implementation='sdpa' (the same causal same-document masks, which "
            "cpcompile makes exact across ranks). If the model already uses 'sdpa', report it with the graphs "
            "cpcompile.backend(..., dump_dir=...) writes"
        )
    attention = vocab.attention_op_fix(op.op) if op.kind == "custom" else None
    if attention is not None:
        return attention
    if op.kind == "custom":
        return (
            f"if {op.op} computes every token's output from that token's inputs, list it: "
            f'cpcompile.backend(cp_group, per_token_ops=("{op.op}",)); otherwise compute it with torch ops '
            "cpcompile can see, or run this model without context parallelism"
        )
    if op.kind == "index":
        return (
            "build the mask from the global positions of the tokens (the position_ids cpcompile.shard passes, e.g. "
            "position_ids[..., :, None] >= position_ids[..., None, :]) instead of an element's index, or run this "
            "model without context parallelism"
        )
    if op.kind in ("reduction", "loss", "selection"):
        return (
            "compute per-token outputs in the model and reduce them outside it over the whole sequence "
            "(cpcompile.gather(out, dim=1), or a loss summed over tokens divided by the num_items_in_batch "
            "cpcompile.shard passes), or run this model without context parallelism"
        )
    return (
        "write the op as a causal conv1d (padding kernel-1, then [..., :T]), a left pad then a slice, a forward "
        "cumsum or a diff with prepend=x[:, :1] (the change from the previous token), which cpcompile runs on the "
        "whole sequence; or run this model without context parallelism"
    )


def _refusal(op: MixingOp, reason: str) -> UnsupportedMixingError:
    code = f" Model code: {op.source}." if op.source else ""
    held = "some tokens of the sequence"
    if op.kind == "head_parallel" and not op.problem:
        held = "the whole sequence of some heads (channels) in a head-parallel region"
    error = UnsupportedMixingError(
        f"cpcompile cannot run {op.op} at {op.where} across CP ranks: {reason}.{code} Under context parallelism "
        f"each rank holds only {held}, and this op would combine them without the others'. Fix: {_fix(op)}"
    )
    error.functions = mixer_functions(op.node) if op.kind in _MIXER_KINDS else ()
    return error
