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

Modules: :mod:`~cpcompile.failsafe.state` (options, per-group state), :mod:`~cpcompile.failsafe.agreement` (the
agreement protocol: :func:`agree`, :func:`skip`), :mod:`~cpcompile.failsafe.failure` (the failure protocol:
:func:`on_failure`, :func:`scope`, :func:`fail_together`, :func:`enter_step`), :mod:`~cpcompile.failsafe.liveness`
(peers' processes checked through ``/proc``), :mod:`~cpcompile.failsafe.store` (store I/O).
"""

from cpcompile.errors import RankFailedError, RanksDivergedError
from cpcompile.failsafe.agreement import agree, skip
from cpcompile.failsafe.failure import enter_step, fail_together, on_failure, scope
from cpcompile.failsafe.state import (
    DEFAULT_REPORT_GRACE_S,
    PEER_TIMEOUT_ENV,
    REPORT_GRACE_ENV,
    FailsafeOptions,
    configure,
    current_step,
    mark_agreed,
    set_fingerprint,
)

__all__ = [
    "DEFAULT_REPORT_GRACE_S",
    "PEER_TIMEOUT_ENV",
    "REPORT_GRACE_ENV",
    "FailsafeOptions",
    "RankFailedError",
    "RanksDivergedError",
    "agree",
    "configure",
    "current_step",
    "enter_step",
    "fail_together",
    "mark_agreed",
    "on_failure",
    "scope",
    "set_fingerprint",
    "skip",
]
