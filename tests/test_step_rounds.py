"""The control rounds a step holds are decided by what the program did, never by where the allocator put a tensor.

A site's mask check runs once per step for each live model mask (:class:`cpcompile.runtime.context.TensorSet`).
When that identity was an address, a mask freed after a ``no_grad`` forward (nothing saves it for backward) could
hand its address to the next model's mask on one rank and not on the other: one rank skipped the round, the other
waited in it, and the job hung (policy and frozen reference models on one CP group, as RL steps run them).

* :class:`TensorSet` in one process: a new tensor over a freed one's memory, an in-place write and an inference
  tensor are never taken for a noted tensor; a live one, and a view of the same memory and layout, are.
* Two ranks, tiny Qwen3 (transformers: its mask is built inside the graph and checked at every site), two models
  compiled on one group, forwards under ``no_grad``, ``inference_mode`` and ``eval()`` and a training forward in one
  ``shard`` step: every rank holds the same rounds, one mask check per forward, and the log-probs and gradients match
  one process (the full matrix of modes and steps is in ``tests/test_rl_step.py``).
"""

from __future__ import annotations

import torch

from cpcompile.runtime.context import TensorSet
from tests.harness.dist import run_distributed
from tests.harness.tolerances import GRAD_TOL, LOGITS_TOL


def test_tensor_set_knows_live_tensors_only():
    memory = torch.zeros(64)
    noted = memory[:16].view(4, 4)
    tensors = TensorSet()
    tensors.add(noted, "form")
    assert tensors.contains(noted, "form")
    assert tensors.contains(memory[:16].view(4, 4), "form")  # a view of the same memory and layout, noted alive
    assert not tensors.contains(noted, "other form")
    assert not tensors.contains(noted.t(), "form")  # same memory, other strides: other values
    del noted
    # A new tensor over the freed tensor's memory, with its shape and strides: what an allocator that hands the
    # freed address to the next mask produces. It must be checked again.
    assert not tensors.contains(memory[:16].view(4, 4), "form")


def test_tensor_set_sees_in_place_writes_and_never_trusts_inference_tensors():
    tensors = TensorSet()
    t = torch.zeros(4, 4)
    tensors.add(t)
    t.add_(1)
    assert not tensors.contains(t)
    with torch.inference_mode():
        frozen = torch.zeros(4, 4)
    tensors.add(frozen)  # no version counter: never recognised, and noting it does not raise
    assert not tensors.contains(frozen)


def _rounds_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    import cpcompile
    from cpcompile.testing import packed_batch, tiny_model

    group = dist.new_group(list(range(world_size)))
    policy, reference = tiny_model("qwen3", seed=0), tiny_model("qwen3", seed=1)
    reference.requires_grad_(False)
    eager = {name: m for name, m in (("policy", policy), ("reference", reference))}
    compiled = {name: torch.compile(m, backend=cpcompile.backend(group, inner="eager")) for name, m in eager.items()}
    batch = packed_batch([[20, 30, 14]], vocab_size=policy.config.vocab_size, seed=3)

    def logprobs(model, inputs, shifted):
        out = model(**inputs)
        return cpcompile.token_logprobs(out.logits, shifted)

    # One process: the same calls on the whole batch.
    one = {"batch": {**{k: v for k, v in batch.items() if k != "labels"}, "use_cache": False}}
    with torch.no_grad():
        want_old = logprobs(policy, one["batch"], batch["labels"].roll(-1, 1))[:, :-1]
        want_ref = logprobs(reference, one["batch"], batch["labels"].roll(-1, 1))[:, :-1]
    policy.zero_grad()
    policy(**batch, use_cache=False).loss.backward()
    want_grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad()

    deltas, got = [], {}
    with cpcompile.shard(batch, group) as local:
        inputs = {k: v for k, v in local.items() if k not in ("labels", "shift_labels", "num_items_in_batch")}
        stats = cpcompile.comm_stats()

        def forward(mode: str, name: str):
            before = stats.control_rounds
            if mode == "no_grad":
                with torch.no_grad():
                    out = logprobs(compiled[name], inputs, local["shift_labels"])
            elif mode == "inference_mode":
                with torch.inference_mode():
                    out = logprobs(compiled[name], inputs, local["shift_labels"])
            else:  # eval(): no dropout to turn off in this config; the module flag alone must not change rounds
                eager[name].eval()
                with torch.no_grad():
                    out = logprobs(compiled[name], inputs, local["shift_labels"])
                eager[name].train()
            deltas.append((mode, name, stats.control_rounds - before))
            return cpcompile.gather(out.clone())

        for _ in range(2):  # the first pass compiles each mode's graph and holds its sites' first rounds
            got["old"] = forward("no_grad", "policy")
            got["ref"] = forward("no_grad", "reference")
            got["ref_again"] = forward("inference_mode", "reference")
            got["old_eval"] = forward("eval", "policy")
        before = stats.control_rounds
        compiled["policy"](**local).loss.backward()
        deltas.append(("train", "policy", stats.control_rounds - before))
    cpcompile.sync_grads(policy.parameters(), group)
    for key in ("old", "ref", "ref_again", "old_eval"):
        want = want_ref if key.startswith("ref") else want_old
        torch.testing.assert_close(got[key][:, :-1], want, **LOGITS_TOL)
    for n, p in policy.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[n], **GRAD_TOL, msg=lambda m, n=n: f"{n}: {m}")
    return {"deltas": deltas}


def test_two_models_and_forward_only_modes_hold_the_same_rounds_on_every_rank():
    results = run_distributed(_rounds_worker, 2, timeout_s=300)
    assert results[0]["deltas"] == results[1]["deltas"], results
    again = [d for d in results[0]["deltas"] if d[0] != "train"][4:]
    # Every forward builds a new mask (the last one freed): one round for the model's two layers, which share it.
    # An inference tensor has no version counter, so it is never recognised: one round per layer.
    want = [("no_grad", "policy", 1), ("no_grad", "reference", 1), ("inference_mode", "reference", 2)]
    assert again == [*want, ("eval", "policy", 1)], results[0]["deltas"]
