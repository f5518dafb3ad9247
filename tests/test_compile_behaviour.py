"""Compilation behaviour under CP: no recompiles for packed lengths, fullgraph, compiled functions, checkpointing."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed
from tests._workers import compile_behaviour_worker

STEPS = 20
#: At most this many compilations over STEPS random packed lengths (the sequence dim is dynamic from the
#: first compile on, so one is expected; two leaves room for a specialisation of an early shape).
MAX_COMPILES = 2
# The per-step loss is the sum of per-rank partial means (float32 reassociation, measured <= 1e-6).
LOSS_ATOL = 1e-5
GRAD_ATOL = 1e-6  # gradients: sums of per-rank partial sums (measured <= 4e-8)


@pytest.fixture(scope="module")
def results():
    return run_distributed(compile_behaviour_worker, 2, STEPS, timeout_s=400)[0]


def test_variable_lengths_do_not_recompile(results):
    assert len(set(results["lengths"])) >= 10, results["lengths"]  # the batches really changed length
    assert results["compiles"] in range(1, MAX_COMPILES + 1), (
        f"{results['compiles']} compilations over {STEPS} steps of lengths {results['lengths']}"
    )
    assert results["loss_err"] <= LOSS_ATOL, results["loss_err"]


def test_first_compile_is_already_dynamic(results):
    # shard marks the local sequence dim dynamic, so even the first graph has a symbolic length
    assert results["first_dynamic"] is True


def _check(res):
    loss, ref = res["loss"]
    torch.testing.assert_close(loss, ref, atol=LOSS_ATOL, rtol=0)
    for name, (g, ref_g) in res["grads"].items():
        assert g is not None, name
        torch.testing.assert_close(g, ref_g, atol=GRAD_ATOL, rtol=1e-5, msg=lambda m: f"grad {name}: {m}")
    assert res["rewritten"] == 2


def test_compiled_function_fullgraph(results):
    _check(results["function"])


def test_activation_checkpointing(results):
    # the decoder layers' attention runs inside the checkpoint's nested graph: it must be rewritten there
    res = results["checkpointing"]
    _check({"loss": res["loss"], "grads": res["grads"], "rewritten": res["rewritten"]})
    logits, ref = res["logits"]
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
