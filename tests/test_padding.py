"""Padding never contributes: extra ``[B, T]`` keys padded per key (``shard(pad_values=...)``, a safe default per
dtype) and ``cpcompile.real_tokens()`` for hand-written losses.

When T is not a multiple of the CP size, ``shard`` appends padding tokens to the last rank. The tests here use
losses written by hand on keys the user prepared, the way training loops outside transformers do: pre-shifted
targets (``-100`` = ignore), a float loss mask, per-token advantages. Each loss, summed over the CP ranks, and every
gradient must equal the single-process loss on the whole batch; padded with a value that supervises a token, the
same loss must fail the check (negative controls).

Measured differences and the controls' errors: BENCHMARKS.md ("parity errors").
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cpcompile
from tests.harness.dist import run_distributed
from tests.harness.tolerances import GRAD_TOL, LOSS_TOL

B, T = 2, 63


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Token ids, one document per row, pre-shifted targets with ignored tokens, a float loss mask, advantages."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (B, T), generator=g)
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]
    targets[torch.rand(B, T, generator=g) < 0.2] = -100
    return {
        "input_ids": ids,
        "position_ids": torch.arange(T).expand(B, T),
        "targets": targets,
        "loss_mask": torch.rand(B, T, generator=g),
        "advantages": torch.randn(B, T, generator=g),
    }


# -- padding values, one process (this process is rank 1 of a fake CP group of 2: it holds the padding) ---


def test_default_pad_values_per_dtype(last_rank):
    batch = {**_batch(), "flags": torch.ones(B, T, dtype=torch.bool), "segment": torch.ones(B, T, 3)}
    with cpcompile.shard(batch, last_rank, hf_kwargs=False, layout="contiguous") as local:
        real = cpcompile.real_tokens()
        assert local["input_ids"].shape == (B, 32)  # c = 32: tokens 32..62 and one padding token
        assert local["targets"][:, -1].tolist() == [-100, -100]
        assert local["loss_mask"][:, -1].tolist() == [0.0, 0.0] and local["advantages"][:, -1].tolist() == [0.0, 0.0]
        assert local["flags"][:, -1].tolist() == [False, False] and local["segment"][:, -1].eq(0).all()
        torch.testing.assert_close(local["targets"][:, :-1], batch["targets"][:, 32:], atol=0, rtol=0)
        assert real.shape == (B, 32) and real[:, :-1].all() and not real[:, -1].any()
    assert cpcompile.runtime.default_pad_value(torch.int32) == -100
    assert (
        cpcompile.runtime.default_pad_value(torch.bfloat16) == 0.0
        and cpcompile.runtime.default_pad_value(torch.bool) is False
    )


def test_pad_values_override(last_rank):
    with cpcompile.shard(
        _batch(), last_rank, pad_values={"targets": 0, "loss_mask": 1.0}, layout="contiguous"
    ) as local:
        assert local["targets"][:, -1].tolist() == [0, 0] and local["loss_mask"][:, -1].tolist() == [1.0, 1.0]
        assert local["advantages"][:, -1].tolist() == [0.0, 0.0]  # not named: the default


@pytest.mark.parametrize(
    "pad_values, error, words",
    [
        ([("targets", 0)], TypeError, "pad_values must be a dict"),
        ({"target": 0}, ValueError, "names 'target', which is not a tensor of the batch; the extra keys are"),
        ({"labels": 0}, ValueError, "cpcompile pads 'labels' itself"),
        ({"input_ids": 0}, ValueError, "cpcompile pads 'input_ids' itself"),
        ({"targets": 0.5}, TypeError, "pad_values['targets'] = 0.5 does not fit batch['targets'] of dtype torch.int64"),
        ({"loss_mask": True}, TypeError, "pass a number"),
    ],
)
def test_bad_pad_values(last_rank, pad_values, error, words):
    with pytest.raises(error) as info:
        with cpcompile.shard(_batch(), last_rank, pad_values=pad_values):
            pass
    assert words in str(info.value), str(info.value)


def test_real_tokens_outside_shard_raises():
    with pytest.raises(RuntimeError, match=r"cpcompile\.real_tokens needs an active CP plan"):
        cpcompile.real_tokens()


# -- hand-written losses, CP=2 on gloo vs one process ----------------------------------------------------
def _losses(logits, tensors, real=None):
    """Every loss variant as ``(numerator / global denominator)`` from this rank's (or the whole batch's)
    logits and keys. ``real`` (bool [B, c]) masks padding where a variant asks for it."""
    import torch.nn.functional as F

    nll = F.cross_entropy(logits.flatten(0, 1), tensors["targets"].flatten(), ignore_index=-100, reduction="none")
    nll = nll.view(logits.shape[:2])
    n_sup, n_mask, n_tok = tensors["n_sup"], tensors["n_mask"], B * T
    out = {
        "targets": nll.sum() / n_sup,
        "loss_mask": (nll * tensors["loss_mask"]).sum() / n_mask,
        "advantages": -(tensors["advantages"] * -nll).sum() / n_tok,
    }
    if real is not None:
        out["real_tokens"] = (nll * real).sum() / n_sup
    return out


#: variant -> pad_values of the run whose loss it is (controls pad with a value that supervises a token)
RUNS = {
    "targets": None,
    "loss_mask": {"targets": 0},
    "advantages": {"targets": 0},
    "real_tokens": {"targets": 0},
    "control:targets": {"targets": 0},
    "control:loss_mask": {"targets": 0, "loss_mask": 1.0},
    "control:advantages": {"targets": 0, "advantages": 1.0},
}


def _padding_worker(rank, world_size):
    from tests.models.attention import attention_lm

    group = dist.group.WORLD
    batch = _batch()
    counts = {
        "n_sup": (batch["targets"] != -100).sum(),
        "n_mask": batch["loss_mask"].sum(),
    }
    ref_model = attention_lm("causal_gqa")
    model = attention_lm("causal_gqa")
    compiled = torch.compile(model, backend=cpcompile.backend(group, inner="eager"))
    out = {}
    for run, pad_values in RUNS.items():
        variant = run.removeprefix("control:")
        ref_model.zero_grad()
        ref_logits = ref_model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        ref_loss = _losses(ref_logits, {**batch, **counts}, real=torch.ones(B, T))[variant]
        ref_loss.backward()
        model.zero_grad()
        with cpcompile.shard(batch, group, hf_kwargs=False, pad_values=pad_values) as local:
            logits = compiled(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
            loss = _losses(logits, {**local, **counts}, real=cpcompile.real_tokens())[variant]
            loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        cpcompile.sync_grads(model.parameters(), group)
        grads = {
            n: (p.grad.clone(), q.grad.clone()) for (n, p), q in zip(model.named_parameters(), ref_model.parameters())
        }
        out[run] = {"loss": (total, ref_loss.detach()), "grads": grads}
    return out


def _assert_exact(result, name):
    cp, ref = result["loss"]
    torch.testing.assert_close(cp, ref, **LOSS_TOL, msg=lambda m: f"{name} loss: {m}")
    for pname, (g, ref_g) in result["grads"].items():
        torch.testing.assert_close(g, ref_g, **GRAD_TOL, msg=lambda m, p=pname: f"{name} grad of {p}: {m}")


def test_padding_stays_out_of_hand_written_losses():
    results = run_distributed(_padding_worker, 2, timeout_s=300)[0]
    for run, result in results.items():
        cp, ref = result["loss"]
        grad = max(float((g - r).abs().max()) for g, r in result["grads"].values())
        print(f"\n{run}: loss diff {float((cp - ref).abs()):.1e}, max grad diff {grad:.1e}")
        if run.startswith("control:"):
            with pytest.raises(AssertionError):
                _assert_exact(result, run)
        else:
            _assert_exact(result, run)
