"""Parity of models that mix tokens outside attention, compiled with cpcompile at CP=2 and CP=4 (gloo processes), vs
the same model run whole in one process on the same global batch. ONE spawned group of 4 processes runs every case.

Models: ``tests.models.mixing.mixer_lm`` with a causal depthwise conv1d (``conv``), a pad-and-slice token shift
(``shift``) and positions from a cumsum of a mask (``mask_cumsum``), each before a packed-document attention
layer; transformers LFM2 (``Lfm2ForCausalLM``, ``layer_types=["conv", "full_attention"]``, the ``lfm2`` family).
T = 37 is not a multiple of 2 or 4: the last rank holds padding tokens, which sit after every real token and so
never reach a real token through a causal op. Documents cross chunk edges; the conv does not reset at document
edges (neither does the one-process model).

Each case asserts the logits, the summed loss and every summed gradient (``tests.harness.parity`` tolerances), the SDPA
sites rewritten, the mixing ops reported (``expected_mixing``: the conv and the shift take a ``halo``, the cumsum is
``gathered``) and one halo exchange or sequence all-gather per region per step. The negative control of every kind
of region (conv, shift, scan) and of LFM2 compiles the same case with ``cpcompile.backend(..., mixing="off")``: the
parity check must fail, on the logits; the conv and LFM2 also with a halo one token short (``short_halo``).

The 4 processes run CP=2 on ranks {0, 1} (contiguous layout, ``inner="eager"``, with the controls) and on {2, 3}
(the conv model with inductor: the halo ops compiled for real through AOTAutograd; the conv model in a static
graph, ``shard(dynamic=False)``, where the trim ``[..., :T]`` is a constant; the conv model under the balanced
layout, two runs per rank whose halos come from the other rank; the per-token forms the mixing pass accepts next
to refused ones of the same ops: ``token_norm``, ``feature_setitem``, ``head_repeat``; a cumulative sum along the
sequence after the conv's trim, ``conv_cumsum``, dynamic and static, where the scan's region reads the end of the
conv's rewritten region; a cumulative sum after a ``baddbmm`` whose rows merge batch and sequence,
``merged_rows_cumsum``, static; these three with the pass-off control) side by side, then CP=3 on
ranks {0, 1, 2} (the conv, balanced at T = 37, and head_tail at T = 7: runs of one or two tokens, shorter than the
conv's halo of 2, fetched from two ranks and from the rank's own other run) and CP=4 on all four under the balanced
layout (each rank holds several runs of tokens), with the conv and LFM2 under head_tail at T = 8 (runs of one
token). The inductor case, CP=3 and CP=4 are the slow tier.
"""

from __future__ import annotations

import pytest

from cpcompile.layouts import Workload
from tests.harness.dist import run_distributed
from tests.harness.parity import ParityCase, assert_controls, report
from tests.harness.tiers import runs_slow, slow

DOCS = ((10, 20, 7), (5, 30, 2))
LOSS = ("cross_entropy", "partial_sum")
EXPECTED = {
    "conv": (("conv1d", "halo"), LOSS),
    "shift": (("pad", "halo"), LOSS),
    "mask_cumsum": (("cumsum", "gathered"), LOSS),
    "lfm2": (("conv1d", "halo"), LOSS),
    # per token: a norm over the features, msort over the batch rows, tril of per-token matrices, a feature write,
    # repeat_interleave along a heads dim
    "token_norm": (LOSS,),
    "feature_setitem": (LOSS,),
    "head_repeat": (LOSS,),
    # a scan that reads a rewritten region's end: the conv takes its halo, then the cumsum runs on the whole sequence
    "conv_cumsum": (("conv1d", "halo"), ("cumsum", "gathered"), LOSS),
    # a cumsum after a baddbmm of the tokens with batch and sequence merged into its rows
    "merged_rows_cumsum": (("cumsum", "gathered"), LOSS),
}


def _case(name: str, inner: str = "eager", layout: str = "contiguous", dynamic: bool = True, docs=DOCS) -> ParityCase:
    balanced = layout == "balanced"
    shard_kwargs = (("workload", Workload(block_size=4)),) if balanced else ()
    return ParityCase(
        model=name if name == "lfm2" else "tests.models.mixing:mixer_lm",
        doc_lens=docs,
        inner=inner,
        overrides=() if name == "lfm2" else (("mixer", name),),
        expected_sites=1,
        layout=layout,
        expected_mixing=EXPECTED[name],
        # kernel blocks of 4 tokens give the balanced layout something to balance at this length
        shard_kwargs=shard_kwargs + ((("dynamic", False),) if not dynamic else ()),
    )


PAIR0 = [_case(m) for m in ("conv", "shift", "mask_cumsum", "lfm2")]
#: The controls of PAIR0's cases: every region's pass off, and a halo one token short where it has 2 tokens or more.
CONTROLS = {
    "conv": ("mixing_off", "short_halo"),
    "shift": ("mixing_off",),
    "mask_cumsum": ("mixing_off",),
    "lfm2": ("mixing_off", "short_halo"),
}
PAIR1 = [
    _case("conv", dynamic=False),
    _case("conv", layout="balanced"),
    _case("token_norm"),
    _case("feature_setitem"),
    _case("head_repeat"),
    _case("conv_cumsum"),
    _case("conv_cumsum", dynamic=False),
    _case("merged_rows_cumsum", dynamic=False),
]
#: The controls of PAIR1's cases: the regions' pass off.
CONTROLS1 = {"conv_cumsum": ("mixing_off",), "merged_rows_cumsum": ("mixing_off",)}
#: The slow tier adds the inductor case to ranks {2, 3}, and ``CP4``.
PAIR1_SLOW = [_case("conv", inner="inductor")]
#: Runs shorter than the conv's halo of 2 tokens (head_tail at T = 7 over 3 ranks, T = 8 over 4: one token each).
TINY = {3: ((3, 4), (7,)), 4: ((3, 5), (8,))}
CP3 = [_case("conv", layout="balanced"), _case("conv", layout="head_tail", docs=TINY[3])]
CP4 = [_case(m, layout="balanced") for m in ("conv", "shift", "mask_cumsum", "lfm2")] + [
    _case(m, layout="head_tail", docs=TINY[4]) for m in ("conv", "lfm2")
]


def _run(cases, group, controls=None):
    import torch

    from tests.harness.parity import check_case

    out = []
    for case in cases:
        torch.compiler.reset()
        name = case.model if case.model == "lfm2" else dict(case.overrides)["mixer"]
        out.append(check_case(case, group, controls=(controls or {}).get(name, ())))
    return out


def _worker(rank: int, world: int, with_slow: bool) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank takes part in creating every group
    three = dist.new_group([0, 1, 2])
    out = {}
    if rank < 2:
        out["cp2"] = _run(PAIR0, pairs[0], CONTROLS)
    else:
        out["cp2"] = _run(PAIR1 + PAIR1_SLOW * with_slow, pairs[1], CONTROLS1)
    if with_slow and rank < 3:
        out["cp3"] = _run(CP3, three)
    if with_slow:
        out["cp4"] = _run(CP4, dist.group.WORLD)
    return out


TIMEOUT_S = 900


@pytest.fixture(scope="module")
def results(request):
    return run_distributed(_worker, 4, runs_slow(request), timeout_s=TIMEOUT_S)


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_cp2_contiguous_with_controls(results):
    summaries = results[0]["cp2"]
    report(summaries)
    assert [s["case"] for s in summaries] == [c.name for c in PAIR0]
    assert [set(s["controls"]) for s in summaries] == [
        {"mixing_off", "short_halo"},
        {"mixing_off"},
        {"mixing_off"},
        {"mixing_off", "short_halo"},
    ]
    assert_controls(summaries)


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_cp2_static_and_per_token_forms(results):
    summaries = results[2]["cp2"][: len(PAIR1)]
    report(summaries)
    assert [s["case"] for s in summaries] == [c.name for c in PAIR1]
    names = [dict(c.overrides).get("mixer") for c in PAIR1]
    assert [set(s["controls"]) for s in summaries] == [set(CONTROLS1.get(n, ())) for n in names]
    assert_controls(summaries)


@slow
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_cp2_inductor(results):
    summaries = results[2]["cp2"][len(PAIR1) :]
    report(summaries)
    assert [s["case"] for s in summaries] == [c.name for c in PAIR1_SLOW]


@slow
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_cp3_halo_across_ranks(results):
    summaries = results[0]["cp3"]
    report(summaries)
    assert [s["case"] for s in summaries] == [c.name for c in CP3]
    assert all(s["runs"] > 1 for s in summaries), [s["runs"] for s in summaries]


@slow
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_cp4_balanced(results):
    summaries = results[0]["cp4"]
    report(summaries)
    assert [s["case"] for s in summaries] == [c.name for c in CP4]
    assert all(s["runs"] > 1 for s in summaries), [s["runs"] for s in summaries]
