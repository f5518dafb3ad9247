"""The runtime shim: what runs around the compiled model in every training step.

- :mod:`~cpcompile.runtime.sharding`: :func:`shard` slices a global batch for this rank and activates its plan;
- :mod:`~cpcompile.runtime.shard_options`: the options of ``shard``, and what pads each key;
- :mod:`~cpcompile.runtime.batch_check`: every CP rank passed the same batch (fingerprints, one control round);
- :mod:`~cpcompile.runtime.context`: the active shard context, read by the ops of the rewritten graph and by
  :func:`current_plan`, :func:`gather`, :func:`real_tokens`, :func:`comm_stats`;
- :mod:`~cpcompile.runtime.comm`: :class:`CommStats` and the sequence all-gather behind :func:`gather`;
- :mod:`~cpcompile.runtime.workload`: which attention forms were compiled per CP group (the balanced layout's
  default workload);
- :mod:`~cpcompile.runtime.gloo`: :func:`gloo_backend`, gloo with one worker thread per group (stock gloo's two
  can free a status string twice when two collectives of a group finish together).

``sync_grads`` lives with the other gradient code in :mod:`cpcompile.grad` and is re-exported here.
"""

from cpcompile.grad import sync_grads
from cpcompile.runtime.comm import CommStats
from cpcompile.runtime.context import (
    Active,
    active_context,
    comm_stats,
    current_context,
    current_plan,
    gather,
    is_exact,
    is_proved_mask,
    meet_before_backward,
    real_tokens,
    record_exact,
    record_graph_run,
    record_proved_masks,
    tensor_key,
)
from cpcompile.runtime.shard_options import default_pad_value
from cpcompile.runtime.sharding import check_group, mark_local_dynamic, shard
from cpcompile.runtime.workload import compiled_workload, record_attention_form

__all__ = [
    "Active",
    "CommStats",
    "active_context",
    "check_group",
    "comm_stats",
    "compiled_workload",
    "current_context",
    "current_plan",
    "default_pad_value",
    "gather",
    "is_exact",
    "is_proved_mask",
    "mark_local_dynamic",
    "tensor_key",
    "real_tokens",
    "record_attention_form",
    "meet_before_backward",
    "record_graph_run",
    "record_exact",
    "record_proved_masks",
    "shard",
    "sync_grads",
]
