"""What releases a gloo rank blocked in a collective whose peer will not join it (the facts behind failsafe).

Two spawned gloo processes. Rank 0 all-gathers over a fresh group; rank 1 does not join and, one second later,
does what the case says. Rank 0 reports whether its all-gather returned or raised, after how long, and the
start of the message. A case that releases nothing is cut after ``--limit`` seconds (rank 1 exits at the end,
so a late release by "Connection closed by peer" shows the process exit, not the mechanism).
"""

from __future__ import annotations

import argparse
import datetime
import os
import queue
import signal
import tempfile
import threading
import time

#: case -> what happens one second after rank 0 starts waiting.
CASES = {
    "peer ProcessGroup.abort()": "rank 1 calls abort() on its group, then stays alive",
    "peer ProcessGroup.shutdown()": "rank 1 calls shutdown() on its group, then stays alive",
    "peer backend abort()": "rank 1 calls abort() on its gloo backend, then stays alive",
    "own ProcessGroup.abort() from a thread": "a thread of rank 0 calls abort() on the group rank 0 waits in",
    "own backend abort() from a thread": "a thread of rank 0 calls abort() on its gloo backend",
    "peer SIGKILL": "rank 1 kills its own process",
    "peer raises, stays alive": "rank 1 does nothing more (a notebook that caught the error)",
    "group timeout 2 s (set_timeout)": "rank 0 set its group's timeout to 2 s before the all-gather",
}


def _child(rank: int, init_file: str, case: str, limit: float, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=600)
    )
    group = dist.new_group([0, 1])
    t = torch.ones(4)
    dist.all_reduce(t, group=group)  # connected and in step
    backend = group._get_backend(torch.device("cpu"))
    if case.startswith("group timeout"):
        group.set_timeout(datetime.timedelta(seconds=2))
    if rank == 1:
        time.sleep(1.0)
        action = {
            "peer ProcessGroup.abort()": group.abort,
            "peer ProcessGroup.shutdown()": group.shutdown,
            "peer backend abort()": backend.abort,
            "peer SIGKILL": lambda: os.kill(os.getpid(), signal.SIGKILL),
        }.get(case)
        if action is not None:
            threading.Thread(target=action, daemon=True).start()  # shutdown() may block: keep this rank free
        time.sleep(limit + 2)
        os._exit(0)
    own = {"own ProcessGroup.abort() from a thread": group.abort, "own backend abort() from a thread": backend.abort}
    if case in own:
        threading.Timer(1.0, own[case]).start()
    start = time.monotonic()
    try:
        dist.all_gather([torch.zeros(4), torch.zeros(4)], t, group=group)
        results.put((case, "returned", time.monotonic() - start, ""))
    except RuntimeError as e:
        results.put((case, "raised", time.monotonic() - start, str(e)))
    results.close()
    results.join_thread()  # flush before the hard exit (gloo's destructor could wait on the peer)
    os._exit(0)


def _run(case: str, limit: float) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_child, args=(r, os.path.join(tmp, "rdv"), case, limit, results), daemon=True)
            for r in range(2)
        ]
        for p in procs:
            p.start()
        try:
            _, outcome, seconds, message = results.get(timeout=limit + 60)
        except queue.Empty:
            outcome, seconds, message = "no result", float("nan"), ""
        for p in procs:
            p.join(timeout=limit + 10)
            if p.is_alive():
                p.kill()
    released = outcome == "raised" and seconds < limit
    text = message.split("] ", 1)[-1].split(". This is")[0][:70] if message else ""
    return {
        "case": case,
        "what": CASES[case],
        "rank 0": outcome,
        "after (s)": seconds,
        "released by the case": released,
        "message": text,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--limit", type=float, default=8.0, help="seconds rank 1 stays alive after its action")
    args = ap.parse_args()
    from benchmarks._common import print_table

    rows = [_run(case, args.limit) for case in CASES]
    print_table(f"a gloo rank blocked in all_gather, peer stays alive {args.limit:g} s unless killed", rows, ".2f")


if __name__ == "__main__":
    main()
