"""``cpcompile.backend``: the torch.compile backend that makes a model context-parallel."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Literal

import torch
import torch.distributed as dist
import torch.fx as fx

from cpcompile import _compat
from cpcompile.passes.sdpa_cp import SiteReport, cp_attention_pass

__all__ = ["BackendOptions", "CPBackend", "backend"]

_INNER = ("inductor", "aot_eager", "eager")
_backend_ids = itertools.count()


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class BackendOptions:
    """Options of :func:`backend`."""

    #: Compiler the rewritten graph is handed to: ``inductor`` (default), ``aot_eager`` or ``eager``.
    inner: Literal["inductor", "aot_eager", "eager"] = "inductor"
    #: The model's transformers config (``model.config``), or ``None``. Gives every layer's sliding window
    #: (``sliding_window``, ``layer_types``), also where the mask is built outside the compiled graph, and
    #: lets the backend refuse a non-SDPA ``attn_implementation`` up front.
    config: object | None = None

    def __post_init__(self) -> None:
        if self.inner not in _INNER:
            raise ValueError(f"inner={self.inner!r} is not a known inner compiler; choose one of {_INNER}")
        if self.config is not None and not hasattr(self.config, "to_dict"):
            raise TypeError(
                f"config must be a transformers PretrainedConfig (model.config) or None, got "
                f"{type(self.config).__name__}"
            )


class CPBackend:
    """A ``(GraphModule, example_inputs) -> callable`` compiler; build it with :func:`backend`.

    Every Dynamo graph goes through :func:`cpcompile.passes.cp_attention_pass` and then the inner compiler.
    ``reports`` lists what was done with every SDPA site of every graph compiled so far.
    """

    def __init__(self, cp_group: dist.ProcessGroup, options: BackendOptions) -> None:
        if _compat.is_non_member_group(cp_group):
            raise ValueError(
                f"cp_group is the placeholder torch.distributed.new_group returns to ranks outside the group, so this "
                f"process (global rank {dist.get_rank()}) is not a member of it; pass the CP group that contains this "
                "rank (every rank calls new_group for every group and keeps the one it belongs to)"
            )
        if not isinstance(cp_group, dist.ProcessGroup):
            raise TypeError(
                f"cp_group must be a torch.distributed.ProcessGroup, got {type(cp_group).__name__}; create one "
                "with torch.distributed.new_group(ranks) or DeviceMesh.get_group('cp')"
            )
        if dist.get_rank(cp_group) < 0:
            raise ValueError(
                f"this process (global rank {dist.get_rank()}) is not a member of cp_group "
                f"(ranks {dist.get_process_group_ranks(cp_group)}); pass the CP group that contains this rank"
            )
        self.cp_group = cp_group
        self.cp_size = dist.get_world_size(cp_group)
        self.group_name = _compat.group_name_of(cp_group)
        self.options = options
        self.reports: list[SiteReport] = []
        self._id = next(_backend_ids)
        self._graphs = itertools.count()

    def __call__(self, gm: fx.GraphModule, example_inputs: list[torch.Tensor]):
        graph_id = next(self._graphs)
        self.reports += cp_attention_pass(
            gm,
            group_name=self.group_name,
            cp_size=self.cp_size,
            graph_id=graph_id,
            site_prefix=f"backend{self._id}/graph{graph_id}",
            config=self.options.config,
        )
        if self.options.inner == "eager":
            return gm.forward
        return _compat.lookup_inner_backend(self.options.inner)(gm, example_inputs)


def backend(
    cp_group: dist.ProcessGroup,
    *,
    inner: Literal["inductor", "aot_eager", "eager"] = "inductor",
    config: object | None = None,
) -> CPBackend:
    """A torch.compile backend that runs every SDPA call of the model as context-parallel attention.

    ``model = torch.compile(model, backend=cpcompile.backend(cp_group))``, then call the model inside
    ``with cpcompile.shard(batch, cp_group) as local: model(**local)``.

    Args:
        cp_group: the context-parallel process group (the ranks that share one sequence).
        inner: compiler the rewritten graph is handed to (``inductor``, ``aot_eager`` or ``eager``).
        config: the model's transformers config (``model.config``), optional: the per-layer sliding windows
            (needed when the mask is built outside the compiled graph, e.g. one graph per layer under FSDP2;
            otherwise read from the graph and checked against the config) and an early refusal of a
            non-SDPA attention implementation.
    """
    return CPBackend(cp_group, BackendOptions(inner=inner, config=config))


_registry_backends: dict[str, CPBackend] = {}


def _registry_backend(gm: fx.GraphModule, example_inputs: list[torch.Tensor]):
    """``torch.compile(model, backend="cpcompile")``: CP over the default (world) process group, inductor."""
    if not dist.is_initialized():
        raise RuntimeError(
            'backend="cpcompile" uses the default process group as the CP group, but torch.distributed is not '
            "initialized; call torch.distributed.init_process_group first, or pass "
            "backend=cpcompile.backend(cp_group)"
        )
    world = dist.group.WORLD
    key = _compat.group_name_of(world)
    if key not in _registry_backends:
        _registry_backends[key] = backend(world)
    return _registry_backends[key](gm, example_inputs)
