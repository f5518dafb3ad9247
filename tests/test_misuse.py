"""Every bad input a user can give gets a ValueError/TypeError on every rank, naming the value and the fix, before
anything is compiled or communicated where possible. One spawned group per CP size (2 and 3) runs the whole
table (``tests.harness.safe_workers.misuse_worker``); models: ``tests.models.attention.attention_lm``
(packed-document mask) and a tiny transformers Llama (``cpcompile.testing.tiny_model``). CP=3 is the slow tier."""

from __future__ import annotations

import pytest

from tests.harness.dist import run_distributed
from tests.harness.safe_workers import misuse_worker
from tests.harness.tiers import slow

#: case -> (exception type name on every rank, fragments of the message)
TABLE = {
    "B0": ("ValueError", ["an empty batch (B = 0 rows", "skip the step on every rank"]),
    "T0": ("ValueError", ["an empty batch (B = 2 rows, T = 0 tokens)"]),
    "keys_T": ("ValueError", ["batch['labels'] has shape (2, 15)", "[2, 17, ...]", "same batch size and length"]),
    "T_changes": (
        "ValueError",
        ["batch['input_ids'] T (sequence length):", ": 17; rank", ": 19", "same FULL global batch"],
    ),
    "labels_float": ("TypeError", ["batch['labels'] must be an integer tensor", "torch.float32"]),
    "positions_jump": ("ValueError", ["row 0 goes from 1 to 5 at token 12", "must restart at 0"]),
    "positions_continue": ("none", []),
    "layout": ("ValueError", ["layout='zigzag' is not a known layout", "'contiguous'"]),
    "pad_values_key": ("ValueError", ["pad_values names 'segment_ids'", "not a tensor of the batch"]),
    "labels_int32": ("none", []),
    "other_cp_size": ("ValueError", ["got 2 rows of", "tokens per rank", "sliced for another CP size", "`local`"]),
    # the rank holding the padding raises it; its peers, blocked in gather, raise RankFailedValueError with it
    "segment_ids": ("ValueError", ["['segment_ids']", "padded with -100", "pad_values={'segment_ids': 0}"]),
    "segment_ids_fixed": ("none", []),
    "dynamic_true": ("UnsupportedAttentionError", ["symbolic", "compile without dynamic=True"]),
}


@pytest.fixture(scope="module", params=[pytest.param(2, id="cp2"), pytest.param(3, id="cp3", marks=slow)])
def results(request):
    return request.param, run_distributed(misuse_worker, request.param, timeout_s=300, fresh=True)


@pytest.mark.parametrize("case", sorted(TABLE))
def test_bad_input_gets_a_clear_error_on_every_rank(results, case):
    n, per_rank = results
    kind, fragments = TABLE[case]
    messages = set()
    for rank, res in enumerate(per_rank):
        got_kind, msg = res[case]
        ok = got_kind == kind or (case == "segment_ids" and got_kind == "RankFailedValueError")
        assert ok, f"CP={n} rank {rank} {case}: got {got_kind}: {msg}"
        for f in fragments:
            assert f in msg, f"CP={n} rank {rank} {case}: {f!r} not in {msg!r}"
        messages.add(msg)
    if case not in ("other_cp_size", "segment_ids"):  # one error decided in one round
        assert len(messages) == 1, f"CP={n} {case}: ranks raised different messages: {messages}"


def test_int32_labels_give_the_int64_loss(results):
    n, per_rank = results
    for rank, res in enumerate(per_rank):
        (loss32, dtypes32), (loss64, _) = res["labels_int32_loss"]
        assert dtypes32 == ("torch.int64", "torch.int64") or all(str(d) == "torch.int64" for d in dtypes32)
        assert loss32 == loss64, f"CP={n} rank {rank}: {loss32} != {loss64}"
