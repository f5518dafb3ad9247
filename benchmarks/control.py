"""Cost of failing together: control rounds and bytes per step per rank, next to the K/V collectives.

Three training steps of a tiny Qwen3 (2 attention sites), without and with ``shard(check_batch=True)``, read
from ``cpcompile.comm_stats()`` after each step, and the gloo collectives the profiler saw on rank 0 in the
step (equal to the K/V collectives when failing together adds none). Control rounds go through the CP group's
store, never through a collective of the group. Also the latency of one control round (``failsafe.agree`` with
an empty payload) on the store the spawned ranks use (a FileStore; ``torchrun`` uses a TCPStore).
"""

from __future__ import annotations

import argparse

from benchmarks._common import print_table


def _worker(rank: int, world_size: int, steps: int, rounds: int):
    import time

    import torch
    import torch.distributed as dist

    import cpcompile
    from cpcompile import failsafe
    from cpcompile.testing import packed_batch, tiny_model

    out = {}
    for check_batch in (False, True):
        group = dist.new_group(list(range(world_size)))
        torch._dynamo.reset()
        compiled = torch.compile(tiny_model("qwen3"), backend=cpcompile.backend(group, inner="aot_eager"))
        per_step = []
        for step in range(steps):
            batch = packed_batch([[40, 24], [30, 34]], seed=step)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                with cpcompile.shard(batch, group, check_batch=check_batch) as local:
                    compiled(**local).loss.backward()
            gloo = sum(1 for e in prof.events() if e.name.startswith("gloo:"))
            per_step.append((cpcompile.comm_stats(), gloo))
        out[check_batch] = per_step
    group = dist.new_group(list(range(world_size)))
    failsafe.agree(group, "bench", None, what="a benchmark round")  # the first round also posts the hello
    start = time.perf_counter()
    for _ in range(rounds):
        failsafe.agree(group, "bench", None, what="a benchmark round")
    out["round_ms"] = (time.perf_counter() - start) / rounds * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cp", default="2,4")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    from tests._dist import run_distributed

    rows, latency = [], []
    for n in (int(x) for x in args.cp.split(",")):
        results = run_distributed(_worker, n, args.steps, args.rounds, timeout_s=600)
        for check_batch in (False, True):
            for step in range(args.steps):
                stats = [r[check_batch][step][0] for r in results]
                gloo = results[0][check_batch][step][1]
                b = [s.control_bytes for s in stats]
                rows.append(
                    {
                        "CP": n,
                        "check_batch": check_batch,
                        "step": step + 1,
                        "K/V collectives (fwd+bwd)": stats[0].all_gathers + stats[0].reduce_scatters,
                        "gloo collectives (profiler)": gloo,
                        "control rounds": stats[0].control_rounds,
                        "control bytes/rank (min..max)": f"{min(b)}..{max(b)}",
                    }
                )
        latency.append({"CP": n, f"control round latency (ms, rank 0, mean of {args.rounds})": results[0]["round_ms"]})
    print_table("control rounds per step per rank: tiny qwen3, 2 attention sites, B=2, T=64, aot_eager", rows)
    print_table("one control round through the store", latency)


if __name__ == "__main__":
    main()
