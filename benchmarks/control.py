"""Cost of failing together and of the default batch check: control rounds, bytes and time per step per rank.

Three training steps of a tiny Qwen3 (2 attention sites), with the batch check (``shard``'s default) and
without it (``check_batch=False``), read from ``cpcompile.comm_stats()`` after each step, and the gloo
collectives the profiler saw on rank 0 in the step (equal to the K/V collectives when failing together adds
none). Control rounds go through the CP group's store, never through a collective of the group. Also the
latency of one control round (``failsafe.agree`` with an empty payload) on the store the spawned ranks use (a
FileStore; ``torchrun`` uses a TCPStore), the wall time of entering ``shard`` (no model) with and without the
check at several batch sizes (``--shard-sizes``), and the time of one model-mask check (the per-step comparison
of the model's mask with the plan, in one process) at several chunk lengths.
"""

from __future__ import annotations

import argparse

from benchmarks._common import print_table


def _shard_times(group, sizes: list[tuple[int, int]], reps: int) -> list[dict]:
    """Mean wall time (ms) of ``with shard(batch, group): pass`` with and without the batch check."""
    import time

    import cpcompile
    from benchmarks._common import packed_doc_lens
    from cpcompile.testing import packed_batch

    rows = []
    for B, T in sizes:
        batch = packed_batch(packed_doc_lens(T, B, 64, 2048), seed=0, vocab_size=32000)
        row = {"B": B, "T": T}
        for check in (False, True):
            for _ in range(2):  # warm-up (weights of the fingerprint, allocator)
                with cpcompile.shard(batch, group, check_batch=check, layout="contiguous"):
                    pass
            start = time.perf_counter()
            for _ in range(reps):
                with cpcompile.shard(batch, group, check_batch=check, layout="contiguous"):
                    pass
            row[f"check_batch={check} (ms)"] = (time.perf_counter() - start) / reps * 1e3
        row["check cost (ms)"] = row["check_batch=True (ms)"] - row["check_batch=False (ms)"]
        rows.append(row)
    return rows


def _mask_check_times(chunks: list[int], reps: int) -> list[dict]:
    """Time (ms) of one comparison of a model's [1, 1, c, c] mask with the plan's rule, one process."""
    import time

    import torch

    from cpcompile import ops
    from cpcompile.plan import build_plan
    from cpcompile.testing import packed_batch

    torch.set_num_threads(1)  # like each rank of a CP group on a shared CPU
    rows = []
    for c in chunks:
        plan = build_plan(packed_batch([[c, c]]), 2, 0, layout="contiguous")
        spec = ops.SiteSpec(
            site="bench",
            layer="bench",
            group_name="",
            cp_size=2,
            cp_rank=0,
            documents=True,
            window=None,
            kernel="dense",
            needs_grad=False,
        )
        mask = plan.local_rule_mask(documents=True)
        assert ops.mask_mismatch(spec, plan, mask) is None
        start = time.perf_counter()
        for _ in range(reps):
            ops.mask_mismatch(spec, plan, mask)
        row = {"chunk c": c, "mask check (ms, mean)": (time.perf_counter() - start) / reps * 1e3}
        start = time.perf_counter()
        for _ in range(reps):  # what a site whose document condition is assumed adds, on a fresh plan each step
            plan._cache.clear()
            plan.documents_in_blocks(None)
        row["documents_in_blocks (ms, mean)"] = (time.perf_counter() - start) / reps * 1e3
        rows.append(row)
    return rows


def _worker(rank: int, world_size: int, steps: int, rounds: int, sizes=(), reps: int = 0):
    import time

    import torch
    import torch.distributed as dist

    import cpcompile
    from cpcompile import failsafe
    from cpcompile.testing import packed_batch, tiny_model

    out = {}
    for check_batch in (True, False):
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
    out["shard"] = _shard_times(group, list(sizes), reps) if sizes else []
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cp", default="2,4")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--shard-sizes", default="2x64,1x8192,8x8192,1x131072", help="BxT batches timed in shard")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--mask-chunks", default="512,2048,8192")
    args = ap.parse_args()
    sizes = [tuple(int(v) for v in bt.split("x")) for bt in args.shard_sizes.split(",") if bt]
    from tests.harness.dist import run_distributed

    rows, latency, shard_rows = [], [], []
    for n in (int(x) for x in args.cp.split(",") if x):
        results = run_distributed(_worker, n, args.steps, args.rounds, sizes, args.reps, timeout_s=1200)
        for row in results[0]["shard"]:
            shard_rows.append({"CP": n, **row})
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
    if rows:  # --cp "": only the one-process table below
        print_table("control rounds per step per rank: tiny qwen3, 2 attention sites, B=2, T=64, aot_eager", rows)
        print_table("one control round through the store", latency)
        print_table(
            "entering cpcompile.shard (no model), rank 0, mean: the batch check's cost per step (contiguous layout)",
            shard_rows,
        )
    chunks = [int(c) for c in args.mask_chunks.split(",") if c]
    print_table("one model-mask check per step (B=1, one process)", _mask_check_times(chunks, 5))


if __name__ == "__main__":
    main()
