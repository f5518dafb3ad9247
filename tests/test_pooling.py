"""Last-token pooling (an ``argmax`` over the sequence that picks the winning token's rows): exact across CP ranks.

transformers' ``*ForSequenceClassification`` pools the last token that is not ``pad_token_id``:
``logits[arange(B), (arange(T) * (input_ids != pad)).argmax(-1)]``. The mixing pass makes the ranks agree on the
winning token and hands every rank its rows (``pooled``, ``cpcompile/passes/mixing/pooling.py``); the pooled
logits and the loss computed from them are whole on every rank, and the gradients summed over the ranks are the
one-process gradients.

Parity (gloo processes, the comparison of ``tests.harness.parity``: the unsharded model eager in one process on
the same global batch, ``assert_close`` with ``tests.harness.tolerances``; the pooled logits and the loss are
compared on every rank, not gathered or summed, since every rank holds them whole): ``LlamaForSequenceClassification``
and ``MistralForSequenceClassification`` (sliding window), rows right-padded to different lengths with
``pad_token_id = 1`` while ``shard`` pads ``T = 37`` to a multiple of the CP size with token 0 (the model would
take that padding token for the last real one: the pass keeps padding out), under the contiguous and the balanced
layouts; a hand-written model whose scores tie across ranks (``input_ids % 4``: the first maximum in global order
must win, also where a rank holds several runs of tokens). Negative controls: the owner rule broken (every rank's
row carries the gradient: the gradients fail), the tie rule broken (the last maximum wins: the logits fail) and
``mixing="off"`` (each rank pools its own tokens: the logits fail). One process (fake group of 2): what the pass
reports and writes, a model whose only cross-token op is the pooling (a step that mixes tokens), and the argmax
forms it keeps refused. CP=2 is the fast tier; CP=3 and 4 are slow.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cpcompile
from tests.harness.dist import run_distributed
from tests.harness.tiers import slow

#: The model's padding token; ``shard`` pads ``T`` to a multiple of the CP size with its default, 0.
PAD = 1
T = 37
#: Real tokens per row; the rest of the row is ``PAD``.
LENGTHS = (30, 21)
POOLED = [("argmax", "pooled"), ("getitem", "pooled")]


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids [2, T]`` right-padded with ``PAD`` and one class label per row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 128, (len(LENGTHS), T), generator=g)
    for b, n in enumerate(LENGTHS):
        ids[b, n:] = PAD
    return ids, torch.tensor([1, 2])


def seq_cls(family: str) -> nn.Module:
    import transformers

    from cpcompile.testing import tiny_config

    # one decoder layer: the pooling follows the last one, and Dynamo traces every layer anew
    config = tiny_config(family, num_labels=3, pad_token_id=PAD, num_hidden_layers=1)
    torch.manual_seed(0)
    return transformers.AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa").train()


class TiedScores(nn.Module):
    """One causal attention layer, then the row of the first token whose id is largest modulo 4 (many ties)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(128, 16)
        self.qkv = nn.Linear(16, 48)
        self.head = nn.Linear(16, 3)

    def forward(self, input_ids, labels=None, **_):
        h = self.embed(input_ids)
        q, k, v = self.qkv(h)[:, None].chunk(3, dim=-1)
        x = self.head(h + F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, 0])
        pooled = x[torch.arange(x.shape[0]), (input_ids % 4).argmax(-1)]
        return F.cross_entropy(pooled, labels), pooled


def _model(name: str) -> nn.Module:
    return TiedScores() if name == "tied" else seq_cls(name)


def _loss_logits(out) -> tuple[torch.Tensor, torch.Tensor]:
    return (out.loss, out.logits) if hasattr(out, "loss") else out


def _patch(control: str | None):
    """Break the rewrite for a negative control; returns what undoes it."""
    from cpcompile.passes.mixing import pooling

    saved = (pooling._deliver, pooling._first)
    if control == "every_rank_owns":  # the same rows, but every rank's candidate row carries the gradient

        def every(graph, mine, own, theirs):
            zero = graph.call_function(torch.sub, (own, graph.call_method("detach", (own,))))
            return graph.call_function(torch.add, (zero, theirs))

        pooling._deliver = every
    elif control == "last_on_ties":  # the largest global index among the best candidates wins

        def last(graph, best, keys):
            return graph.call_method("amax", (graph.call_function(torch.where, (best, keys, -1)), 0))

        pooling._first = last

    def undo():
        pooling._deliver, pooling._first = saved

    return undo


def _case(name: str, layout: str, group, control: str | None = None) -> dict:
    """One CP step of model ``name`` against the one-process model: errors, failing quantities, mixing reports."""
    from cpcompile.layouts import Workload
    from tests.harness.parity import Step, compare_steps, sum_grads_over_cp

    torch._dynamo.reset()
    ids, labels = batch()
    ref_model = _model(name)
    loss, logits = _loss_logits(ref_model(input_ids=ids, labels=labels, use_cache=False))
    loss.backward()
    ref = Step(logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in ref_model.named_parameters()})

    model = _model(name)
    backend = cpcompile.backend(group, inner="eager", mixing="off" if control == "mixing_off" else "exact")
    compiled = torch.compile(model, backend=backend)
    workload = {"workload": Workload(block_size=4)} if layout == "balanced" else {}
    undo = _patch(control)
    try:
        with cpcompile.shard({"input_ids": ids}, group, pad_token_id=0, layout=layout, **workload) as local:
            runs = int(cpcompile.plan.count_runs(cpcompile.runtime.current_plan().indices).max())
            loss, logits = _loss_logits(compiled(**local, labels=labels))
            loss.backward()
    finally:
        undo()
    cp = Step(logits.detach(), loss.detach(), sum_grads_over_cp(model, group))
    errors, failing = compare_steps(ref, cp)
    return {
        "errors": errors,
        "failing": sorted({line.split(":")[0].split(" of ")[0] for line in failing}),
        "mixing": [(r.op, r.action) for r in backend.mixing_reports],
        "runs": runs,
        "sites": sum(r.action == "rewritten" for r in backend.reports),
    }


#: (model, layout) cases that must be exact.
CASES = [("llama", "contiguous"), ("llama", "balanced"), ("mistral", "balanced"), ("tied", "contiguous")]
CASES += [("tied", "balanced")]
#: (model, layout, control) cases that must fail, and the quantities they fail on.
CONTROLS = {
    ("llama", "contiguous", "every_rank_owns"): ["grad"],
    ("tied", "balanced", "last_on_ties"): ["grad", "logits", "loss"],
    ("llama", "contiguous", "mixing_off"): ["grad", "logits", "loss"],
}


def _worker(rank: int, world: int, with_controls: bool) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    group = dist.group.WORLD
    out = {f"{m}/{layout}": _case(m, layout, group) for m, layout in CASES}
    if with_controls:
        out.update({"/".join(k): _case(*k[:2], group, control=k[2]) for k in CONTROLS})
    return out


TIMEOUT_S = 600


@pytest.fixture(scope="module")
def cp2():
    return run_distributed(_worker, 2, True, timeout_s=TIMEOUT_S)


def _report(results: list[dict]) -> None:
    for rank, out in enumerate(results):
        for name, r in out.items():
            e = r["errors"]
            print(f"\nrank {rank} {name}: logits {e['logits']:.1e} loss {e['loss']:.1e} grad {e['grad']:.1e} {r}")


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_cp2_exact_on_every_rank(cp2):
    _report(cp2)
    for rank, out in enumerate(cp2):
        for m, layout in CASES:
            r = out[f"{m}/{layout}"]
            assert r["failing"] == [], f"rank {rank} {m}/{layout}: {r}"
            assert r["mixing"] == POOLED, f"{m}/{layout}: {r['mixing']}"
            assert r["sites"] == 1, r  # one attention layer in each model
            assert (r["runs"] > 1) == (layout == "balanced"), r  # balanced: local order is not global order


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_cp2_negative_controls_fail(cp2):
    for rank, out in enumerate(cp2):
        for key, failing in CONTROLS.items():
            r = out["/".join(key)]
            assert r["failing"] == failing, f"rank {rank} control {key}: {r}"


@slow
@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("cp", [3, 4])
def test_cp3_cp4_exact(cp):
    results = run_distributed(_worker, cp, False, timeout_s=TIMEOUT_S)
    _report(results)
    for rank, out in enumerate(results):
        for m, layout in CASES:
            r = out[f"{m}/{layout}"]
            assert r["failing"] == [] and r["mixing"] == POOLED, f"CP={cp} rank {rank} {m}/{layout}: {r}"


# -- one process: what the pass reports and writes, and what stays refused ---------------------------------------
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_reports_and_graph(world, tmp_path):
    """Both ops are reported ``pooled``; the graph all-gathers the candidates and keeps padding out; AOTAutograd
    traces the rewrite with its backward."""
    ids, labels = batch()
    backend = cpcompile.backend(world, inner="aot_eager", dump_dir=str(tmp_path))
    with cpcompile.shard({"input_ids": ids}, world) as local:
        loss, logits = _loss_logits(torch.compile(seq_cls("llama"), backend=backend)(**local, labels=labels))
        loss.backward()
    assert [(r.op, r.action) for r in backend.mixing_reports] == POOLED
    argmax, pick = backend.mixing_reports
    assert "modeling_layers.py" in argmax.source and pick.all_gather_bytes_per_call == 2 * 3 * 4  # B x labels fp32
    after = (tmp_path / "rank0" / "graph0_after.py").read_text()
    assert after.count("all_gather_seq") >= 3  # values, keys, rows
    assert "real_tokens" in after and logits.shape == (2, 3) and loss.dim() == 0


class _PoolOnly(nn.Module):
    """Token-wise layers and last-token pooling: the pooling is the model's only op that mixes tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(128, 8)

    def forward(self, input_ids, **_):
        h = self.embed(input_ids)
        return (h[torch.arange(h.shape[0]), (input_ids % 4).argmax(-1)].sum(),)


def test_pooling_counts_as_token_mixing(world):
    """A model whose only cross-token op is the pooling mixes tokens across ranks: the step ends without the error
    that names attention run outside the compiled graphs."""
    backend = cpcompile.backend(world, inner="eager")
    with cpcompile.shard({"input_ids": batch()[0]}, world) as local:
        torch.compile(_PoolOnly(), backend=backend)(**local)
    assert [(r.op, r.action) for r in backend.mixing_reports] == POOLED


class _ArgmaxUse(nn.Module):
    def __init__(self, use: str) -> None:
        super().__init__()
        self.use = use
        self.embed = nn.Embedding(128, 8)
        self.table = nn.Parameter(torch.randn(64, 8))

    def forward(self, input_ids, **_):
        h = self.embed(input_ids)
        h = h + F.scaled_dot_product_attention(h[:, None], h[:, None], h[:, None], is_causal=True)[:, 0]
        last = h.sum(-1).argmax(-1)
        if self.use == "value":  # the index itself becomes a value
            return (h[torch.arange(h.shape[0]), last].sum() + last.float().sum(),)
        return (self.table[last].sum(),)  # a table (not sharded data) looked up at the local index


@pytest.mark.parametrize("use", ["value", "table"])
def test_argmax_used_otherwise_is_refused(world, use):
    """An argmax over the sequence used as a value, or to index what is not per-token data, stays refused."""
    backend = cpcompile.backend(world, inner="eager")
    with pytest.raises(cpcompile.UnsupportedMixingError, match=r"argmax at .*argmax along the sequence"):
        with cpcompile.shard({"input_ids": batch()[0]}, world) as local:
            torch.compile(_ArgmaxUse(use), backend=backend)(**local)
