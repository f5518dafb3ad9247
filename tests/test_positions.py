"""Position sources found in the graph: rewritten, left to the mask, or refused. One process, fake CP group of 2.

The fake process group moves no data, so these tests check what happens at compile time (which sources the pass
finds, what it does with each, the refusals and their messages, the graph it writes) and the run-time checks of
``torch.ops.cpcompile.token_positions``; parity of the rewritten models runs on gloo processes in
``test_positions_parity.py``.
"""

from __future__ import annotations

import copy
import json
import operator

import pytest
import torch
import torch.distributed as dist

import cpcompile
from cpcompile.passes import positions_pass
from cpcompile.plan import build_plan
from cpcompile.testing import packed_batch, tiny_model
from tests.harness.graphs import context, counter_delta, dynamo_graph
from tests.models import positions as pm

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

# T = 37, CP = 2: chunks of 19, one padding token on rank 1
DOCS = [[10, 20, 7], [5, 30, 2]]
FIX_WORDS = 'positions=local["position_ids"]'


def _compile_and_run(model, group, *, dynamic=True, **backend_kwargs):
    backend = cpcompile.backend(group, inner="eager", **backend_kwargs)
    compiled = torch.compile(model, backend=backend)
    with cpcompile.shard(packed_batch(DOCS), group, dynamic=dynamic) as local:
        out = compiled(**local)
    return backend, out


def _position_actions(backend):
    return [(r.layer, r.kind, r.action) for r in backend.position_reports]


# -- what the pass finds and does ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "form, expected",
    [
        ("titan_style", [("layers.0.attn", "table_slice", "rewritten"), ("layers.1.attn", "table_slice", "rewritten")]),
        ("lit_style", [("", "table_slice", "rewritten")] * 2),  # cos[:T], sin[:T] at the model level
        ("arange_rope", [("layers.0.attn", "arange", "rewritten"), ("layers.1.attn", "arange", "rewritten")]),
        ("learned_positions", [("", "arange", "rewritten")]),
        ("explicit_positions", []),  # positions come from the input: nothing to rewrite
        ("library_style", [("layers.0.attn", "arange", "rewritten"), ("layers.1.attn", "arange", "rewritten")]),
    ],
)
def test_sources_found_and_rewritten(world, form, expected):
    before = dict(cpcompile.passes.counters)
    backend, out = _compile_and_run(pm.position_lm(form), world)
    assert _position_actions(backend) == expected
    assert all(r.reason == "" for r in backend.position_reports)
    delta = counter_delta(before)
    assert delta.get("position_sources_found", 0) == len(expected)
    assert delta.get("position_sources_rewritten", 0) == len(expected)
    assert "position_sources_refused" not in delta
    assert [r.action for r in backend.reports] == ["rewritten", "rewritten"]  # both SDPA sites
    assert torch.isfinite(out.loss)


def _captured(model) -> torch.fx.GraphModule:
    with cpcompile.shard(packed_batch(DOCS), dist.group.WORLD) as local:
        return dynamo_graph(model, **local)


def test_rewritten_graph_reads_the_plan(world):
    """The slice becomes an index_select of the whole table at token_positions, which the pass gives the rows
    the table has; arange becomes token_positions cast to its dtype; the graph passes lint."""
    gm = _captured(pm.position_lm("titan_style"))
    before = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is operator.getitem]
    positions_pass(gm, context(site_prefix="t"), 19)
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.cpcompile.token_positions.default]
    assert [n.args[1] for n in calls] == [128, 128]  # the rows of every layer's RoPE cache
    assert all(n.args[2].startswith("t:layers.") for n in calls)
    selects = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "index_select"]
    assert len(selects) == 2 and all(s.args[1] == 0 and s.args[2] in calls for s in selects)
    assert len(before) > 0
    gm.graph.lint()

    gm = _captured(pm.position_lm("learned_positions"))
    positions_pass(gm, context(site_prefix="t"), 19)
    (call,) = [n for n in gm.graph.nodes if n.target is torch.ops.cpcompile.token_positions.default]
    assert call.args[1] == -1  # an arange has no table to check
    # wpe(arange(T)) now looks up the global positions: the embedding's indices come from the op
    lookups = [n for n in gm.graph.nodes if n.target is torch.nn.functional.embedding]
    assert [n.args[0] is call for n in lookups] == [False, True]  # token embedding, then wpe


def test_transformers_masks_are_left_to_the_plan(world):
    """transformers builds its mask from arange(T) in the graph: every such source only feeds the mask, which the
    attention pass replaces and checks, so it is reported as left to the mask and the graph keeps it."""
    backend, _ = _compile_and_run(tiny_model("llama"), world)
    assert [(r.kind, r.action) for r in backend.position_reports] == [("arange", "mask"), ("arange", "mask")]
    assert [r.action for r in backend.reports] == ["rewritten", "rewritten"]


def test_transformers_checkpointed_layers_masks_left_to_the_plan(world):
    """With activation checkpointing the mask enters the checkpointed region (a nested graph): a pairwise
    [B, 1, T, T] value passed on is a mask there too."""
    model = tiny_model("llama")
    model.gradient_checkpointing_enable()
    backend, _ = _compile_and_run(model, world)
    assert {r.action for r in backend.position_reports} == {"mask"}
    assert [r.action for r in backend.reports] == ["rewritten", "rewritten"]


def test_static_graph_of_transformers_model_runs(world):
    """shard(dynamic=False): the mask sources are found by their size and still only feed the mask."""
    backend, _ = _compile_and_run(tiny_model("qwen3"), world, dynamic=False)
    assert {r.action for r in backend.position_reports} == {"mask"}


def test_one_token_per_rank(world):
    """T = N: Dynamo specialises the chunk length 1, so the graph is static and every broadcast dim has the chunk
    length; a transformers model still compiles (its aranges only build the mask), a range of the length does not."""
    batch = packed_batch([[2], [2]])
    backend = cpcompile.backend(world, inner="eager")
    with cpcompile.shard(batch, world) as local:
        torch.compile(tiny_model("llama"), backend=backend)(**local)
    assert {r.action for r in backend.position_reports} == {"mask"}
    torch._dynamo.reset()
    compiled = torch.compile(pm.position_lm("learned_positions"), backend=cpcompile.backend(world, inner="eager"))
    with pytest.raises(cpcompile.UnsupportedPositionError, match=r"static sequence length \(1 tokens per rank"):
        with cpcompile.shard(batch, world) as local:
            compiled(**local)


# -- refusals --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "form, node_words, reason_words",
    [
        ("mixed_positions", "(node ones_like) (factory)", "(node cumsum): cumsum mixes the values of different"),
        ("arange_cumsum", "(node arange) (arange)", "(node cumsum): cumsum mixes"),
        ("table_sum", "(table_slice)", "sum mixes the values of different positions"),
        ("arange_matmul", "(arange)", "matmul contracts the sequence dim"),
        ("shifted_arange", "(node arange) (arange)", "an arange of s"),
        ("length_value", "(length)", "the local sequence length used as a value"),
        ("linspace", "(node linspace) (other)", "made by linspace"),
    ],
)
def test_refused_at_compile_time(world, form, node_words, reason_words):
    before = dict(cpcompile.passes.counters)
    with pytest.raises(cpcompile.UnsupportedPositionError) as info:
        _compile_and_run(pm.position_lm(form), world)
    message = str(info.value)
    assert node_words in message and reason_words in message, message
    assert "<top level>" in message and FIX_WORDS in message and "position_ids" in message, message
    delta = counter_delta(before)
    # nothing rewritten: every source of the graph is checked before the first rewrite
    assert delta.get("position_sources_refused", 0) >= 1 and "position_sources_rewritten" not in delta, delta
    assert isinstance(info.value, RuntimeError)  # torch.compile passed it through unchanged


# near misses of the forms the pass proves (tests/test_positions_values.py checks those): the refusal names the
# model's source line of the source and of the use, and the fix for that code
@pytest.mark.parametrize(
    "form, line_words, reason_words, fix_words",
    [
        ("live_max", "(return model.wpe(t) + (t.max() + 1))", "max mixes", "this reduction sees only"),
        ("live_inplace", "(pe.add_(t.max()))", "max mixes", "this reduction sees only"),
        ("table_tail", "(return model.wpe.weight[-T:])", "a slice at an offset", "table[-T:]"),
        ("partial_slice", "(return torch.cat((e[-(T - 1) :]", "slice(neg, None, None) (a shift", "index the whole"),
        ("ellipsis_contraction", 'einsum("...f -> f"', "einsum contracts the sequence dim", "this product sums"),
        (
            "repeated_positions",
            "(return model.wpe(t.repeat_interleave(2)[:T]))",
            "repeat_interleave repeats positions along the sequence (or flattens it)",
            "take its positions as an input",
        ),
    ],
)
def test_near_misses_refused_at_their_source_line(world, form, line_words, reason_words, fix_words):
    compiled = torch.compile(pm.position_only_lm(form), backend=cpcompile.backend(world, inner="eager"))
    with pytest.raises(cpcompile.UnsupportedPositionError) as info:
        with cpcompile.shard(packed_batch(DOCS, vocab_size=64), world, hf_kwargs=False) as local:
            compiled(local["input_ids"])
    message = str(info.value)
    assert "tests/models/positions.py:" in message and line_words in message, message
    assert reason_words in message and fix_words in message and FIX_WORDS in message, message
    assert "torchtitan" not in message and "transformers" not in message, message
    # the source line comes before the graph node it names
    assert message.index("tests/models/positions.py:") < message.index("(node "), message


def test_cache_written_in_place_is_refused_on_every_call(world):
    """RoPE rows written into a buffer on the call that finds it short (``cached[:T] = freqs``), then read: the
    write would keep this rank's rows for later calls, so every call that writes is refused (the buffer stays
    as it was, and the next call, which finds it short again, is refused the same way)."""
    model = pm.position_only_lm("cache_written")
    compiled = torch.compile(model, backend=cpcompile.backend(world, inner="eager"))
    for _ in range(2):
        with pytest.raises(cpcompile.UnsupportedPositionError) as info:
            with cpcompile.shard(packed_batch(DOCS, vocab_size=64), world, hf_kwargs=False) as local:
                compiled(local["input_ids"])
        message = str(info.value)
        assert "(model.cached[:T] = torch.cat((freqs, freqs), -1).cos())" in message, message
        assert "setitem writes it in place into l_self_buffers_cached_, a buffer or parameter" in message, message
        assert "fill the cache for every row once, outside the training call" in message, message
    assert model.cached_rows == 0 and not model.cached.any()


def test_refused_graph_is_dumped(world, tmp_path):
    with pytest.raises(cpcompile.UnsupportedPositionError) as info:
        _compile_and_run(pm.position_lm("arange_cumsum"), world, dump_dir=str(tmp_path))
    summary = json.loads((tmp_path / "rank0" / "summary.json").read_text())
    (graph,) = summary["graphs"]
    assert str(info.value).startswith(graph["refused"]) and graph["after"] is None
    assert "cumsum" in (tmp_path / "rank0" / graph["before"]).read_text()
    assert not (tmp_path / "rank0" / "graph0_after.py").exists()


def test_static_graph_refuses_what_it_would_rewrite(world):
    """Without a symbol for the length, a size equal to the chunk length may be a constant: refused, naming the
    static length and dynamic=True."""
    with pytest.raises(cpcompile.UnsupportedPositionError) as info:
        _compile_and_run(pm.position_lm("titan_style"), world, dynamic=False)
    message = str(info.value)
    assert "layers.0.attn" in message and "static sequence length (19 tokens per rank" in message, message
    assert "dynamic=True" in message and FIX_WORDS in message, message


class _MixedLengths(torch.nn.Module):
    """Token ids whose sequence dim is a symbol, hidden states whose sequence dim is the constant 16 (a graph
    after a graph break), and positions from the hidden states' length."""

    def forward(self, input_ids, hidden):
        return hidden + torch.arange(hidden.shape[1])[:, None], input_ids * 2


def test_mixed_graph_refuses_a_source_of_the_constant_length():
    """In a graph with the length's symbol and the constant chunk length side by side, a source of the constant
    length is found by its size (as in a static graph) and refused; without that, it was left alone, silently
    giving every rank positions [0, c)."""
    input_ids, hidden = torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, 8)
    torch._dynamo.mark_dynamic(input_ids, 1)
    gm = dynamo_graph(_MixedLengths(), input_ids=input_ids, hidden=hidden)
    with pytest.raises(cpcompile.UnsupportedPositionError) as info:
        positions_pass(gm, context(), chunk_len=16)
    assert "static sequence length (16 tokens per rank" in str(info.value), str(info.value)


class _RowWrites(torch.nn.Module):
    """Rows written into a zero tensor of the local length (a factory: a position source) at the rows an index
    gives: ``form="data"`` writes the hidden states' rows (an MoE combine: the zeros stay put, the rows are
    data), ``form="positions"`` writes rows of an ``arange`` over the tokens (position-derived values moved to
    other rows)."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form

    def forward(self, input_ids, hidden, index):
        T, D = hidden.shape[1], hidden.shape[2]
        rows = hidden[0] if self.form == "data" else torch.arange(T, dtype=hidden.dtype)[:, None].expand(T, D)
        return torch.zeros_like(hidden[0]).scatter_add(0, index, rows), input_ids * 2


@pytest.mark.parametrize("form", ["data", "positions"])
def test_rows_written_into_a_factory(form):
    """``scatter_add`` into a factory of the local length keeps the factory's own elements in place: writing data
    rows is left alone; writing position-derived rows at other rows is refused."""
    input_ids, hidden = torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, 8)
    index = torch.zeros(16, 8, dtype=torch.long)
    for t in (input_ids, hidden, index):
        torch._dynamo.mark_dynamic(t, 1 if t.dim() > 2 or t is input_ids else 0)
    gm = dynamo_graph(_RowWrites(form), input_ids=input_ids, hidden=hidden, index=index)
    if form == "data":
        reports = positions_pass(gm, context(), chunk_len=16)
        assert not [r for r in reports if r.action == "refused"], reports
    else:
        with pytest.raises(cpcompile.UnsupportedPositionError, match="scatter_add moves position-derived rows"):
            positions_pass(gm, context(), chunk_len=16)


def test_positions_off_leaves_the_graph_alone(world):
    backend, _ = _compile_and_run(pm.position_lm("titan_style"), world, positions="off")
    assert backend.position_reports == []
    gm = _captured(pm.position_lm("mixed_positions"))  # refused when on; nothing looked at when off
    assert not any(n.target is torch.ops.cpcompile.token_positions.default for n in gm.graph.nodes)
    backend, _ = _compile_and_run(pm.position_lm("mixed_positions"), world, positions="off")
    assert backend.position_reports == []
    with pytest.raises(ValueError, match=r"positions='on' is not a known mode; choose one of \('rewrite', 'off'\)"):
        cpcompile.backend(world, positions="on")


# -- run-time checks of the op ---------------------------------------------------------------------------
@pytest.mark.parametrize("max_len, what", [(30, "too short"), (19, "cut to one rank's rows")])
def test_table_shorter_than_the_global_sequence_raises(world, max_len, what):
    """A RoPE table of fewer rows than T (also one cut by hand to this rank's 19 rows): ValueError naming the
    layer, the sizes and the fix, never a clamp."""
    with pytest.raises(ValueError) as info:
        _compile_and_run(pm.position_lm("titan_style", max_len=max_len), world)
    message = str(info.value)
    assert f"has {max_len} rows, but the global sequence has 37 tokens" in message, message
    assert "layers.0.attn" in message and "at least 37 rows" in message and "context_parallel" in message, message


def test_token_positions_op_checks(world):
    op = torch.ops.cpcompile.token_positions
    with pytest.raises(RuntimeError, match=r"no cpcompile\.shard context is active"):
        op(torch.zeros(19), -1, "site-x")
    with cpcompile.shard(packed_batch(DOCS), world, layout="contiguous"):
        torch.testing.assert_close(op(torch.zeros(19, 3), 37, "site-x"), torch.arange(19), atol=0, rtol=0)
        with pytest.raises(RuntimeError, match=r"site-x has 18 local positions.*chunk length 19"):
            op(torch.zeros(18), -1, "site-x")
        with pytest.raises(ValueError, match=r"site-x has 36 rows"):
            op(torch.zeros(19), 36, "site-x")


def test_plan_token_indices_and_real_tokens():
    """Rank r holds global tokens [r*c, (r+1)*c); indices >= T are padding (T = 37, CP = 4: c = 10)."""
    batch = packed_batch(DOCS)
    for rank in range(4):
        plan = build_plan(batch, 4, rank, layout="contiguous")
        idx = plan.token_indices()
        assert idx.dtype == torch.long and idx.tolist() == list(range(10 * rank, 10 * rank + 10))
        real = plan.real_tokens()
        assert real.shape == (2, 10) and real.dtype == torch.bool
        assert real.sum().item() == 2 * min(10, max(0, 37 - 10 * rank))
        assert plan.token_indices(rank=0).tolist() == list(range(10))


# -- reports in inspect and dumps ------------------------------------------------------------------------
def test_backend_dump_lists_positions(world, tmp_path):
    _compile_and_run(pm.position_lm("learned_positions"), world, dump_dir=str(tmp_path))
    summary = json.loads((tmp_path / "rank0" / "summary.json").read_text())
    (graph,) = summary["graphs"]
    assert [(p["kind"], p["action"], p["node"]) for p in graph["positions"]] == [("arange", "rewritten", "arange")]
    after = (tmp_path / "rank0" / "graph0_after.py").read_text()
    assert "torch.ops.cpcompile.token_positions.default" in after


def test_backend_deepcopy_is_the_backend(world):
    """Lightning (imported by litgpt) deep-copies torch.compile's keyword arguments; the process group inside
    the backend cannot be copied, so a copy is the backend itself."""
    backend = cpcompile.backend(world)
    assert copy.deepcopy(backend) is backend
    assert copy.deepcopy({"backend": backend})["backend"] is backend
