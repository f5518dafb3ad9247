"""A sequence mixer of the user's own code, never registered, found by the backend and run head-parallel under CP
(``regions="found"``, :mod:`cpcompile.regions`).

Model (``tests.models.user_cores``): a :class:`tests.models.tiny.TinyLM` whose mixer calls a per-head linear
recurrence written as a Python loop over the tokens, on ``[B, H, S, D]`` inputs (``transposed_heads``: the heads at
dim 1 and the sequence at dim 2, unlike the registered cores of ``tests/test_registered_cores.py``), before a
packed-document attention layer. T = 37 with the packed documents of tests/test_hybrids_parity.py: at CP=2 the
padded sequence holds one padding token.

Fast tier (one process, fake CP group of 2, compile time): the function is found, classified (``x`` and ``g``
per-token with the sequence at dim 2 and the heads at dim 1, ``decay`` per-head) and reported ``head_parallel``;
with ``regions="registered"`` a loop is refused; negative controls of the classification: the same loop run from
the last token back (not causal), a loop that adds the mean over heads to its state (not a map over heads) and a
loop that reads its rates from a module global (not an argument, so not narrowed to the rank's heads) stay
refused, naming why; with the region's proof bypassed, the head-mixing loop is still refused by the test on
shares of the heads; heads a CP size does not divide leave the function to be tried again; parity at CP=2
(balanced) against the one-process model (logits, loss, gradients), with a negative control: the found core run
on each rank's own tokens must fail. Slow tier: transformers' cores taken out of the known ones: RWKV's WKV and
Mamba's selective scan found and exact at CP=2 (contiguous, balanced); Qwen3-Next's gated delta rule (grouped
heads) refused by the test on shares of the heads.
"""

from __future__ import annotations

import pytest
import torch

import cpcompile
from cpcompile import _compat, regions
from cpcompile.testing import packed_batch
from tests.harness.parity import ParityCase, report
from tests.harness.tiers import slow
from tests.models import user_cores
from tests.test_hybrids_parity import DOCS

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

FACTORY = "tests.models.user_cores:user_core_lm"
EXPECTED = (("transposed_heads", "head_parallel"), ("cross_entropy", "partial_sum"))


def _compile(core: str, group, **options):
    model = user_cores.user_core_lm(registered=False, core=core)
    backend = cpcompile.backend(group, inner="eager", **options)
    with cpcompile.shard(packed_batch([list(d) for d in DOCS]), group) as local:
        torch.compile(model, backend=backend)(**local)
    return [(r.op, r.action) for r in backend.mixing_reports]


def test_an_unregistered_core_is_found_and_run_head_parallel(world):
    assert _compile("transposed_heads", world) == [
        ("transposed_heads", "head_parallel"),
        ("cross_entropy", "partial_sum"),
    ]
    spec = cpcompile.cores._HEAD_SPECS["tests.models.user_cores.transposed_heads"]
    assert (spec.per_token, spec.per_head, spec.shared, spec.seq_dim, spec.head_dim) == (
        ("x", "g"),
        ("decay",),
        (),
        2,
        1,
    )


def test_with_registered_regions_only_the_same_core_is_refused(world):
    with pytest.raises(cpcompile.UnsupportedMixingError, match="picks token 0 of the sequence") as caught:
        _compile("heads_mixing_loop", world, regions="registered")
    assert "found no head-parallel region" not in str(caught.value)
    assert "tests.models.user_cores.heads_mixing_loop" not in regions._TRIED


@pytest.mark.parametrize(
    ("core", "why"),
    [
        ("reversed_heads", "not reversed_heads, as it is not causal: its outputs at its first 1 tokens change"),
        ("heads_mixing_loop", "as heads, mean combines values of different heads"),
        ("rates_read_inside", "a tensor with a dim of its head count that is none of its arguments"),
    ],
)
def test_a_core_that_cannot_run_head_parallel_stays_refused(world, core, why):
    with pytest.raises(cpcompile.UnsupportedMixingError, match="picks token") as caught:
        _compile(core, world)
    assert "found no head-parallel region for this op" in str(caught.value) and why in str(caught.value)


def test_with_the_proof_bypassed_the_split_test_refuses_a_core_that_mixes_heads(world, monkeypatch):
    """The negative control of the second numerical test: with the region's proof made to accept anything, the loop
    that adds the mean over heads to its state is still refused, by its outputs on shares of the heads."""
    with pytest.raises(cpcompile.UnsupportedMixingError, match="picks token"):
        _compile("heads_mixing_loop", world)  # tried (once per process): refused by the proof
    key = "tests.models.user_cores.heads_mixing_loop"
    monkeypatch.setitem(regions._TRIED, key, "probed")  # tried again: its probe notes its arguments again
    monkeypatch.setattr(_compat, "NOTING", {*_compat.NOTING, key})
    monkeypatch.setattr(regions, "_heads_kept", lambda *args: "")
    with pytest.raises(cpcompile.UnsupportedMixingError, match="picks token") as caught:
        _compile("heads_mixing_loop", world)
    assert "differ from its outputs from all of them: it is not a map over those heads" in str(caught.value)


def test_heads_the_cp_size_does_not_divide_leave_the_function_to_be_tried_again(monkeypatch):
    """A function whose heads one CP size does not divide is refused for that compile only: it stays probed, its
    arguments noted, and is classified again at its next refusal (at CP=2, say, after CP=3). Any other reason is
    kept."""
    key = "tests.models.user_cores.transposed_heads"
    error = cpcompile.UnsupportedMixingError("refused")
    error.functions = (user_cores.transposed_heads,)
    monkeypatch.setitem(regions._TRIED, key, "probed")
    monkeypatch.setattr(_compat, "NOTING", {key})
    monkeypatch.setattr(regions, "classify", lambda *args: regions.ForCPSize("its 6 heads do not divide by 4"))
    assert regions.find(error, None, None, 4) == "not transposed_heads, as its 6 heads do not divide by 4"
    assert regions._TRIED[key] == "probed" and key in _compat.NOTING
    monkeypatch.setattr(regions, "classify", lambda *args: "it is not causal")
    assert regions.find(error, None, None, 2) == "not transposed_heads, as it is not causal"
    assert regions._TRIED[key] == "it is not causal" and key not in _compat.NOTING


def _case(layout: str = "balanced") -> ParityCase:
    from cpcompile.layouts import Workload

    return ParityCase(
        model=FACTORY,
        doc_lens=DOCS,
        expected_sites=1,
        layout=layout,
        overrides=(("core", "transposed_heads"), ("registered", False)),
        expected_mixing=EXPECTED,
        shard_kwargs=(("workload", Workload(block_size=4)),) if layout == "balanced" else (),
    )


def _local_heads(original, *args, **kwargs):
    """The negative control's core: each run of ``c`` tokens alone, split along the sequence dim (2) of the
    per-token arguments."""
    import torch.distributed as dist

    n = dist.get_world_size()
    parts = [original(*(a.chunk(n, dim=2)[piece] for a in args), **kwargs) for piece in range(n)]
    return torch.cat(parts, dim=2)


def _worker(rank: int, world: int, case: ParityCase) -> dict:
    import dataclasses

    import torch.distributed as dist

    from tests.test_hybrids_parity import _control, _run

    torch.set_num_threads(1)
    group = dist.group.WORLD
    cases = _run([case], group)  # first: this process finds the core here
    return {"cases": cases, "control": _control(dataclasses.replace(case, expected_mixing=None), group, _local_heads)}


@pytest.mark.timeout(400)
def test_a_found_core_equals_one_process():
    from tests.harness.dist import run_distributed

    case = _case()
    per_rank = run_distributed(_worker, 2, case, timeout_s=360)
    report(per_rank[0]["cases"])
    assert [s["case"] for s in per_rank[0]["cases"]] == [case.name]
    for mine in per_rank:
        control = mine["control"]
        print(f"\ncontrol (the found core on each rank's own tokens): {control}")
        assert control["caught"] and "logits" in control["failing"], control


#: RWKV's mixing ops with its WKV core found rather than known: the token shifts' halos and the CPU path of the
#: core, ``rwkv_linear_attention_cpu`` (its wrapper ``rwkv_linear_attention`` dispatches to it on CPU).
_RWKV_BLOCK = (("pad", "halo"), ("rwkv_linear_attention_cpu", "head_parallel"), ("pad", "halo"))


def _family_worker(rank: int, world: int, family: str) -> dict:
    """Take ``family``'s core out of :data:`cpcompile.cores.CORES` (a fresh process: it is never substituted) and
    run its CP=2 cases, contiguous and balanced; or, for Qwen3-Next, return the refusal."""
    import dataclasses

    import torch.distributed as dist

    from cpcompile import cores
    from tests.harness.parity import check_case
    from tests.test_hybrids_parity import _case
    from tests.test_recurrent_parity import _LOSS, RWKV_CP2

    torch.set_num_threads(1)
    key = {"rwkv": cores._WKV, "mamba": cores._SELECTIVE, "qwen3_next": cores._GDN}[family].format(family)
    cores.CORES.pop(key)
    if family == "rwkv":
        cases = [dataclasses.replace(c, expected_mixing=(*_RWKV_BLOCK, *_RWKV_BLOCK, _LOSS)) for c in RWKV_CP2]
    else:
        cases = [_case(model=family), _case(model=family, layout="balanced")]
    out = {"cases": [], "refused": ""}
    for case in cases:
        torch.compiler.reset()
        try:
            out["cases"].append(check_case(case, dist.group.WORLD))
        except (cpcompile.UnsupportedPositionError, cpcompile.UnsupportedMixingError) as e:
            out["refused"] = str(e)
            break
    spec = cores._HEAD_SPECS.get(key)
    out["found"] = dataclasses.asdict(spec) if spec is not None else None
    out["tried"] = dict(regions._TRIED)
    return out


@slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["rwkv", "mamba", "qwen3_next"])
def test_a_transformers_core_left_out_of_the_registry(family):
    """transformers' cores taken out of :data:`cpcompile.cores.CORES` (in fresh ranks):

    * RWKV's WKV: its CPU path found (channels as heads, ``time_decay`` and ``time_first`` per-head, the state
      ``None``), exact at CP=2, contiguous and balanced;
    * Mamba's selective scan: found with the channels (dim 1) as heads, the sequence at dim 2, ``A``, ``D`` and
      ``delta_bias`` per-head and ``B``, ``C`` (per token, no channels) gathered whole; exact likewise;
    * Qwen3-Next's gated delta rule (2 key heads, 4 value heads, which it repeats the key heads to): not found, so
      refused. Its likeliest classification (the 4 value heads split, query and key gathered) passes the region's
      proof, and only the test on shares of the heads refuses it: each share would repeat the whole set of key
      heads to its own value heads."""
    from tests.harness.dist import run_distributed

    per_rank = run_distributed(_family_worker, 2, family, timeout_s=840, fresh=True)
    got = per_rank[0]
    key = {"rwkv": "rwkv.modeling_rwkv.rwkv_linear_attention_cpu", "mamba": "mamba.modeling_mamba.mamba_selective_scan",
           "qwen3_next": "qwen3_next.modeling_qwen3_next.torch_chunk_gated_delta_rule"}[family]  # fmt: skip
    if family == "qwen3_next":
        assert got["found"] is None and got["cases"] == [], got
        assert "it is not a map over those heads" in got["refused"], got["refused"]
        return
    report(got["cases"])
    assert len(got["cases"]) == 2 and got["tried"] == {f"transformers.models.{key}": "found"}, got
    if family == "mamba":
        found = {k: got["found"][k] for k in ("per_token", "per_head", "gathered", "seq_dim", "head_dim")}
        assert found == {"per_token": ("z", "hidden_states", "dt"), "per_head": ("D", "delta_bias", "A"),
                         "gathered": ("B", "C"), "seq_dim": 2, "head_dim": 1}, found  # fmt: skip
