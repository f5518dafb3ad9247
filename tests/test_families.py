"""Parity of compiled CP against the unsharded eager model, per transformers family, on the dense path.

Adding a family is one line in ``cpcompile.testing.FAMILIES``; every family runs the block kernel (what
``attention="auto"`` picks on CPU) at CP=2 under the default balanced layout in ``tests/test_layouts_parity.py`` (one
family of each kind at CP=3 or 4). Here the dense path (SDPA under the plan's whole mask, what ``"auto"`` picks on CUDA)
runs end to end with contiguous chunks for three families at CP=2 and for the sliding-window one at CP=3 (T=64 padded to
66); the fast tier runs the sliding-window family at CP=2, the slow tier the rest. Each spawned group runs several
families to pay the process start-up once. The comparison (logits, summed loss, every summed gradient, every attention
layer rewritten, K and V gathered once per layer) is the parity harness's (:func:`tests.harness.parity.check_outcome`,
tolerances in :mod:`tests.harness.parity`).

Measured differences: BENCHMARKS.md ("parity errors"). Mistral compiled with a config whose sliding window is
one token larger must be refused at compile time (UnsupportedAttentionError naming both windows).
"""

from __future__ import annotations

import pytest

from tests.harness.dist import run_distributed
from tests.harness.parity import assert_controls, check_outcome
from tests.harness.tiers import runs_slow, slow
from tests.harness.workers import family_case, parity_worker

#: The module fixtures spawn the groups (400 s at most each, which only cut a hang).
pytestmark = pytest.mark.timeout(900)

#: The dense path end to end: plain causal (llama), q/k norms and head_dim (qwen3), a sliding window (mistral).
DENSE_FAMILIES = ["llama", "mistral", "qwen3"]
#: The fast tier's family (its window and the wrong-config control); the other two are a sweep of the same path.
FAST_FAMILY = "mistral"
#: CP=3 (T padded, a window crossing two rank boundaries): the sliding-window family stands for the three, whose
#: full-attention masks the CP=2 runs and the balanced layout's CP=3 runs (tests/test_layouts_parity.py) cover.
DENSE_CP3 = ["mistral"]
#: A backend config whose window differs from the model's must be refused (mistral: every layer windowed).
CONTROLS = {family_case("mistral", attention="dense").name: ("wrong_window",)}


@pytest.fixture(scope="module")
def dense_cp2_results(request):
    families = DENSE_FAMILIES if runs_slow(request) else [FAST_FAMILY]
    cases = [family_case(f, attention="dense") for f in families]
    return run_distributed(parity_worker, 2, cases, CONTROLS, timeout_s=400)


@pytest.fixture(scope="module")
def dense_cp3_results():
    return run_distributed(parity_worker, 3, [family_case(f, attention="dense") for f in DENSE_CP3], timeout_s=400)


def _outcomes(results, case):
    """The case's outcome on every rank (the gathered and summed values are the same on all of them)."""
    return [per_rank[case.name][0] for per_rank in results]


@pytest.mark.parametrize("family", [f if f == FAST_FAMILY else pytest.param(f, marks=slow) for f in DENSE_FAMILIES])
def test_dense_attention_parity_cp2(family, dense_cp2_results):
    for outcome in _outcomes(dense_cp2_results, family_case(family, attention="dense")):
        check_outcome(outcome)


@slow
@pytest.mark.parametrize("family", DENSE_CP3)
def test_dense_attention_parity_cp3(family, dense_cp3_results):
    for outcome in _outcomes(dense_cp3_results, family_case(family, attention="dense")):
        check_outcome(outcome)


def test_wrong_config_window_is_refused(dense_cp2_results):
    for per_rank in dense_cp2_results:
        _, caught = per_rank[family_case("mistral", attention="dense").name]
        assert set(caught) == {"wrong_window"}
        assert_controls([{"case": "mistral", "cp": 2, "controls": caught}])
