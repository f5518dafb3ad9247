"""Train a small Qwen3-style model with FSDP2 x context parallelism on synthetic packed documents.

Every rank builds the same global batch (rows of packed documents of random lengths); DP rank ``d`` takes its
block of rows, and each of its CP ranks runs one chunk of every row through the model compiled with
``cpcompile.backend``. FSDP2 shards the parameters over all dp x cp ranks and sums their gradients, so one step
here is one step of a single process on the whole global batch; ``--check`` reruns the same steps in one
process and prints the largest parameter difference.

    python examples/train_fsdp_cp.py --dp 2 --cp 2 --steps 10            # spawns 4 CPU gloo processes
    torchrun --nproc-per-node 8 examples/train_fsdp_cp.py --dp 2 --cp 4  # NCCL on CUDA (gloo on CPU)
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

import cpcompile
from cpcompile.plan import IGNORE_INDEX


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=1, help="data-parallel size (default 1)")
    p.add_argument("--cp", type=int, default=2, help="context-parallel size (default 2)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    p.add_argument(
        "--compile-inner",
        default="aot_eager",
        choices=["inductor", "aot_eager", "eager"],
        help="compiler cpcompile hands the rewritten graphs to (default aot_eager; inductor is faster per step)",
    )
    p.add_argument(
        "--layout",
        default="balanced",
        choices=["balanced", "contiguous", "head_tail"],
        help="which tokens each CP rank holds (default balanced: the same attention work on every rank)",
    )
    p.add_argument(
        "--block-size", type=int, default=128, help="block of the CP attention kernel, which balanced balances"
    )
    p.add_argument("--seq-len", type=int, default=512, help="tokens per row (default 512)")
    p.add_argument("--rows", type=int, default=2, help="rows per DP rank (default 2)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (default 128)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping norm (default 1.0)")
    p.add_argument("--check", action="store_true", help="rerun the steps in one process and compare parameters")
    args = p.parse_args(argv)
    for name in ("dp", "cp", "steps", "seq_len", "rows", "layers", "hidden", "block_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.hidden % 8:
        p.error(f"--hidden must be a multiple of 8 (4 heads of head_dim hidden/4), got {args.hidden}")
    return args


def build_model(args, device: torch.device) -> torch.nn.Module:
    """A Qwen3-style causal LM from a config, random init (the same weights on every rank)."""
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.hidden // 4,
        max_position_embeddings=max(args.seq_len, 128),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to(device).train()


def global_batch(args, step: int, device: torch.device) -> dict[str, torch.Tensor]:
    """``dp * rows`` rows of ``seq_len`` tokens, each packing documents of random lengths (same on all ranks)."""
    g = torch.Generator().manual_seed(1000 + step)
    n_rows = args.dp * args.rows
    ids = torch.randint(1, 1024, (n_rows, args.seq_len), generator=g)
    pos = torch.empty_like(ids)
    for r in range(n_rows):
        t = 0
        while t < args.seq_len:
            n = min(int(torch.randint(8, max(9, args.seq_len // 2), (1,), generator=g)), args.seq_len - t)
            pos[r, t : t + n] = torch.arange(n)
            t += n
    labels = ids.clone()
    labels[pos == 0] = IGNORE_INDEX  # no label crosses a document boundary
    return {k: v.to(device) for k, v in {"input_ids": ids, "position_ids": pos, "labels": labels}.items()}


def train(args, device: torch.device) -> dict:
    """Run the steps on this rank; returns the global losses and grad norms (and on rank 0 ``check``'s result)."""
    rank = dist.get_rank()
    mesh = cpcompile.init_dp_cp_mesh(args.dp, args.cp, device_type=device.type)
    dp_group, cp_group = mesh.get_group("dp"), mesh.get_group("cp")
    dp_rank = mesh.get_local_rank("dp")

    model = build_model(args, device)
    cpcompile.fully_shard_dp_cp(model, mesh)  # parameters sharded over dp x cp, gradients summed over them
    backend = cpcompile.backend(cp_group, inner=args.compile_inner, block_size=args.block_size)
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(
            f"Qwen3-style model, {args.layers} layers, hidden {args.hidden}, {n_params / 1e6:.2f}M parameters; "
            f"dp={args.dp} x cp={args.cp} on {dist.get_world_size()} {device.type} processes "
            f"({dist.get_backend()}), {args.dp * args.rows} rows x {args.seq_len} tokens per step, "
            f"inner={args.compile_inner}, {args.layout} layout",
            flush=True,
        )

    losses, norms, first_grads, seconds = [], [], None, []
    tokens_per_step = args.dp * args.rows * args.seq_len
    bar = tqdm(total=args.steps, desc="train", unit="step", disable=rank != 0, dynamic_ncols=True)
    for step in range(args.steps):
        t0 = time.perf_counter()
        full = global_batch(args, step, device)
        rows = {k: v[dp_rank * args.rows : (dp_rank + 1) * args.rows] for k, v in full.items()}
        # balanced: from the second step on, on the forms and block size of the layers compiled in the first
        with cpcompile.shard(rows, cp_group, dp_group=dp_group, layout=args.layout) as local:
            out = compiled(**local)
            out.loss.backward()  # this rank's share of the global mean loss
        if args.check and step == 0:  # the first step's full gradients, for --check (collectives)
            first_grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        norm = cpcompile.clip_grad_norm_(model.parameters(), args.max_norm)
        norms.append(norm.item())
        if torch.isfinite(norm):
            opt.step()
        opt.zero_grad()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)  # the shares of all dp x cp ranks add up to the global batch's loss
        losses.append(loss.item())
        seconds.append(time.perf_counter() - t0)
        if not torch.isfinite(norm) and rank == 0:
            bar.write(f"step {step + 1}: non-finite gradient norm {norm.item()}, optimizer step skipped")
        bar.set_postfix(
            loss=f"{losses[-1]:.4f}", grad_norm=f"{norms[-1]:.4f}", tokens_s=f"{tokens_per_step / seconds[-1]:,.0f}"
        )
        bar.update()
    bar.close()
    if rank == 0:
        print(summary(losses, seconds, tokens_per_step), flush=True)

    result = {"losses": losses, "norms": norms, "check": None}
    if args.check:
        full_params = {n: p.full_tensor().detach() for n, p in model.named_parameters()}  # collective
        if rank == 0:
            result["check"] = check(args, device, losses, norms, first_grads, full_params)
        dist.barrier()
    return result


def summary(losses: list[float], seconds: list[float], tokens_per_step: int) -> str:
    """One line: steps, time, loss first -> last, throughput without the first step (which compiles)."""
    steady = seconds[1:] or seconds
    return (
        f"trained {len(losses)} steps in {sum(seconds):.1f} s (first step, with compiling: {seconds[0]:.1f} s); "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; {tokens_per_step * len(steady) / sum(steady):,.0f} tokens/s "
        f"after the first step ({tokens_per_step:,} tokens per step)"
    )


def check(args, device, losses, norms, first_grads, params) -> dict[str, float]:
    """The same steps in this process on the whole global batch; print and return the largest differences."""
    model = build_model(args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref_losses, ref_norms, ref_grads = [], [], None
    for step in range(args.steps):
        out = model(**global_batch(args, step, device), use_cache=False)
        out.loss.backward()
        if step == 0:
            ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        ref_norms.append(norm.item())
        if torch.isfinite(norm):
            opt.step()
        opt.zero_grad()
        ref_losses.append(out.loss.item())

    def largest(a: dict, b: dict) -> tuple[float, str]:
        return max(((a[n] - b[n]).abs().max().item(), n) for n in b)

    grad_diff, grad_name = largest(first_grads, ref_grads)
    param_diff, param_name = largest(params, {n: p.detach() for n, p in model.named_parameters()})
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    norm_diff = max(abs(a - b) for a, b in zip(norms, ref_norms, strict=True))
    print(f"--check: the same {args.steps} steps in one process on the global batch; largest differences:")
    print(f"  loss                  {loss_diff:.2e}")
    print(f"  grad norm             {norm_diff:.2e}")
    print(f"  gradient, first step  {grad_diff:.2e}  ({grad_name})")
    print(f"  parameter, last step  {param_diff:.2e}  ({param_name})")
    print("  Gradients differ only by fp32 rounding (another summation order). AdamW divides by sqrt(v) + eps")
    print(f"  (eps 1e-8): on gradient entries near zero that rounding can flip a step of up to lr = {args.lr:g},")
    print("  so a few parameter entries may differ by about lr per step; a wrong gradient shows in the rows above.")
    return {"loss": loss_diff, "grad_norm": norm_diff, "grad": grad_diff, "param": param_diff}


def main(argv=None) -> None:
    from _launch import launch  # the examples' folder: this script's own

    args = parse_args(argv)
    launch(train, args, args.dp * args.cp)


if __name__ == "__main__":
    sys.exit(main())
