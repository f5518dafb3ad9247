"""State passing of the gated delta rule (:mod:`cpcompile.cores`): the fold and correction in one process, and
Qwen3-Next at CP=2 and 3 against the one-process model.

Fast tier: the library's own core (transformers' ``torch_chunk_gated_delta_rule``, chunks of 8 tokens) run on three
runs of a 45-token sequence from the state ``[0 | I]`` on the values ``[v | 0]`` (``cores._from_identity``), the
runs' final states folded in order (``cores._fold``) and each run's output corrected (``cores._corrected``), equals
the core run on the whole sequence; so does the form the CP path runs, each run in a slot of the whole length with
zeros elsewhere (zero tokens are identity steps), summed over the slots. The negative control drops the incoming
state (every run from zero): not close.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness.parity import report
from tests.harness.tiers import slow
from tests.harness.tolerances import STATE_FOLD_TOL
from tests.test_hybrids_parity import DOCS, EXPECTED

#: Runs of the 45-token sequence: cuts inside and at the edge of the core's 8-token chunks.
CUTS = (0, 11, 16, 45)


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    T = CUTS[-1]
    q, k = (torch.randn(2, T, 2, 8, generator=gen) for _ in range(2))  # 2 key heads for 4 value heads
    v = torch.randn(2, T, 4, 6, generator=gen)
    g = -torch.rand(2, T, 4, generator=gen)
    beta = torch.rand(2, T, 4, generator=gen)
    return q, k, v, g, beta


def _core():
    import functools

    from transformers.models.qwen3_next import modeling_qwen3_next

    library = modeling_qwen3_next.torch_chunk_gated_delta_rule.__wrapped__
    return functools.partial(library, chunk_size=8, use_qk_l2norm_in_kernel=True)


def _by_runs(drop_incoming: bool = False) -> torch.Tensor:
    from cpcompile import cores

    core, inputs = _core(), _inputs()
    dv = inputs[2].shape[-1]
    runs = [[t[:, a:b] for t in inputs] for a, b in zip(CUTS, CUTS[1:])]
    outs, finals = zip(*(cores._from_identity(core, *run) for run in runs))
    starts = cores._fold(torch.stack(finals), dv)
    if drop_incoming:
        starts = torch.zeros_like(starts)
    return torch.cat([cores._corrected(o, s, dv) for o, s in zip(outs, starts)], dim=1)


def _by_slots() -> torch.Tensor:
    """Each run in a slot of the whole length, zeros elsewhere; the slots' corrected outputs summed."""
    from cpcompile import cores

    core, inputs = _core(), _inputs()
    dv = inputs[2].shape[-1]
    T = CUTS[-1]
    slots = []
    for a, b in zip(CUTS, CUTS[1:]):
        keep = torch.zeros(T)
        keep[a:b] = 1
        slots.append([t * keep.reshape(1, T, *([1] * (t.dim() - 2))) for t in inputs])
    outs, finals = zip(*(cores._from_identity(core, *slot) for slot in slots))
    starts = cores._fold(torch.stack(finals), dv)
    return sum(cores._corrected(o, s, dv) for o, s in zip(outs, starts))


def test_runs_folded_in_order_equal_the_whole_sequence():
    whole, _ = _core()(*_inputs())
    for name, got in (("runs", _by_runs()), ("slots", _by_slots())):
        print(f"\n{name}: max |diff| {(got - whole).abs().max().item():.2e}")
        torch.testing.assert_close(got, whole, **STATE_FOLD_TOL)


def test_runs_without_their_incoming_state_are_not_the_whole_sequence():
    whole, _ = _core()(*_inputs())
    got = _by_runs(drop_incoming=True)
    print(f"\ncontrol: max |diff| {(got - whole).abs().max().item():.2e}")
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, whole, **STATE_FOLD_TOL)


# -- CP=2 and 3: Qwen3-Next against one process ----------------------------------------------------------------

#: The mixing Qwen3-Next reports with state passing: as head-parallel (tests/test_hybrids_parity.py), the core
#: ``state_passing``.
STATE_EXPECTED = tuple(
    ("torch_chunk_gated_delta_rule", "state_passing") if op == "torch_chunk_gated_delta_rule" else (op, action)
    for op, action in EXPECTED
)


def _aot_case():
    import dataclasses

    return dataclasses.replace(_state_case(doc_lens=((100, 156), (256,))), inner="aot_eager")


def _state_case(layout: str = "contiguous", doc_lens=DOCS):
    import dataclasses

    from tests.test_hybrids_parity import _case

    case = _case(layout=layout)
    return dataclasses.replace(
        case,
        doc_lens=doc_lens,
        expected_mixing=STATE_EXPECTED,
        shard_kwargs=(*case.shard_kwargs, ("recurrence", "state")),
    )


#: T = 37 (the hybrids' packed documents) under the contiguous layout (one run per rank) and the balanced one (at
#: CP=2 with these documents: two runs on a rank); and under ``aot_eager`` at T = 256, whose 128 local tokens need no
#: padding to the core's 64-token chunks (before ``cpcompile::state_input`` its backward failed there with torch's
#: view error, pytorch/pytorch#144187).
CP2 = [_state_case(), _state_case("balanced"), _aot_case()]
CP3 = [_state_case("balanced")]
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
    return {"state": comm.state_bytes, "state_backward": comm.state_backward_bytes, "heads": comm.heads_bytes}


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

    torch.compiler.reset()
    saved = cores._fold
    cores._fold = _no_incoming
    try:
        bad = ParityRunner(cases[0], group).run()
    finally:
        cores._fold = saved
        torch.compiler.reset()
    try:
        assert_parity(bad)
        out["control"] = {"caught": False, **bad.errors()}
    except AssertionError:
        out["control"] = {"caught": True, "failing": failing_quantities(bad), **bad.errors()}
    out["bytes"] = {(T, r): _bytes(group, T, r) for T in BYTES_LENGTHS for r in ("state", "heads")}
    return out


TIMEOUT_S = 900


@pytest.fixture(scope="module")
def cp2():
    from tests.harness.dist import run_distributed

    return run_distributed(_worker, 2, CP2, True, timeout_s=TIMEOUT_S)


@slow
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_cp2_contiguous_balanced_and_aot_eager_equal_one_process(cp2):
    summaries = cp2[0]["cases"]
    report(summaries)
    assert [s["case"] for s in summaries] == [c.name for c in CP2]
    assert [s["runs"] for s in summaries] == [1, 2, 1], summaries


@slow
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_cp2_without_the_incoming_state_fails_parity(cp2):
    for per_rank in cp2:
        control = per_rank["control"]
        print(f"\ncontrol: every run from a zero state: {control}")
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


@slow
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_cp3_balanced_equals_one_process():
    from tests.harness.dist import run_distributed

    summaries = run_distributed(_worker, 3, CP3, False, timeout_s=TIMEOUT_S)[0]["cases"]
    report(summaries)
    assert [s["case"] for s in summaries] == [c.name for c in CP3]


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
