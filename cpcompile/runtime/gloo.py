"""A gloo backend whose process groups run their collectives on one worker thread.

torch's ``ProcessGroupGloo`` (measured on torch 2.13) runs each group's collectives on two worker threads. After
each collective, the worker that ran it records the group's last completed collective (``pgStatus_``, a
``std::string`` holding the op's name) in ``ProcessGroupGloo::runLoop``, without holding the group's lock. When
two collectives of one group finish at the same time, both workers replace that string at once and its old buffer
is freed twice. Names longer than 15 characters live on the heap, and ``ALLGATHER_COALESCED`` is the name of every
functional all-gather on gloo, so a compiled graph that keeps K's and V's all-gathers in flight together hits it.
The heap corruption surfaces later, anywhere: glibc's "malloc(): unaligned tcache chunk detected", or a
segmentation fault.

With one worker thread per group, a group's collectives finish one after the other and the race cannot happen.
Collectives still overlap with the computation between issuing them and waiting for them; only two collectives
of the same group no longer run at once.

Usage, on CPU::

    dist.init_process_group(cpcompile.gloo_backend(), ...)  # every group created later uses it too

:func:`gloo_worker_threads` tells how many worker threads a group has; the backend warns once per process when
a CP group is a gloo group with more than one (:func:`cpcompile.failsafe.state.group_state`).
"""

from __future__ import annotations

import warnings

import torch.distributed as dist

from cpcompile import _compat

#: The registered name of the one-thread gloo backend, for ``init_process_group`` / ``new_group`` / device meshes.
BACKEND = "cpcompile_gloo"
#: Names under which a group's collectives run on ``ProcessGroupGloo``.
GLOO_BACKENDS = ("gloo", BACKEND)
#: What the warning about a multi-threaded gloo group tells the user to do.
GLOO_FIX = (
    "create the process groups with dist.init_process_group(cpcompile.gloo_backend(), ...): its groups run "
    "their collectives on one worker thread"
)


def _create(opts, backend_options: object) -> dist.Backend:
    return _compat.new_gloo_backend(opts, threads=1)


def gloo_backend() -> str:
    """Register (once per process) the gloo backend whose groups use one worker thread; returns its name.

    Pass the name wherever torch takes a backend: ``init_process_group``, ``new_group``, ``init_device_mesh``'s
    groups follow the default. Its groups are ``ProcessGroupGloo`` instances, so everything that runs on gloo runs
    on them (functional collectives, FSDP2, ``dist.*`` calls); only ``dist.get_backend(group)`` reads
    ``"cpcompile_gloo"``.
    """
    _compat.register_backend_once(BACKEND, _create, devices=["cpu"])
    return BACKEND


def gloo_worker_threads(group: dist.ProcessGroup) -> int | None:
    """How many worker threads run ``group``'s CPU collectives, or ``None`` when gloo does not run them."""
    if dist.get_backend(group) not in GLOO_BACKENDS:
        return None
    return _compat.gloo_worker_threads(group)


#: Processes warned about a multi-threaded gloo CP group (once per process).
_WARNED: list[bool] = []


def warn_if_threaded(group: dist.ProcessGroup) -> None:
    """Warn, once per process, when CP group ``group`` runs its collectives on more than one gloo worker thread."""
    threads = gloo_worker_threads(group)
    if threads is None or threads <= 1 or _WARNED:
        return
    _WARNED.append(True)
    warnings.warn(
        f"the CP process group {_compat.group_name_of(group)!r} is a gloo group with {threads} worker threads: "
        "torch's ProcessGroupGloo can free its status string twice when two of the group's collectives finish at "
        f"once (heap corruption: 'malloc(): unaligned tcache chunk detected' or a segfault, later); {GLOO_FIX}",
        stacklevel=4,
    )
