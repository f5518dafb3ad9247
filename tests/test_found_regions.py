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
shares of the heads; a reason for one CP size leaves the function to be tried again; parity at CP=2 (balanced)
against the one-process model (logits, loss, gradients), also with 5 heads (padded to 6), with 3 groups of 6 heads
(repeated to their heads) and for the loop written as a method (``self`` passed unchanged), each with a negative
control: the found core run on each rank's own tokens must fail; a method that reads per-head rates from a
parameter of ``self`` is refused. Groups of heads: a loop whose per-token gate holds 2 groups of the 6 heads
(``grouped_heads``, repeated by ``repeat_interleave``) is found with the gate split as groups and is exact at CP=2
(with the same control); the
same loop with the groups tiled (``repeat``) is refused. Slow tier: transformers'
cores taken out of the known ones, each found and exact at CP=2 (contiguous, balanced): RWKV's WKV, Mamba's
selective scan, Qwen3-Next's gated delta rule (2 key heads for 4 value heads, as groups) and Mamba2's SSD scan (2
groups).
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


def test_grouped_heads_are_split_with_their_heads(world):
    """``k`` holds 2 groups of the 6 heads, repeated to them as ``repeat_interleave`` does: it is split with the
    heads (a rank's block of groups serves its block of heads), not gathered whole."""
    assert _compile("grouped_heads", world)[0] == ("grouped_heads", "head_parallel")
    spec = cpcompile.cores._HEAD_SPECS["tests.models.user_cores.grouped_heads"]
    assert (spec.per_token, spec.per_head, spec.gathered, spec.seq_dim, spec.head_dim) == (
        ("x", "g", "k"),
        ("decay",),
        (),
        1,
        2,
    )


def test_a_method_is_found_with_its_self_passed_unchanged(world):
    """``self.scan_method(x, g, decay)``, a method that reads a number from ``self``: found, ``self`` passed to
    each rank's run unchanged."""
    assert _compile("scan_method", world)[0] == ("scan_method", "head_parallel")
    spec = cpcompile.cores._HEAD_SPECS["tests.models.user_cores.UserMixer.scan_method"]
    assert (spec.names, spec.per_token, spec.per_head, spec.shared, spec.seq_dim, spec.head_dim) == (
        ("self", "x", "g", "decay"),
        ("x", "g"),
        ("decay",),
        (),
        1,
        2,
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
        ("tiled_groups", "not tiled_groups, as with dim 2 of ['x', 'g', 'k'] as heads, repeat combines values of"),
        ("rates_from_self", "not rates_from_self, as with dim 2 of ['x', 'g'] as heads, it reads l_self_modules_"),
    ],
)
def test_a_core_that_cannot_run_head_parallel_stays_refused(world, core, why):
    with pytest.raises(cpcompile.UnsupportedMixingError, match="picks token") as caught:
        _compile(core, world)
    assert "found no head-parallel region for this op" in str(caught.value) and why in str(caught.value)


def test_with_the_proof_bypassed_the_split_test_refuses_a_core_that_mixes_heads(world, monkeypatch):
    """The negative control of the second numerical test: with the region's proof made to accept the heads as they
    are (dim 2), the loop that adds the mean over heads to its state is still refused, by its outputs on shares of
    the heads."""
    with pytest.raises(cpcompile.UnsupportedMixingError, match="picks token"):
        _compile("heads_mixing_loop", world)  # tried (once per process): refused by the proof
    key = "tests.models.user_cores.heads_mixing_loop"
    monkeypatch.setitem(regions._TRIED, key, "probed")  # tried again: its probe notes its arguments again
    monkeypatch.setattr(_compat, "NOTING", {*_compat.NOTING, key})
    proof = regions._heads_kept
    # accepted with the heads (dim 2) only: its channels (dim 3) are tried next, which the proof refuses
    monkeypatch.setattr(regions, "_heads_kept", lambda *a: "" if a[-1] == 2 else proof(*a))
    with pytest.raises(cpcompile.UnsupportedMixingError, match="picks token") as caught:
        _compile("heads_mixing_loop", world)
    assert "differ from its outputs from all of them: it is not a map over those heads" in str(caught.value)


def test_a_reason_for_one_cp_size_leaves_the_function_to_be_tried_again(monkeypatch):
    """A function refused for a reason that holds at one CP size (:class:`regions.ForCPSize`) is refused for that
    compile only: it stays probed, its arguments noted, and is classified again at its next refusal (at CP=2, say,
    after CP=3). Any other reason is kept."""
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


def test_the_eager_tests_leave_the_module_and_the_random_state_as_they_were():
    """The tests on random inputs run a method on its own module: what the run changes in the module's attributes,
    buffers and submodules, and the global random state, comes back; a parameter changed in place is reported."""
    module = torch.nn.Linear(2, 2)
    module.register_buffer("calls", torch.zeros(1))
    module.scale = 1.0
    before = torch.get_rng_state()
    weight = module.weight.detach().clone()
    with torch.no_grad(), regions._kept([module]) as changed:
        module.calls += 1
        module.scale = 2.0
        module.extra = torch.nn.Identity()
        torch.randn(3)
    assert changed == [] and module.calls.item() == 0.0 and module.scale == 1.0 and "extra" not in module._modules
    assert torch.equal(torch.get_rng_state(), before)
    with torch.no_grad(), regions._kept([module]) as changed:
        module.weight.mul_(2.0)
    assert changed == ["the parameter weight"]
    torch.testing.assert_close(module.weight.detach(), 2.0 * weight)


def _case(
    core: str = "transposed_heads",
    layout: str = "balanced",
    heads: int = user_cores.HEADS,
    groups: int = user_cores.GROUPS,
    inner: str = "eager",
) -> ParityCase:
    from cpcompile.layouts import Workload

    return ParityCase(
        model=FACTORY,
        doc_lens=DOCS,
        expected_sites=1,
        layout=layout,
        inner=inner,
        overrides=(("core", core), ("registered", False))
        + ((("heads", heads),) if heads != user_cores.HEADS else ())
        + ((("groups", groups),) if groups != user_cores.GROUPS else ()),
        expected_mixing=((core, "head_parallel"), ("cross_entropy", "partial_sum")),
        shard_kwargs=(("workload", Workload(block_size=4)),) if layout == "balanced" else (),
    )


def _local_heads(seq_dim: int):
    """The negative control's core: each run of ``c`` tokens alone, split along the sequence dim (``seq_dim``) of
    the per-token arguments."""
    import torch.distributed as dist

    def local(original, *args, **kwargs):
        n = dist.get_world_size()
        parts = [original(*(a.chunk(n, dim=seq_dim)[piece] for a in args), **kwargs) for piece in range(n)]
        return torch.cat(parts, dim=seq_dim)

    return local


def _worker(rank: int, world: int, case: ParityCase) -> dict:
    import dataclasses

    import torch.distributed as dist

    from tests.test_hybrids_parity import _control, _run

    torch.set_num_threads(1)
    group = dist.group.WORLD
    cases = _run([case], group)  # first: this process finds the core here
    local = _local_heads(2 if dict(case.overrides)["core"] in user_cores.TRANSPOSED else 1)
    return {"cases": cases, "control": _control(dataclasses.replace(case, expected_mixing=None), group, local)}


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("core", "heads", "groups"),
    [
        ("transposed_heads", 6, 2),
        ("grouped_heads", 6, 2),
        ("scan_method", 6, 2),
        ("transposed_heads", 5, 2),
        ("grouped_heads", 6, 3),
    ],
)
def test_a_found_core_equals_one_process(core, heads, groups):
    """CP=2, balanced: the loop on ``[B, H, S, D]``, the loop with 2 groups of heads (``grouped_heads``: split with
    them), the loop written as a method (``scan_method``), the first with 5 heads (padded to 6), and the grouped
    loop with 3 groups (which the CP size does not divide: repeated to their heads)."""
    _check_parity(_case(core, heads=heads, groups=groups), 2, timeout_s=360)


def _check_parity(case: ParityCase, cp: int, timeout_s: float) -> None:
    """``case`` on ``cp`` ranks equals one process, and its control (the found core on each rank's own tokens) fails
    on the logits."""
    from tests.harness.dist import run_distributed

    per_rank = run_distributed(_worker, cp, case, timeout_s=timeout_s)
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
    run its CP=2 cases, contiguous and balanced (a refusal returned)."""
    import dataclasses

    import torch.distributed as dist

    from cpcompile import cores
    from tests.harness.parity import check_case
    from tests.test_hybrids_parity import _case
    from tests.test_recurrent_parity import _LOSS, RWKV_CP2

    torch.set_num_threads(1)
    key = {"rwkv": cores._WKV, "mamba": cores._SELECTIVE, "qwen3_next": cores._GDN, "mamba2": cores._MAMBA2,
           "recurrent_gemma": cores._RG_LRU}[family]  # fmt: skip
    key = key.format(family)
    cores.CORES.pop(key)
    if family == "rwkv":
        cases = [dataclasses.replace(c, expected_mixing=(*_RWKV_BLOCK, *_RWKV_BLOCK, _LOSS)) for c in RWKV_CP2]
    elif family == "recurrent_gemma":
        from tests.test_recurrent_parity import _case as recurrent_case

        cases = [recurrent_case(), recurrent_case(layout="balanced")]
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
@pytest.mark.parametrize("family", ["rwkv", "mamba", "qwen3_next", "mamba2", "recurrent_gemma"])
def test_a_transformers_core_left_out_of_the_registry(family):
    """transformers' cores taken out of :data:`cpcompile.cores.CORES` (in fresh ranks), each found and exact at
    CP=2, contiguous and balanced:

    * RWKV's WKV: its CPU path found (channels as heads, ``time_decay`` and ``time_first`` per-head, the state
      ``None``);
    * Mamba's selective scan: found with the channels (dim 1) as heads, the sequence at dim 2, ``A``, ``D`` and
      ``delta_bias`` per-head and ``B``, ``C`` (per token, no channels) gathered whole;
    * Qwen3-Next's gated delta rule (2 key heads, 4 value heads, which it repeats the key heads to): the value
      heads split and ``query``, ``key`` split with them as groups;
    * Mamba2's SSD scan (``n_groups`` 2 of its heads): ``B`` and ``C`` split with the heads as groups, ``A``, ``D``
      and ``dt_bias`` per-head.

    RecurrentGemma's RG-LRU scan, a method (``RecurrentGemmaRglru._rnn_scan``), is tried and refused, as it returns
    its final state (no sequence dim), which a head-parallel run cannot bring back to the ranks' tokens; the known
    core drops it under CP."""
    from tests.harness.dist import run_distributed

    per_rank = run_distributed(_family_worker, 2, family, timeout_s=840, fresh=True)
    got = per_rank[0]
    if family == "recurrent_gemma":
        assert got["cases"] == [] and got["found"] is None, got
        why = got["tried"]["transformers.models.recurrent_gemma.modeling_recurrent_gemma.RecurrentGemmaRglru._rnn_scan"]
        assert "it returns recurrent_states" in why and "not as its per-token arguments hold them" in why, why
        return
    key = {"rwkv": "rwkv.modeling_rwkv.rwkv_linear_attention_cpu", "mamba": "mamba.modeling_mamba.mamba_selective_scan",
           "qwen3_next": "qwen3_next.modeling_qwen3_next.torch_chunk_gated_delta_rule",
           "mamba2": "mamba2.modeling_mamba2.mamba2_chunk_scan"}[family]  # fmt: skip
    report(got["cases"])
    assert len(got["cases"]) == 2 and got["tried"].get(f"transformers.models.{key}") == "found", got
    expected = {
        "mamba": {"per_token": ("z", "hidden_states", "dt"), "per_head": ("D", "delta_bias", "A"),
                  "gathered": ("B", "C"), "seq_dim": 2, "head_dim": 1},
        "qwen3_next": {"per_token": ("value", "g", "beta", "query", "key"), "per_head": (), "gathered": (),
                       "seq_dim": 1, "head_dim": 2},
        "mamba2": {"per_token": ("hidden_states", "dt", "B", "C"), "per_head": ("D", "dt_bias", "A"), "gathered": (),
                   "seq_dim": 1, "head_dim": 2},
    }  # fmt: skip
    if family in expected:  # RWKV's found function is the wrapper's CPU path, not the registry's key
        found = {k: got["found"][k] for k in ("per_token", "per_head", "gathered", "seq_dim", "head_dim")}
        assert found == expected[family], found


#: Found cores at CP=3 and 4, traced by AOTAutograd and compiled by inductor, under every layout: (CP size, core,
#: inner compiler, layout). At T = 37: CP=3 pads to 39 (13 tokens a rank), CP=4 to 40. At CP=4 the 6 heads are padded
#: to 8 and the 2 groups of ``grouped_heads`` repeated to their heads; at CP=3 its 2 groups are repeated too.
MORE_RANKS = [
    (3, "grouped_heads", "aot_eager", "head_tail"),
    (3, "transposed_heads", "inductor", "contiguous"),
    (4, "grouped_heads", "inductor", "balanced"),
    (4, "scan_method", "aot_eager", "contiguous"),
]


@slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("cp", "core", "inner", "layout"), MORE_RANKS)
def test_a_found_core_at_more_ranks_equals_one_process(cp, core, inner, layout):
    _check_parity(_case(core, layout=layout, inner=inner), cp, timeout_s=840)
