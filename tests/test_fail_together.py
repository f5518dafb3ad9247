"""Fail together: when one CP rank fails, every rank raises, naming the failed rank and its reason, in seconds.

Each scenario runs on real gloo processes (2 ranks). A rank blocked in a collective by a peer that failed but
stays alive is released by the CP group's collective timeout, set short here (``FAIL_PEER_TIMEOUT_S``);
a killed peer releases it at once ("Connection closed by peer").
"""

from __future__ import annotations

import pytest

from tests.harness.dist import run_distributed
from tests.harness.workers import FAIL_GRACE_S, FAIL_PEER_TIMEOUT_S, fail_together_worker, killed_rank_worker

#: Timing bounds (a peer reacts within seconds) assume no other test competes for the cores.
pytestmark = pytest.mark.serial

#: Slack on top of the waits under test, for a loaded 2-core machine (steps after the first compile nothing).
SLACK_S = 15.0
#: Bound on a first call, which compiles the model first (about 2 s on an idle machine, 15 s under load).
FIRST_CALL_S = 90.0


@pytest.fixture(scope="module")
def results():
    return run_distributed(fail_together_worker, 2, timeout_s=240, fresh=True)


def test_mask_mismatch_on_one_rank_raises_on_every_rank(results):
    for rank, res in enumerate(results):
        got = res["mask_mismatch"]
        assert got["mask_mismatch"], f"rank {rank}: {got}"
        assert "failed on CP rank 1 of 2" in got["message"], got["message"]
        assert "differs from the global causal same-document mask" in got["message"]
        assert got["seconds"] < FIRST_CALL_S
    # both decided in the same control round: neither waited for the other beyond that round
    assert abs(results[0]["mask_mismatch"]["raised_at"] - results[1]["mask_mismatch"]["raised_at"]) < 5.0


def test_bad_batch_under_the_default_check_raises_the_same_error_on_every_rank(results):
    for rank, res in enumerate(results):
        got = res["bad_batch_checked"]
        assert got["type"] == "ValueError", f"rank {rank}: {got}"
        assert "batch validation of cpcompile.shard failed on CP rank 1 of 2" in got["message"]
        assert "negative" in got["message"]
    assert [r["checked_group_usable"] > 0 for r in results] == [True, True]  # the group is still in step


def test_bad_batch_first_call_without_the_check_raises_on_every_rank(results):
    peer, failed = results[0]["bad_batch_first_call"], results[1]["bad_batch_first_call"]
    # rank 0 learns it in its first-call mask check's round, without waiting for a collective timeout
    assert peer["rank_failed"] and peer["value_error"], peer
    assert list(peer["failed"]) == [1] and "negative" in peer["failed"][1], peer
    assert peer["seconds"] < FIRST_CALL_S
    # rank 1 raises its own error, or RankFailedError with it when rank 0 reported within the grace period
    # (rank 0 compiles its graph first)
    assert failed["value_error"] and "negative" in failed["message"], failed
    for rank, res in enumerate(results):
        nxt = res["bad_batch_first_call_next"]
        assert nxt["rank_failed"] and "failed earlier" in nxt["message"], f"rank {rank}: {nxt}"


def test_bad_batch_later_step_without_the_check_reaches_the_peer_in_its_site_round(results):
    """Without the batch check, the peer goes on into the model; the attention's control round of the step
    (one per step) sees the failed rank's report, so neither waits for a collective timeout."""
    failed, peer = results[1]["bad_batch_later"], results[0]["bad_batch_later"]
    assert failed["value_error"] and "negative" in failed["message"], failed
    assert peer["rank_failed"] and peer["value_error"], peer
    assert list(peer["failed"]) == [1] and "negative" in peer["failed"][1]
    assert "in the mask check of the CP attention at layers.0.attn" in peer["message"], peer
    assert peer["seconds"] < SLACK_S
    for rank, res in enumerate(results):
        nxt = res["bad_batch_later_next"]
        assert nxt["rank_failed"] and "failed earlier" in nxt["message"], f"rank {rank}: {nxt}"


@pytest.mark.parametrize("when", ["first_call", "later"])
def test_rank_outside_shard_does_not_hang_its_peer(results, when):
    peer = results[0][f"outside_{when}"]
    assert peer["rank_failed"], peer
    assert list(peer["failed"]) == [1] and "called outside cpcompile.shard" in peer["message"], peer
    assert peer["seconds"] < (FIRST_CALL_S if when == "first_call" else FAIL_PEER_TIMEOUT_S + SLACK_S)
    outside = results[1][f"outside_{when}"]
    assert "no cpcompile.shard context is active" in outside["message"], outside
    for rank, res in enumerate(results):
        assert res[f"outside_{when}_next"]["rank_failed"], f"rank {rank}: {res[f'outside_{when}_next']}"


def test_failure_in_own_code_is_bounded_by_the_peer_timeout(results):
    """The case that cannot be detected cheaply: a live peer that simply does not call. Its peer raises after
    the group's timeout, naming it as a rank that did not report; with ``fail_together``, with its error."""
    silent = results[0]["own_code_unreported"]
    assert silent["rank_failed"] and silent["failed"] == {} and "rank 1 did not report" in silent["message"], silent
    assert FAIL_PEER_TIMEOUT_S <= silent["seconds"] < FAIL_PEER_TIMEOUT_S + FAIL_GRACE_S + SLACK_S
    reported = results[0]["own_code_fail_together"]
    assert reported["rank_failed"] and list(reported["failed"]) == [1], reported
    assert "the data loader of rank 1 failed" in reported["message"]
    assert reported["seconds"] < FAIL_PEER_TIMEOUT_S + SLACK_S
    assert results[1]["own_code_unreported"]["message"].startswith("the data loader of rank 1 failed")
    # with fail_together, rank 1 raises its own error, or, when its peer was in one of shard's control rounds and
    # gave the verdict within the grace period (the balanced layout's workload round), the group's verdict
    mine = results[1]["own_code_fail_together"]
    own = mine["message"].startswith("the data loader of rank 1 failed")
    assert own or (mine["rank_failed"] and "rank 1 failed" in mine["message"] and "the data loader" in mine["message"])
    for name in ("own_code_unreported", "own_code_fail_together"):
        # the failed rank's next step does not run against its out-of-step peer: it raises too
        assert results[1][name + "_next"]["rank_failed"], results[1][name + "_next"]


#: a rank killed mid-step in the fast tier; killed before its first call (a peer in its first control round) in the
#: slow one
@pytest.mark.parametrize(
    "where", ["between_forward_and_backward", pytest.param("before_first_call", marks=pytest.mark.slow)]
)
def test_killed_rank_is_reported_dead(where):
    results = run_distributed(killed_rank_worker, 2, where, timeout_s=120, may_die=(1,), fresh=True)
    assert results[1] is None  # rank 1 killed itself
    got = results[0]["killed"]
    assert got["rank_failed"], got
    assert got["dead"] == (1,) and "CP rank 1 of CP group" in got["message"] and "died" in got["message"], got
    assert "is gone" in got["message"]
    assert got["seconds"] < (FIRST_CALL_S if where == "before_first_call" else SLACK_S)
    assert results[0]["next"]["rank_failed"]


def test_options_are_validated(monkeypatch):
    from cpcompile.failsafe import PEER_TIMEOUT_ENV, REPORT_GRACE_ENV, FailsafeOptions
    from cpcompile.failsafe import configure as configure_failsafe

    monkeypatch.delenv(PEER_TIMEOUT_ENV, raising=False)
    monkeypatch.delenv(REPORT_GRACE_ENV, raising=False)
    assert FailsafeOptions() == FailsafeOptions(peer_timeout_s=None, report_grace_s=5.0)
    monkeypatch.setenv(PEER_TIMEOUT_ENV, "90")
    monkeypatch.setenv(REPORT_GRACE_ENV, "2.5")
    assert FailsafeOptions() == FailsafeOptions(peer_timeout_s=90.0, report_grace_s=2.5)
    monkeypatch.setenv(PEER_TIMEOUT_ENV, "ten")
    with pytest.raises(ValueError, match=r"\$CPCOMPILE_PEER_TIMEOUT='ten' is not a number of seconds"):
        FailsafeOptions()
    monkeypatch.setenv(PEER_TIMEOUT_ENV, "-1")
    with pytest.raises(ValueError, match="must be a positive number of seconds"):
        FailsafeOptions()
    with pytest.raises(ValueError, match=r"report_grace_s=0 must be a positive number"):
        FailsafeOptions(peer_timeout_s=1, report_grace_s=0)
    with pytest.raises(TypeError, match="ProcessGroup"):
        configure_failsafe("cp")
