"""Bytes all-gathered per step per rank by the CP attention vs the theoretical minimum, for a GQA model.

The minimum is, per layer, (N-1) chunks of the un-expanded K and V: layers * 2 * (N-1) * B * Hkv * c * D *
bytes. Measured with cpcompile.comm_stats() over one forward+backward step. A ratio of n_rep (query heads per
KV head) means K/V are gathered after transformers' repeat_kv expansion.
"""

from __future__ import annotations

import argparse

from benchmarks._common import packed_doc_lens, print_table


def _worker(rank: int, world_size: int, seq: int, heads: int, kv_heads: int, layers: int):
    import torch
    import torch.distributed as dist

    import cpcompile
    from cpcompile.testing import packed_batch, tiny_model

    model = tiny_model("qwen3", num_attention_heads=heads, num_key_value_heads=kv_heads, num_hidden_layers=layers)
    group = dist.new_group(list(range(world_size)))
    compiled = torch.compile(model, backend=cpcompile.backend(group, inner="aot_eager"))
    batch = packed_batch(packed_doc_lens(seq, 2, 16, 128))
    with cpcompile.shard(batch, group) as local:
        compiled(**local).loss.backward()
        plan = cpcompile.current_plan()
    stats = cpcompile.comm_stats()
    head_dim = model.config.head_dim
    minimum = layers * 2 * (world_size - 1) * plan.batch_size * kv_heads * plan.chunk_len * head_dim * 4
    return dict(
        gathered=stats.all_gather_bytes,
        scattered=stats.reduce_scatter_bytes,
        minimum=minimum,
        gathers=stats.all_gathers,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--cp", default="2,4")
    args = ap.parse_args()
    from tests._dist import run_distributed

    rows = []
    for n in (int(x) for x in args.cp.split(",")):
        res = run_distributed(_worker, n, args.seq, args.heads, args.kv_heads, args.layers)[0]
        rows.append(
            {
                "CP": n,
                "all-gathers": res["gathers"],
                "gathered bytes/rank": res["gathered"],
                "minimum bytes/rank": res["minimum"],
                "gathered/minimum": res["gathered"] / res["minimum"],
                "reduce-scattered/minimum": res["scattered"] / res["minimum"],
            }
        )
    print_table(
        f"K/V bytes per step per rank: qwen3 {args.layers} layers, {args.heads} query / {args.kv_heads} KV heads "
        f"(n_rep {args.heads // args.kv_heads}), head dim 16, B=2, T={args.seq}, fp32",
        rows,
    )


if __name__ == "__main__":
    main()
