"""Every misuse gets an error naming the value, what was expected and the fix, raised before a collective
can hang; and a multi-process test never hangs."""

from __future__ import annotations

import time

import pytest

from cpcompile.plan import build_plan
from cpcompile.testing import packed_batch
from tests.harness.dist import run_distributed
from tests.harness.workers import bad_input_worker, failing_worker, sleeping_worker

#: case -> (exception type, fragments the message must contain)
EXPECTED = {
    "different_lengths": (
        "ValueError",
        ["batch['position_ids']", "(2, 14)", "[2, 16, ...]", "same batch size and length"],
    ),
    "missing_input_ids": ("ValueError", ["no 'input_ids'", "'labels'", "under 'input_ids'"]),
    "negative_positions": ("ValueError", ["negative", "min -3", "restart at 0"]),
    "float_positions": ("TypeError", ["position_ids", "integer", "torch.float32"]),
    "labels_shape": ("ValueError", ["batch['labels']", "(2, 16, 1)", "[2, 16]"]),
    "labels_length": ("ValueError", ["batch['labels']", "(2, 15)", "[2, 16, ...]"]),
    "group_not_pg": ("TypeError", ["cp_group", "ProcessGroup", "got str", "new_group"]),
    "backend_group_not_pg": ("TypeError", ["cp_group", "ProcessGroup", "got list", "new_group"]),
    "too_short": ("ValueError", ["sequence length 1", "CP size 2", "smaller CP group"]),
    "check_batch_differs": (
        "ValueError",
        ["check_batch=True", "batch['input_ids']", "[[0], [1]]", "same FULL global batch"],
    ),
    "check_batch_same": ("none", []),
    "check_batch_labels": ("ValueError", ["batch['labels']", "[[0], [1]]"]),
    "block_mask_length": ("ValueError", ["batch['masks']", "(14, 14)", "16 tokens", "get_attention_masks"]),
    "block_mask_rows": ("ValueError", ["batch['masks']['full']", "3 rows", "the batch has 2"]),
    "block_mask_without_mask_mod": ("ValueError", ["batch['masks']", "without a mask_mod", "create_block_mask"]),
    "check_batch_block_mask": ("ValueError", ["check_batch=True", "batch['masks.mask_mod[0]']", "[[0], [1]]"]),
    "nested": ("RuntimeError", ["cannot be nested", "already active", "finish the current step"]),
    "gather_outside": (
        "RuntimeError",
        ["cpcompile.gather", "no cpcompile.shard context is active", "with cpcompile.shard"],
    ),
    "model_outside_shard": (
        "RuntimeError",
        ["model.layers.0.self_attn", "no cpcompile.shard context is active", "with cpcompile.shard"],
    ),
    "eager_attention": ("", ["model.layers.0.self_attn", "softmax", "set attn_implementation='sdpa'"]),
    "window_right": ("none", []),
    "window_wrong": ("MaskMismatchError", ["sliding-window(4)", "differs", "first difference"]),
    "window_missing": ("MaskMismatchError", ["global causal same-document mask", "differs"]),
}
#: only on the rank outside the group
NON_MEMBER = {
    "group_without_rank": ("ValueError", ["not a member", "global rank 1", "contains this rank"]),
    "backend_group_without_rank": ("ValueError", ["not a member", "global rank 1", "contains this rank"]),
}


@pytest.fixture(scope="module")
def results():
    return run_distributed(bad_input_worker, 2, timeout_s=300, fresh=True)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_misuse_error(case, results):
    kind, fragments = EXPECTED[case]
    for rank, res in enumerate(results):
        got_kind, msg = res[case]
        if kind:
            assert got_kind == kind, f"rank {rank} {case}: got {got_kind}: {msg}"
        else:
            assert got_kind != "none", f"rank {rank} {case}: no error"
        for f in fragments:
            assert f in msg, f"rank {rank} {case}: {f!r} not in {msg!r}"


@pytest.mark.parametrize("case", sorted(NON_MEMBER))
def test_group_without_this_rank(case, results):
    kind, fragments = NON_MEMBER[case]
    got_kind, msg = results[1][case]
    assert got_kind == kind, msg
    for f in fragments:
        assert f in msg, msg


def test_ranks_stay_in_step_after_errors(results):
    # after every refused call, one more collective over the group still completes on both ranks
    assert [r["in_step"] for r in results] == [2.0, 2.0]


def test_plan_rejects_bad_sizes():
    batch = packed_batch([[5, 3]])
    with pytest.raises(ValueError, match=r"cp_size must be a positive int, got 0"):
        build_plan(batch, 0, 0)
    with pytest.raises(ValueError, match=r"cp_rank must be in \[0, 2\), got 2"):
        build_plan(batch, 2, 2)
    with pytest.raises(TypeError, match="batch must be a dict"):
        build_plan([batch["input_ids"]], 2, 0)
    with pytest.raises(TypeError, match="integer token ids"):
        build_plan({"input_ids": batch["input_ids"].float()}, 2, 0)
    with pytest.raises(ValueError, match=r"must be a \[B, T\] tensor, got \(8,\)"):
        build_plan({"input_ids": batch["input_ids"][0]}, 2, 0)


def test_failing_rank_fails_fast_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(AssertionError) as e:
        run_distributed(failing_worker, 2, timeout_s=60, fresh=True)
    assert "rank 1 failed on purpose" in str(e.value) and "--- rank 1 ---" in str(e.value)
    assert "Traceback" in str(e.value)
    assert time.monotonic() - start < 45  # not the 60 s timeout: the failure is reported as it happens


def test_hanging_run_is_cut_at_its_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 6s"):
        run_distributed(sleeping_worker, 2, timeout_s=6, fresh=True)
    assert time.monotonic() - start < 30
