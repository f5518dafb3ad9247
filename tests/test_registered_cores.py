"""A sequence mixer of the user's own code made exact under CP by :func:`cpcompile.cores.register_head_parallel`.

Model (``tests.models.user_cores``): a :class:`tests.models.tiny.TinyLM` whose mixer calls ``decayed_heads``, a
per-head linear recurrence in plain torch (6 heads of 4 channels, a per-head decay parameter, a per-token gate),
before a packed-document attention layer. T = 37 with the packed documents of tests/test_hybrids_parity.py.

``looped_heads`` is the same recurrence written as a Python loop over the tokens; ``restarting_heads`` restarts it
at every document start, which the mixer passes as a per-token argument (1.0 where the position id is 0).

Fast tier (one process, fake CP group of 2, compile time): registered, the core is reported ``head_parallel``;
not registered, the same model is refused at compile time with ``regions="registered"`` (its einsum contracts the
sequence; the loop picks a token by its index; ``tests/test_found_regions.py`` covers the default, which finds
such a core), and both refusals name the registration of the function, with its parameters, while a mixer
written in a method gets no such fix; registered, a core
that adds the mean over heads is refused naming the op; a tensor argument left out of the registration is refused
naming it; heads that the CP size does not divide are padded (5 heads at CP=2, and parity below), groups that it
does not divide are refused (6 heads in 3 groups at CP=2); bad registrations raise
``TypeError``/``ValueError`` naming the value; parity at CP=2 (contiguous, balanced; the loop and the restarting
core balanced: documents that span rank edges and start on either rank; 5 heads, padded to 6) against
the one-process model, logits, loss and gradients (the decay parameter's gradient is summed over the ranks' heads),
and a negative control: the core run on each rank's own tokens (``cores._run_core`` replaced by a call per rank
chunk) must fail. Slow tier:
parity at CP=3 (balanced; 6 heads, and 5 padded to 6). (``aot_eager`` and inductor at CP=2 were checked by hand.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cpcompile
from cpcompile import cores
from cpcompile.testing import packed_batch
from tests.harness.parity import ParityCase, report
from tests.harness.tiers import slow
from tests.models import user_cores
from tests.test_hybrids_parity import DOCS

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

FACTORY = "tests.models.user_cores:user_core_lm"
EXPECTED = (("decayed_heads", "head_parallel"), ("cross_entropy", "partial_sum"))


def _compile(model, group, **options):
    backend = cpcompile.backend(group, inner="eager", **options)
    with cpcompile.shard(packed_batch([list(d) for d in DOCS]), group) as local:
        torch.compile(model, backend=backend)(**local)
    return [(r.op, r.action) for r in backend.mixing_reports]


def test_a_registered_core_is_head_parallel(world):
    assert _compile(user_cores.user_core_lm(), world) == list(EXPECTED)


#: What the refusal of an unregistered core of the user's own code names as the fix.
REGISTER_FIX = "cpcompile.cores.register_head_parallel(tests.models.user_cores.{}, per_token=(...), per_head=(...)"


def test_the_same_core_not_registered_is_refused_naming_the_registration(world):
    """The control: without the registration the core's einsum contracts the sequence (its decay matrix built from
    an ``arange`` of the local length): refused by the positions pass, before the mixing pass sees it. Written as
    a loop over the tokens it is refused by the mixing pass (a token picked by its index). Both refusals name the
    registration of the function the op is in, with its parameters."""
    model = user_cores.user_core_lm(registered=False)
    model.mixer.core = "_decayed"  # the same recurrence, a function no one registered
    with pytest.raises(cpcompile.UnsupportedPositionError, match="einsum contracts the sequence") as caught:
        _compile(model, world, regions="registered")
    assert REGISTER_FIX.format("_decayed") in str(caught.value) and "(x, g, decay)" in str(caught.value)
    with pytest.raises(cpcompile.UnsupportedMixingError, match="picks token 0 of the sequence") as caught:
        _compile(user_cores.user_core_lm(registered=False, core="looped_heads"), world, regions="registered")
    assert REGISTER_FIX.format("looped_heads") in str(caught.value) and "(x, g, decay)" in str(caught.value)


def test_a_method_is_not_named_for_registration(world, monkeypatch):
    """A mixer in a method gets no head-parallel registration as its fix: a method cannot be registered so
    (a class's ``forward`` gets :func:`cpcompile.cores.register_replicated` instead: tests/test_replicated_layers.py;
    this ``forward``, nested in the test, is in no class)."""

    def forward(self, x, batch=None):
        u = self.inp(x).unflatten(-1, (self.heads, user_cores.HEAD_DIM))
        y = torch.stack([u[:, : t + 1].sum(1) for t in range(u.shape[1])], dim=1)
        return x + self.out(y.flatten(-2))

    monkeypatch.setattr(user_cores.UserMixer, "forward", forward)
    with pytest.raises(cpcompile.UnsupportedMixingError) as caught:
        _compile(user_cores.user_core_lm(registered=False), world, regions="registered")
    assert "register_head_parallel" not in str(caught.value), str(caught.value)


def test_a_registered_core_that_mixes_heads_is_refused(world):
    with pytest.raises(cpcompile.UnsupportedMixingError, match=r"mean.*mixed_heads|mixed_heads.*mean"):
        _compile(user_cores.user_core_lm(core="mixed_heads"), world)


def _unclassified(x, g, decay):
    return user_cores._decayed(x, g, decay)


def test_a_tensor_argument_left_out_of_the_registration_is_refused(world, monkeypatch):
    cores.register_head_parallel(_unclassified, per_token=("x",), per_head=("decay",))
    model = user_cores.user_core_lm(registered=False)
    model.mixer.core = "_unclassified"
    monkeypatch.setattr(user_cores, "_unclassified", _unclassified, raising=False)
    with pytest.raises(Exception, match="got the tensor argument 'g', which register_head_parallel did not classify"):
        _compile(model, world)


def _misregistered(x, g, decay):
    return user_cores.transposed_heads(x, g, decay)


def test_a_core_registered_with_the_wrong_dims_is_refused_naming_them(world, monkeypatch):
    """A core on ``[B, H, S, D]`` inputs registered with the default dims (``seq_dim=1``: its heads): refused while
    the graph is traced, naming ``seq_dim``, instead of failing in the core's code on exchanged shapes."""
    cores.register_head_parallel(_misregistered, per_token=("x", "g"), per_head=("decay",))
    model = user_cores.user_core_lm(registered=False)
    model.mixer.core = "_misregistered"
    monkeypatch.setattr(user_cores, "_misregistered", _misregistered, raising=False)
    monkeypatch.setattr(user_cores, "TRANSPOSED", frozenset({"_misregistered"}))
    with pytest.raises(Exception, match=r"with 6 along seq_dim=1, but this rank holds 19 tokens .* seq_dim") as caught:
        _compile(model, world)
    assert "ValueError" in str(caught.value), str(caught.value)  # raised while tracing, as the cores' refusals are


def test_heads_the_cp_size_does_not_divide_are_padded(world):
    """5 heads at CP=2: run as 6, the sixth of zeros (its outputs cut off; parity below)."""
    assert _compile(user_cores.user_core_lm(heads=5), world) == list(EXPECTED)


def test_groups_the_cp_size_does_not_divide_are_refused(world):
    """6 heads in 3 groups at CP=2, registered: repeated to the heads, the function's own pairing would be out of
    the proof's sight (a found function's is tested instead: ``tests/test_found_regions.py``)."""
    model = user_cores.user_core_lm(core="registered_groups", heads=6, groups=3)
    with pytest.raises(Exception, match=r"has 3 groups of heads \(dim 2 of 'k'\) for 6 heads, which the CP size 2"):
        _compile(model, world)


def test_the_restarting_core_restarts_at_document_starts():
    """One process: ``restarting_heads`` equals ``decayed_heads`` on the first document's tokens and differs after
    the second document starts (so that its parity under CP shows the starts reach every head's whole sequence)."""
    torch.manual_seed(0)
    x, g, decay = torch.randn(1, 12, 6, 4), torch.randn(1, 12, 6), torch.linspace(-1.0, 2.0, 6)
    starts = torch.zeros(1, 12, 6)
    starts[:, [0, 5]] = 1.0
    restarted, carried = user_cores.restarting_heads(x, g, decay, starts), user_cores.decayed_heads(x, g, decay)
    torch.testing.assert_close(restarted[:, :5], carried[:, :5])
    assert (restarted[:, 5:] - carried[:, 5:]).abs().max() > 0.1


def _two_args(a, b=1):
    return a


def _star(*a):
    return a


def test_bad_registrations_name_the_value():
    with pytest.raises(TypeError, match="module-level Python function"):
        cores.register_head_parallel(torch.sin, per_token=("x",))
    with pytest.raises(TypeError, match=r"\*args or positional-only"):
        cores.register_head_parallel(_star, per_token=("a",))
    with pytest.raises(ValueError, match=r"per_token=\('q',\) names \['q'\], not parameters of _two_args"):
        cores.register_head_parallel(_two_args, per_token=("q",))
    with pytest.raises(ValueError, match="named in two of"):
        cores.register_head_parallel(_two_args, per_token=("a",), shared=("a",))
    with pytest.raises(ValueError, match="per_token is empty"):
        cores.register_head_parallel(_two_args, per_token=())
    with pytest.raises(ValueError, match="seq_dim=1, head_dim=1"):
        cores.register_head_parallel(_two_args, per_token=("a",), head_dim=1)
    cores.register_head_parallel(user_cores.decayed_heads, **user_cores.REGISTRATION)  # again, the same: no-op
    with pytest.raises(ValueError, match="is registered already"):
        cores.register_head_parallel(user_cores.decayed_heads, per_token=("x", "g"), shared=("decay",))


# -- CP=2 and 3 against one process ------------------------------------------------------------------------------


def _case(
    layout: str = "contiguous",
    core: str = "decayed_heads",
    heads: int = user_cores.HEADS,
    groups: int = user_cores.GROUPS,
) -> ParityCase:
    from cpcompile.layouts import Workload

    return ParityCase(
        model=FACTORY,
        doc_lens=DOCS,
        expected_sites=1,
        layout=layout,
        overrides=((("core", core),) if core != "decayed_heads" else ())
        + ((("heads", heads),) if heads != user_cores.HEADS else ())
        + ((("groups", groups),) if groups != user_cores.GROUPS else ()),
        expected_mixing=((core, "head_parallel"), EXPECTED[1]),
        shard_kwargs=(("workload", Workload(block_size=4)),) if layout == "balanced" else (),
    )


#: ``looped_heads``: the same recurrence as a Python loop over the tokens, registered as its refusal says;
#: ``restarting_heads``: restarted at document starts, which it takes as a per-token argument.
CP2 = [
    _case(),
    _case("balanced"),
    _case("balanced", "looped_heads"),
    _case("balanced", "restarting_heads"),
    _case("balanced", heads=5),
]
#: 5 heads: padded to 6 at CP=3 as at CP=2.
CP3 = [_case("balanced"), _case("balanced", heads=5)]


def _worker(rank: int, world: int, cases: list, control: bool) -> dict:
    import torch.distributed as dist

    from tests.test_hybrids_parity import _control, _local_core, _run

    torch.set_num_threads(1)
    group = dist.group.WORLD
    out = {"cases": _run(cases, group)}
    if control:
        out["control"] = _control(dataclasses.replace(cases[0], expected_mixing=None), group, _local_core)
    return out


@pytest.mark.timeout(660)
@pytest.mark.parametrize("cp", [2, pytest.param(3, marks=slow)])
def test_a_registered_core_equals_one_process(cp):
    from tests.harness.dist import run_distributed

    cases = CP2 if cp == 2 else CP3
    per_rank = run_distributed(_worker, cp, cases, cp == 2, timeout_s=600)
    summaries = per_rank[0]["cases"]
    report(summaries)
    assert [s["case"] for s in summaries] == [c.name for c in cases]
    if cp == 2:
        for mine in per_rank:
            control = mine["control"]
            print(f"\ncontrol (the core on each rank's own tokens): {control}")
            assert control["caught"] and "logits" in control["failing"], control
