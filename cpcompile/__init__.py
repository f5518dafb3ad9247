"""cpcompile: context parallelism for PyTorch training by compiling the model.

Main API::

    model = torch.compile(model, backend=cpcompile.backend(cp_group))
    with cpcompile.shard(batch, cp_group) as local:  # layout="balanced": every rank the same attention work
        out = model(**local)
        out.loss.backward()
        logits = cpcompile.gather(out.logits)

Positions the model computes from the local sequence length (``arange(T)``, ``rope_cache[:T]``) are made global
in the graph, or refused at compile time (:mod:`cpcompile.passes.positions`, ``backend.position_reports``).
Hand-written losses mask padding with :func:`real_tokens`.

What the backend does to a model, without a cluster: ``cpcompile inspect`` (:func:`cpcompile.inspect.inspect_model`).

With FSDP2 and data parallelism (see :mod:`cpcompile.fsdp`)::

    mesh = cpcompile.init_dp_cp_mesh(dp, cp)
    cpcompile.fully_shard_dp_cp(model, mesh)
    with cpcompile.shard(rows, mesh.get_group("cp"), dp_group=mesh.get_group("dp")) as local: ...
    norm = cpcompile.clip_grad_norm_(model.parameters(), 1.0)

On CPU, create the process groups with ``dist.init_process_group(cpcompile.gloo_backend())``: stock gloo's two
worker threads per group can corrupt the heap when two collectives finish together (:mod:`cpcompile.runtime.gloo`).

Hugging Face ``Trainer`` / TRL ``SFTTrainer``: :mod:`cpcompile.integrations.transformers`. What the backend did, in
torch.compile's tools: ``TORCH_LOGS="cpcompile"`` (``+cpcompile`` adds the graphs), ``TORCH_TRACE`` + ``tlparse``.
"""

import importlib as _importlib
import warnings as _warnings

from cpcompile import inspect  # noqa: F401 - loaded with the package, as before inspect_model left the root
from cpcompile.backend import backend
from cpcompile.errors import (
    MaskMismatchError,
    RankFailedError,
    UnsupportedAttentionError,
    UnsupportedMixingError,
    UnsupportedPositionError,
)
from cpcompile.failsafe import fail_together
from cpcompile.fsdp import fully_shard_dp_cp, init_dp_cp_mesh
from cpcompile.grad import clip_grad_norm_, sync_grads
from cpcompile.layouts import Workload
from cpcompile.losses import per_sample_mean, token_entropy, token_logprobs
from cpcompile.runtime import comm_stats, gather, real_tokens, shard
from cpcompile.runtime.gloo import gloo_backend

#: What a training script calls (at most 20 names); everything else stays importable from its module
#: (``cpcompile.plan.build_plan``, ``cpcompile.passes.counters``, ``cpcompile.options.BackendOptions``, ...).
__all__ = [
    "MaskMismatchError",
    "RankFailedError",
    "UnsupportedAttentionError",
    "UnsupportedMixingError",
    "UnsupportedPositionError",
    "Workload",
    "backend",
    "clip_grad_norm_",
    "comm_stats",
    "fail_together",
    "fully_shard_dp_cp",
    "gather",
    "gloo_backend",
    "init_dp_cp_mesh",
    "per_sample_mean",
    "real_tokens",
    "shard",
    "sync_grads",
    "token_entropy",
    "token_logprobs",
]

#: Names that left the root namespace -> (their module, their name there). Each still resolves from the root for
#: one release, with a ``DeprecationWarning`` naming its home; CHANGELOG.md lists them.
MOVED = {
    "AttentionForm": ("cpcompile.layouts", "AttentionForm"),
    "BackendOptions": ("cpcompile.options", "BackendOptions"),
    "CPBackend": ("cpcompile.backend", "CPBackend"),
    "CPPlan": ("cpcompile.plan", "CPPlan"),
    "CommStats": ("cpcompile.runtime", "CommStats"),
    "FailsafeOptions": ("cpcompile.failsafe", "FailsafeOptions"),
    "Inspection": ("cpcompile.inspect", "Inspection"),
    "MAX_RUNS": ("cpcompile.plan", "MAX_RUNS"),
    "PositionReport": ("cpcompile.passes", "PositionReport"),
    "RankSite": ("cpcompile.inspect", "RankSite"),
    "SiteReport": ("cpcompile.passes", "SiteReport"),
    "build_plan": ("cpcompile.plan", "build_plan"),
    "configure_failsafe": ("cpcompile.failsafe", "configure"),
    "counters": ("cpcompile.passes", "counters"),
    "current_plan": ("cpcompile.runtime", "current_plan"),
    "default_pad_value": ("cpcompile.runtime", "default_pad_value"),
    "dp_cp_mesh": ("cpcompile.fsdp", "dp_cp_mesh"),
    "inspect_model": ("cpcompile.inspect", "inspect_model"),
    "write_dump": ("cpcompile.inspect", "write_dump"),
}


def __getattr__(name: str):
    """A name that moved (:data:`MOVED`): its object, with a ``DeprecationWarning`` naming the new home."""
    if name not in MOVED:
        raise AttributeError(f"module 'cpcompile' has no attribute {name!r}")
    module, attr = MOVED[name]
    _warnings.warn(
        f"cpcompile.{name} moved to {module}.{attr}: import it from there (`from {module} import {attr}`); "
        "the alias in the cpcompile namespace will be removed in the next release",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(_importlib.import_module(module), attr)
