"""A sequence mixer of the user's own code, never registered, found by the backend and run head-parallel under CP
(``regions="found"``, :mod:`cpcompile.regions`).

Model (``tests.models.user_cores``): a :class:`tests.models.tiny.TinyLM` whose mixer calls a per-head linear
recurrence written as a Python loop over the tokens, on ``[B, H, S, D]`` inputs (``transposed_heads``: the heads at
dim 1 and the sequence at dim 2, unlike the registered cores of ``tests/test_registered_cores.py``), before a
packed-document attention layer. T = 37 with the packed documents of tests/test_hybrids_parity.py: at CP=2 the
padded sequence holds one padding token.

Fast tier (one process, fake CP group of 2, compile time): the function is found, classified (``x`` and ``g``
per-token with the sequence at dim 2 and the heads at dim 1, ``decay`` per-head) and reported ``head_parallel``;
with ``regions="registered"`` the same model is refused; two negative controls of the classification: the same loop
run from the last token back (not causal), a loop that adds the mean over heads to its state (not a map over
heads) and a loop that reads its per-head rates from a module global (not an argument, so not narrowed to the
rank's heads) stay refused, naming why; with the region's proof bypassed, the head-mixing loop is still refused
by the test on shares of the heads; parity at CP=2 (balanced) against the one-process model (logits, loss,
gradients), with a negative control: the found core run on each rank's own tokens must fail. Slow tier:
transformers' RWKV with its WKV core taken out of the known cores, found and exact at CP=2 (contiguous,
balanced).
"""

from __future__ import annotations

import pytest
import torch

import cpcompile
from cpcompile import regions
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
        ("reversed_heads", "not reversed_heads, as it is not causal: its outputs at tokens before 1 change"),
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
    monkeypatch.setitem(regions._TRIED, "tests.models.user_cores.heads_mixing_loop", "probed")  # tried again
    monkeypatch.setattr(regions, "_heads_kept", lambda *args: "")
    with pytest.raises(cpcompile.UnsupportedMixingError, match="picks token") as caught:
        _compile("heads_mixing_loop", world)
    assert "differ from its outputs from all of them: it is not a map over those heads" in str(caught.value)


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


def _rwkv_worker(rank: int, world: int) -> dict:
    import dataclasses

    import torch.distributed as dist

    from cpcompile import cores
    from tests.harness.parity import check_case
    from tests.test_recurrent_parity import _LOSS, RWKV_CP2

    torch.set_num_threads(1)
    cores.CORES.pop(cores._WKV)  # a fresh process: the known core is never substituted
    expected = (*_RWKV_BLOCK, *_RWKV_BLOCK, _LOSS)
    out = []
    for case in RWKV_CP2:
        torch.compiler.reset()
        out.append(check_case(dataclasses.replace(case, expected_mixing=expected), dist.group.WORLD))
    return {"cases": out, "tried": dict(regions._TRIED)}


@slow
@pytest.mark.timeout(700)
def test_a_transformers_core_left_out_of_the_registry_is_found():
    """transformers' RWKV with its WKV core taken out of :data:`cpcompile.cores.CORES` (in fresh ranks): the
    backend finds the core's CPU path (channels as heads, ``time_decay`` and ``time_first`` per-head, the state
    ``None``), and the model equals one process at CP=2, contiguous and balanced."""
    from tests.harness.dist import run_distributed

    per_rank = run_distributed(_rwkv_worker, 2, timeout_s=600, fresh=True)
    report(per_rank[0]["cases"])
    assert per_rank[0]["tried"] == {"transformers.models.rwkv.modeling_rwkv.rwkv_linear_attention_cpu": "found"}
