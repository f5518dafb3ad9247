"""How often a CPU training run dies in native code, on stock gloo (two worker threads per group) and on
``cpcompile.gloo_backend()`` (one), side by side.

The workload keeps several all-gathers of one CP group in flight at once, which is what lets two of them finish
together on stock gloo's two worker threads (``cpcompile.runtime.gloo``): transformers' tiny Qwen3 on its
flex_attention path, CP=4 processes on the machine's cores, one packed row of ``--seq`` tokens in documents of
256..1023 tokens, the balanced layout, aot_eager, ``--steps`` training steps. Each run spawns its own processes;
a run "died" when a rank ended with SIGABRT or SIGSEGV (glibc's "malloc(): unaligned tcache chunk detected",
"free(): invalid pointer", a segfault), and the table counts such runs. Runs alternate between the two backends,
so both see the same machine load.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import tempfile
import time

import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import packed_doc_lens, print_table  # noqa: E402

#: Exit codes of a process that died in native code.
NATIVE = {-signal.SIGABRT: "SIGABRT", -signal.SIGSEGV: "SIGSEGV"}


def _rank(rank: int, world: int, init_file: str, backend: str, seq: int, steps: int) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist

    import cpcompile
    from cpcompile.testing import packed_batch, tiny_model

    faulthandler.enable()
    torch.set_num_threads(1)
    name = cpcompile.gloo_backend() if backend == "cpcompile" else "gloo"
    dist.init_process_group(
        name, init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600)
    )
    model = tiny_model("qwen3", attn_implementation="flex_attention")
    batch = packed_batch(packed_doc_lens(seq, 1, 256, 1024))
    group = dist.new_group(list(range(world)))
    compiled = torch.compile(model, backend=cpcompile.backend(group, inner="aot_eager"))
    for _ in range(steps):
        with cpcompile.shard(batch, group, layout="balanced") as local:
            compiled(**local).loss.backward()
    dist.barrier()
    dist.destroy_process_group()


def run_once(backend: str, world: int, seq: int, steps: int, limit_s: float) -> tuple[str, float]:
    """One run in new processes: ``("ok" | "SIGABRT" | "SIGSEGV" | "exit N" | "timeout", seconds)``."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        start = time.perf_counter()
        procs = [
            ctx.Process(target=_rank, args=(r, world, init_file, backend, seq, steps), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = start + limit_s
        outcome = "ok"
        while any(p.is_alive() for p in procs):
            dead = [p.exitcode for p in procs if not p.is_alive() and p.exitcode != 0]
            if dead or time.perf_counter() > deadline:
                outcome = NATIVE.get(dead[0], f"exit {dead[0]}") if dead else "timeout"
                break
            time.sleep(0.2)
        else:
            bad = [p.exitcode for p in procs if p.exitcode != 0]
            outcome = NATIVE.get(bad[0], f"exit {bad[0]}") if bad else "ok"
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        return outcome, time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=8, help="runs per backend")
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--limit", type=float, default=900.0, help="seconds before a run counts as a timeout")
    args = parser.parse_args(argv)
    backends = ("gloo", "cpcompile")
    outcomes: dict[str, list[str]] = {b: [] for b in backends}
    seconds: dict[str, list[float]] = {b: [] for b in backends}
    for i in range(args.runs):
        for backend in backends:
            outcome, s = run_once(backend, args.cp, args.seq, args.steps, args.limit)
            outcomes[backend].append(outcome)
            seconds[backend].append(s)
            print(f"run {i + 1}/{args.runs} {backend}: {outcome} in {s:.0f} s", flush=True)
    rows = [
        {
            "backend": "stock gloo (2 worker threads)" if b == "gloo" else "cpcompile.gloo_backend() (1 thread)",
            "runs": len(outcomes[b]),
            "died in native code": sum(o in NATIVE.values() for o in outcomes[b]),
            "other failures": sum(o not in NATIVE.values() and o != "ok" for o in outcomes[b]),
            "outcomes": " ".join(outcomes[b]),
            "mean s per run": sum(seconds[b]) / len(seconds[b]),
        }
        for b in backends
    ]
    print_table(
        f"Runs that died in native code: Qwen3 flex_attention, CP={args.cp}, T={args.seq}, {args.steps} steps",
        rows,
        floatfmt=".0f",
    )


if __name__ == "__main__":
    main()
