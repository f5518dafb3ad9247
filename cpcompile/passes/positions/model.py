"""What the positions pass works with and what it says: the types of its find -> check -> rewrite steps and the
texts of its refusals.

:class:`SequenceLength` (how the local length appears in a graph), :class:`GraphFacts` (sharded data, mask-only
and live nodes of one graph), :class:`PositionSource` (one value derived from the local length),
:class:`PositionCheck` (what :func:`~cpcompile.passes.positions.check_source` decides), :class:`PositionReport`
(what the pass did); :data:`FIX`, :data:`REASON_FIXES` and :data:`STATIC_FIX` (the fixes a refusal names) and
:func:`refusal` (its :class:`UnsupportedPositionError`).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
import torch.fx as fx

from cpcompile import _compat
from cpcompile.errors import UnsupportedPositionError
from cpcompile.passes import vocabulary as vocab
from cpcompile.passes.common import FoundAt, mixer_functions, registration_fix

#: What the pass does with a source: see :mod:`cpcompile.passes.positions`.
Action = Literal["rewritten", "refused", "mask", "unchanged"]
#: How a source derives from the local length.
Kind = Literal["arange", "table_slice", "narrow", "factory", "length", "other"]

#: The fix every refusal ends with: positions as an input are sharded data, exact in every case.
FIX = (
    "make the model take its positions as an input (a positions= or position_ids= argument of its forward) and "
    'pass the global ones cpcompile.shard provides, e.g. model(tokens, positions=local["position_ids"])'
)
#: The fix for the code at hand, by the words of the refusal's reason (first match), before :data:`FIX`.
REASON_FIXES = (
    (
        "mixes the values of different positions",
        "this reduction sees only this rank's positions; compute what it needs from the global sequence length "
        "or positions, or remove it if its result is not needed",
    ),
    (
        "contracts the sequence dim",
        "this product sums over this rank's positions only; compute it per position (outer, einsum keeping the "
        "position index) or from positions passed as an input",
    ),
    (
        "(a shift or a selection)",
        "a shifted or selected position is another token's, which may live on another rank; index the whole "
        "range (table[:T], table[k - q:k] with k = q the local length, x[..., -T:, :] of T rows) or pass "
        "positions as an input",
    ),
    (
        "joins position-derived values along the sequence",
        "build the positions of the local tokens in one range (arange(T), table[:T]) instead of joining pieces",
    ),
    (
        "the local sequence length used as a value",
        "the local length is not the global one; pass the global length or positions as an input",
    ),
    (
        "an index computed from the local sequence length",
        "the local length is not the global one; pass the global length or positions as an input",
    ),
    (
        "a slice at an offset that is only known at run time",
        "slice the table from a constant first row (table[:T], table[a:a + T] with an int a); a slice relative "
        "to the end of a longer table (table[-T:]) selects rows that depend on the local length",
    ),
    (
        "without a same-document condition (causal order or a window of the token index alone",
        "build the mask in the same graph as the attention on every call (no graph break between them, not kept on "
        "the module), or add the same-document condition (equal document ids, or position ids that restart at 0 in "
        "every document, as cpcompile.shard passes them)",
    ),
    (
        "that outlives this call (a cache that later calls read)",
        "fill the cache for every row once, outside the training call (at init, for the longest sequence), so "
        "that the training call only slices it (cache[:T]), which cpcompile rewrites",
    ),
)


def _fix_for(reason: str) -> str:
    return next((f"{fix}; or " for words, fix in REASON_FIXES if words in reason), "")


@dataclasses.dataclass(frozen=True)
class SequenceLength:
    """How the local sequence length appears in a graph.

    ``symbols``: the sympy symbols of the local length (a dynamic graph: ``shard`` marks the sequence dim
    dynamic). Empty in a static graph, where sizes equal to ``chunk_len`` stand for the local length.
    """

    symbols: frozenset
    #: The active plan's chunk length (``None`` when the graph was compiled outside a shard context).
    chunk_len: int | None
    #: A graph with symbols whose inputs also hold the local length as the constant ``chunk_len`` (after a
    #: graph break, Dynamo specialises the tensors the previous graph returned, while the ones the user marked
    #: stay symbolic): sizes equal to ``chunk_len`` stand for the local length too (the mixing pass's view).
    mixed: bool = False

    @property
    def static(self) -> bool:
        """True when the graph has no symbol for the length (sizes are compared with ``chunk_len`` instead)."""
        return not self.symbols

    @property
    def by_size(self) -> bool:
        """True when constant sizes equal to ``chunk_len`` stand for the local length (static or mixed)."""
        return not self.symbols or self.mixed

    def involves(self, size: object) -> bool:
        """Whether a size (or a symbolic scalar) depends on the local length."""
        if self.symbols and _compat.free_symbols(size) & self.symbols:
            return True
        return self.is_chunk_constant(size)

    def is_length(self, size: object) -> bool:
        """Whether a size is exactly the local length."""
        if self.symbols and isinstance(size, torch.SymInt) and _compat.sym_expr(size) in self.symbols:
            return True
        return self.is_chunk_constant(size)

    def is_chunk_constant(self, size: object) -> bool:
        """Whether a constant size stands for the local length: it equals ``chunk_len`` in a static or mixed
        graph. A constant dim may be a SymInt without free symbols: in a graph with symbols, and in a graph traced
        with a symbolic length that Dynamo then specialised (an op that needs a concrete length, such as a scan
        over a head-parallel core's whole sequence, fixes the symbol to its value)."""
        if not self.by_size or self.chunk_len is None:
            return False
        if isinstance(size, torch.SymInt) and not _compat.free_symbols(size):
            return _compat.sym_hint(size) == self.chunk_len
        return type(size) is int and size == self.chunk_len


@dataclasses.dataclass(frozen=True)
class GraphFacts:
    """What the pass knows about one graph module: which nodes hold sharded data, which only build masks."""

    graph_module: fx.GraphModule
    seq: SequenceLength
    #: Nodes whose values depend on sharded data.
    data: frozenset
    #: Nodes every use of which ends in an SDPA ``attn_mask`` (or, for a pairwise ``[.., T, T]`` value, leaves
    #: the graph: the graph that receives it checks it as a mask), and the nodes of torch's BlockMask
    #: construction whose values reach only its block tables (the flex pass never reads them).
    mask_only: frozenset
    #: Nodes whose value reaches the graph's output or a side effect (see
    #: :func:`~cpcompile.passes.positions.live_nodes`); the others are dead code Dynamo keeps (``max_pos =
    #: t.max() + 1`` never used) and cannot change a result.
    live: frozenset


@dataclasses.dataclass(frozen=True)
class PositionSource(FoundAt):
    """One value derived from the local sequence length and not from sharded data."""

    node: fx.Node
    kind: Kind
    #: Qualified name of the module that made it (``layers.0.attention.rope``), or ``""``.
    layer: str
    facts: GraphFacts = dataclasses.field(repr=False)
    #: ``table_slice``/``narrow``: the sliced table, its sliced dim and the first row; ``arange``: start, step.
    table: fx.Node | None = None
    dim: int = 0
    start: object = 0
    step: object = 1
    #: ``table_slice``: dim of the node's output that holds the sequence, and the index entry that slices it.
    out_dim: int = 0
    entry: int = 0
    #: Why the source cannot be rewritten as found (``""``: it can, if its uses allow).
    problem: str = ""


@dataclasses.dataclass(frozen=True)
class PositionCheck:
    """The outcome of :func:`~cpcompile.passes.positions.check_source`: what to do and, when refused, why and at
    which node."""

    action: Literal["rewrite", "refuse", "mask", "unchanged"]
    reason: str = ""
    #: Refused only because the graph has no symbol for the length (the fix then also names dynamic shapes).
    static: bool = False


@dataclasses.dataclass(frozen=True)
class PositionReport:
    """What the pass did with one position source (``backend.position_reports``, inspect, dumps)."""

    graph_id: int
    node: str
    layer: str
    kind: Kind
    action: Action
    reason: str = ""


def static_reason(seq: SequenceLength) -> str:
    return (
        f"the graph has a static sequence length ({seq.chunk_len} tokens per rank: cpcompile.shard(..., "
        "dynamic=False), a graph break, or one graph per layer under FSDP2 compile with concrete sizes first), so "
        f"a size of {seq.chunk_len} here cannot be told apart from a constant of the same value"
    )


#: Added to the fix of a refusal in a static graph.
STATIC_FIX = (
    "; or compile the model in one graph and call it under cpcompile.shard with its default dynamic=True, so "
    "that the local length is a symbol"
)


#: Reasons of a refusal that a sequence mixer of the model's own code gives (a product over the sequence, a scan,
#: a scan's length used as a value, a mask over positions built by an op the pass does not know, as SSD's ``tril``
#: of its chunk): their fix names :func:`cpcompile.cores.register_head_parallel` when the code is a module-level
#: function, and the backend tries that function as a head-parallel region.
MIXER_REASONS = (
    "contracts the sequence dim",
    "mixes the values of different positions along the sequence",
    "the local sequence length used as a value",
    "is not known to keep the values of different positions apart",
)


def refusal(src: PositionSource, reason: str, static: bool) -> UnsupportedPositionError:
    outside = vocab.masks_built_outside_fix(src.node)
    mixer = any(words in reason for words in MIXER_REASONS)
    register = registration_fix(src.node) if mixer else ""
    outside = f"{outside}; or " if outside else ""
    outside += f"{register}; or " if register else ""
    error = UnsupportedPositionError(
        f"cpcompile cannot make the positions computed at {src.located} ({src.kind}) global across CP ranks: "
        f"{reason}. Fix: {outside}{'' if static else _fix_for(reason)}{FIX}{STATIC_FIX if static else ''}"
    )
    error.functions = mixer_functions(src.node) if mixer else ()
    return error
