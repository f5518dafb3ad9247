"""Per-rank attention work of the layouts, side by side: the slowest rank's computed pairs over the mean rank's.

Work is what the block kernel computes: ``CPPlan.visible_blocks(block, block).computed_pairs()`` per rank (the
(query, key) pairs of the blocks it does not skip), summed over the model's layers. One table per run, with
the contiguous, head_tail and balanced layouts next to each other at N = 2, 4 and 8, on:

* one long document;
* the attention benchmark's packed documents (256..4096 tokens, ``benchmarks/attention.py``);
* many short documents (16..256 tokens) around one long one;
* a sliding-window model (every layer windowed) and a mixed one (5 sliding layers per full one, Gemma 3);
* the issue's example: CP=8, 8192 tokens in documents of 3000, 4000 and 1192.

``--sweep`` adds random packed batches (1-4 rows, 4k-16k tokens) and the balanced layout's distribution over
them for several run bounds (``MAX_RUNS``); ``--timing`` the time ``build_plan`` takes per batch.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from benchmarks._common import packed_doc_lens, print_table
from cpcompile import layouts as balance_module
from cpcompile.plan import AttentionForm, Workload, build_plan, count_runs
from cpcompile.testing import packed_batch

LAYOUTS = ("contiguous", "head_tail", "balanced")


def work_per_rank(plan, workload: Workload) -> list[int]:
    return [plan.work(workload, r) for r in range(plan.cp_size)]


def max_over_mean(work: list[int]) -> float:
    return max(work) * len(work) / sum(work)


def slowest_per_layer(plan, workload: Workload) -> float:
    """Sum over layers of the slowest rank's work / sum over layers of the mean rank's work (per-layer sync)."""
    slow = mean = 0.0
    for f in workload.forms:
        one = Workload(forms=(AttentionForm(f.documents, f.window),), block_size=workload.block_size)
        w = work_per_rank(plan, one)
        slow += f.layers * max(w)
        mean += f.layers * sum(w) / len(w)
    return slow / mean


def cases(seq: int) -> dict[str, list[list[int]]]:
    short = packed_doc_lens(seq - seq // 2, 1, 16, 256, seed=1)[0]
    return {
        "one document": [[seq]],
        "packed 256..4096": packed_doc_lens(seq, 1, 256, 4096),
        "short + one long + short": [short[: len(short) // 2] + [seq // 2] + short[len(short) // 2 :]],
    }


def main_table(seq: int, block: int, window: int) -> None:
    rows = []
    full = Workload(block_size=block)
    sliding = Workload(forms=(AttentionForm(window=window),), block_size=block)
    mixed = Workload(forms=(AttentionForm(layers=1), AttentionForm(window=window, layers=5)), block_size=block)
    runs = [(name, docs, full) for name, docs in cases(seq).items()]
    runs.append((f"packed 256..4096, sliding window {window}", cases(seq)["packed 256..4096"], sliding))
    runs.append((f"packed 256..4096, 5 sliding ({window}) : 1 full", cases(seq)["packed 256..4096"], mixed))
    for name, docs, workload in runs:
        batch = packed_batch(docs)
        for n in (2, 4, 8):
            row = {"case": name, "N": n}
            for layout in LAYOUTS:
                plan = build_plan(batch, n, 0, layout=layout, workload=workload)
                ratio = slowest_per_layer(plan, workload)
                row[layout] = ratio
                if layout == "balanced":
                    row["balanced runs"] = int(count_runs(plan.indices).max())
            rows.append(row)
    print_table(
        f"slowest rank / mean rank of the block kernel's computed (query, key) pairs: T={seq}, B=1, block {block}; "
        "mixed: sum over layers of the slowest rank / sum of the mean",
        rows,
        floatfmt=".3f",
    )


def issue_example(block: int) -> None:
    """The issue's numbers: CP=8, 8192 tokens in documents 3000, 4000, 1192 (visible and computed pairs)."""
    batch = packed_batch([[3000, 4000, 1192]])
    rows = []
    for layout in LAYOUTS:
        plan = build_plan(batch, 8, 0, layout=layout, workload=Workload(block_size=block))
        visible = [plan.visible_pairs(rank=r) for r in range(8)]
        computed = work_per_rank(plan, Workload(block_size=block))
        rows.append(
            {
                "layout": layout,
                "visible pairs min": min(visible),
                "visible pairs max": max(visible),
                "visible max/mean": max_over_mean(visible),
                "computed max/mean": max_over_mean(computed),
                "runs": int(count_runs(plan.indices).max()),
            }
        )
    print_table(f"CP=8, T=8192, documents 3000,4000,1192, one attention layer, block {block}", rows, floatfmt=".3f")


def random_rows(rng: random.Random) -> list[list[int]]:
    T = rng.choice([4096, 8192, 16384]) + rng.randrange(0, 3) * rng.randrange(1, 100)
    B = rng.choice([1, 1, 2, 4])
    kind = rng.choice(["uniform", "long + short", "few"])
    docs = []
    for _ in range(B):
        if kind == "uniform":
            lo, hi = rng.choice([16, 64, 256]), rng.choice([512, 2048, T])
            docs.append(packed_doc_lens(T, 1, lo, max(hi, lo + 1), seed=rng.randrange(1000))[0])
        elif kind == "few":
            cuts = sorted(rng.sample(range(1, T), rng.randrange(0, 4)))
            bounds = [0, *cuts, T]
            docs.append([b - a for a, b in zip(bounds, bounds[1:])])
        else:
            long = rng.randrange(T // 4, T)
            short = packed_doc_lens(T - long, 1, 8, 300, seed=rng.randrange(1000))[0] if T > long else []
            at = rng.randrange(0, len(short) + 1)
            docs.append(short[:at] + [long] + short[at:])
    return docs


def sweep(count: int, block: int, bounds: list[int]) -> None:
    rng = random.Random(0)
    batches = [random_rows(rng) for _ in range(count)]
    rows = []
    real = balance_module.MAX_RUNS
    try:
        for bound in bounds:
            balance_module.MAX_RUNS = bound  # the run bound the balancer enforces (not the plan's constant)
            for name, window in (("causal", None), ("sliding 1024", 1024)):
                workload = Workload(forms=(AttentionForm(window=window),), block_size=block)
                ratios = []
                for docs in batches:
                    batch = packed_batch(docs)
                    for n in (2, 4, 8):
                        plan = build_plan(batch, n, 0, layout="balanced", workload=workload)
                        ratios.append(max_over_mean(work_per_rank(plan, workload)))
                ratios.sort()
                rows.append(
                    {
                        "runs per rank at most": bound,
                        "work": name,
                        "batches x N": len(ratios),
                        "median": statistics.median(ratios),
                        "90%": ratios[int(0.9 * len(ratios))],
                        "99%": ratios[int(0.99 * len(ratios))],
                        "worst": ratios[-1],
                        "share <= 1.05": sum(r <= 1.05 for r in ratios) / len(ratios),
                    }
                )
    finally:
        balance_module.MAX_RUNS = real
    print_table(
        f"balanced layout over {count} random packed batches (1-4 rows of 4k-16k tokens, N = 2, 4, 8, block "
        f"{block}): slowest rank / mean rank by the bound on runs per rank",
        rows,
        floatfmt=".3f",
    )


def timing(block: int) -> None:
    rows = []
    for seq in (8192, 32768, 131072):
        batch = packed_batch(packed_doc_lens(seq, 2, 256, 16384, seed=2))
        for layout in LAYOUTS:
            build_plan(batch, 8, 0, layout=layout, workload=Workload(block_size=block))  # warm-up
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                build_plan(batch, 8, 0, layout=layout, workload=Workload(block_size=block))
                times.append(time.perf_counter() - t0)
            rows.append({"T": seq, "B": 2, "N": 8, "layout": layout, "build_plan (ms)": 1e3 * min(times)})
    print_table(f"time to build a plan on the CPU (1 thread), documents 256..16384, block {block}", rows, ".3g")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--window", type=int, default=1024, help="sliding window of the windowed models")
    ap.add_argument("--sweep", type=int, default=0, metavar="BATCHES", help="random batches (0: no sweep)")
    ap.add_argument("--bounds", default="2,3,4,6", help="run bounds compared in the sweep")
    ap.add_argument("--timing", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    main_table(args.seq, args.block, args.window)
    issue_example(args.block)
    if args.sweep:
        sweep(args.sweep, args.block, [int(b) for b in args.bounds.split(",")])
    if args.timing:
        timing(args.block)


if __name__ == "__main__":
    main()
