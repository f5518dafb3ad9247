"""Refusals, errors and no-op cases, in one process with a fake CP group of size 2 (this process is rank 0).

The fake backend moves no data, so these tests only use what happens before any gathered value is read: the
compile-time check of every SDPA site, the run-time checks of the plan-mask op (active shard context, chunk
length, group, the model's own mask) and models in which nothing is rewritten. Parity of rewritten models runs
on real gloo processes in ``test_parity.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cpcompile
from cpcompile.testing import packed_batch, tiny_model
from tests.harness.graphs import counter_delta, dynamo_graph, run_pass
from tests.harness.tolerances import EXACT, GRAD_TOL, LOGITS_TOL, LOSS_TOL
from tests.models import attention as _models

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

# T = 37, CP = 2: chunks of 19; documents cross the boundary
DOCS = [[10, 20, 7], [5, 30, 2]]


# -- refused at compile time -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make, layer, words",
    [
        (lambda: tiny_model("qwen3", attention_dropout=0.1), "model.layers.0.self_attn", "dropout p=0.1"),
        (lambda: _models.attention_lm("dropout"), "layers.0.attn", "dropout p=0.1"),
        (lambda: _models.attention_lm("float_bias"), "layers.0.attn", "additive bias"),
        (lambda: _models.attention_lm("no_mask"), "layers.0.attn", "non-causal attention without a mask"),
        # a [B, H, T, T] mask that may differ per head (a mask expanded to the heads is accepted)
        (lambda: _models.attention_lm("head_windows"), "layers.0.attn", "per-head masks are not supported"),
    ],
    ids=["hf-qwen3-dropout", "dropout", "float-bias", "noncausal-no-mask", "per-head-mask"],
)
def test_refused_at_compile_time(world, make, layer, words):
    model = make()
    assert model.training
    backend = cpcompile.backend(world, inner="eager")
    compiled = torch.compile(model, backend=backend)
    before = dict(cpcompile.passes.counters)
    with cpcompile.shard(packed_batch(DOCS), world) as local:
        with pytest.raises(cpcompile.UnsupportedAttentionError) as info:
            compiled(**local)
    message = str(info.value)
    assert layer in message and words in message, message
    delta = counter_delta(before)
    assert delta.get("sdpa_refused") == 1 and "sdpa_rewritten" not in delta, delta


def test_second_configuration_in_one_process_is_refused_with_the_reset_fix(world):
    """A second model of another head_dim through the same code: Dynamo recompiles with its ``scaling`` symbolic
    (automatic dynamic), which cannot be proved constant; the refusal names ``torch.compiler.reset()``, and after
    it the second model compiles."""
    with cpcompile.shard(packed_batch(DOCS), world) as local:
        first = tiny_model("qwen3", head_dim=16, num_hidden_layers=1)  # the refusal is per site: one layer
        torch.compile(first, backend=cpcompile.backend(world, inner="eager"))(**local)
        second = tiny_model("qwen3", head_dim=32, num_hidden_layers=1)
        with pytest.raises(cpcompile.UnsupportedAttentionError, match=r"scale is symbolic.*torch\.compiler\.reset\(\)"):
            torch.compile(second, backend=cpcompile.backend(world, inner="eager"))(**local)
    torch.compiler.reset()
    backend = cpcompile.backend(world, inner="eager")
    with cpcompile.shard(packed_batch(DOCS), world) as local:
        torch.compile(second, backend=backend)(**local)
    assert [r.action for r in backend.reports] == ["rewritten"]


@pytest.mark.parametrize("attention", ["flex", "flash_varlen"])
def test_cuda_only_attention_paths_are_refused_on_cpu(world, attention):
    compiled = torch.compile(_models.attention_lm("causal_gqa"), backend=cpcompile.backend(world, attention=attention))
    with cpcompile.shard(packed_batch(DOCS), world) as local:
        with pytest.raises(cpcompile.UnsupportedAttentionError, match=f"attention='{attention}' runs on CUDA only"):
            compiled(**local)


# -- errors at run time ----------------------------------------------------------------------------------
def test_compiled_model_outside_shard_raises(world):
    backend = cpcompile.backend(world, inner="eager")
    compiled = torch.compile(_models.attention_lm("causal_gqa"), backend=backend)
    ids = torch.randint(0, 128, (2, 19))
    with pytest.raises(RuntimeError, match=r"no cpcompile\.shard context is active.*with cpcompile\.shard"):
        compiled(input_ids=ids)
    assert [r.action for r in backend.reports] == ["rewritten", "rewritten"]  # refused at run time, not compile


def test_chunk_length_not_matching_the_plan_raises(world):
    backend = cpcompile.backend(world, inner="eager")
    compiled = torch.compile(_models.attention_lm("causal_gqa"), backend=backend)
    batch = packed_batch(DOCS)
    with cpcompile.shard(batch, world):
        # the whole batch (37 tokens) instead of this rank's chunk (19)
        with pytest.raises(ValueError, match=r"2 rows of 37 tokens.*2 rows of 19 tokens per rank"):
            compiled(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    assert [r.action for r in backend.reports] == ["rewritten", "rewritten"]


def test_shard_with_another_group_raises(world):
    single = dist.new_group([0])
    backend = cpcompile.backend(world, inner="eager")
    compiled = torch.compile(_models.attention_lm("causal_gqa"), backend=backend)
    with cpcompile.shard(packed_batch(DOCS), single) as local:
        with pytest.raises(RuntimeError, match=r"compiled for group .* of size 2.*size 1"):
            compiled(**local)
    assert [r.action for r in backend.reports] == ["rewritten", "rewritten"]


def test_model_mask_differing_from_the_plan_raises(world):
    """A model whose own bool mask is not causal+same-document: MaskMismatchError naming the layer, every call."""
    backend = cpcompile.backend(world, inner="eager")
    compiled = torch.compile(_models.attention_lm("bidirectional"), backend=backend)
    with cpcompile.shard(packed_batch(DOCS), world) as local:
        for _ in range(2):  # not only on the first call: a refused site is never marked verified
            with pytest.raises(cpcompile.MaskMismatchError, match=r"layers\.0\.attn") as info:
                compiled(**local)
    assert "differs from the global causal same-document mask" in str(info.value)
    assert [(r.action, r.mask_form) for r in backend.reports] == [("rewritten", "bool-mask")] * 2


def test_mask_expanded_to_the_heads_is_the_mask(world):
    """``mask.expand(B, H, T, T)`` of a causal same-document mask: the site takes the [B, 1, T, T] mask it was
    expanded from (the same for every head), checks it against the plan's on the first call and runs."""
    backend = cpcompile.backend(world, inner="eager")
    compiled = torch.compile(_models.attention_lm("head_expanded"), backend=backend)
    with cpcompile.shard(packed_batch(DOCS), world) as local:
        out = compiled(**local)
    assert [(r.action, r.mask_form) for r in backend.reports] == [("rewritten", "bool-mask")] * 2
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("form, error", [("document_ids", None), ("bidirectional", "layout='contiguous'")])
def test_document_mask_under_several_runs(world, form, error):
    """The head_tail layout gives a rank two runs of tokens (the balanced one, several). A mask built from
    per-token document ids (an input sharded like the tokens) keeps a document whole across runs, unlike the
    local rule (a new document at every run boundary): it is accepted as the whole-sequence mask among the
    rank's tokens. A mask that is neither is refused, and the refusal names the contiguous layout."""
    backend = cpcompile.backend(world, inner="eager")
    compiled = torch.compile(_models.attention_lm(form), backend=backend)
    batch = packed_batch(DOCS)
    batch["document_ids"] = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in DOCS])
    with cpcompile.shard(batch, world, layout="head_tail") as local:
        assert cpcompile.runtime.current_plan().runs() > 1  # else the case tests nothing
        if error is None:
            assert torch.isfinite(compiled(**local).loss)
        else:
            with pytest.raises(cpcompile.MaskMismatchError, match=error):
                compiled(**local)
    assert [r.action for r in backend.reports] == ["rewritten", "rewritten"]


def test_window_mask_built_in_the_graph_is_reproduced(world):
    """A causal same-document mask with a 4-token window: the pass reads the window from the graph, so the
    plan's mask matches the model's (no MaskMismatchError) and every site's mask op carries window 4."""
    backend = cpcompile.backend(world, inner="eager")
    compiled = torch.compile(_models.attention_lm("window"), backend=backend)
    with cpcompile.shard(packed_batch(DOCS), world) as local:
        compiled(**local)
    assert [(r.action, r.mask_form) for r in backend.reports] == [("rewritten", "bool-mask")] * 2
    gm = _captured_rewritten(_models.attention_lm("window"))
    assert [r.window for r in backend.reports] == [_models.WINDOW] * 2
    plan_ops = [n for n in gm.graph.nodes if n.target is torch.ops.cpcompile.site_plan.default]
    assert [cpcompile.ops.site_spec(n.args[-1]).window for n in plan_ops] == [_models.WINDOW] * 2


def _captured_rewritten(model) -> torch.fx.GraphModule:
    gm = dynamo_graph(model, **packed_batch(DOCS), use_cache=False)
    run_pass(gm, cp_size=2)
    return gm


# -- nothing to rewrite ----------------------------------------------------------------------------------
def test_model_without_sdpa_is_unchanged(world):
    model = _models.mlp_lm()
    backend = cpcompile.backend(world, inner="eager", token_mixing="none")  # else the step raises: no attention
    compiled = torch.compile(model, backend=backend)
    before = dict(cpcompile.passes.counters)
    with cpcompile.shard(packed_batch(DOCS), world) as local:
        out = compiled(**local)
        ref = model(**local)
    # the same aten ops on the same inputs: bit-identical
    torch.testing.assert_close(out.logits, ref.logits, **EXACT)
    torch.testing.assert_close(out.loss, ref.loss, **EXACT)
    assert backend.reports == []
    # the loss (cross entropy summed over this rank's tokens) is the one op that mixes tokens: a partial sum
    assert counter_delta(before) == {
        "graphs": 1,
        "graphs_without_sdpa": 1,
        "mixing_ops_found": 1,
        "mixing_partial_sum": 1,
    }


def test_cp_group_of_size_one_is_a_noop(world):
    """CP over one rank: nothing rewritten, and the compiled step equals the eager model on the whole batch."""
    single = dist.new_group([0])
    batch = packed_batch(DOCS)
    ref = tiny_model("llama")
    ref_out = ref(**batch, use_cache=False)
    ref_out.loss.backward()
    model = tiny_model("llama")
    backend = cpcompile.backend(single, inner="eager")
    before = dict(cpcompile.passes.counters)
    with cpcompile.shard(batch, single) as local:
        assert torch.equal(local["input_ids"], batch["input_ids"])
        out = torch.compile(model, backend=backend)(**local)
        out.loss.backward()
        logits = cpcompile.gather(out.logits)
    assert [r.action for r in backend.reports] == ["untouched", "untouched"]
    delta = counter_delta(before)
    assert delta.get("sdpa_found") == 2 and "sdpa_rewritten" not in delta, delta
    # the compiled graph may order the backward's additions differently from eager autograd
    torch.testing.assert_close(logits, ref_out.logits, **LOGITS_TOL)
    torch.testing.assert_close(out.loss, ref_out.loss, **LOSS_TOL)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **GRAD_TOL, msg=lambda m, n=name: f"grad of {n}: {m}")


def test_cp_group_of_size_one_leaves_unsupported_forms_alone(world):
    """With one rank nothing is rewritten, so a form CP would refuse (dropout) runs as the model wrote it."""
    single = dist.new_group([0])
    backend = cpcompile.backend(single, inner="eager")
    compiled = torch.compile(_models.attention_lm("dropout"), backend=backend)
    with cpcompile.shard(packed_batch(DOCS), single) as local:
        out = compiled(**local)
    assert torch.isfinite(out.loss)
    assert [(r.action, r.reason) for r in backend.reports] == [("untouched", "CP group of size 1")] * 2


# -- bad input -------------------------------------------------------------------------------------------
def test_bad_arguments_raise_clear_errors(world):
    with pytest.raises(TypeError, match="ProcessGroup"):
        cpcompile.backend("cp")
    with pytest.raises(ValueError, match="inner='tvm'"):
        cpcompile.backend(world, inner="tvm")
    with pytest.raises(RuntimeError, match="no cpcompile.shard context is active"):
        cpcompile.gather(torch.zeros(2, 19, 4))
    batch = packed_batch(DOCS)
    with cpcompile.shard(batch, world):
        with pytest.raises(ValueError, match="chunk length 19"):
            cpcompile.gather(torch.zeros(2, 37, 4))
        with pytest.raises(RuntimeError, match="cannot be nested"):
            with cpcompile.shard(batch, world):
                pass
    with pytest.raises(ValueError, match="masks out tokens"):
        with cpcompile.shard({**batch, "attention_mask": torch.zeros(2, 37, dtype=torch.bool)}, world):
            pass


def test_model_mask_check_covers_every_block_of_rows(world):
    """The first-call mask check compares the model's mask a block of query rows at a time: a difference in the
    last block is found, and reported at its local query index."""
    from cpcompile import ops

    c = ops.MASK_CHECK_ROWS + 300  # two blocks of rows
    with cpcompile.shard(packed_batch([[c, c], [2 * c]]), world, layout="contiguous"):
        plan = cpcompile.runtime.current_plan()
        good = plan.local_rule_mask(documents=True)
        bad = good.clone()
        bad[1, 0, c - 1, 0] = ~bad[1, 0, c - 1, 0]
        k = torch.zeros(2, 2, c, 4)

        def check(name, mask):
            spec = ops.SiteSpec(
                site=f"test-mask-rows-{name}",
                layer="test.layer",
                group_name=plan.group_name,
                cp_size=2,
                cp_rank=0,
                documents=True,
                window=None,
                kernel="dense",
                needs_grad=False,
            )
            return torch.ops.cpcompile.site_check(k, mask, ops.register_site(spec))

        check("good", good)
        difference = rf"row 1, local query {c - 1}, key 0: model False, expected True"
        with pytest.raises(cpcompile.MaskMismatchError, match=difference):
            check("bad", bad)
