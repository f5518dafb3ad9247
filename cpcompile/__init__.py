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

What the backend does to a model, without a cluster: ``cpcompile inspect`` (:func:`inspect_model`).

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

from cpcompile.backend import backend
from cpcompile.errors import (
    MaskMismatchError,
    RankFailedError,
    UnsupportedAttentionError,
    UnsupportedMixingError,
    UnsupportedPositionError,
)
from cpcompile.failsafe import FailsafeOptions, fail_together
from cpcompile.failsafe import configure as configure_failsafe
from cpcompile.fsdp import fully_shard_dp_cp, init_dp_cp_mesh
from cpcompile.grad import clip_grad_norm_, sync_grads
from cpcompile.inspect import inspect_model
from cpcompile.layouts import AttentionForm, Workload
from cpcompile.losses import per_sample_mean, token_entropy, token_logprobs
from cpcompile.runtime import comm_stats, gather, real_tokens, shard
from cpcompile.runtime.gloo import gloo_backend

#: What a user calls; everything else stays importable from its module (``cpcompile.plan.build_plan``,
#: ``cpcompile.passes.counters``, ``cpcompile.options.BackendOptions``, ...).
__all__ = [
    "AttentionForm",
    "FailsafeOptions",
    "MaskMismatchError",
    "RankFailedError",
    "UnsupportedAttentionError",
    "UnsupportedMixingError",
    "UnsupportedPositionError",
    "Workload",
    "backend",
    "clip_grad_norm_",
    "comm_stats",
    "configure_failsafe",
    "fail_together",
    "gloo_backend",
    "fully_shard_dp_cp",
    "gather",
    "init_dp_cp_mesh",
    "inspect_model",
    "per_sample_mean",
    "real_tokens",
    "shard",
    "sync_grads",
    "token_entropy",
    "token_logprobs",
]
