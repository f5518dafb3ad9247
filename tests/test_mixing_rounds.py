"""Ranks fail together at the mixing exchanges: a rank whose peer failed before reaching an exchange raises, naming
the peer and its error, instead of waiting in the exchange's collective.

Each exchange of the mixing pass and of the recurrent cores (:mod:`cpcompile.cores`) holds a control round before
its first collective (``cpcompile.ops.check.exchange_round``): on its first call, then once per step. Two
scenarios on real gloo processes (2 ranks), each a model whose first cross-rank exchange is not an attention site
(which holds its own round):

* ``registration``: only rank 0 registers the user's core (``tests.models.user_cores``, a per-head recurrence in
  plain torch, with ``cpcompile.cores.register_head_parallel``); rank 1's graph is refused at compile time (the
  backend keeps to registered regions, ``regions="registered"``; by default rank 1 finds the inner function of the
  core itself, another site, and both ranks raise ``RanksDivergedError`` at the first round). The
  round is ``cpcompile::heads_order``'s, before the core's head all-to-all.
* ``mamba``: transformers' Mamba (no attention layer), where rank 1's compile fails (its backend raises a
  ``ValueError`` before cpcompile's). Rank 0's first exchange is the first layer's causal conv (a halo region, the
  round of ``cpcompile::halo_routing``).
* ``branch`` (slow tier): the same Mamba, where rank 1 raises in its own code (a forward pre-hook of the second
  layer) while Dynamo traces it: Dynamo breaks the graph there, so rank 1 reaches another exchange than rank 0
  (the first layer's conv of another graph), and both ranks raise ``RanksDivergedError`` naming the two.

The round names a site as every rank names it (one process): without the backend and graph numbers of the
process that compiled it, nor its digest.

Both ranks stay alive until both are done (a rank whose process exits would release its peer's collective with
a closed connection). Without the rounds rank 0 waits in the exchange until the job's timeout (checked by hand:
neither scenario finished within the job's timeout). That timeout is short here, so that a missing round fails
the test instead of hanging it.
"""

from __future__ import annotations

import pytest

from tests.harness.dist import run_distributed
from tests.harness.tiers import slow

#: The job's timeout: a first compile of both models and the rounds, on a loaded 2-core machine.
TIMEOUT_S = 180


def _raise_on_rank_1(*args):
    raise ValueError("rank 1's own code failed")


def _worker(rank: int, world: int, scenario: str) -> dict:
    import time

    import torch
    import torch.distributed as dist

    import cpcompile
    from cpcompile.testing import packed_batch, tiny_model
    from tests.models import user_cores
    from tests.test_hybrids_parity import DOCS

    torch.set_num_threads(1)
    group = dist.group.WORLD
    if scenario == "registration":
        model = user_cores.user_core_lm(registered=rank == 0)
    else:
        model = tiny_model("mamba")
        if rank == 1 and scenario == "branch":
            model.backbone.layers[1].register_forward_pre_hook(_raise_on_rank_1)
    # rank 1 keeps to registered regions: by default it would find a core of its own (another site, which the
    # rounds see as ranks out of step)
    backend = cpcompile.backend(group, inner="eager", regions="registered" if scenario == "registration" else "found")
    if rank == 1 and scenario == "mamba":
        backend = _raise_on_rank_1
    start = time.monotonic()
    try:
        with cpcompile.shard(packed_batch([list(d) for d in DOCS]), group) as local:
            torch.compile(model, backend=backend)(**local).loss.backward()
        got = {"type": None, "message": ""}
    except Exception as e:  # noqa: BLE001 - the outcome under test
        got = {"type": type(e).__name__, "message": str(e)}
    got["seconds"] = time.monotonic() - start
    _stay_until_both_done(rank)
    return got


def _stay_until_both_done(rank: int) -> None:
    """Keep this rank's process (and its end of the group's connections) alive until the peer is done too, as a
    job's rank that caught its error stays: a rank that exits would release a peer waiting in a collective."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    store.set(f"mixing_rounds_done_{rank}", "1")
    store.wait([f"mixing_rounds_done_{1 - rank}"], timedelta(seconds=TIMEOUT_S))


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize(
    ("scenario", "error"),
    [("registration", "UnsupportedPositionError"), ("mamba", "ValueError: rank 1's own code failed")],
)
def test_a_peer_that_failed_before_an_exchange_is_seen_in_its_round(scenario, error):
    peer, failed = run_distributed(_worker, 2, scenario, timeout_s=TIMEOUT_S, fresh=True)
    assert peer["type"] == "RankFailedError", peer
    assert "CP rank 1" in peer["message"] and error in peer["message"], peer["message"]
    # rank 1 raises its own error, or RankFailedError with it once rank 0 reported
    assert (
        failed["type"] is not None and "rank 1's own code failed" in failed["message"] or error in failed["message"]
    ), failed


@slow
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_ranks_that_reach_different_exchanges_both_raise():
    results = run_distributed(_worker, 2, "branch", timeout_s=TIMEOUT_S, fresh=True)
    for rank, got in enumerate(results):
        assert got["type"] == "RanksDivergedError", f"rank {rank}: {got}"
        assert "rank 0: the step check of the sequence-mixing op at" in got["message"], got["message"]
        assert "rank 1: the step check of the sequence-mixing op at" in got["message"], got["message"]


def test_the_round_names_a_site_as_every_rank_names_it():
    """A region's site carries the backend and graph numbers of the process that compiled it and a digest that
    differs between ranks; a core's site is its function. The round drops the first two and keeps the third."""
    from cpcompile.ops.check import _same_on_every_rank

    assert _same_on_every_rank("backend10/graph0:mixer.conv (node conv1d)#d85f5cfc") == "mixer.conv (node conv1d)"
    assert _same_on_every_rank("backend0/graph3:<top level> (node cumsum)") == "<top level> (node cumsum)"
    core = "transformers.models.qwen3_next.modeling_qwen3_next.torch_chunk_gated_delta_rule"
    assert _same_on_every_rank(core) == core
