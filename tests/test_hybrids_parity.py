"""Parity of hybrid models whose recurrent mixer runs head-parallel (:mod:`cpcompile.cores`), compiled with
cpcompile at CP=2, 3 and 4 (gloo processes), vs the same model run whole in one process on the same global batch.
The gated delta rule's cases pass ``shard(recurrence="heads")`` (the default; state passing is
tests/test_state_passing.py's); the other cores' cases pass nothing: they run head-parallel whatever it says.

Models (``cpcompile.testing.HYBRID_FAMILIES``): transformers Qwen3-Next, a gated delta-net layer (2 key / 4 value
heads, causal conv kernel 4, the torch chunked delta rule) before a gated attention layer, MoE feed-forwards; the
Mamba2 (SSD) core's families, Bamba first (a Mamba2 layer of 8 heads in 2 groups, chunks of 16 tokens, before an
attention layer); and the selective scan's families, Jamba first (a Mamba layer of 128 channels, state 8, then an
attention layer with MoE feed-forwards). T = 37 is not a multiple of 2, 3 or 4, fits one chunk of the delta rule
(64 tokens) and crosses the SSD's chunk edges; documents cross rank edges. transformers' torch paths do not keep
packed documents apart in the recurrence or the conv, so the one-process model leaks state across documents and
the CP run must do the same.

Each case asserts the logits, the summed loss and every summed gradient (``tests.harness.parity`` tolerances), the
SDPA sites rewritten, the mixing ops reported (``EXPECTED_BY_MODEL``: the conv gathered, the core head-parallel, MoE
dispatch, the loss) and one sequence all-gather per gathered region. The negative controls run the core on each
rank's own tokens only (``cores._run_core`` replaced by a call per run of ``c`` tokens, which under the contiguous
layout are the ranks' chunks): the parity check must fail, on the logits.

Fast tier: Qwen3-Next at CP=2 contiguous (``inner="eager"``) with its control (the mechanism every core shares).
Slow tier, in four jobs so that none idles ranks or runs past its limit on 2 cores: at CP=2, Qwen3-Next under
``aot_eager`` (the exchanges and the core traced by AOTAutograd) and under inductor (the region's exchanges, pads
and the re-traced core compiled to C++), Bamba and Jamba contiguous, each with its control,
and the other families of each core contiguous (Qwen3.5, Qwen3.5-MoE, OLMo-Hybrid; Granite-4 hybrid, Falcon-H1,
Mamba2, Nemotron-H, Zamba2; Mamba, FalconMamba, Zamba); CP=3 balanced, which divides no head or channel count
(padded with zero heads), for one family of each core; CP=4 balanced (2 key heads or 2 groups for 4 ranks: repeated
to the heads before the exchange) for Qwen3-Next and Bamba; and one ``aot_eager`` compile at CP=2 over T = 37 and
128 (128 needs no padding to the delta rule's 64-token chunk), with its control: the core's inputs in the
exchange's layout must fail at T = 128 with torch's view error (pytorch/pytorch#144187). Single process (fast):
outside a CP context the compiled cores are the library's (every family's core is substituted), and a cache under
CP is refused while tracing.
"""

from __future__ import annotations

import pytest

from cpcompile.layouts import Workload
from tests.harness.dist import run_distributed
from tests.harness.parity import ParityCase, report
from tests.harness.tiers import runs_slow, slow

DOCS = ((10, 20, 7), (5, 30, 2))
_MOE_LAYER = (
    ("sort", "dispatch"),
    ("getitem", "dispatch"),
    ("getitem", "dispatch"),
    ("histc", "dispatch"),
    ("transformers::grouped_mm_fallback", "per_token"),
    ("transformers::grouped_mm_fallback", "per_token"),
    ("setitem", "dispatch"),
    ("getitem", "dispatch"),
)
EXPECTED = (
    ("conv1d", "halo"),
    ("torch_chunk_gated_delta_rule", "head_parallel"),
    *_MOE_LAYER,
    *_MOE_LAYER,
    ("cross_entropy", "partial_sum"),
)


#: the mixing of the families of the same core: Qwen3.5 and OLMo-Hybrid (dense feed-forwards), Qwen3.5-MoE (as
#: Qwen3-Next)
EXPECTED_BY_MODEL = {
    "qwen3_next": EXPECTED,
    "qwen3_5": (EXPECTED[0], EXPECTED[1], EXPECTED[-1]),
    "qwen3_5_moe": EXPECTED,
    "olmo_hybrid": (EXPECTED[0], EXPECTED[1], EXPECTED[-1]),
}

#: The Mamba2 (SSD) core's families: the conv with a halo, the SSD core head-parallel, per Mamba2 layer.
_SSD_LAYER = (("conv1d", "halo"), ("mamba2_chunk_scan", "head_parallel"))
EXPECTED_BY_MODEL.update(
    {
        "bamba": (*_SSD_LAYER, EXPECTED[-1]),
        "granitemoehybrid": (*_SSD_LAYER, *_MOE_LAYER, *_MOE_LAYER, EXPECTED[-1]),
        "falcon_h1": (*_SSD_LAYER, *_SSD_LAYER, EXPECTED[-1]),
        "mamba2": (*_SSD_LAYER, *_SSD_LAYER, EXPECTED[-1]),
        "nemotron_h": (*_SSD_LAYER, EXPECTED[-1]),
        "zamba2": (*_SSD_LAYER, *_SSD_LAYER, EXPECTED[-1]),
    }
)
#: The selective scan's families: the conv with a halo, the scan head-parallel (channel-parallel), per Mamba layer;
#: Zamba's mixer calls the scan once per Mamba head (2).
_SCAN_LAYER = (("conv1d", "halo"), ("mamba_selective_scan", "head_parallel"))
EXPECTED_BY_MODEL.update(
    {
        "jamba": (*_SCAN_LAYER, *_MOE_LAYER, EXPECTED[-1]),
        "mamba": (*_SCAN_LAYER, *_SCAN_LAYER, EXPECTED[-1]),
        "falcon_mamba": (*_SCAN_LAYER, *_SCAN_LAYER, EXPECTED[-1]),
        "zamba": (*_SCAN_LAYER, _SCAN_LAYER[1], *_SCAN_LAYER, _SCAN_LAYER[1], EXPECTED[-1]),
    }
)
#: SDPA sites per model: one attention layer, two in Falcon-H1 (attention beside the SSD in every layer), none in
#: Mamba2, Mamba and FalconMamba.
SITES = {"falcon_h1": 2, "mamba2": 0, "mamba": 0, "falcon_mamba": 0}


#: The families of the gated delta rule: their cases here run it head-parallel (``shard(recurrence="heads")``, the
#: default, named; state passing is tests/test_state_passing.py's). The other cores run head-parallel whatever it says.
GATED_DELTA_RULE = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid")


def _case(inner: str = "eager", layout: str = "contiguous", model: str = "qwen3_next") -> ParityCase:
    balanced = layout == "balanced"
    heads = (("recurrence", "heads"),) if model in GATED_DELTA_RULE else ()
    return ParityCase(
        model=model,
        doc_lens=DOCS,
        inner=inner,
        expected_sites=SITES.get(model, 1),
        layout=layout,
        expected_mixing=EXPECTED_BY_MODEL[model],
        shard_kwargs=((("workload", Workload(block_size=4)),) if balanced else ()) + heads,
    )


FAST = [_case()]
#: The gated delta rule's slow cases: the exchanges and the core traced by AOTAutograd, then compiled by inductor
#: (the balanced layout runs at CP=3 and 4 below).
SLOW_CP2 = [_case(inner="aot_eager"), _case(inner="inductor")]
SAME_CORE_CP2 = [_case(model="qwen3_5"), _case(model="qwen3_5_moe"), _case(model="olmo_hybrid")]
#: The Mamba2 core: Bamba at CP=2 contiguous (2 groups of 4 heads: a rank takes a whole group) with its control,
#: and the other families.
SSD_FAST = [_case(model="bamba")]
SSD_SLOW_CP2 = [_case(model=m) for m in ("granitemoehybrid", "falcon_h1", "mamba2", "nemotron_h", "zamba2")]
#: The selective scan: Jamba at CP=2 contiguous (a Mamba layer, then attention with MoE feed-forwards) with its
#: control, and the other families.
SCAN_FAST = [_case(model="jamba")]
SCAN_SLOW_CP2 = [_case(model=m) for m in ("mamba", "falcon_mamba", "zamba")]
#: CP=3 divides no head or channel count, under the balanced layout: Qwen3-Next's 4 value heads (key heads repeated
#: to them), Bamba's 8 heads (B and C repeated to them) and Mamba's 128 channels are padded with zero heads to 6, 9
#: and 129.
CP3 = [_case(layout="balanced"), _case(model="bamba", layout="balanced"), _case(model="mamba", layout="balanced")]
#: CP=4 balanced: Qwen3-Next's 2 key heads and Bamba's 2 groups for 4 ranks, repeated to the heads before the
#: exchange.
CP4 = [_case(layout="balanced"), _case(model="bamba", layout="balanced")]


def _local_core(original, *args, **kwargs):
    """The negative control's core: each run of ``c`` tokens (a rank's chunk under the contiguous layout) alone.
    Every tensor argument with the sequence dim (dim 1, the first argument's length) is split; per-head parameters
    are passed whole."""
    import torch
    import torch.distributed as dist

    n, length = dist.get_world_size(), args[0].shape[1]
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.dim() > 1 and a.shape[1] == length]
    outs = []
    for piece in range(n):
        part = [a.chunk(n, dim=1)[piece] if i in tensors else a for i, a in enumerate(args)]
        out = original(*part, **kwargs)
        outs.append(out[0] if isinstance(out, tuple) else out)
    whole = torch.cat(outs, dim=1)
    return (whole, None) if isinstance(out, tuple) else whole


def _local_scan(original, *args, **kwargs):
    """The selective scan's negative control: as :func:`_local_core`, along the scan's sequence dim (2 of
    ``[B, channels, S]``), the gate ``z`` too."""
    import torch
    import torch.distributed as dist

    n, length = dist.get_world_size(), args[0].shape[2]

    def piece(a, i):
        if isinstance(a, torch.Tensor) and a.dim() == 3 and a.shape[2] == length:
            return a.chunk(n, dim=2)[i]
        return a

    outs = [original(*(piece(a, i) for a in args), **{k: piece(v, i) for k, v in kwargs.items()}) for i in range(n)]
    return torch.cat(outs, dim=2)


def _control(case, group, local=_local_core) -> dict:
    import torch

    from cpcompile import cores
    from tests.harness.parity import ParityRunner, assert_parity, failing_quantities

    torch.compiler.reset()
    saved = cores._run_core
    cores._run_core = local
    try:
        bad = ParityRunner(case, group).run()
    finally:
        cores._run_core = saved
        torch.compiler.reset()
    try:
        assert_parity(bad)
    except AssertionError as e:
        return {"caught": True, "failing": failing_quantities(bad), **bad.errors(), "message": str(e).splitlines()[0]}
    return {"caught": False, "failing": [], **bad.errors()}


def _run(cases, group):
    import torch

    from tests.harness.parity import check_case

    out = []
    for case in cases:
        torch.compiler.reset()
        out.append(check_case(case, group))
    return out


def _worker(rank: int, world: int, with_slow: bool) -> dict:
    """The CP=2 cases: Qwen3-Next and its control (fast), then the other cases of the gated delta rule and the
    Mamba2 core (slow)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    group = dist.group.WORLD
    out = {"cp2": _run(FAST + SLOW_CP2 * with_slow, group), "control": _control(FAST[0], group)}
    if with_slow:
        out["ssd"] = _run(SSD_FAST + SSD_SLOW_CP2, group)
        out["ssd_control"] = _control(SSD_FAST[0], group)
        out["same_core"] = _run(SAME_CORE_CP2, group)
    return out


def _scan_worker(rank: int, world: int) -> dict:
    """The selective scan's CP=2 cases and control (slow)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    group = dist.group.WORLD
    return {"scan": _run(SCAN_FAST + SCAN_SLOW_CP2, group), "scan_control": _control(SCAN_FAST[0], group, _local_scan)}


def _cases_worker(rank: int, world: int, cases: list) -> list:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    return _run(cases, dist.group.WORLD)


#: One job's wall-clock limit: the slow CP=2 job runs 12 compiles on 2 ranks, one of them by inductor.
TIMEOUT_S = 1200
#: A test's limit: the first test to use :func:`results` waits for its two jobs.
TEST_TIMEOUT_S = 2 * TIMEOUT_S + 60


@pytest.fixture(scope="module")
def results(request):
    """The CP=2 job (:func:`_worker`), and in the slow tier the selective scan's (:func:`_scan_worker`), merged."""
    with_slow = runs_slow(request)
    per_rank = run_distributed(_worker, 2, with_slow, timeout_s=TIMEOUT_S)
    if with_slow:
        for mine, scan in zip(per_rank, run_distributed(_scan_worker, 2, timeout_s=TIMEOUT_S)):
            mine.update(scan)
    return per_rank


#: Each core's CP=2 results (``_worker``'s key), its fast and slow cases there, and its negative control's key.
CORE_RUNS = {
    "gated delta rule": ("cp2", FAST, SLOW_CP2, "control"),
    "Mamba2 SSD": ("ssd", SSD_FAST, SSD_SLOW_CP2, "ssd_control"),
    "selective scan": ("scan", SCAN_FAST, SCAN_SLOW_CP2, "scan_control"),
}


#: The cores whose CP=2 contiguous case and control run in the fast tier; the others run in the slow tier only.
FAST_CORES = ("gated delta rule",)
CORES_BY_TIER = [core if core in FAST_CORES else pytest.param(core, marks=slow) for core in CORE_RUNS]


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("core", CORES_BY_TIER)
def test_cp2_contiguous(results, core):
    key, fast, _, _ = CORE_RUNS[core]
    summaries = results[0][key][: len(fast)]
    report(summaries)
    assert [s["case"] for s in summaries] == [c.name for c in fast]
    for s in summaries:  # one graph, run once: the bytes the report gives per call are the bytes received
        reported, received = s["heads_bytes"]
        assert reported == received > 0, s


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("core", CORES_BY_TIER)
def test_core_on_local_tokens_fails_parity(results, core):
    control_key = CORE_RUNS[core][3]
    for per_rank in results[:2]:
        control = per_rank[control_key]
        print(f"\ncontrol: the {core} on local tokens: {control}")
        assert control["caught"], f"the {core} on each rank's tokens alone passed the parity check: {control}"
        assert "logits" in control["failing"], control


@slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("core", list(CORE_RUNS))
def test_cp2_aot_eager_and_other_families(results, core):
    key, fast, slow_cases, _ = CORE_RUNS[core]
    summaries = results[0][key][len(fast) :]
    report(summaries)
    assert [s["case"] for s in summaries] == [c.name for c in slow_cases]


@slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_cp2_qwen3_5_qwen3_5_moe_olmo_hybrid(results):
    summaries = results[0]["same_core"]
    report(summaries)
    assert [s["case"] for s in summaries] == [c.name for c in SAME_CORE_CP2]


@slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_cp3_heads_padded_to_a_multiple_of_the_cp_size():
    summaries = run_distributed(_cases_worker, 3, CP3, timeout_s=TIMEOUT_S)[0]
    report(summaries)
    assert [s["case"] for s in summaries] == [c.name for c in CP3]


@slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_cp4_balanced_repeated_key_heads_and_repeated_ssd_groups():
    summaries = run_distributed(_cases_worker, 4, CP4, timeout_s=TIMEOUT_S)[0]
    report(summaries)
    assert [s["case"] for s in summaries] == [c.name for c in CP4]
    assert all(s["runs"] > 1 for s in summaries), [s["runs"] for s in summaries]


def _core_inputs(seed: int = 0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, 21, 2, 8, generator=gen) for _ in range(2))
    v = torch.randn(2, 21, 4, 8, generator=gen)
    g = -torch.rand(2, 21, 4, generator=gen)
    beta = torch.rand(2, 21, 4, generator=gen)
    return q, k, v, g, beta


def test_outside_cp_the_compiled_cores_are_the_library_ones_and_a_cache_under_cp_is_refused():
    import torch
    from transformers.models.bamba import modeling_bamba
    from transformers.models.falcon_h1 import modeling_falcon_h1
    from transformers.models.falcon_mamba import modeling_falcon_mamba
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid
    from transformers.models.jamba import modeling_jamba
    from transformers.models.mamba import modeling_mamba
    from transformers.models.mamba2 import modeling_mamba2
    from transformers.models.olmo_hybrid import modeling_olmo_hybrid
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next
    from transformers.models.zamba import modeling_zamba

    from cpcompile import cores

    cores.register_known_cores()
    for module in (qwen3_next, modeling_qwen3_5, modeling_qwen3_5_moe, modeling_olmo_hybrid):
        assert cores.registered_cores()[f"{module.__name__}.torch_chunk_gated_delta_rule"] is not None
    for module in (modeling_bamba, modeling_falcon_h1, modeling_granitemoehybrid, modeling_mamba2):
        assert cores.registered_cores()[f"{module.__name__}.mamba2_chunk_scan"] is not None
    for module in (modeling_mamba, modeling_falcon_mamba, modeling_jamba, modeling_zamba):
        assert cores.registered_cores()[f"{module.__name__}.mamba_selective_scan"] is not None

    def f(q, k, v, g, beta, cache=False):
        return qwen3_next.torch_chunk_gated_delta_rule(
            q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, output_final_state=cache
        )[0]

    inputs = _core_inputs()
    torch.compiler.reset()
    compiled = torch.compile(f, backend="eager")
    torch.testing.assert_close(compiled(*inputs), f(*inputs), rtol=0, atol=0)
    assert cores.HEADS_GROUP is None
    try:
        cores.set_heads_group(("not-a-group", 3, 0))  # a cache under CP: the traced core refuses
        with pytest.raises(RuntimeError, match="got a recurrent state.*train with use_cache=False"):
            compiled(*inputs, cache=True)
    finally:
        cores.set_heads_group(None)
    # the graph traced without CP is still the one used once the CP context is gone
    torch.testing.assert_close(compiled(*inputs), f(*inputs), rtol=0, atol=0)

    def ssd(x, dt, A, B, C, cache=False):  # 6 heads in 2 groups, as Mamba2's mixer calls it
        out = modeling_mamba2.mamba2_chunk_scan(
            x, dt, A, B, C, chunk_size=8, dt_softplus=True, return_final_states=cache
        )
        return out[0] if cache else out

    gen = torch.Generator().manual_seed(1)
    x, dt, B, C = (torch.randn(1, 10, *shape, generator=gen) for shape in ((6, 4), (6,), (2, 3), (2, 3)))
    compiled_ssd = torch.compile(ssd, backend="eager")
    torch.testing.assert_close(compiled_ssd(x, dt, -torch.ones(6), B, C), ssd(x, dt, -torch.ones(6), B, C))
    try:
        cores.set_heads_group(("not-a-group", 4, 0))
        with pytest.raises(RuntimeError, match="got a recurrent state.*train with use_cache=False"):
            compiled_ssd(x, dt, -torch.ones(6), B, C, cache=True)
    finally:
        cores.set_heads_group(None)

    def scan(x, dt, A, B, C, cache=False):  # 6 channels, state 3, as Mamba's mixer calls it
        out = modeling_mamba.mamba_selective_scan(x, dt, A, B, C, delta_softplus=True, return_last_state=cache)
        return out[0] if cache else out

    x, dt, B, C = (torch.randn(1, *shape, 10, generator=gen) for shape in ((6,), (6,), (3,), (3,)))
    A = -torch.rand(6, 3, generator=gen)
    compiled_scan = torch.compile(scan, backend="eager")
    torch.testing.assert_close(compiled_scan(x, dt, A, B, C), scan(x, dt, A, B, C))
    try:
        cores.set_heads_group(("not-a-group", 2, 0))
        with pytest.raises(RuntimeError, match="returns its recurrent state.*train with use_cache=False"):
            compiled_scan(x, dt, A, B, C, cache=True)
    finally:
        cores.set_heads_group(None)
    torch.compiler.reset()


#: Global lengths run through ONE compiled model under ``aot_eager`` at CP=2: 37 pads the whole sequence of the
#: head-parallel core (2 * c) to a multiple of its 64-token chunk, 128 (c = 64, two chunks) needs no padding.
LENGTHS = (37, 128)


def _rows(T: int) -> tuple[tuple[int, ...], ...]:
    return ((T // 3, T - T // 3 - 2, 2), (T,))


def _lengths_worker(rank: int, world: int, lengths: tuple[int, ...], control: bool) -> list[dict]:
    """One ``aot_eager`` compile of the model, one CP step per global length against the eager model at that
    length. ``control``: the core's inputs keep the exchange's layout (``cores._heads_major`` an identity)."""
    import dataclasses
    import traceback

    import torch
    import torch.distributed as dist

    from cpcompile import cores
    from cpcompile.testing import packed_batch
    from tests.harness.parity import ParityRunner, assert_parity

    torch.set_num_threads(1)
    torch.compiler.reset()
    saved = cores._heads_major
    if control:
        cores._heads_major = lambda x: x
    out = []
    try:
        runner = ParityRunner(
            dataclasses.replace(_case(inner="aot_eager"), doc_lens=_rows(lengths[0])), dist.group.WORLD
        )
        for T in lengths:
            batch = packed_batch([list(r) for r in _rows(T)], seed=1)
            try:
                outcome = runner.run(batch=batch)
            except RuntimeError as e:
                out.append({"T": T, "error": str(e).splitlines()[0], "tb": traceback.format_exc()[-6000:]})
                continue
            try:
                assert_parity(outcome)
                out.append({"T": T, "exact": True, **outcome.errors()})
            except AssertionError as e:
                out.append({"T": T, "exact": False, "message": str(e).splitlines()[0], **outcome.errors()})
    finally:
        cores._heads_major = saved
        torch.compiler.reset()
    return out


@slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_one_aot_eager_compile_over_lengths_with_and_without_padding():
    per_rank = run_distributed(_lengths_worker, 2, LENGTHS, False, timeout_s=TIMEOUT_S)
    for rank, rows in enumerate(per_rank):
        print(f"\nrank {rank}: {[{k: v for k, v in r.items() if k != 'tb'} for r in rows]}")
        assert [r["T"] for r in rows] == list(LENGTHS), rows
        assert all(r.get("exact") for r in rows), [r.get("tb", r) for r in rows]


@slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_core_inputs_in_the_exchange_layout_fail_at_a_length_without_padding():
    per_rank = run_distributed(_lengths_worker, 2, LENGTHS, True, timeout_s=TIMEOUT_S)
    for rank, rows in enumerate(per_rank):
        print(f"\ncontrol rank {rank}: {[{k: v for k, v in r.items() if k != 'tb'} for r in rows]}")
        assert rows[0].get("exact"), rows
        assert "view size is not compatible" in rows[1].get("error", ""), rows


def _length_inputs(T: int):
    import torch

    gen = torch.Generator().manual_seed(T)
    q, k = (torch.randn(1, T, 1, 4, generator=gen) for _ in range(2))  # one key head for two value heads
    v = torch.randn(1, T, 2, 4, generator=gen)
    return q, k, v, -torch.rand(1, T, 2, generator=gen), torch.rand(1, T, 2, generator=gen)


#: Chunks of 8 tokens: 12 tokens padded by 4, then 16 (two chunks) padded by 0; one graph serves both.
CHUNK, SHORT_LENGTHS = 8, (12, 16)


def _compiled_over_lengths(core) -> dict[int, str]:
    """``core`` (a gated delta rule) compiled ONCE (``aot_eager``, the sequence dim dynamic; forward only: the
    failing view is in the forward) and run at :data:`SHORT_LENGTHS` against the library's eager core;
    ``{T: "exact" | the error's first line}``."""
    import torch
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    library = qwen3_next.torch_chunk_gated_delta_rule.__wrapped__

    def f(q, k, v, g, beta, fn=core):
        return fn(q, k, v, g=g, beta=beta, chunk_size=CHUNK, use_qk_l2norm_in_kernel=True)[0]

    torch.compiler.reset()
    compiled = torch.compile(f, backend="aot_eager")
    out = {}
    try:
        for T in SHORT_LENGTHS:
            inputs = _length_inputs(T)
            for t in inputs:  # the sequence dim only, as cpcompile.shard marks it
                torch._dynamo.mark_dynamic(t, 1)
            try:
                got = compiled(*inputs)
            except RuntimeError as e:
                out[T] = str(e).splitlines()[0]
                continue
            torch.testing.assert_close(got, f(*inputs, fn=library), rtol=0, atol=0)
            out[T] = "exact"
    finally:
        torch.compiler.reset()
    return out


@slow
def test_without_cp_the_substituted_core_compiles_once_over_lengths():
    """Outside a CP context (plain ``torch.compile``, or a CP group of one rank) the substituted gated delta rule
    lays its inputs out heads-major (``cores._heads_major``, values unchanged), so one dynamic ``aot_eager`` compile
    is exact at a length the core pads (12) and one it does not (16, two chunks of 8). The control, the library's
    function compiled the same way, fails at 16 with torch's view error (pytorch/pytorch#144187)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    from cpcompile import cores

    cores.register_known_cores()
    assert _compiled_over_lengths(qwen3_next.torch_chunk_gated_delta_rule) == {12: "exact", 16: "exact"}
    control = _compiled_over_lengths(qwen3_next.torch_chunk_gated_delta_rule.__wrapped__)
    assert control[12] == "exact" and "view size is not compatible" in control[16], control
