"""Run a function on N CPU processes with gloo, from pytest, with a timeout and the children's tracebacks."""

from __future__ import annotations

import datetime
import io
import os
import queue
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: Default wall-clock limit of one multi-process test (spawn + import + compile + run).
DEFAULT_TIMEOUT_S = 240.0


def _child(rank: int, world_size: int, init_file: str, fn, args, results, timeout_s: float) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        out = fn(rank, world_size, *args)
        buf = io.BytesIO()  # bytes, not shared-memory tensors: the child exits before the parent reads
        torch.save(out, buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - the traceback is sent to the parent, which fails the test
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn, world_size: int, *args, timeout_s: float = DEFAULT_TIMEOUT_S, may_die: tuple[int, ...] = ()
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo processes; return per-rank results.

    ``fn`` must be importable (a module-level function). Raises ``AssertionError`` with every failed rank's
    traceback when a rank raises, and ``TimeoutError`` (after killing the children) when the run takes longer
    than ``timeout_s``; a collective that waits for a dead rank is cut by the process group timeout.
    Ranks in ``may_die`` may exit without a result (a test that kills them on purpose): their result is
    ``None``, and the run waits for the other ranks' results.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_child, args=(r, world_size, init_file, fn, args, results, timeout_s), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outcome: dict[int, tuple[str, object]] = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        try:
            while len(outcome) < world_size:
                left = (deadline - datetime.datetime.now()).total_seconds()
                if left <= 0:
                    raise TimeoutError(
                        f"distributed test {fn.__name__} did not finish within {timeout_s:.0f}s; ranks done: "
                        f"{sorted(outcome)}; failures so far: {_failures(outcome)}"
                    )
                try:
                    rank, status, payload = results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outcome]
                    for r in [r for r in dead if r in may_die]:
                        outcome[r] = ("died", None)
                    dead = [r for r in dead if r not in may_die]
                    if dead and results.empty():
                        # a child died without reporting (e.g. killed); give the queue a moment, then fail
                        try:
                            rank, status, payload = results.get(timeout=2.0)
                        except queue.Empty:
                            raise AssertionError(
                                f"ranks {dead} of {fn.__name__} exited without a result (exit codes "
                                f"{[procs[r].exitcode for r in dead]}); failures: {_failures(outcome)}"
                            ) from None
                    else:
                        continue
                outcome[rank] = (status, payload)
                if status == "error":
                    # one failed rank is enough: collect the others briefly, then fail
                    _drain(results, outcome, world_size, wait_s=10.0)
                    raise AssertionError(f"distributed test {fn.__name__} failed:\n{_failures(outcome)}")
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=5)
    return [
        None if outcome[r][0] == "died" else torch.load(io.BytesIO(outcome[r][1]), weights_only=False)
        for r in range(world_size)
    ]


def _drain(results, outcome: dict, world_size: int, wait_s: float) -> None:
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=wait_s)
    while len(outcome) < world_size:
        left = (deadline - datetime.datetime.now()).total_seconds()
        if left <= 0:
            return
        try:
            rank, status, payload = results.get(timeout=left)
        except queue.Empty:
            return
        outcome[rank] = (status, payload)


def _failures(outcome: dict) -> str:
    return "\n".join(f"--- rank {r} ---\n{p}" for r, (s, p) in sorted(outcome.items()) if s == "error") or "none"
