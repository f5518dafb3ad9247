"""Per-rank peak memory of one training step at a fixed global length: CP=1/2/4, dense vs block attention.

With ``--selective`` the variants are the block path with the all-gather and with ``exchange="selective"`` (a
receive buffer of ``exchange_slots`` keys, sized to the most this batch needs). With ``--sliding-window W`` the
model is Mistral-shaped (every layer a sliding window of W tokens) and the two
variants are the block path with the halo exchange (only the keys a rank's queries see arrive) and with the
all-gather of the whole sequence at every layer (``backend(..., halo=False)``).

Each rank is a CPU process (gloo, one thread). After a warm-up step (compilation), the peak resident set
(VmHWM) is reset and one more forward+backward step runs; the table shows the peak above the rank's resident
size just before that step, the largest over the ranks. glibc's malloc is told to return freed memory
(MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_) so that the baseline does not hide reused heap. CP=1 "dense"
is the unsharded model (its own SDPA and [T, T] mask); CP=1 "block" runs cp_attention without collectives.
CPU only (on CUDA the same comparison would read torch.cuda.max_memory_allocated).
"""

from __future__ import annotations

import argparse
import os

from benchmarks._common import print_table, row_doc_lens, step_peak_mib


def _worker(rank: int, world_size: int, options: dict, doc_lens: list, hidden: int, layers: int, window: int | None):
    import torch
    import torch.distributed as dist

    import cpcompile
    from cpcompile.testing import packed_batch, tiny_model

    heads = hidden // 16
    family, extra = ("qwen3", {}) if window is None else ("mistral", {"sliding_window": window})
    model = tiny_model(
        family,
        **extra,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        intermediate_size=2 * hidden,
        max_position_embeddings=65536,
    )
    group = dist.new_group(list(range(world_size)))
    compiled = torch.compile(model, backend=cpcompile.backend(group, inner="aot_eager", **options))
    batch = packed_batch(doc_lens)

    def step():
        with cpcompile.shard(batch, group) as local:
            out = compiled(**local)
            out.loss.backward()
        del out

    step()  # compile
    return step_peak_mib(step)


def _options(variant: str, window: int | None, slots: int) -> dict:
    """The backend options of one variant of the table."""
    if variant in ("dense", "block"):
        return {"attention": variant}
    if window is not None:
        return {"attention": "block", "halo": variant == "halo"}
    if variant == "selective":
        return {"attention": "block", "exchange": "selective", "exchange_slots": slots}
    return {"attention": "block"}


def _needed_slots(doc_lens: list, cp: int) -> int:
    """The most keys of other ranks any rank's queries see in this batch, under every layout ``shard`` may pick
    for a full-attention model (contiguous; balanced, also keeping documents whole), rounded up to 64 slots."""
    from cpcompile.plan import Workload, build_plan
    from cpcompile.testing import packed_batch

    batch = packed_batch(doc_lens)
    most = 0
    for layout, workload in (("contiguous", None), ("balanced", Workload()), ("balanced", Workload(split_keys=True))):
        kwargs = {} if workload is None else {"workload": workload}
        for rank in range(cp):
            plan = build_plan(batch, cp, rank, layout=layout, **kwargs)
            most = max(most, int(plan.needs(None).sum(-1).max()))
    return max(64, -(-most // 64) * 64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=64, help="hidden size (heads = hidden/16, kv heads = heads/2)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--docs", default="256,4096", help="document length range lo,hi of the packed row")
    ap.add_argument(
        "--lognormal-mean",
        type=int,
        help="documents of log-normal lengths with this mean (sigma 1.0 of the log, seed 0) instead of --docs",
    )
    ap.add_argument("--cp", default="1,2,4")
    ap.add_argument("--sliding-window", type=int, help="Mistral-shaped model with this window: halo vs all-gather")
    ap.add_argument(
        "--selective",
        action="store_true",
        help="full attention, block path: the all-gather vs exchange='selective' with a receive buffer of the keys "
        "this batch needs (exchange_slots: the most any rank needs under any layout shard may pick)",
    )
    args = ap.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.environ["MALLOC_TRIM_THRESHOLD_"] = "65536"
    from tests.harness.dist import run_distributed

    doc_lens, docs_text = row_doc_lens(args.seq, args.docs, args.lognormal_mean)
    window = args.sliding_window
    if args.selective:
        variants, column = ("all-gather", "selective"), "full-attention exchange"
    elif window is None:
        variants, column = ("dense", "block"), "attention"
    else:
        variants, column = ("all-gather", "halo"), "sliding-window exchange"
    rows, base = [], {}
    for n in (int(x) for x in args.cp.split(",")):
        slots = _needed_slots(doc_lens, n) if args.selective else 0
        for variant in variants:
            options = _options(variant, window, slots)
            peaks = run_distributed(_worker, n, options, doc_lens, args.hidden, args.layers, window, timeout_s=900)
            peak = max(peaks)
            row = {"CP": n, column: variant, "peak above baseline, max rank (MiB)": peak}
            if args.selective:  # the two exchanges side by side at each CP size
                base.setdefault(n, peak)
                row["exchange_slots"] = slots if variant == "selective" else "-"
                rows.append({**row, "ratio to the all-gather": peak / base[n]})
                continue
            base.setdefault(variant, peak)
            rows.append({**row, "ratio to CP=1 (same path)": peak / base[variant], "ideal 1/N": 1 / n})
    model = f"qwen3 hidden {args.hidden}" if window is None else f"mistral (window {window}) hidden {args.hidden}"
    print_table(
        f"per-rank peak memory of a training step: global T={args.seq}, B=1, {model}, {args.layers} layers, "
        f"{docs_text}, aot_eager",
        rows,
    )


if __name__ == "__main__":
    main()
