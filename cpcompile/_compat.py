"""Every use of a private or version-dependent torch API lives here (torch >= 2.11 supported).

Each helper names the torch releases it was checked against.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as _fc

__all__ = [
    "SDPA_TARGETS",
    "FLEX_ATTENTION_TARGETS",
    "all_gather_into",
    "all_gather_seq",
    "group_name_of",
    "is_non_member_group",
    "lookup_inner_backend",
    "mark_seq_dynamic",
    "node_module_path",
    "statically_true",
]

#: Callables under which Dynamo records ``F.scaled_dot_product_attention`` (torch 2.11-2.13: the C function).
SDPA_TARGETS = frozenset({torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention})



def _flex_targets() -> frozenset:
    targets = set()
    hop = getattr(getattr(torch.ops, "higher_order", None), "flex_attention", None)
    if hop is not None:
        targets.add(hop)
    try:
        from torch.nn.attention.flex_attention import flex_attention

        targets.add(flex_attention)
    except ImportError:  # pragma: no cover - torch without flex attention
        pass
    return frozenset(targets)


#: Callables under which ``flex_attention`` appears in Dynamo graphs (torch 2.11-2.13: the higher-order op).
FLEX_ATTENTION_TARGETS = _flex_targets()

# torch 2.13: `all_gather_single_autograd` (an alias of `all_gather_single`, whose op carries autograd).
# torch 2.11-2.12: `all_gather_tensor_autograd`. Both backprop as a sum reduce-scatter.
_all_gather_autograd = getattr(_fc, "all_gather_single_autograd", None) or _fc.all_gather_tensor_autograd


def all_gather_seq(t: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """All-gather ``t`` along ``dim`` over the group called ``group_name``, with autograd.

    Forward: concatenation of every rank's ``t`` in rank order. Backward: sum reduce-scatter of the gradient,
    so each rank receives the sum over ranks of the gradient of its own slice. Works eagerly and traced by
    Dynamo/AOTAutograd (functional collectives).
    """
    return _all_gather_autograd(t.contiguous(), dim, group_name)


def all_gather_into(out: torch.Tensor, t: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Eager all-gather of contiguous ``t`` into ``out`` along dim 0.

    torch 2.13 renamed ``all_gather_into_tensor`` to ``all_gather_single`` (the old name warns); 2.11-2.12
    only have the old name.
    """
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, t, group=group)


def group_name_of(group: dist.ProcessGroup) -> str:
    """The registered name of a process group (torch 2.11-2.13: ``ProcessGroup.group_name``)."""
    return group.group_name


def is_non_member_group(group: object) -> bool:
    """True for the value ``new_group`` returns on ranks outside the group (torch 2.11-2.13: the int ``-100``
    ``GroupMember.NON_GROUP_MEMBER``)."""
    sentinel = getattr(dist.GroupMember, "NON_GROUP_MEMBER", None)
    return sentinel is not None and type(group) is type(sentinel) and group == sentinel


def lookup_inner_backend(name: str):
    """The compiler function registered under ``name`` (torch 2.11-2.13: ``torch._dynamo.backends.registry``)."""
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(name)


def node_module_path(node: torch.fx.Node) -> str:
    """The qualified module path of the module that made ``node`` (Dynamo's ``nn_module_stack`` metadata).

    Dynamo names modules like ``L['self'].model.layers[0].self_attn``; this returns ``model.layers.0.self_attn``.
    Returns ``""`` when the node carries no module stack.
    """
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path, _cls = list(stack.values())[-1]
    return _clean_module_path(str(path))


def _clean_module_path(path: str) -> str:
    import re

    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"^L\['([^']+)'\]", r"\1", path)
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return path.lstrip(".")


def statically_true(expr: object) -> bool:
    """True when a (possibly symbolic) boolean is known true without adding a guard (torch 2.11-2.13)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(expr))


def mark_seq_dynamic(t: torch.Tensor, dim: int = 1) -> None:
    """Ask Dynamo to compile ``t``'s ``dim`` as a symbolic size from the first compile on.

    torch 2.11-2.13: ``torch._dynamo.maybe_mark_dynamic`` (a hint, not a constraint: no error if the graph
    specialises the size).
    """
    torch._dynamo.maybe_mark_dynamic(t, dim)
