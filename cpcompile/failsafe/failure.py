"""The failure protocol: an error in cpcompile's scope is posted to the CP group's store and every rank raises
together (:func:`on_failure`, :func:`scope`, :func:`fail_together`); a group that failed raises again at once
(:func:`enter_step`, :func:`usable`).

Each failure round has a number (the group's epoch): every rank that fails or is released posts one record,
the first to decide writes the verdict (alike: each rank re-raises its own error; not alike: every rank raises
:class:`~cpcompile.errors.RankFailedError` and the group is marked failed).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

import torch.distributed as dist

from cpcompile import _compat
from cpcompile.errors import RankFailedError, RankFailedTypeError, RankFailedValueError
from cpcompile.failsafe.liveness import dead_peers, say_hello
from cpcompile.failsafe.state import (
    LIVENESS_EVERY_S,
    PEER_TIMEOUT_ENV,
    Backoff,
    GroupState,
    clip,
    group_state,
    is_marked,
    mark_agreed,
    ranks_text,
)
from cpcompile.failsafe.store import has_key, load_json, put_json, store_errors

__all__ = ["enter_step", "fail_together", "on_failure", "resolve", "scope", "usable"]

_BY_CAUSE = {"ValueError": RankFailedValueError, "TypeError": RankFailedTypeError}


# -- failure rounds ----------------------------------------------------------------------------------------
def enter_step(group: dist.ProcessGroup, stats=None) -> None:
    """Start a ``shard`` step on ``group``: raise at once if the group failed earlier, else count the step.

    A failure round this rank left open (its peers had not reported within ``report_grace_s``) is settled
    first, waiting up to the peer timeout. On the group's first step this rank posts how its peers can check
    that its process is alive (one small store write).
    """
    state = usable(group)
    state.step += 1
    if state.store is not None:
        say_hello(state, stats)


def usable(group: dist.ProcessGroup | str) -> GroupState:
    """The group's state; raises RankFailedError if it failed, after settling a round left open."""
    state = group_state(group)
    if state.open is not None and state.broken is None:
        epoch, state.open = state.open, None
        with store_errors(state, None):
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
    if is_marked(exc) or isinstance(exc, GeneratorExit):
        return
    state = group_state(group)
    if state.store is None or state.broken is not None:
        return
    if state.open is not None:
        usable(group)  # settle the earlier round first; raises if it left the group failed
    kind = "comm" if _compat.is_comm_error(exc) else "error"
    wait = not isinstance(exc, (KeyboardInterrupt, SystemExit))
    err = resolve(state, exc, kind, where, wait=wait, in_step=in_step)
    if err is not None:
        raise err from exc


@contextlib.contextmanager
def scope(group: dist.ProcessGroup, where: str, *, in_step: bool = False) -> Iterator[None]:
    """Run a block whose errors are reported to CP group ``group`` (see :func:`on_failure`).

    Raises :class:`RankFailedError` at once if the group failed earlier.
    """
    usable(group)
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
    return f"{type(exc).__qualname__}|{clip(str(exc))}|{frame}"


def resolve(
    state: GroupState, exc: BaseException, kind: str, where: str, *, cause=None, wait: bool = True, in_step: bool = True
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
        "message": clip(str(exc)),
        "point": _point(exc),
    }
    with store_errors(state, cause if cause is not None else exc):
        put_json(state, f"fail/{epoch}/{state.rank}", record)
        state.store.set(f"fail/{epoch}/any", b"1")
        limit = state.options.report_grace_s if wait else 0.0
        same = _await_verdict(state, epoch, limit_s=limit, final=kind != "error")
    if same is None:
        state.open = epoch
        _note_open(state, exc, epoch)
        return None
    return _close_round(state, epoch, same)


def _close_round(state: GroupState, epoch: int, same: bool) -> RankFailedError | None:
    state.epoch = epoch + 1
    if same:
        return None
    with store_errors(state, None):
        records, dead, silent = _reports(state, epoch)
    state.broken = _failure_error(state, records, dead, silent)
    mark_agreed(state.broken)
    return state.broken


def _note_open(state: GroupState, exc: BaseException, epoch: int) -> None:
    with store_errors(state, exc):
        missing = [r for r in range(state.size) if not has_key(state, f"fail/{epoch}/{r}")]
    note = (
        f"cpcompile: this error was reported to CP group {state.name!r} (this is rank {state.rank} of "
        f"{state.size}); CP {ranks_text(missing)} had not reported the same error within "
        f"{state.options.report_grace_s:g} s. The group's next use settles it and raises RankFailedError if they "
        "failed differently. Peers blocked in a collective are released when this process exits, or after "
        f"the group's collective timeout ({state.peer_timeout_s:g} s; ${PEER_TIMEOUT_ENV})"
    )
    if hasattr(exc, "add_note"):
        exc.add_note(note)


def _await_verdict(state: GroupState, epoch: int, *, limit_s: float, final: bool) -> bool | None:
    """Whether every rank failed alike in round ``epoch``; the first rank to decide writes it for all.

    Decides as soon as every rank reported, a report differs from another, or a rank that did not report is
    dead. After ``limit_s`` without that: decides "not alike" when ``final``, else returns ``None``.
    """
    key = f"verdict/{epoch}"
    start = time.monotonic()
    next_liveness = start
    backoff = Backoff()
    while True:
        if has_key(state, key):
            return load_json(state, key)["same"]
        posted = {
            r: load_json(state, f"fail/{epoch}/{r}") for r in range(state.size) if has_key(state, f"fail/{epoch}/{r}")
        }
        missing = [r for r in range(state.size) if r not in posted]
        alike = all(rec["kind"] == "error" for rec in posted.values())
        alike = alike and len({(rec["point"], rec["step"]) for rec in posted.values()}) <= 1
        decided = not missing or not alike
        now = time.monotonic()
        if not decided and now >= next_liveness:
            next_liveness = now + LIVENESS_EVERY_S
            decided = bool(dead_peers(state, missing))
        if not decided and now - start >= limit_s:
            if not final:
                return None
            decided = True
        if decided:
            same = alike and not missing
            stored = state.store.compare_set(key, "", json.dumps({"same": same}))
            return json.loads(stored)["same"]
        backoff.sleep()


def _reports(state: GroupState, epoch: int) -> tuple[dict[int, dict], dict[int, str], list[int]]:
    """The records posted in round ``epoch``, the ranks known dead, and the other ranks that did not report."""
    records = {
        r: load_json(state, f"fail/{epoch}/{r}") for r in range(state.size) if has_key(state, f"fail/{epoch}/{r}")
    }
    missing = [r for r in range(state.size) if r not in records]
    dead = dead_peers(state, missing)
    return records, dead, [r for r in missing if r not in dead]


def _failure_error(
    state: GroupState, records: dict[int, dict], dead: dict[int, str], silent: list[int]
) -> RankFailedError:
    failed = {r: rec for r, rec in sorted(records.items()) if rec["kind"] == "error"}
    others = {r: rec for r, rec in sorted(records.items()) if rec["kind"] != "error"}
    group = f"of CP group {state.name!r} (size {state.size})"
    first = failed[min(failed)] if failed else {"step": state.step, "in_step": True}
    step = first["step"]
    when = f"{'in' if first['in_step'] else 'after'} step {step}"
    if failed:
        head = f"CP {ranks_text(list(failed))} {group} failed {when}"
    elif dead:
        head = f"CP {ranks_text(sorted(dead))} {group} died {when}"
    elif silent:
        head = f"CP {ranks_text(silent)} {group} stopped responding {when}"
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
            why = clip(rec["message"].splitlines()[0] if rec["message"] else "", 300)
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


def _again(state: GroupState) -> RankFailedError:
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
