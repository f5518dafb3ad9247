"""The active :func:`cpcompile.shard` context of a thread, and what reads it.

The compiled graph cannot carry the per-batch layout (FSDP2 splits a model into one graph per layer, and the
layer graphs never see ``position_ids``), so :func:`cpcompile.shard` activates a :class:`~cpcompile.plan.CPPlan`
for the duration of a ``with`` block (:func:`activated`) and the rewritten graph reads it at run time through the
custom ops of :mod:`cpcompile.ops` (:func:`active_context` is their way in). The user-facing readers live here
too: :func:`current_plan`, :func:`gather`, :func:`real_tokens`, :func:`comm_stats`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist

from cpcompile import _compat, cores, failsafe
from cpcompile.errors import UnsupportedAttentionError
from cpcompile.plan import CPPlan, count_runs
from cpcompile.runtime.comm import CommStats, gather_sequence

__all__ = [
    "Active",
    "StepRecord",
    "TensorSet",
    "activated",
    "active_context",
    "comm_stats",
    "current_context",
    "current_plan",
    "check_token_mixing",
    "ensure_inactive",
    "gather",
    "is_exact",
    "meet_before_backward",
    "real_tokens",
    "record_graph_run",
    "record_exact",
    "tensor_key",
]


@dataclasses.dataclass
class StepRecord:
    """What ran in one :func:`shard` step: rewritten attention calls, and compiled graphs without attention."""

    #: Calls of rewritten attention sites (``cpcompile::site_plan``).
    sites: int = 0
    #: Backend name -> frames of the graphs it compiled for this CP group that ran in the step and mix no tokens
    #: across ranks (no rewritten attention, no gathered region).
    unmixed: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    #: Backends whose graphs that ran in the step mix tokens across ranks.
    mixed: set[str] = dataclasses.field(default_factory=set)
    #: The step's backward round was held (:func:`meet_before_backward`).
    backward_met: bool = False


@dataclasses.dataclass(frozen=True)
class Active:
    """The active :func:`shard` context: its plan, CP group and collective counts."""

    plan: CPPlan
    group: dist.ProcessGroup | None
    comm: CommStats = dataclasses.field(default_factory=lambda: CommStats())
    #: The model masks already compared with the plan in this step, by site form (written only by the attention
    #: ops through :meth:`TensorSet.add`).
    checked_masks: TensorSet = dataclasses.field(default_factory=lambda: TensorSet())
    #: The attention forms ``(documents, window)`` whose sites without a model mask held their round this step.
    checked_forms: set = dataclasses.field(default_factory=set)
    #: The masks a compiled graph proved to keep documents apart and handed on in this step (written by
    #: :func:`record_proved_masks`, read through :func:`is_proved_mask`).
    proved_masks: TensorSet = dataclasses.field(default_factory=lambda: TensorSet())
    #: Per-token tensors known to hold, at this rank's tokens, what the whole-sequence run holds there: the
    #: local batch ``shard`` made, and what compiled graphs of the CP group computed from such tensors only
    #: (written by :func:`record_exact`, read through :func:`is_exact`).
    exact: TensorSet = dataclasses.field(default_factory=lambda: TensorSet())
    ran: StepRecord = dataclasses.field(default_factory=StepRecord)
    #: ``shard(recurrence=...)``: ``"state"`` or ``"heads"`` (:mod:`cpcompile.cores`).
    recurrence: str = "heads"


def tensor_key(t: torch.Tensor) -> tuple | None:
    """What identifies a tensor's values while it lives: its memory (address, shape, strides) and its version (an
    in-place write changes it). ``None`` for a tensor without a version counter (made under
    ``torch.inference_mode``), whose in-place writes cannot be seen: such a tensor is never recognised."""
    if t.is_inference():
        return None
    return (t.data_ptr(), t._version, tuple(t.shape), t.stride())


class TensorSet:
    """Tensors noted in one step, each under a tag, held weakly.

    A tensor is in the set under a tag when a noted tensor with the same :func:`tensor_key` is still alive: the
    same tensor, or a view of the same memory with the same shape and strides, unwritten since. A tensor that
    merely took a freed one's address is not in it. That matters beyond memory safety: whether an allocator
    hands a freed address to the next tensor differs between processes, so a decision keyed by addresses alone
    (whether a site holds a control round) could differ between CP ranks, which then wait in different places.
    Whether a noted tensor is still alive depends only on the program, which every rank runs alike.
    """

    __slots__ = ("_refs",)

    def __init__(self) -> None:
        self._refs: dict[tuple, list[weakref.ref]] = {}

    def add(self, t: torch.Tensor, tag: object = None) -> None:
        key = tensor_key(t)
        if key is not None:
            self._refs.setdefault((tag, key), []).append(weakref.ref(t))

    def contains(self, t: torch.Tensor, tag: object = None) -> bool:
        key = tensor_key(t)
        return key is not None and any(ref() is not None for ref in self._refs.get((tag, key), ()))


def record_proved_masks(masks: list[torch.Tensor]) -> None:
    """Note, in the active shard context, masks that the graph which built them proved to keep packed documents
    apart before handing them on (no-op outside a shard context). Held weakly (:class:`TensorSet`): a mask freed
    in the step is no longer trusted, so a later tensor at its address is not taken for it."""
    current = _STATE.active
    if current is not None:
        for m in masks:
            current.proved_masks.add(m)


def is_proved_mask(context: Active, mask: torch.Tensor) -> bool:
    """Whether ``mask`` is a mask :func:`record_proved_masks` noted in ``context`` and still alive."""
    return context.proved_masks.contains(mask)


def record_exact(tensors: list[torch.Tensor], context: Active | None = None) -> None:
    """Note per-token tensors whose values at this rank's tokens are the whole-sequence run's in ``context`` (the
    active shard context by default; no-op outside one). Held weakly (:class:`TensorSet`): an in-place write
    afterwards, or a freed tensor's address taken by another, is not trusted. A view that covers its base with
    the same shape and strides (``position_ids.expand(B, -1)`` of a ``[B, T]`` tensor) is recognised as its base."""
    current = context if context is not None else _STATE.active
    if current is not None:
        for t in tensors:
            current.exact.add(t)


def is_exact(context: Active, t: torch.Tensor) -> bool:
    """Whether ``t`` holds what a tensor :func:`record_exact` noted in ``context`` holds: same memory, version,
    shape and strides, the noted tensor still alive."""
    return context.exact.contains(t)


class _State(threading.local):
    """The shard context that is active in this thread; owned by :func:`shard`."""

    def __init__(self) -> None:
        self.active: Active | None = None
        self.last_comm: CommStats | None = None


_STATE = _State()


def current_plan() -> CPPlan | None:
    """The plan of the innermost active :func:`shard` context of this thread, or ``None``."""
    current = _STATE.active
    return None if current is None else current.plan


def current_context() -> Active | None:
    """The innermost active :func:`shard` context of this thread, or ``None``."""
    return _STATE.active


def ensure_inactive() -> None:
    """``RuntimeError`` when a :func:`cpcompile.shard` context is already active in this thread."""
    if _STATE.active is not None:
        raise RuntimeError(
            "cpcompile.shard contexts cannot be nested: a shard context is already active in this thread; "
            "finish the current step's `with cpcompile.shard(...)` block before starting another"
        )


@contextlib.contextmanager
def activated(context: Active) -> Iterator[Active]:
    """Make ``context`` the active one of this thread for the ``with`` block; its counts stay readable after.

    With a group of more than one rank it also switches the known mixer cores to their CP form for the block
    (:mod:`cpcompile.cores`: head-parallel, or state passing for the gated delta rule, the SSD and the RG-LRU with
    ``recurrence="state"``, for the plan's largest number of runs per rank)."""
    cores.register_known_cores()
    group = context.group
    heads = (
        (_compat.group_name_of(group), group.size(), group.rank()) if group is not None and group.size() > 1 else None
    )
    runs = None
    if heads is not None and context.recurrence == "state":
        runs = int(count_runs(context.plan.indices).max())
    _STATE.active = context
    cores.set_heads_group(heads)
    cores.set_state_runs(runs)
    try:
        yield context
    finally:
        cores.set_heads_group(None)
        cores.set_state_runs(None)
        _STATE.active = None
        _STATE.last_comm = context.comm


def real_tokens() -> torch.Tensor:
    """Bool ``[B, c]`` of the active :func:`shard` context: True for this rank's tokens of the batch, False for
    the padding that makes ``T`` a multiple of the CP size. Multiply a hand-written per-token loss by it (or
    index with it) so that padding never contributes, whatever the padded keys hold."""
    return active_context("cpcompile.real_tokens").plan.real_tokens()


def active_context(what: str) -> Active:
    """The active :func:`shard` context of this thread; ``RuntimeError`` naming ``what`` needed it otherwise."""
    current = _STATE.active
    if current is None:
        raise RuntimeError(
            f"{what} needs an active CP plan, but no cpcompile.shard context is active; call the model as "
            "`with cpcompile.shard(batch, cp_group) as local: model(**local)`"
        )
    return current


def gather(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Gather this rank's per-token tensor into the whole sequence, in original token order, without padding.

    ``t`` has this rank's tokens along ``dim`` (e.g. logits ``[B, c, V]``); the result has the global length
    ``T`` there, whatever the plan's layout. Autograd-aware: the backward returns the incoming gradient of this
    rank's tokens, which is
    right when every rank computes the same function of the gathered tensor. Call inside the
    :func:`shard` context of the batch.
    """
    current = active_context("cpcompile.gather")
    plan = current.plan
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"cpcompile.gather expects a tensor, got {type(t).__name__}")
    dim = dim % t.dim()
    if t.shape[dim] != plan.chunk_len:
        raise ValueError(
            f"cpcompile.gather: tensor has {t.shape[dim]} elements along dim {dim}, expected this rank's chunk "
            f"length {plan.chunk_len} (global length {plan.seq_len}, CP size {plan.cp_size}); pass the per-token "
            "output of the model called with this shard context's `local` batch and the right `dim`"
        )
    full = t if plan.cp_size == 1 else gather_sequence(t, dim, current.group, plan.cp_rank, plan.cp_size)
    return plan.restore_order(full, dim)


def comm_stats() -> CommStats:
    """Collective counts and bytes of the active :func:`shard` context, or of the last one that ended."""
    active = _STATE.active
    if active is not None:
        return active.comm
    if _STATE.last_comm is None:
        raise RuntimeError("cpcompile.comm_stats(): no cpcompile.shard context has run in this thread yet")
    return _STATE.last_comm


def record_graph_run(group_name: str, backend_name: str, frame: str, mixes: bool) -> None:
    """Note that a graph compiled for ``group_name`` by the backend ``backend_name`` ran in the active step, and
    whether it mixes tokens across ranks (called by the backend; read by :func:`check_token_mixing`)."""
    current = _STATE.active
    if current is None or current.plan.group_name != group_name:
        return
    if mixes:
        current.ran.mixed.add(backend_name)
    else:
        frames = current.ran.unmixed.setdefault(backend_name, [])
        if frame not in frames:
            frames.append(frame)


def meet_before_backward(outputs: object, group_name: str) -> None:
    """Hold one control round when the backward of the step reaches a compiled graph with CP collectives.

    Called by the backend with the outputs of every run of such a graph: a hook on the outputs that require grad
    runs before the graph's backward, hence before its collectives (the reduce-scatter of the gathered K/V, the
    backward of a sequence gather), and the first one to fire in the step holds the round. A rank that skipped
    ``backward()`` and started the next step comes to that step's batch round in this turn instead: every rank
    raises :class:`~cpcompile.RanksDivergedError` at once, naming where each one is, instead of one waiting in
    backward's collective and the other in the next step until the peer timeout. One round per step.
    """
    current = _STATE.active
    if current is None or current.group is None or current.plan.group_name != group_name:
        return
    if not torch.is_grad_enabled() or current.ran.backward_met:
        return
    seq = outputs if isinstance(outputs, (list, tuple)) else (outputs,)
    tensors = [t for t in seq if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        return

    def meet(_grad: torch.Tensor) -> None:
        if current.ran.backward_met:
            return
        current.ran.backward_met = True
        failsafe.agree(current.group, "backward", None, what="the backward of the CP step", stats=current.comm)

    torch.autograd.graph.register_multi_grad_hook(tensors, meet, mode="any")


def check_token_mixing(context: Active, group_name: str) -> None:
    """Raise when a backend's graphs ran in this step and none of them mixed tokens across ranks.

    Such a model either has no token mixing (declared with ``cpcompile.backend(..., token_mixing="none")``, whose
    graphs are not noted) or ran its attention outside the compiled graphs: in a ``@torch.compiler.disable``
    function, or cut off by a graph break, where it attended over this rank's tokens only. Every rank runs the
    same graphs, so every rank raises the same :class:`~cpcompile.UnsupportedAttentionError` as the step ends.
    """
    ran = context.ran
    unmixed = {name: frames for name, frames in ran.unmixed.items() if name not in ran.mixed}
    if not unmixed:
        return
    name, frames = next(iter(unmixed.items()))
    raise UnsupportedAttentionError(
        f"cpcompile.shard: the model compiled by cpcompile {name} for CP group {group_name!r} ran "
        f"{len(frames)} graph(s) in this step ({'; '.join(frames)}) and none of them held attention or another op "
        "that mixes tokens across the CP ranks. If the model has attention, it ran outside the compiled graphs "
        "(inside a @torch.compiler.disable function, or cut off by a graph break: TORCH_LOGS=graph_breaks shows "
        "where) and attended over this rank's tokens only, which is wrong under context parallelism: let Dynamo "
        "trace the attention (remove the disable, fix the graph break). A model without attention or any other "
        'token mixing is exact: declare it with cpcompile.backend(cp_group, token_mixing="none")'
    )
