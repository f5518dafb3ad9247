"""Liveness of peers on this host: every rank posts who it is (host, PID namespace, pid, start time) once, and a
rank waiting for a peer checks through ``/proc`` whether that peer's process is gone (Linux, same PID namespace)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Sequence

from cpcompile.failsafe.state import GroupState
from cpcompile.failsafe.store import has_key, load_json, put_json, store_errors

__all__ = ["dead_peers", "identity", "say_hello"]


# -- liveness of peers on this host ------------------------------------------------------------------------
def identity() -> dict:
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


def say_hello(state: GroupState, stats=None) -> None:
    if state.said_hello:
        return
    with store_errors(state, None):
        nbytes = put_json(state, f"hello/{state.rank}", identity())
    state.said_hello = True
    if stats is not None:
        stats.record_control(nbytes, rounds=0)


def dead_peers(state: GroupState, ranks: Sequence[int]) -> dict[int, str]:
    """Which of ``ranks`` are known dead: their process ran on this host (same PID namespace) and is gone."""
    me = identity()
    dead = {}
    for r in ranks:
        key = f"hello/{r}"
        if not has_key(state, key):
            continue
        peer = load_json(state, key)
        if peer["host"] != me["host"] or peer["pidns"] is None or peer["pidns"] != me["pidns"]:
            continue
        stat = _proc_stat(peer["pid"])
        if stat is None or stat[0] in ("Z", "X") or stat[19] != peer["start"]:
            dead[r] = f"its process {peer['pid']} on host {peer['host']} is gone"
    return dead
