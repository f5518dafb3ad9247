"""A layer whose scan is inline in its ``forward``, made exact under CP by :func:`cpcompile.cores.register_replicated`.

Model (``tests.models.user_cores.inline_forward_lm``): a :class:`tests.models.tiny.TinyLM` whose mixer
(:class:`~tests.models.user_cores.InlineMixer`) projects the embeddings to 6 heads of 4 channels, runs a per-head
decayed recurrence as a Python loop over the tokens written in its ``forward``, normalises across the heads (RMS
norm of all 24 channels: no share of the heads can run it) and projects back, before a packed-document attention
layer. T = 37 with the packed documents of tests/test_hybrids_parity.py: at CP=2 the padded sequence holds one
padding token, at CP=3 and 4 two and three.

Fast tier (one process, fake CP group of 2, compile time): not registered, the layer is refused, naming the
class's ``forward``, the move of the loop into a function and the registration (run first: a registration is
process-wide); registered, it is reported ``replicated``; a tensor argument left out of the registration, a
returned tensor without the sequence and a ``seq_dim`` that is not the sequence's are refused naming them; bad
registrations raise ``TypeError``/``ValueError`` naming the value. Parity at CP=2 (contiguous, balanced) against
the one-process model (logits, loss, gradients, and the all-to-all bytes the mixing report gives against those the
step moved), and a negative control: the layer run on each rank's own tokens must fail. Slow tier: CP=3 and 4
(balanced, head_tail; aot_eager and inductor).
"""

from __future__ import annotations

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

FACTORY = "tests.models.user_cores:inline_forward_lm"
KEY = "tests.models.user_cores.InlineMixer.forward"
EXPECTED = (("forward", "replicated"), ("cross_entropy", "partial_sum"))


def _compile(model, group, **options):
    backend = cpcompile.backend(group, inner="eager", **options)
    with cpcompile.shard(packed_batch([list(d) for d in DOCS]), group) as local:
        torch.compile(model, backend=backend)(**local)
    return [(r.op, r.action) for r in backend.mixing_reports]


def test_a_layer_not_registered_is_refused_naming_its_forward(world):
    """The control of the registration; first in this file, before any test registers the layer in this process."""
    assert KEY not in cores.registered_cores(), "run this test before the registration (it is process-wide)"
    with pytest.raises(cpcompile.UnsupportedMixingError, match="picks token 0 of the sequence") as caught:
        _compile(user_cores.inline_forward_lm(registered=False), world)
    message = str(caught.value)
    assert f"the op is inline in {KEY}: move the loop" in message, message
    assert f"cpcompile.cores.register_replicated({KEY}, per_token=(...), shared=(...))" in message, message
    assert "(x, batch)" in message and "register_head_parallel" not in message, message


def test_a_registered_layer_is_replicated(world):
    assert _compile(user_cores.inline_forward_lm(), world) == list(EXPECTED)


def _returns_state(x, scale):
    return x * scale, x.sum(dim=1)[:, 0]  # a per-token value, and one without the sequence


def _scaled(x, scale):
    return x * scale


def _misregistered(x, scale):
    return x * scale


class _Calls(torch.nn.Module):
    """A mixer calling a module-level function registered with :func:`cpcompile.cores.register_replicated`."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, x, batch=None):
        out = self.fn(x, self.scale)
        return out[0] if isinstance(out, tuple) else out


def _lm(mixer):
    from tests.models.attention import sdpa
    from tests.models.tiny import TinyLM, seeded

    return seeded(lambda: TinyLM([sdpa("packed_docs")], hidden=32, mixer=mixer))


def test_a_tensor_argument_left_out_a_value_without_the_sequence_and_a_wrong_seq_dim_are_refused(world):
    cores.register_replicated(_scaled, per_token=("x",))
    with pytest.raises(Exception, match="got the tensor argument 'scale', which register_replicated did not classify"):
        _compile(_lm(_Calls(_scaled)), world)
    cores.register_replicated(_returns_state, per_token=("x",), shared=("scale",))
    with pytest.raises(Exception, match=r"replicated layer .*_returns_state .* returned a tensor of 1 dims"):
        _compile(_lm(_Calls(_returns_state)), world)
    cores.register_replicated(_misregistered, per_token=("x",), shared=("scale",), seq_dim=2)  # x is [B, S, 32]
    wrong_dim = r"with 32 along seq_dim=2, but this rank holds 19 tokens .*cores.register_replicated"
    with pytest.raises(Exception, match=wrong_dim):
        _compile(_lm(_Calls(_misregistered)), world)


def _star(*x):
    return x


def test_bad_registrations_name_the_value():
    def nested(x):
        return x

    with pytest.raises(TypeError, match="nested"):
        cores.register_replicated(nested, per_token=("x",))
    with pytest.raises(TypeError, match=r"\*args"):
        cores.register_replicated(_star, per_token=("x",))
    with pytest.raises(ValueError, match=r"\['y'\], not parameters of _scaled"):
        cores.register_replicated(_scaled, per_token=("y",))
    with pytest.raises(ValueError, match="seq_dim=-1"):
        cores.register_replicated(_scaled, per_token=("x",), seq_dim=-1)
    with pytest.raises(ValueError, match="per_token is empty"):
        cores.register_replicated(_scaled, per_token=())
    cores.register_replicated(_scaled, per_token=("x",))  # the registration of the test above, again: nothing
    with pytest.raises(ValueError, match="registered already"):
        cores.register_replicated(_scaled, per_token=("x",), shared=("scale",))


# -- CP=2, 3 and 4 against one process ---------------------------------------------------------------------------


def _case(layout: str = "contiguous", inner: str = "eager") -> ParityCase:
    from cpcompile.layouts import Workload

    return ParityCase(
        model=FACTORY,
        doc_lens=DOCS,
        expected_sites=1,
        layout=layout,
        inner=inner,
        expected_mixing=EXPECTED,
        shard_kwargs=(("workload", Workload(block_size=4)),) if layout == "balanced" else (),
    )


CP2 = [_case(), _case("balanced")]
MORE = {3: [_case("balanced"), _case("head_tail", "inductor")], 4: [_case("balanced", "aot_eager"), _case("head_tail")]}


@pytest.mark.timeout(660)
@pytest.mark.parametrize("cp", [2, pytest.param(3, marks=slow), pytest.param(4, marks=slow)])
def test_a_replicated_layer_equals_one_process(cp):
    from tests.harness.dist import run_distributed
    from tests.test_registered_cores import _worker  # the cases, then the control on the first one

    cases = CP2 if cp == 2 else MORE[cp]
    per_rank = run_distributed(_worker, cp, cases, cp == 2, timeout_s=600)
    summaries = per_rank[0]["cases"]
    report(summaries)
    assert [s["case"] for s in summaries] == [c.name for c in cases]
    for s in summaries:  # the bytes the report gives per call, against those the step received (one call a step)
        reported, moved = s["heads_bytes"]
        assert reported == moved > 0, s
    if cp == 2:
        for mine in per_rank:
            control = mine["control"]
            print(f"\ncontrol (the layer on each rank's own tokens): {control}")
            assert control["caught"] and "logits" in control["failing"], control
