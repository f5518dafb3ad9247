"""The values a rewritten position source yields, checked in one process: this process is the LAST rank of a fake
CP group of 2, so its tokens are 19..36 of a T = 37 sequence plus one padding token.

The models have no attention (nothing needs the other rank's data), so the compiled model's local rows must equal
the whole model's rows 19..36; with the rewrite off they are the rows of tokens 0..17 instead.
"""

from __future__ import annotations

import pytest
import torch

import cpcompile
from cpcompile.testing import packed_batch
from tests.harness.tolerances import LOGITS_TOL
from tests.models import positions as pm

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

DOCS = [[10, 20, 7], [5, 30, 2]]  # T = 37: rank 1 of 2 holds tokens 19..36 and one padding token


def _local_logits(form, group, positions="rewrite", inner="eager"):
    backend = cpcompile.backend(group, inner=inner, positions=positions)
    compiled = torch.compile(pm.position_only_lm(form), backend=backend)
    with cpcompile.shard(packed_batch(DOCS, vocab_size=64), group, hf_kwargs=False, layout="contiguous") as local:
        logits = compiled(local["input_ids"])
        real = cpcompile.real_tokens()
    return logits, real, backend


@pytest.mark.parametrize("form", pm.POSITION_ONLY_FORMS)
def test_local_rows_are_the_global_rows(last_rank, form):
    whole = pm.position_only_lm(form)(packed_batch(DOCS, vocab_size=64)["input_ids"])
    logits, real, backend = _local_logits(form, last_rank)
    assert [r.action for r in backend.position_reports] == ["rewritten"], backend.position_reports
    assert real[:, :18].all() and not real[:, 18:].any()
    torch.testing.assert_close(logits[:, :18], whole[:, 19:], **LOGITS_TOL)
    assert torch.isfinite(logits[:, 18:]).all()  # the padding token's index is clamped into the table
    # negative control: left as the model computes them, the positions are those of tokens 0..17
    off, _, _ = _local_logits(form, last_rank, positions="off")
    assert (off[:, :18] - whole[:, 19:]).abs().max() > 1e-3
