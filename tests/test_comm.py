"""Communication of the rewritten attention: KV-head gathers, their placement, and exact byte counts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpcompile import _compat
from cpcompile.plan import visible_mask
from cpcompile.testing import packed_batch, tiny_config, tiny_model
from tests._dist import run_distributed
from tests._graphs import run_pass

FAMILIES = ["llama", "qwen3"]


def _capture(family: str, **kw) -> torch.fx.GraphModule:
    """The Dynamo graph of a tiny model's training call (no pass applied)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model = tiny_model(family)
    batch = packed_batch([[10, 20, 6], [5, 30, 1]], seed=1)
    torch.compile(model, backend=capture)(**batch, use_cache=False, **kw)
    assert len(graphs) == 1, f"expected one graph for {family}, got {len(graphs)}"
    return graphs[0]


def _nodes(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


@pytest.mark.parametrize("family", FAMILIES)
def test_gathers_kv_heads_not_query_heads(family):
    config = tiny_config(family)
    gm = _capture(family)
    reports = run_pass(gm, cp_size=4)
    starts = _nodes(gm, _compat.all_gather_start)
    sdpas = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _compat.SDPA_TARGETS]
    assert len(reports) == len(sdpas) == config.num_hidden_layers
    assert len(starts) == 2 * config.num_hidden_layers
    for start in starts:
        gathered = start.args[0].meta["example_value"]
        assert gathered.shape[1] == config.num_key_value_heads, (start.args[0].name, tuple(gathered.shape))
    for sdpa in sdpas:
        assert sdpa.kwargs["enable_gqa"] is True
    for r in reports:
        assert [s[1] for s in r.gathered_shapes] == [config.num_key_value_heads] * 2
    # repeat_kv's expand/reshape are gone: nothing expands K/V to the query heads any more
    expands_5d = [
        n
        for n in gm.graph.nodes
        if n.op == "call_method" and n.target == "expand" and n.meta["example_value"].dim() == 5
    ]
    assert not expands_5d, [n.name for n in expands_5d]


@pytest.mark.parametrize("family", FAMILIES)
def test_gather_issued_early_and_waited_at_attention(family):
    gm = _capture(family)
    run_pass(gm, cp_size=2)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    sdpas = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _compat.SDPA_TARGETS]
    for sdpa in sdpas:
        waits = sdpa.args[1:3]
        for wait in waits:
            assert wait.target is _compat.all_gather_wait
            start = wait.args[0]
            src = start.args[0]
            # issued right after its input exists ...
            assert start.prev is src, f"{start.name} issued after {start.prev.name}, not right after {src.name}"
            # ... waited only just before attention (only the other wait and the mask op may stand between)
            between = [n for n in gm.graph.nodes if order[wait] < order[n] < order[sdpa]]
            allowed = (_compat.all_gather_wait, visible_mask)
            assert all(n.target in allowed for n in between), [n.name for n in between]
            # ... with real work in between to overlap with (the query path: projection, norm, RoPE)
            overlapped = [
                n
                for n in gm.graph.nodes
                if order[start] < order[n] < order[wait] and n.op in ("call_function", "call_method")
            ]
            assert len(overlapped) >= 3, f"nothing to overlap between {start.name} and {wait.name}"
        # the key gather starts before the query's rotary embedding is done
        q_rope = sdpa.args[0]
        assert order[waits[1].args[0]] < order[q_rope] or order[waits[0].args[0]] < order[q_rope]


def _comm_worker(rank, world_size, family, regather):
    import cpcompile

    config = tiny_config(family)
    batch = packed_batch([[10, 20, 7], [5, 30, 2]], seed=3)
    ref = tiny_model(family)
    out_ref = ref(**batch, use_cache=False)
    out_ref.loss.backward()

    group = dist.new_group(list(range(world_size)))
    model = tiny_model(family)
    compiled = torch.compile(
        model, backend=cpcompile.backend(group, inner="aot_eager", regather_kv_in_backward=regather)
    )
    with cpcompile.shard(batch, group) as local:
        with torch.profiler.profile(record_shapes=True) as prof:
            out = compiled(**local)
            out.loss.backward()
        logits = cpcompile.gather(out.logits)
        stats = cpcompile.comm_stats()
    gloo = {}
    for e in prof.events():
        if e.name.startswith("gloo:"):
            gloo[e.name] = gloo.get(e.name, 0) + 1
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        grads[name] = g
    plan_chunk = -(-batch["input_ids"].shape[1] // world_size)
    return {
        "stats": stats,
        "gloo": gloo,
        "chunk": plan_chunk,
        "layers": config.num_hidden_layers,
        "kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim
        if getattr(config, "head_dim", None)
        else config.hidden_size // config.num_attention_heads,
        "logits": logits.detach(),
        "ref_logits": out_ref.logits.detach(),
        "grads": grads,
        "ref_grads": {n: p.grad for n, p in ref.named_parameters()},
    }


# fp32: the CP run reorders only the softmax/matmul reductions over keys; 1e-5 leaves ~100x headroom
# over the observed differences (<= 2e-7 logits, <= 5e-8 gradients).
FP32_ATOL, FP32_RTOL = 1e-5, 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_comm_stats_bytes_are_the_theoretical_minimum(family):
    world = 2
    results = run_distributed(_comm_worker, world, family, False)
    for r in results:
        B = 2
        # theoretical minimum: (N-1) chunks of the un-expanded K and V per layer, fp32
        per_tensor = (world - 1) * B * r["kv_heads"] * r["chunk"] * r["head_dim"] * 4
        expected = 2 * r["layers"] * per_tensor
        assert r["stats"].all_gather_bytes == expected
        assert r["stats"].all_gathers == 2 * r["layers"]
        assert r["stats"].reduce_scatters == 2 * r["layers"]
        # independent count from the profiler: one gloo all-gather per gathered tensor
        assert r["gloo"].get("gloo:all_gather", 0) == 2 * r["layers"]
        torch.testing.assert_close(r["logits"], r["ref_logits"], atol=FP32_ATOL, rtol=FP32_RTOL)


def test_regather_kv_in_backward_gathers_again_and_stays_exact():
    world = 2
    results = run_distributed(_comm_worker, world, "qwen3", True)
    for r in results:
        # forward gathers K and V once per layer; backward gathers them again instead of saving them
        assert r["gloo"].get("gloo:all_gather", 0) == 4 * r["layers"]
        torch.testing.assert_close(r["logits"], r["ref_logits"], atol=FP32_ATOL, rtol=FP32_RTOL)
        for name, g in r["grads"].items():
            torch.testing.assert_close(g, r["ref_grads"][name], atol=FP32_ATOL, rtol=FP32_RTOL, msg=name)
