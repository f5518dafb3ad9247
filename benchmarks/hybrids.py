"""Hybrid (recurrent) models under CP: per-rank peak memory, step time and bytes of a training step, CP=1/2/4.

The model is a tiny hybrid of :data:`cpcompile.testing.HYBRID_FAMILIES` (``--family``: ``qwen3_next``, a gated
delta-net layer before an attention layer; ``bamba``, a Mamba2 layer before an attention layer; ``recurrent_gemma``,
an RG-LRU layer before an attention layer; ...), widened with
``--hidden`` so that the recurrent mixer dominates: the mixer's heads grow with the hidden size (key, value and SSD
head counts divisible by 4, so that CP=4 takes whole heads and groups), ``use_cache=False``. Under CP the mixer's
core runs head-parallel (:mod:`cpcompile.cores`: one all-to-all per exchanged tensor and direction) or, for the gated
delta rule, Mamba2's SSD and the RG-LRU, by state passing (``--recurrence state`` or ``heads``, the default;
``state,heads`` runs both, one row each), the causal conv before it takes a halo of ``kernel - 1`` tokens before
each of the rank's runs (:mod:`cpcompile.passes.mixing`: the rank's tokens and its halo, not the whole sequence),
and the attention layer gathers K/V.

Each rank is a CPU process (gloo, one thread). After two warm-up steps (compilation), the peak resident set (VmHWM)
is reset and one forward+backward step runs; the memory column is the peak above the rank's resident size just
before that step, the largest over the ranks (glibc's malloc is told to return freed memory, as in
``benchmarks/memory.py``). Then ``--steps`` more steps are timed; the step time is the slowest rank's median. The
CP=1 rows (``--baseline``, the first the base of the ratios) are the unsharded model under
``torch.compile(backend="aot_eager")`` (``plain``, the default: the model's own SDPA and mask) and/or cpcompile
with a group of one rank (``cpcompile``: the same attention path as under CP without collectives, the library's
core on the whole sequence); both are one process holding the whole sequence.

Bytes are this rank's forward bytes of the last step, from ``cpcompile.comm_stats()`` (the largest over the ranks):
the head-parallel all-to-alls (``heads_bytes``, received; and divided by the number of mixer layers), the state
summaries' all-gathers of state passing (``state_bytes``), the halo exchanges and sequence all-gathers of the mixing
ops outside attention (``sequence_halo_bytes`` and ``sequence_gather_bytes``: the causal conv's input, one or the
other) and the attention K/V all-gathers (``all_gather_bytes``). Backward moves the same bytes again in the reverse
exchanges (``heads_backward_bytes``, ``sequence_halo_backward_bytes`` or ``sequence_reduce_scatter_bytes``,
``reduce_scatter_bytes``). Next to them, computed from the config and not measured: what a naive CP would receive per
mixer layer by all-gathering the mixer's input (``(N - 1) / N * T * hidden * dtype bytes``: every rank runs the whole
mixer on the whole sequence), and by all-gathering the core's inputs instead (the same with the core's input
channels).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks._common import print_table, row_doc_lens, step_peak_mib


def _overrides(family: str, hidden: int, layers: int) -> dict:
    """Config fields of a ``family`` model of hidden size ``hidden``: heads of 16 (attention) and 32 (mixer),
    the mixer's head counts growing with ``hidden`` and divisible by 4."""
    heads = hidden // 16
    common = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "intermediate_size": 2 * hidden,
        "max_position_embeddings": 65536,
        "use_cache": False,
    }
    mixer_heads = max(4, hidden // 32)
    if family in ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid"):
        return {
            **common,
            "linear_num_key_heads": mixer_heads // 2 if mixer_heads >= 8 else 4,
            "linear_num_value_heads": mixer_heads,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
        }
    if family in ("bamba", "granitemoehybrid"):
        return {
            **common,
            "mamba_n_heads": 2 * hidden // 32,  # heads x head dim = expand x hidden
            "mamba_d_head": 32,
            "mamba_n_groups": 4,
            "mamba_d_state": 16,
            "mamba_expand": 2,
            "mamba_chunk_size": 64,
        }
    if family == "recurrent_gemma":  # the RG-LRU as wide as the hidden size, its attention's window the whole row
        return {**common, "lru_width": hidden, "attention_window_size": 65536}
    raise ValueError(
        f"no overrides for family {family!r}; known: qwen3_next, qwen3_5(_moe), olmo_hybrid, bamba, "
        "granitemoehybrid, recurrent_gemma"
    )


def _mixer_channels(config) -> tuple[int, int, int]:
    """(mixer layers, channels of the mixer's input, channels of its core's inputs) of ``config``."""
    types = list(getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None) or [])
    if hasattr(config, "lru_width"):  # RecurrentGemma: its block types cycle over the layers
        layers = sum(
            config.block_types[i % len(config.block_types)] == "recurrent" for i in range(config.num_hidden_layers)
        )
        return layers, config.hidden_size, 2 * config.lru_width + 1  # x, the gate, the reset flag
    if hasattr(config, "linear_num_value_heads"):
        layers = sum(t == "linear_attention" for t in types)
        key = config.linear_num_key_heads * config.linear_key_head_dim
        value = config.linear_num_value_heads * config.linear_value_head_dim
        return layers, config.hidden_size, 2 * key + value + 2 * config.linear_num_value_heads  # q, k, v, g, beta
    layers = sum(t in ("mamba", "linear_attention") for t in types)  # Bamba names its Mamba2 layers linear_attention
    inner = config.mamba_n_heads * config.mamba_d_head
    groups = 2 * config.mamba_n_groups * config.mamba_d_state
    return layers, config.hidden_size, inner + config.mamba_n_heads + groups  # x, dt, B, C


def _worker(
    rank: int,
    world_size: int,
    family: str,
    overrides: dict,
    doc_lens: list,
    steps: int,
    plain: bool,
    recurrence: str = "heads",
):
    import torch
    import torch.distributed as dist

    import cpcompile
    from cpcompile.testing import packed_batch, tiny_model

    model = tiny_model(family, **overrides)
    batch = packed_batch(doc_lens)
    if plain:
        compiled = torch.compile(model, backend="aot_eager")

        def step():
            out = compiled(**batch)
            out.loss.backward()
            del out

        barrier = lambda: None  # noqa: E731
    else:
        group = dist.new_group(list(range(world_size)))
        compiled = torch.compile(model, backend=cpcompile.backend(group, inner="aot_eager"))

        def step():
            with cpcompile.shard(batch, group, recurrence=recurrence) as local:
                out = compiled(**local)
                out.loss.backward()
            del out

        barrier = lambda: dist.barrier(group)  # noqa: E731

    step()  # compile
    step()
    peak = step_peak_mib(step, barrier)
    times = []
    for _ in range(steps):
        barrier()
        t0 = time.perf_counter()
        step()
        barrier()
        times.append(time.perf_counter() - t0)
    comm = {}
    if not plain:
        stats = cpcompile.comm_stats()
        comm = {
            "heads": stats.heads_bytes,
            "state": stats.state_bytes,
            "sequence": stats.sequence_gather_bytes + stats.sequence_halo_bytes,
            "kv": stats.all_gather_bytes,
        }
    return peak, statistics.median(times), comm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--family", default="qwen3_next", help="a family of cpcompile.testing.HYBRID_FAMILIES")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=256, help="hidden size (attention heads of 16, mixer heads of 32)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--docs", default="256,4096", help="document length range lo,hi of the packed row")
    ap.add_argument(
        "--lognormal-mean",
        type=int,
        help="documents of log-normal lengths with this mean (sigma 1.0 of the log, seed 0) instead of --docs",
    )
    ap.add_argument("--cp", default="1,2,4")
    ap.add_argument(
        "--recurrence",
        default="heads",
        help="shard(recurrence=...) of the CP>1 rows, comma-separated ('state', 'heads'): one row per CP size and mode",
    )
    ap.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up and the memory step")
    ap.add_argument(
        "--baseline",
        default="plain",
        help="CP=1 rows, comma-separated, the first the base of the ratios: 'plain' (the model under "
        "torch.compile(backend='aot_eager')) and/or 'cpcompile' (cpcompile with a group of one rank)",
    )
    args = ap.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.environ["MALLOC_TRIM_THRESHOLD_"] = "65536"
    from cpcompile.testing import tiny_config
    from tests.harness.dist import run_distributed

    doc_lens, docs_text = row_doc_lens(args.seq, args.docs, args.lognormal_mean)
    overrides = _overrides(args.family, args.hidden, args.layers)
    mixers, hidden_ch, core_ch = _mixer_channels(tiny_config(args.family, **overrides))
    dtype_bytes = 4
    mib = 2.0**20
    rows, base = [], None
    modes = args.recurrence.split(",")
    runs = [(int(x), False, mode) for x in args.cp.split(",") for mode in (modes if int(x) > 1 else modes[:1])]
    if runs and runs[0][0] == 1:  # the CP=1 rows, the first of them the base of the ratios
        runs[:1] = [(1, b == "plain", modes[0]) for b in args.baseline.split(",")]
    for n, plain, mode in runs:
        res = run_distributed(
            _worker, n, args.family, overrides, doc_lens, args.steps, plain, mode, timeout_s=1800, fresh=True
        )
        peak = max(r[0] for r in res)
        step_s = max(r[1] for r in res)
        base = base or (peak, step_s)
        comm = [r[2] for r in res]
        heads = max((c.get("heads", 0) for c in comm), default=0)
        naive = (n - 1) / n * args.seq * dtype_bytes
        rows.append(
            {
                "CP": n,
                "run": "torch.compile aot_eager"
                if plain
                else "cpcompile" + (", 1 rank" if n == 1 else f", recurrence={mode}"),
                "peak MiB (max rank)": peak,
                "peak / CP=1": peak / base[0],
                "1/N": 1 / n,
                "step s (slowest rank)": step_s,
                "step / CP=1": step_s / base[1],
                "measured: all-to-all MiB": heads / mib,
                "measured: all-to-all MiB / mixer layer": heads / max(mixers, 1) / mib,
                "measured: state gather MiB": max((c.get("state", 0) for c in comm), default=0) / mib,
                "measured: conv halo or gather MiB": max((c.get("sequence", 0) for c in comm), default=0) / mib,
                "measured: K/V gather MiB": max((c.get("kv", 0) for c in comm), default=0) / mib,
                "computed: naive gather of mixer input MiB / layer": naive * hidden_ch / mib,
                "computed: naive gather of core inputs MiB / layer": naive * core_ch / mib,
            }
        )
    print_table(
        f"hybrid model under CP, one training step: {args.family}, global T={args.seq}, B=1, hidden {args.hidden}, "
        f"{args.layers} layers ({mixers} mixer), {docs_text}, aot_eager, forward bytes received per rank",
        rows,
    )


if __name__ == "__main__":
    main()
