"""GPU (H200) check and benchmark of the CP attention op: fwd+bwd TFLOP/s of useful work at T_local 8k-32k.

Every implementation of ``cpcompile::cp_attention`` runs (``loop``: the default ``attention="auto"`` on every
device; ``flex``; ``flash_varlen`` when flash-attn is installed). First each is checked at a small size, forward
and dQ/dK/dV, against dense SDPA under the plan's mask in float32: it passes when its error is at most twice dense
SDPA's own error in the same dtype (plus 1e-4); a path that fails is reported and left out of the timings. Then
the compile count of ``flex`` over 20 chunk lengths is printed (automatic dynamic shapes: at most 2 compiles).
Then, for every T_local, each path times the last CP rank (the one with the most visible keys) on a packed global
sequence of CP * T_local tokens, next to torch's own dense causal SDPA (``is_causal=True``) on one sequence with
the same number of visible (query, key) pairs. Useful work counts visible pairs only: forward 4 * pairs *
head_dim * heads FLOPs, backward 2.5x forward (FlashAttention's convention), so fwd+bwd = 3.5x forward.

Peak memory is ``torch.cuda.max_memory_allocated`` over one fwd+bwd call, inputs included.

``--dry-run`` runs the same logic on CPU at a tiny size (the loop only, plus flex's forward alone, which
compiles on CPU) to check the script without a GPU.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from benchmarks._common import packed_doc_lens, print_table
from cpcompile.kernels import cp_attention, dense_cp_attention
from cpcompile.kernels import library as _library
from cpcompile.plan import build_plan
from cpcompile.testing import packed_batch


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device, repeats: int) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def impls(device) -> list[str]:
    """The cp_attention implementations that can run on ``device``."""
    import importlib.util

    if device.type != "cuda":
        return ["loop"]
    return ["loop", "flex"] + (["flash_varlen"] if importlib.util.find_spec("flash_attn") else [])


def check_parity(device, dtype, impl: str) -> dict:
    """Max abs errors of out, dQ, dK, dV against dense SDPA under the plan mask run in float32 on the same inputs:
    ``impl`` in ``dtype`` as ``(name, impl_error)`` and dense SDPA in ``dtype`` as ``(name, dense_error)``, the
    error that ``dtype`` alone costs (FlashAttention's test convention compares the two)."""
    batch = packed_batch([[300, 5, 400, 319], [1024]])
    g = torch.Generator().manual_seed(0)
    errors: dict[str, list[float]] = {}
    for rank in range(4):
        plan = build_plan(batch, 4, rank, layout="contiguous")
        T, c = plan.padded_len, plan.chunk_len
        q, dout = (torch.randn(2, 8, c, 64, generator=g).to(device, dtype) for _ in range(2))
        k, v = (torch.randn(2, 2, T, 64, generator=g).to(device, dtype) for _ in range(2))
        pos = [t.to(device) for t in (plan.token_indices(), plan.gathered_indices(), plan.doc_ids)]
        runs = []
        for fn, kw, cast in (
            (dense_cp_attention, {}, torch.float32),
            (cp_attention, {"impl": impl}, dtype),
            (dense_cp_attention, {}, dtype),
        ):
            leaves = [t.to(cast).requires_grad_() for t in (q, k, v)]
            out = fn(*leaves, *pos, enable_gqa=True, **kw)
            runs.append([t.float() for t in (out, *torch.autograd.grad(out, leaves, dout.to(cast)))])
        ref, ours, dense = runs
        for name, r, a, b in zip(("out", "dq", "dk", "dv"), ref, ours, dense):
            e = errors.setdefault(name, [0.0, 0.0])
            e[0] = max(e[0], (a - r).abs().max().item())
            e[1] = max(e[1], (b - r).abs().max().item())
    return {name: tuple(e) for name, e in errors.items()}


#: A path passes when each of its errors against float32 is at most this many times dense SDPA's own error in the
#: same dtype, plus ``PARITY_ATOL`` (FlashAttention's tests use twice the reference implementation's error).
PARITY_FACTOR, PARITY_ATOL = 2.0, 1e-4


def flex_compiles_over_lengths(device, dtype, lengths: int = 20) -> int:
    """Graphs Dynamo compiled for cp_attention's flex path over ``lengths`` different chunk lengths."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    for i in range(lengths):
        batch = packed_batch([[100 + 7 * i, 60 + 3 * i]])
        plan = build_plan(batch, 2, 1, layout="contiguous")
        q = torch.randn(1, 4, plan.chunk_len, 64, device=device, dtype=dtype)
        k = torch.randn(1, 2, plan.padded_len, 64, device=device, dtype=dtype)
        pos = [t.to(device) for t in (plan.token_indices(), plan.gathered_indices(), plan.doc_ids)]
        cp_attention(q, k, k, *pos, enable_gqa=True, impl="flex")
    return counters["stats"]["unique_graphs"] - before


def check_flex_forward_on_cpu() -> float:
    """Dry run only: flex's forward with the plan's BlockMask vs dense SDPA (CPU flex: inference, no lse)."""
    from torch.nn.attention.flex_attention import flex_attention

    batch = packed_batch([[100, 3, 150], [253]])
    plan = build_plan(batch, 2, 1, layout="contiguous")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, plan.chunk_len, 16, generator=g)
    k, v = (torch.randn(2, 2, plan.padded_len, 16, generator=g) for _ in range(2))
    pos = (plan.token_indices(), plan.gathered_indices(), plan.doc_ids)
    block_mask = _library._flex_block_mask(*pos, None)
    with torch.no_grad():
        out = torch.compile(flex_attention)(q, k, v, block_mask=block_mask, scale=0.25, enable_gqa=True)
    ref = dense_cp_attention(q, k, v, *pos, scale=0.25, enable_gqa=True)
    return (out - ref).abs().max().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--t-local", default="8192,16384,32768")
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--docs", default="1024,16384", help="document length range lo,hi of the packed row")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU, to check the script")
    args = ap.parse_args()
    if args.dry_run:
        device, dtype = torch.device("cpu"), torch.float32
        args.t_local, args.heads, args.kv_heads, args.head_dim, args.docs = "256", 4, 2, 16, "64,512"
        print(f"flex forward on CPU vs dense: max abs error {check_flex_forward_on_cpu():.2e}")
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or pass --dry-run to check the script on CPU")
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
    exact = []
    for impl in impls(device):
        try:
            errors = check_parity(device, dtype, impl)
        except Exception as e:  # noqa: BLE001 - a path that fails is reported, the others still run
            print(f"{impl}: FAILED on {device} {dtype}: {type(e).__name__}: {e}")
            continue
        ok = all(ours <= PARITY_FACTOR * dense + PARITY_ATOL for ours, dense in errors.values())
        print(
            f"{impl} ({device}, {dtype}) vs dense SDPA in float32, max abs error {impl} / dense SDPA in {dtype} "
            f"(pass: at most {PARITY_FACTOR:g}x + {PARITY_ATOL:g}): {'exact' if ok else 'DIFFERS'}, "
            + ", ".join(f"{k} {a:.2e}/{b:.2e}" for k, (a, b) in errors.items())
        )
        if ok:
            exact.append(impl)
    if "flex" in exact:
        try:
            print(f"flex: {flex_compiles_over_lengths(device, dtype)} compile(s) over 20 chunk lengths")
        except Exception as e:  # noqa: BLE001 - reported; the timings at the long lengths still run
            print(f"flex over 20 chunk lengths: FAILED: {type(e).__name__}: {str(e)[:300]}")

    H, Hkv, D = args.heads, args.kv_heads, args.head_dim
    lo, hi = (int(x) for x in args.docs.split(","))
    rows = []
    for t_local in (int(x) for x in args.t_local.split(",")):
        batch = packed_batch(packed_doc_lens(args.cp * t_local, 1, lo, hi))
        plan = build_plan(batch, args.cp, args.cp - 1, layout="contiguous")
        visible = plan.visible_pairs()
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, H, t_local, D, generator=g).to(device, dtype).requires_grad_()
        k, v = (
            torch.randn(1, Hkv, plan.padded_len, D, generator=g).to(device, dtype).requires_grad_() for _ in range(2)
        )
        dout = torch.randn_like(q)
        pos = [t.to(device) for t in (plan.token_indices(), plan.gathered_indices(), plan.doc_ids)]
        # one causal sequence with the same number of visible pairs: L (L + 1) / 2 = visible
        L = int((math.isqrt(8 * visible + 1) - 1) // 2)
        qs, ks, vs = (torch.randn(1, h, L, D, generator=g).to(device, dtype).requires_grad_() for h in (H, Hkv, Hkv))
        douts = torch.randn_like(qs)

        def sdpa():
            out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            torch.autograd.grad(out, (qs, ks, vs), douts)

        flops = 3.5 * 4 * H * D
        t_sdpa = _time(sdpa, device, args.repeats)
        for impl in exact:

            def ours(impl=impl):
                out = cp_attention(q, k, v, *pos, enable_gqa=True, impl=impl)
                torch.autograd.grad(out, (q, k, v), dout)

            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t_ours = _time(ours, device, args.repeats)
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
            rows.append(
                {
                    "T_local": t_local,
                    "impl": impl,
                    "global T": plan.padded_len,
                    "visible pairs": visible,
                    "fwd+bwd (ms)": 1e3 * t_ours,
                    "TFLOP/s": flops * visible / t_ours / 1e12,
                    "peak GiB": peak,
                    "causal SDPA length": L,
                    "SDPA fwd+bwd (ms)": 1e3 * t_sdpa,
                    "TFLOP/s ours/SDPA": (visible / t_ours) / (L * (L + 1) / 2 / t_sdpa),
                }
            )
    print_table(
        f"CP attention op, last of {args.cp} ranks, {device} {str(dtype).removeprefix('torch.')}, heads {H}/{Hkv} kv, "
        f"head dim {D}, documents {lo}..{hi} tokens" + (" (DRY RUN: CPU, tiny)" if args.dry_run else ""),
        rows,
    )


if __name__ == "__main__":
    main()
