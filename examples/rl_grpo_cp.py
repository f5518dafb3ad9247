"""GRPO-style RL steps with FSDP2 x context parallelism: a policy and a frozen reference on packed rollouts.

The step of FSDP RL frameworks on long contexts: every step packs a global batch of rollouts (a prompt and a
response per document; several responses per prompt) into rows of up to ``--seq-len`` tokens, a different
length every step (``T`` need not divide by the CP size). DP rank ``d`` takes its
block of rows and its CP ranks each hold one chunk of every row. Inside one
``cpcompile.shard``:

1. the policy's old log-probs and the frozen reference's log-probs, under ``torch.no_grad()``;
2. ``--epochs`` optimizer steps of the policy on the same rollouts: the GRPO loss per token is the clipped
   ratio (new / old probability) times the rollout's advantage plus ``--beta`` times the k3 estimate of the KL to
   the reference; each rollout's mean over its response tokens, then the mean over rollouts
   (``cpcompile.per_sample_mean``), backward, ``cpcompile.clip_grad_norm_`` and AdamW.

Both models are sharded with FSDP2 over all dp x cp ranks (``cpcompile.fully_shard_dp_cp``, gradients summed)
and compiled with ``cpcompile.backend(cp_group)``. Rank 0 then runs the same steps in one process on the whole
global batch and prints both side by side. The rollouts are random tokens with a toy reward (the share of a
response's tokens in the lower half of the vocabulary), normalised within each prompt's group: the point is the
step, not the learning.

    python examples/rl_grpo_cp.py                        # dp=2 x cp=2: spawns 4 CPU gloo processes
    python examples/rl_grpo_cp.py --dp 1 --cp 2          # 2 processes
    torchrun --nproc-per-node 8 examples/rl_grpo_cp.py --dp 2 --cp 4   # NCCL on CUDA (gloo on CPU)
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

import cpcompile
from cpcompile.plan import IGNORE_INDEX

VOCAB = 1024


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=2, help="data-parallel size (default 2)")
    p.add_argument("--cp", type=int, default=2, help="context-parallel size (default 2)")
    p.add_argument("--steps", type=int, default=3, help="batches of rollouts (default 3)")
    p.add_argument("--epochs", type=int, default=2, help="optimizer steps per batch of rollouts (default 2)")
    p.add_argument(
        "--seq-len",
        type=int,
        default=256,
        help="longest row in tokens; steps cycle through it, 21 and 42 fewer (default 256)",
    )
    p.add_argument("--rows", type=int, default=2, help="rows per DP rank (default 2)")
    p.add_argument("--group-size", type=int, default=4, help="responses per prompt (default 4)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping norm (default 1.0)")
    p.add_argument("--clip", type=float, default=0.2, help="clip range of the probability ratio (default 0.2)")
    p.add_argument("--beta", type=float, default=0.05, help="weight of the KL to the reference (default 0.05)")
    p.add_argument(
        "--compile-inner",
        default="aot_eager",
        choices=["inductor", "aot_eager", "eager"],
        help="compiler cpcompile hands the rewritten graphs to (default aot_eager)",
    )
    p.add_argument("--no-check", action="store_true", help="skip the single-process run and the comparison")
    args = p.parse_args(argv)
    for name in ("dp", "cp", "steps", "epochs", "rows", "group_size", "layers", "hidden"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.seq_len < 96:
        p.error(f"--seq-len must be >= 96, got {args.seq_len}")
    if args.hidden % 8:
        p.error(f"--hidden must be a multiple of 8 (4 heads of head_dim hidden/4), got {args.hidden}")
    return args


def build_model(args, seed: int, device: torch.device) -> torch.nn.Module:
    """A Qwen3-style causal LM from a config, random init (the same weights on every rank for one seed)."""
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.hidden // 4,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to(device).train()


def build_models(args, device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The policy and the frozen reference (another initialisation: a policy some way into training)."""
    return build_model(args, 0, device), build_model(args, 1, device).eval().requires_grad_(False)


def rollouts(args, step: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The global batch of ``step`` (the same on every rank): ``dp * rows`` rows of ``T`` tokens packing rollouts.

    A rollout is one document: a prompt (not supervised) and a response (supervised). ``group_size`` responses
    share each prompt; a response's advantage is its reward normalised over its group's responses in the row.
    """
    g = torch.Generator().manual_seed(1000 + step)
    T = args.seq_len - 21 * (step % 3)  # rows as long as the step's rollouts: a new T, odd ones included
    n_rows = args.dp * args.rows
    ids = torch.zeros(n_rows, T, dtype=torch.long)
    pos = torch.zeros_like(ids)
    labels = torch.full_like(ids, IGNORE_INDEX)
    adv = torch.zeros(n_rows, T)
    for r in range(n_rows):
        t = 0
        while t < T:
            prompt = torch.randint(1, VOCAB, (int(torch.randint(4, 16, (1,), generator=g)),), generator=g)
            rewards, spans = [], []
            for _ in range(args.group_size):
                room = T - t - len(prompt)
                if room < 2:  # the row's end: a last prompt-only document, not supervised
                    pos[r, t:T] = torch.arange(T - t)
                    ids[r, t:T] = torch.randint(1, VOCAB, (T - t,), generator=g)
                    t = T
                    break
                n = min(int(torch.randint(8, 48, (1,), generator=g)), room)
                response = torch.randint(1, VOCAB, (n,), generator=g)
                doc = slice(t, t + len(prompt) + n)
                ids[r, doc] = torch.cat([prompt, response])
                pos[r, doc] = torch.arange(len(prompt) + n)
                labels[r, t + len(prompt) : doc.stop] = response
                rewards.append((response < VOCAB // 2).float().mean())
                spans.append(doc)
                t = doc.stop
            if spans:
                rewards = torch.stack(rewards)
                scaled = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-4)
                for doc, a in zip(spans, scaled):
                    adv[r, doc] = a
    batch = {"input_ids": ids, "position_ids": pos, "labels": labels, "advantages": adv}
    return {k: v.to(device) for k, v in batch.items()}


def grpo_token_loss(args, logp, old, ref, adv) -> torch.Tensor:
    """Per token: the clipped policy-gradient term plus ``beta`` times the k3 KL estimate to the reference."""
    ratio = torch.exp(logp - old)
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - args.clip, 1 + args.clip) * adv)
    d = ref - logp
    return pg + args.beta * (torch.exp(d) - d - 1)


def train(args, device: torch.device) -> dict:
    """The steps on this rank; returns what it recorded (rank 0: the comparison with one process too)."""
    rank = dist.get_rank()
    mesh = cpcompile.init_dp_cp_mesh(args.dp, args.cp, device_type=device.type)
    dp_group, cp_group = mesh.get_group("dp"), mesh.get_group("cp")
    dp_rank = mesh.get_local_rank("dp")

    policy, reference = build_models(args, device)
    cpcompile.fully_shard_dp_cp(policy, mesh)  # parameters sharded over dp x cp, gradients summed over them
    cpcompile.fully_shard_dp_cp(reference, mesh)
    # One backend may compile both models (a backend each works too: each then compiles its own variants of the
    # frames the two models share).
    backend = cpcompile.backend(cp_group, inner=args.compile_inner)
    cpolicy = torch.compile(policy, backend=backend)
    creference = torch.compile(reference, backend=backend)
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    if rank == 0:
        n_params = sum(p.numel() for p in policy.parameters())
        print(
            f"GRPO: Qwen3-style policy and frozen reference, {args.layers} layers, hidden {args.hidden}, "
            f"{n_params / 1e6:.2f}M parameters each; dp={args.dp} x cp={args.cp} on {dist.get_world_size()} "
            f"{device.type} processes ({dist.get_backend()}), {args.dp * args.rows} rows per step, "
            f"{args.epochs} optimizer steps per batch, inner={args.compile_inner}",
            flush=True,
        )

    def logprobs(model, local):
        out = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False)
        return cpcompile.token_logprobs(out.logits, local["shift_labels"])  # [B, c]: this rank's chunk

    rec = {"T": [], "loss": [], "norm": [], "old": [], "seconds": []}
    for step in range(args.steps):
        start = time.perf_counter()
        full = rollouts(args, step, device)
        rows = {k: v[dp_rank * args.rows : (dp_rank + 1) * args.rows] for k, v in full.items()}
        with cpcompile.shard(rows, cp_group, dp_group=dp_group) as local:
            mask = local["shift_labels"] != IGNORE_INDEX  # response tokens
            with torch.no_grad():
                old = logprobs(cpolicy, local)
                ref = logprobs(creference, local)
            for _ in range(args.epochs):
                per_token = grpo_token_loss(args, logprobs(cpolicy, local), old, ref, local["advantages"])
                loss = cpcompile.per_sample_mean(per_token, mask, dp_group=dp_group)  # this rank's share
                loss.backward()
                norm = cpcompile.clip_grad_norm_(policy.parameters(), args.max_norm)
                if torch.isfinite(norm):
                    opt.step()
                opt.zero_grad()
                total = loss.detach().clone()
                dist.all_reduce(total)  # the shares of all dp x cp ranks add up to the global batch's loss
                rec["loss"].append(total.item())
                rec["norm"].append(norm.item())
            if not args.no_check:  # the old log-probs of the whole global batch, for the comparison
                mine = cpcompile.gather(old)  # [rows, T] of this DP rank, original token order
                parts = [torch.empty_like(mine) for _ in range(args.dp)]
                dist.all_gather(parts, mine, group=dp_group)
                rec["old"].append(torch.cat(parts))
        rec["T"].append(full["input_ids"].shape[1])
        rec["seconds"].append(time.perf_counter() - start)
        if rank == 0:
            print(
                f"step {step + 1}/{args.steps}: T={rec['T'][-1]}, loss {rec['loss'][-1]:.6f}, "
                f"grad norm {rec['norm'][-1]:.4f}, {rec['seconds'][-1]:.1f} s",
                flush=True,
            )
    if not args.no_check:
        params = {n: p.full_tensor().detach() for n, p in policy.named_parameters()}  # collective
        if rank == 0:
            rec["check"] = check(args, device, rec, params)
        dist.barrier()
    return rec


def reference_run(args, device: torch.device) -> dict:
    """The same steps in this process on the whole global batch, eager, the loss written out in plain torch."""
    policy, reference = build_models(args, device)
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr)

    def logprobs(model, batch):
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        targets = torch.cat([batch["labels"][:, 1:], torch.full_like(batch["labels"][:, :1], IGNORE_INDEX)], 1)
        logp = torch.log_softmax(logits.float(), -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
        return logp.masked_fill(targets == IGNORE_INDEX, 0.0), targets != IGNORE_INDEX

    rec = {"loss": [], "norm": [], "old": []}
    for step in range(args.steps):
        batch = rollouts(args, step, device)
        doc = torch.cumsum(batch["position_ids"] == 0, dim=1) - 1  # document index within its row
        with torch.no_grad():
            old, mask = logprobs(policy, batch)
            ref, _ = logprobs(reference, batch)
        rec["old"].append(old)
        for _ in range(args.epochs):
            logp, _ = logprobs(policy, batch)
            per_token = grpo_token_loss(args, logp, old, ref, batch["advantages"]) * mask
            num = torch.zeros(doc.shape[0], int(doc.max()) + 1, device=device).scatter_add(1, doc, per_token)
            den = torch.zeros_like(num).scatter_add(1, doc, mask.float())
            loss = (num[den > 0] / den[den > 0]).mean()  # each rollout's mean, then the mean over rollouts
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_norm)
            if torch.isfinite(norm):
                opt.step()
            opt.zero_grad()
            rec["loss"].append(loss.item())
            rec["norm"].append(norm.item())
    rec["params"] = {n: p.detach() for n, p in policy.named_parameters()}
    return rec


def check(args, device, cp: dict, params: dict) -> dict[str, float]:
    """Print the CP run next to one process, step by step; return the largest differences."""
    one = reference_run(args, device)
    print(f"\nthe same steps in one process on the global batch (dp={args.dp} x cp={args.cp} | 1 process):")
    header = (
        f"{'step':>4} {'epoch':>5} {'T':>4} {'loss cp':>12} {'loss 1-proc':>12} {'|diff|':>9} "
        f"{'norm cp':>10} {'norm 1-proc':>11} {'|diff|':>9} {'old logp |diff|':>15}"
    )
    print(header)
    worst = {"loss": 0.0, "grad_norm": 0.0, "old_logp": 0.0}
    for i in range(args.steps * args.epochs):
        step, epoch = divmod(i, args.epochs)
        dl, dn = abs(cp["loss"][i] - one["loss"][i]), abs(cp["norm"][i] - one["norm"][i])
        dold = (cp["old"][step] - one["old"][step]).abs().max().item()
        for key, value in (("loss", dl), ("grad_norm", dn), ("old_logp", dold)):
            worst[key] = max(worst[key], value)
        print(
            f"{step + 1:>4} {epoch + 1:>5} {cp['T'][step]:>4} {cp['loss'][i]:>12.8f} {one['loss'][i]:>12.8f} "
            f"{dl:>9.2e} {cp['norm'][i]:>10.6f} {one['norm'][i]:>11.6f} {dn:>9.2e} {dold:>15.2e}"
        )
    worst["param"] = max((params[n] - p).abs().max().item() for n, p in one["params"].items())
    print(f"largest parameter difference after {args.steps * args.epochs} AdamW steps: {worst['param']:.2e}")
    print(
        "Differences come from fp32 sums in another order; AdamW divides by sqrt(v) + eps (1e-8), which can turn "
        "that rounding on near-zero gradient entries into parameter steps of up to lr."
    )
    return worst


def main(argv=None) -> None:
    from _launch import launch  # the examples' folder: this script's own

    args = parse_args(argv)
    launch(train, args, args.dp * args.cp)


if __name__ == "__main__":
    sys.exit(main())
