"""FSDP2 with context parallelism: the ``(dp, cp)`` device mesh and ``fully_shard`` over its dp x cp ranks.

Main API::

    mesh = cpcompile.init_dp_cp_mesh(dp=2, cp=2)                 # dims ("dp", "cp") + flattened "dp_cp"
    cpcompile.fully_shard_dp_cp(model, mesh)                     # per decoder layer and at the root
    model = torch.compile(model, backend=cpcompile.backend(mesh.get_group("cp")))
    with cpcompile.shard(rows_of_this_dp_rank, mesh.get_group("cp"), dp_group=mesh.get_group("dp")) as local:
        model(**local).loss.backward()                           # every gradient: the global batch's gradient

The gradient contract, in one place (:func:`fully_shard_dp_cp`): every rank's loss is its share of the loss of
the whole global batch (``cpcompile.shard(..., dp_group=...)`` divides by the global token count, and
:func:`cpcompile.per_sample_mean` by the global sample count), so the global batch's gradient is the SUM of the
per-rank gradients over all dp x cp ranks. A CP rank's gradient is a partial sum over its own tokens: it must
be added to the other CP ranks' parts, never averaged with them nor left alone. FSDP2 averages over its mesh
by default (divides by dp x cp), so the helper sets its gradient divide factor to 1 (a plain sum).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from cpcompile import _compat

__all__ = ["DP", "CP", "DP_CP", "init_dp_cp_mesh", "fully_shard_dp_cp", "dp_cp_mesh"]

#: Mesh dimension names used by :func:`init_dp_cp_mesh`.
DP, CP = "dp", "cp"
#: Name of the flattened 1-D mesh over all dp x cp ranks (FSDP2 shards parameters over it).
DP_CP = "dp_cp"


def init_dp_cp_mesh(dp: int, cp: int, *, device_type: str | None = None) -> DeviceMesh:
    """The 2-D device mesh ``(dp, cp)`` over all ranks, with its 1-D dp x cp mesh (:func:`dp_cp_mesh`) created.

    Rank ``r`` has DP index ``r // cp`` and CP index ``r % cp`` (CP ranks are neighbours, so on GPUs a CP group
    stays inside a node as long as ``cp`` divides the GPUs per node). ``mesh.get_group("cp")`` is the group
    for :func:`cpcompile.backend` and :func:`cpcompile.shard`, ``mesh.get_group("dp")`` the ``dp_group`` of
    :func:`cpcompile.shard`, and :func:`dp_cp_mesh` the 1-D mesh FSDP2 shards over.

    Args:
        dp: data-parallel size (number of different row blocks of the global batch).
        cp: context-parallel size (number of chunks of every sequence).
        device_type: ``"cuda"``, ``"cpu"``, ...; default ``"cuda"`` when the default process group uses NCCL,
            else ``"cpu"``.
    """
    for name, value in (("dp", dp), ("cp", cp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not dist.is_initialized():
        raise RuntimeError(
            "init_dp_cp_mesh needs an initialised default process group; call "
            "torch.distributed.init_process_group(...) first (torchrun sets the environment for it)"
        )
    world = dist.get_world_size()
    if dp * cp != world:
        raise ValueError(
            f"dp={dp} x cp={cp} = {dp * cp} ranks, but the world has {world}; choose dp and cp with "
            f"dp * cp == {world}, or launch dp * cp processes"
        )
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, (dp, cp), mesh_dim_names=(DP, CP))
    dp_cp_mesh(mesh)
    return mesh


def dp_cp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh over all ranks of a ``("dp", "cp")`` mesh, the one FSDP2 shards over.

    When ``dp`` or ``cp`` is 1 this is the other dimension's slice; otherwise the flattened ``"dp_cp"`` mesh,
    created (a new process group, collective over the mesh's ranks) on first use and cached on the mesh.
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}; build it with "
            "cpcompile.init_dp_cp_mesh(dp, cp)"
        )
    if mesh.mesh_dim_names != (DP, CP):
        raise ValueError(
            f"mesh has dimensions {mesh.mesh_dim_names}, expected exactly ({DP!r}, {CP!r}); build it with "
            "cpcompile.init_dp_cp_mesh(dp, cp) or init_device_mesh(..., mesh_dim_names=('dp', 'cp'))"
        )
    if mesh.size(0) == 1:  # a 1-D slice already spans all ranks: no new process group needed
        return mesh[CP]
    if mesh.size(1) == 1:
        return mesh[DP]
    return _compat.flatten_mesh(mesh[DP, CP], DP_CP)


def fully_shard_dp_cp(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    *,
    layers: Iterable[torch.nn.Module] | None = None,
    **fully_shard_kwargs,
) -> torch.nn.Module:
    """Apply FSDP2 ``fully_shard`` to every layer and to the root of ``model``, over the dp x cp ranks of ``mesh``.

    Parameters are sharded over the flattened ``"dp_cp"`` mesh (all ``dp * cp`` ranks), and every FSDP module's
    gradient reduction is a SUM over those ranks (divide factor 1), so that with per-rank losses that add up to
    the global loss (``cpcompile.shard(..., dp_group=...)``) every gradient is exactly the gradient of the global
    batch: the CP ranks' partial gradients are added, the DP ranks' too. Compile the model afterwards with
    ``cpcompile.backend(mesh.get_group("cp"))``.

    Args:
        model: the model (modified in place and returned; its class becomes an ``FSDPModule``).
        mesh: a 2-D mesh with dimensions ``("dp", "cp")``, e.g. from :func:`init_dp_cp_mesh`.
        layers: modules to shard one by one (each all-gathers its parameters just before use). Default: every
            module whose class is listed in the model's ``_no_split_modules`` (the decoder layers of a
            transformers model).
        fully_shard_kwargs: passed to every ``fully_shard`` call (``reshard_after_forward``, ``mp_policy``,
            ``offload_policy``); ``mesh`` is set by this function.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if "mesh" in fully_shard_kwargs:
        raise ValueError(
            "fully_shard_dp_cp sets the FSDP mesh itself (the flattened dp x cp mesh); pass the ('dp', 'cp') mesh "
            "as the second argument, not mesh= in the keyword arguments"
        )
    flat = dp_cp_mesh(mesh)
    if layers is None:
        names = set(getattr(model, "_no_split_modules", None) or ())
        layers = [m for m in model.modules() if type(m).__name__ in names]
        if not layers:
            raise ValueError(
                f"fully_shard_dp_cp could not find the layers of {type(model).__name__} (no module class listed in "
                f"its _no_split_modules={sorted(names)}); pass layers=[...] (e.g. model.model.layers)"
            )
    for layer in layers:
        fully_shard(layer, mesh=flat, **fully_shard_kwargs)
    fully_shard(model, mesh=flat, **fully_shard_kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            _sum_gradients(module)
    return model


def _sum_gradients(module: FSDPModule) -> None:
    """Make ``module``'s gradient reduce-scatter a plain sum over its mesh (see the module docstring)."""
    module.set_gradient_divide_factor(1.0)
    # A factor of 1 would otherwise become a PREMUL_SUM reduction, which gloo does not implement; a SUM with a
    # no-op post-division is the same reduction on every backend.
    module.set_force_sum_reduction_for_comms(True)
