"""Parity: cpcompile on CPU/gloo (CP=2 and CP=4) vs the same model run eagerly in one process on the whole batch.

Every case uses packed rows (B >= 2) whose documents are split between ranks and a length T that is not a multiple
of the CP size, and compares the gathered logits, the summed loss and every parameter's gradient summed over CP
ranks with ``torch.testing.assert_close`` (the harness and its tolerances: :mod:`tests.harness.parity`). Each case
also asserts that every attention layer's SDPA was rewritten and that K and V were all-gathered once per layer.
``attention="auto"`` runs the block kernel on CPU; one case at each CP size uses the ``head_tail`` layout (the balanced
layout has its own parity tests in ``tests/test_layouts_parity.py``). CP=4 is in the slow tier. The negative controls
break the CP side through public means only and must fail the same check on what they break: a wrong label shift (loss
and gradients, the logits stay right), the batch's documents merged (logits), the plan's documents merged under the
model's true positions (logits). The first case at each CP size compiles through AOTAutograd (``inner="aot_eager"``),
the others
run the rewritten graph as traced (``inner="eager"``). The CP=2 run also checks ``cpcompile.gather`` and its
backward, with contiguous chunks and with the balanced layout.

Measured differences and the controls' errors: BENCHMARKS.md ("parity errors").
"""

from __future__ import annotations

import pytest

from tests.harness.dist import run_distributed
from tests.harness.parity import ParityCase, assert_controls, check_case, report
from tests.harness.tiers import slow
from tests.harness.tolerances import EXACT

# T = 37: not a multiple of 2 or 4; documents cross chunk boundaries at CP=2 (c=19) and CP=4 (c=10).
DOCS = ((10, 20, 7), (5, 30, 2))
# B = 3, T = 45 (c = 23 at CP=2), one-token documents included.
DOCS_B3 = ((1, 30, 14), (45,), (12, 1, 1, 31))

#: The CP=2 cases' transformers models have one decoder layer: each form is checked per site, and Dynamo traces
#: every layer anew (half the compiling of the two-layer default).
ONE_LAYER = (("num_hidden_layers", 1),)
CP2_CASES = (
    # HF models in training form: a bool [B, 1, T, T] causal same-document mask, K/V expanded by repeat_kv
    ParityCase(
        model="qwen3", doc_lens=DOCS, inner="aot_eager", expected_form=("bool-mask", False), overrides=ONE_LAYER
    ),
    ParityCase(model="llama", doc_lens=DOCS_B3, batch_seed=2, expected_form=("bool-mask", False), overrides=ONE_LAYER),
    # is_causal=True + enable_gqa=True (HF's form with the KV cache on): 2 KV heads for 4 query heads
    ParityCase(model="attn:causal_gqa", doc_lens=DOCS, expected_form=("is_causal", True)),
    # the block kernel with blocks of 16 (several blocks per chunk) under AOTAutograd; 67 tokens padded to 68
    ParityCase(
        model="qwen3",
        doc_lens=((10, 20, 37), (5, 60, 2)),
        attention="block",
        backend_kwargs=(("block_size", 16),),
        overrides=ONE_LAYER,
    ),
    # the head_tail layout: rank r holds pieces r and 3 - r of 4 (T = 37 padded to 40, pieces of 10)
    ParityCase(
        model="qwen3", doc_lens=DOCS, layout="head_tail", expected_form=("bool-mask", False), overrides=ONE_LAYER
    ),
)
CP4_CASES = (
    ParityCase(model="llama", doc_lens=DOCS, inner="aot_eager"),
    # the load-balanced layout: rank r holds pieces r and 7 - r of 8 (T = 37 padded to 40, pieces of 5)
    ParityCase(model="qwen3", doc_lens=DOCS, layout="head_tail", expected_form=("bool-mask", False)),
)
#: The negative controls of a model without a sliding window (tests.harness.parity.CONTROLS).
CONTROLS = ("label_shift", "merge_documents", "plan_merges_documents")


def _worker(rank, world_size, cases, controls, gather_check=False):
    import torch.distributed as dist

    group = dist.group.WORLD
    if gather_check:
        _check_gather_autograd(rank, world_size, group)
    # negative controls on the first case only: its compiled model is reused, so they cost one step each
    return [check_case(case, group, controls=controls if i == 0 else ()) for i, case in enumerate(cases)]


def _check_gather_autograd(rank, world_size, group):
    """gather = every rank's tokens put back in token order without padding; its backward (run after the shard
    context ended, as in a training loop) gives this rank's tokens' gradient. Contiguous chunks and the
    balanced layout (blocks of 4 tokens, so that the 37 tokens really move)."""
    import torch

    import cpcompile
    from cpcompile.plan import Workload
    from cpcompile.testing import packed_batch

    T = sum(DOCS[0])
    c = -(-T // world_size)
    batch = packed_batch([list(r) for r in DOCS])
    for layout in ("contiguous", "balanced"):
        chunks = [torch.randn(2, c, 3, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
        x = chunks[rank].clone().requires_grad_()
        w = torch.randn(2, T, 3, generator=torch.Generator().manual_seed(99))
        with cpcompile.shard(batch, group, layout=layout, workload=Workload(block_size=4)):
            held = cpcompile.runtime.current_plan().indices  # [N, c]: the global index of every rank's tokens
            y = cpcompile.gather(x)
        if layout == "contiguous":
            assert torch.equal(held, torch.arange(world_size * c).view(world_size, c))
        else:
            assert not torch.equal(held, torch.arange(world_size * c).view(world_size, c))
        full = torch.empty(2, world_size * c, 3)
        full[:, held.flatten()] = torch.cat(chunks, 1)
        torch.testing.assert_close(y, full[:, :T], **EXACT)  # a copy
        (y * w).sum().backward()
        w_padded = torch.cat([w, torch.zeros(2, world_size * c - T, 3)], 1)
        torch.testing.assert_close(x.grad, w_padded[:, held[rank]], **EXACT)


# Generous limits: about 30-60 s each on 2 idle cores; they only cut a hang (the machine may be shared).
TIMEOUT_S = 420


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_parity_cp2():
    results = run_distributed(_worker, 2, CP2_CASES, CONTROLS, True, timeout_s=TIMEOUT_S)
    report(results[0])
    assert_controls(results[0])
    assert [set(s["controls"]) for s in results[0]] == [set(CONTROLS)] + [set()] * (len(CP2_CASES) - 1)
    assert [len(r) for r in results] == [len(CP2_CASES)] * 2


@slow  # the CP=2 cases cover every form; head_tail at CP=2 too
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_parity_cp4():
    results = run_distributed(_worker, 4, CP4_CASES, (), timeout_s=TIMEOUT_S)
    report(results[0])
    assert [len(r) for r in results] == [len(CP4_CASES)] * 4
