"""Fail-together state: the options (:class:`FailsafeOptions`, :func:`configure`) and what this process knows about
each CP group (:class:`GroupState`: its store, step, control-round sequence, failure rounds), plus the small
helpers both protocols share (:func:`mark_agreed`, :func:`clip`, :class:`Backoff`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import time
import warnings
import weakref
from collections.abc import Sequence

import torch.distributed as dist

from cpcompile import _compat
from cpcompile.errors import RankFailedError
from cpcompile.runtime import gloo

__all__ = [
    "DEFAULT_REPORT_GRACE_S",
    "LIVENESS_EVERY_S",
    "PEER_TIMEOUT_ENV",
    "REPORT_GRACE_ENV",
    "Backoff",
    "FailsafeOptions",
    "GroupState",
    "clip",
    "configure",
    "current_step",
    "group_state",
    "is_marked",
    "mark_agreed",
    "ranks_text",
    "set_fingerprint",
]

#: Environment variable: default of :attr:`FailsafeOptions.peer_timeout_s` (seconds).
PEER_TIMEOUT_ENV = "CPCOMPILE_PEER_TIMEOUT"
#: Environment variable: default of :attr:`FailsafeOptions.report_grace_s` (seconds).
REPORT_GRACE_ENV = "CPCOMPILE_REPORT_GRACE"
DEFAULT_REPORT_GRACE_S = 5.0
#: Longest pause between two looks at the store while waiting for peers.
_POLL_MAX_S = 0.02
#: Pause between two checks of whether the peers' processes are alive while waiting.
LIVENESS_EVERY_S = 0.5
#: Longest error message kept in a report.
_MESSAGE_CHARS = 2000


def _env_seconds(name: str) -> float | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${name}={raw!r} is not a number of seconds; set it to e.g. 60, or unset it") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"${name}={raw!r} must be a positive number of seconds; set it to e.g. 60, or unset it")
    return value


def _default_grace() -> float:
    grace = _env_seconds(REPORT_GRACE_ENV)
    return DEFAULT_REPORT_GRACE_S if grace is None else grace


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class FailsafeOptions:
    """How long the ranks of a CP group wait for each other; see :func:`configure`."""

    #: Seconds a rank waits for its peers, in a collective of the CP group (set on the group with
    #: ``ProcessGroup.set_timeout``) and in a control round. ``None``: the group keeps its own timeout
    #: (``new_group(timeout=)``; default 30 min for gloo, 10 min for NCCL), which the control rounds use too.
    #: Must exceed the longest legitimate wait: the first step's compile-time difference between ranks, and
    #: whatever a rank does between two steps while its peers already wait in the next one.
    #: Default: ``$CPCOMPILE_PEER_TIMEOUT``, else ``None``.
    peer_timeout_s: float | None = dataclasses.field(default_factory=lambda: _env_seconds(PEER_TIMEOUT_ENV))
    #: Seconds a failing rank waits for every peer to report the same failure (then the group stays usable),
    #: and a rank released from a collective waits for the reports of the others before naming the ranks
    #: that did not report. Default: ``$CPCOMPILE_REPORT_GRACE``, else 5.
    report_grace_s: float = dataclasses.field(default_factory=_default_grace)

    def __post_init__(self) -> None:
        for name in ("peer_timeout_s", "report_grace_s"):
            value = getattr(self, name)
            if value is None and name == "peer_timeout_s":
                continue
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or value <= 0:
                raise ValueError(f"FailsafeOptions.{name}={value!r} must be a positive number of seconds")


# -- per-group state ---------------------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class GroupState:
    """What this process knows about one CP group's failures and control rounds."""

    ref: weakref.ReferenceType
    name: str
    rank: int
    size: int
    #: The control store, ``None`` where nothing is exchanged (one rank, or the fake backend).
    store: dist.Store | None
    options: FailsafeOptions
    #: ``shard`` contexts entered on this group (for messages).
    step: int = 0
    #: Failure rounds resolved so far; every rank resolves the same rounds while the group is usable.
    epoch: int = 0
    #: The error of the failure that made the group unusable.
    broken: RankFailedError | None = None
    #: A failure round this rank posted to whose verdict is still open (its peers had not all reported).
    open: int | None = None
    said_hello: bool = False
    #: Next control round of the group: one sequence for every kind of round (a rank that arrives at another
    #: kind of round than its peers is seen in that round), and this rank's key of its last round (deleted later).
    seq: int = 0
    last_key: str | None = None
    #: Fingerprint of the batch of the current step (``""``: not computed, ``shard(check_batch=False)``),
    #: carried by every control round of the step.
    fingerprint: str = ""
    #: The group's own collective timeout, read once (through a private torch accessor) when first needed.
    group_timeout_s: float | None = None

    @property
    def peer_timeout_s(self) -> float:
        if self.options.peer_timeout_s is not None:
            return self.options.peer_timeout_s
        if self.group_timeout_s is None:
            group = self.ref()
            self.group_timeout_s = (
                _compat.group_timeout_s(group) if group is not None else dist.default_pg_timeout.total_seconds()
            )
        return self.group_timeout_s


#: Backends already warned about by :func:`group_state` (untested with fail-together).
_WARNED: set[str] = set()
#: Fail-together state of every CP group this process used, by group name; written only by :func:`group_state`
#: and :func:`configure`. A group whose name is reused by a new group gets fresh state.
_GROUPS: dict[str, GroupState] = {}


def group_state(group: dist.ProcessGroup | str) -> GroupState:
    """This process's state of CP group ``group`` (a group or its name), created on its first use."""
    pg = _compat.resolve_group(group) if isinstance(group, str) else group
    if pg is None:
        raise RuntimeError(f"the CP process group {group!r} is not registered in this process")
    name = _compat.group_name_of(pg)
    state = _GROUPS.get(name)
    if state is None or state.ref() is not pg:
        size = dist.get_world_size(pg)
        backend = dist.get_backend(pg)
        enabled = size > 1 and backend != "fake"
        gloo.warn_if_threaded(pg)
        if enabled and backend not in gloo.GLOO_BACKENDS and backend not in _WARNED:
            _WARNED.add(backend)
            warnings.warn(
                f"cpcompile's fail-together protocol has been run on gloo only, not on {backend}: its control "
                "rounds go through the group's store whatever the backend, but how this backend ends a timed-out "
                "collective (NCCL's watchdog may end the process) has not been measured",
                stacklevel=3,
            )
        store = dist.PrefixStore("cpcompile/", pg.get_group_store()) if enabled else None
        state = GroupState(weakref.ref(pg), name, dist.get_rank(pg), size, store, FailsafeOptions())
        _GROUPS[name] = state
        _apply_timeout(state, pg)
    return state


def _apply_timeout(state: GroupState, pg: dist.ProcessGroup) -> None:
    if state.store is not None and state.options.peer_timeout_s is not None:
        pg.set_timeout(datetime.timedelta(seconds=state.options.peer_timeout_s))


def configure(group: dist.ProcessGroup, options: FailsafeOptions | None = None) -> None:
    """Set how long the ranks of CP group ``group`` wait for each other (every rank should pass the same).

    With ``options.peer_timeout_s`` the group's collective timeout is set to it (``ProcessGroup.set_timeout``,
    for the collectives issued from now on): a rank blocked in a collective by a peer that failed but stays
    alive raises :class:`RankFailedError` after that long. ``None`` options: the defaults (environment).
    """
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup (the CP group), got {type(group).__name__}")
    if options is not None and not isinstance(options, FailsafeOptions):
        raise TypeError(f"options must be a cpcompile.failsafe.FailsafeOptions or None, got {type(options).__name__}")
    state = group_state(group)
    state.options = FailsafeOptions() if options is None else options
    _apply_timeout(state, group)


def current_step(group: dist.ProcessGroup) -> int:
    """The number of the current ``shard`` step on ``group`` (counted from 1; 0 before the first)."""
    return group_state(group).step


def set_fingerprint(group: dist.ProcessGroup, fingerprint: str) -> None:
    """Set the batch fingerprint that this step's control rounds carry (``shard`` calls this every step)."""
    group_state(group).fingerprint = fingerprint


def clip(text: str, limit: int = _MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def mark_agreed(exc: BaseException) -> BaseException:
    """Mark ``exc`` as decided by the whole group (every rank raises it), so that no failure round reports it.

    For errors computed from data every rank holds after an :func:`agree` round. Returns ``exc``.
    """
    with contextlib.suppress(AttributeError, TypeError):
        exc.__cpcompile_resolved__ = True
    return exc


def is_marked(exc: BaseException) -> bool:
    return bool(getattr(exc, "__cpcompile_resolved__", False))


class Backoff:
    """Pauses growing from 0.5 ms to :data:`_POLL_MAX_S` between looks at the store."""

    def __init__(self) -> None:
        self.pause = 0.0005

    def sleep(self) -> None:
        time.sleep(self.pause)
        self.pause = min(self.pause * 2, _POLL_MAX_S)


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks [0, 2]``."""
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
