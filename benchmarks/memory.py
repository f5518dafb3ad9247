"""Per-rank peak memory of one training step at a fixed global length: CP=1/2/4, dense vs block attention.

With ``--sliding-window W`` the model is Mistral-shaped (every layer a sliding window of W tokens) and the two
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
import gc
import os

from benchmarks._common import packed_doc_lens, print_table


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _worker(rank: int, world_size: int, variant: str, doc_lens: list, hidden: int, layers: int, window: int | None):
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
    options = {"attention": variant} if window is None else {"attention": "block", "halo": variant == "halo"}
    compiled = torch.compile(model, backend=cpcompile.backend(group, inner="aot_eager", **options))
    batch = packed_batch(doc_lens)

    def step():
        with cpcompile.shard(batch, group) as local:
            out = compiled(**local)
            out.loss.backward()
        del out

    step()  # compile
    gc.collect()
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    step()
    peak = _status_kib("VmHWM")
    return (peak - before) / 1024.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=64, help="hidden size (heads = hidden/16, kv heads = heads/2)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--docs", default="256,4096", help="document length range lo,hi of the packed row")
    ap.add_argument("--cp", default="1,2,4")
    ap.add_argument("--sliding-window", type=int, help="Mistral-shaped model with this window: halo vs all-gather")
    args = ap.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.environ["MALLOC_TRIM_THRESHOLD_"] = "65536"
    from tests.harness.dist import run_distributed

    lo, hi = (int(x) for x in args.docs.split(","))
    doc_lens = packed_doc_lens(args.seq, 1, lo, hi)
    window = args.sliding_window
    variants = ("dense", "block") if window is None else ("all-gather", "halo")
    rows, base = [], {}
    for n in (int(x) for x in args.cp.split(",")):
        for variant in variants:
            peaks = run_distributed(_worker, n, variant, doc_lens, args.hidden, args.layers, window, timeout_s=900)
            peak = max(peaks)
            base.setdefault(variant, peak)
            rows.append(
                {
                    "CP": n,
                    "attention" if window is None else "sliding-window exchange": variant,
                    "peak above baseline, max rank (MiB)": peak,
                    "ratio to CP=1 (same path)": peak / base[variant],
                    "ideal 1/N": 1 / n,
                }
            )
    model = f"qwen3 hidden {args.hidden}" if window is None else f"mistral (window {window}) hidden {args.hidden}"
    print_table(
        f"per-rank peak memory of a training step: global T={args.seq}, B=1, {model}, {args.layers} layers, "
        f"documents {lo}..{hi} tokens, aot_eager",
        rows,
    )


if __name__ == "__main__":
    main()
