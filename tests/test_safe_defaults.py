"""Ranks that disagree are caught by default, on every rank, in seconds: different batches or options (the
batch check of ``cpcompile.shard``), ranks that take different paths through a step (every control round
carries the step, its kind and the batch fingerprint), and model masks that change with the batch (checked on
every step). Tiny hand-written models (``tests.models.attention.attention_lm`` with its packed-document mask, and
``tests.harness.safe_workers.MaskLM``) at CP=2 on gloo, aot_eager."""

from __future__ import annotations

import pytest

from tests.harness.dist import run_distributed
from tests.harness.safe_workers import PEER_TIMEOUT_S, disagree_worker

#: Timing bounds (a peer reacts within seconds) assume no other test competes for the cores.
pytestmark = pytest.mark.serial

#: Slack on top of the waits under test, for a loaded 2-core machine.
SLACK_S = 15.0
#: A round where every rank is present decides at once: far below the peer timeout.
AT_ONCE_S = 2.0


@pytest.fixture(scope="module")
def results():
    return run_distributed(disagree_worker, 2, timeout_s=300, fresh=True)


#: case -> fragments of the ValueError every rank raises in shard's batch check
DIFFERENT = {
    "ids": ["batch['input_ids']: the token ids differ", "[[0], [1]]"],
    "docs": ["batch['position_ids']: the positions (document boundaries"],
    "labels": ["batch['labels']: the labels differ"],
    "T": ["batch['input_ids'] T (sequence length): rank 0: 16; rank 1: 20"],
    "B": ["batch['input_ids'] B (rows): rank 0: 2; rank 1: 3"],
    "layout": ["shard(..., layout=...) differs", 'rank 0: "balanced"; rank 1: "contiguous"'],
    "pad_token_id": ["shard(..., pad_token_id=...) differs"],
    "T_model": ["T (sequence length)"],
}


@pytest.mark.parametrize("case", sorted(DIFFERENT))
def test_different_batches_raise_the_same_error_on_every_rank(results, case):
    messages = set()
    for rank, res in enumerate(results):
        got = res[case]
        assert got["type"] == "ValueError", f"rank {rank}: {got}"
        assert "the CP ranks passed different batches or options in step" in got["message"]
        assert "same FULL global batch" in got["message"]
        for fragment in DIFFERENT[case]:
            assert fragment in got["message"], f"rank {rank}: {fragment!r} not in {got['message']}"
        assert got["seconds"] < AT_ONCE_S + SLACK_S, got
        messages.add(got["message"])
    assert len(messages) == 1  # the same error on every rank


def test_group_stays_usable_after_the_check_and_the_opt_out_compares_nothing(results):
    for res in results:
        assert res["warm"]["type"] == "none" and res["after"]["type"] == "none", (res["warm"], res["after"])
        assert res["opt_out"]["type"] == "none", res["opt_out"]


def test_check_on_one_rank_only(results):
    # rank 0 holds the batch check's round; rank 1 skipped it (check_batch=False) and went on into the model:
    # rank 0 sees the skip at once and reports it, and rank 1's next round (the model's mask check) raises it
    for rank, res in enumerate(results):
        got = res["check_one_rank"]
        assert got["rank_failed"] and list(got["failed"]) == [0], f"rank {rank}: {got}"
        assert "RanksDivergedError: CP rank 1 of group" in got["message"]
        assert "skipped the batch validation of cpcompile.shard of step 2" in got["message"]
        assert "check_batch=False" in got["message"]
        assert got["seconds"] < AT_ONCE_S + SLACK_S, got
        assert res["check_one_rank_next"]["rank_failed"], res["check_one_rank_next"]


def test_skipped_backward_is_named_at_once(results):
    """The last rank skips backward() and starts step 3. The backward of a compiled graph with CP collectives holds
    a control round before its collectives, so rank 0's backward round and rank 1's batch round are the same turn:
    both raise RanksDivergedError at once, each naming where every rank is (not a peer timeout)."""
    messages = set()
    for rank, res in enumerate(results):
        got = res["skipped_backward"]
        assert got["type"] == "RanksDivergedError", f"rank {rank}: {got}"
        assert got["seconds"] < AT_ONCE_S + SLACK_S, got
        assert "rank 0: the backward of the CP step in step 2" in got["message"], got["message"]
        assert "rank 1: " in got["message"] and "in step 3" in got["message"], got["message"]
        assert "a skipped backward()" in got["message"]
        messages.add(got["message"])
    assert len(messages) == 1  # the same error on every rank


def test_error_caught_inside_shard_reaches_every_rank(results):
    for rank, res in enumerate(results):
        got = res["caught_in_block"]
        assert got["rank_failed"] and list(got["failed"]) == [1], f"rank {rank}: {got}"
        assert "the last rank's own code failed inside the shard block" in got["message"]
        assert got["seconds"] < PEER_TIMEOUT_S + SLACK_S, got
        assert res["caught_in_block_next"]["rank_failed"], res["caught_in_block_next"]


def test_data_dependent_branch_is_refused_at_compile_time(results):
    """The branch's predicate (``diff`` of the positions along the sequence, then ``any``) reads only this rank's
    tokens, so ranks would decide differently from the whole sequence: the mixing pass refuses it when the first
    graph compiles, on every rank, whatever the batch, before any rank can take the other branch."""
    for rank, res in enumerate(results):
        for case in ("branch_same", "branch"):
            got = res[case]
            assert got["type"] == "UnsupportedMixingError", f"rank {rank}, {case}: {got}"
            assert "cannot run diff" in got["message"] and not got["rank_failed"], got


def test_prefix_lm_mask_from_an_input_is_refused_at_compile_time(results):
    """A prefix-LM mask (``causal | prefix x prefix`` from a per-token input) is not causal order, a window or a
    document condition: refused when the model is compiled, on every rank, naming the model's line."""
    for rank, res in enumerate(results):
        got = res["mask_prefix_first"]
        assert got["type"] == "UnsupportedAttentionError", f"rank {rank}: {got}"
        assert "or_" in got["message"] and "safe_workers.py:" in got["message"], got["message"]


@pytest.mark.parametrize("mask", ["causal"])
def test_mask_is_checked_on_every_new_batch(results, mask):
    first, second = ("mask_causal_first", "mask_causal_packed")
    for rank, res in enumerate(results):
        assert res[first]["type"] == "none", f"rank {rank}: {res[first]}"
        got = res[second]
        assert got["mask_mismatch"], f"rank {rank}: {got}"
        assert "differs from the global causal same-document mask" in got["message"]
        assert got["seconds"] < AT_ONCE_S + SLACK_S
        # the check runs before the site's K/V all-gathers are issued: nothing is left in flight to warn at exit
        assert res["pending_after_mismatch"] == 0, f"rank {rank}: {res['pending_after_mismatch']} unwaited"


def test_attention_hidden_from_the_backend_is_an_error_on_every_rank(results):
    """Attention inside a ``@torch.compiler.disable`` function runs on the local chunk only: a step that ran
    compiled graphs of a backend and none with rewritten attention raises on every rank, every step, naming the
    frame, the cause and the fix; also when another model's attention ran in the same step (the check is per
    backend). A model without token mixing runs when declared (``token_mixing="none"``) and is refused when not
    (the control: the backend cannot tell it from hidden attention)."""
    for rank, res in enumerate(results):
        outcomes = [*res["hidden"], res["hidden_next_to_compiled"], res["undeclared_without_mixing"]]
        for got in outcomes:
            assert got["type"] == "UnsupportedAttentionError", f"rank {rank}: {got}"
            message = got["message"]
            assert "attended over this rank's tokens only" in message and "@torch.compiler.disable" in message
            assert "in forward" in message, message  # names the frame of the graph that ran
            assert 'token_mixing="none"' in message, message  # the opt-out for a model without mixing
        assert res["compiled_alone"]["type"] == "none", res["compiled_alone"]
        assert res["declared_without_mixing"]["type"] == "none", res["declared_without_mixing"]
    assert results[0]["hidden"][0]["message"] == results[1]["hidden"][0]["message"]  # the same error everywhere
