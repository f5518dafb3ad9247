"""The halo exchange of sliding-window sites: only the keys a rank's queries see travel, and the result is exact.

- The plan's halo (``CPPlan.halo_needs``) equals, for random batches, layouts, CP sizes and windows, the keys that
  a brute-force mask shows some local query sees and another rank holds; the routing every rank computes agrees
  with every other rank's.
- Parity (tests.harness.parity, against the unsharded eager model): Mistral with windows smaller than a chunk and longer
  than a run of a rank's tokens (the halo then comes from two ranks), Gemma 3 (sliding and full layers), at
  CP = 2, 3 and 4, packed documents crossing chunk edges, contiguous and balanced layouts, run as traced and inductor
  (CP=3, 4 and inductor in the slow tier); the bytes each rank received equal the brute-force count. A halo one token
  short (every rank's first needed key dropped) fails the same check. Windows of a chunk or more keep the all-gather at
  these sizes (the halo's ``MAX_RUNS * (window - 1)`` slots would not be fewer keys); the families' parity covers them.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpcompile.plan import LAYOUTS, MAX_RUNS, AttentionForm, CPPlan, Workload, build_plan, runs
from tests.harness.dist import run_distributed
from tests.harness.parity import ParityCase, ParityRunner, assert_parity, assert_rewrites, check_case
from tests.harness.tiers import slow

SETTINGS = settings(max_examples=40, deadline=None)


def brute_force_needs(plan: CPPlan, window: int, rank: int) -> list[int]:
    """Keys another rank holds that some query of ``rank`` sees in some row (from the dense mask)."""
    mask = plan.mask(documents=True, window=window, rank=rank)  # [B, 1, c, T_pad], keys in token order
    seen = mask.any(dim=2).any(dim=0)[0]  # [T_pad]
    seen[plan.token_indices(rank)] = False
    return torch.nonzero(seen).flatten().tolist()


@st.composite
def cases(draw):
    cp_size = draw(st.integers(1, 6))
    T = draw(st.integers(cp_size, 48))
    rows = []
    for _ in range(draw(st.integers(1, 2))):
        cuts = sorted(set(draw(st.lists(st.integers(1, max(T - 1, 1)), max_size=4)))) if T > 1 else []
        bounds = [0, *[c for c in cuts if c < T], T]
        rows.append([b - a for a, b in zip(bounds, bounds[1:])])
    pos = torch.tensor([[p for n in row for p in range(n)] for row in rows])
    batch = {"input_ids": torch.zeros_like(pos), "position_ids": pos}
    # small kernel blocks give the balanced layout something to balance at these lengths (several runs per rank)
    layout = {
        "layout": draw(st.sampled_from(sorted(LAYOUTS))),
        "workload": Workload(block_size=draw(st.integers(1, 4))),
    }
    return batch, cp_size, layout, draw(st.integers(1, T + 2))


@SETTINGS
@given(cases())
def test_halo_needs_are_exactly_the_keys_seen_on_other_ranks(case):
    batch, N, layout, window = case
    for r in range(N):
        plan = build_plan(batch, N, r, **layout)
        assert len(runs(plan.token_indices())) <= MAX_RUNS
        assert plan.halo_needs(window).tolist() == brute_force_needs(plan, window, r), (layout, r)


@SETTINGS
@given(cases())
def test_every_rank_computes_the_same_routing(case):
    """What rank s sends to rank r (its local slots, as global indices) is what r expects from s, in order."""
    batch, N, layout, window = case
    slots = MAX_RUNS * max(window - 1, 1)
    plans = [build_plan(batch, N, r, **layout) for r in range(N)]
    routes = [p.halo_routing(window, slots) for p in plans]
    for s, (plan_s, route_s) in enumerate(zip(plans, routes)):
        sent = plan_s.token_indices()[route_s.send_slots[: int(route_s.counts[0].sum())]].tolist()
        offset = 0
        for r, route_r in enumerate(routes):
            n = int(route_s.counts[0, r])
            assert n == int(route_r.counts[1, s])
            start = int(route_r.counts[1, :s].sum())
            assert sent[offset : offset + n] == route_r.recv_pos[start : start + n].tolist(), (s, r)
            offset += n
    for r, route in enumerate(routes):
        got = route.recv_pos[route.recv_pos >= 0].sort().values.tolist()
        assert got == plans[r].halo_needs(window).tolist()


# -- parity ------------------------------------------------------------------------------------------------
# T = 64 (chunks of 32, 22 and 16 at CP = 2, 3, 4), documents crossing chunk edges, a one-token document
DOCS = ((24, 30, 10), (5, 50, 1, 8))


#: Per CP size: (the case whose bytes and negative control are checked, further cases). Chunks are 32, 22 and 16
#: tokens; every window keeps the halo's ``MAX_RUNS * (window - 1)`` slots below the all-gather's ``(N - 1) * c``
#: keys. At CP=4 the ranks hold runs of 8 tokens or fewer (head_tail, balanced), so a window of 12 reaches back
#: over a whole run: the halo comes from two ranks.
CASES = {
    2: (ParityCase(model="mistral", doc_lens=DOCS, overrides=(("sliding_window", 6),)), ()),
    3: (
        ParityCase(model="mistral", doc_lens=DOCS, overrides=(("sliding_window", 11),)),
        (ParityCase(model="gemma3", doc_lens=DOCS),),
    ),
    4: (
        ParityCase(
            model="mistral",
            doc_lens=DOCS,
            overrides=(("sliding_window", 12),),
            layout="balanced",
            shard_kwargs=(("workload", Workload(forms=(AttentionForm(window=12, layers=2),), block_size=4)),),
        ),
        (),
    ),
}
#: The inductor case (slow tier), checked like the cases above: bytes and the negative control.
INDUCTOR = ParityCase(model="mistral", doc_lens=DOCS, overrides=(("sliding_window", 6),), inner="inductor")


def _worker(rank, world_size, case, others):
    import torch.distributed as dist

    group = dist.group.WORLD
    runner = ParityRunner(case, group)
    outcome = runner.run()
    sites = [r.exchange for r in runner.backend.reports]
    assert sites == ["halo", "halo"], sites
    assert_rewrites(outcome, 2)
    assert_parity(outcome)
    # bytes: every halo exchange received exactly the brute-force needs of this rank (K and V, both sites)
    window = dict(case.overrides)["sliding_window"]
    plan = build_plan(runner.batch, world_size, rank, layout=case.layout, **dict(case.shard_kwargs))
    config = runner.model.config
    heads_dim = config.num_key_value_heads * (config.head_dim or config.hidden_size // config.num_attention_heads)
    per_exchange = len(brute_force_needs(plan, window, rank)) * len(case.doc_lens) * heads_dim * 4
    bytes_check = (outcome.comm.halo_bytes, 2 * len(sites) * per_exchange)
    # negative control: every rank's halo one token short (its first needed key not sent)
    original = CPPlan.halo_needs

    def one_short(plan, window, rank=None, **kwargs):
        return original(plan, window, rank, **kwargs)[1:]

    with mock.patch.object(CPPlan, "halo_needs", one_short):
        bad = runner.run()
    try:
        assert_parity(bad)
        control = None
    except AssertionError as e:
        control = str(e).splitlines()[0]
    summaries = [{"case": case.name, "cp": world_size, **outcome.errors()}]
    summaries += [check_case(other, group) for other in others]
    return {"summaries": summaries, "bytes": bytes_check, "control": control}


# Generous limits: they only cut a hang (the machine may be shared).
TIMEOUT_S = 420


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("cp", [2, pytest.param(3, marks=slow), pytest.param(4, marks=slow)])
def test_halo_parity(cp):
    _check(run_distributed(_worker, cp, *CASES[cp], timeout_s=TIMEOUT_S))


@slow
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_halo_parity_inductor():
    _check(run_distributed(_worker, 2, INDUCTOR, (), timeout_s=TIMEOUT_S))


def _check(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        got, expected = res["bytes"]
        assert got == expected, (rank, got, expected)
        assert res["control"] is not None, f"rank {rank}: a halo one token short passed the parity check"
    for s in results[0]["summaries"]:
        print(f"{s['case']} CP={s['cp']}: logits {s['logits']:.1e} loss {s['loss']:.1e} grad {s['grad']:.1e}")
    print("halo one token short:", results[0]["control"])
