"""The balanced layout in one process: the issue's benchmark cases come out balanced, its work model is the
kernel's, the choices it makes in simple cases, one host sync, the workload it takes from compiled sites, the
block kernel under it, and ``cpcompile inspect``'s columns and picture.

The measure is the kernel's own: ``CPPlan.visible_blocks(...).computed_pairs()`` per rank (the (query, key)
pairs of the blocks the block kernel visits), never the balancer's model.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import cpcompile
from benchmarks._common import lognormal_doc_lens, packed_doc_lens
from cpcompile import _compat, layouts
from cpcompile.kernels import cp_attention, dense_cp_attention
from cpcompile.layouts import balance, token_work
from cpcompile.plan import MAX_RUNS, AttentionForm, Workload, build_plan, count_runs
from cpcompile.runtime import workload as runtime  # the compiled-workload registry
from cpcompile.testing import packed_batch
from tests.harness.tiers import slow

T = 8192
#: The issue's cases: one long document, the benchmarks' packed documents (256..4096 tokens), many short
#: documents around one long one, two rows of packed documents.
SHORT = packed_doc_lens(T - 4096, 1, 16, 256, seed=1)[0]
CASES = {
    "one document": [[T]],
    "packed 256..4096": packed_doc_lens(T, 1, 256, 4096),
    "short + long + short": [SHORT[: len(SHORT) // 2] + [4096] + SHORT[len(SHORT) // 2 :]],
    "2 rows packed": packed_doc_lens(T, 2, 256, 4096, seed=3),
}
WORKLOADS = {
    "causal": Workload(),
    "sliding 1024": Workload(forms=(AttentionForm(window=1024),)),  # every layer windowed (Gemma 3's window)
}
#: The issue's target for the slowest rank over the mean.
TARGET = 1.05


def computed(plan, workload: Workload) -> list[int]:
    """Per rank: the block kernel's computed pairs, summed over the workload's layers."""
    return [plan.work(workload, r) for r in range(plan.cp_size)]


def max_over_mean(work: list[int]) -> float:
    return max(work) * len(work) / sum(work)


@pytest.mark.parametrize("workload", WORKLOADS, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_benchmark_cases_are_balanced(case, workload):
    """Slowest rank / mean rank <= 1.05 at N = 2, 4, 8, block 128, where contiguous chunks are far off."""
    batch = packed_batch(CASES[case])
    wl = WORKLOADS[workload]
    for n in (2, 4, 8):
        plan = build_plan(batch, n, 0, layout="balanced", workload=wl)
        ours = max_over_mean(computed(plan, wl))
        theirs = max_over_mean(computed(build_plan(batch, n, 0, layout="contiguous"), wl))
        print(f"{case}, {workload}, N={n}: balanced {ours:.3f}, contiguous {theirs:.3f}")
        assert ours <= TARGET, (case, workload, n, ours)
        assert ours <= theirs + 1e-9
        assert int(count_runs(plan.indices).max()) <= MAX_RUNS


def test_mixed_layers_are_never_worse_than_balancing_one_kind():
    """Sliding and full layers (Gemma 3's 5:1): the layer-weighted objective (every layer waits for its slowest
    rank) of the mixed layout is at most that of the layouts balanced for either kind alone (+0.5%)."""
    batch = packed_batch(CASES["packed 256..4096"])
    sliding, full = AttentionForm(window=1024, layers=5), AttentionForm(layers=1)
    mixed = Workload(forms=(full, sliding))

    def objective(plan):
        return sum(
            f.layers * max(computed(plan, Workload(forms=(AttentionForm(f.documents, f.window),)))) for f in mixed.forms
        )

    for n in (2, 4, 8):
        ours = objective(build_plan(batch, n, 0, layout="balanced", workload=mixed))
        for alone in (full, sliding):
            theirs = objective(build_plan(batch, n, 0, layout="balanced", workload=Workload(forms=(alone,))))
            assert ours <= 1.005 * theirs, (n, alone, ours, theirs)


def test_one_long_document_is_head_tail_and_short_rows_stay_contiguous():
    one = build_plan(packed_batch([[T]]), 8, 0, layout="balanced")
    assert torch.equal(one.indices, build_plan(packed_batch([[T]]), 8, 0, layout="head_tail").indices)
    # 100 tokens fit in one block of 128: every layout computes the same block, so nothing moves
    short = build_plan(packed_batch([[30, 70]]), 4, 0, layout="balanced")
    assert torch.equal(short.indices, torch.arange(100).view(4, 25))


def test_token_work_is_the_kernels_work():
    """Sum of token_work over a rank's tokens == computed pairs when its runs are block-aligned; >= otherwise."""
    batch = packed_batch(packed_doc_lens(1024, 2, 20, 300, seed=5))
    for window in (None, 50):
        for layout, n in (("contiguous", 4), ("head_tail", 4), ("balanced", 4), ("balanced", 3)):
            wl = Workload(forms=(AttentionForm(window=window),), block_size=32)
            plan = build_plan(batch, n, 0, layout=layout, workload=wl)
            model = token_work(plan.doc_ids, 32, 32, window)
            for r, work in enumerate(computed(plan, wl)):
                idx = plan.token_indices(r)
                predicted = int(model[idx].sum())
                jump = torch.cat([torch.tensor([True]), idx[1:] != idx[:-1] + 1])  # a run starts here
                ends = torch.cat([jump[1:], torch.tensor([True])])  # a run ends here
                ragged = (jump & (idx % 32 != 0)) | (ends & (idx % 32 != 31) & (idx != plan.padded_len - 1))
                aligned = not bool(ragged.any())
                assert work <= predicted, (layout, n, r)
                if aligned:
                    assert work == predicted, (layout, n, r)


def test_one_host_sync_per_batch():
    """The balancer reads device values once (the pieces' work for the greedy assignment), whatever the forms."""
    batch = packed_batch(CASES["2 rows packed"])
    wl = Workload(forms=(AttentionForm(), AttentionForm(window=512, layers=3)))
    plan = build_plan(batch, 4, 0, layout="contiguous")
    reads = []
    real = {name: getattr(torch.Tensor, name) for name in ("tolist", "item", "__bool__", "__int__", "__index__")}

    def counting(name):
        def read(self, *args):
            reads.append(name)
            return real[name](self, *args)

        return read

    with mock.patch.multiple(torch.Tensor, **{name: counting(name) for name in real}):
        found = balance(plan.padded_len, 4, plan.doc_ids, wl)
    assert reads == ["tolist"], reads
    assert found.indices.shape == (4, plan.chunk_len)


def test_sites_compiled_for_a_group_become_its_workload():
    """shard's default workload: the forms of the layers compiled for this group, each layer counted once."""
    group = "test-layouts-group"
    assert runtime.compiled_workload(group) == Workload()
    for layer in ("l0", "l1", "l1", "l2"):  # l1 compiled twice (a recompile): one layer
        runtime.record_attention_form(group, layer, True, 4 if layer != "l0" else None, 64)
    runtime.record_attention_form(group, "x", False, None, 32)
    assert runtime.compiled_workload(group) == Workload(
        forms=(AttentionForm(True, None, 1), AttentionForm(True, 4, 2), AttentionForm(False, None, 1)), block_size=32
    )
    assert runtime.compiled_workload("another-group") == Workload()


def test_a_selective_exchange_keeps_documents_whole():
    """Once a site compiled for a group exchanges only the keys its queries see, shard's balanced layout prefers
    layouts that split the fewest keys across ranks (``Workload.split_keys``); other groups are not affected."""
    with mock.patch.dict(runtime._FORMS, clear=True):
        runtime.record_attention_form("g", "layers.0", True, None, 128)
        assert runtime.compiled_workload("g").split_keys is False
        runtime.record_attention_form("g", "layers.1", True, None, 128, selective=True)
        assert runtime.compiled_workload("g") == Workload(
            forms=(AttentionForm(True, None, 2),), block_size=128, split_keys=True
        )
        assert runtime.compiled_workload("other").split_keys is False


def test_shard_balances_the_compiled_forms():
    batch = packed_batch(CASES["packed 256..4096"])
    # fake groups share one name: forget what other tests compiled in this process
    with mock.patch.dict(runtime._FORMS, clear=True), _compat.fake_process_group(1, 4) as group:
        name = _compat.group_name_of(group)
        runtime.record_attention_form(name, "model.layers.0.self_attn", True, 512, 64)
        with cpcompile.shard(batch, group) as local:
            plan = cpcompile.runtime.current_plan()
            wl = Workload(forms=(AttentionForm(window=512),), block_size=64)
            assert plan.layout == "balanced"
            assert torch.equal(plan.indices, build_plan(batch, 4, 1, layout="balanced", workload=wl).indices)
            assert torch.equal(local["input_ids"], batch["input_ids"][:, plan.token_indices()])
            assert torch.equal(local["position_ids"], batch["position_ids"][:, plan.token_indices()])
        with pytest.raises(ValueError, match="layout='zigzag' is not a known layout"):
            with cpcompile.shard(batch, group, layout="zigzag"):
                pass
        with pytest.raises(TypeError, match="workload must be"):
            with cpcompile.shard(batch, group, workload={"block_size": 8}):
                pass


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: Workload(forms=()), "non-empty tuple of AttentionForm"),
        (lambda: Workload(block_size=0), "block_size=0"),
        (lambda: AttentionForm(window=0), "window=0"),
        (lambda: AttentionForm(layers=0), "layers=0"),
    ],
)
def test_bad_workload_is_refused(make, words):
    with pytest.raises(ValueError, match=words):
        make()


def test_block_kernel_under_the_balanced_layout():
    """Forward and dQ/dK/dV of every rank against SDPA under the plan's mask, queries in several runs."""
    batch = packed_batch([[40, 3, 70, 44], [1, 100, 56]], seed=2)
    wl = Workload(forms=(AttentionForm(window=24),), block_size=8)
    g = torch.Generator().manual_seed(0)
    for window in (None, 24):
        plan = build_plan(batch, 4, 0, layout="balanced", workload=wl)
        assert int(count_runs(plan.indices).max()) > 1
        B, Tp, c = 2, plan.padded_len, plan.chunk_len
        k, v = torch.randn(B, 2, Tp, 16, generator=g), torch.randn(B, 2, Tp, 16, generator=g)
        for r in range(4):
            q = torch.randn(B, 4, c, 16, generator=g)
            pos = (plan.token_indices(r), plan.gathered_indices(), plan.doc_ids)
            outs = []
            for fn, kw in ((cp_attention, {"block_q": 8, "block_k": 8}), (dense_cp_attention, {})):
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                out = fn(*leaves, *pos, window=window, enable_gqa=True, **kw)
                outs.append((out, *torch.autograd.grad(out, leaves, torch.ones_like(out))))
            for got, want in zip(*outs):
                # blockwise online softmax vs SDPA: a few fp32 ulps of O(1) values
                torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_inspect_columns_and_picture_follow_the_layout(tmp_path):
    """inspect's computed-pairs column is balanced and its picture colours every query row by its owner."""
    from PIL import Image

    from cpcompile.inspect.picture import _PALETTE, GUTTER_PX, TITLE_PX, pattern_geometry
    from cpcompile.testing import tiny_config

    config = tiny_config("llama")
    config.save_pretrained(tmp_path / "llama")
    docs = [[200, 250, 62]]
    result = cpcompile.inspect.inspect_model(
        str(tmp_path / "llama"), cp_size=4, seq_len=512, doc_lens=docs, block_size=16
    )
    assert result.layout == "balanced"
    assert result.workload == Workload(forms=(AttentionForm(True, None, config.num_hidden_layers),), block_size=16)
    ours = [t.computed_pairs for t in result.totals]
    assert ours == computed(result.plan, result.workload)
    contiguous = computed(build_plan(packed_batch(docs), 4, 0, layout="contiguous"), result.workload)
    assert max_over_mean(ours) <= TARGET < max_over_mean(contiguous), (ours, contiguous)
    assert int(count_runs(result.plan.indices).max()) > 1
    cpcompile.inspect.write_dump(result, str(tmp_path / "dump"))
    geo = pattern_geometry(512, 1)
    owner = torch.empty(512, dtype=torch.long)
    owner[result.plan.gathered_indices()] = torch.arange(4).repeat_interleave(result.chunk_len)
    with Image.open(tmp_path / "dump" / "attention_pattern.png") as im:
        rgb = im.convert("RGB")
        for cell in range(geo.cells):
            tokens = owner[cell * geo.tokens_per_cell : (cell + 1) * geo.tokens_per_cell]
            y = TITLE_PX + cell * geo.pixels_per_cell + geo.pixels_per_cell // 2
            row = {rgb.getpixel((GUTTER_PX + j * geo.pixels_per_cell + 1, y)) for j in range(geo.cells)}
            colour = _PALETTE[int(tokens[0])]  # own keys, gathered keys, partly visible
            shades = {colour, tuple(x * 3 // 5 for x in colour), tuple((x + 255) // 2 for x in colour)}
            # masked cells are light gray; the lines where the owning rank changes are gray
            assert row - {(236, 236, 236), (170, 170, 170), (60, 60, 60)} <= shades, (cell, row, shades)


#: Log-normal packed mixes (sigma 1.0 of the log) where the candidates before ``halves`` missed the target on
#: 1 to 7 of 12 seeds (worst 1.38 at CP=16); ``halves`` is within 1.5% on each (BENCHMARKS.md, exchange).
LOGNORMAL = [(T, n, mean) for T in (16384, 32768) for n in (4, 8) for mean in (1024, 2048)]
LOGNORMAL += [(32768, 16, mean) for mean in (1024, 2048)]
#: The control's mixes: without ``halves``, 6 of the 12 seeds miss 1.05 here (worst 1.18).
LOGNORMAL_CONTROL = [(32768, 8, 1024)]


def _lognormal_worst(mixes: list[tuple[int, int, int]], halves: bool) -> float:
    worst = 0.0
    with mock.patch.object(layouts, "_halves", layouts._halves if halves else _no_halves):
        for T, n, mean in mixes:
            for seed in range(12):
                plan = build_plan(packed_batch([lognormal_doc_lens(T, mean, seed)]), n, 0, layout="balanced")
                worst = max(worst, max_over_mean(computed(plan, Workload())))
    return worst


def _no_halves(work, N, cut_cost=None):
    return layouts._contiguous(work.shape[0], N, work, Workload())


def test_lognormal_mixes_are_balanced_and_need_the_halves_candidate():
    """Every batch of the control's mix within 1.05 at CP=8, and of the largest CP's mixes (16); without the
    ``halves`` candidate some batch of the control's mix is not (the control). The other mixes: the slow tier."""
    assert _lognormal_worst(LOGNORMAL_CONTROL + [m for m in LOGNORMAL if m[1] == 16], halves=True) <= TARGET
    assert _lognormal_worst(LOGNORMAL_CONTROL, halves=False) > TARGET


@slow
def test_every_lognormal_mix_is_balanced():
    """Every batch of every log-normal mix within 1.05 at CP 4, 8 and 16."""
    assert _lognormal_worst(LOGNORMAL, halves=True) <= TARGET
