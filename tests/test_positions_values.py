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
    backend = cpcompile.backend(group, inner=inner, positions=positions, token_mixing="none")  # no attention
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


# -- decisions the model's code takes on the length it is given --------------------------------------------
def _whole_and_local(model, doc_lens, group, monkeypatch=None):
    """The whole model's rows of this rank's tokens and the compiled model's local rows (``monkeypatch``: with
    the check of the code's decisions on the length switched off, the negative control)."""
    import copy

    from cpcompile.passes.positions.guards import LengthGuards

    if monkeypatch is not None:
        monkeypatch.setattr(LengthGuards, "check", lambda self, seq_len, chunk_len: None)
    batch = packed_batch(doc_lens, vocab_size=64)
    T = batch["input_ids"].shape[1]
    c = -(-T // 2)
    whole = copy.deepcopy(model)(batch["input_ids"])[:, c:]
    compiled = torch.compile(model, backend=cpcompile.backend(group, inner="eager", token_mixing="none"))
    with cpcompile.shard(batch, group, hf_kwargs=False, layout="contiguous") as local:
        logits = compiled(local["input_ids"])
    return whole, logits[:, : T - c]


@pytest.mark.parametrize(
    "form, filled, decided",
    [
        ("length_branch", 0, "T <= 24"),  # if T > 24: not taken for a rank's 19 tokens, taken for the whole 37
        ("cache_written", 20, "T <= 20"),  # a cache of 20 rows is long enough for a rank's 19, not for 37
    ],
)
def test_decision_on_the_local_length_is_refused(last_rank, monkeypatch, form, filled, decided):
    """A branch on ``x.shape[1]`` (or on a cache's row count against it) is taken on the rank's length; where the
    whole sequence decides otherwise, the call is refused, naming the line, the decision and both lengths."""
    model = pm.position_only_lm(form)
    if filled:  # an earlier eager call (an evaluation, a warm-up) on a shorter sequence filled the cache
        model(torch.zeros(1, filled, dtype=torch.long))
    with pytest.raises(cpcompile.UnsupportedPositionError) as info:
        _whole_and_local(model, DOCS, last_rank)
    message = str(info.value)
    assert "tests/models/positions.py:" in message and f"it decided `{decided}`" in message, message
    assert "this rank's 19 tokens" in message and "the whole sequence has 37 tokens" in message, message
    assert "take the decision from the global length" in message, message
    # negative control: without the check the call runs and its rows are not the whole model's
    torch._dynamo.reset()
    whole, local = _whole_and_local(model, DOCS, last_rank, monkeypatch)
    assert (local - whole).abs().max() > 1e-3


def test_decision_is_checked_again_for_a_new_global_length(last_rank):
    """A graph whose decision held for the first batch's lengths serves a later batch whose rank length keeps it
    (no recompile), but whose whole length does not: that call is refused before the graph runs."""
    counts = torch._dynamo.utils.counters
    model = pm.position_only_lm("length_branch")
    whole, local = _whole_and_local(model, [[12, 8]], last_rank)  # T = 20: a rank's 10 and the whole 20 <= 24
    torch.testing.assert_close(local, whole, **LOGITS_TOL)
    frames = counts["stats"]["unique_graphs"]
    with pytest.raises(cpcompile.UnsupportedPositionError, match=r"it decided `T <= 24`.*this rank's 19 tokens"):
        _whole_and_local(model, DOCS, last_rank)  # T = 37: a rank's 19 <= 24 keeps the graph, the whole 37 does not
    assert counts["stats"]["unique_graphs"] == frames  # the same graph, checked again for the new length
