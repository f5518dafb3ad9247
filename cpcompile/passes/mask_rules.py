"""Masks a model builds from token positions: proved to be cpcompile's visibility rule, or refused.

Main API: :func:`prove_mask` (a :class:`MaskProof`: the sliding windows the mask applies, whether it keeps
documents apart, or why it cannot be proved), used by :mod:`cpcompile.passes.sdpa_cp` on every site whose mask is
built in the graph.

Why at compile time: the runtime compares the model's mask with the plan's local rule on this rank's ``c x c``
block only. A condition that is constant on that block but not across the whole sequence passes that check and
runs wrong: a sliding window of ``W >= c`` tokens written as ``(q - k) < W`` looks causal inside the block, and
chunked attention ``k // 8 == q // 8`` looks causal when ``c <= 8``. So the subgraph that builds the mask is read
as a formula over query and key positions, and every condition must be one the rule has:

* **causal order**: ``k <= q`` in any spelling (``q >= k``, ``k < q + 1``, ``q - k >= 0``, ``~(k > q)``,
  ``ones(T, T).tril()``, ``~ones(T, T).triu(1)``);
* **a sliding window**: ``k > q - W`` in any spelling (``(q - k) < W``, ``q - k <= W - 1``, ``k >= q - W + 1``),
  which becomes the site's window;
* **same document**: equality of per-token values the model got as inputs or computed from them
  (transformers' document ids from ``diff(position_ids) != 1``, a ``document_ids`` input);
* per-token conditions on inputs (a padding mask), combined with ``&``.

The site applies the same-document condition only when the mask has one: a mask proved without it (``k <= q``
of ``arange``, ``ones(T, T).tril()``) attends across packed documents in the model, so the site does too. The step
check cannot tell the two apart when documents end at chunk edges (every rank's block is causal either way), so
this is decided here. A ``[.., T, T]`` mask input made in another graph is not analysed here and keeps the
condition, which the step check compares it with: the graph that makes such a mask refuses to hand it on without a
document condition (:mod:`cpcompile.passes.positions.check`), so an index-only mask never reaches a site as an
input from a compiled graph. A mask read from module state (a buffer, a tensor an earlier call kept on the module)
is refused: its values are not in any graph, and nothing tells whether it keeps documents apart.

Causal order and windows of per-token positions (``position_ids[b, k] <= position_ids[b, q]``, transformers'
packed-sequence mask) hold within a document only, since positions restart at 0 in every one: a mask that orders
them without a same-document condition is refused.

Positions are the local ``arange`` of the sequence length and per-token inputs (``position_ids``: an input dim
of the queries' length, or of another symbol with the same value at this compilation, which the proof then guards
equal to it), moved by layout ops, offsets by int constants and lookups at other positions
(``position_ids[b, q_idx]``, the batch dim told apart from the sequence dim). Anything else a position goes through
before it reaches the mask (``//``, ``%``, ``*``, a comparison with a constant, a table lookup), and a mask
combined with ``|`` or negated as a whole, read from a buffer or written in place, is refused with the model's
source line.

Why one module of about 600 lines: the reader of a mask's subgraph and the rules it proves are one proof; a
spelling accepted in one place and refused in another is the error this module exists to prevent.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from cpcompile import _compat
from cpcompile.passes import vocabulary as vocab
from cpcompile.passes.aliasing import mutated, op_name, viewed_bases
from cpcompile.passes.common import graph_modules, index_dims, node_located, node_value, shape_of

__all__ = ["MaskProof", "outer_arguments", "prove_mask"]


@dataclasses.dataclass(frozen=True)
class MaskProof:
    """What :func:`prove_mask` found: the sliding windows of the mask, or why it is refused."""

    #: Sliding windows (``k > q - W``) the mask applies; empty: causal (and documents, see below) only.
    windows: frozenset = frozenset()
    #: Whether the site applies the same-document condition: ``False`` only for a mask proved to be built without
    #: one (causal order and windows of the token index alone, which attend across packed documents); ``True``
    #: when the mask has one, or was not analysed (a mask input made in another graph, whose maker refuses to hand
    #: it on without one), where the step check against the rule with documents is the guard.
    documents: bool = True
    #: Whether :attr:`documents` is assumed, not proved: the mask (or the part of it that would hold a document
    #: condition) was made outside this graph. The runtime then trusts it only after a batch on which the step
    #: check could see the condition (:meth:`cpcompile.plan.CPPlan.documents_in_blocks`).
    assumed: bool = False
    #: ``""`` when proved; else the refusal, naming the model's source line and the op.
    reason: str = ""


class _Unproven(Exception):
    def __init__(self, node: fx.Node, what: str) -> None:
        super().__init__(f"{what} at {node_located(node)}")


@dataclasses.dataclass(frozen=True)
class _Tokens:
    """A per-token value: one entry per local token along one dim."""

    #: The dim holding the tokens, counted from the right (1: the last dim). In the ``[.., T_q, T_k]`` mask a
    #: value along dim -2 belongs to the query, along dim -1 to the key.
    rdim: int
    #: ``"index"``: the local ``arange`` of the length (ordered, compared as positions); ``"data"``: per-token
    #: inputs and values computed from them (positions, document ids, padding).
    kind: str
    #: An int constant added to the value (``q + 1``); ``None`` when a value known only at run time was added
    #: (the value is still a label, but its order is not known).
    offset: int | None = 0
    #: The arange itself, unmoved (it may index the batch dim of a table when the batch size equals the length).
    bare: bool = False


@dataclasses.dataclass(frozen=True)
class _Difference:
    """``sign * (q - k) + offset``, pairwise."""

    sign: int
    offset: int
    #: A difference of per-token positions (``"data"``), not of the token index.
    data: bool = False


@dataclasses.dataclass(frozen=True)
class _Rule:
    """A bool pairwise mask proved to be causal order, the windows ``windows`` and, where ``documents``, same
    document (or fewer)."""

    windows: frozenset = frozenset()
    #: The node of an order or distance of per-token positions (``position_ids[k] <= position_ids[q]``) among its
    #: conditions: causal order and windows within a document only, since positions restart at 0 in every one.
    ordered: fx.Node | None = None
    #: A same-document condition (equal per-token labels) among its conditions.
    documents: bool = False
    #: A ``[.., T, T]`` mask made elsewhere (a graph input) among its conditions: not analysed here, it may hold a
    #: document condition.
    opaque: bool = False

    def __and__(self, other: _Rule) -> _Rule:
        return _Rule(
            self.windows | other.windows,
            self.ordered or other.ordered,
            self.documents or other.documents,
            self.opaque or other.opaque,
        )


#: Not computed from token positions (constants, sizes, module state, the batch index).
_PLAIN = None
_ONES = "ones"  # a plain tensor of ones (``ones(T, T)``), a marker among plain values

_COMPARE = {"lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "eq": "eq", "ne": "ne"}
_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}
_NEGATE = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt", "eq": "ne", "ne": "eq"}
_NOT = {"invert", "logical_not", "bitwise_not"}
_AND = {"and_", "logical_and", "bitwise_and", "__and__", "mul"}
#: Ops that keep per-token input values per-token labels (document ids, padding): equality stays meaningful.
_DATA_OPS = {
    "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "and_", "or_", "invert",
    "bitwise_not", "diff", "cumsum", "add", "sub", "neg",
}  # fmt: skip
_ONES_FACTORIES = {"ones", "new_ones", "ones_like"}
#: Ops that read no tensor value, only shapes, dtypes and devices.
_SHAPE_ONLY = {
    "size", "dim", "numel", "sym_size", "new_ones", "new_zeros", "new_empty", "new_full", "ones_like", "zeros_like",
    "empty_like", "full_like",
}  # fmt: skip


def _same(a: object, b: object) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return isinstance(a, (int, torch.SymInt)) and isinstance(b, (int, torch.SymInt)) and _compat.statically_true(a == b)


def _int(x: object) -> int | None:
    """A plain int constant (a node's value when it is a concrete int, or a SymInt of no symbol: ``j - i + 1`` of
    one length, x-transformers' ``triu`` diagonal), else ``None``."""
    v = node_value(x) if isinstance(x, fx.Node) else x
    if isinstance(v, torch.SymInt) and not _compat.free_symbols(v):
        v = _compat.sym_hint(v)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def outer_arguments(gm: fx.GraphModule) -> dict[fx.Node, object]:
    """Every placeholder of a graph nested in ``gm`` (the body of a higher-order op such as activation
    checkpointing's ``tag_activation_checkpoint(body, *operands)``) mapped to the operand the calling graph passes
    it: a mask built outside a checkpointed layer is read where it is built."""
    out: dict[fx.Node, object] = {}
    for g in graph_modules(gm):
        for n in g.graph.nodes:
            if n.op != "call_function" or not _compat.is_higher_order_op(n.target) or not n.args:
                continue
            body = n.args[0]
            if not (isinstance(body, fx.Node) and body.op == "get_attr"):
                continue
            module = getattr(g, str(body.target), None)
            if not isinstance(module, fx.GraphModule):
                continue
            holders = [p for p in module.graph.nodes if p.op == "placeholder"]
            if len(holders) == len(n.args) - 1:
                out.update(zip(holders, n.args[1:]))
    return out


class _Prover:
    def __init__(self, length: object, outer: dict | None) -> None:
        self.length = length
        self.outer = outer or {}
        self.values: dict[fx.Node, object] = {}
        self.windows: set[int] = set()
        #: Sizes of inputs read as the token dim because they equal the length at this compilation only (see
        #: :meth:`_is_length`); :func:`prove_mask` guards them equal to it.
        self.guarded: list[object] = []
        #: Whether a tensor was read that is neither token positions nor a per-token input (module state, an
        #: input without a token dim): a mask of plain values read from it is not analysed.
        self.reads_plain_tensors = False
        #: Whether module state was read (a parameter, a buffer, a tensor an earlier call kept on the module): a mask
        #: of plain values read from it is refused (:func:`prove_mask`).
        self.reads_state = False

    # -- values ------------------------------------------------------------------------------------------
    def value(self, x: object) -> object:
        if not isinstance(x, fx.Node):
            return _PLAIN
        if x not in self.values:
            self.values[x] = self._evaluate(x)
        return self.values[x]

    def _evaluate(self, n: fx.Node) -> object:
        if n.op == "placeholder" or n.op == "get_attr":
            return self._input(n)
        if n.op not in ("call_function", "call_method"):
            return _PLAIN
        for u in n.users:  # a mask written in place is not what its ops say
            target = mutated(u)
            if target is not None and n in viewed_bases(target) and u is not n:
                raise _Unproven(u, f"{op_name(u)} writes in place into a value the mask is built from")
        name = op_name(n)
        if name in _SHAPE_ONLY:
            return self._plain(n, name)
        if name in _NOT and n.args and isinstance(n.args[0], fx.Node) and op_name(n.args[0]) in {*_COMPARE, "triu"}:
            return self._not(n, n.args[0])  # the condition itself is not evaluated: its negation is
        inner = n.args[0] if name in _NOT and n.args and isinstance(n.args[0], fx.Node) else None
        if inner is not None and op_name(inner) in _NOT and inner.args and isinstance(inner.args[0], fx.Node):
            v = node_value(inner.args[0])
            if isinstance(v, torch.Tensor) and v.dtype == torch.bool:
                return self.value(inner.args[0])  # ~~mask: the mask (x-transformers' ~attn_mask, then ~ of the masks)
        inputs = [self.value(a) for a in n.all_input_nodes]
        if all(v is _PLAIN or v == _ONES for v in inputs):
            return self._plain(n, name)
        if name == "getitem":
            return self._getitem(n)
        if name in vocab.MASK_LAYOUT:
            return self.value(n.args[0]) if n.args and isinstance(n.args[0], fx.Node) else _PLAIN
        if name in vocab.MASK_RESHAPE:
            return self._reshape(n, name)
        if name in ("add", "sub", "iadd", "isub"):
            return self._add(n, name)
        if name in _COMPARE:
            return self._compare(n, _COMPARE[name])
        if name in _AND:
            return self._and(n, name)
        if name in ("tril", "triu"):
            return self._tril(n, name)
        return self._other(n, name, inputs)

    def _not(self, n: fx.Node, inner: fx.Node) -> object:
        """``~cond`` of one condition: the comparison with the negated operator (``~(k > q)`` is ``k <= q``), or
        ``~triu(ones, d)``, which is ``tril(ones, d - 1)``. A negated conjunction is refused."""
        name = op_name(inner)
        if all(self.value(a) is _PLAIN for a in inner.all_input_nodes):
            return _PLAIN
        if name in _COMPARE:
            return self._compare(inner, _NEGATE[_COMPARE[name]])
        if name == "triu" and self.value(inner.args[0]) == _ONES:
            diagonal = inner.args[1] if len(inner.args) > 1 else inner.kwargs.get("diagonal", 0)
            if _int(diagonal) == 1:
                return _Rule()
        raise _Unproven(n, f"{op_name(n)} of a mask built from token positions (only of one comparison or triu)")

    def _input(self, n: fx.Node) -> object:
        if n in self.outer:  # a nested graph's input: read where the calling graph makes it
            return self.value(self.outer[n])
        shape = shape_of(n)
        if shape is None:
            return _PLAIN
        if _compat.is_module_state(n):
            self.reads_plain_tensors = self.reads_state = True
            return _PLAIN
        dims = [d for d, s in enumerate(shape) if self._is_length(s)]
        v = node_value(n)
        if v.dtype == torch.bool and len(shape) >= 3 and dims[-2:] == [len(shape) - 2, len(shape) - 1]:
            return _Rule(opaque=True)  # a [.., T, T] mask made elsewhere: the runtime compares it with the plan's rule
        if not dims:
            self.reads_plain_tensors = True
            return _PLAIN
        d = 1 if len(shape) >= 2 and 1 in dims else dims[-1]  # [B, T, ...]: the sequence is dim 1
        return _Tokens(len(shape) - d, "data")

    def _is_length(self, size: object) -> bool:
        """Whether an input's size is the mask's length: the same size, or

        * a symbolic input size traced at the mask's constant length (FSDP2's root graph builds transformers'
          mask with the chunk length as a constant while its inputs have a symbolic length);
        * another symbol of the same value at this compilation: ``shard`` marks the sequence dim of every
          per-token input dynamic, and Dynamo gives each its own symbol unless the model's code relates them.
          Llama's RoPE broadcasts ``position_ids`` against the queries, which makes them one symbol; a model that
          reads ``position_ids`` only in its mask (Jamba: no RoPE) keeps two. The proof then holds only while the
          sizes are equal, so :func:`prove_mask` guards them equal (a call where they differ recompiles).
        """
        if _same(size, self.length):
            return True
        if not isinstance(size, torch.SymInt) or _compat.sym_hint(size) != _compat.sym_hint(self.length):
            return False
        if type(self.length) is not int:
            self.guarded.append(size)
        return True

    def _plain(self, n: fx.Node, name: str) -> object:
        """A value computed from plain values only: an arange of the local length is the token index."""
        if name == "arange":
            shape = shape_of(n)
            if shape is not None and len(shape) == 1 and _same(shape[0], self.length):
                start = n.args[0] if len(n.args) > 1 else n.kwargs.get("start", 0)
                step = n.args[2] if len(n.args) > 2 else n.kwargs.get("step", 1)
                if _int(start) is None or _int(step) != 1:
                    raise _Unproven(n, "an arange with a start or step other than int constants, step 1,")
                return _Tokens(1, "index", _int(start), bare=_int(start) == 0)
        if name in _ONES_FACTORIES or (name in ("full", "new_full") and _int(n.args[-1]) == 1):
            return _ONES
        return _PLAIN

    # -- per-token values ----------------------------------------------------------------------------------
    def _getitem(self, n: fx.Node) -> object:
        base, index = n.args[0], n.args[1]
        b = self.value(base)
        entries = index if isinstance(index, tuple) else (index,)
        tensors = [e for e in entries if isinstance(e, fx.Node) and isinstance(node_value(e), torch.Tensor)]
        if tensors:
            return self._lookup(n, b, entries)
        if isinstance(b, _Rule):
            return self._keeps_last_two(n, b, entries)
        if not isinstance(b, _Tokens):
            raise _Unproven(n, "indexing of a value built from token positions")
        shape, out = shape_of(base), shape_of(n)
        kept = _kept_dim(entries, shape, len(shape) - b.rdim)
        if kept is None:
            # some tokens' values (the first position of a row, transformers' packed-sequence detection): per-row
            # values known only at run time, which shift positions without telling their order
            return _PLAIN
        return dataclasses.replace(b, rdim=len(out) - kept)

    def _lookup(self, n: fx.Node, table: object, entries: tuple) -> object:
        """``table[b_idx, t_idx]``: a per-token table read at the token positions (advanced indexing)."""
        if not isinstance(table, _Tokens):
            raise _Unproven(n, "a table or buffer looked up at token positions (its values are not in the graph)")
        shape = shape_of(n.args[0])
        seq = len(shape) - table.rdim
        if any(e is None or e is Ellipsis or isinstance(e, slice) for e in entries) or len(entries) <= seq:
            raise _Unproven(n, "a lookup of token positions with slices or new dims between its indices")
        found = None
        for d, e in enumerate(entries):
            v = self.value(e)
            if d == seq:
                if not (isinstance(v, _Tokens) and v.kind == "index" and v.offset == 0):
                    raise _Unproven(n, "a lookup of per-token values at other than the token index (a shift)")
                found = v
            elif v is not _PLAIN and not (isinstance(v, _Tokens) and v.bare):  # the batch index
                raise _Unproven(n, f"a lookup along dim {d} (not the token dim) at token positions")
        rest = len(shape) - len(entries)
        return _Tokens(found.rdim + rest, table.kind, table.offset)

    def _reshape(self, n: fx.Node, name: str) -> object:
        v = self.value(n.args[0])
        shape, out = shape_of(n.args[0]), shape_of(n)
        if shape is None or out is None:
            raise _Unproven(n, f"{name} of a value built from token positions without a recorded shape")
        if isinstance(v, _Rule):
            if len(out) >= 2 and _same(out[-1], shape[-1]) and _same(out[-2], shape[-2]):
                return v
            raise _Unproven(n, f"{name} moves the query or key dim of a mask")
        if not isinstance(v, _Tokens):
            raise _Unproven(n, f"{name} of a value built from token positions")
        seq = len(shape) - v.rdim
        after = 1
        for s in shape[seq + 1 :]:
            after *= s
        acc = 1
        for k in range(len(out) - 1, -1, -1):  # the out dim of the same size with the same elements after it
            if _same(acc, after) and _same(out[k], shape[seq]):
                return dataclasses.replace(v, rdim=len(out) - k, bare=False)
            acc *= out[k]
        raise _Unproven(n, f"{name} from {list(shape)} to {list(out)} moves token positions across dims")

    def _keeps_last_two(self, n: fx.Node, rule: _Rule, entries: tuple) -> _Rule:
        shape, out = shape_of(n.args[0]), shape_of(n)
        if shape is not None and out is not None and len(shape) >= 2:
            q, k = _kept_dim(entries, shape, len(shape) - 2), _kept_dim(entries, shape, len(shape) - 1)
            if q == len(out) - 2 and k == len(out) - 1:
                return rule
        raise _Unproven(n, "a selection of query or key rows of a mask")

    def _add(self, n: fx.Node, name: str) -> object:
        a, b = n.args[0], n.args[1]
        va, vb = self.value(a), self.value(b)
        sign = -1 if name in ("sub", "isub") else 1
        if isinstance(va, _Tokens) and isinstance(vb, _Tokens) and va.rdim != vb.rdim:
            if sign != -1 or (va.kind == "index") != (vb.kind == "index"):
                raise _Unproven(n, f"{name} of query and key positions (only their difference is read)")
            q_first = va.rdim == 2 and vb.rdim == 1
            if not (q_first or (va.rdim == 1 and vb.rdim == 2)):
                raise _Unproven(n, "a difference of token positions along unexpected dims")
            if va.offset is None or vb.offset is None:
                raise _Unproven(n, f"{name} of positions moved by a value known only at run time")
            return _Difference(1 if q_first else -1, va.offset - vb.offset, data=va.kind == "data")
        tokens, other = (va, b) if isinstance(va, _Tokens) else (vb, a)
        if isinstance(tokens, _Tokens) and self.value(other) is _PLAIN:
            k = _int(other)
            if k is None:
                if tokens.kind == "data":  # still a label; its order is no longer known
                    return dataclasses.replace(tokens, offset=None, bare=False)
                raise _Unproven(n, f"{name} of token positions and a value known only at run time")
            if sign == -1 and tokens is vb:
                raise _Unproven(n, "a constant minus token positions (positions reversed)")
            offset = None if tokens.offset is None else tokens.offset + sign * k
            return dataclasses.replace(tokens, offset=offset, bare=False)
        if isinstance(va, _Difference) and self.value(b) is _PLAIN and _int(b) is not None:
            return _Difference(va.sign, va.offset + sign * _int(b), va.data)
        raise _Unproven(n, f"{name} of values built from token positions")

    def _compare(self, n: fx.Node, op: str) -> object:
        a, b = n.args[0], n.args[1]
        va, vb = self.value(a), self.value(b)
        if isinstance(va, _Tokens) and isinstance(vb, _Tokens) and va.rdim != vb.rdim:
            return self._order(n, op, va, vb)
        if isinstance(vb, _Difference) and not isinstance(va, _Difference):
            va, vb, op = vb, va, _FLIP[op]
            a, b = b, a
        if isinstance(va, _Difference):
            k = _int(b)
            if vb is not _PLAIN or k is None:
                raise _Unproven(n, "a difference of token positions compared with a value known only at run time")
            return self._bound(n, op, va.sign, k - va.offset, va.data)
        tokens = va if isinstance(va, _Tokens) else vb
        if isinstance(tokens, _Tokens) and (va is _PLAIN or vb is _PLAIN):
            if tokens.kind == "index":
                raise _Unproven(n, f"{op} of token positions with a constant (a fixed range of positions)")
            return dataclasses.replace(tokens, bare=False)  # a per-token condition on inputs
        if isinstance(va, _Tokens) and isinstance(vb, _Tokens) and va.kind == vb.kind == "data":
            return dataclasses.replace(va, bare=False)
        raise _Unproven(n, f"{op} of values built from token positions")

    def _order(self, n: fx.Node, op: str, va: _Tokens, vb: _Tokens) -> _Rule:
        """``va op vb`` with one side the query's (rdim 2) and the other the key's (rdim 1)."""
        if {va.rdim, vb.rdim} != {1, 2}:
            raise _Unproven(n, "a comparison of token positions along unexpected dims")
        if va.rdim == 2:  # put the key first: k + a  op  q + b
            va, vb, op = vb, va, _FLIP[op]
        if op == "eq":
            if va.kind == "data" and vb.kind == "data" and va.offset == vb.offset:
                return _Rule(documents=True)  # same document
            raise _Unproven(n, "an equality of token indices (not a document condition)")
        if op == "ne":
            raise _Unproven(n, "ne of query and key positions")
        if (va.kind == "index") != (vb.kind == "index"):
            raise _Unproven(n, f"{op} of a token index with a per-token input")
        if va.offset is None or vb.offset is None:
            raise _Unproven(n, f"{op} of positions moved by a value known only at run time")
        # k + a op q + b  <=>  (q - k) flip(op) (a - b)
        return self._bound(n, _FLIP[op], 1, va.offset - vb.offset, va.kind == "data")

    def _bound(self, n: fx.Node, op: str, sign: int, k: int, data: bool = False) -> _Rule:
        """The condition ``sign * (q - k) op k`` as causal order or a window; refused otherwise. ``data``: of
        per-token positions, which the mask must also keep within a document (:meth:`within_documents`)."""
        ordered = n if data else None
        if sign == -1:
            op, k = _FLIP[op], -k
        d = "q - k"
        if op in ("lt", "le"):  # an upper bound on the distance: a sliding window
            window = k if op == "lt" else k + 1
            if window < 1:
                raise _Unproven(n, f"the condition {d} < {window}, which no key satisfies,")
            self.windows.add(window)
            return _Rule(frozenset({window}), ordered)
        if op in ("gt", "ge"):
            lowest = k + 1 if op == "gt" else k
            if lowest != 0:
                raise _Unproven(n, f"the condition {d} >= {lowest}, which is not causal order,")
            return _Rule(ordered=ordered)
        raise _Unproven(n, f"{op} of query and key positions")

    def _and(self, n: fx.Node, name: str) -> object:
        values = [self.value(a) for a in n.args[:2]]
        if name == "mul" and any(not isinstance(node_value(a), torch.Tensor) or node_value(a).dtype != torch.bool
                                 for a in n.args[:2]):  # fmt: skip
            raise _Unproven(n, "mul of values built from token positions")
        if all(isinstance(v, _Tokens) for v in values):
            if all(v.kind == "data" for v in values):
                return dataclasses.replace(values[0], bare=False) if values[0].rdim == values[1].rdim else _Rule()
            raise _Unproven(n, f"{name} of token positions")
        rule = _Rule()
        for a, v in zip(n.args[:2], values):
            if isinstance(v, _Rule):
                rule &= v
            elif isinstance(v, _Tokens) and v.kind == "data":
                continue  # a per-token condition on inputs (padding)
            elif v is _PLAIN and not _pairwise(a, self.length):
                continue  # a scalar or a constant
            elif v != _ONES:
                raise _Unproven(n, f"{name} of a mask with a value not built from token positions (a buffer?)")
        return rule

    def within_documents(self, value: object) -> None:
        """Refuse a mask that orders per-token positions without a same-document condition: position ids restart
        at 0 in every packed document, so ``position_ids[k] <= position_ids[q]`` alone lets a query see the keys of
        other documents at lower positions, after it as well as before it. A rank's block that holds no document
        boundary looks causal (the step check passes) while the whole sequence's mask is not."""
        if isinstance(value, _Rule) and value.ordered is not None and not value.documents:
            raise _Unproven(
                value.ordered, "an order of per-token positions (position ids) without a same-document condition"
            )

    def _tril(self, n: fx.Node, name: str) -> _Rule:
        v = self.value(n.args[0])
        diagonal = n.args[1] if len(n.args) > 1 else n.kwargs.get("diagonal", 0)
        if name == "triu" or _int(diagonal) != 0:
            raise _Unproven(n, f"{name}(diagonal={diagonal}), which is not causal order,")
        if not (isinstance(v, _Rule) or v == _ONES):
            raise _Unproven(n, f"{name} of a value not built from token positions (a buffer?)")
        return v if isinstance(v, _Rule) else _Rule()

    def _other(self, n: fx.Node, name: str, inputs: list) -> object:
        tokens_only = all(v is _PLAIN or isinstance(v, _Tokens) for v in inputs)
        if tokens_only and name in _DATA_OPS and any(isinstance(v, _Tokens) for v in inputs):
            # per-token labels (documents detected from positions, as transformers does from position_ids or
            # from its own arange when none are given): compared for equality only, their order is not read
            tokens = next(v for v in inputs if isinstance(v, _Tokens))
            return dataclasses.replace(tokens, kind="data", bare=False)
        raise _Unproven(n, f"{name} of values built from token positions")


def _kept_dim(entries: tuple, shape: tuple, dim: int) -> int | None:
    """The output dim of input dim ``dim`` of ``x[entries]`` (basic indexing) when the dim is kept whole, else
    ``None`` (selected, sliced or indexed by an int)."""
    for e, _, d, o in index_dims(entries, len(shape)):
        if d == dim:
            return o if e is Ellipsis or (isinstance(e, slice) and _full_slice(e, shape[d])) else None
    return None


def _full_slice(e: object, size: object) -> bool:
    if not isinstance(e, slice) or e.step not in (None, 1):
        return False
    start = node_value(e.start) if isinstance(e.start, fx.Node) else e.start
    stop = node_value(e.stop) if isinstance(e.stop, fx.Node) else e.stop
    return start in (None, 0) and (stop is None or _compat.statically_true(stop >= size))


def _pairwise(n: object, length: object) -> bool:
    shape = shape_of(n)
    return shape is not None and len(shape) >= 2 and _same(shape[-1], length) and _same(shape[-2], length)


def prove_mask(mask: fx.Node, length: object, outer: dict | None = None) -> MaskProof:
    """Read the subgraph that builds ``mask`` (a bool ``[.., T, T]`` attention mask) for local length ``length``.

    Returns the windows it applies and whether it keeps documents apart (:attr:`MaskProof.documents`), or the
    first condition that is not causal order, a sliding window or a document condition (see the module
    docstring), with the model's source line. A mask that is a graph input (made in another graph) is proved here
    as far as this graph sees it, with documents; the runtime checks it on every step. A mask of values read from
    module state is refused.
    ``outer`` (:func:`outer_arguments`) follows the inputs of nested graphs to the graph that calls them.
    """
    prover = _Prover(length, outer)
    try:
        value = prover.value(mask)
        prover.within_documents(value)
    except _Unproven as e:
        return MaskProof(
            reason=f"the mask is built from token positions through {e}, which cpcompile cannot prove to be "
            "causal order, a sliding window or a document condition across CP ranks (this rank's block of the mask "
            "can look right while the whole sequence's is not); build the mask from k <= q, k > q - window and "
            "equal document ids (or position ids restarting at 0 per document), or run this attention without "
            "context parallelism"
        )
    if isinstance(value, _Tokens) and value.kind == "index":
        return MaskProof(reason="the mask is a per-token index, not a [.., T, T] mask of queries and keys")
    for size in prover.guarded:
        if not _compat.guard_equal(size, length):
            return MaskProof(
                reason=f"the mask reads per-token inputs of length {size}, which Dynamo traced apart from the "
                f"length {length} of the queries, and cpcompile cannot guard them equal; pass inputs that the "
                "model relates to the tokens, or run this attention without context parallelism"
            )
    if (value is _PLAIN or value == _ONES) and prover.reads_state:
        return MaskProof(
            reason="the mask is read from module state (a buffer, or a tensor an earlier call kept on the module), "
            "whose values cpcompile cannot read: neither its order nor whether it keeps packed documents apart "
            "can be proved across CP ranks, and this rank's block of it can look right while the whole sequence's "
            "is not; build the mask in the attention's graph on every call, from arange(T) (k <= q, k > q - "
            "window) and equal document ids or position ids restarting at 0 per document, or run this attention "
            "without context parallelism"
        )
    documents, assumed = _documents(value, prover)
    return MaskProof(windows=frozenset(prover.windows), documents=documents, assumed=assumed)


def _documents(value: object, prover: _Prover) -> tuple[bool, bool]:
    """:attr:`MaskProof.documents` and :attr:`MaskProof.assumed` of a proved mask: no documents for a rule without
    a same-document condition and for a mask of plain values made in the graph (``ones(T, T).tril()``), which
    depends on no per-token input; documents, proved, for a rule with one; documents, assumed, wherever the mask
    was not analysed (a rule with a mask made elsewhere, plain values read from inputs without a token dim, a
    per-token value that is not a ``[.., T, T]`` rule). Plain values read from module state do not get here:
    :func:`prove_mask` refuses them."""
    if isinstance(value, _Rule):
        return value.documents or value.opaque, not value.documents and value.opaque
    if value is _PLAIN or value == _ONES:
        return prover.reads_plain_tensors, prover.reads_plain_tensors
    return True, True
