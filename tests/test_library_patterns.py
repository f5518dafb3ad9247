"""Plain calls of model code from libraries outside transformers that the mixing and attention passes must accept,
each next to the pattern of the same rule they must refuse. One process, fake CP group of 2 (what is decided at
compile time); exact at CP=2 and CP=4: ``tests/test_library_patterns_parity.py``.

Models: :mod:`tests.models.libraries` (nanoGPT's mean cross-entropy; RoPE over passed positions in the spellings of
x-transformers, IBM fms and rotary-embedding-torch) and the head-broadcast mask forms of
:mod:`tests.models.attention`.
"""

from __future__ import annotations

import os

import pytest
import torch

import cpcompile
from cpcompile.passes import vocabulary as vocab
from cpcompile.testing import packed_batch
from tests.models import libraries
from tests.models.attention import attention_lm
from tests.models.positions import package_missing

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

DOCS = [[10, 22], [5, 27]]
LOSS = ("cross_entropy", "partial_sum")


def _run(model, group, *, targets: bool = False, graphs: list | None = None):
    backend = cpcompile.backend(group, inner="eager")

    def keep(gm, example_inputs):
        out = backend(gm, example_inputs)
        if graphs is not None:
            graphs.append(gm)
        return out

    batch, pads = packed_batch(DOCS), None
    if targets:  # nanoGPT's Y; padding gets its ignore index
        batch.update(libraries.nanogpt_targets(batch))
        pads = {"targets": libraries.NANOGPT_IGNORE}
    with cpcompile.shard(batch, group, pad_values=pads) as local:
        out = torch.compile(model, backend=keep)(**local)
    return backend, out


def _mixing(backend):
    return [(r.op, r.action) for r in backend.mixing_reports]


# -- a mean cross-entropy over tokens inside the model ---------------------------------------------------------
@pytest.mark.parametrize(
    "form, expected",
    [
        ("mean", [("cross_entropy", "mean_share")]),
        # loss / accumulation steps + a z-loss summed over tokens: shares and partial sums added
        ("mean_scaled", [("cross_entropy", "mean_share"), ("sum", "partial_sum")]),
    ],
)
def test_mean_cross_entropy_is_this_ranks_share(world, form, expected):
    """nanoGPT's ``F.cross_entropy(..., ignore_index=-1)``: the loss summed over this rank's tokens, divided by the
    targets that are not -1 on every rank (one int64 all-gathered per rank)."""
    graphs = []
    backend, out = _run(libraries.nanogpt_lm(form=form), world, targets=True, graphs=graphs)
    assert _mixing(backend) == expected
    assert torch.isfinite(out.loss)
    (graph,) = graphs
    code = graph.code
    assert "reduction = 'sum'" in code and "all_gather_seq" in code, code


def test_mean_cross_entropy_ignores_padding_whatever_its_target(world):
    """A rank that holds padding (rank 0 under ``head_tail``: the last piece of the row), with shard's default
    padding of the targets (-100, which nanoGPT's ``ignore_index=-1`` does not ignore and cross_entropy rejects):
    the rewrite makes the padding's targets -1."""
    backend = cpcompile.backend(world, inner="eager")
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return backend(gm, example_inputs)

    batch = packed_batch([[10, 21], [5, 26]])  # T = 31: one padding token, the last of the row
    batch.update(libraries.nanogpt_targets(batch))
    with cpcompile.shard(batch, world, layout="head_tail") as local:
        assert (local["targets"][:, -1] == -100).all()
        out = torch.compile(libraries.nanogpt_lm(), backend=keep)(**local)
    assert _mixing(backend) == [("cross_entropy", "mean_share")] and torch.isfinite(out.loss)
    assert "cpcompile.real_tokens" in graphs[0].code


@pytest.mark.parametrize(
    "form, words",
    [
        # the negative control: a mean over this rank's tokens used inside the forward
        ("mean_in_forward", "averages over this rank's tokens only: its result is used by mul"),
        ("weighted", "its class weights make the mean's denominator a sum of the targets' weights"),
    ],
)
def test_mean_cross_entropy_that_is_not_a_loss_share_is_refused(world, form, words):
    with pytest.raises(cpcompile.UnsupportedMixingError, match="cannot run cross_entropy") as info:
        _run(libraries.nanogpt_lm(form=form), world, targets=True)
    assert words in str(info.value), str(info.value)
    assert "models/libraries.py" in str(info.value)


# -- reductions over positions the model is given ---------------------------------------------------------------
@pytest.mark.parametrize("form", ["xtransformers", "fms"])
def test_dead_reduction_over_positions_is_not_refused(world, form):
    """x-transformers' ``max_pos = t.max() + 1`` (never read without xpos) and fms's ``torch.max(position_ids[:,
    0])`` (read by a function that ignores it): code Dynamo keeps that changes no result."""
    backend, out = _run(libraries.rope_lm(form=form), world)
    assert _mixing(backend) == [LOSS]
    assert [r.action for r in backend.reports] == ["rewritten", "rewritten"]
    assert torch.isfinite(out.logits).all()


def test_max_over_positions_read_by_every_token_is_refused(world):
    """The negative control: with xpos, ``max_pos`` sets the scale of every token's rotation."""
    with pytest.raises(cpcompile.UnsupportedMixingError, match=r"cannot run max at layers\.0\.attn.*max along the seq"):
        _run(libraries.rope_lm(form="xtransformers_xpos"), world)


# -- einsum read dim by dim -----------------------------------------------------------------------------------
def test_ellipsis_einsum_outer_product_is_not_refused(world):
    """rotary-embedding-torch: ``einsum('..., f -> ... f', t, freqs)`` over passed positions contracts nothing."""
    backend, _ = _run(libraries.rope_lm(form="rotary_torch"), world)
    assert _mixing(backend) == [LOSS]


@pytest.mark.parametrize(
    "eq, ranks, read",
    [
        ("..., f -> ... f", [2, 1], (["YZ", "f"], "YZf")),
        ("b i , j -> b i j", [2, 1], (["bi", "j"], "bij")),
        ("...d,...d->...", [3, 3], (["YZd", "YZd"], "YZ")),
        ("...f", [2], (["Zf"], "Zf")),
        ("..., f", [2], None),  # two terms, one operand
        (3, [1], None),
    ],
)
def test_einsum_subscripts(eq, ranks, read):
    """The one reading of an einsum both passes use: ``...`` as spare letters, right-aligned."""
    assert vocab.einsum_subscripts(eq, ranks) == read


def test_ellipsis_einsum_that_contracts_the_sequence_is_refused(world):
    """The negative control: ``einsum('...td,...td->...d')`` sums over the tokens."""

    class Pool(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = libraries.rope_lm(form="rotary_torch")

        def forward(self, input_ids, **kwargs):
            out = self.inner(input_ids, **kwargs)
            hidden = out.logits
            out.logits = hidden + torch.einsum("...td,...td->...d", hidden, hidden)[:, None]
            return out

    with pytest.raises(cpcompile.UnsupportedMixingError, match=r"cannot run einsum.*einsum contracts the sequence"):
        _run(Pool(), world)


# -- one mask for every head ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "form", ["head_expanded", "head_expand_causal", "head_repeat", "head_einops", "head_none_expand"]
)
def test_mask_broadcast_to_every_head_is_rewritten(world, form):
    """x-transformers' ``mask.expand(B, H, T, T) & ~causal_mask`` and the other spellings: the site gets the mask
    without the heads dim and the attention is rewritten (not refused as a per-head mask)."""
    backend, _ = _run(attention_lm(form), world)
    assert [r.action for r in backend.reports] == ["rewritten", "rewritten"]
    assert {r.mask_form for r in backend.reports} == {"bool-mask"}


@pytest.mark.parametrize("form", ["head_windows", "head_written"])
def test_per_head_mask_is_refused(world, form):
    """The negative controls: a window that differs per head; a broadcast mask whose head 0 is then written in
    place (``mask[:, 0] = causal``), which a copy of its ops without the heads dim would miss."""
    with pytest.raises(cpcompile.UnsupportedAttentionError, match=r"per-head masks are not supported"):
        _run(attention_lm(form), world)


def test_narrow_of_part_of_the_sequence_is_refused(world):
    """The negative control of fms's whole-dim ``narrow`` (accepted in the ``fms`` form above): ``narrow(1, 1, T -
    1)`` picks tokens by their local index."""

    class Narrow(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = libraries.rope_lm(form="fms")

        def forward(self, input_ids, **kwargs):
            out = self.inner(input_ids, **kwargs)
            T = out.logits.size(1)
            out.logits = out.logits + torch.nn.functional.pad(out.logits.narrow(1, 1, T - 1), (0, 0, 0, 1))
            return out

    with pytest.raises(cpcompile.UnsupportedMixingError, match=r"cannot run narrow.*narrow picks tokens"):
        _run(Narrow(), world)


# -- the real packages (optional test dependencies) -------------------------------------------------------------
#: rotary-embedding-torch and ibm-fms are optional test dependencies, installed by scripts/setup.sh: these tests
#: skip without them, except under CI (``CI`` set, as ``.ci/run`` runs), where a missing package fails them.
def _needs(package: str):
    missing = package_missing(package)
    return pytest.mark.skipif(missing is not None and not os.environ.get("CI"), reason=str(missing))


@_needs("rotary_embedding_torch")
def test_rotary_embedding_torch_with_positions_is_not_refused(world):
    backend, out = _run(libraries.rotary_torch_lm(), world)
    assert _mixing(backend) == [LOSS] and [r.action for r in backend.reports] == ["rewritten", "rewritten"]
    assert torch.isfinite(out.logits).all()


@_needs("fms")
def test_ibm_fms_llama_with_position_ids_is_not_refused(world):
    backend, out = _run(libraries.fms_lm(), world)
    assert _mixing(backend) == [LOSS] and [r.action for r in backend.reports] == ["rewritten", "rewritten"]
    assert torch.isfinite(out.logits).all()
