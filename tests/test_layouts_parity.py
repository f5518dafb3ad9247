"""Parity under the balanced layout: every model family at CP = 2 and one family of each kind at CP = 3 or 4,
layout changes without recompiling, the model-mask check, and negative controls, all in ONE group of 4 gloo
processes.

The cases are :class:`tests.harness.parity.ParityCase` instances (``LAYOUT_CASES``: ``layout="balanced"`` and its
workload) checked with :func:`tests.harness.parity.check_case` (gathered logits, summed loss, every summed gradient
against the unsharded eager model; every attention layer rewritten; K and V gathered once per layer). The 4 processes
run CP=2 on ranks {0, 1} and {2, 3} side by side (half of the families each), CP=3 on ranks {0, 1, 2} and CP=4 on all
four. The fast tier runs one family of each kind at CP=2 (``FAST_FAMILIES``) and the rest; the other families at CP=2
and the CP=3 and CP=4 repeats are the slow tier. ``inner="eager"``: the rewritten graph runs as traced (AOTAutograd and
inductor are covered by tests/test_parity.py and tests/test_fsdp_cp.py).

The batch has T = 64 tokens in documents that cross chunk edges: T is not a multiple of 3, so CP=3 pads it
to 66. The workload's block of 4 tokens gives the balanced layout something to balance at this length
(with the kernel's default block of 128 every layout computes the same single block and ``balanced`` keeps
the contiguous chunks); every case asserts that some rank really holds more than one run of tokens.
"""

from __future__ import annotations

import pytest

from cpcompile.plan import AttentionForm, Workload
from cpcompile.testing import FAMILIES
from tests.harness.dist import run_distributed
from tests.harness.tiers import runs_slow, slow
from tests.harness.workers import BALANCED_WORKLOAD as WORKLOAD
from tests.harness.workers import FAMILY_DOCS, balanced_case

FAMILY_NAMES = sorted(FAMILIES)
#: CP=3 and CP=4 share one family of each kind between them (the layout's arithmetic for more ranks and padded
#: lengths does not depend on the family, the model code's handling of a rank's several runs does, and CP=2 under
#: the same balanced layout covers every family): sliding-window layers interleaved with full ones and a mixture
#: of experts at CP=3 (T padded), dense and a hybrid with a short conv at CP=4 (the shortest runs of tokens).
CP_FAMILIES = {2: FAMILY_NAMES, 3: ["gemma3", "qwen3_moe"], 4: ["llama", "lfm2"]}
LAYOUT_CASES = {family: balanced_case(family) for family in FAMILY_NAMES}
#: The fast tier's families at CP=2, one of each kind: dense, a mixture of experts, sliding-window layers
#: interleaved with full ones, a hybrid with a short conv.
FAST_FAMILIES = ["qwen3", "qwen3_moe", "gemma3", "lfm2"]


def _families(group, families) -> dict:
    import torch

    from tests.harness.parity import check_case

    out = {}
    for family in families:
        torch.compiler.reset()  # transformers' shared code objects would otherwise pile up recompiles
        case = LAYOUT_CASES[family]
        out[family] = check_case(case, group)
    return out


def _layout_changes(group) -> dict:
    """One compiled model, steps with other layouts and other documents: losses equal, no recompilation."""
    import torch
    import torch.distributed as dist

    import cpcompile
    from cpcompile.plan import count_runs
    from cpcompile.testing import packed_batch, tiny_model

    torch.compiler.reset()
    model, ref = tiny_model("qwen3", seed=4), tiny_model("qwen3", seed=4)
    compiles = []
    backend = cpcompile.backend(group, inner="eager", block_size=8)

    def counting(gm, example_inputs):
        compiles.append(1)
        return backend(gm, example_inputs)

    compiled = torch.compile(model, backend=counting)
    steps = [
        ("balanced", FAMILY_DOCS),
        ("contiguous", FAMILY_DOCS),
        ("head_tail", ((40, 17), (3, 3, 51))),
        ("balanced", ((40, 17), (3, 3, 51))),
        ("balanced", ((12, 12, 12, 12, 12, 12, 1),) * 2),
    ]
    out = {"loss": [], "compiles_after_first": None}
    for i, (layout, docs) in enumerate(steps):
        batch = packed_batch([list(r) for r in docs], seed=20 + i)
        with cpcompile.shard(batch, group, layout=layout, workload=WORKLOAD) as local:
            loss = compiled(**local).loss.detach().clone()
        dist.all_reduce(loss, group=group)
        with torch.no_grad():
            want = ref(**batch, use_cache=False).loss
        out["loss"].append((layout, float((loss - want).abs())))
        if i == 0:
            out["compiles_after_first"] = len(compiles)
    out["compiles"] = len(compiles)
    # without a workload, shard balances what was compiled for the group: 2 full-causal layers, blocks of 8
    with cpcompile.shard(packed_batch([list(r) for r in FAMILY_DOCS]), group) as local:
        out["default_workload"] = cpcompile.runtime.compiled_workload(cpcompile.runtime.current_plan().group_name)
        out["default_runs"] = int(count_runs(cpcompile.runtime.current_plan().indices).max())
        compiled(**local)
    out["compiles_with_default"] = len(compiles)
    return out


def _mask_checks(group, rank: int) -> dict:
    """The first-call mask check under the balanced layout: the model's own rule passes, other masks fail."""
    import torch

    import cpcompile
    from cpcompile import ops
    from cpcompile.testing import packed_batch
    from tests.models import attention as _models

    out = {}
    batch = packed_batch([list(r) for r in FAMILY_DOCS], seed=1)
    q = torch.zeros(2, 4, 16, 8)
    with cpcompile.shard(batch, group, layout="balanced", workload=WORKLOAD):
        plan = cpcompile.runtime.current_plan()
        out["runs"] = int((torch.diff(plan.token_indices()) != 1).sum()) + 1

        def check(name, model_mask):
            spec = ops.SiteSpec(
                site=f"layouts-mask-{name}-{rank}",
                layer="test.layer",
                group_name=plan.group_name,
                cp_size=plan.cp_size,
                cp_rank=rank,
                documents=True,
                window=None,
                kernel="dense",
                needs_grad=False,
            )
            site = ops.register_site(spec)
            try:
                torch.ops.cpcompile.site_check(q, model_mask, site)
            except cpcompile.MaskMismatchError as e:
                return "MaskMismatchError: " + str(e)
            return "none"

        # what a transformers model builds from this rank's position ids: a jump between runs starts a document
        out["model_rule"] = check("rule", plan.local_rule_mask(documents=True))
        # the global mask restricted to the local keys joins a rank's runs of one document: what a model builds
        # from per-token document ids, accepted as the whole-sequence mask among the rank's tokens
        joined = plan.mask(documents=True)[..., plan.token_indices()]
        out["runs_joined"] = check("joined", joined)
        out["joined_differs"] = not torch.equal(joined, plan.local_rule_mask(documents=True))
        # near miss: joined, but one document's runs not causal between them (a key after its query)
        wrong = joined.clone()
        wrong[..., 0, -1] = True
        out["joined_wrong"] = check("joined-wrong", wrong)
    # a model whose own mask is wrong (same document, not causal), end to end
    torch.compiler.reset()
    compiled = torch.compile(_models.attention_lm("bidirectional"), backend=cpcompile.backend(group, inner="eager"))
    try:
        with cpcompile.shard(batch, group, layout="balanced", workload=WORKLOAD) as local:
            compiled(**local)
        out["bidirectional"] = "none"
    except cpcompile.MaskMismatchError as e:
        out["bidirectional"] = "MaskMismatchError: " + str(e)
    return out


def _controls(group) -> dict:
    """Negative controls: the same parity check fails when attention or gather ignore the layout."""
    from unittest import mock

    import torch

    from cpcompile import ops
    from cpcompile.plan import CPPlan
    from tests.harness.parity import ParityRunner, assert_parity

    torch.compiler.reset()
    runner = ParityRunner(LAYOUT_CASES["qwen3"], group)
    assert_parity(runner.run())  # the uncorrupted step passes

    def contiguous_positions(plan, spec):  # the attention believes rank r holds [r*c, (r+1)*c)
        c, r = plan.chunk_len, plan.cp_rank
        return torch.arange(r * c, (r + 1) * c), torch.arange(plan.padded_len), plan.attention_docs(spec.documents)

    def gather_in_slot_order(plan, gathered, dim=1):  # gather forgets to put tokens back in order
        return gathered.narrow(dim, 0, plan.seq_len)

    out = {}
    for name, target, attr, fake in (
        ("positions", ops.sites, "_site_positions", contiguous_positions),
        ("gather", CPPlan, "restore_order", gather_in_slot_order),
    ):
        with mock.patch.object(target, attr, fake):
            bad = runner.run()
        try:
            assert_parity(bad)
            out[name] = {"caught": False, **bad.errors()}
        except AssertionError as e:
            out[name] = {"caught": True, **bad.errors(), "message": str(e).splitlines()[0]}
    return out


def _worker(rank: int, world: int, with_slow: bool) -> dict:
    import torch.distributed as dist

    world_group = dist.group.WORLD
    first3 = dist.new_group([0, 1, 2])  # every rank takes part in creating every group
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    families = FAMILY_NAMES if with_slow else FAST_FAMILIES
    half = len(families) // 2
    res = {"cp2": _families(pairs[rank // 2], families[:half] if rank < 2 else families[half:])}
    if with_slow and rank < 3:
        res["cp3"] = _families(first3, CP_FAMILIES[3])
    dist.barrier()
    if with_slow:
        res["cp4"] = _families(world_group, CP_FAMILIES[4])
    res["layout_changes"] = _layout_changes(dist.new_group([0, 1, 2, 3]))  # a group nothing was compiled for yet
    res["mask"] = _mask_checks(world_group, rank)
    res["controls"] = _controls(world_group)
    return res


@pytest.fixture(scope="module")
def results(request):
    return run_distributed(_worker, 4, runs_slow(request), timeout_s=900)


def _summary(results, cp: int, family: str) -> dict:
    key = f"cp{cp}"
    if cp == 2:  # ranks 0 and 2 hold the two pairs' families
        return results[0][key].get(family) or results[2][key][family]
    return results[0][key][family]


def _tier(family: str, cp: int):
    return (family, cp) if cp == 2 and family in FAST_FAMILIES else pytest.param(family, cp, marks=slow)


@pytest.mark.timeout(960)
@pytest.mark.parametrize(("family", "cp"), [_tier(f, cp) for cp, families in CP_FAMILIES.items() for f in families])
def test_family_parity_with_balanced_layout(results, family, cp):
    s = _summary(results, cp, family)  # parity itself was asserted in every rank (check_case)
    print(
        f"{family} CP={cp}: logits {s['logits']:.1e} loss {s['loss']:.1e} grad {s['grad']:.1e}, "
        f"{s['runs']} runs, {s['seconds']:.1f}s"
    )
    assert s["cp"] == cp
    assert s["runs"] > 1, f"{family} CP={cp}: the balanced layout kept contiguous chunks; nothing was tested"


def test_layout_and_documents_change_without_recompiling(results):
    res = results[0]["layout_changes"]
    for _layout, err in res["loss"]:
        assert err <= 1e-5, res["loss"]  # a sum of 4 per-rank partial means (fp32)
    assert res["compiles"] == res["compiles_after_first"] == res["compiles_with_default"], res
    assert res["default_workload"] == Workload(forms=(AttentionForm(True, None, 2),), block_size=8)
    assert res["default_runs"] > 1


def test_model_mask_is_still_checked_under_the_balanced_layout(results):
    """The local rule and the whole-sequence mask among a rank's tokens pass; other masks raise MaskMismatchError."""
    for rank, r in enumerate(results):
        mask = r["mask"]
        assert mask["model_rule"] == "none", (rank, mask)
        # two runs of one document joined (a mask built from document ids): the whole-sequence mask, accepted
        assert mask["runs_joined"] == "none", (rank, mask)
        assert mask["joined_wrong"].startswith("MaskMismatchError"), (rank, mask)
        assert mask["bidirectional"].startswith("MaskMismatchError"), (rank, mask)
        assert "differs from the global causal same-document mask" in mask["bidirectional"]
        if mask["runs"] > 1:  # neither rule matches: the refusal names the layout with one run per rank
            assert "layout='contiguous'" in mask["bidirectional"], (rank, mask)
    assert any(r["mask"]["joined_differs"] for r in results), "no rank held two runs of one document"


@pytest.mark.parametrize("control", ["positions", "gather"])
def test_parity_fails_when_the_layout_is_ignored(results, control):
    c = results[0]["controls"][control]
    print(f"control {control}: {c}")
    assert c["caught"], c
