"""Which graph nodes write into which tensors: in-place ops, views, and when a tensor's value is final.

Dynamo graphs keep the model's in-place writes (``buf[..., :d].copy_(k)``, ``inv[perm] = arange(n)``,
``x.add_(y)``). A pass that reads a tensor's value at some point of the graph (the attention pass issuing the
exchange of K/V) or that asks what a tensor holds (the positions pass following sharded data) must see these
writes, also when they go through a view of the tensor. Used by :mod:`cpcompile.passes.positions` and
:mod:`cpcompile.passes.sdpa_cp`.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from cpcompile import _compat

__all__ = ["INPLACE_OPERATORS", "VIEWS", "is_inplace", "last_write", "mutated", "op_name", "viewed_bases"]

#: ``operator`` names of Python's augmented assignments (``x += y`` traced on a tensor).
INPLACE_OPERATORS = frozenset({"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior", "ixor"})
#: Ops whose output shares its first argument's storage: an in-place write into the output writes the base too.
VIEWS = frozenset(
    {"getitem", "narrow", "select", "view", "transpose", "permute", "unsqueeze", "squeeze", "expand", "t"}
)


def op_name(n: fx.Node) -> str:
    """The op's plain name (``"arange"``, ``"getitem"``, ``"index_select"``; the node's kind for non-calls)."""
    if n.op == "call_method":
        return str(n.target)
    if n.op != "call_function":
        return n.op
    if n.target is operator.getitem:
        return "getitem"
    overload = _compat.op_overload_name(n.target)
    if overload is not None:
        return overload
    return getattr(n.target, "__name__", str(n.target))


def is_inplace(name: str) -> bool:
    """Whether an op of this name writes into its first argument (``add_``, ``setitem``, ``iadd``)."""
    if name in INPLACE_OPERATORS or name == "setitem":
        return True
    return name.endswith("_") and not name.endswith("__") and name not in {"and_", "or_", "not_", "is_"}


def mutated(n: fx.Node) -> fx.Node | None:
    """The tensor an in-place op writes into (its first argument, or ``out=``), or ``None``."""
    out = n.kwargs.get("out")
    if isinstance(out, fx.Node):
        return out
    if n.op in ("call_function", "call_method") and is_inplace(op_name(n)) and n.args:
        first = n.args[0]
        return first if isinstance(first, fx.Node) else None
    return None


def _is_tensor(n: object) -> bool:
    return isinstance(n, fx.Node) and isinstance(n.meta.get("example_value", n.meta.get("val")), torch.Tensor)


def _is_view_of_first(n: fx.Node) -> bool:
    if op_name(n) not in VIEWS or not n.args or not _is_tensor(n.args[0]):
        return False
    if op_name(n) == "getitem":
        entries = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
        return not any(_is_tensor(e) for e in entries)  # advanced indexing copies
    return True


def viewed_bases(n: fx.Node) -> list[fx.Node]:
    """``n`` and the tensors it is a view of (``buf[..., :d]``: itself, then ``buf``), innermost first."""
    out = [n]
    while _is_view_of_first(n):
        n = n.args[0]
        out.append(n)
    return out


def last_write(t: fx.Node) -> fx.Node:
    """The node after which ``t``'s value is final: ``t``, or the last in-place write into ``t``, into a tensor
    ``t`` is a view of, or into another view of that tensor. DeepSeek-V3 allocates its key buffer with
    ``new_empty`` and fills it with ``buf[..., :d].copy_(k)``: an op that reads ``t`` must come after the writes."""
    order = {n: i for i, n in enumerate(t.graph.nodes)}
    root = viewed_bases(t)[-1]
    aliases, queue, last = {root}, [root], t
    while queue:
        a = queue.pop()
        for u in a.users:
            if u not in aliases and _is_view_of_first(u) and u.args[0] is a:
                aliases.add(u)
                queue.append(u)
            elif mutated(u) is a and order[u] > order[last]:
                last = u
    return last
