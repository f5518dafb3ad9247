"""State passing of the gated delta rule, Mamba2's SSD and the RG-LRU (:mod:`cpcompile.cores`): the fold and
correction in one process, and Qwen3-Next, Bamba and RecurrentGemma at CP=2, 3 and 4 against the one-process model.

Fast tier: each library core (transformers' ``torch_chunk_gated_delta_rule`` and Bamba's ``mamba2_chunk_scan``,
chunks of 8 tokens; RecurrentGemma's ``RecurrentGemmaRglru._rnn_scan``, with documents restarting inside a run and
at a run's first token) run on three runs of a 45-token sequence from the state ``[0 | I]``
(``cores._from_identity``, ``cores._ssd_from_identity``, ``cores._rg_lru_from_identity``), the runs' final states
folded in order (``cores._fold``) and each run's output corrected (``cores._corrected``), equals the core run on the
whole sequence; so does the form the CP path runs for the first two, each run in a slot of the whole length with
zeros elsewhere (zero tokens are identity steps), summed over the slots. The negative control drops the incoming
state (every run from zero): not close.

Slow tier: Qwen3-Next (contiguous, balanced, ``aot_eager``), Bamba and RecurrentGemma (contiguous, balanced) at
CP=2 with one control per core (every run from a zero state: parity fails) and the bytes against the length;
Granite-4 hybrid, Falcon-H1, Mamba2, Nemotron-H and Zamba2 balanced at CP=2; Qwen3-Next and RecurrentGemma balanced
at CP=3; Qwen3-Next, Bamba and RecurrentGemma balanced at CP=4 (three runs on a rank).
"""

from __future__ import annotations

import pytest
import torch

from tests.harness.parity import report
from tests.harness.tiers import slow
from tests.harness.tolerances import SSD_STATE_FOLD_TOL, STATE_FOLD_TOL
from tests.test_hybrids_parity import DOCS

#: Runs of the 45-token sequence: cuts inside and at the edge of the cores' 8-token chunks.
CUTS = (0, 11, 16, 45)
T_FOLD = CUTS[-1]


def _gdr():
    """The gated delta rule's fold form: ``(core, inputs, from_identity, dv, transpose_final)``: 2 key heads for 4
    value heads."""
    import functools

    from transformers.models.qwen3_next import modeling_qwen3_next

    from cpcompile import cores

    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, T_FOLD, 2, 8, generator=gen) for _ in range(2))
    v = torch.randn(2, T_FOLD, 4, 6, generator=gen)
    g = -torch.rand(2, T_FOLD, 4, generator=gen)
    beta = torch.rand(2, T_FOLD, 4, generator=gen)
    library = modeling_qwen3_next.torch_chunk_gated_delta_rule.__wrapped__
    core = functools.partial(library, chunk_size=8, use_qk_l2norm_in_kernel=True)
    whole, _ = core(q, k, v, g, beta)
    return whole, (q, k, v, g, beta), lambda *run: cores._from_identity(core, *run), 6, False


def _ssd():
    """Mamba2's SSD: 4 heads of 6 channels in 2 groups, state 5, the step sizes biased, softplus'd and clamped
    (a lower limit above zero: the zero steps of the slots must not be clamped)."""
    import functools

    from transformers.models.bamba import modeling_bamba

    from cpcompile import cores

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, T_FOLD, 4, 6, generator=gen)
    dt = torch.randn(2, T_FOLD, 4, generator=gen)
    A = -torch.rand(4, generator=gen) - 0.5
    B, C = (torch.randn(2, T_FOLD, 2, 5, generator=gen) for _ in range(2))
    D, dt_bias = torch.randn(4, generator=gen), torch.randn(4, generator=gen)
    step = (dt_bias, True, (0.01, 5.0))
    library = modeling_bamba.mamba2_chunk_scan.__wrapped__
    core = functools.partial(library, chunk_size=8, D=D)
    whole = core(x, dt, A, B, C, dt_bias=dt_bias, dt_softplus=True, dt_limit=step[2])
    steps = cores._ssd_steps(dt, step)
    return whole, (x, steps, B, C), lambda x, s, b, c: cores._ssd_from_identity(core, x, s, A, b, c), 6, True


def _rg_lru():
    """The RG-LRU's diagonal recurrence over 6 channels, with a document restarting inside the second run (token
    13) and one at the third run's first token (16): the resets are folded into the gate (a zero step) before the
    runs, as the CP path does."""
    import functools

    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

    from cpcompile import cores

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, T_FOLD, 6, generator=gen)
    gate = torch.rand(2, T_FOLD, 6, generator=gen) * 0.5 + 0.5
    reset = torch.zeros(2, T_FOLD, 1, dtype=torch.bool)
    reset[:, [0, 13, 16]] = True
    core = functools.partial(RecurrentGemmaRglru._rnn_scan, None, acc_dtype=torch.float32)
    whole, _ = core(x, gate, reset, None)
    return whole.unsqueeze(-1), (x, gate * ~reset), lambda *run: cores._rg_lru_from_identity(core, *run), 1, False


#: Each form: how to build it, its tolerance, and whether it runs in slots (zero tokens are identity steps: not so
#: for the RG-LRU, whose zero gate restarts the state; its CP path sets the gate to one outside a run).
FORMS = {
    "gated_delta_rule": (_gdr, STATE_FOLD_TOL, True),
    "ssd": (_ssd, SSD_STATE_FOLD_TOL, True),
    "rg_lru": (_rg_lru, STATE_FOLD_TOL, False),
}


def _folded(form: str, slots: bool, drop_incoming: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(whole, got)``: the core on the whole sequence, and by runs (each run alone; with ``slots``, each run in
    a slot of the whole length with zeros elsewhere, summed over the slots) folded and corrected."""
    from cpcompile import cores

    whole, inputs, from_identity, dv, transpose = FORMS[form][0]()
    pieces = []
    for a, b in zip(CUTS, CUTS[1:]):
        if slots:
            keep = torch.zeros(T_FOLD)
            keep[a:b] = 1
            pieces.append([t * keep.reshape(1, T_FOLD, *([1] * (t.dim() - 2))) for t in inputs])
        else:
            pieces.append([t[:, a:b] for t in inputs])
    outs, finals = zip(*(from_identity(*piece) for piece in pieces))
    starts = cores._fold(torch.stack([f.transpose(-1, -2) if transpose else f for f in finals]), dv)
    if drop_incoming:
        starts = torch.zeros_like(starts)
    corrected = [cores._corrected(o, s, dv) for o, s in zip(outs, starts)]
    return whole, sum(corrected) if slots else torch.cat(corrected, dim=1)


@pytest.mark.parametrize("form", FORMS)
def test_runs_folded_in_order_equal_the_whole_sequence(form):
    for slots in (False, True)[: 1 + FORMS[form][2]]:
        whole, got = _folded(form, slots)
        print(f"\n{form} {'slots' if slots else 'runs'}: max |diff| {(got - whole).abs().max().item():.2e}")
        torch.testing.assert_close(got, whole, **FORMS[form][1])


@pytest.mark.parametrize("form", FORMS)
def test_runs_without_their_incoming_state_are_not_the_whole_sequence(form):
    whole, got = _folded(form, slots=False, drop_incoming=True)
    print(f"\ncontrol {form}: max |diff| {(got - whole).abs().max().item():.2e}")
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, whole, **FORMS[form][1])


# -- CP=2, 3 and 4: the models against one process --------------------------------------------------------------

#: The cores that run by state passing, as the mixing pass names them.
STATE_CORES = ("torch_chunk_gated_delta_rule", "mamba2_chunk_scan", "_rnn_scan")


def _head_parallel_case(model: str, layout: str):
    """``model``'s head-parallel case: RecurrentGemma's from tests/test_recurrent_parity.py, the others' from
    tests/test_hybrids_parity.py."""
    if model == "recurrent_gemma":
        from tests.test_recurrent_parity import _case
    else:
        from tests.test_hybrids_parity import _case
    return _case(layout=layout, model=model)


def _state_expected(expected) -> tuple[tuple[str, str], ...]:
    """The mixing a model reports with state passing: as head-parallel (``expected``), its core ``state_passing``."""
    return tuple((op, "state_passing") if op in STATE_CORES else (op, a) for op, a in expected)


def _aot_case():
    import dataclasses

    return dataclasses.replace(_state_case(doc_lens=((100, 156), (256,))), inner="aot_eager")


def _state_case(layout: str = "contiguous", doc_lens=DOCS, model: str = "qwen3_next"):
    import dataclasses

    case = _head_parallel_case(model, layout)
    return dataclasses.replace(
        case,
        doc_lens=doc_lens,
        expected_mixing=_state_expected(case.expected_mixing),
        shard_kwargs=(*case.shard_kwargs, ("recurrence", "state")),
    )


#: T = 37 (the hybrids' packed documents) under the contiguous layout (one run per rank) and the balanced one (at
#: CP=2 with these documents: two runs on a rank); and under ``aot_eager`` at T = 256, whose 128 local tokens need no
#: padding to the core's 64-token chunks (before ``cpcompile::state_input`` its backward failed there with torch's
#: view error, pytorch/pytorch#144187).
#: Bamba (Mamba2's SSD) and RecurrentGemma (the RG-LRU, ``inner="eager"`` as in tests/test_recurrent_parity.py:
#: its loop over tokens traced by AOTAutograd and inductor was checked by hand) under the contiguous and the
#: balanced layout at T = 37.
CP2 = [
    _state_case(),
    _state_case("balanced"),
    _aot_case(),
    _state_case(model="bamba"),
    _state_case("balanced", model="bamba"),
    _state_case(model="recurrent_gemma"),
    _state_case("balanced", model="recurrent_gemma"),
]
#: The cases whose negative control (every run from a zero state) runs too: one per core.
CONTROLS = (0, 3, 5)
CP3 = [_state_case("balanced"), _state_case("balanced", model="recurrent_gemma")]
#: The other families of the SSD core (their mixers call it with their own configs: Falcon-H1's SSD beside
#: attention, Granite-4's beside MoE feed-forwards, Zamba2's shared attention), balanced at CP=2 (two runs on a rank).
SSD_FAMILIES_CP2 = [
    _state_case("balanced", model=m) for m in ("granitemoehybrid", "falcon_h1", "mamba2", "nemotron_h", "zamba2")
]
#: CP=4 balanced at T = 37: three runs on a rank for every core, so the fold crosses runs of every rank in between.
CP4 = [
    _state_case("balanced"),
    _state_case("balanced", model="bamba"),
    _state_case("balanced", model="recurrent_gemma"),
]
#: Two global lengths of one document each (contiguous: one run per rank whatever T): the state bytes per step must
#: be the same, the head-parallel bytes grow with T.
BYTES_LENGTHS = (37, 101)


def _no_incoming(summaries, dv):
    """The negative control's fold: every run starts from a zero state."""
    return summaries.new_zeros((*summaries.shape[:-1], dv), dtype=torch.float32)


def _bytes(group, T: int, recurrence: str) -> dict:
    import dataclasses

    from tests.harness.parity import ParityRunner, assert_parity

    torch.compiler.reset()
    case = dataclasses.replace(_state_case(doc_lens=((T,), (T // 2, T - T // 2))), expected_mixing=None)
    case = dataclasses.replace(case, shard_kwargs=(("recurrence", recurrence),))
    outcome = ParityRunner(case, group).run()
    assert_parity(outcome)
    comm = outcome.comm
    return {
        "state": comm.state_bytes,
        "state_backward": comm.state_backward_bytes,
        "heads": comm.heads_bytes,
        "reported": outcome.reported_bytes,
    }


def _worker(rank: int, world: int, cases: list, extras: bool) -> dict:
    import torch.distributed as dist

    from cpcompile import cores
    from tests.test_hybrids_parity import _run

    torch.set_num_threads(1)
    group = dist.group.WORLD
    out = {"cases": _run(cases, group)}
    if not extras:
        return out
    from tests.harness.parity import ParityRunner, assert_parity, failing_quantities

    out["controls"] = {}
    for i in CONTROLS:
        torch.compiler.reset()
        saved = cores._fold
        cores._fold = _no_incoming
        try:
            bad = ParityRunner(cases[i], group).run()
        finally:
            cores._fold = saved
            torch.compiler.reset()
        try:
            assert_parity(bad)
            out["controls"][cases[i].model] = {"caught": False, **bad.errors()}
        except AssertionError:
            out["controls"][cases[i].model] = {"caught": True, "failing": failing_quantities(bad), **bad.errors()}
    out["bytes"] = {(T, r): _bytes(group, T, r) for T in BYTES_LENGTHS for r in ("state", "heads")}
    return out


TIMEOUT_S = 900


@pytest.fixture(scope="module")
def cp2():
    from tests.harness.dist import run_distributed

    return run_distributed(_worker, 2, CP2, True, timeout_s=TIMEOUT_S)


@slow
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_cp2_every_core_contiguous_balanced_and_aot_eager_equal_one_process(cp2):
    summaries = cp2[0]["cases"]
    report(summaries)
    assert [s["case"] for s in summaries] == [c.name for c in CP2]
    assert [s["runs"] for s in summaries] == [1, 2, 1, 1, 2, 1, 2], summaries


@slow
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_cp2_without_the_incoming_state_fails_parity(cp2):
    for per_rank in cp2:
        controls = per_rank["controls"]
        print(f"\ncontrols: every run from a zero state: {controls}")
        assert sorted(controls) == ["bamba", "qwen3_next", "recurrent_gemma"], controls
        for control in controls.values():
            assert control["caught"] and "logits" in control["failing"], control


@slow
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_cp2_state_bytes_do_not_grow_with_the_length(cp2):
    got = cp2[0]["bytes"]
    print(f"\nbytes per step (T, recurrence): {got}")
    (short, long) = BYTES_LENGTHS
    assert got[(short, "state")] == got[(long, "state")], got
    assert got[(short, "state")]["state"] > 0 and got[(short, "state")]["heads"] == 0, got
    assert got[(short, "heads")]["state"] == 0 and got[(long, "heads")]["heads"] > got[(short, "heads")]["heads"], got
    for measured in got.values():  # one graph, run once: what the mixing reports give per call is what moved
        assert measured["reported"] == {"heads": measured["heads"], "state": measured["state"]}, got


#: The jobs beyond the CP=2 fixture: the CP size, the cases, and the runs of consecutive tokens the most loaded rank
#: holds in each.
REPEATS = {
    "cp2_other_ssd_families": (2, SSD_FAMILIES_CP2, [2] * len(SSD_FAMILIES_CP2)),
    "cp3_balanced": (3, CP3, [3, 3]),
    "cp4_balanced_every_core": (4, CP4, [3, 3, 3]),
}


@slow
@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("repeat", REPEATS)
def test_more_families_and_ranks_equal_one_process(repeat):
    from tests.harness.dist import run_distributed

    cp, cases, runs = REPEATS[repeat]
    summaries = run_distributed(_worker, cp, cases, False, timeout_s=TIMEOUT_S)[0]["cases"]
    report(summaries)
    assert [s["case"] for s in summaries] == [c.name for c in cases]
    assert [s["runs"] for s in summaries] == runs, summaries


def test_an_unknown_recurrence_is_refused_naming_the_choices():
    from cpcompile.runtime.shard_options import ShardOptions, validate_options

    options = ShardOptions(
        layout="contiguous",
        workload=None,
        num_items_in_batch=None,
        dp_group=None,
        pad_token_id=0,
        hf_kwargs=True,
        dynamic=True,
        pad_values=None,
        recurrence="scan",
    )
    with pytest.raises(ValueError, match=r"recurrence='scan' is not a known mode; choose one of \('state', 'heads'\)"):
        validate_options({"input_ids": torch.zeros(1, 4, dtype=torch.long)}, "", options)
