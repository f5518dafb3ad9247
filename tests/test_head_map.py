"""The mixing pass proves that a head-parallel region (:mod:`cpcompile.cores`) is a map over its heads. One process,
fake CP group of 2 (compile time only: the fake group moves no data).

Toy cores (``tests.models.head_cores``) registered as known cores of the WKV form: the one that keeps its channels
apart is accepted (``head_parallel``, nothing refused), and each of its variants with one op that combines channels
(a sum, an einsum contracting them, a softmax over them, a sum of the per-channel parameter the replacement
narrows, a reshape that merges them into a dim a matmul contracts, a chunk of them into halves) is refused at
compile time, naming the op, the core, the model's line and the fix; an op the head dim cannot be followed through
(an einsum, with that rule taken away) is refused too. Then every known core form's region, traced
from a tiny transformers model, is proved a head map: the gated delta rule (Qwen3-Next), Mamba2's SSD (Bamba), the
selective scan (Mamba), RecurrentGemma's RG-LRU and RWKV's WKV (the first three in the slow tier: each traces a
whole model).
"""

from __future__ import annotations

import pytest
import torch

import cpcompile
from cpcompile import cores
from cpcompile.testing import packed_batch, tiny_model
from tests.harness.tiers import slow
from tests.models import head_cores
from tests.models.head_cores import CoreLM

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

DOCS = [[10, 22], [5, 27]]


@pytest.fixture
def toy_cores(monkeypatch):
    """The toy cores registered as known cores of the WKV form for the test (their substitution stays inert
    outside a CP context once the test is over)."""
    monkeypatch.setattr(cores, "_REGISTERED", dict(cores._REGISTERED))
    for name in head_cores.CORES:
        monkeypatch.setitem(cores.CORES, f"{head_cores.__name__}.{name}", "wkv")
    cores.register_known_cores()


def _reports(model, group) -> list[tuple[str, str, str]]:
    backend = cpcompile.backend(group, inner="eager")
    with cpcompile.shard(packed_batch(DOCS), group) as local:
        torch.compile(model, backend=backend)(**local)
    return [(r.op, r.kind, r.action) for r in backend.mixing_reports]


def test_a_core_that_keeps_its_channels_apart_is_head_parallel(world, toy_cores):
    reports = _reports(CoreLM("channel_map"), world)
    assert reports == [("pad", "shift", "halo"), ("channel_map", "head_parallel", "head_parallel")], reports


def test_an_op_the_head_dim_cannot_be_followed_through_is_refused(world, toy_cores, monkeypatch):
    """``channel_product``'s einsum keeps the channels apart and is accepted; with the rule that follows a dim
    through an einsum taken away, the proof cannot tell what the ops after it do with the channels, and refuses."""
    from cpcompile.passes import sequence_dims

    reports = _reports(CoreLM("channel_product"), world)
    assert ("channel_product", "head_parallel", "head_parallel") in reports, reports
    torch._dynamo.reset()
    monkeypatch.setattr(sequence_dims, "_einsum_tags", lambda *a: None)
    with pytest.raises(cpcompile.UnsupportedMixingError, match="cannot follow the head dim through einsum"):
        _reports(CoreLM("channel_product"), world)


@pytest.mark.parametrize(
    "core, op, line",
    [
        ("channel_sum", "sum", "out.sum(dim=-1, keepdim=True)"),
        ("channel_einsum", "einsum", 'torch.einsum("bsc,bsd->bsd", key, out)'),
        ("channel_softmax", "softmax", "torch.softmax("),
        ("decay_sum", "sum", "time_decay.sum()"),  # the per-channel parameter narrowed to the rank's channels
        ("merged_matmul", "matmul", "pairs @ pairs.transpose(-1, -2)"),
        ("channel_halves", "chunk", ".chunk(2, dim=-1)"),
    ],
)
def test_a_core_that_mixes_channels_is_refused(world, toy_cores, core, op, line):
    with pytest.raises(cpcompile.UnsupportedMixingError) as info:
        _reports(CoreLM(core), world)
    message = str(info.value)
    assert f"cpcompile cannot run {op} at " in message, message
    assert f"inside the head-parallel region of {core}" in message, message
    assert "models/head_cores.py:" in message and line in message, message
    assert "Fix: this core mixes heads, so it cannot run head-parallel" in message, message


#: family -> the core's report (every call of it: one per layer that has it)
FAMILIES = {
    "qwen3_next": "torch_chunk_gated_delta_rule",
    "bamba": "mamba2_chunk_scan",
    "mamba": "mamba_selective_scan",
    "recurrent_gemma": "_rnn_scan",
    "rwkv": "rwkv_linear_attention",
}
#: The families traced in the fast tier (a few seconds each, and no fast parity test runs their cores); Qwen3-Next's
#: region is proved by the fast tier's parity test (tests/test_hybrids_parity.py), Bamba's and Mamba's trace longer.
FAST_FAMILIES = ("recurrent_gemma", "rwkv")


@pytest.mark.parametrize("family", [f if f in FAST_FAMILIES else pytest.param(f, marks=slow) for f in FAMILIES])
def test_every_known_core_form_is_proved_a_head_map(world, family):
    reports = _reports(tiny_model(family), world)
    assert (FAMILIES[family], "head_parallel", "head_parallel") in reports, reports
    assert all(action != "refused" for _, _, action in reports), reports
