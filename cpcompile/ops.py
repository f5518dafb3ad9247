"""Custom ops that rewritten graphs call at run time: each op's schema, its fake implementation and the helper
that emits it into an FX graph, in one place, so the contract between a pass and the runtime is visible.

* ``torch.ops.cpcompile.token_positions(like, table_rows, site)``: the global index of every token this rank
  holds, read from the active :func:`cpcompile.shard` plan (:meth:`cpcompile.CPPlan.token_indices`); emitted by
  :func:`emit_token_positions` for :mod:`cpcompile.passes.positions`.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from cpcompile import runtime

__all__ = ["emit_token_positions", "token_positions"]


@torch.library.custom_op("cpcompile::token_positions", mutates_args=())
def token_positions(like: torch.Tensor, table_rows: int, site: str) -> torch.Tensor:
    """Int64 ``[c]``: the global index of each of this rank's ``c`` local tokens, on ``like``'s device.

    ``like`` is any tensor with the local length ``c`` along dim 0 (only its size and device are read).
    Padding tokens (global index ``>= T``, the batch's unpadded length) get ``T - 1``: they are ignored
    tokens, and the clamp keeps a table lookup in range. ``table_rows >= 0`` is the number of rows of the
    table the indices will select from (counted from the slice's start); ``ValueError`` when it is smaller
    than ``T``, the same on every rank (the check reads only the plan, which every rank shares).
    ``site`` names the position source in errors.
    """
    plan = runtime._require_active(f"the position source at {site}").plan
    if like.shape[0] != plan.chunk_len:
        raise RuntimeError(
            f"the position source at {site} has {like.shape[0]} local positions, but the active plan expects "
            f"this rank's chunk length {plan.chunk_len}; call the model with the `local` batch of the active "
            "cpcompile.shard context"
        )
    if 0 <= table_rows < plan.seq_len:
        raise ValueError(
            f"the position table sliced at {site} has {table_rows} rows, but the global sequence has "
            f"{plan.seq_len} tokens (CP size {plan.cp_size}, {plan.chunk_len} tokens per rank): cpcompile selects "
            f"the rows of the global positions of every rank's tokens, so the table needs at least {plan.seq_len} "
            "rows; build the model with a maximum sequence length of at least the global length and pass the "
            "whole table (a table cut to one rank's rows, as torch's context_parallel(buffers=...) asks for, "
            "is not needed with cpcompile)"
        )
    idx = plan.token_indices().clamp(max=plan.seq_len - 1)
    return idx.to(like.device)


@token_positions.register_fake
def _(like: torch.Tensor, table_rows: int, site: str) -> torch.Tensor:
    return like.new_empty((like.shape[0],), dtype=torch.long)


def emit_token_positions(graph: fx.Graph, like: fx.Node, table_rows: int, site: str) -> fx.Node:
    """Insert ``token_positions(like.detach(), table_rows, site)`` at the graph's insertion point; return it.

    ``like`` is detached first: the op reads only its size, and its int64 output never carries a gradient.
    """
    detached = graph.call_method("detach", (like,))
    return graph.call_function(torch.ops.cpcompile.token_positions.default, (detached, table_rows, site))
