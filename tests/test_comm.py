"""Communication of the rewritten attention: KV-head gathers, their placement, and exact byte counts."""

from __future__ import annotations

import pytest
import torch

from cpcompile import _compat
from cpcompile.plan import visible_mask
from cpcompile.testing import packed_batch, tiny_config, tiny_model
from tests.harness.dist import run_distributed
from tests.harness.graphs import dynamo_graph, run_pass
from tests.harness.parity import ParityCase, check_outcome
from tests.harness.tiers import runs_slow, slow
from tests.harness.workers import parity_worker

FAMILIES = ["llama", "qwen3"]
#: The family whose bytes the fast tier counts (its own head_dim); the slow tier adds the others.
FAST_FAMILY = "qwen3"
#: Layers of the spawned cases: what is counted is per layer, and one layer halves the compiling.
LAYERS = 1


def _capture(family: str, **kw) -> torch.fx.GraphModule:
    """The Dynamo graph of a tiny model's training call (no pass applied)."""
    batch = packed_batch([[10, 20, 6], [5, 30, 1]], seed=1)
    return dynamo_graph(tiny_model(family), **batch, use_cache=False, **kw)


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
            # issued right after its input exists (the first one after the site's check, which comes as early as
            # the first of K and V exists) ...
            prev = start.prev
            if prev.target is torch.ops.cpcompile.site_check.default:
                assert prev.args[0].args[0] is src, f"{start.name}: the site's check does not follow {src.name}"
                prev = prev.prev.prev  # the check and the detached input it reads
            assert prev is src, f"{start.name} issued after {prev.name}, not right after {src.name}"
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


def _case(family: str, regather: bool, exchange: str = "all_gather") -> ParityCase:
    return ParityCase(
        model=family,
        doc_lens=((10, 20, 7), (5, 30, 2)),
        batch_seed=3,
        overrides=(("num_hidden_layers", LAYERS),),
        backend_kwargs=(("regather_kv_in_backward", regather), ("exchange", exchange)),
        inner="aot_eager" if regather else "eager",  # recomputation is AOTAutograd's partitioner's
    )


def _kv_bytes_per_gather(family: str, world: int, batch: int, chunk: int) -> int:
    """(N-1) chunks of the un-expanded K (or V) of one layer, fp32: the theoretical minimum per gather."""
    config = tiny_config(family)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return (world - 1) * batch * config.num_key_value_heads * chunk * head_dim * 4


@pytest.fixture(scope="module")
def profiled(request):
    """One spawned CP=2 group: each family plainly (the fast tier: ``FAST_FAMILY``), and qwen3 re-gathering K/V in
    backward, also with the selective exchange (profiled steps)."""
    families = FAMILIES if runs_slow(request) else [FAST_FAMILY]
    cases = [_case(family, False) for family in families] + [_case("qwen3", True), _case("qwen3", True, "selective")]
    return run_distributed(parity_worker, 2, cases, None, True, timeout_s=400)


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f == FAST_FAMILY else slow) for f in FAMILIES])
def test_comm_stats_bytes_are_the_theoretical_minimum(profiled, family):
    world = 2
    for per_rank in profiled:
        case = _case(family, False)
        layers = LAYERS
        chunk = -(-sum(case.doc_lens[0]) // world)
        outcome, _ = per_rank[case.name]
        check_outcome(outcome)  # parity with the unsharded model, K and V gathered once per layer
        assert outcome.comm.all_gather_bytes == 2 * layers * _kv_bytes_per_gather(family, world, 2, chunk)
        assert outcome.comm.all_gathers == 2 * layers
        assert outcome.comm.reduce_scatters == 2 * layers
        # independent count from the profiler: one gloo all-gather per gathered tensor
        assert outcome.collectives.get("gloo:all_gather", 0) == 2 * layers


def test_regather_kv_in_backward_gathers_again_and_stays_exact(profiled):
    case = _case("qwen3", True)
    layers = LAYERS
    for per_rank in profiled:
        outcome, _ = per_rank[case.name]
        # forward gathers K and V once per layer; backward gathers them again instead of saving them
        assert outcome.collectives.get("gloo:all_gather", 0) == 4 * layers
        check_outcome(outcome)


def test_regather_with_the_selective_exchange_fetches_again_and_stays_exact(profiled):
    """The exchanged keys are fetched again in backward instead of being saved: per layer, K and V exchanged in
    forward, again in backward, and their gradients sent back (6 all-to-alls, 4 without regathering); the
    gradients' bytes are counted once."""
    case = _case("qwen3", True, "selective")
    layers = LAYERS
    for per_rank in profiled:
        outcome, _ = per_rank[case.name]
        check_outcome(outcome)
        assert outcome.collectives.get("gloo:all_to_all", 0) == 6 * layers, outcome.collectives
        assert "gloo:all_gather" not in outcome.collectives, outcome.collectives
        comm = outcome.comm
        assert comm.halo_exchanges == 4 * layers and comm.halo_bytes == 2 * comm.halo_backward_bytes, comm


def test_regather_without_a_partitioner_is_refused():
    from cpcompile.options import BackendOptions

    with pytest.raises(ValueError, match="regather_kv_in_backward=True needs an inner compiler that partitions"):
        BackendOptions(regather_kv_in_backward=True, inner="eager")
    assert BackendOptions(regather_kv_in_backward=True, inner="aot_eager").regather_kv_in_backward
