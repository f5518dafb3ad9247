"""Every use of a private or version-dependent torch API lives here (torch >= 2.11 supported).

Each helper names the torch releases it was checked against.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as _fc
from torch._dynamo.exc import ShortenTraceback as _ShortenTraceback

__all__ = [
    "SDPA_TARGETS",
    "PassThroughCompileError",
    "all_gather_into",
    "all_gather_seq",
    "group_name_of",
    "init_fake_process_group",
    "lookup_inner_backend",
    "node_module_path",
    "statically_true",
]

#: Callables under which Dynamo records ``F.scaled_dot_product_attention`` (torch 2.11-2.13: the C function).
SDPA_TARGETS = frozenset({torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention})

# torch 2.13: `all_gather_single_autograd` (an alias of `all_gather_single`, whose op carries autograd).
# torch 2.11-2.12: `all_gather_tensor_autograd`. Both backprop as a sum reduce-scatter.
_all_gather_autograd = getattr(_fc, "all_gather_single_autograd", None) or _fc.all_gather_tensor_autograd


class PassThroughCompileError(_ShortenTraceback):
    """Base of errors a backend raises at compile time that must reach the user unchanged.

    Dynamo wraps any other exception a backend raises in ``torch._dynamo.exc.BackendCompilerFailed``, so
    ``except cpcompile.UnsupportedAttentionError`` would never match. Subclasses of ``ShortenTraceback`` are
    re-raised as they are (torch 2.13 ``OutputGraph.call_user_compiler``; inductor's ``TritonMissing`` relies on
    the same rule). Still a ``RuntimeError``.
    """

    def __init__(self, *args: object) -> None:
        super().__init__(*args, first_useful_frame=None)


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


def init_fake_process_group(rank: int, world_size: int) -> None:
    """Initialise a default process group of the "fake" backend: one process acts as ``rank`` of ``world_size``.

    No collective moves data (outputs are left as they are), so it only suits tests that compile graphs or
    check errors raised before any result is used. The backend is registered by a private testing module
    (torch 2.11-2.13: ``torch.testing._internal.distributed.fake_pg``).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


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
