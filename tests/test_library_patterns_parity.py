"""Parity of the library patterns of ``tests/test_library_patterns.py`` compiled with cpcompile, vs the same model
run whole in one process on the same global batch: CP=2 (contiguous layout, 2 gloo processes) and, in the full
tier, CP=4 under the balanced layout (4 processes; each rank holds several runs of tokens).

Cases (:mod:`tests.models.libraries`, :mod:`tests.models.attention`):

* nanoGPT's ``logits, loss = model(X, Y)`` with its mean ``F.cross_entropy(..., ignore_index=-1)`` (``mean``),
  and that mean over accumulation steps plus a summed z-loss (``mean_scaled``): the per-rank losses, summed,
  are the one-process loss, and the summed gradients its gradients. ``T = 37`` is padded, the padding's targets
  -1 (``pad_values={"targets": -1}``), and once more with ``shard``'s default padding of the targets (-100, out
  of range for nanoGPT's ``ignore_index=-1``: the rewrite makes padding targets ignored). Negative control: the
  ``mean`` case compiled with
  ``mixing="off"`` (each rank's mean over its own tokens): the parity check fails on the loss and the gradients;
* RoPE over the positions the model is given in the spellings of x-transformers (an unused ``t.max()``), IBM fms
  (``torch.max(position_ids[:, 0])`` sizing the cache) and rotary-embedding-torch (an ellipsis einsum);
* one mask broadcast to every head: x-transformers' ``expand`` then ``& ~causal_mask``, ``repeat``,
  ``einops.repeat``, ``[:, None].expand(-1, H, -1, -1)``. Negative control (``head_expand_causal``): the plan
  given merged documents, the reference keeping them apart: the logits differ;
* the real rotary-embedding-torch and IBM fms (``LLaMA(x, position_ids=...)``), optional test dependencies.
"""

from __future__ import annotations

import os

import pytest

from cpcompile.layouts import Workload
from tests.harness.dist import run_distributed
from tests.harness.parity import ParityCase, assert_controls, report
from tests.models.positions import package_missing

DOCS = ((10, 20, 7), (5, 30, 2))
NANOGPT = "tests.models.libraries:nanogpt_lm"
ROPE = "tests.models.libraries:rope_lm"
LOSS = ("cross_entropy", "partial_sum")
MEAN = ("cross_entropy", "mean_share")
SUM = ("sum", "partial_sum")


def _cases(layout: str) -> list[ParityCase]:
    balanced = (("workload", Workload(block_size=4)),) if layout == "balanced" else ()
    nanogpt = {
        "batch_extras": "tests.models.libraries:nanogpt_targets",
        "expected_sites": 2,
        "shard_kwargs": (("pad_values", {"targets": -1}), *balanced),
        "layout": layout,
    }
    other = {"shard_kwargs": balanced, "layout": layout}
    cases = [
        ParityCase(NANOGPT, DOCS, overrides=(("form", "mean"),), expected_mixing=(MEAN,), **nanogpt),
        ParityCase(NANOGPT, DOCS, overrides=(("form", "mean_scaled"),), expected_mixing=(MEAN, SUM), **nanogpt),
    ]
    # shard's default padding of the targets (-100, not nanoGPT's -1): the rewrite ignores padding itself
    cases.append(ParityCase(NANOGPT, DOCS, expected_mixing=(MEAN,), **{**nanogpt, **other}))
    cases += [
        ParityCase(ROPE, DOCS, overrides=(("form", form),), expected_sites=2, expected_mixing=(LOSS,), **other)
        for form in ("xtransformers", "fms", "rotary_torch")
    ]
    cases += [
        ParityCase(f"attn:{form}", DOCS, expected_mixing=(LOSS,), **other)
        for form in ("head_expand_causal", "head_repeat", "head_einops", "head_none_expand")
    ]
    return cases


#: CP=2 also through AOTAutograd: the rewritten mean (its all-gathered count, real_tokens) traced with its backward.
CP2 = [
    *_cases("contiguous"),
    ParityCase(
        NANOGPT,
        DOCS,
        inner="aot_eager",
        overrides=(("form", "mean"),),
        expected_mixing=(MEAN,),
        batch_extras="tests.models.libraries:nanogpt_targets",
        expected_sites=2,
    ),
]
CP4 = _cases("balanced")
#: The real packages (optional test dependencies): rotary-embedding-torch over passed positions, IBM fms's LLaMA.
PACKAGES = [
    ParityCase("tests.models.libraries:rotary_torch_lm", DOCS, expected_sites=2, expected_mixing=(LOSS,)),
    ParityCase("tests.models.libraries:fms_lm", DOCS, expected_sites=2, expected_mixing=(LOSS,)),
]
#: The negative control of each case that has one (by case index).
CONTROLS = {0: ("mixing_off",), 6: ("merge_documents",)}


def _worker(rank: int, world: int, which: str) -> list:
    import torch
    import torch.distributed as dist

    from tests.harness.parity import check_case

    torch.set_num_threads(1)
    cases, out = {"cp2": CP2, "cp4": CP4, "packages": PACKAGES}[which], []
    for i, case in enumerate(cases):
        torch.compiler.reset()
        controls = CONTROLS.get(i, ()) if which == "cp2" else ()
        out.append(check_case(case, dist.group.WORLD, controls=controls))
    return out


TIMEOUT_S = 900


def _check(summaries: list, cases: list[ParityCase]) -> None:
    report(summaries)
    assert [s["case"] for s in summaries] == [c.name for c in cases]


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_cp2_library_patterns_with_controls():
    summaries = run_distributed(_worker, 2, "cp2", timeout_s=TIMEOUT_S)[0]
    _check(summaries, CP2)
    # the mean loss without its rewrite: each rank's mean over its own tokens; the logits stay right
    mixing_off = summaries[0]["controls"]["mixing_off"]
    assert mixing_off["caught"] and mixing_off["failing"] == ["loss", "grads"], mixing_off
    assert summaries[6]["controls"].keys() == {"merge_documents"}
    assert_controls([summaries[6]])


@pytest.mark.skipif(
    any(package_missing(p) for p in ("rotary_embedding_torch", "fms")) and not os.environ.get("CI"),
    reason="rotary-embedding-torch or ibm-fms is not installed (scripts/setup.sh installs them)",
)
@pytest.mark.slow  # models of other libraries; their patterns, written by hand, are the CP=2 cases above
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_cp2_real_packages():
    """The real rotary-embedding-torch and IBM fms (skipped without them, failed under CI)."""
    summaries = run_distributed(_worker, 2, "packages", timeout_s=TIMEOUT_S)[0]
    _check(summaries, PACKAGES)


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_cp4_balanced_library_patterns():
    summaries = run_distributed(_worker, 4, "cp4", timeout_s=TIMEOUT_S)[0]
    _check(summaries, CP4)
    assert all(s["runs"] > 1 for s in summaries), [s["runs"] for s in summaries]
