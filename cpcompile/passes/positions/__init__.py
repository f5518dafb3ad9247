"""Positions a model computes from the local sequence length: made global in the graph, or refused.

Under :func:`cpcompile.shard` a rank holds ``c`` tokens of the sequence (``[r*c, (r+1)*c)`` in the contiguous
layout, a few runs of tokens in the balanced one) but the model sees a sequence of length ``c``. A value the
model derives from that length (``arange(T)``, ``table[:T]``) gives every rank the positions of tokens
``[0, c)``: silently wrong for every token held elsewhere. This pass finds such values (*position
sources*) in a Dynamo graph and, for each one:

* **rewrites** it so that every local token gets what the whole-sequence run gives that token: ``arange`` becomes
  the global token indices of this rank (read from the active plan at run time by
  ``torch.ops.cpcompile.token_positions``), ``table[a:a+T]`` / ``narrow`` become an ``index_select`` of the
  table at those indices; whatever the model then computes element-wise from them follows;
* leaves it to the attention mask (**mask**) when every use ends in an SDPA ``attn_mask`` (the attention pass
  replaces those masks and checks them against the plan at run time; the backend runs this pass after it, so
  the model's mask then feeds the ``model_mask`` argument of a ``cpcompile::`` op); a mask handed to another
  graph (a graph break, a tensor kept on the module) is proved here instead, and refused when it cannot be or
  has no same-document condition, since the graph that receives it keeps documents apart;
* leaves it **unchanged** when it holds the same value at every position (``ones(T)``) and is only used
  element-wise;
* **refuses** it (:class:`UnsupportedPositionError` at compile time) when it mixes positions along the sequence
  before it meets the sharded data (``cumsum``, a sum, a matmul over the sequence, a shift), when it uses the
  local length itself as a value, or whenever the pass cannot prove that the value is computed per position.

find -> check -> rewrite: :func:`sequence_length` (how the local length appears in the graph),
:func:`find_position_sources` (typed :class:`PositionSource` matches), :func:`check_source` (a
:class:`PositionCheck` with a one-line reason), :func:`rewrite_source`; :func:`positions_pass` is the entry point
the backend runs on every graph when the CP group has more than one rank. ``cpcompile.passes.counters`` counts
``position_sources_found`` and, by what became of them, ``position_sources_rewritten``, ``_refused``, ``_mask``
and ``_unchanged``.

*Sharded data* are the graph inputs whose shape contains the local length (token ids, hidden states of a
per-layer graph, the global ``position_ids`` that ``shard`` passes) and everything computed from their values;
the pass follows a source forward through pure position computation and stops where it meets sharded data.

The package, by concern: :mod:`~cpcompile.passes.positions.model` (the types above and the texts of a refusal),
:mod:`~cpcompile.passes.positions.graph` (what the pass reads off a node),
:mod:`~cpcompile.passes.positions.facts` (the local length, sharded data, mask-only and live nodes of a graph:
also read by the mixing pass), :mod:`~cpcompile.passes.positions.find`,
:mod:`~cpcompile.passes.positions.check` with :mod:`~cpcompile.passes.positions.uses` (the rule for each op),
:mod:`~cpcompile.passes.positions.rewrite`, and this module's :func:`positions_pass`. The op tables they read are
those of :mod:`cpcompile.passes.vocabulary`.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch.fx as fx

# ``name as name``: re-exported (imported from cpcompile.passes.positions by other passes, tests and users)
from cpcompile.errors import UnsupportedPositionError as UnsupportedPositionError
from cpcompile.passes.common import PassContext, counters, finish
from cpcompile.passes.common import source_line as source_line
from cpcompile.passes.positions.check import ROW_NUMBERS as ROW_NUMBERS
from cpcompile.passes.positions.check import check_source
from cpcompile.passes.positions.facts import graph_facts as graph_facts
from cpcompile.passes.positions.facts import live_nodes as live_nodes
from cpcompile.passes.positions.facts import sequence_length
from cpcompile.passes.positions.find import find_position_sources
from cpcompile.passes.positions.model import FIX as FIX
from cpcompile.passes.positions.model import REASON_FIXES as REASON_FIXES
from cpcompile.passes.positions.model import STATIC_FIX as STATIC_FIX
from cpcompile.passes.positions.model import Action as Action
from cpcompile.passes.positions.model import GraphFacts as GraphFacts
from cpcompile.passes.positions.model import Kind as Kind
from cpcompile.passes.positions.model import (
    PositionCheck,
    PositionReport,
    PositionSource,
    SequenceLength,
    refusal,
    static_reason,
)
from cpcompile.passes.positions.rewrite import rewrite_source

__all__ = [
    "PositionCheck",
    "PositionReport",
    "PositionSource",
    "SequenceLength",
    "check_source",
    "find_position_sources",
    "positions_pass",
    "rewrite_source",
    "sequence_length",
    "source_line",
]


def positions_pass(gm: fx.GraphModule, ctx: PassContext, chunk_len: int | None) -> list[PositionReport]:
    """Find, check and rewrite every position source of ``gm`` in place; return one report per source.

    ``chunk_len`` is the active plan's chunk length (identifies the length's symbol; in a static graph, the
    sizes that stand for it). ``ctx.refuse == "raise"`` raises :class:`UnsupportedPositionError` for the first
    source that cannot be made exact, before rewriting anything; ``"report"`` only records it (inspection,
    never for running). In a static graph (no symbol for the length) a source that would be rewritten is
    refused instead, since its size may be a constant that merely equals the chunk length; with ``"report"``
    it is rewritten as a dynamic graph would be, and the report says it was found by its size.
    """
    refuse, graph_id, site_prefix = ctx.refuse, ctx.graph_id, ctx.site_prefix
    mixed = sequence_length(gm, chunk_len, mixed=True)
    if mixed is None:
        return []
    seq = dataclasses.replace(mixed, mixed=False)  # sources are found by the length's symbols
    sources = find_position_sources(gm, seq)
    by_size: set[fx.Node] = set()
    if mixed.mixed:
        # inputs with the length's symbol next to inputs with the constant chunk length (after a graph break):
        # a source of the constant length is found by its size only, as in a static graph
        found = {src.node for src in sources}
        extra = [s for s in find_position_sources(gm, SequenceLength(frozenset(), chunk_len, mixed=True))
                 if s.node not in found]  # fmt: skip
        by_size = {s.node for s in extra}
        sources += extra
    counters["position_sources_found"] += len(sources)
    decided: list[tuple[PositionSource, PositionCheck]] = []
    for src in sources:
        check = check_source(src)
        if check.action == "rewrite" and src.node in by_size:
            check = PositionCheck("refuse", static_reason(seq), static=True)
        elif check.action == "rewrite" and seq.static:
            if refuse == "raise":
                check = PositionCheck("refuse", static_reason(seq), static=True)
            else:
                check = PositionCheck("rewrite", f"found by its size ({seq.chunk_len}) in a static trace")
        decided.append((src, check))
    refused = [(src, check) for src, check in decided if check.action == "refuse"]
    counters["position_sources_refused"] += len(refused)
    if refused and refuse == "raise":  # before anything is rewritten: the graph is left as it was
        src, check = refused[0]
        raise refusal(src, check.reason, check.static)
    reports, done = [], Counter()
    for src, check in decided:
        action, reason = check.action, check.reason
        if action == "rewrite":
            try:
                rewrite_source(src, f"{site_prefix}:{src.where}")
            except Exception as e:  # noqa: BLE001 - re-raised with the pass's name
                raise RuntimeError(f"cpcompile positions pass failed while rewriting {src.where}: {e}") from e
        action = {"rewrite": "rewritten", "refuse": "refused"}.get(action, action)
        if action != "refused":
            counters[f"position_sources_{action}"] += 1
        done[action] += 1
        reports.append(PositionReport(graph_id, src.node.name, src.layer, src.kind, action, reason))
    if done["rewritten"]:
        finish(gm)
    return reports
