"""Forward+backward time per rank of the CP attention op, by layout (and dense vs block path), and the work.

For CP size N, rank r runs the op on its c = T/N queries against all T keys; the time of a CP step is the
slowest rank's. "whole" is the same op on the whole sequence in one process (N=1), timed at the start and
again at the end of the run (the faster of the two). Layouts (contiguous,
head_tail, balanced) side by side; computed pairs max/mean is the block kernel's work of the slowest rank
over the mean rank. One thread per rank.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks._common import packed_doc_lens, print_table
from cpcompile.kernels import cp_attention, dense_cp_attention
from cpcompile.plan import Workload, build_plan
from cpcompile.testing import packed_batch


def _time(fn, repeats: int) -> float:
    """Best of ``repeats`` runs after one warm-up."""
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seq", type=int, default=8192, help="global tokens per row")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--docs", default="256,4096", help="document length range lo,hi of the packed row")
    ap.add_argument("--cp", default="1,2,4")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--layouts", default="contiguous,head_tail,balanced", help="the plans' layouts, side by side")
    ap.add_argument("--paths", default="block", help="attention paths: block, dense or both (dense,block)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lo, hi = (int(x) for x in args.docs.split(","))
    batch = packed_batch(packed_doc_lens(args.seq, 1, lo, hi))
    g = torch.Generator().manual_seed(0)
    D, H, Hkv = args.head_dim, args.heads, args.kv_heads
    paths = args.paths.split(",")
    workload = Workload(block_size=args.block)
    rows, whole, again = [], {}, {}
    for n in (int(x) for x in args.cp.split(",")):
        for layout in args.layouts.split(",") if n > 1 else ["contiguous"]:
            plans = [build_plan(batch, n, r, layout=layout, workload=workload) for r in range(n)]
            T = plans[0].padded_len
            k = torch.randn(1, Hkv, T, D, generator=g, requires_grad=True)
            v = torch.randn(1, Hkv, T, D, generator=g, requires_grad=True)
            times = {path: [] for path in paths}
            computed, visible = [], 0
            for plan in plans:
                q = torch.randn(1, H, plan.chunk_len, D, generator=g, requires_grad=True)
                dout = torch.randn(1, H, plan.chunk_len, D, generator=g)
                pos = (plan.token_indices(), plan.gathered_indices(), plan.doc_ids)  # k, v: all-gathered order

                def dense(q=q, pos=pos, dout=dout):
                    torch.autograd.grad(dense_cp_attention(q, k, v, *pos, enable_gqa=True), (q, k, v), dout)

                def block(q=q, pos=pos, dout=dout):
                    out = cp_attention(q, k, v, *pos, enable_gqa=True, block_q=args.block, block_k=args.block)
                    torch.autograd.grad(out, (q, k, v), dout)

                for path in paths:
                    times[path].append(_time(dense if path == "dense" else block, args.repeats))
                    if n == 1:
                        again[path] = dense if path == "dense" else block
                computed.append(plan.visible_blocks(args.block, args.block).computed_pairs())
                visible += plan.visible_pairs()
            for path in paths:
                slowest = max(times[path])
                whole.setdefault(path, slowest)
                rows.append(
                    {
                        "CP": n,
                        "layout": layout if n > 1 else "(whole)",
                        "path": path,
                        "slowest rank fwd+bwd (s)": slowest,
                        "mean rank (s)": sum(times[path]) / n,
                        "speedup vs whole": whole[path] / slowest,
                        "speedup / N": whole[path] / slowest / n,
                        "computed pairs max/mean": max(computed) * n / sum(computed),
                        "computed/visible": (sum(computed) if path == "block" else n * plans[0].chunk_len * T)
                        / visible,
                    }
                )
    # the machine's load changes during a run: time the whole sequence once more at the end, keep the faster
    for path, fn in again.items():
        best = min(whole[path], _time(fn, args.repeats))
        for row in rows:
            if row["path"] == path:
                if row["CP"] == 1:
                    row["slowest rank fwd+bwd (s)"] = row["mean rank (s)"] = best
                row["speedup vs whole"] = best / row["slowest rank fwd+bwd (s)"]
                row["speedup / N"] = row["speedup vs whole"] / row["CP"]
    print_table(
        f"attention op fwd+bwd per rank: T={args.seq}, B=1, heads {H}/{Hkv} kv, head dim {D}, documents "
        f"{lo}..{hi} tokens, block {args.block}, 1 thread",
        rows,
    )


if __name__ == "__main__":
    main()
