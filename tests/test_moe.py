"""Mixture-of-experts models under CP: token dispatch is bookkeeping, not positions, and the models are exact.

transformers' MoE dispatch (``transformers/integrations/moe.py``) sorts the tokens x top_k rows by expert and
undoes the sort with ``inv_perm[perm] = arange(perm.size(0))``: an arange over ``k * T`` rows that numbers this
rank's own rows. The positions pass must leave it unchanged (not refuse it, and not make it global), while an
arange that shifts or selects rows, or that is used as a position, is still refused. DeepSeek-V3's attention
fills its key buffer in place (``new_empty``, then ``buf[..., :d].copy_(k)``): the exchange of K must wait for
those writes.

torchtitan's dispatch combines the experts' rows with ``scatter_add`` into zeros and counts the tokens per expert
from a one-hot map, which it also adds to a running buffer: the combine is bookkeeping, the count in the buffer
is summed over the CP ranks (padding left out), and a count used as a value is refused.

Parity of every MoE family of :data:`cpcompile.testing.MOE_FAMILIES` at CP=2 and 3, and of Mixtral at CP=3 (balanced
layout, T not a multiple of 3), runs in one spawned group of 3 processes, with torchtitan's Qwen3-MoE (its trainer's
masks, its running counts compared exactly), in the slow tier; Mixtral and Qwen3-MoE are in
:data:`cpcompile.testing.FAMILIES` and run with every family in ``tests/test_layouts_parity.py``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import cpcompile
from cpcompile.passes.positions import ROW_NUMBERS, UnsupportedPositionError
from cpcompile.testing import MOE_FAMILIES, packed_batch
from tests.harness.dist import run_distributed
from tests.harness.graphs import dynamo_graph, run_pass
from tests.harness.tiers import slow
from tests.harness.workers import balanced_case
from tests.models.positions import package_missing
from tests.models.tiny import lm_output, seeded

DOCS = [[10, 20, 7], [5, 30, 2]]  # T = 37


class _DispatchLM(nn.Module):
    """A one-layer LM with an MoE-style dispatch written in the ways the test names (``form``):

    * ``"inverse_permutation"``: sort rows by a routing score, process them sorted, undo the sort with
      ``inv[perm] = arange(n)`` and ``x[inv]`` (transformers' MoE dispatch): exact under CP;
    * ``"shift"``: ``x[:, arange(T) - 1]``, a token shift spelled as an index: refused;
    * ``"as_positions"``: ``pos[perm] = arange(T)`` used as positions of a learned table: refused.
    """

    def __init__(self, form: str, vocab: int = 64, dim: int = 16):
        super().__init__()
        self.form = form
        self.embed = nn.Embedding(vocab, dim)
        self.router = nn.Linear(dim, 1)
        self.expert = nn.Linear(dim, dim)
        self.wpe = nn.Embedding(128, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, labels=None, shift_labels=None, num_items_in_batch=None, **_):
        x = self.embed(input_ids)
        B, T, D = x.shape
        if self.form == "shift":
            x = x + x[:, torch.arange(T, device=x.device) - 1]
        else:
            rows = x.reshape(B * T, D)
            _, perm = torch.sort(self.router(rows).squeeze(-1))
            inv = torch.empty_like(perm)
            inv[perm] = torch.arange(perm.size(0), device=x.device)
            if self.form == "as_positions":
                x = x + self.wpe(inv.view(B, T) % 128)
            else:
                x = x + self.expert(rows[perm])[inv].view(B, T, D)
        q, k, v = self.qkv(x).view(B, T, 3, 1, D).permute(2, 0, 3, 1, 4)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        return lm_output(self.head(x), labels, shift_labels, num_items_in_batch)


def dispatch_lm(form: str = "inverse_permutation", seed: int = 0) -> nn.Module:
    return seeded(_DispatchLM, form, seed=seed)


@pytest.mark.usefixtures("fresh_dynamo")
def test_inverse_permutation_is_left_unchanged(world):
    backend = cpcompile.backend(world, inner="aot_eager")
    compiled = torch.compile(dispatch_lm(), backend=backend)
    with cpcompile.shard(packed_batch(DOCS, vocab_size=64), world) as local:
        assert torch.isfinite(compiled(**local).loss)
    assert [(r.kind, r.action, r.reason) for r in backend.position_reports] == [("arange", "unchanged", ROW_NUMBERS)]


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize(
    "form, words",
    [
        ("shift", r"indexes sharded data \(or positions\) with position-derived indices"),
        ("as_positions", "not of the local sequence length"),
    ],
)
def test_row_numbers_used_otherwise_are_refused(world, form, words):
    compiled = torch.compile(dispatch_lm(form), backend=cpcompile.backend(world, inner="aot_eager"))
    with pytest.raises(UnsupportedPositionError, match=words):
        with cpcompile.shard(packed_batch(DOCS, vocab_size=64), world) as local:
            compiled(**local)


class _CombineLM(nn.Module):
    """A one-layer LM with torchtitan's MoE dispatch (``form``): top-2 of 4 experts per token, tokens sorted by
    expert (``argsort``), expert outputs combined back with ``zeros_like(x).scatter_add(0, index, rows)``, and the
    tokens per expert counted from a one-hot routing map (``zeros(...).scatter_(-1, ids, True).sum((0, 1))``):

    * ``"combine"``: the count only kept in a buffer (torchtitan's ``tokens_per_expert_E``): exact, the buffer
      getting the count summed over the CP ranks;
    * ``"combine_at_expert_ids"``: rows combined at their expert ids, not at the dispatch's rows (tokens mixed):
      refused;
    * ``"count_as_value"``: the count used as a value in a load-balancing loss (this rank's count where the
      one-process model has the whole sequence's): refused.
    """

    def __init__(self, form: str, vocab: int = 64, dim: int = 16, experts: int = 4):
        super().__init__()
        self.form = form
        self.embed = nn.Embedding(vocab, dim)
        self.router = nn.Linear(dim, experts)
        self.experts = nn.Parameter(torch.randn(experts, dim, dim) / dim**0.5)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("tokens_per_expert", torch.zeros(experts))

    def forward(self, input_ids, labels=None, shift_labels=None, num_items_in_batch=None, **_):
        x = self.embed(input_ids)
        B, T, D = x.shape
        scores = F.softmax(self.router(x), dim=-1)
        top, ids = torch.topk(scores, 2, dim=-1)
        routing = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, ids, True)
        counts = routing.sum(dim=(0, 1))
        with torch.no_grad():
            self.tokens_per_expert.add_(counts)
        x_TD = x.reshape(B * T, D)
        perm = torch.argsort(ids.view(-1), stable=True)
        rows = perm // 2
        out = torch.bmm(x_TD[rows][:, None, :], self.experts[ids.view(-1)[perm]]).squeeze(1)
        out = out * top.reshape(-1)[perm][:, None]
        if self.form == "combine_at_expert_ids":
            rows = ids.view(-1)[perm]
        moe = torch.zeros_like(x_TD).scatter_add(0, rows.reshape(-1, 1).expand(-1, D), out)
        x = x + moe.view(B, T, D)
        q, k, v = self.qkv(x).view(B, T, 3, 1, D).permute(2, 0, 3, 1, 4)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        result = lm_output(self.head(x), labels, shift_labels, num_items_in_batch)
        if self.form == "count_as_value":  # a penalty on uneven expert loads
            result.loss = result.loss + 1e-3 * (counts.float() ** 2).sum()
        return result


@pytest.mark.usefixtures("fresh_dynamo")
def test_moe_combine_by_scatter_add_runs_and_its_count_is_summed(world):
    """torchtitan's dispatch: the combine (``scatter_add`` into zeros at the dispatch's rows) is bookkeeping,
    and the count kept in a buffer is summed over the CP ranks (its parity: the torchtitan case below)."""
    backend = cpcompile.backend(world, inner="aot_eager")
    compiled = torch.compile(seeded(_CombineLM, "combine"), backend=backend)
    with cpcompile.shard(packed_batch(DOCS, vocab_size=64), world) as local:
        assert torch.isfinite(compiled(**local).loss)
    actions = {(r.op, r.action) for r in backend.mixing_reports}
    assert {("sum", "summed"), ("argsort", "dispatch"), ("scatter_add", "dispatch")} <= actions, actions


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize(
    "form, error, words",
    [
        ("combine_at_expert_ids", cpcompile.UnsupportedMixingError, "scatter_add along the sequence"),
        ("count_as_value", cpcompile.UnsupportedMixingError, "the count over this rank's tokens becomes a value"),
    ],
)
def test_moe_combine_elsewhere_or_count_as_value_is_refused(world, form, error, words):
    compiled = torch.compile(seeded(_CombineLM, form), backend=cpcompile.backend(world, inner="aot_eager"))
    with pytest.raises(error, match=words):
        with cpcompile.shard(packed_batch(DOCS, vocab_size=64), world) as local:
            compiled(**local)


class _FilledKeys(nn.Module):
    """Attention whose keys are written into a fresh buffer in place (DeepSeek-V3's ``expand_kv``)."""

    def forward(self, q, k_a, k_b, v):
        k = k_a.new_empty(*k_a.shape[:-1], k_a.shape[-1] + k_b.shape[-1])
        k[..., : k_a.shape[-1]].copy_(k_a)
        k[..., k_a.shape[-1] :].copy_(k_b)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.usefixtures("fresh_dynamo")
def test_keys_are_exchanged_after_in_place_writes():
    q, v = torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8)
    gm = dynamo_graph(_FilledKeys(), q=q, k_a=torch.randn(1, 2, 8, 3), k_b=torch.randn(1, 2, 8, 5), v=v)
    run_pass(gm, cp_size=2)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    writes = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "copy_"]
    gathers = [n for n in gm.graph.nodes if "all_gather_start" in str(n.target)]
    buffer = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "new_empty")
    key_gather = next(g for g in gathers if g.args[0] is buffer)
    assert len(writes) == 2 and len(gathers) == 2
    assert order[key_gather] > max(order[w] for w in writes), "K is exchanged before the model wrote it"


# -- parity of the MoE families -----------------------------------------------------------------------------
MOE_NAMES = sorted(MOE_FAMILIES)
#: CP=3 (T padded, three ranks' runs): every MoE family, Mixtral included (it is in ``FAMILIES``, whose CP=2 runs in
#: tests/test_layouts_parity.py with Qwen3-MoE's CP=3).
CP3_NAMES = [*MOE_NAMES, "mixtral"]
CASES = [(family, 2) for family in MOE_NAMES] + [(family, 3) for family in CP3_NAMES]


#: torchtitan's Qwen3-MoE (optional test dependency) on its default flex attention with its trainer's masks:
#: (CP size, layout); CP=3 pads T = 37 to 39, whose padding tokens are routed too but must not be counted.
TORCHTITAN_MOE = ((2, "balanced"), (3, "contiguous"))


def _torchtitan_moe(group, layout: str, control: bool = False) -> dict:
    """One training step of torchtitan's Qwen3-MoE against the one-process model: logits, loss and gradients (at
    the tolerances of its bf16 experts) and its running ``tokens_per_expert_E`` counts (exactly). ``control``: the
    counts are not summed over the CP ranks."""
    from unittest import mock

    from cpcompile.passes import mixing
    from tests.harness.parity import compare_steps, cp_step, reference_step
    from tests.harness.tolerances import BF16_EXPERTS_GRAD_TOL, BF16_EXPERTS_LOGITS_TOL, LOSS_TOL
    from tests.models import flex

    batch = packed_batch(DOCS, seed=1)
    batch.update(flex.torchtitan_trainer_masks(batch))
    reference, model = flex.torchtitan_trainer_moe(), flex.torchtitan_trainer_moe()
    ref = reference_step(reference, batch)
    backend = cpcompile.backend(group)
    with mock.patch.object(mixing, "_sum_over_ranks", lambda *args: None) if control else contextlib.nullcontext():
        cp = cp_step(torch.compile(model, backend=backend), model, batch, group, layout=layout)
    errors, failing = compare_steps(ref, cp, tols=(BF16_EXPERTS_LOGITS_TOL, LOSS_TOL, BF16_EXPERTS_GRAD_TOL))
    counts = {n: b for n, b in reference.named_buffers() if "tokens_per_expert" in n}
    cp_counts = dict(model.named_buffers())
    return {
        **errors,
        "failing": failing,
        "counts": len(counts),
        "counts_differ": [n for n, b in counts.items() if not torch.equal(b, cp_counts[n])],
        "mixing": sorted({(r.op, r.action) for r in backend.mixing_reports}),
    }


def _worker(rank: int, world: int) -> dict:
    from tests.harness.parity import check_case

    pair = dist.new_group([0, 1])  # every rank takes part in creating every group
    out = {}
    for cp, group in ((2, pair), (3, dist.group.WORLD)):
        if rank >= cp:
            continue
        for family in MOE_NAMES if cp == 2 else CP3_NAMES:
            torch.compiler.reset()
            out[(cp, family)] = check_case(balanced_case(family, use_config=True), group)
        if package_missing("torchtitan") is None:
            layout = dict(TORCHTITAN_MOE)[cp]
            torch.compiler.reset()
            out[(cp, "torchtitan")] = _torchtitan_moe(group, layout)
            if cp == 2:
                torch.compiler.reset()
                out[(cp, "torchtitan control")] = _torchtitan_moe(group, layout, control=True)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def moe_results():
    return run_distributed(_worker, 3, timeout_s=600)


@slow  # torchtitan's models; the counts' decision is tested in one process above
@pytest.mark.parametrize(("cp", "layout"), TORCHTITAN_MOE)
def test_torchtitan_qwen3_moe_is_exact_and_counts_every_token_once(moe_results, cp, layout):
    """torchtitan's Qwen3-MoE as its trainer runs it (its default masks built outside for the whole batch): its
    dispatch (``argsort``, ``torch._grouped_mm``, ``torchtitan::deterministic_scatter_add``) is bookkeeping, and
    its running ``tokens_per_expert_E`` (the load-balancing bias's input) equals the one-process model's: the
    count written into it is summed over the CP ranks, padding left out. The control (counts not summed) leaves
    each rank its own tokens' counts."""
    missing = package_missing("torchtitan")
    if missing is not None:
        pytest.skip(missing)
    s = moe_results[0][(cp, "torchtitan")]
    print(f"torchtitan Qwen3-MoE CP={cp} {layout}: logits {s['logits']:.1e} loss {s['loss']:.1e} grad {s['grad']:.1e}")
    assert not s["failing"], s["failing"]
    assert s["counts"] == 2 and not s["counts_differ"], s
    assert ("sum", "summed") in s["mixing"] and ("torchtitan::deterministic_scatter_add", "dispatch") in s["mixing"]
    if cp == 2:
        control = moe_results[0][(cp, "torchtitan control")]
        assert not control["failing"] and len(control["counts_differ"]) == 2, control


@slow  # a family sweep; one MoE family (Qwen3-MoE) is exact at CP=2 in the fast tier (tests/test_layouts_parity.py)
@pytest.mark.timeout(660)
@pytest.mark.parametrize(("family", "cp"), CASES)
def test_moe_family_parity(moe_results, family, cp):
    s = moe_results[0][(cp, family)]  # parity itself was asserted in every rank (check_case)
    print(f"{family} CP={cp}: logits {s['logits']:.1e} loss {s['loss']:.1e} grad {s['grad']:.1e}, {s['runs']} runs")
    assert s["cp"] == cp
    assert s["runs"] > 1, f"{family} CP={cp}: the balanced layout kept contiguous chunks; nothing was tested"
