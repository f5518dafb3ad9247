"""Ops that mix tokens outside attention: found, run on the whole sequence, accounted for, or refused. One process,
fake CP group of 2.

The fake group moves no data, so these tests check what the mixing pass decides at compile time (the ops it finds
and what it does with each, the refusals and their messages, the graph it writes, the options); parity of the
rewritten models runs on gloo processes in ``test_mixing_parity.py``. Models: ``tests.models.mixing.mixer_lm``
(one mixer each), transformers LFM2 (``Lfm2ForCausalLM``, a conv layer and an attention layer), Llama, GLM-4-MoE,
Mixtral and Qwen3-MoE (``MixtralForCausalLM``, ``Qwen3MoeForCausalLM``: MoE
dispatch), and ``LlamaForSequenceClassification`` (last-token pooling, ``pooled``).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cpcompile
from cpcompile.passes import counters
from cpcompile.plan import MAX_RUNS
from cpcompile.testing import packed_batch, tiny_config, tiny_model
from tests.harness.graphs import counter_delta
from tests.models.mixing import KERNEL, mixer_lm
from tests.models.tiny import lm_output

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

# T = 32, CP = 2: chunks of 16 (a multiple of the chunked scan's chunk of 4); documents cross the chunk edge
DOCS = [[10, 22], [5, 27]]


def _compile_and_run(model, group, *, docs=DOCS, backward=False, traced_backward=False, **backend_kwargs):
    """``backward``: compile with AOTAutograd and run the backward; ``traced_backward``: compile with AOTAutograd (the
    backward is traced) but run only the forward (a halo's backward all-to-all receives on rank 0, which the fake
    group refuses)."""
    inner = "aot_eager" if backward or traced_backward else "eager"
    backend = cpcompile.backend(group, inner=inner, **backend_kwargs)
    compiled = torch.compile(model, backend=backend)
    with cpcompile.shard(packed_batch(docs), group) as local:
        out = compiled(**local)
        if backward:
            out.loss.backward()
        comm = cpcompile.comm_stats()
    return backend, out, comm


def _actions(backend):
    return [(r.layer, r.op, r.kind, r.action) for r in backend.mixing_reports]


LOSS = ("", "cross_entropy", "loss", "partial_sum")


# -- run with a halo, or on the whole sequence --------------------------------------------------------------------
@pytest.mark.parametrize(
    "mixer, found",
    [
        ("conv", ("mixer.conv", "conv1d", "convolution", "halo")),
        ("shift", ("mixer", "pad", "shift", "halo")),
        ("first_diff", ("mixer", "diff", "shift", "gathered")),  # with the first-token slice it reads
        ("mask_cumsum", ("mixer", "cumsum", "scan", "gathered")),
    ],
)
def test_causal_mixers_take_a_halo_or_run_on_the_whole_sequence(world, mixer, found):
    before = dict(counters)
    # AOTAutograd traces the rewritten conv with its backward (the others: forward only, cheaper)
    backend, out, comm = _compile_and_run(mixer_lm(mixer=mixer), world, traced_backward=mixer == "conv")
    assert _actions(backend) == [found, LOSS]
    action = found[3]
    delta = counter_delta(before)
    assert delta["mixing_ops_found"] == 2 and delta[f"mixing_{action}"] == 1 and delta["mixing_partial_sum"] == 1
    assert "mixing_refused" not in delta
    (region,) = [r for r in backend.mixing_reports if r.action == action]
    if action == "gathered":  # one all-gather of the region's input per step (16 tokens of rank 1 received)
        assert comm.sequence_gathers == 1 and comm.sequence_gather_bytes == region.all_gather_bytes_per_call > 0
        assert comm.sequence_halos == 0
    else:  # one halo exchange per step; rank 0 holds the sequence's first tokens and receives none
        assert comm.sequence_halos == 1 and comm.sequence_halo_bytes == 0 and comm.sequence_gathers == 0
        assert comm.halo_exchanges == 0  # kept apart from attention's
    assert comm.all_gathers == 2  # K and V of the one attention layer
    assert torch.isfinite(out.loss)
    assert "models/mixing.py" in region.source


def test_halo_region_receives_the_tokens_before_its_run(world):
    """Rank 0 of 2 under head_tail (tokens 0..7 and 24..31) receives the conv's halo of its second run, kernel - 1 =
    2 tokens from rank 1: ``2 x hidden`` values per row, counted apart from attention's halo."""
    model = mixer_lm(mixer="conv")
    backend = cpcompile.backend(world, inner="eager")
    with cpcompile.shard(packed_batch(DOCS), world, layout="head_tail") as local:
        torch.compile(model, backend=backend)(**local)
        comm = cpcompile.comm_stats()
    assert _actions(backend)[0][3] == "halo"
    assert comm.sequence_halos == 1 and comm.halo_exchanges == 0 and comm.sequence_gathers == 0
    assert comm.sequence_halo_bytes == len(DOCS) * model.mixer.conv.in_channels * (KERNEL - 1) * 4  # fp32


def test_halo_region_runs_on_its_tokens_and_halo_not_the_gathered_sequence(world, tmp_path):
    """The conv region becomes: the halo routing and exchange, the plan's order, the conv on this rank's 16 tokens
    and ``MAX_RUNS * (kernel - 1)`` halo slots (not on the 32 tokens of the whole sequence), this rank's tokens taken
    back; no all-gather of the sequence; the dump lists the mixing ops."""
    backend = cpcompile.backend(world, inner="eager", dump_dir=str(tmp_path))
    graphs, lengths = [], []

    def keep(gm, example_inputs):
        out = backend(gm, example_inputs)
        graphs.append((gm, example_inputs))
        return out

    class ConvInputs(torch.fx.Interpreter):
        def call_function(self, target, args, kwargs):
            if target is torch.conv1d:
                lengths.append(args[0].shape[-1])
            return super().call_function(target, args, kwargs)

    with cpcompile.shard(packed_batch(DOCS), world) as local:
        torch.compile(mixer_lm(mixer="conv"), backend=keep)(**local)
        ((gm, inputs),) = graphs
        ConvInputs(gm).run(*(i.node.hint if isinstance(i, torch.SymInt) else i for i in inputs))
    assert lengths == [16 + MAX_RUNS * (KERNEL - 1)]
    after = (tmp_path / "rank0" / "graph0_after.py").read_text()
    assert "cpcompile.halo_exchange.default" in after and "cpcompile.region_halo_order.default" in after
    assert "all_gather_seq" not in after and "sequence_order" not in after
    assert after.count("conv1d(") == 1  # the local conv is gone
    summary = json.loads((tmp_path / "rank0" / "summary.json").read_text())
    (graph,) = summary["graphs"]
    found = [(m["op"], m["action"]) for m in graph["mixing"]]
    assert found == [("conv1d", "halo"), ("cross_entropy", "partial_sum")]


@pytest.mark.parametrize("value, action", [(0.0, "halo"), (1.0, "gathered")])
def test_a_token_shift_padded_with_another_value_than_zero_is_gathered(world, value, action):
    """The halo holds zeros before the sequence's first token, what a pad of 0 supplies; a pad of another value
    runs on the whole sequence, where the pad itself supplies it."""

    class Shift(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mix = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.mix(F.pad(x, (0, 0, 2, 0), value=value)[:, :-2]).sum()

    backend = cpcompile.backend(world, inner="eager")
    x = torch.randn(2, 32, 8)
    with cpcompile.shard({"input_ids": torch.zeros(2, 32, dtype=torch.long), "x": x}, world) as local:
        torch.compile(Shift(), backend=backend)(local["x"])
    assert [(r.op, r.action) for r in backend.mixing_reports] == [("pad", action), ("sum", "partial_sum")]


def test_rewritten_gathered_region_reads_the_plan(world, tmp_path):
    """A region without a bounded window (the cumsum) becomes: all-gather of its input, the plan's order, the scan
    on the whole sequence, this rank's tokens taken back."""
    _compile_and_run(mixer_lm(mixer="mask_cumsum"), world, dump_dir=str(tmp_path))
    after = (tmp_path / "rank0" / "graph0_after.py").read_text()
    assert "torch.ops.cpcompile.sequence_order.default" in after and "all_gather_seq" in after
    assert "halo_exchange" not in after


@pytest.mark.parametrize("dynamic", [True, False])
def test_a_squeezed_dim_before_a_conv_keeps_its_sequence_dim(world, dynamic):
    """Zamba's Mamba mixer: ``view(B, C, 1, T).squeeze(2)`` in front of the conv. In a static graph the sequence
    dim is known only by following it from the inputs; it must survive the squeeze, or the conv is not found and
    runs on this rank's tokens."""
    backend = cpcompile.backend(world, inner="eager")
    with cpcompile.shard(packed_batch(DOCS), world, dynamic=dynamic) as local:
        torch.compile(mixer_lm(mixer="squeezed_conv"), backend=backend)(**local)
    assert _actions(backend) == [("mixer.conv", "conv1d", "convolution", "halo"), LOSS]


def test_static_graph_region_trims_to_the_length_it_runs_on(world):
    """shard(dynamic=False): the conv's trim [..., :16] is a constant; rewritten, it stops at the length of the
    tokens and halo slots the conv runs on."""
    model = mixer_lm(mixer="conv")
    backend = cpcompile.backend(world, inner="eager", dump_dir=None)
    graphs = []

    def keep(gm, example_inputs):
        out = backend(gm, example_inputs)
        graphs.append(gm)
        return out

    with cpcompile.shard(packed_batch(DOCS), world, dynamic=False) as local:
        torch.compile(model, backend=keep)(**local)
    assert _actions(backend)[0] == ("mixer.conv", "conv1d", "convolution", "halo")
    (gm,) = graphs
    code = gm.code
    assert "slice(None, size" in code and "slice(None, 16" not in code, code


def test_transformers_lfm2_conv_layer_takes_a_halo(world):
    """Lfm2ForCausalLM with layer_types ["conv", "full_attention"]: the short conv takes a halo, attention rewritten."""
    backend, _, _ = _compile_and_run(tiny_model("lfm2"), world)
    assert _actions(backend) == [("model.layers.0.conv", "conv1d", "convolution", "halo"), LOSS]
    assert [r.action for r in backend.reports] == ["rewritten"]
    assert "modeling_lfm2.py" in backend.mixing_reports[0].source


# -- accounted for: no false refusal ------------------------------------------------------------------------------
# Every family of FAMILIES and MOE_FAMILIES compiles with the mixing pass on and is exact at CP=2 in the parity
# tests (tests/test_layouts_parity.py, tests/test_moe.py): a refusal there fails the compile, and their parity shows
# that what the pass accounted for (its loss a partial sum, LFM2's conv run on the whole sequence, MoE dispatch as
# bookkeeping) is right. The cases below are the forms that once were refused falsely.
#: What a family may do besides its summed loss: LFM2's conv takes a halo, MoE dispatch is bookkeeping.
ACCOUNTED = {"halo", "gathered", "dispatch", "per_token"}


@pytest.mark.parametrize("family, T", [("llama", 128), ("lfm2", 32), ("glm4_moe", 37)])
def test_static_graph_sizes_equal_to_the_chunk_length(world, family, T):
    """In a static graph (FSDP2's per-layer graphs, shard(dynamic=False)) a hidden size (64) or head dim (16) equal
    to the chunk length is not taken for the sequence: dims are followed from the inputs; GLM-4-MoE's grouped
    router (``view(-1, n_group, E // n_group).topk(2, dim=-1)``) reduces over experts, not tokens."""
    backend = cpcompile.backend(world, inner="eager")
    with cpcompile.shard(packed_batch([[T // 2, T - T // 2], [T]]), world, dynamic=False) as local:
        torch.compile(tiny_model(family), backend=backend)(**local)
    assert _actions(backend)[-1] == LOSS, _actions(backend)
    assert {a[3] for a in _actions(backend)[:-1]} <= ACCOUNTED, _actions(backend)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_moe_dispatch_is_bookkeeping(world, name):
    """transformers' MoE dispatch (integrations/moe.py): the sort of expert ids over tokens x top_k, the rows moved
    by that permutation and back, the histogram and grouped_mm_fallback are token bookkeeping, not mixing."""
    backend, _, _ = _compile_and_run(tiny_model(name), world)
    actions = {(r.op, r.action) for r in backend.mixing_reports}
    assert actions == {
        ("sort", "dispatch"),
        ("getitem", "dispatch"),
        ("setitem", "dispatch"),
        ("histc", "dispatch"),
        ("transformers::grouped_mm_fallback", "per_token"),
        ("cross_entropy", "partial_sum"),
    }, actions


def test_listed_custom_op_is_per_token(world):
    backend, _, _ = _compile_and_run(
        mixer_lm(mixer="custom_per_token"), world, per_token_ops=("cpcompile_tests::softsign",)
    )
    assert _actions(backend) == [("mixer", "cpcompile_tests::softsign", "custom", "per_token"), LOSS]


# -- refused ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mixer, op_words, reason_words, fix_words",
    [
        ("mean_pool", "mean at mixer (node mean)", "mean along the sequence", "cpcompile.gather"),
        ("last_token", "getitem at mixer", "picks tokens [-1:] of the sequence", "cpcompile.gather"),
        ("chunked_scan", "matmul at mixer (node within)", "matmul contracts the sequence dim", "causal conv1d"),
        ("next_diff", "diff at mixer", "reads up to 1 token(s) after it (not causal)", "diff with prepend"),
        ("custom_scan", "cpcompile_tests::prefix_sum at mixer", "cannot see into it", "per_token_ops=("),
        ("custom_per_token", "cpcompile_tests::softsign at mixer", "cannot see into it", "per_token_ops=("),
        # the dim of norm comes after p; msort sorts along the first dim (here the sequence); tril reads the index
        ("norm_pool", "norm at mixer", "norm along the sequence", "cpcompile.gather"),
        ("sort_tokens", "msort at mixer", "msort along the sequence", "run this model without context parallelism"),
        ("tril_tokens", "tril at mixer", "by their index along the sequence", "positions"),
        ("token_setitem", "setitem at mixer", "writes tokens [:4] of the sequence", "cpcompile.gather"),
        # repeat_interleave(2, 1): the dim read at its place after repeats
        ("token_repeat", "repeat_interleave at mixer", "repeats tokens along the sequence", "cpcompile.gather"),
    ],
)
def test_refused_at_compile_time(world, mixer, op_words, reason_words, fix_words):
    before = dict(counters)
    with pytest.raises(cpcompile.UnsupportedMixingError) as info:
        _compile_and_run(mixer_lm(mixer=mixer), world)
    message = str(info.value)
    assert f"cpcompile cannot run {op_words}" in message and reason_words in message, message
    assert "Model code: " in message and "models/mixing.py:" in message, message
    assert "Fix: " in message and fix_words in message, message
    assert counter_delta(before).get("mixing_refused", 0) >= 1
    assert isinstance(info.value, RuntimeError)  # torch.compile passed it through unchanged


@pytest.mark.parametrize("mixer", ["token_norm", "feature_setitem", "head_repeat"])
def test_per_token_norm_sort_tril_writes_and_repeats_are_not_mixing(world, mixer):
    """The counterparts of the six refusals above: the same ops over the features, the batch rows, the heads or a
    per-token matrix, and a write of some features of every token, keep the tokens apart and are not reported
    (exact: tests/test_mixing_parity.py)."""
    backend, out, _ = _compile_and_run(mixer_lm(mixer=mixer), world)
    assert _actions(backend) == [LOSS] and torch.isfinite(out.logits).all()


@pytest.mark.parametrize("mixer", ["chunked_scan", "mean_pool", "last_token"])
def test_refused_in_static_graphs(world, mixer):
    """shard(dynamic=False): the sequence dim is followed from the inputs, through the chunking view and unbind."""
    backend = cpcompile.backend(world, inner="eager")
    with pytest.raises(cpcompile.UnsupportedMixingError, match=r"cpcompile cannot run .* at mixer"):
        with cpcompile.shard(packed_batch(DOCS), world, dynamic=False) as local:
            torch.compile(mixer_lm(mixer=mixer), backend=backend)(**local)


@pytest.mark.parametrize(
    ("mixer", "dynamic", "found"),
    [
        (
            "conv_cumsum",
            True,
            [("mixer.conv", "conv1d", "convolution", "halo"), ("mixer", "cumsum", "scan", "gathered")],
        ),
        (
            "conv_cumsum",
            False,
            [("mixer.conv", "conv1d", "convolution", "halo"), ("mixer", "cumsum", "scan", "gathered")],
        ),
        ("merged_rows_cumsum", False, [("mixer", "cumsum", "scan", "gathered")]),
    ],
)
def test_a_scan_after_a_conv_or_merged_rows_is_found(world, mixer, dynamic, found):
    """A cumsum along the sequence after a conv's trim, and after a ``baddbmm`` whose rows merge batch and sequence
    (RG-LRU's gate). In a static graph (``shard(dynamic=False)``) no size names the sequence: it is followed through
    the conv's longer output and the bias-first product, or the scan would run on this rank's tokens. The scan's
    region reads the end of the conv's rewritten region (the graph stays well formed)."""
    backend = cpcompile.backend(world, inner="eager")
    with cpcompile.shard(packed_batch(DOCS), world, dynamic=dynamic) as local:
        torch.compile(mixer_lm(mixer=mixer), backend=backend)(**local)
    assert _actions(backend) == [*found, LOSS]


def test_sequence_classification_last_token_pooling_is_pooled(world):
    """LlamaForSequenceClassification pools the last non-padding token (an argmax over the sequence): both ops are
    ``pooled`` (parity and the refused argmax forms: tests/test_pooling.py)."""
    import transformers

    config = tiny_config("llama", num_labels=3, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")
    backend = cpcompile.backend(world, inner="eager")
    batch = {k: v for k, v in packed_batch(DOCS).items() if k != "labels"}
    with cpcompile.shard(batch, world) as local:
        torch.compile(model, backend=backend)(**local)
    assert [(r.op, r.action) for r in backend.mixing_reports] == [("argmax", "pooled"), ("getitem", "pooled")]


class _LossPlusConstant(nn.Module):
    """A summed loss with a constant added: each rank would add it, so the ranks' values would not add up."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(128, 16)
        self.head = nn.Linear(16, 128)

    def forward(self, input_ids, position_ids=None, labels=None, shift_labels=None, num_items_in_batch=None, **_):
        logits = self.head(self.embed(input_ids))
        loss = F.cross_entropy(logits.flatten(0, 1), shift_labels.flatten(), reduction="sum") / num_items_in_batch
        out = lm_output(logits)
        out.loss = loss + 1.0
        return out


def test_sum_that_is_not_a_partial_sum_is_refused(world):
    with pytest.raises(cpcompile.UnsupportedMixingError, match=r"not only scaled into the graph's output"):
        _compile_and_run(_LossPlusConstant(), world)


# -- options ---------------------------------------------------------------------------------------------------
def test_mixing_off_leaves_the_graph_alone(world):
    backend, _, comm = _compile_and_run(mixer_lm(mixer="mean_pool"), world, mixing="off")
    assert backend.mixing_reports == [] and comm.sequence_gathers == 0


def test_options_are_checked(world):
    with pytest.raises(ValueError, match=r"mixing='on' is not a known mode; choose one of \('exact', 'off'\)"):
        cpcompile.backend(world, mixing="on")
    with pytest.raises(TypeError, match=r"per_token_ops must be a tuple of 'namespace::name' strings"):
        cpcompile.backend(world, per_token_ops="mylib::norm")
    with pytest.raises(ValueError, match=r"per_token_ops holds \['norm'\]; every entry must name a custom op"):
        cpcompile.backend(world, per_token_ops=("norm",))
    # an attention op listed as per-token would run on one rank's keys: silently wrong, so refused with the fix
    with pytest.raises(ValueError, match=r"lists 'torch_attn::_varlen_attn', an attention op.*attn_backend='flex'"):
        cpcompile.backend(world, per_token_ops=("torch_attn::_varlen_attn",))


def test_torch_logs_list_mixing_ops(world, caplog):
    """TORCH_LOGS=cpcompile: each graph's mixing ops, what became of them and the model's line, on cpcompile.mixing."""
    import logging

    caplog.set_level(logging.INFO, logger="cpcompile.mixing")
    _compile_and_run(mixer_lm(mixer="shift"), world)
    (text,) = [r.getMessage() for r in caplog.records if r.name == "cpcompile.mixing"]
    assert "2 op(s) mixing tokens outside attention" in text, text
    row = next(line for line in text.splitlines() if " pad " in line)
    assert "halo" in row and "models/mixing.py" in row, text
