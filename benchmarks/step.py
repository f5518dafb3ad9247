"""Tokens/s of a training step (forward+backward): cpcompile with inductor vs with aot_eager vs the unsharded
eager model, CP=1/2/4, measured side by side in one run; also layouts (``--layouts``) and full-attention K/V
exchanges (``--exchanges all_gather,selective``) side by side, and the K/V bytes each rank received per step.
``--attn-implementation flex_attention`` runs transformers' flex path on the CP side (the unsharded eager row runs
SDPA with the same weights and mask: CPU flex has no backward).

Each rank is a CPU process (gloo, one thread); the step time is the slowest rank's median over the timed steps,
after warm-up steps that compile. Tokens/s counts the global tokens of the batch (B * T).
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks._common import packed_doc_lens, print_table


def _worker(
    rank: int,
    world_size: int,
    inner: str,
    attention: str,
    doc_lens: list,
    steps: int,
    layout: str,
    exchange: str = "all_gather",
    attn_implementation: str = "sdpa",
):
    import torch
    import torch.distributed as dist

    import cpcompile
    from cpcompile.testing import packed_batch, tiny_model

    model = tiny_model("qwen3", attn_implementation="sdpa" if inner == "unsharded eager" else attn_implementation)
    batch = packed_batch(doc_lens)
    if inner == "unsharded eager":

        def step():
            model(**batch, use_cache=False).loss.backward()

        barrier = lambda: None  # noqa: E731
    else:
        group = dist.new_group(list(range(world_size)))
        backend = cpcompile.backend(group, inner=inner, attention=attention, exchange=exchange)
        compiled = torch.compile(model, backend=backend)

        def step():
            with cpcompile.shard(batch, group, layout=layout) as local:
                compiled(**local).loss.backward()

        barrier = lambda: dist.barrier(group)  # noqa: E731
    t0 = time.perf_counter()
    step()
    step()
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        barrier()
        t0 = time.perf_counter()
        step()
        barrier()
        times.append(time.perf_counter() - t0)
    received = 0
    if inner != "unsharded eager":
        comm = cpcompile.comm_stats()
        received = comm.all_gather_bytes + comm.halo_bytes
    return statistics.median(times), compile_s, received


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--docs", default="64,1024", help="document length range lo,hi of the packed rows")
    ap.add_argument("--cp", default="1,2,4")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--layouts", default="balanced", help="shard's layouts, side by side (e.g. contiguous,balanced)")
    ap.add_argument("--inners", default="inductor,aot_eager", help="inner compilers, side by side")
    ap.add_argument("--exchanges", default="all_gather", help="K/V exchanges of full attention, side by side")
    ap.add_argument("--attn-implementation", default="sdpa", choices=("sdpa", "flex_attention"))
    args = ap.parse_args()
    from tests.harness.dist import run_distributed

    lo, hi = (int(x) for x in args.docs.split(","))
    doc_lens = packed_doc_lens(args.seq, args.batch, lo, hi)
    tokens = args.seq * args.batch
    rows = []
    eager_s, _, _ = run_distributed(
        _worker, 1, "unsharded eager", args.attention, doc_lens, args.steps, "contiguous", timeout_s=900
    )[0]
    rows.append(
        {
            "CP": 1,
            "model": "unsharded eager",
            "layout": "-",
            "exchange": "-",
            "step (ms)": 1e3 * eager_s,
            "tokens/s": tokens / eager_s,
            "vs unsharded eager": 1.0,
            "warm-up incl. compile (s)": 0.0,
            "K/V MiB received (max rank)": 0.0,
        }
    )
    inners, layouts, exchanges = (v.split(",") for v in (args.inners, args.layouts, args.exchanges))
    variants = [(i, lay, x) for i in inners for lay in layouts for x in exchanges]
    for n in (int(x) for x in args.cp.split(",")):
        for inner, layout, exchange in variants:
            res = run_distributed(
                _worker,
                n,
                inner,
                args.attention,
                doc_lens,
                args.steps,
                layout,
                exchange,
                args.attn_implementation,
                timeout_s=900,
            )
            step_s = max(r[0] for r in res)
            rows.append(
                {
                    "CP": n,
                    "model": f"cpcompile inner={inner}",
                    "layout": layout,
                    "exchange": exchange,
                    "step (ms)": 1e3 * step_s,
                    "tokens/s": tokens / step_s,
                    "vs unsharded eager": eager_s / step_s,
                    "warm-up incl. compile (s)": max(r[1] for r in res),
                    "K/V MiB received (max rank)": max(r[2] for r in res) / 2**20,
                }
            )
    print_table(
        f"training step throughput: tiny qwen3 (2 layers, hidden 64, {args.attn_implementation}), B={args.batch}, "
        f"T={args.seq}, documents "
        f"{lo}..{hi} tokens, attention={args.attention}, 1 thread per rank",
        rows,
    )


if __name__ == "__main__":
    main()
