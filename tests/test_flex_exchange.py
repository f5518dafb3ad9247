"""The selective exchange at flex_attention sites (``cpcompile.backend(..., exchange="selective")``): a rank
receives only the keys its queries see under the site's ``mask_mod``, evaluated at global indices.

* In one process: :meth:`BoundMods.keys_seen` (what a rank asks for) against the brute-force union over the
  queries of the dense mask_mod (hypothesis: random documents, windows, a bidirectional prefix, padding, CP 2 to 8
  under every layout), and a selective flex site whose mods have no mask.
* ONE spawned group of 4 gloo processes: CP=2 on ranks {0, 1} (contiguous layout: the ``document`` form, with
  its bytes, a second batch and the negative control; transformers' flex path on Qwen3-MoE; torchtitan's trainer
  masks), CP=2 on {2, 3} (balanced: the ``sliding`` form, with its bytes; transformers' flex path on LFM2, a
  hybrid), then CP=4 on all four (balanced: soft-capping with the logsumexp; transformers' flex path on Gemma 3,
  sliding-window and global layers). T = 37 is not a multiple of 2 or 4. Every site must report
  ``exchange == "selective"``, no K/V all-gather may run, and one routing all-gather per site and forward.
* Bytes: each exchange of the ``document`` and ``sliding`` forms received exactly the keys this rank's queries see
  on other ranks, counted from the dense mask of the plan (``tests.test_exchange.brute_force_needs``: causal, same
  document, within the window), K and V, every row. A second batch with other documents runs exact without a
  recompile.
* The fast tier runs the ``document`` and ``sliding`` forms at CP=2; transformers' flex path, torchtitan's trainer
  masks and CP=4 are the slow tier.
* Negative control: every rank's first needed key left out of the routing must fail the parity check.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cpcompile.kernels import FlexMods, bind_mods, register_flex_mods
from cpcompile.plan import CPPlan, build_plan
from cpcompile.testing import packed_batch
from tests.harness.dist import run_distributed
from tests.harness.parity import ParityCase
from tests.harness.tiers import runs_slow, slow
from tests.models import flex as _flex_models
from tests.test_exchange import SETTINGS, brute_force_needs, packed
from tests.test_flex import DOCS
from tests.test_flex import _case as flex_case
from tests.test_flex import _hf_case as hf_flex_case

SELECTIVE = (("exchange", "selective"),)
#: The spawned group's fixture runs inside its first test: a limit that only cuts a hang (4 processes compiling on
#: 2 shared cores, next to another file's group under ``-n 2``).
pytestmark = pytest.mark.timeout(660)


# -- what a rank asks for (one process) ----------------------------------------------------------------------
@SETTINGS
@given(packed(), st.integers(0, 12), st.integers(0, 3))
def test_keys_seen_is_the_dense_mask_mod_union(drawn, prefix, padding):
    """Every key some real query of a rank sees under the mask_mod (causal within documents, a sliding window,
    and a bidirectional prefix of ``prefix`` tokens per document, which no causal rule gives), and no other:
    against the dense mask_mod evaluated on every (query, key) pair of the rank, padding tokens excluded."""
    batch, cp, layout, window, _ = drawn
    plan = build_plan(batch, cp, 0, **layout)
    docs = plan.doc_ids
    T = max(plan.seq_len - padding, 1)  # the last ``padding`` tokens count as padding here
    limit = window or T + 1

    starts = torch.stack([torch.searchsorted(row.contiguous(), row) for row in docs])  # each token's document start

    def mask_mod(b, h, q, kv):
        same = docs[b, q] == docs[b, kv]
        in_prefix = (q - starts[b, q] < prefix) & (kv - starts[b, q] < prefix)
        return same & (((kv <= q) & (q - kv < limit)) | in_prefix)

    register_flex_mods("test_flex_exchange:prefix", FlexMods(mask_mod, None))
    bound = bind_mods("test_flex_exchange:prefix", [], T, 2)
    keys = plan.gathered_indices()
    for rank in range(cp):
        q_pos = plan.token_indices(rank)
        seen = bound.keys_seen(plan.batch_size, q_pos, keys, 3, 5)
        i, j = q_pos[q_pos < T][:, None], keys[None, :]
        dense = torch.zeros(keys.shape[0], dtype=torch.bool)
        for b in range(plan.batch_size):
            dense |= (mask_mod(b, 0, i, j) & (j < T)).any(0)
        assert torch.equal(seen, dense), (rank, seen.nonzero().flatten(), dense.nonzero().flatten())


def test_keys_seen_without_a_mask_is_every_real_key():
    register_flex_mods("test_flex_exchange:none", FlexMods(None, None))
    bound = bind_mods("test_flex_exchange:none", [], 5, 1)
    seen = bound.keys_seen(1, torch.arange(3), torch.tensor([-1, 0, 4, 5, 6]), 2, 2)
    assert seen.tolist() == [False, True, True, False, False]


# -- parity (one spawned group of 4) -------------------------------------------------------------------------
def _case(form: str, layout: str = "contiguous") -> ParityCase:
    return flex_case(form, layout, "aot_eager", SELECTIVE)


def _hf_case(family: str, layers: int = 1, layout: str = "contiguous") -> ParityCase:
    return hf_flex_case(family, layers, layout, SELECTIVE)


#: Cases whose mask is a rule of the plan (form -> window): their bytes are checked against the dense mask.
RULES = {"tests.models.flex:document": None, "tests.models.flex:sliding": _flex_models.WINDOW}
#: The fast tier's cases (``PAIR0``, ``PAIR1``: the two forms whose bytes are checked) and those the slow tier adds
#: (``*_SLOW``: transformers' flex path, torchtitan's trainer masks, and ``CP4``).
PAIR0 = [_case("document")]
PAIR0_SLOW = [
    _hf_case("qwen3_moe"),
    ParityCase(
        model="tests.models.flex:torchtitan_trainer",
        doc_lens=DOCS,
        inner="aot_eager",
        batch_extras="tests.models.flex:torchtitan_trainer_masks",
        backend_kwargs=SELECTIVE,
    ),
]
PAIR1 = [_case("sliding", "balanced")]
PAIR1_SLOW = [_hf_case("lfm2", 2, "balanced")]
CP4 = [_case("softcap", "balanced"), _hf_case("gemma3", 2, "balanced")]
#: Seconds the spawned group may take (4 processes compiling on 2 shared cores).
TIMEOUT_S = 600.0
#: K or V bytes per token and row of the tiny flex models (TinyLM defaults: 2 KV heads of 8 dims, fp32).
KV_TOKEN_BYTES = 2 * 8 * 4


@contextlib.contextmanager
def _first_needed_key_left_out():
    original = CPPlan.routing

    def one_short(plan, needs, slots, **kwargs):
        return original(plan, [n[1:] for n in needs], slots, **kwargs)

    CPPlan.routing = one_short
    try:
        yield
    finally:
        CPPlan.routing = original


def _run(cases, group) -> list[dict]:
    import torch.distributed as dist

    from tests.harness.parity import ParityRunner, assert_parity, failing_quantities

    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    out = []
    for case in cases:
        torch.compiler.reset()
        runner = ParityRunner(case, group)
        outcome = runner.run()
        assert_parity(outcome)
        summary = {
            "case": outcome.name,
            **outcome.errors(),
            "exchanges": [r.exchange for r in runner.backend.reports],
            "comm": (outcome.comm.all_gathers, outcome.comm.halo_exchanges, outcome.comm.routing_gathers),
        }
        if case.model in RULES:
            plan = build_plan(runner.batch, cp, rank, layout=case.layout, **case.plan_kwargs())
            needed = len(brute_force_needs(plan, RULES[case.model], rank))
            summary["bytes"] = (outcome.comm.halo_bytes, 2 * needed * len(case.doc_lens) * KV_TOKEN_BYTES, needed)
        if case.model == "tests.models.flex:document":
            T = sum(case.doc_lens[0])
            other = packed_batch([[T // 3, T - T // 3 - 2, 2], [T]], seed=7)
            second = runner.run(batch=other, profile=True)
            assert_parity(second)
            summary["second_compiles"] = second.counter_delta.get("graphs", 0)
            # the profiler's record of the forward exchanges (K, then V): each delivered the keys the second
            # batch's dense mask shows this rank's queries on other ranks, every row
            other_plan = build_plan(other, cp, rank, layout=case.layout, **case.plan_kwargs())
            per_call = len(brute_force_needs(other_plan, None, rank)) * len(other["input_ids"]) * KV_TOKEN_BYTES // 4
            summary["profiled"] = (second.all_to_all_received[:2], [per_call, per_call])
            torch.compiler.reset()
            with _first_needed_key_left_out():
                summary["control_failing"] = failing_quantities(runner.run())
        out.append(summary)
    return out


def _worker(rank: int, world: int, with_slow: bool) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank takes part in creating every group
    cases = (PAIR0 + PAIR0_SLOW * with_slow) if rank < 2 else (PAIR1 + PAIR1_SLOW * with_slow)
    out = {"pair0" if rank < 2 else "pair1": _run(cases, pairs[rank // 2])}
    if with_slow:
        out["cp4"] = _run(CP4, dist.group.WORLD)
    return out


@pytest.fixture(scope="module")
def results(request) -> list[dict]:
    return run_distributed(_worker, 4, runs_slow(request), timeout_s=TIMEOUT_S)


def _summaries(results: list[dict]) -> list[dict]:
    return [s for res in results for group in res.values() for s in group]


def test_every_flex_site_exchanges_only_what_its_queries_see(results):
    """Every case is exact (``assert_parity`` in the workers); every site took the selective exchange, with no
    K/V all-gather: two exchanges (K, V) and one routing all-gather per site."""
    for s in _summaries(results):
        print(f"{s['case']}: logits {s['logits']:.1e} loss {s['loss']:.1e} grad {s['grad']:.1e}, comm {s['comm']}")
        sites = len(s["exchanges"])
        assert sites and s["exchanges"] == ["selective"] * sites, s
        assert s["comm"] == (0, 2 * sites, sites), s


def test_bytes_are_the_keys_the_dense_mask_shows(results):
    """The bytes each rank received are the keys its queries see on other ranks, from the dense mask."""
    checked = [s["bytes"] for s in _summaries(results) if "bytes" in s]
    assert len(checked) == 4 and any(needed for _, _, needed in checked), checked  # some rank needed keys
    for got, expected, _ in checked:
        assert got == expected, checked


def test_another_batch_runs_without_a_recompile_and_the_control_fails(results):
    """The ``document`` case: a batch with other documents runs exact with the graphs compiled for the first, and
    the profiler's record of its forward all-to-alls (independent of cpcompile's accounting) shows the elements of
    the keys its dense mask needs; with every rank's first needed key left out of its routing, parity fails."""
    controlled = [s for s in _summaries(results) if "control_failing" in s]
    assert len(controlled) == 2, controlled
    for s in controlled:  # logits and gradients are compared over the whole batch on every rank
        assert s["second_compiles"] == 0 and s["control_failing"], s
        got, expected = s["profiled"]
        assert got == expected, s
    assert any(s["profiled"][1][0] for s in controlled), controlled  # some rank received keys


@slow
def test_transformers_flex_path_torchtitan_and_cp4_ran(results):
    """The slow tier's cases ran (transformers' flex path on three families, torchtitan's trainer masks where
    installed, CP=4); each is exact and exchanged selectively (checked by the tests above)."""
    names = [s["case"] for s in results[0]["pair0"] + results[2]["pair1"] + results[0]["cp4"]]
    assert sum("hf_flex" in n for n in names) == 3 and len(results[0]["cp4"]) == len(CP4), names
