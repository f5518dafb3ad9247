"""Keys a rank needs from other ranks against the all-gather, and the work balance, on packed length mixes.

Batches: one row of ``T`` tokens packed with documents of log-normal lengths (``sigma`` 1.0, mean ``--means``;
the last document cut to fit), ``--batches`` batches per setting from ``random.Random(seed)`` with seeds
``0..batches-1``. For each batch, CP size and layout:

* work: the slowest rank's computed (query, key) pairs over the mean rank's (``CPPlan.work``, the block kernel's
  measure, block 128, one full-attention layer over packed documents);
* keys: the keys all ranks need from other ranks (``CPPlan.keys_needed``, full attention, packed documents), as a
  share of the keys the all-gather moves (``N * (N - 1) * c``), summed over ranks and for the rank that needs most
  (the selective exchange's receive buffer must hold that rank's keys);
* layout cost: the time ``build_plan`` takes for the batch (CPU, one thread), best of 3.

Layouts: ``contiguous``, ``balanced`` (fewest runs within 0.5% of the best work) and ``balanced`` with
``Workload(split_keys=True)`` (fewest split keys within 5% of the best work and 4% of perfectly even work).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks._common import lognormal_doc_lens, print_table
from cpcompile.plan import Workload, build_plan
from cpcompile.testing import packed_batch

LAYOUTS = {
    "contiguous": ("contiguous", Workload()),
    "balanced": ("balanced", Workload()),
    "balanced+split_keys": ("balanced", Workload(split_keys=True)),
}


def measure(docs: list[list[int]], N: int, layout: str, workload: Workload) -> dict:
    batch = packed_batch(docs)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        plan = build_plan(batch, N, 0, layout=layout, workload=workload)
        times.append(time.perf_counter() - t0)
    work = [plan.work(Workload(), r) for r in range(N)]
    needed = [len(plan.keys_needed(None, r)) for r in range(N)]
    gathered = (N - 1) * plan.chunk_len
    return {
        "work": max(work) * N / sum(work),
        "keys": sum(needed) / (N * gathered),
        "max keys": max(needed) / gathered,
        "ms": 1e3 * min(times),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--means", default="2048,8192", help="mean document lengths")
    ap.add_argument("--seqs", default="32768,131072", help="row lengths")
    ap.add_argument("--cps", default="4,8", help="CP sizes")
    ap.add_argument("--batches", type=int, default=8, help="batches per (mean, length), seeds 0..batches-1")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for mean in (int(m) for m in args.means.split(",")):
        for T in (int(t) for t in args.seqs.split(",")):
            batches = [[lognormal_doc_lens(T, mean, seed)] for seed in range(args.batches)]
            for N in (int(n) for n in args.cps.split(",")):
                for name, (layout, workload) in LAYOUTS.items():
                    got = [measure(docs, N, layout, workload) for docs in batches]
                    works = [g["work"] for g in got]
                    rows.append(
                        {
                            "mean len": mean,
                            "T": T,
                            "N": N,
                            "layout": name,
                            "work max/mean median": statistics.median(works),
                            "worst": max(works),
                            "share <= 1.05": sum(w <= 1.05 for w in works) / len(works),
                            "keys needed / all-gather": statistics.mean(g["keys"] for g in got),
                            "max rank keys / all-gather": max(g["max keys"] for g in got),
                            "layout ms": statistics.median(g["ms"] for g in got),
                        }
                    )
    print_table(
        f"one row of T tokens, log-normal document lengths (sigma 1.0), {args.batches} batches per (mean, T), "
        "seeds 0..; work: slowest/mean computed pairs (block 128); keys: needed from other ranks / all-gather "
        "(mean over batches; max rank: worst batch)",
        rows,
        floatfmt=".3f",
    )


if __name__ == "__main__":
    main()
