"""The agreement protocol: a check whose verdict can differ between ranks is decided together (:func:`agree`), in
one control round through the group's store; :func:`skip` takes a rank's turn without a round.

A peer that fails instead of posting, dies or times out turns the round into a failure round
(:mod:`cpcompile.failsafe.failure`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import torch.distributed as dist

from cpcompile.errors import RankFailedError, RanksDivergedError
from cpcompile.failsafe.failure import resolve, usable
from cpcompile.failsafe.liveness import dead_peers, say_hello
from cpcompile.failsafe.state import (
    LIVENESS_EVERY_S,
    PEER_TIMEOUT_ENV,
    Backoff,
    GroupState,
    clip,
    mark_agreed,
    ranks_text,
)
from cpcompile.failsafe.store import has_key, load_json, put_json, store_errors

__all__ = ["agree", "skip"]


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

    ``error`` is this rank's verdict (``None``: passed); ``series`` names the kind of check and ``what`` says
    what was checked. Every round of the group (of every kind) takes the next number of one sequence, and each
    post carries its kind, ``what``, the ``shard`` step and the step's batch fingerprint
    (:func:`set_fingerprint`): ranks that arrive at different rounds, or with different batches, all raise
    :class:`RanksDivergedError` naming where each rank was, and a peer that skipped this turn (:func:`skip`) is
    seen at once; ``payload`` (JSON-serialisable) is handed to every rank. When any rank
    failed, every rank raises an error of the first failing rank's type (one of ``kinds``, ``ValueError``,
    ``TypeError``, else ``RuntimeError``) naming the failing ranks and their messages. When a peer fails
    elsewhere, dies or does not post within the peer timeout, :class:`RankFailedError` instead.

    Returns every rank's ``payload``, by rank. ``stats`` (a ``CommStats``) counts the round and its bytes.
    Without peers (one rank, the fake backend) it raises ``error`` itself or returns ``[payload]``.
    """
    state = usable(group)
    if state.store is None:
        if error is not None:
            raise error
        return [payload]
    say_hello(state, stats)
    seq = state.seq
    keys = [f"agree/{seq}/{r}" for r in range(state.size)]
    verdict = None if error is None else {"type": type(error).__name__, "message": clip(str(error))}
    round_id = {"kind": series, "what": what, "step": state.step, "fp": state.fingerprint}
    with store_errors(state, error):
        nbytes = put_json(state, keys[state.rank], {"error": verdict, "payload": payload, "round": round_id})
        _wait_for_posts(state, keys, what, error)
        raw = state.store.multi_get(keys)
        if state.last_key is not None:  # every rank has read the previous round: it posted this one after reading it
            state.store.delete_key(state.last_key)
    state.seq = seq + 1
    state.last_key = keys[state.rank]
    if stats is not None:
        stats.record_control(nbytes + sum(len(v) for v in raw))
    posts = [json.loads(v) for v in raw]
    _check_same_round(state, seq, [p["round"] for p in posts], error)
    failed = {r: p["error"] for r, p in enumerate(posts) if p["error"] is not None}
    if failed:
        exc = _agreed_error(state, what, failed, kinds)
        mark_agreed(exc)
        raise exc from error
    return [p["payload"] for p in posts]


def skip(group: dist.ProcessGroup, what: str, stats=None) -> None:
    """Take this rank's turn of the group's next control round without one: a step that opts out of its check.

    One store write, no wait: a peer that holds a round at this turn sees at once that this rank skipped it
    (:class:`RanksDivergedError` naming ``what``) instead of waiting for it until the peer timeout.
    """
    state = usable(group)
    if state.store is None:
        return
    say_hello(state, stats)
    with store_errors(state, None):
        nbytes = put_json(state, f"skip/{state.rank}", {"seq": state.seq, "what": what, "step": state.step})
    state.seq += 1
    if stats is not None:
        stats.record_control(nbytes, rounds=0)


def _describe_round(r: dict) -> str:
    return f"{r.get('what', '?')} in step {r.get('step', '?')}"


def _check_same_round(state: GroupState, seq: int, rounds: list[dict], error: BaseException | None) -> None:
    """Every rank must have come to the same round (kind, check, step) with the same batch; else every rank
    raises :class:`RanksDivergedError` (the same message, from the same posts) and the group is marked failed."""
    ident = [(r["kind"], r["what"], r["step"]) for r in rounds]
    fps = {r["fp"] for r in rounds}
    if len(set(ident)) == 1 and len(fps) == 1:
        return
    by: dict[str, list[int]] = {}
    if len(set(ident)) > 1:
        for rank, r in enumerate(rounds):
            by.setdefault(_describe_round(r), []).append(rank)
        head = f"the CP ranks of group {state.name!r} arrived at different control rounds (round {seq})"
        why = (
            "they took different paths through the step: a data-dependent branch in the model, a recompile on "
            "some ranks only (a batch shape that differs), a skipped backward(), an error caught on one rank, or "
            "shard(...) options that differ between ranks"
        )
    else:
        for rank, r in enumerate(rounds):
            by.setdefault(f"batch fingerprint {r['fp'] or '(not computed: check_batch=False)'}", []).append(rank)
        first = rounds[0]
        head = f"the CP ranks of group {state.name!r} run {first['what']} in step {first['step']} on different batches"
        why = "every rank of the CP group must pass the same FULL global batch to cpcompile.shard"
    lines = [f"  {ranks_text(ranks)}: {desc}" for desc, ranks in by.items()]
    err = RanksDivergedError(
        head + "; every rank of the group raises this error:\n" + "\n".join(lines) + f"\n{why}. The group's "
        "collectives may be out of step: destroy the CP group and create a new one, or restart the job.",
        step=state.step,
    )
    state.broken = err
    mark_agreed(err)
    raise err from error


def _agreed_error(state: GroupState, what: str, failed: dict[int, dict], kinds) -> BaseException:
    by_name = {k.__name__: k for k in (*kinds, ValueError, TypeError, RuntimeError)}
    cls = by_name.get(failed[min(failed)]["type"], RuntimeError)
    groups: dict[tuple[str, str], list[int]] = {}
    for r, v in sorted(failed.items()):
        groups.setdefault((v["type"], v["message"]), []).append(r)
    lines = [
        f"  {ranks_text(ranks)}: {kind}: {message}" if kind != cls.__name__ else f"  {ranks_text(ranks)}: {message}"
        for (kind, message), ranks in groups.items()
    ]
    return cls(
        f"{what} failed on CP {ranks_text(sorted(failed))} of {state.size} (group {state.name!r}); every rank of the "
        "group raises this error:\n" + "\n".join(lines)
    )


def _wait_for_posts(state: GroupState, keys: list[str], what: str, cause: BaseException | None) -> None:
    """Wait until every key exists; a peer that fails instead, dies or times out raises RankFailedError."""
    timeout = state.peer_timeout_s
    start = time.monotonic()
    next_liveness = start + LIVENESS_EVERY_S
    backoff = Backoff()
    while not state.store.check(keys):
        now = time.monotonic()
        missing = None
        skipped = _skipped(state, keys)
        if skipped:
            err = RanksDivergedError(
                f"CP {ranks_text(sorted(skipped))} of group {state.name!r} skipped {what} of step {state.step} "
                f"(round {int(keys[0].split('/')[1])}) that CP rank {state.rank} holds: "
                + "; ".join(f"rank {r} ran {why}" for r, why in sorted(skipped.items()))
                + ". The ranks no longer run the same checks: pass the same cpcompile.shard(...) options "
                "(check_batch=...) on every rank. A rank that skipped the round is released from its next "
                f"collective when this process exits or after the group's timeout ({timeout:g} s; "
                f"${PEER_TIMEOUT_ENV})",
                step=state.step,
            )
            reported = resolve(state, err, "error", what, cause=cause)
            raise (reported or err) from cause
        if has_key(state, f"fail/{state.epoch}/any"):
            if state.store.check(keys):
                # every peer posted before one failed later (in its step): the round is complete here too, and
                # this rank meets that failure where it happened
                break
            reason = f"it was waiting for its peers in {what} of step {state.step}"
        elif now - start >= timeout:
            missing = [r for r, k in enumerate(keys) if not has_key(state, k)]
            reason = f"it timed out after {timeout:g} s waiting for CP {ranks_text(missing)} in {what}"
            reason += _last_seen(state, keys, missing)
        elif now >= next_liveness:
            next_liveness = now + LIVENESS_EVERY_S
            missing = [r for r, k in enumerate(keys) if not has_key(state, k)]
            dead = dead_peers(state, missing)
            reason = f"it was waiting for CP {ranks_text(sorted(dead))} in {what}" if dead else None
        else:
            reason = None
        if reason is not None:
            # a "wait" record never matches an "error" one, so the round always ends with an error
            err = resolve(state, _Waiting(reason), "wait", what, cause=cause) or RankFailedError(reason)
            if cause is None:
                raise err
            raise err from cause
        backoff.sleep()


def _last_seen(state: GroupState, keys: list[str], missing: list[int]) -> str:
    """Where the ranks that did not come to this round were last seen (their post of the previous round)."""
    seq = int(keys[0].split("/")[1])
    seen = []
    for r in missing:
        key = f"agree/{seq - 1}/{r}"
        if seq > 0 and has_key(state, key):
            rnd = load_json(state, key).get("round") or {}
            seen.append(f"rank {r} last came to {_describe_round(rnd)}")
    if not seen:
        return ""
    return (
        f" of step {state.step} ({'; '.join(seen)}: it is still in an earlier part of the step, most likely "
        "blocked in a collective this rank did not issue: a backward() or an attention call that this rank "
        "skipped, or a recompile on that rank only)"
    )


def _skipped(state: GroupState, keys: list[str]) -> dict[int, str]:
    """Ranks that did not post ``keys`` because they skipped this round (:func:`skip`), with what they ran."""
    seq = int(keys[0].split("/")[1])
    out = {}
    for r, key in enumerate(keys):
        marker = f"skip/{r}"
        if r == state.rank or has_key(state, key) or not has_key(state, marker):
            continue
        rec = load_json(state, marker)
        if rec["seq"] >= seq:
            out[r] = f"{rec['what']} in step {rec['step']}"
    return out


class _Waiting(RuntimeError):
    """This rank's part in a failure round it joined because a peer did not come (never raised to the user)."""
