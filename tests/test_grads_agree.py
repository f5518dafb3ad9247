"""Gradients that exist on different parameters of different CP ranks (two MoE experts of the same shape, each
reached by one rank's tokens only) are summed parameter by parameter: a ``None`` on one rank is zeros there,
never another parameter's gradient. ``cpcompile.sync_grads`` and ``cpcompile.clip_grad_norm_`` (DTensor
gradients, as FSDP2 holds them), at CP=2 on gloo; expected values are summed here from each rank's gradients."""

from __future__ import annotations

import math

import pytest
import torch

from tests.harness.dist import run_distributed
from tests.harness.safe_workers import grads_worker


@pytest.fixture(scope="module")
def results():
    return run_distributed(grads_worker, 2, timeout_s=120, fresh=True)


def test_none_on_one_rank_is_zero_there(results):
    before = [r["before"] for r in results]
    # rank 0 reached expert 0 only, rank 1 expert 1 only: each gradient exists on one rank
    assert before[0][0] is not None and before[0][1] is None and before[1][0] is None and before[1][1] is not None
    for res in results:
        expert0, expert1, unused = res["after"]
        torch.testing.assert_close(expert0, before[0][0], atol=0, rtol=0)  # plus rank 1's zeros: exact
        torch.testing.assert_close(expert1, before[1][1], atol=0, rtol=0)
        assert unused is None  # no rank has it: stays None


def test_different_parameter_lists_are_refused_on_every_rank(results):
    for rank, res in enumerate(results):
        kind, msg = res["count_mismatch"]
        assert kind in ("ValueError", "RankFailedValueError"), f"rank {rank}: {kind}: {msg}"
        assert "different numbers of parameters (between 2 and 3" in msg


def test_clip_grad_norm_with_gradients_on_one_rank_only(results):
    expected = math.sqrt(sum(float(t.square().sum()) for t in results[0]["dtensor_locals"]))
    for rank, res in enumerate(results):
        assert res["dtensor_norm"] == pytest.approx(expected, rel=1e-6), f"rank {rank}"
