"""Run a function on N CPU processes with gloo, from pytest, with a timeout and the children's tracebacks.

Starting a rank by ``spawn`` costs about 4 s of CPU (importing torch, transformers and cpcompile) against a
fraction of a second for a tiny model's step. So ranks are forked from multiprocessing's fork server, which
imports :data:`PRELOAD` once per pytest process (a rank then starts in well under a second, with the parent's
environment of the moment, as a spawned one would), and by default :func:`run_distributed` runs on a *pool*:
``world_size`` ranks started once per pytest process and reused by every later call of that size. A call runs on
a new process group (and store), with a clean Dynamo state, environment and cpcompile module state; a call that
fails or times out takes its pool down (its ranks may be stuck in a collective), and the next call starts a new
one. Tests whose ranks fail, die or break their process group on purpose pass ``fresh=True`` and get processes of
their own. Ranks run on ``cpcompile.gloo_backend()`` (one gloo worker thread per group: stock gloo's two corrupt
the heap now and then, ``cpcompile.runtime.gloo``); a rank that dies in native code fails the call like any other
rank that exits without a result.
"""

from __future__ import annotations

import atexit
import collections
import copy
import datetime
import faulthandler
import importlib
import importlib.abc
import io
import itertools
import os
import queue
import shutil
import sys
import tempfile
import traceback
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cpcompile.runtime.gloo import gloo_backend

#: Default wall-clock limit of one multi-process test (spawn + import + compile + run).
DEFAULT_TIMEOUT_S = 240.0
#: Process-group timeout of pooled ranks: a collective waits this long for a slow peer (4 ranks compiling on 2
#: cores); a failed call does not wait for it, since the parent kills the pool.
POOL_PG_TIMEOUT_S = 900.0
#: Pooled ranks kept alive per pytest process, over all pool sizes (each holds a torch runtime, ~0.5 GB).
MAX_POOLED_RANKS = 9
#: What the fork server imports before it forks a rank: what every rank imports (nothing here starts a thread or
#: touches a device; Dynamo's state is made per process on first compile).
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch._dynamo.backends.debugging",  # AOTAutograd and the first compile's imports
    "torch._functorch.aot_autograd",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "cpcompile",
    "tests.harness.parity",
    "tests.harness.workers",
)


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _adopt(environ: dict[str, str]) -> None:
    """The parent's environment when it started this rank (the fork server's is the one it had at its start)."""
    os.environ.clear()
    os.environ.update(environ)


def _setup_rank(rank: int, world_size: int, init_file: str, timeout_s: float) -> None:
    faulthandler.enable()  # a rank that crashes in native code prints where, before its peers report it gone
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        gloo_backend(),  # one gloo worker thread per group (cpcompile.runtime.gloo: torch's two race)
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _run_job(fn, rank: int, world_size: int, args) -> tuple[str, object]:
    try:
        out = fn(rank, world_size, *args)
        buf = io.BytesIO()  # bytes, not shared-memory tensors: the child may exit before the parent reads
        torch.save(out, buf)
        return "ok", buf.getvalue()
    except BaseException:  # noqa: BLE001 - the traceback is sent to the parent, which fails the test
        return "error", traceback.format_exc()


def _child(rank: int, world_size: int, init_file: str, fn, args, results, timeout_s: float, environ) -> None:
    _adopt(environ)
    try:
        _setup_rank(rank, world_size, init_file, timeout_s)
        status, payload = _run_job(fn, rank, world_size, args)
    except BaseException:  # noqa: BLE001
        status, payload = "error", traceback.format_exc()
    results.put((0, rank, status, payload))
    if dist.is_initialized():
        dist.destroy_process_group()


_STATE_TYPES = (dict, set, list, collections.OrderedDict, weakref.WeakValueDictionary, weakref.WeakSet)
_SCALAR_TYPES = (type(None), bool, int, float, str)


def _snapshot(module) -> dict:
    """The module-level containers, id counters and private scalars of one cpcompile module (registries,
    warned-once sets, backend numbers)."""
    state = {}
    for attr, value in vars(module).items():
        if attr.startswith("__"):
            continue
        if isinstance(value, itertools.count):  # id counters (backend names): a pooled call numbers from the start
            state[module.__name__, attr] = (value, _next_of(value))
        elif isinstance(value, _STATE_TYPES) or (attr.startswith("_") and isinstance(value, _SCALAR_TYPES)):
            state[module.__name__, attr] = (value, copy.copy(value))
    return state


def _next_of(counter: itertools.count) -> int:
    """The value ``counter`` yields next, without advancing it (its repr is ``count(n)``)."""
    return int(repr(counter)[len("count(") : -1])


def _is_cpcompile(name: str) -> bool:
    return name == "cpcompile" or name.startswith("cpcompile.")


class _SnapshotOnImport(importlib.abc.MetaPathFinder):
    """Snapshots each cpcompile module right after its import, before any call can change its state: a pooled
    rank imports only what its calls use (``cpcompile.integrations.transformers`` alone costs a second and a
    half of CPU for transformers' Trainer), and a module first imported by a later call still starts clean."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def find_spec(self, name, path, target=None):
        if not _is_cpcompile(name):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader, state = spec.loader, self.state
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module):
            run(module)
            state.update(_snapshot(module))

        loader.exec_module = exec_module  # a source file's loader serves this one module
        return spec


def _module_state() -> dict:
    """The state of every cpcompile module imported so far, and of each one imported later (when it is)."""
    state = {}
    for name, module in list(sys.modules.items()):
        if _is_cpcompile(name):
            state.update(_snapshot(module))
    sys.meta_path.insert(0, _SnapshotOnImport(state))
    return state


def _restore_module_state(state: dict) -> None:
    """Put cpcompile's module state back as :func:`_module_state` found it: a pooled call starts like a new process."""
    for (name, attr), (obj, saved) in list(state.items()):
        module = sys.modules[name]
        if isinstance(obj, itertools.count):
            obj = itertools.count(saved)
        elif isinstance(obj, _STATE_TYPES):
            obj.clear()
            obj.update(saved) if not isinstance(obj, list) else obj.extend(saved)
        setattr(module, attr, obj)


def _pool_child(rank: int, world_size: int, init_file: str, jobs, results, environ) -> None:
    _adopt(environ)
    state = None
    while True:
        job = jobs.get()
        if job is None:
            break
        job_id, fn, args = job
        try:
            # a new process group and store per call: cpcompile keeps per-group state in the store (numbered
            # control rounds), which must not carry over from an earlier call on the same group name
            if dist.is_initialized():
                dist.destroy_process_group()
            _setup_rank(rank, world_size, f"{init_file}.{job_id}", POOL_PG_TIMEOUT_S)
            if state is None:
                state = _module_state()
        except BaseException:  # noqa: BLE001
            results.put((job_id, rank, "error", traceback.format_exc()))
            break
        env = dict(os.environ)
        status, payload = _run_job(fn, rank, world_size, args)
        os.environ.clear()
        os.environ.update(env)
        torch.compiler.reset()
        _restore_module_state(state)
        results.put((job_id, rank, status, payload))
    if dist.is_initialized():
        dist.destroy_process_group()


class _Ranks:
    """Spawned ranks and the queue their results come back on."""

    def __init__(self, world_size: int, pooled: bool, fn=None, args=(), timeout_s: float = 0.0) -> None:
        ctx = _context()
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tmp = tempfile.mkdtemp(prefix="cpcompile-dist-")
        init_file = os.path.join(self.tmp, "rendezvous")
        self.jobs = [ctx.Queue() for _ in range(world_size)] if pooled else None
        self.procs = [
            ctx.Process(
                target=_pool_child if pooled else _child,
                args=(r, world_size, init_file, self.jobs[r], self.results, dict(os.environ))
                if pooled
                else (r, world_size, init_file, fn, args, self.results, timeout_s, dict(os.environ)),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def collect(self, job_id: int, name: str, timeout_s: float, may_die: tuple[int, ...]) -> dict:
        """Wait for every rank's result of ``job_id``; raise on the first failure, a silent death or the timeout."""
        outcome: dict[int, tuple[str, object]] = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        while len(outcome) < self.world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                raise TimeoutError(
                    f"distributed test {name} did not finish within {timeout_s:.0f}s; ranks done: "
                    f"{sorted(outcome)}; failures so far: {_failures(outcome)}"
                )
            try:
                got_id, rank, status, payload = self.results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in outcome]
                for r in [r for r in dead if r in may_die]:
                    outcome[r] = ("died", None)
                dead = [r for r in dead if r not in may_die]
                if not dead or not self.results.empty():
                    continue
                try:  # a child died without reporting (e.g. killed): give the queue a moment, then fail
                    got_id, rank, status, payload = self.results.get(timeout=2.0)
                except queue.Empty:
                    raise AssertionError(
                        f"ranks {dead} of {name} exited without a result (exit codes "
                        f"{[self.procs[r].exitcode for r in dead]}); failures: {_failures(outcome)}"
                    ) from None
            if got_id not in (job_id, -1):
                continue  # a result of an earlier call that failed elsewhere
            outcome[rank] = (status, payload)
            if status == "error":
                self._drain(job_id, outcome, wait_s=10.0)  # one failed rank is enough: collect the others briefly
                raise AssertionError(f"distributed test {name} failed:\n{_failures(outcome)}")
        return outcome

    def _drain(self, job_id: int, outcome: dict, wait_s: float) -> None:
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=wait_s)
        while len(outcome) < self.world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                return
            try:
                got_id, rank, status, payload = self.results.get(timeout=left)
            except queue.Empty:
                return
            if got_id in (job_id, -1):
                outcome[rank] = (status, payload)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, graceful: bool = False) -> None:
        if graceful and self.jobs is not None:
            for q in self.jobs:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        shutil.rmtree(self.tmp, ignore_errors=True)


_pools: dict[int, _Ranks] = {}  # world size -> pool, least recently used first
_job_ids = itertools.count(1)


def _pool(world_size: int) -> _Ranks:
    pool = _pools.pop(world_size, None)
    if pool is not None and not pool.alive():
        pool.close()
        pool = None
    while _pools and sum(p.world_size for p in _pools.values()) + world_size > MAX_POOLED_RANKS:
        _pools.pop(next(iter(_pools))).close(graceful=True)
    if pool is None:
        pool = _Ranks(world_size, pooled=True)
    _pools[world_size] = pool
    return pool


@atexit.register
def _close_pools() -> None:
    while _pools:
        _pools.popitem()[1].close(graceful=True)


def run_distributed(
    fn,
    world_size: int,
    *args,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    may_die: tuple[int, ...] = (),
    fresh: bool = False,
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return per-rank results.

    ``fn`` must be importable (a module-level function). Raises ``AssertionError`` with every failed rank's
    traceback when a rank raises, and ``TimeoutError`` (after killing the ranks) when the run takes longer than
    ``timeout_s``. By default the ranks are a pool reused across calls (module docstring); ``fresh=True`` spawns
    ranks for this call only, whose process group times out after ``timeout_s``. Ranks in ``may_die`` (fresh
    runs only) may exit without a result (a test that kills them on purpose): their result is ``None``.
    """
    if may_die and not fresh:
        raise ValueError(f"may_die={may_die} needs fresh=True: a pooled rank must not die")
    name = getattr(fn, "__name__", str(fn))
    if fresh:
        ranks = _Ranks(world_size, pooled=False, fn=fn, args=args, timeout_s=timeout_s)
        try:
            outcome = ranks.collect(0, name, timeout_s, may_die)
        finally:
            ranks.close()
    else:
        ranks = _pool(world_size)
        job_id = next(_job_ids)
        for q in ranks.jobs:
            q.put((job_id, fn, args))
        try:
            outcome = ranks.collect(job_id, name, timeout_s, may_die)
        except BaseException:
            _pools.pop(world_size, None)
            ranks.close()  # its ranks may be stuck in a collective of the failed call
            raise
    return [
        None if outcome[r][0] == "died" else torch.load(io.BytesIO(outcome[r][1]), weights_only=False)
        for r in range(world_size)
    ]


def _alone_child(fn, args, results, environ) -> None:
    _adopt(environ)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    results.put(_run_job(lambda _rank, _world_size, *a: fn(*a), 0, 1, args))


def run_alone(fn, *args, timeout_s: float = DEFAULT_TIMEOUT_S):
    """Run ``fn(*args)`` in a new process forked from the fork server (no process group, nothing imported past
    :data:`PRELOAD`: a fresh interpreter's state at a fraction of its start-up cost); return its result. Raises
    ``AssertionError`` with the traceback when it raises or exits without a result, ``TimeoutError`` past
    ``timeout_s``."""
    ctx = _context()
    results = ctx.Queue()
    proc = ctx.Process(target=_alone_child, args=(fn, args, results, dict(os.environ)), daemon=True)
    proc.start()
    name = getattr(fn, "__name__", str(fn))
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    try:
        while True:
            try:
                status, payload = results.get(timeout=1.0)
                break
            except queue.Empty:
                if datetime.datetime.now() > deadline:
                    raise TimeoutError(f"{name} did not finish within {timeout_s:.0f}s") from None
                if not proc.is_alive() and results.empty():
                    raise AssertionError(f"{name} exited without a result (exit code {proc.exitcode})") from None
    finally:
        proc.join(timeout=5.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if status == "error":
        raise AssertionError(f"{name} failed:\n{payload}")
    return torch.load(io.BytesIO(payload), weights_only=False)


def _failures(outcome: dict) -> str:
    return "\n".join(f"--- rank {r} ---\n{p}" for r, (s, p) in sorted(outcome.items()) if s == "error") or "none"
