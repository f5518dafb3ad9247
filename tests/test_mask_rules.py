"""Masks the model builds from token positions: proved against cpcompile's rule at compile time, or refused.

A mask the model builds on its local inputs is compared with the plan's local rule on every step, but that
check only sees this rank's ``c x c`` block. A sliding window of at least ``c`` tokens written as a difference
``(q - k) < W`` and chunked attention ``k // 8 == q // 8`` at ``c <= 8`` both look causal there and used to run
silently wrong. The attention pass now reads the whole mask-building subgraph (:mod:`cpcompile.passes.mask_rules`):
causal order, same document and sliding windows in any of their spellings are proved (the window joins the site),
and any other use of token positions is refused with the model's source line.

One process: the pass on Dynamo graphs of ``tests.models.attention.attention_lm`` and of small mask functions. One
spawned CP=2 group: parity of the difference-spelled window against the single-process eager model (plus a
control showing the window matters on that batch), and chunked attention refused on every rank.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cpcompile.errors import UnsupportedAttentionError
from cpcompile.passes.sdpa_cp import find_sdpa_sites, graph_windows
from cpcompile.testing import packed_batch
from tests.harness.dist import run_distributed
from tests.harness.graphs import dynamo_graph, run_pass
from tests.harness.parity import (
    ParityCase,
    ParityRunner,
    assert_controls,
    assert_parity,
    check_case,
    check_outcome,
    reference_step,
)
from tests.harness.workers import BALANCED_WORKLOAD
from tests.models.attention import LONG_WINDOW, WINDOW, attention_lm

# T = 37 (c = 19 at CP=2 < LONG_WINDOW = 24 < T); a 30-token document, so the window cuts keys off globally.
DOCS = ((7, 30), (37,))


def _graph(form: str, T: int = 16):
    batch = packed_batch([[T]])
    return dynamo_graph(attention_lm(form, layers=1), input_ids=batch["input_ids"], position_ids=batch["position_ids"])


# -- one process: the attention pass on traced graphs -------------------------------------------------------
def test_window_written_as_a_difference_is_the_sites_window():
    gm = _graph("window_diff")
    assert [graph_windows(s) for s in find_sdpa_sites(gm)] == [{LONG_WINDOW}]
    reports = run_pass(gm)
    assert [r.window for r in reports] == [LONG_WINDOW]


def test_chunked_attention_is_refused_at_its_source_line():
    gm = _graph("chunked")
    with pytest.raises(UnsupportedAttentionError) as e:
        run_pass(gm)
    msg = str(e.value)
    assert "floordiv" in msg and "models/attention.py:" in msg and "token positions" in msg, msg


class _MaskModel(nn.Module):
    """One SDPA call under the mask ``rule(q, k, doc_q, doc_k)`` of broadcast ``[T, 1]`` / ``[1, T]`` indices."""

    def __init__(self, rule) -> None:
        super().__init__()
        self.rule = rule
        self.proj = nn.Linear(8, 8)

    def forward(self, x, position_ids):
        T = x.shape[1]
        idx = torch.arange(T, device=x.device)
        q, k = idx[:, None], idx[None, :]
        mask = self.rule(q, k)[None, None]
        h = self.proj(x)[:, None]
        return F.scaled_dot_product_attention(h, h, h, attn_mask=mask)


def _rule_graph(rule, T: int = 16):
    x = torch.randn(1, T, 8)
    pos = torch.arange(T)[None]
    return dynamo_graph(_MaskModel(rule), x=x, position_ids=pos)


PROVED = {  # spelling -> window the site gets (None: causal only)
    "k <= q": (lambda q, k: k <= q, None),
    "q >= k": (lambda q, k: q >= k, None),
    "k < q + 1": (lambda q, k: k < q + 1, None),
    "q - k >= 0": (lambda q, k: (q - k) >= 0, None),
    "tril": (lambda q, k: torch.ones(q.shape[0], k.shape[1], dtype=torch.bool).tril(), None),
    "k > q - 5": (lambda q, k: (k <= q) & (k > q - 5), 5),
    "q - k < 20": (lambda q, k: (k <= q) & ((q - k) < 20), 20),
    "k - q > -20": (lambda q, k: (k <= q) & ((k - q) > -20), 20),
    "q - k <= 19": (lambda q, k: (k <= q) & ((q - k) <= 19), 20),
    "20 > q - k": (lambda q, k: (k <= q) & (20 > (q - k)), 20),
    "k >= q - 19": (lambda q, k: (k <= q) & (k >= q - 19), 20),
    "~(k > q)": (lambda q, k: ~(k > q), None),
    "~triu(ones, 1)": (lambda q, k: ~torch.ones(q.shape[0], k.shape[1], dtype=torch.bool).triu(1), None),
}
REFUSED = {  # spelling -> words of the refusal
    "k // 8 == q // 8": (lambda q, k: (k <= q) & (k // 8 == q // 8), "floordiv"),
    "k % 8": (lambda q, k: (k <= q) & (k % 8 == q % 8), "remainder"),
    "k < 4 (a prefix)": (lambda q, k: (k <= q) | (k < 4), "or_"),
    "k >= 4 (a fixed key range)": (lambda q, k: (k <= q) & (k >= 4), "with a constant"),
    "q - k > 2 (a gap)": (lambda q, k: (q - k) > 2, "not causal order"),
    "~((k <= q) & (k > q - 4))": (lambda q, k: ~((k <= q) & (k > q - 4)), "invert"),
    "~(k <= q) (anti-causal)": (lambda q, k: ~(k <= q), "which no key satisfies"),
    "k * 2 <= q": (lambda q, k: k * 2 <= q, "mul"),
}


@pytest.mark.parametrize("spelling", sorted(PROVED))
def test_mask_spellings_proved(spelling):
    rule, window = PROVED[spelling]
    reports = run_pass(_rule_graph(rule))
    assert [(r.action, r.window) for r in reports] == [("rewritten", window)], reports


@pytest.mark.parametrize("spelling", sorted(REFUSED))
def test_mask_spellings_refused(spelling):
    rule, words = REFUSED[spelling]
    with pytest.raises(UnsupportedAttentionError) as e:
        run_pass(_rule_graph(rule))
    assert words in str(e.value) and "test_mask_rules.py:" in str(e.value), str(e.value)


class _CheckpointedMaskModel(_MaskModel):
    """:class:`_MaskModel` with the attention in a checkpointed function: the mask is built outside the nested
    graph that holds the SDPA call and reaches it as that graph's input."""

    def forward(self, x, position_ids):
        from torch.utils.checkpoint import checkpoint

        T = x.shape[1]
        idx = torch.arange(T, device=x.device)
        mask = self.rule(idx[:, None], idx[None, :])[None, None]
        h = self.proj(x)[:, None]
        return checkpoint(
            lambda h, m: F.scaled_dot_product_attention(h, h, h, attn_mask=m), h, mask, use_reentrant=False
        )


@pytest.mark.parametrize("spelling", ["q - k < 20", "k // 8 == q // 8"])
def test_mask_built_outside_a_checkpointed_layer_is_read_where_it_is_built(spelling):
    rule = {**PROVED, **REFUSED}[spelling][0]
    gm = dynamo_graph(_CheckpointedMaskModel(rule), x=torch.randn(1, 16, 8), position_ids=torch.arange(16)[None])
    if spelling in PROVED:
        assert [(r.action, r.window) for r in run_pass(gm)] == [("rewritten", 20)]
    else:
        with pytest.raises(UnsupportedAttentionError, match="floordiv"):
            run_pass(gm)


class _BrokenMaskModel(_MaskModel):
    """:class:`_MaskModel` with a graph break between the mask and the attention: the first graph hands the mask on
    as its output, and the graph of the attention sees it as an input."""

    def forward(self, x, position_ids):
        T = x.shape[1]
        idx = torch.arange(T, device=x.device)
        mask = self.rule(idx[:, None], idx[None, :])[None, None]
        torch._dynamo.graph_break()
        h = self.proj(x)[:, None]
        return F.scaled_dot_product_attention(h, h, h, attn_mask=mask)


class _BrokenDocumentsModel(_BrokenMaskModel):
    """:class:`_BrokenMaskModel` whose mask also keeps documents apart (equal ``position_ids`` labels)."""

    def forward(self, x, position_ids):
        T = x.shape[1]
        idx = torch.arange(T, device=x.device)
        doc = position_ids[:, :, None] == position_ids[:, None, :]
        mask = (self.rule(idx[:, None], idx[None, :]) & doc)[:, None]
        torch._dynamo.graph_break()
        h = self.proj(x)[:, None]
        return F.scaled_dot_product_attention(h, h, h, attn_mask=mask)


@pytest.mark.parametrize("spelling", ["k <= q", "k <= q, documents", "k // 8 == q // 8"])
def test_mask_handed_to_another_graph_is_proved_where_it_is_built(spelling):
    """The graph that builds a mask and hands it on proves it; one without a same-document condition is refused
    there, since the attention's graph sees an input it keeps documents apart with (see
    ``test_cp2_mask_handed_to_another_graph_or_kept_on_the_module``)."""
    from cpcompile.passes.positions import positions_pass
    from tests.harness.graphs import context

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    rule = {**PROVED, **REFUSED}[spelling.removesuffix(", documents")][0]
    model = _BrokenDocumentsModel(rule) if spelling.endswith("documents") else _BrokenMaskModel(rule)
    torch.compile(model, backend=capture)(x=torch.randn(1, 16, 8), position_ids=torch.arange(16)[None])
    reports = positions_pass(graphs[0], context(refuse="report"), 16)
    actions = {r.action for r in reports}
    if spelling == "k <= q, documents":
        assert actions == {"mask"}, reports
    else:
        words = "floordiv" if "//" in spelling else "without a same-document condition"
        assert "refused" in actions and any(words in r.reason for r in reports), reports


def test_transformers_masks_are_proved():
    from cpcompile.testing import tiny_model

    batch = packed_batch([[10, 22]])
    for family, window in (("llama", None), ("mistral", 6)):
        gm = dynamo_graph(
            tiny_model(family), input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        )
        assert [(r.action, r.window) for r in run_pass(gm)] == [("rewritten", window)] * 2, family


# -- whether the mask has a same-document condition ------------------------------------------------------------
def _site_documents(gm) -> list[bool]:
    """``documents`` of every site the attention pass rewrites in ``gm`` (its report shows the spec's, which the
    runtime reads)."""
    return [r.documents for r in run_pass(gm) if r.action == "rewritten"]


@pytest.mark.parametrize(
    "form, documents",
    [
        ("packed_docs", True),
        ("window_diff", True),
        ("document_ids", True),
        ("causal_mask", False),
        ("causal_window", False),
    ],
)
def test_site_applies_documents_only_where_the_mask_has_them(form, documents):
    """A mask proved without a same-document condition (causal order of ``arange`` alone) attends across packed
    documents in the model, so its site must too; a mask with one keeps documents apart."""
    from cpcompile.passes.sdpa_cp import mask_proof

    gm = _graph(form)
    assert [mask_proof(s).documents for s in find_sdpa_sites(gm)] == [documents]
    assert _site_documents(gm) == [documents]


def test_causal_window_site_exchanges_a_halo():
    """The ``attn:causal_window`` parity case below runs the halo exchange (c = 16 at CP=2), which must route the
    keys of the other document before the chunk edge."""
    reports = run_pass(_graph("causal_window", T=16))
    assert [(r.window, r.exchange) for r in reports] == [(WINDOW, "halo")], reports


@pytest.mark.parametrize("spelling", ["k <= q", "tril", "~triu(ones, 1)", "q - k < 20"])
def test_index_only_masks_have_no_documents(spelling):
    from cpcompile.passes.sdpa_cp import mask_proof

    gm = _rule_graph(PROVED[spelling][0])
    assert [mask_proof(s).documents for s in find_sdpa_sites(gm)] == [False]
    assert _site_documents(gm) == [False]


def test_mask_made_in_another_graph_keeps_documents():
    """A ``[.., T, T]`` mask that is this graph's input is not analysed here (it may hold a document condition):
    the site keeps documents, and the runtime compares the model's mask with that rule on every step. (The graph
    that made this ``k <= q`` refuses to hand it on under CP: see the test above.)"""
    from cpcompile.passes.sdpa_cp import mask_proof

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model = _BrokenMaskModel(PROVED["k <= q"][0])
    torch.compile(model, backend=capture)(x=torch.randn(1, 16, 8), position_ids=torch.arange(16)[None])
    [site] = [s for gm in graphs for s in find_sdpa_sites(gm)]
    assert site.attn_mask.op == "placeholder"
    assert mask_proof(site).documents
    assert _site_documents(site.node.graph.owning_module) == [True]


def test_mask_read_from_module_state_is_refused():
    """A mask read from a buffer (``causal[:T, :T]``) has no values in the graph: whether it keeps documents apart
    is unknown, and the site would keep them apart where the model does not."""
    with pytest.raises(UnsupportedAttentionError, match="module state") as e:
        run_pass(_graph("causal_buffer"))
    assert "models/tiny.py:" in str(e.value), str(e.value)  # the attention's call (TinyLM's SDPA)


def test_documents_matter_on_the_causal_mask_batches():
    """Negative control of the parity test below: on its batches, attention within documents (what the site ran
    before it read the mask's documents) gives other logits than the model's causal mask across documents."""
    for case in _CAUSAL_MASK_CASES:
        batch = case.batch()
        across = reference_step(case.build_model(), batch)
        within = reference_step(attention_lm("window" if case.model == "attn:causal_window" else "packed_docs"), batch)
        assert (across.logits - within.logits).abs().max() > 1e-3, case.name


# -- position ids looked up at the token index, in a dynamic graph (Jamba) -------------------------------------
class _PositionLookupModel(nn.Module):
    """Jamba's mask in a few lines: transformers' packed-sequence mask reads the position ids and the document ids
    at the token index (``position_ids[batch_idx, q_idx]``), and the model reads ``position_ids`` nowhere else (no
    RoPE), so Dynamo gives their length a symbol of its own, apart from the hidden states' length.
    ``documents=False`` drops the document condition: the order of the position ids alone."""

    def __init__(self, documents: bool = True) -> None:
        super().__init__()
        self.documents = documents
        self.proj = nn.Linear(8, 8)

    def forward(self, x, position_ids):
        B, T = x.shape[:2]
        idx = torch.arange(T, device=x.device)
        b, q_idx, kv_idx = torch.arange(B)[:, None, None, None], idx[None, None, :, None], idx[None, None, None, :]
        doc = (torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1).cumsum(-1)
        mask = position_ids[b, kv_idx] <= position_ids[b, q_idx]
        if self.documents:
            mask = mask & (doc[b, q_idx] == doc[b, kv_idx])
        h = self.proj(x)[:, None]
        return F.scaled_dot_product_attention(h, h, h, attn_mask=mask)


def _lookup_inputs(T: int, positions: int) -> dict:
    """Hidden states of ``T`` tokens and ``positions`` position ids (two documents), each length marked dynamic
    as ``cpcompile.shard`` marks every per-token input."""
    x, position_ids = torch.randn(2, T, 8), packed_batch([[positions // 2, positions - positions // 2]] * 2)
    position_ids = position_ids["position_ids"]
    for t in (x, position_ids):
        torch._dynamo.maybe_mark_dynamic(t, 1)
    return {"x": x, "position_ids": position_ids}


def _lookup_pass(T: int = 16, positions: int = 16, documents: bool = True) -> tuple[list, tuple]:
    """The attention pass on the graph of :class:`_PositionLookupModel`, run while Dynamo compiles it (as the
    backend runs it: a guard can be added then, not once the compilation is over); the reports, and the lengths
    of the queries and of the position ids as traced."""
    from cpcompile import _compat

    got = []

    def backend(gm, example_inputs):
        [site] = find_sdpa_sites(gm)
        ids = next(n for n in gm.graph.nodes if n.op == "placeholder" and "position_ids" in n.name)
        lengths = site.meta(site.query).shape[-2], ids.meta["example_value"].shape[1]
        separate = not _compat.statically_true(lengths[0] == lengths[1])
        traced = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))  # runs without the shard context the pass needs
        got.append((run_pass(gm), (separate, _compat.statically_true(lengths[0] == lengths[1]))))
        return traced.forward

    torch._dynamo.reset()
    torch.compile(_PositionLookupModel(documents), backend=backend)(**_lookup_inputs(T, positions))
    return got[0]


def test_position_ids_looked_up_at_the_token_index_are_proved():
    """Refused before as 'a table or buffer looked up at token positions': the position ids' length is another
    symbol than the queries' (what Jamba's graph has and Llama's, whose RoPE relates them, does not). Proved, with
    the two lengths guarded equal: the proof holds for every call of the graph."""
    reports, (separate, equal_after) = _lookup_pass()
    assert [(r.action, r.window) for r in reports] == [("rewritten", None)], reports
    assert separate and equal_after


def test_position_ids_of_another_length_looked_up_are_refused():
    """Negative control: position ids longer than the tokens (24 for 16 tokens), looked up at the token index.
    Each rank would read the first entries of the table, which are not its own tokens' positions."""
    with pytest.raises(UnsupportedAttentionError) as e:
        _lookup_pass(16, 24)
    assert "looked up at token positions" in str(e.value) and "test_mask_rules.py:" in str(e.value), str(e.value)


def test_order_of_position_ids_without_documents_is_refused():
    """Negative control: the order of the position ids alone, without the document condition (proved as causal
    order before), in the graph above and in a graph whose lengths are one symbol."""

    class _Broadcast(nn.Module):  # position_ids broadcast against the tokens: one symbol, as Llama's RoPE makes it
        def forward(self, x, position_ids):
            mask = (position_ids[:, None, :] <= position_ids[:, :, None])[:, None]
            return F.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None], attn_mask=mask)

    with pytest.raises(UnsupportedAttentionError) as e:
        _lookup_pass(documents=False)
    assert "without a same-document condition" in str(e.value) and "test_mask_rules.py:" in str(e.value), str(e.value)
    batch = packed_batch([[8, 8]])
    with pytest.raises(UnsupportedAttentionError, match="without a same-document condition"):
        run_pass(dynamo_graph(_Broadcast(), x=torch.randn(1, 16, 8), position_ids=batch["position_ids"]))


def test_order_of_position_ids_alone_is_wrong_under_cp():
    """Why it is refused: position ids restart at 0 in every document. With documents that end at the chunk edge
    (CP=2, c=16), every rank's block of the order mask equals the plan's local rule, so the step check passes,
    while on the whole sequence a query sees the keys of the other document at lower positions (after it too)."""
    from cpcompile.plan import build_plan

    batch = packed_batch([[16, 16], [32]])
    pid = batch["position_ids"]
    whole = (pid[:, None, :] <= pid[:, :, None])[:, None]  # the model's mask on the whole sequence
    for rank in range(2):
        plan = build_plan(batch, 2, rank)
        local = plan.local(plan.position_ids)
        assert torch.equal((local[:, None, :] <= local[:, :, None])[:, None], plan.local_rule_mask(documents=True))
        assert not torch.equal(whole[:, :, plan.token_indices()], plan.mask(documents=True))


def test_position_ids_proved_at_an_equal_length_guard_it():
    """The proof guards the two lengths equal: a call whose position ids are longer than its tokens does not
    reuse the graph proved for equal lengths (it would read a prefix of the position ids), it recompiles, and
    the new graph is refused."""
    from cpcompile.passes.sdpa_cp import mask_proof

    proofs = []

    def backend(gm, example_inputs):
        proofs.extend(mask_proof(s) for s in find_sdpa_sites(gm))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(_PositionLookupModel(), backend=backend)
    compiled(**_lookup_inputs(16, 16))
    compiled(**_lookup_inputs(12, 12))
    assert [p.reason for p in proofs] == [""], proofs
    compiled(**_lookup_inputs(12, 20))
    assert len(proofs) == 2 and "looked up at token positions" in proofs[1].reason, proofs


def test_jamba_mask_is_proved():
    """Jamba itself (the tiny config of ``benchmarks/mixing_forms.py``), its inputs marked dynamic as ``shard``
    marks them: the mask of its attention layer is proved (it was refused as a table lookup). The model is still
    refused under CP, at its Mamba layer's scan (the survey in BENCHMARKS.md)."""
    from benchmarks.mixing_forms import build
    from cpcompile.passes.sdpa_cp import mask_proof
    from cpcompile.runtime import mark_local_dynamic

    proofs = []

    def backend(gm, example_inputs):
        proofs.extend(mask_proof(s) for s in find_sdpa_sites(gm))
        return gm.forward

    batch = packed_batch([[10, 22], [5, 27]])
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    mark_local_dynamic(inputs, 32)
    torch._dynamo.reset()
    torch.compile(build("jamba"), backend=backend)(**inputs, use_cache=False)
    assert [p.reason for p in proofs] == [""], proofs


# -- CP = 2: parity of the difference-spelled window, chunked attention refused on every rank ------------------
def _worker(rank, world_size):
    import torch.distributed as dist

    import cpcompile

    group = dist.group.WORLD
    case = ParityCase(model="attn:window_diff", doc_lens=DOCS, expected_form=("bool-mask", False))
    summary = check_case(case, group)
    lookup = ParityCase(model="attn:position_lookup", doc_lens=DOCS, expected_form=("bool-mask", False))
    lookup_summary = check_case(lookup, group, controls=("merge_documents", "plan_merges_documents"))
    model = attention_lm("chunked")
    batch = packed_batch([[16]])  # c = 8: each rank's block is one chunk, which looks causal from inside
    compiled = torch.compile(model, backend=cpcompile.backend(group, inner="eager"))
    try:
        with cpcompile.shard(batch, group) as local:
            compiled(**local)
        chunked = ("none", "")
    except Exception as e:  # noqa: BLE001 - the test asserts which error
        chunked = (type(e).__name__, str(e))
    return summary, lookup_summary, chunked


@pytest.mark.timeout(400)
def test_cp2_window_difference_exact_and_chunked_refused():
    """Also Jamba's mask (``attn:position_lookup``: position ids read by the mask alone, at the token index):
    exact at CP=2, and its negative controls caught (documents merged on the CP side: parity fails; the plan's
    documents merged under the model's own: the mask check refuses)."""
    results = run_distributed(_worker, 2, timeout_s=360)
    for rank, (summary, lookup, chunked) in enumerate(results):
        assert summary["cp"] == 2 and lookup["cp"] == 2, (summary, lookup)
        assert_controls([lookup])
        kind, msg = chunked
        assert kind == "UnsupportedAttentionError" and "floordiv" in msg, f"rank {rank}: {kind}: {msg}"


#: A causal mask without documents (``k <= q`` of ``arange``) on packed documents: documents that end exactly at the
#: chunk edge (CP=2, c=16, contiguous: every rank's block of the mask equals the same-document rule's, so the step
#: check cannot tell the two apart), also with the selective exchange and as a sliding window of ``WINDOW`` tokens
#: (the halo exchange: the keys before the edge belong to the other document), and documents that cross chunk
#: edges under the balanced layout (ranks hold several runs; kernel blocks of 8, a workload in blocks of 4, as
#: ``tests.harness.workers.balanced_case``).
_EDGE_DOCS = ((16, 16), (32,))
_CAUSAL_MASK_CASES = (
    ParityCase(model="attn:causal_mask", doc_lens=_EDGE_DOCS, expected_form=("bool-mask", False)),
    ParityCase(
        model="attn:causal_mask",
        doc_lens=_EDGE_DOCS,
        expected_form=("bool-mask", False),
        backend_kwargs=(("exchange", "selective"),),
    ),
    ParityCase(model="attn:causal_window", doc_lens=_EDGE_DOCS, expected_form=("bool-mask", False)),
    ParityCase(
        model="attn:causal_mask",
        doc_lens=((10, 22), (5, 17, 10)),
        expected_form=("bool-mask", False),
        backend_kwargs=(("block_size", 8),),
        layout="balanced",
        shard_kwargs=(("workload", BALANCED_WORKLOAD),),
    ),
)


def _causal_mask_worker(rank, world_size):
    import torch.distributed as dist

    out = []
    for case in _CAUSAL_MASK_CASES:
        torch._dynamo.reset()
        try:
            out.append(check_case(case, dist.group.WORLD))
        except Exception as e:  # noqa: BLE001 - the test reports every case's error
            out.append({"case": case.name, "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"})
    return out


@pytest.mark.timeout(400)
def test_cp2_causal_mask_without_documents_attends_across_them():
    """A hand-written causal mask has no document condition: the single-process model attends across packed
    documents, and so must every CP rank. The site used to apply same-document attention whenever a mask was
    given: at the chunk edge that ran silently wrong (parity failed on the logits), under the balanced layout the
    mask check refused it."""
    results = run_distributed(_causal_mask_worker, 2, timeout_s=360)
    for rank, summaries in enumerate(results):
        errors = [s for s in summaries if "error" in s]
        assert not errors, f"rank {rank}: {errors}"
        assert summaries[-1]["runs"] > 1, f"the balanced layout kept contiguous chunks: {summaries[-1]}"


#: Masks the attention's graph does not build, on the batch above (documents ending at the chunk edge). One layer:
#: the graph after the break is the same for every layer, and the harness counts one site per layer.
_HANDED_CASES = {
    form: ParityCase(
        model=f"attn:{form}", doc_lens=_EDGE_DOCS, overrides=(("layers", 1),), expected_form=("bool-mask", False)
    )
    for form in ("causal_mask_break", "causal_cached", "causal_buffer")
}


def _handed_worker(rank, world_size):
    import torch.distributed as dist

    out = {}
    for form, case in _HANDED_CASES.items():
        torch._dynamo.reset()
        try:
            runner = ParityRunner(case, dist.group.WORLD)
            check_outcome(runner.run())
            assert_parity(runner.run())  # a second call reads what the first kept on the module
            out[form] = ""
        except Exception as e:  # noqa: BLE001 - the test asserts every case's error
            out[form] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return out


@pytest.mark.timeout(400)
def test_cp2_mask_handed_to_another_graph_or_kept_on_the_module():
    """A mask the attention's graph gets as an input is not analysed there: the site keeps documents apart and the
    step check, which sees only this rank's block, is its guard. With documents ending at the chunk edge that check
    passes for ``k <= q`` too, which ran silently wrong (parity failed on the logits) when the mask came across a
    graph break. Now the graph that builds such a mask without a same-document condition refuses to hand it on
    (also to module state a later call reads), and a mask read from a buffer is refused where the attention runs
    (a handed mask with a document condition: ``test_cp2_assumed_documents_wait_for_a_batch_that_shows_them``)."""
    results = run_distributed(_handed_worker, 2, timeout_s=360)
    assert results[0] == results[1], results
    got = results[0]
    for form in ("causal_mask_break", "causal_cached"):
        msg = got[form]
        assert msg.startswith("UnsupportedPositionError") and "without a same-document condition" in msg, (form, msg)
        assert "models/attention.py:" in msg and "same graph as the attention" in msg, (form, msg)
    msg = got["causal_buffer"]
    assert msg.startswith("UnsupportedAttentionError") and "module state" in msg, msg
    assert "layers.0.attn" in msg and "models/tiny.py:" in msg, msg  # the attention's call (TinyLM's SDPA)


#: Masks made where no compiled graph proves them: across a graph break from a graph that proved its document
#: condition, or in eager code (``torch.compiler.disable``), which nothing proves.
_ASSUMED_FORMS = ("packed_docs_break", "packed_docs_eager", "causal_mask_eager")
_CROSSING_DOCS = ((10, 20, 2), (5, 27))  # T = 32: documents cross the chunk edge in both rows


def _assumed_worker(rank, world_size, check_hidden):
    import torch.distributed as dist

    from cpcompile.plan import CPPlan

    out = {}
    shows = CPPlan.documents_in_blocks
    for form in _ASSUMED_FORMS:
        torch._dynamo.reset()
        case = ParityCase(model=f"attn:{form}", doc_lens=_EDGE_DOCS, overrides=(("layers", 1),))
        runner, steps = ParityRunner(case, dist.group.WORLD), []
        for doc_lens in (_EDGE_DOCS, _CROSSING_DOCS, _EDGE_DOCS):
            try:
                if not check_hidden:  # negative control: every batch as if documents did not matter to the check
                    CPPlan.documents_in_blocks = lambda self, window: "irrelevant"
                assert_parity(runner.run(batch=packed_batch([list(d) for d in doc_lens])))
                steps.append("")
            except Exception as e:  # noqa: BLE001 - the test asserts every step's error
                steps.append(f"{type(e).__name__}: {' '.join(str(e).split())}")
            finally:
                CPPlan.documents_in_blocks = shows  # the pooled rank keeps no trace of the control
        out[form] = steps
    return out


@pytest.mark.timeout(400)
def test_cp2_assumed_documents_wait_for_a_batch_that_shows_them():
    """A mask made outside the attention's graph is assumed to keep documents apart, and the step check compares
    each rank's block of it with that rule. Where documents end at chunk edges no block shows the condition, and a
    mask without it (``k <= q`` made in eager code) passed the check and ran silently wrong (the negative control,
    with that batch let through, fails parity). Now such a batch is refused on every rank until a batch whose
    documents cross a chunk edge has shown the condition; then it runs, exactly. A mask that a compiled graph
    proved with its document condition and handed across a graph break is trusted from the first batch."""
    hidden = "every rank's tokens lie within one document"
    results = run_distributed(_assumed_worker, 2, True, timeout_s=360)
    assert results[0] == results[1], results
    got = results[0]
    # the graph before the break proved its mask's document condition and noted the mask it handed on: trusted
    assert got["packed_docs_break"] == ["", "", ""], got
    first, crossing, again = got["packed_docs_eager"]
    assert first.startswith("MaskMismatchError") and hidden in first and "compile the module" in first, got
    assert crossing == "" and again == "", got  # exact once the condition was seen
    first, crossing, again = got["causal_mask_eager"]
    assert first.startswith("MaskMismatchError") and hidden in first, got
    assert crossing.startswith("MaskMismatchError") and "differs from the global causal same-document" in crossing
    assert again.startswith("MaskMismatchError") and hidden in again, got  # never seen: still refused
    control = run_distributed(_assumed_worker, 2, False, timeout_s=360)[0]["causal_mask_eager"]
    assert control[0].startswith("AssertionError") and "logits" in control[0], control


def test_window_matters_on_the_parity_batch():
    """Negative control: on the parity batch the window changes the logits, so a site run without it (what the
    pass did before it read the difference spelling) fails the parity check."""
    batch = ParityCase(model="attn:window_diff", doc_lens=DOCS).batch()
    windowed = reference_step(attention_lm("window_diff"), batch)
    unwindowed = reference_step(attention_lm("packed_docs"), batch)
    assert (windowed.logits - unwindowed.logits).abs().max() > 1e-3


# -- the per-step mask check on the compact form ---------------------------------------------------------------
def _dense_verdict(plan, spec, mask) -> bool:
    """The check's definition: the model's mask equals the local rule, or (several runs) the whole-sequence rule."""
    kwargs = {"documents": spec.documents, "window": spec.window}
    if torch.equal(mask.expand(plan.batch_size, 1, -1, -1), plan.local_rule_mask(**kwargs)):
        return True
    return plan.runs() > 1 and torch.equal(mask.expand(plan.batch_size, 1, -1, -1), plan.local_global_mask(**kwargs))


@pytest.mark.parametrize("seed", range(6))
def test_mask_check_on_intervals_agrees_with_the_dense_comparison(seed):
    """Every model mask the dense comparison accepts is accepted, and every change of one entry, of a row's
    first or last key, or of a whole row is caught, naming the first differing entry of the dense comparison."""
    from cpcompile import ops
    from cpcompile.plan import build_plan

    g = torch.Generator().manual_seed(seed)
    docs = [[int(x) for x in torch.randint(1, 12, (5,), generator=g)] for _ in range(2)]
    docs[1][-1] += sum(docs[0]) - sum(docs[1])
    if docs[1][-1] < 1:
        docs[1] = [sum(docs[0])]
    cp, layout = (2, 3, 4)[seed % 3], ("contiguous", "head_tail", "balanced")[seed % 3]
    plan = build_plan(packed_batch(docs), cp, seed % cp, layout=layout)
    for documents, window in ((True, None), (False, None), (True, 3), (True, 40)):
        spec = ops.SiteSpec(
            site="t", layer="t", group_name="", cp_size=cp, cp_rank=plan.cp_rank, documents=documents,
            window=window, kernel="dense", needs_grad=False,
        )  # fmt: skip
        rules = [plan.local_rule_mask(documents=documents, window=window)]
        if plan.runs() > 1:
            rules.append(plan.local_global_mask(documents=documents, window=window))
        for rule in rules:
            assert ops.mask_mismatch(spec, plan, rule) is None
            one_row = rule[:1]  # a mask broadcast over the batch
            assert (ops.mask_mismatch(spec, plan, one_row) is None) == _dense_verdict(plan, spec, one_row)
            c = rule.shape[-1]
            for _ in range(12):
                broken = rule.clone()
                b, i = (
                    int(torch.randint(0, plan.batch_size, (1,), generator=g)),
                    int(torch.randint(0, c, (1,), generator=g)),
                )
                how = int(torch.randint(0, 4, (1,), generator=g))
                if how == 0:
                    j = int(torch.randint(0, c, (1,), generator=g))
                    broken[b, 0, i, j] = ~broken[b, 0, i, j]
                elif how == 1:
                    broken[b, 0, i] = False
                elif how == 2:  # a row shifted by one key (same count)
                    broken[b, 0, i] = broken[b, 0, i].roll(1)
                else:  # a hole inside the row with one more key after it (same count and first key)
                    keys = broken[b, 0, i].nonzero().flatten()
                    if len(keys) >= 3 and int(keys[-1]) + 1 < c:
                        broken[b, 0, i, keys[1]] = False
                        broken[b, 0, i, keys[-1] + 1] = True
                error = ops.mask_mismatch(spec, plan, broken)
                assert (error is None) == _dense_verdict(plan, spec, broken), (documents, window, how)
                if error is not None:
                    ours = plan.local_rule_mask(documents=documents, window=window)
                    bb, _, ii, jj = (broken != ours).nonzero()[0].tolist()
                    assert f"row {bb}, local query {ii}, key {jj}:" in str(error), str(error)
