"""Parity of the selective K/V exchange (``cpcompile.backend(..., exchange="selective")``) and its bytes.

Against the unsharded eager model (tests.harness.parity): Llama at CP = 2 and 4, packed documents that cross
ranks and documents that lie on one rank (a one-token document among them), T not a multiple of N, the contiguous
and balanced layouts (balanced with ``Workload(split_keys=True)``, the layout that keeps documents whole, and
without, which here is the ``halves`` candidate), the rewritten graph run as traced and one inductor case, one case
with a receive buffer bounded by ``exchange_slots``. CP=4 and the inductor case are the slow tier.
Every full-attention site must report ``exchange == "selective"``; the bytes each rank received equal the
brute-force count of the keys its queries see on other ranks (tests/test_exchange.py), K and V, every site. A second
batch with other documents (one row a single document) runs exact without a recompile; the profiler sees
all-to-alls and no all-gather, and the elements each forward all-to-all delivered, read from the profiler's record
of the call (independent of cpcompile's accounting), equal the keys that batch's plan says the rank needs.
Negative control: every rank's first needed key left out of the exchange must fail the parity check.
"""

from __future__ import annotations

from unittest import mock

import pytest

from cpcompile.layouts import balance, count_runs
from cpcompile.plan import CPPlan, Workload, build_plan
from cpcompile.testing import packed_batch
from tests.harness.dist import run_distributed
from tests.harness.parity import ParityCase, ParityRunner, assert_parity, assert_rewrites, check_case
from tests.harness.tiers import slow
from tests.test_exchange import brute_force_needs

SELECTIVE = (("exchange", "selective"),)
#: Rows of 63 tokens (T not a multiple of 2 or 4): documents crossing chunk edges and short ones inside one
#: chunk, a one-token document.
DOCS_63 = ((24, 29, 10), (5, 50, 1, 7))
KEEP_WHOLE = (("workload", Workload(block_size=4, split_keys=True)),)
#: Blocks of 4 tokens without keeping documents whole: on DOCS_63 at CP=4 the balanced layout is the ``halves``
#: candidate (checked by ``test_cases_run_the_layouts_they_name``).
HALVES = (("workload", Workload(block_size=4)),)

#: Per CP size: (the case whose bytes and negative control are checked, further cases).
CASES = {
    2: (
        ParityCase(model="llama", doc_lens=DOCS_63, backend_kwargs=SELECTIVE),
        (
            # a receive buffer of 28 key slots (the all-gather's: 32); this batch needs at most 27 (row 1)
            ParityCase(model="llama", doc_lens=DOCS_63, backend_kwargs=(*SELECTIVE, ("exchange_slots", 28))),
        ),
    ),
    4: (
        ParityCase(
            model="llama", doc_lens=DOCS_63, backend_kwargs=SELECTIVE, layout="balanced", shard_kwargs=KEEP_WHOLE
        ),
        (
            ParityCase(
                model="llama", doc_lens=DOCS_63, backend_kwargs=SELECTIVE, layout="balanced", shard_kwargs=HALVES
            ),
        ),
    ),
}
#: The inductor case (slow tier), checked like the cases above: bytes, another batch, the negative control.
INDUCTOR = ParityCase(model="llama", doc_lens=DOCS_63, backend_kwargs=SELECTIVE, inner="inductor")


def _worker(rank, world_size, case, others):
    import torch.distributed as dist

    group = dist.group.WORLD
    runner = ParityRunner(case, group)
    outcome = runner.run()
    sites = [r.exchange for r in runner.backend.reports]
    assert sites == ["selective"] * len(sites) and sites, sites
    assert_rewrites(outcome, len(sites))
    assert_parity(outcome)
    # bytes: every exchange received exactly the brute-force needs of this rank (K and V, every site)
    plan = build_plan(runner.batch, world_size, rank, layout=case.layout, **case.plan_kwargs())
    config = runner.model.config
    heads_dim = config.num_key_value_heads * (config.head_dim or config.hidden_size // config.num_attention_heads)
    needed = len(brute_force_needs(plan, None, rank))
    per_exchange = needed * len(case.doc_lens) * heads_dim * 4
    bytes_check = (outcome.comm.halo_bytes, 2 * len(sites) * per_exchange, needed)
    # another batch, other documents, same length: exact, no recompile, and the profiler sees all-to-alls and no
    # all-gather of K/V
    T = sum(case.doc_lens[0])
    other = packed_batch([[T // 3, T - T // 3 - 2, 2], [T]], seed=7)
    second = runner.run(batch=other, profile=True)
    assert_parity(second)
    assert second.counter_delta.get("graphs", 0) == 0, second.counter_delta
    seen = sorted(second.collectives)
    assert any("all_to_all" in n for n in seen) and not any("all_gather" in n for n in seen), seen
    # the profiler's own record of the forward exchanges (K and V of every site, before the backward's): each
    # delivered the keys the second batch's plan says this rank's queries need from other ranks, every row
    other_plan = build_plan(other, world_size, rank, layout=case.layout, **case.plan_kwargs())
    forward = second.all_to_all_received[: 2 * len(sites)]
    per_call = len(brute_force_needs(other_plan, None, rank)) * len(other["input_ids"]) * heads_dim
    profiled = (forward, [per_call] * (2 * len(sites)))
    # negative control: every rank's first needed key left out of the exchange
    original = CPPlan.exchange_needs

    def one_short(plan, window, rank=None, **kwargs):
        return original(plan, window, rank, **kwargs)[1:]

    with mock.patch.object(CPPlan, "exchange_needs", one_short):
        bad = runner.run()
    try:
        assert_parity(bad)
        control = None
    except AssertionError as e:
        control = str(e).splitlines()[0]
    summaries = [{"case": case.name, "cp": world_size, **outcome.errors()}]
    summaries += [check_case(other, group) for other in others]
    return {"summaries": summaries, "bytes": bytes_check, "profiled": profiled, "control": control}


def test_cases_run_the_layouts_they_name():
    """The CP=4 cases: keeping documents whole picks the ``pairs`` candidate, the other the ``halves`` one, and
    both give some rank several runs of tokens."""
    batch = packed_batch([list(row) for row in DOCS_63])
    plan = build_plan(batch, 4, 0, layout="contiguous")
    for kwargs, name in ((KEEP_WHOLE, "pairs[doc]"), (HALVES, "halves[doc]")):
        found = balance(plan.padded_len, 4, plan.doc_ids, dict(kwargs)["workload"])
        assert found.chosen == name, (found.chosen, name)
        assert int(count_runs(found.indices).max()) > 1


# Generous limits: they only cut a hang (the machine may be shared).
TIMEOUT_S = 420


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=slow)])
def test_selective_exchange_parity(cp):
    _check(run_distributed(_worker, cp, *CASES[cp], timeout_s=TIMEOUT_S))


@slow
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_selective_exchange_parity_inductor():
    _check(run_distributed(_worker, 2, INDUCTOR, (), timeout_s=TIMEOUT_S))


def _check(results: list[dict]) -> None:
    assert any(res["bytes"][2] for res in results), "no rank needed keys of another rank: the case tests nothing"
    for rank, res in enumerate(results):
        got, expected, _ = res["bytes"]
        assert got == expected, (rank, got, expected)
        forward, expected = res["profiled"]
        assert forward == expected and forward, (rank, forward, expected)
    assert all(res["control"] is not None for res in results if res["bytes"][2]), [r["control"] for r in results]
    for s in results[0]["summaries"]:
        print(f"{s['case']} CP={s['cp']}: logits {s['logits']:.1e} loss {s['loss']:.1e} grad {s['grad']:.1e}")
    print("first needed key left out:", results[0]["control"])
