"""Communication of the runtime: :class:`CommStats` (what one step sent and received) and the sequence all-gather
behind :func:`cpcompile.gather` (an autograd function whose backward takes this rank's slice back).

Nothing here reads the active :func:`cpcompile.shard` context; :mod:`cpcompile.runtime.context` does.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from cpcompile import _compat

__all__ = ["CommStats", "gather_sequence"]


@dataclasses.dataclass
class CommStats:
    """Collectives the CP attention issued on this rank for one batch (one ``shard`` context), and control rounds;
    apart, the all-gathers of the ops that mix tokens outside attention (:mod:`cpcompile.passes.mixing`).

    Forward all-gathers are counted as they run; every gathered K/V that needs a gradient adds one
    reduce-scatter of the same size in backward.
    """

    #: Number of all-gather calls (one for K, one for V per attention call).
    all_gathers: int = 0
    #: Bytes this rank received from the other ranks in those all-gathers: (N-1) chunks each.
    all_gather_bytes: int = 0
    #: Number of backward reduce-scatters (one per gathered tensor that requires grad).
    reduce_scatters: int = 0
    #: Bytes this rank sends in those reduce-scatters: (N-1) chunks each.
    reduce_scatter_bytes: int = 0
    #: Number of exchanges of the keys a rank's queries see (the halo of sliding-window sites, the selective
    #: exchange of full-attention sites: one for K, one for V per attention call, and again when backward runs
    #: it again: ``regather_kv_in_backward``, activation checkpointing).
    halo_exchanges: int = 0
    #: Bytes this rank received in those exchanges (only the keys its queries see that other ranks hold).
    halo_bytes: int = 0
    #: Bytes this rank sends back in their backward (the gradients of the keys it received), once per attention
    #: call.
    halo_backward_bytes: int = 0
    #: All-gathers of the keys every rank's queries see at flex_attention sites with the selective exchange (one
    #: byte per global token and rank, from which each rank routes its exchange), and the bytes this rank received.
    routing_gathers: int = 0
    routing_bytes: int = 0
    #: Control rounds through the CP group's store (never a collective of the group; see
    #: :mod:`cpcompile.failsafe`): the first-call mask check of each attention site, and one per batch with
    #: ``shard(check_batch=True)``. None on later steps otherwise.
    control_rounds: int = 0
    #: Bytes this rank wrote to and read from the store for them (and, on a group's first step, the few bytes
    #: that let its peers check that its process is alive).
    control_bytes: int = 0
    #: All-gathers of the inputs of ops that mix tokens outside attention, run on the whole sequence (a causal
    #: conv1d, a token shift, a cumsum), and the bytes this rank received in them; each that needs a gradient
    #: adds a reduce-scatter of the same size in backward (``sequence_reduce_scatter_bytes``).
    sequence_gathers: int = 0
    sequence_gather_bytes: int = 0
    sequence_reduce_scatter_bytes: int = 0
    #: Halo exchanges of the inputs of causal regions with a bounded window (a causal conv1d, a token shift: the
    #: tokens before each of this rank's runs, ``cpcompile::halo_exchange``), the bytes this rank received in them,
    #: and the bytes it sends back in their backward (the gradients of those tokens).
    sequence_halos: int = 0
    sequence_halo_bytes: int = 0
    sequence_halo_backward_bytes: int = 0
    #: All-to-alls between the sequence split and the head split (``cpcompile::heads_from_sequence`` and
    #: ``cpcompile::sequence_from_heads``, :mod:`cpcompile.ops.heads`) and the bytes this rank received in them
    #: from the other ranks; each whose input needs a gradient adds the reverse all-to-all of the same size in
    #: backward (``heads_backward_bytes``, bytes received).
    heads_exchanges: int = 0
    heads_bytes: int = 0
    heads_backward_bytes: int = 0
    #: ``heads_bytes`` by the core that exchanged them (``"module.function"`` of :data:`cpcompile.cores.CORES`,
    #: or the ``site`` a caller of the ops named): what each head-parallel region costs in forward.
    heads_bytes_by_site: dict[str, int] = dataclasses.field(default_factory=dict)
    #: All-gathers of the per-run state summaries of a recurrence run by state passing (``cpcompile::state_gather``,
    #: :mod:`cpcompile.ops.state`) and the bytes this rank received in them from the other ranks; each whose input
    #: needs a gradient adds a reduce-scatter of the same size in backward (``state_backward_bytes``). Their size
    #: depends on the state's shape and the number of runs per rank, not on the sequence length.
    state_gathers: int = 0
    state_bytes: int = 0
    state_backward_bytes: int = 0
    #: ``state_bytes`` by the core that gathered them (``"module.function"`` of :data:`cpcompile.cores.CORES`).
    state_bytes_by_site: dict[str, int] = dataclasses.field(default_factory=dict)

    def record_sequence_gather(self, t: torch.Tensor, cp_size: int, needs_grad: bool) -> None:
        nbytes = (cp_size - 1) * t.numel() * t.element_size()
        self.sequence_gathers += 1
        self.sequence_gather_bytes += nbytes
        if needs_grad:
            self.sequence_reduce_scatter_bytes += nbytes

    def record_sequence_halo(self, nbytes: int, needs_grad: bool) -> None:
        self.sequence_halos += 1
        self.sequence_halo_bytes += nbytes
        if needs_grad:
            self.sequence_halo_backward_bytes += nbytes

    def record_halo(self, nbytes: int, needs_grad: bool) -> None:
        self.halo_exchanges += 1
        self.halo_bytes += nbytes
        if needs_grad:
            self.halo_backward_bytes += nbytes

    def record_heads(self, nbytes: int, needs_grad: bool, site: str = "") -> None:
        self.heads_exchanges += 1
        self.heads_bytes += nbytes
        self.heads_bytes_by_site[site] = self.heads_bytes_by_site.get(site, 0) + nbytes
        if needs_grad:
            self.heads_backward_bytes += nbytes

    def record_state(self, nbytes: int, needs_grad: bool, site: str = "") -> None:
        self.state_gathers += 1
        self.state_bytes += nbytes
        self.state_bytes_by_site[site] = self.state_bytes_by_site.get(site, 0) + nbytes
        if needs_grad:
            self.state_backward_bytes += nbytes

    def record_routing(self, nbytes: int) -> None:
        self.routing_gathers += 1
        self.routing_bytes += nbytes

    def record_gather(self, t: torch.Tensor, cp_size: int, needs_grad: bool) -> None:
        nbytes = (cp_size - 1) * t.numel() * t.element_size()
        self.all_gathers += 1
        self.all_gather_bytes += nbytes
        if needs_grad:
            self.reduce_scatters += 1
            self.reduce_scatter_bytes += nbytes

    def record_control(self, nbytes: int, rounds: int = 1) -> None:
        self.control_rounds += rounds
        self.control_bytes += nbytes


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, dim: int, group: dist.ProcessGroup, rank: int, size: int) -> torch.Tensor:
        ctx.dim, ctx.rank, ctx.size = dim, rank, size
        moved = t.movedim(dim, 0).contiguous()
        out = moved.new_empty((moved.shape[0] * size, *moved.shape[1:]))
        _compat.all_gather_into(out, moved, group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # no plan lookup: backward usually runs after the shard context has ended
        c = grad.shape[ctx.dim] // ctx.size
        return grad.narrow(ctx.dim, ctx.rank * c, c).contiguous(), None, None, None, None


def gather_sequence(t: torch.Tensor, dim: int, group: dist.ProcessGroup, rank: int, size: int) -> torch.Tensor:
    """All-gather ``t`` along ``dim`` over ``group`` in rank-major order (``size`` chunks, this rank's is
    ``rank``); the backward returns the incoming gradient of this rank's chunk."""
    return _GatherSeq.apply(t, dim, group, rank, size)
