"""Compilation behaviour under CP: no recompiles for packed lengths, fullgraph, compiled functions, checkpointing.

Every step is compared with the unsharded eager model on the same batch through the parity harness
(:mod:`tests.harness.parity`: logits, summed loss, every summed gradient, its tolerances).
"""

from __future__ import annotations

import pytest

from tests.harness.dist import run_distributed
from tests.harness.parity import assert_parity, check_outcome
from tests.harness.workers import compile_behaviour_worker

STEPS = 20
#: At most this many compilations over STEPS random packed lengths (the sequence dim is dynamic from the
#: first compile on, so one is expected; two leaves room for a specialisation of an early shape).
MAX_COMPILES = 2


@pytest.fixture(scope="module")
def results():
    return run_distributed(compile_behaviour_worker, 2, STEPS, timeout_s=400)[0]


def test_variable_lengths_do_not_recompile(results):
    assert len(set(results["lengths"])) >= 10, results["lengths"]  # the batches really changed length
    assert results["compiles"] in range(1, MAX_COMPILES + 1), (
        f"{results['compiles']} compilations over {STEPS} steps of lengths {results['lengths']}"
    )
    assert len(results["steps"]) == STEPS
    for step, outcome in enumerate(results["steps"]):
        assert outcome.cp_logits.shape[1] == results["lengths"][step]
        assert_parity(outcome)
    worst = {k: max(o.errors()[k] for o in results["steps"]) for k in ("logits", "loss", "grad")}
    print(f"\nlargest differences over {STEPS} lengths: {worst}")


def test_first_compile_is_already_dynamic(results):
    # shard marks the local sequence dim dynamic, so even the first graph has a symbolic length
    assert results["first_dynamic"] is True


def test_compiled_function_fullgraph(results):
    check_outcome(results["function"])


def test_activation_checkpointing(results):
    # the decoder layers' attention runs inside the checkpoint's nested graph: it must be rewritten there
    outcome = results["checkpointing"]
    check_outcome(outcome)
    # the backward recomputes each layer: K and V are gathered again, and reduce-scattered once (gloo: all-reduce)
    layers = outcome.expected_sites
    assert outcome.collectives == {"gloo:all_gather": 4 * layers, "gloo:all_reduce": 2 * layers}, outcome.collectives
