"""Parity of models that compute their own positions: compiled with cpcompile at CP=2 and CP=4 (gloo processes) vs
the same model run whole in one process on the same global batch.

T = 37 is not a multiple of 2 or 4, so the last rank holds padding tokens, whose global indices (>= T) are
clamped into the tables. Every case asserts the logits, the summed loss and every summed gradient
(``tests.harness.parity`` tolerances), every SDPA site rewritten, and the position sources the backend reports. The
negative control compiles the same model with ``cpcompile.backend(..., positions="off")``: the parity check must
fail. It runs for one model per kind of rewrite (a table slice, an arange, transformers' ``cache_position``) and
for each real package (``explicit_positions`` takes its positions as input and needs no rewrite).

Inductor runs one model that combines every form (``all_forms``: a layer per RoPE form, ``library_style`` included,
learned positions at the embedding, one layer taking explicit positions) at CP=2, standing for them. The other cases
run the rewritten graph as traced (``inner="eager"``: the positions pass rewrites Dynamo's graph, before
AOTAutograd). CP=4 runs the balanced layout (each rank holds several runs of tokens), and so does ``titan_style``
at CP=2, so rewritten positions are checked to follow the plan's tokens wherever they are. CP=4, inductor and the
real packages are the slow tier.

Measured differences: BENCHMARKS.md ("parity errors", models that compute positions).
"""

from __future__ import annotations

import pytest

from cpcompile.plan import Workload
from tests.harness.dist import run_distributed
from tests.harness.parity import ParityCase, assert_controls, check_case, report
from tests.harness.tiers import slow
from tests.models import positions as pm

# T = 37: chunks of 19 (CP=2) and 10 (CP=4, 3 padding tokens on rank 3); documents cross chunk boundaries.
DOCS = ((10, 20, 7), (5, 30, 2))
#: (kind, action) of every position source each model must report.
EXPECTED = {
    "titan_style": (("table_slice", "rewritten"),) * 2,  # one RoPE cache per attention layer
    "lit_style": (("table_slice", "rewritten"),) * 2,  # cos[:T] and sin[:T]
    "arange_rope": (("arange", "rewritten"),) * 2,  # one arange per attention layer
    "learned_positions": (("arange", "rewritten"),),
    "explicit_positions": (),
    "torchtitan_llama3": (("table_slice", "rewritten"),) * 2,
    "litgpt_gpt": (("table_slice", "rewritten"),) * 2,
    # cache_position = arange(T) feeds RoPE (rewritten); the mask's own aranges are left to the mask
    "llama_without_positions": (("arange", "rewritten"), ("arange", "mask"), ("arange", "mask")),
    # wpe(arange(T)), cos[:T], sin[:T], layer 0's RoPE cache, layer 2's arange (layer 3 takes positions as input),
    # layer 4's arange (library_style: dead max, ellipsis einsum, -T: and k - q narrow)
    "all_forms": (
        ("arange", "rewritten"),
        ("table_slice", "rewritten"),
        ("table_slice", "rewritten"),
        ("table_slice", "rewritten"),
        ("arange", "rewritten"),
        ("arange", "rewritten"),
    ),
}
MODELS = ("titan_style", "lit_style", "arange_rope", "learned_positions", "explicit_positions")


def _case(name: str, inner: str = "eager", layout: str = "contiguous", **overrides) -> ParityCase:
    return ParityCase(
        model=f"tests.models.positions:{name}",
        # without position_ids a transformers model sees one document per row, padding included, while the plan
        # makes padding its own document: its mask matches the plan's (checked at run time) only without padding
        doc_lens=((38,), (38,)) if name == "llama_without_positions" else DOCS,
        inner=inner,
        overrides=tuple(overrides.items()),
        expected_sites=len(pm.ALL_FORMS_LAYERS) if name == "all_forms" else 2,
        expected_positions=EXPECTED[name],
        layout=layout,
        # kernel blocks of 4 tokens give the balanced layout something to balance at this length
        shard_kwargs=(("workload", Workload(block_size=4)),) if layout == "balanced" else (),
    )


def _worker(rank, world_size, cases, with_controls):
    import torch
    import torch.distributed as dist

    out = []
    for case in cases:
        torch._dynamo.reset()
        name = case.model.rsplit(":", 1)[-1]
        wanted = with_controls is True or name in (with_controls or ())
        controls = ("positions_off",) if wanted and case.expected_positions else ()
        out.append(check_case(case, dist.group.WORLD, controls=controls))
    return out


def _report_and_check(summaries):
    report(summaries)
    assert_controls(summaries)


# Generous limits: they only cut a hang on a shared machine (about 1-2 min each on 2 idle cores, more cold).
TIMEOUT_S = 900


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_position_models_cp2():
    # learned positions with exactly T rows: the padding token's index (37) must be clamped into the table
    # titan_style under the balanced layout (blocks of 4: rank 1 holds two runs of tokens), the others contiguous
    cases = [_case(m, layout="balanced" if m == "titan_style" else "contiguous") for m in MODELS]
    cases = [c for c in cases if "learned_positions" not in c.model]
    cases += [_case("learned_positions", max_len=37), _case("llama_without_positions")]
    # one control per kind of rewrite: a table slice, an arange, transformers' cache_position
    controlled = ("titan_style", "arange_rope", "llama_without_positions")
    results = run_distributed(_worker, 2, cases, controlled, timeout_s=TIMEOUT_S)
    _report_and_check(results[0])
    assert [len(s["controls"]) for s in results[0]] == [1, 0, 1, 0, 0, 1]


@slow
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_position_models_cp4():
    """The balanced layout: rewritten positions are the plan's global indices, whichever tokens a rank holds."""
    cases = [_case(m, layout="balanced") for m in ("titan_style", "lit_style")]
    cases.append(_case("learned_positions", layout="balanced", max_len=37))  # 3 padding tokens clamped
    results = run_distributed(_worker, 4, cases, (), timeout_s=TIMEOUT_S)
    assert all(s["runs"] > 1 for s in results[0]), "the balanced layout kept contiguous chunks; nothing was tested"
    _report_and_check(results[0])


@slow
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_position_models_cp2_inductor():
    """Every form in one model (one layer per form, learned positions at the embedding): one inductor compile
    per rank instead of five, and the check fails if any form is wrong on any rank."""
    results = run_distributed(_worker, 2, [_case("all_forms", "inductor")], False, timeout_s=TIMEOUT_S)
    _report_and_check(results[0])


@slow  # torchtitan's and litgpt's models; the same forms hand-written are in the fast tier
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_real_packages_cp2():
    """Each package's model in its plain ``model(tokens)`` call (RoPE sliced by the local length) is exact at
    CP=2 under the default balanced layout, and is not with the rewrite off (torchtitan's Llama 3 and litgpt's
    GPT, in one spawned group)."""
    packages = {"torchtitan": "torchtitan_llama3", "litgpt": "litgpt_gpt"}
    missing = [m for m in (pm.package_missing(p) for p in packages) if m is not None]
    if missing:
        pytest.skip("; ".join(missing))
    cases = [_case(f, layout="balanced") for f in packages.values()]  # shard's default layout
    results = run_distributed(_worker, 2, cases, True, timeout_s=TIMEOUT_S)
    assert all(s["runs"] > 1 for s in results[0]), "the balanced layout kept contiguous chunks; nothing was tested"
    _report_and_check(results[0])
    assert [len(s["controls"]) for s in results[0]] == [1, 1]


def _short_table_worker(rank, world_size):
    import torch
    import torch.distributed as dist

    import cpcompile
    from cpcompile.testing import packed_batch

    model = pm.titan_style(max_len=30)  # 30 rows for T = 37
    compiled = torch.compile(model, backend=cpcompile.backend(dist.group.WORLD, inner="aot_eager"))
    try:
        with cpcompile.shard(packed_batch([list(r) for r in DOCS]), dist.group.WORLD) as local:
            compiled(**local)
    except ValueError as e:
        error = str(e)
    else:
        error = ""
    t = torch.ones(1)
    dist.all_reduce(t)  # every rank is still in step
    return error, float(t)


def test_table_shorter_than_the_sequence_raises_on_every_rank():
    results = run_distributed(_short_table_worker, 2, timeout_s=240)
    for error, in_step in results:
        assert "has 30 rows, but the global sequence has 37 tokens" in error, error
        assert in_step == 2.0
