"""flex_attention sites under CP: the kernel with mask_mod/score_mod, the reference models, parity, refusals.

* In one process: the CPU kernel (``cpcompile::flex_cp_attention``) against fp64 dense attention with the same
  mods (forward, backward, the logsumexp's gradient, GQA, keys in any order, padding); flex_attention itself
  (forward only: CPU flex has no backward) against the dense reference every parity test compares with; the
  refusals, with a fake CP group of 2 (nothing is communicated before a compile-time refusal).
* ONE spawned group of 4 gloo processes runs every parity case (``tests.models.flex``: a torchtitan-style
  document BlockMask, a sliding window, soft-capping plus an ALiBi-style bias with the logsumexp; K/V with
  fewer heads; transformers' flex path, ``attn_implementation="flex_attention"``, on the tiny Llama (dense),
  Qwen3-MoE (MoE), LFM2 (hybrid: a short conv layer, then attention) and Gemma 3 (sliding-window and global
  layers)). T = 37 is not a multiple of 2 or 4; documents cross chunk edges. CP=2 on ranks {0, 1}
  (contiguous layout: document, soft-capping, Llama, Qwen3-MoE) and on {2, 3} (balanced layout, aot_eager:
  sliding window, LFM2), then CP=4 on all four (balanced layout, every rank holds several runs of tokens:
  soft-capping, Gemma 3). torchtitan's Llama 3 on its default FlexAttention runs twice: with its masks built in
  the forward (CP=2, balanced) and as its trainer runs it, with its default masks built outside the model for
  the whole batch and passed through ``shard`` (CP=2 contiguous with two rows; CP=4 balanced with one row, over
  packed rows of changing length). The one-process reference is the same weights with an equivalent SDPA mask
  (explicit softmax where a score_mod or the logsumexp is needed; transformers' own SDPA path), since CPU flex
  cannot train.
* The fast tier runs the hand-written document and sliding-window forms, transformers' LFM2 (its packed-sequence
  ids, and its conv in the mixed graph) and the eager document ids at CP=2; soft-capping at CP=2 (its score_mod
  and logsumexp: the kernel's tests in one process in the fast tier), transformers' Llama and Qwen3-MoE,
  torchtitan's models and CP=4 are the slow tier.
* Document ids made in eager code from one rank's tokens (``document_eager``, CP=2): refused at run time on each
  rank, and wrong (parity fails) with the check told every tensor is exact.
* Negative controls, each must fail the parity check: the mask_mod evaluated at this rank's local query indices
  (as the model would see them without the rewrite; hand-written models and torchtitan's trainer masks);
  transformers' packed-sequence ids computed from this rank's tokens only; LFM2's conv unseen in the mixed
  graph after the BlockMask's graph break.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch

import cpcompile
from cpcompile.kernels import FlexMods, flex_cp_attention, register_flex_mods
from cpcompile.testing import packed_batch
from tests.harness.dist import run_distributed
from tests.harness.parity import ParityCase
from tests.harness.tiers import runs_slow, slow
from tests.harness.tolerances import KERNEL_TOL, LOGITS_TOL
from tests.models import flex as _flex_models

DOCS = ((10, 20, 7), (5, 30, 2))
#: The spawned group's fixture runs inside its first test: a limit that only cuts a hang (4 processes compiling on
#: 2 shared cores, next to another file's group under ``-n 2``).
pytestmark = pytest.mark.timeout(660)


# -- the kernel ------------------------------------------------------------------------------------------------
def test_kernel_matches_dense_attention_with_mods():
    torch.manual_seed(0)
    B, H, Hkv, T, D, valid = 2, 4, 2, 40, 8, 38  # tokens 38, 39 are padding
    doc = torch.tensor([[0] * 13 + [1] * 20 + [2] * 7, [0] * 25 + [1] * 15])

    def mask_mod(b, h, q, kv):
        return (kv <= q) & (doc[b, q] == doc[b, kv]) & (kv > q - 9)

    def score_mod(s, b, h, q, kv):
        return 2 * torch.tanh(s / 2) + 0.1 * h

    register_flex_mods("test_flex:kernel", FlexMods(mask_mod, score_mod))
    q, k, v = (torch.randn(B, h, T, D, dtype=torch.float64, requires_grad=True) for h in (H, Hkv, Hkv))
    q_pos, perm = torch.arange(10, 30), torch.randperm(T)  # local queries; keys in any order
    out, lse = flex_cp_attention(
        *(t.float() for t in (q[:, :, q_pos], k[:, :, perm], v[:, :, perm])),
        q_pos,
        perm,
        torch.tensor(valid),
        "test_flex:kernel",
        block_q=8,
        block_k=8,
    )
    i = torch.arange(T)
    mask = torch.stack([mask_mod(b, 0, i[:, None], i[None, :]) for b in range(B)])[:, None] & (i < valid)
    s = q @ k.repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(D)
    s = score_mod(s, None, torch.arange(H)[:, None, None], None, None).masked_fill(~mask, -math.inf)
    ref, ref_lse = (torch.softmax(s, -1) @ v.repeat_interleave(2, 1))[:, :, q_pos], torch.logsumexp(s, -1)[:, :, q_pos]
    torch.testing.assert_close(out.double(), ref, **KERNEL_TOL)
    torch.testing.assert_close(lse.double(), ref_lse, **KERNEL_TOL)
    g, gl = torch.randn_like(ref), torch.randn_like(ref_lse)
    got = torch.autograd.grad((out * g).sum() + (lse * gl).sum(), (q, k, v))
    want = torch.autograd.grad((ref * g).sum() + (ref_lse * gl).sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **KERNEL_TOL)


# -- the reference models --------------------------------------------------------------------------------------
@pytest.mark.parametrize("form", _flex_models.FORMS)
def test_flex_equals_the_dense_reference_forward(form):
    """flex_attention itself (no grad: CPU flex has no backward) gives the logits of the SDPA-mask reference."""
    flex = _flex_models.flex_lm(form, impl="flex")
    ref = copy.deepcopy(flex)
    for layer in ref.layers:
        layer.attn.impl = "reference"
    batch = packed_batch([list(r) for r in DOCS], seed=1)
    with torch.no_grad():
        torch.testing.assert_close(flex(**batch).logits, ref(**batch).logits, **LOGITS_TOL)


# -- refusals (fake CP group of 2) -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "form, words",
    [
        ("dense_mask", "local sequence length on several dims"),
        ("learned_bias", "reads a tensor that requires grad"),
    ],
)
@pytest.mark.usefixtures("fresh_dynamo")
def test_unmappable_mods_are_refused_at_compile_time(world, form, words):
    backend = cpcompile.backend(world, inner="aot_eager")
    compiled = torch.compile(_flex_models.flex_lm(form, layers=1), backend=backend)
    before = dict(cpcompile.passes.counters)
    with cpcompile.shard(packed_batch([list(r) for r in DOCS]), world) as local:
        with pytest.raises(cpcompile.UnsupportedAttentionError) as info:
            compiled(**local)
    message = str(info.value)
    assert "layers.0.attn" in message and "models/flex.py:" in message and words in message, message
    assert cpcompile.passes.counters["flex_refused"] - before.get("flex_refused", 0) == 1


@pytest.mark.usefixtures("fresh_dynamo")
def test_torchtitan_masks_built_in_the_forward_are_refused_with_the_fix(world):
    """torchtitan's default masks built inside the compiled forward from a rank's positions (its efficient
    document mask fills a table with the local length and scatters by document id): refused at compile time,
    naming the fix in torchtitan's terms (build them outside on the global batch and pass them to ``shard``)."""
    backend = cpcompile.backend(world, inner="aot_eager")
    compiled = torch.compile(_flex_models.torchtitan_masks_in_forward(), backend=backend)
    with cpcompile.shard(packed_batch([list(r) for r in DOCS]), world) as local:
        with pytest.raises((cpcompile.UnsupportedPositionError, cpcompile.UnsupportedMixingError)) as info:
            compiled(**local)
    message = str(info.value)
    assert "get_attention_masks" in message and "before cpcompile.shard" in message, message


@pytest.mark.usefixtures("fresh_dynamo")
def test_torchtitan_varlen_attention_is_refused_naming_its_flex_path(world):
    """torchtitan's ``VarlenAttention`` (``attn_backend="varlen"``, masks as ``VarlenMetadata`` built outside):
    a custom attention op cpcompile does not rewrite, refused at compile time with torchtitan's flex path as the
    fix, not with the per-token listing offered for other custom ops (which would make it silently wrong)."""
    from tests.models.positions import torchtitan_llama3_model

    model = torchtitan_llama3_model(seed=0, layers=1, max_len=128, flex=False, varlen=True)
    batch = packed_batch([list(r) for r in DOCS])
    batch["attention_masks"] = model.get_attention_masks(batch["position_ids"])
    compiled = torch.compile(model, backend=cpcompile.backend(world, inner="aot_eager"))
    with cpcompile.shard(batch, world, hf_kwargs=False) as local:
        with pytest.raises(cpcompile.UnsupportedMixingError) as info:
            compiled(local["input_ids"], positions=local["position_ids"], attention_masks=local["attention_masks"])
    message = str(info.value)
    assert "_varlen_attn" in message and "VarlenAttention" in message and "attn_backend='flex'" in message, message
    assert "per_token_ops" not in message, message


# -- parity (one spawned group of 4) ---------------------------------------------------------------------------
def _case(form: str, layout: str = "contiguous", inner: str = "eager", backend_kwargs: tuple = ()) -> ParityCase:
    # one attention layer: the cost of these cases is compiling flex's BlockMask construction in every rank
    return ParityCase(
        model=f"tests.models.flex:{form}",
        doc_lens=DOCS,
        inner=inner,
        layout=layout,
        overrides=(("layers", 1),),
        backend_kwargs=backend_kwargs,
    )


def _hf_case(family: str, layers: int = 1, layout: str = "contiguous", backend_kwargs: tuple = ()) -> ParityCase:
    """transformers' flex path: the family's tiny model with ``attn_implementation="flex_attention"``."""
    return ParityCase(
        model="tests.models.flex:hf_flex",
        doc_lens=DOCS,
        inner="aot_eager",
        layout=layout,
        overrides=(("family", family), ("num_hidden_layers", layers)),
        backend_kwargs=backend_kwargs,
    )


#: CP=2 cases of the fast tier (``PAIR0``, ``PAIR1``) and those the slow tier adds (``*_SLOW``): transformers' flex path
#: on more families, torchtitan's models, and CP=4.
PAIR0 = [_case("document"), _case("document_eager")]
#: soft-capping; transformers' Llama: its packed-sequence ids made on the whole sequence, as LFM2's in ``PAIR1`` are
PAIR0_SLOW = [_case("softcap"), _hf_case("llama"), _hf_case("qwen3_moe")]
#: Cases refused at run time on every rank (the document ids were made in eager code from one rank's tokens).
REFUSED_AT_RUN_TIME = ("tests.models.flex:document_eager",)
#: torchtitan's Llama 3 on its default FlexAttention (a test dependency, installed by scripts/setup.sh).
TORCHTITAN = ParityCase(model="tests.models.flex:torchtitan_flex", doc_lens=DOCS, inner="aot_eager", layout="balanced")
#: The same model called as torchtitan's trainer calls it: its default masks (the efficient packed-document
#: mask_mod) built outside the model for the whole global batch and passed in the batch ``shard`` slices.
TORCHTITAN_TRAINER = ParityCase(
    model="tests.models.flex:torchtitan_trainer",
    doc_lens=DOCS,
    inner="aot_eager",
    batch_extras="tests.models.flex:torchtitan_trainer_masks",
)
PAIR0_SLOW += [TORCHTITAN_TRAINER]
PAIR1 = [_case("sliding", "balanced", "aot_eager"), _hf_case("lfm2", 2, "balanced")]
PAIR1_SLOW = [TORCHTITAN]
CP4 = [_case("softcap", "balanced"), _hf_case("gemma3", 2, "balanced")]
#: Seconds the spawned group may take (4 processes compiling on 2 shared cores).
TIMEOUT_S = 600.0


def _local_query_indices(rank: int, chunk: int):
    """The negative control: the mods see this rank's queries at local indices (``q_pos - rank * chunk`` in the
    contiguous layout), as the model's own mask would without the rewrite."""
    from cpcompile.kernels import flex_mods

    original = flex_mods.BoundMods._indices

    def local(self, b, q_pos, kv_pos):
        bi, h, qi, ki = original(self, b, q_pos, kv_pos)
        return bi, h, qi - rank * chunk, ki

    return original, local


@contextlib.contextmanager
def _patched(owner: object, name: str, value: object):
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _control(case: ParityCase, group):
    """The negative control of ``case`` (a context), or ``None``.

    * a hand-written flex model, and torchtitan's masks built outside the model (its trainer's call): the mods
      see this rank's queries at local indices;
    * transformers' llama and torchtitan's Llama 3 with its masks built in the forward: the document ids
      (transformers: ``diff`` and ``cumsum`` of ``position_ids``; torchtitan: ``cumsum`` of the document starts)
      are computed from this rank's tokens only, as without the mixing pass's regions;
    * transformers' LFM2: the mixing pass reads a mixed graph (hidden states of the constant local length, mask
      tensors with its symbol) by the symbols only, so it does not see the conv of the graph after the mask's
      graph break.
    """
    import torch.distributed as dist

    from cpcompile.kernels import flex_mods
    from cpcompile.passes import mixing

    overrides = dict(case.overrides)
    if case.model == TORCHTITAN.model:
        overrides["family"] = "llama"  # the same control: document ids from this rank's tokens
    elif not case.model.endswith("hf_flex"):
        if case.layout != "contiguous":
            return None
        chunk = -(-sum(DOCS[0]) // dist.get_world_size(group))
        _, local = _local_query_indices(dist.get_rank(group), chunk)
        return _patched(flex_mods.BoundMods, "_indices", local)
    if overrides["family"] == "llama":
        check_op = mixing.check_op

        def local_ids(op, data, *rest):
            return ("per_token", "") if op.kind in ("shift", "scan") else check_op(op, data, *rest)

        return _patched(mixing, "check_op", local_ids)
    if overrides["family"] == "lfm2":
        sequence_length = mixing.sequence_length
        return _patched(mixing, "sequence_length", lambda gm, chunk_len, mixed=False: sequence_length(gm, chunk_len))
    return None


def _every_tensor_exact(context, t) -> bool:
    """The negative control's ``cpcompile.ops.check.is_exact``: every tensor taken for one computed from the whole
    sequence, so document ids made from one rank's tokens pass the run-time check."""
    return True


def _refused_at_run_time(case: ParityCase, runner) -> dict:
    """Run a case that must raise ``UnsupportedAttentionError`` on this rank; then its negative control, the
    check told every tensor is exact, which must fail the parity check."""
    from cpcompile import ops
    from tests.harness.parity import failing_quantities

    try:
        runner.run()
        message = ""
    except cpcompile.UnsupportedAttentionError as e:
        message = str(e)
    torch.compiler.reset()
    with _patched(ops.check, "is_exact", _every_tensor_exact):  # the check turned off
        failing = failing_quantities(runner.run())
    return {"case": case.model, "refused": message, "control_failing": failing}


def _run(cases, group, control: bool = False) -> list[dict]:
    from tests.harness.parity import ParityRunner, assert_parity, failing_quantities

    out = []
    for case in cases:
        torch.compiler.reset()
        runner = ParityRunner(case, group)
        if case.model in REFUSED_AT_RUN_TIME:
            out.append(_refused_at_run_time(case, runner))
            continue
        outcome = runner.run()
        assert_parity(outcome)
        summary = {
            "case": outcome.name,
            **outcome.errors(),
            "seconds": outcome.seconds,
            "actions": outcome.actions,
            "rewritten": outcome.counter_delta.get("flex_rewritten", 0),
            "all_gathers": outcome.comm.all_gathers,
            "reduce_scatters": outcome.comm.reduce_scatters,
            "mixing": outcome.mixing,
        }
        patch = _control(case, group) if control else None
        if patch is not None:
            torch.compiler.reset()
            with patch:
                summary["control_failing"] = failing_quantities(runner.run())
        out.append(summary)
    return out


#: torchtitan's trainer masks for one row (the other branch of its efficient document mask: a table of document
#: starts by document id, ``scatter_``-filled, size ``round_up(T + 1, 128)``), at CP=4 under the balanced layout,
#: on packed rows of changing length (T not always a multiple of 4), one compiled model for all of them.
TRAINER_LENGTHS = 6
#: At most this many compilations of the model over those lengths: the masks' tensors have the global length,
#: which Dynamo makes dynamic at its first change of size (shard marks the local length dynamic from the start).
TRAINER_MAX_COMPILES = 2


def _one_row_trainer(group) -> dict:
    import random

    from tests.harness.parity import compare_steps, cp_step, reference_step
    from tests.models import flex

    reference, model = flex.torchtitan_trainer(), flex.torchtitan_trainer()
    backend, compiles = cpcompile.backend(group, inner="aot_eager"), []

    def counting(gm, example_inputs):
        compiles.append(gm)
        return backend(gm, example_inputs)

    compiled = torch.compile(model, backend=counting)
    rng, out = random.Random(3), {"lengths": [], "errors": [], "failing": []}
    for step in range(TRAINER_LENGTHS):
        docs = [rng.randint(2, 24) for _ in range(rng.randint(2, 4))]
        batch = packed_batch([docs], seed=step)
        batch.update(flex.torchtitan_trainer_masks(batch))
        ref = reference_step(reference, batch)
        cp = cp_step(compiled, model, batch, group, layout="balanced")
        errors, failing = compare_steps(ref, cp, f"T={sum(docs)} ")
        out["failing"] += failing
        out["lengths"].append(sum(docs))
        out["errors"].append(errors)
    out["compiles"] = len(compiles)
    return out


def _worker(rank: int, world: int, with_slow: bool) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank takes part in creating every group
    out = {"with_slow": with_slow}
    if rank < 2:
        out["pair0"] = _run(PAIR0 + (PAIR0_SLOW if with_slow else []), pairs[0], control=True)
    else:
        out["pair1"] = _run(PAIR1 + (PAIR1_SLOW if with_slow else []), pairs[1], control=True)
    if not with_slow:
        return out
    out["cp4"] = _run(CP4, dist.group.WORLD)
    torch.compiler.reset()
    out["trainer_one_row"] = _one_row_trainer(dist.group.WORLD)
    return out


@pytest.fixture(scope="module")
def results(request) -> dict:
    per_rank = run_distributed(_worker, 4, runs_slow(request), timeout_s=TIMEOUT_S)
    return {**per_rank[2], **per_rank[0]}  # pair0 from rank 0, pair1 from rank 2, CP=4 from rank 0


def _check(summaries: list[dict]) -> None:
    checked = [s for s in summaries if s["case"] not in REFUSED_AT_RUN_TIME]
    assert checked, f"no parity case ran: {[s['case'] for s in summaries]}"  # an empty list would pass unchecked
    for s in checked:
        errors = f"logits {s['logits']:.1e}, loss {s['loss']:.1e}, grad {s['grad']:.1e}"
        print(f"{s['case']}: {errors} in {s['seconds']:.1f}s, all-gathers {s['all_gathers']}, mixing {s['mixing']}")
        sites = len(s["actions"])
        assert sites and s["actions"] == ["rewritten"] * sites and s["rewritten"] == sites, s
        assert s["all_gathers"] == s["reduce_scatters"] == 2 * sites, s  # K and V per site, each with its backward
        if "torchtitan_flex" in s["case"]:  # its document ids (cumsum of the starts) run on the whole sequence
            assert ("cumsum", "gathered") in s["mixing"], s
        if "hf_flex" in s["case"]:  # transformers' packed-sequence ids run on the whole sequence
            assert ("diff", "gathered") in s["mixing"] and ("cumsum", "gathered") in s["mixing"], s
        if "lfm2" in s["case"]:
            assert ("conv1d", "halo") in s["mixing"], s


def test_parity_cp2_contiguous(results):
    _check(results["pair0"])


def test_negative_controls_fail_parity(results):
    """Each control fails the parity check: the mods at local query indices (hand-written models), the
    packed-sequence ids of transformers' llama computed from this rank's tokens, LFM2's conv not seen in the mixed
    graph after the BlockMask's graph break."""
    controlled = [s for s in results["pair0"] + results["pair1"] if "control_failing" in s]
    # document, transformers' LFM2, document_eager; the slow tier adds softcap, transformers' llama, torchtitan's two
    expected = 3 + (4 if results["with_slow"] else 0)
    assert len(controlled) == expected, [s["case"] for s in controlled]
    for s in controlled:
        assert s["control_failing"], f"{s['case']}: the negative control passed the parity check"


def test_document_ids_made_in_eager_code_are_refused_on_every_rank(results):
    """Document ids a mask_mod reads, made outside the compiled model from one rank's tokens (torchtitan's trainer
    makes its masks so): refused at run time on each rank, naming the fix; with the check off, parity fails
    (``test_negative_controls_fail_parity``)."""
    (s,) = [s for s in results["pair0"] if s["case"] in REFUSED_AT_RUN_TIME]
    assert "computed outside the compiled model" in s["refused"], s
    assert "shape (2, 19)" in s["refused"] and "mask_mod" in s["refused"], s
    assert "build the BlockMask there too" in s["refused"], s


@slow
def test_torchtitan_llama3_on_its_flex_attention(results):
    """torchtitan's own Llama 3 on its default FlexAttention, the BlockMask built in the forward from its own
    mask mods (causal and document) and ``positions`` passed to its RoPE (a ``gather`` of ``rope_cache`` at the
    positions), is exact at CP=2 under the balanced layout (``_check`` in ``test_parity_cp2_balanced``)."""
    (s,) = [s for s in results["pair1"] if "torchtitan" in s["case"]]
    assert s["actions"] == ["rewritten"] and s["control_failing"], s


@slow
def test_torchtitan_trainer_masks_built_outside_the_model(results):
    """torchtitan's default config as its trainer runs it: ``model.get_attention_masks(positions)`` on the global
    batch (its efficient packed-document mask_mod), passed to ``shard`` in the batch. Exact at CP=2 with two rows
    (document ends by token), and at CP=4 with one row (document starts by document id) on packed rows of
    changing length, compiled at most twice; with the mask_mod at local query indices, parity fails
    (``test_negative_controls_fail_parity``)."""
    (s,) = [s for s in results["pair0"] if "torchtitan_trainer" in s["case"]]
    assert s["actions"] == ["rewritten"] and s["control_failing"], s
    one_row = results["trainer_one_row"]
    print(f"\none row at CP=4, lengths {one_row['lengths']}: {one_row['errors']}, {one_row['compiles']} compiles")
    assert not one_row["failing"], one_row["failing"]
    assert len(set(one_row["lengths"])) >= TRAINER_LENGTHS - 1, one_row["lengths"]
    assert 1 <= one_row["compiles"] <= TRAINER_MAX_COMPILES, one_row


def test_parity_cp2_balanced(results):
    _check(results["pair1"])


@slow
def test_parity_cp4(results):
    _check(results["cp4"])


@slow  # the fast tier: transformers' LFM2 on its flex path at CP=2 (the same ids gathered, parity, its control)
@pytest.mark.usefixtures("fresh_dynamo")
def test_transformers_flex_path_runs_the_packed_ids_on_the_whole_sequence(world):
    """transformers' flex path (tiny llama): the packed-sequence ids (``position_ids[:, :1] - 1``, ``diff``,
    ``cumsum``) run on the whole sequence, and the graph that builds the BlockMask (``create_block_mask(...,
    _compile=True)``: the mask_mod on a grid of local indices) is left to the flex site, which reads only its
    mask_mod: nothing is refused."""
    from cpcompile.backend import CPBackend
    from cpcompile.options import BackendOptions

    backend = CPBackend(world, BackendOptions(inner="eager"), trace_only=True)
    model = _flex_models.hf_flex(num_hidden_layers=1)
    with cpcompile.shard(packed_batch([list(r) for r in DOCS]), world) as local:
        torch.compile(model, backend=backend)(**local)
    mixing = [(r.op, r.action, r.source.split(" ")[0].rsplit("/", 1)[-1]) for r in backend.mixing_reports]
    assert mixing[:2] == [("diff", "gathered", "masking_utils.py:757"), ("cumsum", "gathered", "masking_utils.py:758")]
    assert [r.action for r in backend.mixing_reports + backend.position_reports if r.action == "refused"] == []
    assert [r.action for r in backend.reports] == ["rewritten"]
