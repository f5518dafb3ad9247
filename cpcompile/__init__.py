"""cpcompile: context parallelism for PyTorch training by compiling the model.

Main API::

    model = torch.compile(model, backend=cpcompile.backend(cp_group))
    with cpcompile.shard(batch, cp_group) as local:
        out = model(**local)
        out.loss.backward()
        logits = cpcompile.gather(out.logits)
"""

from cpcompile.backend import BackendOptions, CPBackend, backend
from cpcompile.passes import SiteReport, UnsupportedAttentionError, counters
from cpcompile.plan import CPPlan, build_plan
from cpcompile.runtime import CommStats, MaskMismatchError, comm_stats, current_plan, gather, shard, sync_grads

__all__ = [
    "BackendOptions",
    "CPBackend",
    "CPPlan",
    "CommStats",
    "MaskMismatchError",
    "SiteReport",
    "UnsupportedAttentionError",
    "backend",
    "build_plan",
    "comm_stats",
    "counters",
    "current_plan",
    "gather",
    "shard",
    "sync_grads",
]
