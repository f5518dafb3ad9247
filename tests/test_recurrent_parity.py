"""Parity of RecurrentGemma and RWKV, whose recurrences run channel-parallel under CP (:mod:`cpcompile.cores`), and
of MiniMax, whose lightning-attention layers run whole on every rank, compiled with cpcompile at CP=2 and 3 (gloo
processes), vs the same model run whole in one process on the same global batch.

Models (``cpcompile.testing.HYBRID_FAMILIES``): transformers RecurrentGemma, an RG-LRU layer (a conv of kernel 4,
then a diagonal linear recurrence over 64 channels, ``RecurrentGemmaRglru._rnn_scan``, that restarts at every token
whose position id is 0) before a sliding-window attention layer (window 16); RWKV, two blocks of a token shift
(``nn.ZeroPad2d((0, 0, 1, -1))``, a gathered region) and the WKV recurrence over 64 channels
(``rwkv_linear_attention``), which does not restart at documents (nor does the one-process model); MiniMax, a
lightning-attention layer (4 heads, blocks of 16 tokens counted from the sequence's first token) before an
attention layer, MoE feed-forwards. T = 37 with the documents of tests/test_hybrids_parity.py (``DOCS``): at CP=2
contiguous (chunks of 19 tokens) row 0's documents start at 0, 10 (spanning the rank edge) and 30 (on rank 1), row
1's at 0, 5 (spanning it) and 35 (on rank 1), so the parity check covers a recurrence carried across the rank edge
and restarted on rank 1.

Slow tier, one distributed job (``results``): each family at CP=2 contiguous and balanced, RecurrentGemma (64
channels padded to 66) and MiniMax at CP=3 balanced (RWKV's channels are padded as the RG-LRU's; its CP=3 case,
exact when run by hand, is left out for the tier's time), ``inner="eager"`` (the ``aot_eager`` path of the
exchanges is what the other cores' tests cover; RecurrentGemma under ``aot_eager`` at CP=2 was checked by hand).
Negative controls at CP=2 contiguous must
fail the parity check on the logits: each recurrence (MiniMax's: the whole layer) run on each rank's own tokens
only (``cores._run_core`` replaced by a call per rank chunk), and RecurrentGemma's run on the whole sequence without
its resets (``reset`` all false: shows that the check sees where documents restart). Single process (fast): each
core is given its replacement, which outside a CP context is the library's recurrence, and a cache under CP is
refused while tracing (RG-LRU, WKV); the method cores registered again after a reset of the cores module's state
get their library functions back.
"""

from __future__ import annotations

import pytest

from tests.harness.dist import run_distributed
from tests.harness.parity import ParityCase, report
from tests.harness.tiers import runs_slow, slow
from tests.test_hybrids_parity import _MOE_LAYER, DOCS, _control, _local_core, _run

_LOSS = ("cross_entropy", "partial_sum")
#: RWKV block: the attention's token shift with a halo, the WKV recurrence channel-parallel, the feed-forward's shift
_RWKV_BLOCK = (("pad", "halo"), ("rwkv_linear_attention", "head_parallel"), ("pad", "halo"))
EXPECTED = {
    "recurrent_gemma": (("conv1d", "halo"), ("_rnn_scan", "head_parallel"), _LOSS),
    "rwkv": (*_RWKV_BLOCK, *_RWKV_BLOCK, _LOSS),
    # the lightning-attention layer run whole on every rank (reported as its core, the layer's forward)
    "minimax": (("forward", "replicated"), *_MOE_LAYER, *_MOE_LAYER, _LOSS),
}
SITES = {"recurrent_gemma": 1, "rwkv": 0, "minimax": 1}


def _case(inner: str = "eager", layout: str = "contiguous", model: str = "recurrent_gemma") -> ParityCase:
    from cpcompile.layouts import Workload

    balanced = layout == "balanced"
    return ParityCase(
        model=model,
        doc_lens=DOCS,
        inner=inner,
        expected_sites=SITES[model],
        layout=layout,
        expected_mixing=EXPECTED[model],
        shard_kwargs=(("workload", Workload(block_size=4)),) if balanced else (),
    )


CP2 = [_case(), _case(layout="balanced")]
CP3 = [_case(layout="balanced")]
RWKV_CP2 = [_case(model="rwkv"), _case(model="rwkv", layout="balanced")]
MINIMAX_CP2 = [_case(model="minimax"), _case(model="minimax", layout="balanced")]
MINIMAX_CP3 = [_case(model="minimax", layout="balanced")]


def _without_resets(original, hidden_states, recurrent_gate, reset, *rest):
    """The reset control's core: the whole sequence of the rank's channels, with no document restarting."""
    import torch

    return original(hidden_states, recurrent_gate, torch.zeros_like(reset), *rest)


def _worker(rank: int, world: int) -> dict:
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    pair = dist.new_group([0, 1])  # every rank takes part in creating the group
    out = {}
    if rank < 2:
        out["cp2"] = _run(CP2, pair)
        start = time.perf_counter()
        out["local_control"] = _control(CP2[0], pair, _local_core)
        out["reset_control"] = _control(CP2[0], pair, _without_resets)
        out["controls_s"] = time.perf_counter() - start
        out["rwkv_cp2"] = _run(RWKV_CP2, pair)
        out["rwkv_control"] = _control(RWKV_CP2[0], pair, _local_core)
        out["minimax_cp2"] = _run(MINIMAX_CP2, pair)
        out["minimax_control"] = _control(MINIMAX_CP2[0], pair, _local_core)
    out["cp3"] = _run(CP3 + MINIMAX_CP3, dist.group.WORLD)
    return out


TIMEOUT_S = 600


@pytest.fixture(scope="module")
def results(request):
    if not runs_slow(request):
        return None
    return run_distributed(_worker, 3, timeout_s=TIMEOUT_S)


@slow
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_rg_lru_cp2_contiguous_and_balanced(results):
    summaries = results[0]["cp2"]
    report(summaries)
    assert [s["case"] for s in summaries] == [c.name for c in CP2]


@slow
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_rg_lru_cp3_channels_padded_to_a_multiple_of_the_cp_size(results):
    summaries = results[0]["cp3"]
    report(summaries)
    assert [s["case"] for s in summaries] == [c.name for c in CP3 + MINIMAX_CP3]


@slow
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_rwkv_cp2_contiguous_and_balanced(results):
    summaries = results[0]["rwkv_cp2"]
    report(summaries)
    assert [s["case"] for s in summaries] == [c.name for c in RWKV_CP2]


@slow
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_minimax_cp2_contiguous_and_balanced(results):
    summaries = results[0]["minimax_cp2"]
    report(summaries)
    assert [s["case"] for s in summaries] == [c.name for c in MINIMAX_CP2]


@slow
@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("control", ["local_control", "reset_control", "rwkv_control", "minimax_control"])
def test_recurrence_on_local_tokens_or_without_resets_fails_parity(results, control):
    for per_rank in results[:2]:
        outcome = per_rank[control]
        print(f"\n{control}: {outcome} (RecurrentGemma's two controls {per_rank['controls_s']:.1f}s)")
        assert outcome["caught"], f"{control} passed the parity check: {outcome}"
        assert "logits" in outcome["failing"], outcome


def test_rg_lru_method_replaced_library_outside_cp_and_cache_under_cp_refused():
    import torch
    from transformers.models.minimax import modeling_minimax
    from transformers.models.recurrent_gemma import modeling_recurrent_gemma as rg

    from cpcompile import _compat, cores
    from cpcompile.testing import tiny_config

    cores.register_known_cores()
    lightning = modeling_minimax.MiniMaxLightningAttention.forward
    assert cores.registered_cores()[f"{modeling_minimax.__name__}.MiniMaxLightningAttention.forward"] is lightning
    assert _compat.inlined_in_graph(lightning)
    method = rg.RecurrentGemmaRglru._rnn_scan
    assert cores.registered_cores()[f"{rg.__name__}.RecurrentGemmaRglru._rnn_scan"] is method
    assert _compat.inlined_in_graph(method)
    layer = rg.RecurrentGemmaRglru(tiny_config("recurrent_gemma"))
    gen = torch.Generator().manual_seed(0)
    x, gate = torch.randn(2, 9, 64, generator=gen), torch.rand(2, 9, 64, generator=gen)
    reset = (torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0]] * 2) == 0)[:, :, None]

    def f(x, gate, state=None):
        return layer._rnn_scan(x, gate, reset, state)[0]

    torch.compiler.reset()
    calls = []
    saved = cores._run_core
    cores._run_core = lambda original, *a, **k: calls.append(1) or original(*a, **k)
    try:
        compiled = torch.compile(f, backend="eager")
        torch.testing.assert_close(compiled(x, gate), f(x, gate), rtol=0, atol=0)
        assert calls == []  # outside a CP context: the library's recurrence, not the head-parallel call
        try:
            cores.set_heads_group(("not-a-group", 2, 0))  # a cache under CP: the traced replacement refuses
            with pytest.raises(RuntimeError, match="_rnn_scan under context parallelism got a recurrent state"):
                compiled(x, gate, torch.zeros(2, 64))
        finally:
            cores.set_heads_group(None)
        torch.testing.assert_close(compiled(x, gate), f(x, gate), rtol=0, atol=0)
    finally:
        cores._run_core = saved
        torch.compiler.reset()


def test_method_cores_registered_again_after_a_state_reset_get_their_library_back(monkeypatch):
    """A reset of :mod:`cpcompile.cores`' module state (as the pooled test ranks do between jobs) drops the method
    cores from ``_REGISTERED`` and their library copies; registering again must give the replacements Dynamo
    already holds their library functions back (before, the RG-LRU's replacement then called ``None``, Dynamo fell
    back to calling it unbound, and a later CP run failed with a ``TypeError``)."""
    from transformers.models.minimax import modeling_minimax  # noqa: F401 - registers the lightning layer
    from transformers.models.recurrent_gemma import modeling_recurrent_gemma as rg

    from cpcompile import cores

    cores.register_known_cores()
    monkeypatch.setattr(cores, "_REGISTERED", {})
    monkeypatch.setattr(cores, "_RG_LRU_LIBRARY", None)
    monkeypatch.setattr(cores, "_LIGHTNING_LIBRARY", None)
    cores.register_known_cores()
    library = cores._RG_LRU_LIBRARY
    assert library is not None and library.__code__ is rg.RecurrentGemmaRglru._rnn_scan.__code__
    assert cores._LIGHTNING_LIBRARY is not None


def test_wkv_substituted_library_outside_cp_and_cache_under_cp_refused():
    import torch
    from transformers.models.rwkv import modeling_rwkv

    from cpcompile import cores

    cores.register_known_cores()
    assert cores.registered_cores()[f"{modeling_rwkv.__name__}.rwkv_linear_attention"] is not None
    gen = torch.Generator().manual_seed(0)
    decay, first = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    key, value = torch.randn(1, 7, 6, generator=gen), torch.randn(1, 7, 6, generator=gen)

    def f(key, value, cache=False):
        return modeling_rwkv.rwkv_linear_attention(decay, first, key, value, return_state=cache)[0]

    torch.compiler.reset()
    try:
        compiled = torch.compile(f, backend="eager")
        torch.testing.assert_close(compiled(key, value), f(key, value), rtol=0, atol=0)
        try:
            cores.set_heads_group(("not-a-group", 2, 0))
            with pytest.raises(RuntimeError, match="rwkv_linear_attention under context parallelism got a recurrent"):
                compiled(key, value, cache=True)
        finally:
            cores.set_heads_group(None)
    finally:
        torch.compiler.reset()
