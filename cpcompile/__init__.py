"""cpcompile: context parallelism for PyTorch training by compiling the model.

Main API::

    model = torch.compile(model, backend=cpcompile.backend(cp_group))
    with cpcompile.shard(batch, cp_group) as local:
        out = model(**local)
        out.loss.backward()
        logits = cpcompile.gather(out.logits)

What the backend does to a model, without a cluster: ``cpcompile inspect`` (:func:`inspect_model`).
"""

from cpcompile.backend import BackendOptions, CPBackend, backend
from cpcompile.inspect import Inspection, SiteRow, inspect_model, write_dump
from cpcompile.passes import SiteReport, UnsupportedAttentionError, counters
from cpcompile.plan import CPPlan, build_plan
from cpcompile.runtime import CommStats, MaskMismatchError, comm_stats, current_plan, gather, shard, sync_grads

__all__ = [
    "BackendOptions",
    "CPBackend",
    "CPPlan",
    "CommStats",
    "Inspection",
    "MaskMismatchError",
    "SiteReport",
    "SiteRow",
    "UnsupportedAttentionError",
    "backend",
    "build_plan",
    "comm_stats",
    "counters",
    "current_plan",
    "gather",
    "inspect_model",
    "shard",
    "sync_grads",
    "write_dump",
]
