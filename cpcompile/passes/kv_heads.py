"""Find the un-expanded key/value heads behind the K/V an SDPA call receives.

Grouped-query models expand K/V from ``Hkv`` heads to the ``H`` query heads before SDPA (query head ``h`` uses
KV head ``h // n_rep``). Gathering the expanded tensors across CP ranks would move ``n_rep`` times the bytes, so
the pass gathers the source instead and attends with ``enable_gqa=True``. Main API: :func:`kv_source`.

Spellings recognised, matched on the shapes Dynamo recorded (``s``: the source, ``n``: ``n_rep``)::

    s[:, :, None].expand(B, Hkv, n, T, D).reshape(B, H, T, D)        # transformers' repeat_kv
    s.unsqueeze(2).expand(B, Hkv, n, T, D).flatten(1, 2)             # (reshape/view/flatten; .contiguous() allowed)
    s.repeat_interleave(n, dim=1)                                    # torch.repeat_interleave(s, n, dim=1) too
    x.transpose(1, 2)  with x one of the above on s [B, T, Hkv, D] along dim 2 (expansion before the transpose)

``s.repeat(1, n, 1, 1)`` (tiling: query head ``h`` uses KV head ``h % Hkv``) is not GQA's order and is not matched;
unmatched K/V are gathered as SDPA receives them.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from cpcompile import _compat

__all__ = ["KVSource", "kv_source", "unexpanded_heads"]

_RESHAPES = ("reshape", "view", "flatten")
_SAME = _compat.statically_true


@dataclasses.dataclass(frozen=True)
class KVSource:
    """What a site exchanges for K and V."""

    key: fx.Node
    value: fx.Node
    #: True when ``key``/``value`` are the un-expanded heads (the attention then uses ``enable_gqa=True``).
    unexpanded: bool
    #: Layout of ``key``/``value``: ``"bhtd"`` (``[B, Hkv, T, D]``) or ``"bthd"`` (``[B, T, Hkv, D]``: the rewrite
    #: inserts ``transpose(1, 2)``).
    layout: str = "bhtd"
    #: The spelling found (module docstring), ``""`` when none.
    spelling: str = ""


def _meta(node: object) -> torch.Tensor | None:
    if not isinstance(node, fx.Node):
        return None
    value = node.meta.get("example_value", node.meta.get("val"))
    return value if isinstance(value, torch.Tensor) else None


def _is(node: object, *, methods: tuple[str, ...] = (), functions: tuple = ()) -> bool:
    if not isinstance(node, fx.Node):
        return False
    return (node.op == "call_method" and node.target in methods) or (
        node.op == "call_function" and node.target in functions
    )


def _arg(node: fx.Node, index: int, name: str, default: object = None) -> object:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _shape_is(shape: tuple, expected: tuple) -> bool:
    return len(shape) == len(expected) and all(_SAME(a == b) for a, b in zip(shape, expected))


def _skip_contiguous(node: object) -> object:
    while _is(node, methods=("contiguous",)) and node.args:
        node = node.args[0]
    return node


def unexpanded_heads(node: fx.Node, head_dim: int) -> tuple[fx.Node, int, str] | None:
    """``(source, n_rep, spelling)`` when ``node`` repeats every head of ``source`` ``n_rep`` times consecutively
    along ``head_dim`` (head ``h`` of ``node`` is head ``h // n_rep`` of ``source``), else ``None``."""
    out = _meta(node)
    if out is None:
        return None
    # repeat_interleave(n, dim=head_dim)
    if _is(node, methods=("repeat_interleave",), functions=(torch.repeat_interleave,)):
        src, n, dim = node.args[0], _arg(node, 1, "repeats"), _arg(node, 2, "dim")
        s = _meta(src)
        if s is None or not isinstance(n, int) or dim not in (head_dim, head_dim - s.dim()):
            return None
        expected = (*s.shape[:head_dim], s.shape[head_dim] * n, *s.shape[head_dim + 1 :])
        return (src, n, "repeat_interleave") if _shape_is(tuple(out.shape), expected) else None
    # reshape/view/flatten of expand of (unsqueeze | getitem None) at head_dim + 1
    if not _is(node, methods=_RESHAPES, functions=(torch.flatten, torch.reshape)):
        return None
    exp = _skip_contiguous(node.args[0])
    if not _is(exp, methods=("expand",)):
        return None
    unsq = exp.args[0]
    src = unsq.args[0] if isinstance(unsq, fx.Node) and unsq.args else None
    is_unsqueeze = _is(unsq, methods=("unsqueeze",), functions=(torch.unsqueeze,))
    if not (is_unsqueeze or _is(unsq, functions=(operator.getitem,))):
        return None
    s, u, e = _meta(src), _meta(unsq), _meta(exp)
    if s is None or u is None or e is None or u.dim() != s.dim() + 1 or e.dim() != u.dim():
        return None
    at = head_dim + 1
    if not (_shape_is(tuple(u.shape), (*s.shape[:at], 1, *s.shape[at:])) and isinstance(e.shape[at], int)):
        return None
    n = e.shape[at]
    if not _shape_is(tuple(e.shape), (*s.shape[:at], n, *s.shape[at:])):
        return None
    expected = (*s.shape[:head_dim], s.shape[head_dim] * n, *s.shape[head_dim + 1 :])
    if not _shape_is(tuple(out.shape), expected):
        return None
    return src, n, ("unsqueeze_expand" if is_unsqueeze else "repeat_kv")


def _source(node: fx.Node) -> tuple[fx.Node, int, str, str] | None:
    """``(source, n_rep, layout, spelling)`` of an SDPA key/value input ``[B, H, T, D]``, or ``None``."""
    found = unexpanded_heads(node, 1)
    if found is not None:
        return (found[0], found[1], "bhtd", found[2])
    inner = _skip_contiguous(node)
    if _is(inner, methods=("transpose",), functions=(torch.transpose,)):
        dims = {_arg(inner, 1, "dim0"), _arg(inner, 2, "dim1")}
        x = _meta(inner.args[0])
        if x is not None and x.dim() == 4 and dims in ({1, 2}, {-3, -2}, {1, -2}, {-3, 2}):
            found = unexpanded_heads(inner.args[0], 2)
            if found is not None:
                return (found[0], found[1], "bthd", found[2] + " before transpose")
    return None


def kv_source(key: fx.Node, value: fx.Node, enable_gqa: object) -> KVSource:
    """What a site should exchange: the un-expanded heads when both K and V are expanded the same way from
    ``[B, Hkv, T, D]`` (or ``[B, T, Hkv, D]``) sources, else K and V as SDPA receives them."""
    k, v = _source(key), _source(value)
    if enable_gqa is False and k is not None and v is not None and k[1] == v[1] and k[2] == v[2]:
        return KVSource(k[0], v[0], unexpanded=True, layout=k[2], spelling=k[3])
    return KVSource(key, value, unexpanded=False)
