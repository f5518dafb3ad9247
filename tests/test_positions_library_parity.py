"""Parity of the position and mask forms of model libraries outside transformers, in their plain training call.

Two spawned groups for the whole module (module-scoped fixtures): CP=2 and CP=4 on gloo, every case compiled
with cpcompile and compared with the same model run whole in one process on the same global batch (the one
harness, :mod:`tests.harness.parity`: logits, summed loss, every summed gradient, every SDPA site rewritten, the
position sources reported). T = 37 is not a multiple of 2 or 4.

Models (``tests.models.positions.library_style``, ``tests.models.attention`` form ``head_expanded``):

* ``library_style``: RoPE from ``arange(T)`` through an unused ``max_pos = t.max() + 1``, an ellipsis einsum,
  ``emb[:, -T:, :]`` and ``narrow(1, k - q, q)``; negative control ``positions="off"`` (at CP=4);
* ``attn:head_expanded``: a causal same-document mask built from ``position_ids`` and expanded to every head
  (``mask.expand(B, H, T, T)``); negative control ``merge_documents`` (the CP run sees documents merged).

CP=4 is the slow tier.

The rewritten graph runs as traced (``inner="eager"``); inductor runs ``library_style`` as a layer of ``all_forms``
(``tests/test_positions_parity.py``). The one-process checks of each form's values on the last rank, with
``positions="off"`` as control, are in ``tests/test_positions_values.py``.

Measured differences: BENCHMARKS.md ("parity errors", models that compute positions).
"""

from __future__ import annotations

import traceback

import pytest

from cpcompile.plan import Workload
from tests.harness.dist import run_distributed
from tests.harness.parity import ParityCase, assert_controls, check_case, report
from tests.harness.tiers import slow

DOCS = ((10, 20, 7), (5, 30, 2))  # T = 37
LIBRARY = "tests.models.positions:library_style"
ROPE = (("arange", "rewritten"),) * 2  # one arange per attention layer


def _case(model: str, layout: str, inner: str = "eager", positions=ROPE) -> ParityCase:
    return ParityCase(
        model=model,
        doc_lens=DOCS,
        inner=inner,
        expected_sites=2,
        expected_positions=positions,
        layout=layout,
        # kernel blocks of 4 tokens give the balanced layout something to balance at this length
        shard_kwargs=(("workload", Workload(block_size=4)),) if layout == "balanced" else (),
    )


#: (case, negative control or None) per world size.
CASES = {
    2: (
        (_case(LIBRARY, "contiguous"), None),
        (_case("attn:head_expanded", "balanced", positions=None), "merge_documents"),
    ),
    4: (
        (_case(LIBRARY, "balanced"), "positions_off"),
        (_case("attn:head_expanded", "head_tail", positions=None), None),
    ),
}


def _worker(rank, world_size, cases):
    import torch
    import torch.distributed as dist

    out = []
    for case, control in cases:
        torch._dynamo.reset()
        try:
            out.append(check_case(case, dist.group.WORLD, controls=(control,) if control else ()))
        except Exception:  # noqa: BLE001 - reported per case by the test that reads it
            out.append({"case": case.name, "failed": traceback.format_exc()})
    return out


# Generous limit: it only cuts a hang on a shared machine.
TIMEOUT_S = 900


@pytest.fixture(scope="module")
def cp2():
    return run_distributed(_worker, 2, CASES[2], timeout_s=TIMEOUT_S)[0]


@pytest.fixture(scope="module")
def cp4():
    return run_distributed(_worker, 4, CASES[4], timeout_s=TIMEOUT_S)[0]


def _check(summary: dict) -> None:
    assert "failed" not in summary, summary.get("failed")
    report([summary])
    assert_controls([summary])


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("i", range(len(CASES[2])), ids=[c.name for c, _ in CASES[2]])
def test_cp2(cp2, i):
    _check(cp2[i])
    assert len(cp2[i]["controls"]) == (CASES[2][i][1] is not None)


@slow
@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("i", range(len(CASES[4])), ids=[c.name for c, _ in CASES[4]])
def test_cp4(cp4, i):
    _check(cp4[i])
    assert cp4[i]["runs"] > 1 or CASES[4][i][0].layout == "contiguous"
    assert len(cp4[i]["controls"]) == (CASES[4][i][1] is not None)
