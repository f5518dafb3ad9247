"""Bytes each rank sends per forward step, by layer kind, measured by the profiler, against the minimum.

The byte meter is independent of cpcompile's own accounting: ``torch.profiler`` records every gloo collective
with its input shape (``gloo:all_gather``: the local K or V chunk, sent to the N-1 other ranks; ``gloo:all_to_all``:
the halo rows sent). Minimums:

* full-attention layers keep the all-gather by design (every key before a query is visible, and the all-gather
  is one collective issued early): (N-1) chunks of the un-expanded K and V per layer;
* sliding-window layers: only the keys some local query can see that another rank holds (from the plan's dense
  mask, causal, same document, within the window), K and V.

Tables: a GQA model of full layers (all-gather); a Gemma-3-shaped model (5 sliding layers per full layer, a
window much shorter than a chunk) with the halo exchange next to all-gather everywhere (``halo=False``); and the
KV-head expansion spellings of model code outside transformers (tests/models/kv_heads.py).
"""

from __future__ import annotations

import argparse

from benchmarks._common import packed_doc_lens, print_table


def _forward_bytes(compiled, local, itemsize: int, cp_size: int) -> dict[str, int]:
    """Bytes this rank sends in the forward's gloo collectives, by collective, from the profiler."""
    import math

    import torch

    with torch.profiler.profile(record_shapes=True) as prof:
        out = compiled(**local)
    sent = {"gloo:all_gather": 0, "gloo:all_to_all": 0}
    for e in prof.events():
        if e.name in sent:
            numel = math.prod(e.input_shapes[0])
            sent[e.name] += numel * itemsize * ((cp_size - 1) if e.name == "gloo:all_gather" else 1)
    out.loss.backward()
    return sent


def _seen_elsewhere(plan, window) -> int:
    """Keys (summed over rows) other ranks hold that some query of this rank sees (from the dense mask)."""
    mask = plan.mask(documents=True, window=window)[:, 0]  # [B, c, T_pad], keys in token order
    seen = mask.any(dim=1)  # [B, T_pad]
    seen[:, plan.token_indices()] = False
    return int(seen.sum())


def _gqa_worker(rank: int, world_size: int, seq: int, heads: int, kv_heads: int, layers: int):
    import torch
    import torch.distributed as dist

    import cpcompile
    from cpcompile.testing import packed_batch, tiny_model

    model = tiny_model("qwen3", num_attention_heads=heads, num_key_value_heads=kv_heads, num_hidden_layers=layers)
    group = dist.group.WORLD
    compiled = torch.compile(model, backend=cpcompile.backend(group, inner="aot_eager"))
    batch = packed_batch(packed_doc_lens(seq, 2, 16, 128))
    with cpcompile.shard(batch, group) as local:
        sent = _forward_bytes(compiled, local, 4, world_size)
        plan = cpcompile.runtime.current_plan()
    per_layer = 2 * (world_size - 1) * plan.batch_size * kv_heads * plan.chunk_len * model.config.head_dim * 4
    return {"sent": sent["gloo:all_gather"], "minimum": layers * per_layer, "stats": cpcompile.comm_stats()}


def _gemma_worker(rank: int, world_size: int, seq: int, window: int, halo: bool):
    import torch
    import torch.distributed as dist

    import cpcompile
    from cpcompile.testing import packed_batch, tiny_model

    kinds = ["sliding_attention"] * 5 + ["full_attention"]
    model = tiny_model("gemma3", sliding_window=window, num_hidden_layers=6, layer_types=kinds)
    config = model.config
    group = dist.group.WORLD
    compiled = torch.compile(model, backend=cpcompile.backend(group, inner="aot_eager", config=config, halo=halo))
    batch = packed_batch(packed_doc_lens(seq, 1, seq // 8, seq // 2, seed=1))
    with cpcompile.shard(batch, group) as local:
        sent = _forward_bytes(compiled, local, 4, world_size)
        plan = cpcompile.runtime.current_plan()
    key_bytes = 2 * config.num_key_value_heads * config.head_dim * 4  # one token's K and V, fp32
    full_min = (world_size - 1) * plan.batch_size * plan.chunk_len * key_bytes
    sliding_min = 5 * _seen_elsewhere(plan, window) * key_bytes
    # with halo=False the sliding layers' all-gathers are in the all-gather total too
    sliding_sent = sent["gloo:all_to_all"] if halo else sent["gloo:all_gather"] - full_min
    return {
        "full": (sent["gloo:all_gather"] if halo else full_min, full_min),
        "sliding": (sliding_sent, sliding_min),
        "chunk": plan.chunk_len,
    }


def _spelling_worker(rank: int, world_size: int, seq: int):
    import torch
    import torch.distributed as dist

    import cpcompile
    from cpcompile.testing import packed_batch
    from tests.models.kv_heads import SPELLINGS, kv_heads_lm

    out = {}
    for spelling in SPELLINGS:
        torch._dynamo.reset()
        model = kv_heads_lm(spelling, heads=8, kv_heads=2, hidden=64)
        compiled = torch.compile(model, backend=cpcompile.backend(dist.group.WORLD, inner="aot_eager"))
        with cpcompile.shard(packed_batch(packed_doc_lens(seq, 1, 16, 128)), dist.group.WORLD) as local:
            sent = _forward_bytes(compiled, local, 4, world_size)
            plan = cpcompile.runtime.current_plan()
        minimum = 2 * 2 * (world_size - 1) * plan.chunk_len * 2 * 8 * 4  # 2 layers, K and V, 2 KV heads, dim 8
        out[spelling] = (sent["gloo:all_gather"], minimum)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seq", type=int, default=512, help="tokens per row of the GQA and spelling tables")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--sliding-seq", type=int, default=4096, help="tokens of the Gemma-3-shaped row")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--cp", default="2,4")
    args = ap.parse_args()
    from tests.harness.dist import run_distributed

    sizes = [int(x) for x in args.cp.split(",")]
    rows = []
    for n in sizes:
        res = run_distributed(_gqa_worker, n, args.seq, args.heads, args.kv_heads, args.layers)
        sent, minimum = sum(r["sent"] for r in res), sum(r["minimum"] for r in res)
        stats = res[0]["stats"]
        rows.append(
            {
                "CP": n,
                "sent/minimum (profiler)": sent / minimum,
                "received/minimum (comm_stats, rank 0)": stats.all_gather_bytes / res[0]["minimum"],
                "backward reduce-scattered/minimum (comm_stats)": stats.reduce_scatter_bytes / res[0]["minimum"],
            }
        )
    print_table(
        f"full-attention layers, K/V bytes per forward over all ranks: qwen3 {args.layers} layers, {args.heads} query "
        f"/ {args.kv_heads} KV heads (n_rep {args.heads // args.kv_heads}), head dim 16, B=2, T={args.seq}, fp32",
        rows,
    )

    rows = []
    for n in sizes:
        for halo in (True, False):
            res = run_distributed(_gemma_worker, n, args.sliding_seq, args.window, halo, timeout_s=900)
            for kind in ("sliding", "full"):
                sent, minimum = (sum(r[kind][i] for r in res) for i in (0, 1))
                rows.append(
                    {
                        "CP": n,
                        "chunk": res[0]["chunk"],
                        "sliding layers": "halo" if halo else "all-gather",
                        "layer kind": kind,
                        "sent bytes (all ranks)": sent,
                        "minimum bytes": minimum,
                        "sent/minimum": sent / minimum if minimum else float("nan"),
                    }
                )
    print_table(
        f"Gemma-3-shaped model (5 sliding layers of window {args.window} per full layer, 4/2 heads, head dim 16), "
        f"one packed row of T={args.sliding_seq}, forward K/V bytes by layer kind, profiler",
        rows,
    )

    res = run_distributed(_spelling_worker, 2, args.seq)
    rows = [
        {"spelling": spelling, "sent/minimum (profiler)": (res[0][spelling][0] + res[1][spelling][0]) / (2 * m)}
        for spelling, (_, m) in res[0].items()
    ]
    print_table(
        f"KV-head expansion spellings (tests/models/kv_heads.py: 8 query / 2 KV heads, head dim 8, 2 layers), CP=2, "
        f"T={args.seq}; 'tile' (repeat) is not grouped-query order and is gathered expanded",
        rows,
    )


if __name__ == "__main__":
    main()
