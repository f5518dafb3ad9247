"""Fail together: when one rank of a CP group fails, every rank of the group raises, within a bounded time.

A CP step is a chain of collectives over the CP group (the K/V all-gathers of every attention layer, their
reduce-scatters in backward). A rank that raises while its peers go on leaves them waiting in their next
collective. This module keeps the ranks of a CP group failing together through a control channel kept apart
from the data collectives: the group's own store (``ProcessGroup.get_group_store()``, keys under
``cpcompile/``). A control message is never a collective of the group, so it can never be matched against a
K/V all-gather.

Main API (``group``: the CP process group):

* :func:`agree`: a check whose verdict can differ between ranks is decided together. Every rank posts its
  verdict and waits for the others'; if any rank failed, every rank raises the same error naming the ranks
  that failed and their reasons. Used by the first-call mask check of every attention site (once per site)
  and by ``shard(check_batch=True)`` (once per step, batch validation included). One control round each.
* :func:`on_failure` / :func:`scope` / :func:`fail_together`: any other error in cpcompile's scope (the batch
  validation of ``shard``, the ``with shard(...)`` block, the attention ops called outside ``shard``,
  ``sync_grads``) is posted to the store, and the failing rank waits up to ``report_grace_s`` for its peers:

  - every rank reports the same error at the same line in the same step (a deterministic error such as bad
    input): each rank re-raises its own error and the group stays usable;
  - a peer reports something else (it was released from a collective, or was waiting in a control round) or
    its process is gone: every rank raises :class:`RankFailedError` naming the ranks that failed with their
    errors, the ranks that died and the ranks that did not report; the group is marked failed;
  - otherwise (a peer is still busy, e.g. compiling, or blocked in a collective): the failing rank re-raises
    its own error with a note, and its next use of the group settles the round, waiting up to the peer
    timeout, and raises :class:`RankFailedError` unless the peers reported the same error.

  Nothing is exchanged while nothing fails.
* :func:`enter_step`: called by ``shard``; a group that failed raises again at once instead of issuing
  collectives that could be matched against its peers' stale ones.

Releasing a rank blocked in a collective (measured on torch 2.13, gloo, CPU: ``benchmarks/gloo_release.py``):
``ProcessGroup.abort()``, ``shutdown()`` and the gloo backend's ``abort()`` release it neither when the
blocked rank calls them (from another thread) nor when its peer does. Only the peer's process exiting
("Connection closed by peer", 1 s after a ``SIGKILL``) or the collective's own timeout does. Hence:

* a rank whose process dies (killed, out of memory, or exiting after its error) releases its peers at once;
  they raise :class:`RankFailedError` saying it died (its process is checked when it ran on the same host in
  the same PID namespace; otherwise it is named as a rank that did not report within ``report_grace_s``);
* a rank that fails and stays alive (a notebook, a supervisor that catches the error) releases its peers
  only through their collective timeout, the CP group's timeout. ``peer_timeout_s`` (environment variable
  ``CPCOMPILE_PEER_TIMEOUT``) sets it on the CP group (``ProcessGroup.set_timeout``) and bounds the control
  rounds too; without it the group keeps its own (``new_group``'s default: 30 min for gloo, 10 min for NCCL).

What cannot be detected cheaply: a peer that is alive and simply never calls (stuck in its own code, or
failed outside cpcompile's scope). Its peers wait in their next collective until the CP group's timeout, then
raise :class:`RankFailedError` naming it as a rank that did not report. Wrap a step's own code (data loading,
the optimizer step) in :func:`fail_together` so that its errors reach the peers too. The same holds for a
peer on another host whose machine dies without closing its connections.

Not run on NCCL yet: the control channel is backend-independent, but how NCCL's watchdog treats a collective
timeout (it may end the process) has not been measured here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import socket
import time
import warnings
import weakref
from collections.abc import Iterator, Sequence

import torch.distributed as dist

from cpcompile import _compat
from cpcompile.errors import RankFailedError, RankFailedTypeError, RankFailedValueError

__all__ = [
    "PEER_TIMEOUT_ENV",
    "REPORT_GRACE_ENV",
    "FailsafeOptions",
    "agree",
    "configure",
    "enter_step",
    "fail_together",
    "mark_agreed",
    "on_failure",
    "scope",
]

#: Environment variable: default of :attr:`FailsafeOptions.peer_timeout_s` (seconds).
PEER_TIMEOUT_ENV = "CPCOMPILE_PEER_TIMEOUT"
#: Environment variable: default of :attr:`FailsafeOptions.report_grace_s` (seconds).
REPORT_GRACE_ENV = "CPCOMPILE_REPORT_GRACE"
DEFAULT_REPORT_GRACE_S = 5.0
#: Longest pause between two looks at the store while waiting for peers.
_POLL_MAX_S = 0.02
#: Pause between two checks of whether the peers' processes are alive while waiting.
_LIVENESS_EVERY_S = 0.5
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


_BY_CAUSE = {"ValueError": RankFailedValueError, "TypeError": RankFailedTypeError}


# -- per-group state ---------------------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class _Group:
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
    #: Next round number of each agreement series, and this rank's key of its last round (deleted later).
    rounds: dict[str, int] = dataclasses.field(default_factory=dict)
    last_key: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def peer_timeout_s(self) -> float:
        if self.options.peer_timeout_s is not None:
            return self.options.peer_timeout_s
        group = self.ref()
        return _compat.group_timeout_s(group) if group is not None else dist.default_pg_timeout.total_seconds()


#: Backends already warned about by :func:`_group` (untested with fail-together).
_WARNED: set[str] = set()
#: Fail-together state of every CP group this process used, by group name; written only by :func:`_group`
#: and :func:`configure`. A group whose name is reused by a new group gets fresh state.
_GROUPS: dict[str, _Group] = {}


def _group(group: dist.ProcessGroup | str) -> _Group:
    pg = _compat.resolve_group(group) if isinstance(group, str) else group
    if pg is None:
        raise RuntimeError(f"the CP process group {group!r} is not registered in this process")
    name = _compat.group_name_of(pg)
    state = _GROUPS.get(name)
    if state is None or state.ref() is not pg:
        size = dist.get_world_size(pg)
        backend = dist.get_backend(pg)
        enabled = size > 1 and backend != "fake"
        if enabled and backend != "gloo" and backend not in _WARNED:
            _WARNED.add(backend)
            warnings.warn(
                f"cpcompile's fail-together protocol has been run on gloo only, not on {backend}: its control "
                "rounds go through the group's store whatever the backend, but how this backend ends a timed-out "
                "collective (NCCL's watchdog may end the process) has not been measured",
                stacklevel=3,
            )
        store = dist.PrefixStore("cpcompile/", pg.get_group_store()) if enabled else None
        state = _Group(weakref.ref(pg), name, dist.get_rank(pg), size, store, FailsafeOptions())
        _GROUPS[name] = state
        _apply_timeout(state, pg)
    return state


def _apply_timeout(state: _Group, pg: dist.ProcessGroup) -> None:
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
        raise TypeError(f"options must be a cpcompile.FailsafeOptions or None, got {type(options).__name__}")
    state = _group(group)
    state.options = FailsafeOptions() if options is None else options
    _apply_timeout(state, group)


# -- store helpers -----------------------------------------------------------------------------------------
def _put(state: _Group, key: str, value: object) -> int:
    data = json.dumps(value).encode()
    state.store.set(key, data)
    return len(data)


def _has(state: _Group, key: str) -> bool:
    return state.store.check([key])


def _load(state: _Group, key: str) -> dict:
    return json.loads(state.store.get(key))


@contextlib.contextmanager
def _store_errors(state: _Group, cause: BaseException | None) -> Iterator[None]:
    """Store failures (the process hosting the store died) become a :class:`RankFailedError`."""
    try:
        yield
    except (RuntimeError, OSError) as e:
        if isinstance(e, RankFailedError):
            raise
        err = RankFailedError(
            f"the control store of CP group {state.name!r} failed ({type(e).__name__}: {_clip(str(e), 300)}): "
            "the process hosting the job's store (the launcher, or global rank 0) has probably died; "
            "restart the job",
            step=state.step,
        )
        state.broken = err
        mark_agreed(err)
        raise err from (cause or e)


def _clip(text: str, limit: int = _MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def mark_agreed(exc: BaseException) -> BaseException:
    """Mark ``exc`` as decided by the whole group (every rank raises it), so that no failure round reports it.

    For errors computed from data every rank holds after an :func:`agree` round. Returns ``exc``.
    """
    with contextlib.suppress(AttributeError, TypeError):
        exc.__cpcompile_resolved__ = True
    return exc


def _is_marked(exc: BaseException) -> bool:
    return bool(getattr(exc, "__cpcompile_resolved__", False))


class _Backoff:
    """Pauses growing from 0.5 ms to :data:`_POLL_MAX_S` between looks at the store."""

    def __init__(self) -> None:
        self.pause = 0.0005

    def sleep(self) -> None:
        time.sleep(self.pause)
        self.pause = min(self.pause * 2, _POLL_MAX_S)


# -- liveness of peers on this host ------------------------------------------------------------------------
def _identity() -> dict:
    """This process as its peers can check it: host, PID namespace, pid and start time (Linux)."""
    ident: dict = {"host": socket.gethostname(), "pid": os.getpid(), "pidns": None, "start": None}
    with contextlib.suppress(OSError):
        ident["pidns"] = os.stat("/proc/self/ns/pid").st_ino
    ident["start"] = _start_time(os.getpid())
    return ident


def _start_time(pid: int) -> str | None:
    stat = _proc_stat(pid)
    return None if stat is None else stat[19]


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name (state first), or ``None`` if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _say_hello(state: _Group, stats=None) -> None:
    if state.said_hello:
        return
    with _store_errors(state, None):
        nbytes = _put(state, f"hello/{state.rank}", _identity())
    state.said_hello = True
    if stats is not None:
        stats.record_control(nbytes, rounds=0)


def _dead_peers(state: _Group, ranks: Sequence[int]) -> dict[int, str]:
    """Which of ``ranks`` are known dead: their process ran on this host (same PID namespace) and is gone."""
    me = _identity()
    dead = {}
    for r in ranks:
        key = f"hello/{r}"
        if not _has(state, key):
            continue
        peer = _load(state, key)
        if peer["host"] != me["host"] or peer["pidns"] is None or peer["pidns"] != me["pidns"]:
            continue
        stat = _proc_stat(peer["pid"])
        if stat is None or stat[0] in ("Z", "X") or stat[19] != peer["start"]:
            dead[r] = f"its process {peer['pid']} on host {peer['host']} is gone"
    return dead


# -- agreement ---------------------------------------------------------------------------------------------
def agree(
    group: dist.ProcessGroup,
    series: str,
    error: BaseException | None,
    *,
    what: str,
    payload: object = None,
    kinds: Sequence[type[BaseException]] = (),
    stats=None,
) -> list:
    """Decide a check together: post this rank's verdict, wait for every rank's, raise the same error everywhere.

    ``error`` is this rank's verdict (``None``: passed); ``series`` names the kind of check (rounds of one
    series are numbered, so every rank must run the checks of a series in the same order); ``what`` says what
    was checked, for the message; ``payload`` (JSON-serialisable) is handed to every rank. When any rank
    failed, every rank raises an error of the first failing rank's type (one of ``kinds``, ``ValueError``,
    ``TypeError``, else ``RuntimeError``) naming the failing ranks and their messages. When a peer fails
    elsewhere, dies or does not post within the peer timeout, :class:`RankFailedError` instead.

    Returns every rank's ``payload``, by rank. ``stats`` (a ``CommStats``) counts the round and its bytes.
    Without peers (one rank, the fake backend) it raises ``error`` itself or returns ``[payload]``.
    """
    state = _usable(group)
    if state.store is None:
        if error is not None:
            raise error
        return [payload]
    _say_hello(state, stats)
    seq = state.rounds.get(series, 0)
    base = f"agree/{series}/{seq}"
    keys = [f"{base}/{r}" for r in range(state.size)]
    verdict = None if error is None else {"type": type(error).__name__, "message": _clip(str(error))}
    with _store_errors(state, error):
        nbytes = _put(state, keys[state.rank], {"error": verdict, "payload": payload})
        _wait_for_posts(state, keys, what, error)
        raw = state.store.multi_get(keys)
        previous = state.last_key.get(series)
        if previous is not None:  # every rank has read the previous round: it posted this one after reading it
            state.store.delete_key(previous)
    state.rounds[series] = seq + 1
    state.last_key[series] = keys[state.rank]
    if stats is not None:
        stats.record_control(nbytes + sum(len(v) for v in raw))
    posts = [json.loads(v) for v in raw]
    failed = {r: p["error"] for r, p in enumerate(posts) if p["error"] is not None}
    if failed:
        exc = _agreed_error(state, what, failed, kinds)
        mark_agreed(exc)
        raise exc from error
    return [p["payload"] for p in posts]


def _agreed_error(state: _Group, what: str, failed: dict[int, dict], kinds) -> BaseException:
    by_name = {k.__name__: k for k in (*kinds, ValueError, TypeError, RuntimeError)}
    cls = by_name.get(failed[min(failed)]["type"], RuntimeError)
    groups: dict[tuple[str, str], list[int]] = {}
    for r, v in sorted(failed.items()):
        groups.setdefault((v["type"], v["message"]), []).append(r)
    lines = [
        f"  {_ranks(ranks)}: {kind}: {message}" if kind != cls.__name__ else f"  {_ranks(ranks)}: {message}"
        for (kind, message), ranks in groups.items()
    ]
    return cls(
        f"{what} failed on CP {_ranks(sorted(failed))} of {state.size} (group {state.name!r}); every rank of the "
        "group raises this error:\n" + "\n".join(lines)
    )


def _ranks(ranks: Sequence[int]) -> str:
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _wait_for_posts(state: _Group, keys: list[str], what: str, cause: BaseException | None) -> None:
    """Wait until every key exists; a peer that fails instead, dies or times out raises RankFailedError."""
    timeout = state.peer_timeout_s
    start = time.monotonic()
    next_liveness = start + _LIVENESS_EVERY_S
    backoff = _Backoff()
    while not state.store.check(keys):
        now = time.monotonic()
        missing = None
        if _has(state, f"fail/{state.epoch}/any"):
            reason = f"it was waiting for its peers in {what}"
        elif now - start >= timeout:
            missing = [r for r, k in enumerate(keys) if not _has(state, k)]
            reason = f"it timed out after {timeout:g} s waiting for CP {_ranks(missing)} in {what}"
        elif now >= next_liveness:
            next_liveness = now + _LIVENESS_EVERY_S
            missing = [r for r, k in enumerate(keys) if not _has(state, k)]
            dead = _dead_peers(state, missing)
            reason = f"it was waiting for CP {_ranks(sorted(dead))} in {what}" if dead else None
        else:
            reason = None
        if reason is not None:
            # a "wait" record never matches an "error" one, so the round always ends with an error
            err = _resolve(state, _Waiting(reason), "wait", what, cause=cause) or RankFailedError(reason)
            if cause is None:
                raise err
            raise err from cause
        backoff.sleep()


class _Waiting(RuntimeError):
    """This rank's part in a failure round it joined because a peer did not come (never raised to the user)."""


# -- failure rounds ----------------------------------------------------------------------------------------
def enter_step(group: dist.ProcessGroup, stats=None) -> None:
    """Start a ``shard`` step on ``group``: raise at once if the group failed earlier, else count the step.

    A failure round this rank left open (its peers had not reported within ``report_grace_s``) is settled
    first, waiting up to the peer timeout. On the group's first step this rank posts how its peers can check
    that its process is alive (one small store write).
    """
    state = _usable(group)
    state.step += 1
    if state.store is not None:
        _say_hello(state, stats)


def _usable(group: dist.ProcessGroup | str) -> _Group:
    """The group's state; raises RankFailedError if it failed, after settling a round left open."""
    state = _group(group)
    if state.open is not None and state.broken is None:
        epoch, state.open = state.open, None
        with _store_errors(state, None):
            same = _await_verdict(state, epoch, limit_s=state.peer_timeout_s, final=True)
        _close_round(state, epoch, same)
    if state.broken is not None:
        raise _again(state)
    return state


def on_failure(group: dist.ProcessGroup | str, exc: BaseException, *, where: str, in_step: bool = False) -> None:
    """Report ``exc``, raised on this rank ``where``, to the CP group; raise what the group must raise.

    Returns when the caller should re-raise ``exc`` itself: it was already decided together, the group has no
    peers or had already failed, every rank failed at the same point of the same step, or the peers had not
    reported within ``report_grace_s`` (the round stays open: the group's next use settles it, and a note on
    ``exc`` says so). Raises :class:`RankFailedError` (chained from ``exc``) when a peer reported a different
    failure or died. ``KeyboardInterrupt``/``SystemExit`` are posted without waiting. ``in_step``: raised
    inside a ``shard`` step (else after the last one), for the message.
    """
    if _is_marked(exc) or isinstance(exc, GeneratorExit):
        return
    state = _group(group)
    if state.store is None or state.broken is not None:
        return
    if state.open is not None:
        _usable(group)  # settle the earlier round first; raises if it left the group failed
    kind = "comm" if _compat.is_comm_error(exc) else "error"
    wait = not isinstance(exc, (KeyboardInterrupt, SystemExit))
    err = _resolve(state, exc, kind, where, wait=wait, in_step=in_step)
    if err is not None:
        raise err from exc


@contextlib.contextmanager
def scope(group: dist.ProcessGroup, where: str, *, in_step: bool = False) -> Iterator[None]:
    """Run a block whose errors are reported to CP group ``group`` (see :func:`on_failure`).

    Raises :class:`RankFailedError` at once if the group failed earlier.
    """
    _usable(group)
    try:
        yield
    except BaseException as e:
        on_failure(group, e, where=where, in_step=in_step)
        raise


def fail_together(cp_group: dist.ProcessGroup) -> contextlib.AbstractContextManager[None]:
    """``with cpcompile.fail_together(cp_group): ...``: an error raised in the block reaches every CP rank.

    For a step's own code outside ``cpcompile.shard`` (data loading, the optimizer step): the error is posted
    to the group's store, and peers blocked in a collective raise :class:`RankFailedError` with it when they
    are released (when this process exits, or after the group's collective timeout, ``peer_timeout_s``).
    An error that every rank raises at the same point leaves the group usable. Costs nothing without errors.
    """
    return scope(cp_group, "a cpcompile.fail_together block")


def _point(exc: BaseException) -> str:
    """Where and how ``exc`` was raised: type, message and innermost frame (equal on ranks failing alike)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    frame = "?" if tb is None else f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
    return f"{type(exc).__qualname__}|{_clip(str(exc))}|{frame}"


def _resolve(
    state: _Group, exc: BaseException, kind: str, where: str, *, cause=None, wait: bool = True, in_step: bool = True
) -> RankFailedError | None:
    """Post this rank's failure in the current round and wait up to ``report_grace_s`` for the verdict.

    ``kind``: ``"error"`` (this rank's own error), ``"comm"`` (a collective failed under it), ``"wait"`` (a
    peer did not come to a control round). Returns ``None`` when every rank failed alike (the group stays
    usable) or, for an ``"error"``, when the peers had not all reported in time (the round stays open);
    else the :class:`RankFailedError` to raise (the group is marked failed).
    """
    epoch = state.epoch
    record = {
        "step": state.step,
        "in_step": in_step,
        "kind": kind,
        "where": where,
        "type": type(exc).__name__,
        "message": _clip(str(exc)),
        "point": _point(exc),
    }
    with _store_errors(state, cause if cause is not None else exc):
        _put(state, f"fail/{epoch}/{state.rank}", record)
        state.store.set(f"fail/{epoch}/any", b"1")
        limit = state.options.report_grace_s if wait else 0.0
        same = _await_verdict(state, epoch, limit_s=limit, final=kind != "error")
    if same is None:
        state.open = epoch
        _note_open(state, exc, epoch)
        return None
    return _close_round(state, epoch, same)


def _close_round(state: _Group, epoch: int, same: bool) -> RankFailedError | None:
    state.epoch = epoch + 1
    if same:
        return None
    with _store_errors(state, None):
        records, dead, silent = _reports(state, epoch)
    state.broken = _failure_error(state, records, dead, silent)
    mark_agreed(state.broken)
    return state.broken


def _note_open(state: _Group, exc: BaseException, epoch: int) -> None:
    with _store_errors(state, exc):
        missing = [r for r in range(state.size) if not _has(state, f"fail/{epoch}/{r}")]
    note = (
        f"cpcompile: this error was reported to CP group {state.name!r} (this is rank {state.rank} of "
        f"{state.size}); CP {_ranks(missing)} had not reported the same error within "
        f"{state.options.report_grace_s:g} s. The group's next use settles it and raises RankFailedError if they "
        "failed differently. Peers blocked in a collective are released when this process exits, or after "
        f"the group's collective timeout ({state.peer_timeout_s:g} s; ${PEER_TIMEOUT_ENV})"
    )
    if hasattr(exc, "add_note"):
        exc.add_note(note)


def _await_verdict(state: _Group, epoch: int, *, limit_s: float, final: bool) -> bool | None:
    """Whether every rank failed alike in round ``epoch``; the first rank to decide writes it for all.

    Decides as soon as every rank reported, a report differs from another, or a rank that did not report is
    dead. After ``limit_s`` without that: decides "not alike" when ``final``, else returns ``None``.
    """
    key = f"verdict/{epoch}"
    start = time.monotonic()
    next_liveness = start
    backoff = _Backoff()
    while True:
        if _has(state, key):
            return _load(state, key)["same"]
        posted = {r: _load(state, f"fail/{epoch}/{r}") for r in range(state.size) if _has(state, f"fail/{epoch}/{r}")}
        missing = [r for r in range(state.size) if r not in posted]
        alike = all(rec["kind"] == "error" for rec in posted.values())
        alike = alike and len({(rec["point"], rec["step"]) for rec in posted.values()}) <= 1
        decided = not missing or not alike
        now = time.monotonic()
        if not decided and now >= next_liveness:
            next_liveness = now + _LIVENESS_EVERY_S
            decided = bool(_dead_peers(state, missing))
        if not decided and now - start >= limit_s:
            if not final:
                return None
            decided = True
        if decided:
            same = alike and not missing
            stored = state.store.compare_set(key, "", json.dumps({"same": same}))
            return json.loads(stored)["same"]
        backoff.sleep()


def _reports(state: _Group, epoch: int) -> tuple[dict[int, dict], dict[int, str], list[int]]:
    """The records posted in round ``epoch``, the ranks known dead, and the other ranks that did not report."""
    records = {r: _load(state, f"fail/{epoch}/{r}") for r in range(state.size) if _has(state, f"fail/{epoch}/{r}")}
    missing = [r for r in range(state.size) if r not in records]
    dead = _dead_peers(state, missing)
    return records, dead, [r for r in missing if r not in dead]


def _failure_error(state: _Group, records: dict[int, dict], dead: dict[int, str], silent: list[int]) -> RankFailedError:
    failed = {r: rec for r, rec in sorted(records.items()) if rec["kind"] == "error"}
    others = {r: rec for r, rec in sorted(records.items()) if rec["kind"] != "error"}
    group = f"of CP group {state.name!r} (size {state.size})"
    first = failed[min(failed)] if failed else {"step": state.step, "in_step": True}
    step = first["step"]
    when = f"{'in' if first['in_step'] else 'after'} step {step}"
    if failed:
        head = f"CP {_ranks(list(failed))} {group} failed {when}"
    elif dead:
        head = f"CP {_ranks(sorted(dead))} {group} died {when}"
    elif silent:
        head = f"CP {_ranks(silent)} {group} stopped responding {when}"
    else:
        head = f"every rank {group} lost a collective {when}"
    lines = [head + "; every rank of the group raises RankFailedError:"]
    lines += [f"  rank {r} failed in {rec['where']}: {rec['type']}: {rec['message']}" for r, rec in failed.items()]
    lines += [f"  rank {r} died: {why}" for r, why in sorted(dead.items())]
    grace = state.options.report_grace_s
    closed = any(rec["kind"] == "comm" and _compat.is_peer_exit_error(rec["message"]) for rec in others.values())
    if closed:
        why = "a peer's connection closed, so it most likely died (a process on another host)"
    else:
        why = (
            "it died (a process on another host), or it is alive but not calling (blocked in a collective, "
            f"which raises after the group's timeout of {state.peer_timeout_s:g} s, or busy in its own code)"
        )
    lines += [f"  rank {r} did not report within {grace:g} s: {why}" for r in silent]
    for r, rec in others.items():
        if rec["kind"] == "wait":
            lines.append(f"  rank {r} stopped with them: {rec['message']}")
        else:
            why = _clip(rec["message"].splitlines()[0] if rec["message"] else "", 300)
            lines.append(f"  rank {r} stopped with them: a collective failed in {rec['where']} ({rec['type']}: {why})")
    lines.append(
        "The group's collectives are out of step: destroy the CP group and create a new one, or restart the job. "
        f"${PEER_TIMEOUT_ENV} (seconds) bounds how long a rank waits for a peer that failed but stays alive."
    )
    cls = _BY_CAUSE.get(failed[min(failed)]["type"], RankFailedError) if failed else RankFailedError
    return cls(
        "\n".join(lines),
        failed={r: f"{rec['type']}: {rec['message']}" for r, rec in failed.items()},
        dead=sorted(dead),
        silent=silent,
        step=step,
    )


def _again(state: _Group) -> RankFailedError:
    """The error of a group that failed earlier, raised again by a later call."""
    old = state.broken
    err = type(old)(
        f"CP group {state.name!r} failed earlier and cannot be used again; create a new process group. "
        f"It failed with:\n{old}",
        failed=old.failed,
        dead=old.dead,
        silent=old.silent,
        step=old.step,
    )
    mark_agreed(err)
    return err
