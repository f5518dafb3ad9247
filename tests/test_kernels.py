"""The block attention kernel (cpcompile.kernels) against dense SDPA under the plan's mask, and end to end."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cpcompile
from cpcompile import _compat
from cpcompile.kernels import block_schedule, computed_pairs, cp_attention, dense_cp_attention, varlen_layout
from cpcompile.plan import build_plan
from cpcompile.testing import packed_batch
from tests.harness.tolerances import ELEMENTWISE_TOL, EXACT, FP64_TOL, KERNEL_TOL


@dataclasses.dataclass(frozen=True)
class Case:
    doc_lens: list  # per row; rows of equal total
    cp_size: int
    heads: int
    kv_heads: int
    window: int | None
    block_q: int
    block_k: int


CASES = [
    # documents crossing chunk boundaries, padding (T=157 not a multiple of 2 or 4), GQA, many skipped blocks
    Case([[40, 3, 70, 44], [157]], 2, 4, 2, None, 16, 16),
    Case([[40, 3, 70, 44], [1, 100, 56]], 4, 4, 2, None, 8, 32),
    # one query block wider than the key block and vice versa, no GQA, single process
    Case([[90, 67], [20, 20, 117]], 1, 2, 2, None, 32, 8),
    # sliding window (keys before the window skipped even inside a document)
    Case([[120, 37], [157]], 2, 4, 1, 24, 16, 16),
]


def _inputs(case: Case, seed: int):
    g = torch.Generator().manual_seed(seed)
    batch = packed_batch(case.doc_lens, seed=seed)
    plans = [build_plan(batch, case.cp_size, r, layout="contiguous") for r in range(case.cp_size)]
    B, Tp, c = len(case.doc_lens), plans[0].padded_len, plans[0].chunk_len
    k = torch.randn(B, case.kv_heads, Tp, 16, generator=g)
    v = torch.randn(B, case.kv_heads, Tp, 12, generator=g)
    qs = [torch.randn(B, case.heads, c, 16, generator=g) for _ in plans]
    douts = [torch.randn(B, case.heads, c, 12, generator=g) for _ in plans]
    return plans, qs, k, v, douts


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"cp{c.cp_size}-h{c.heads}kv{c.kv_heads}-w{c.window}-b{c.block_q}x{c.block_k}"
)
def test_kernel_matches_sdpa_under_plan_mask(case: Case):
    """Forward and dQ/dK/dV of every rank against fp64 SDPA with CPPlan.mask, on the gathered K/V."""
    plans, qs, k, v, douts = _inputs(case, seed=3)
    gqa = case.heads != case.kv_heads
    for plan, q, dout in zip(plans, qs, douts):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        keys = torch.arange(plan.padded_len)  # k/v hold the whole sequence in token order
        out = cp_attention(
            *leaves,
            plan.token_indices(),
            keys,
            plan.doc_ids,
            window=case.window,
            enable_gqa=gqa,
            block_q=case.block_q,
            block_k=case.block_k,
        )
        grads = torch.autograd.grad(out, leaves, dout)

        ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
        mask = plan.mask(documents=True, window=case.window)
        ref = torch.nn.functional.scaled_dot_product_attention(*ref_leaves, attn_mask=mask, enable_gqa=gqa)
        ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double())

        assert out.dtype == q.dtype and out.shape == ref.shape
        torch.testing.assert_close(out, ref.float(), **KERNEL_TOL)
        for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
            torch.testing.assert_close(got, want.float(), **KERNEL_TOL, msg=lambda m: f"{name}: {m}")

        # the dense reference path builds exactly the plan's mask (same SDPA call: identical result)
        dense = dense_cp_attention(
            q, k, v, plan.token_indices(), keys, plan.doc_ids, window=case.window, enable_gqa=gqa
        )
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        torch.testing.assert_close(dense, want, **EXACT)


def test_schedule_skips_masked_blocks():
    """The kernel visits every visible pair, skips future chunks and other documents, and on packed data
    computes at most 1.25x the visible pairs at block 128."""
    # small: the schedule covers the whole mask, and skips blocks
    batch = packed_batch([[40, 3, 70, 44], [1, 100, 56]])
    for r in range(4):
        plan = build_plan(batch, 4, r, layout="contiguous")
        bounds, sched = block_schedule(plan.visible_blocks(8, 16))
        mask = plan.mask(documents=True)
        covered = torch.zeros_like(mask)
        for b, row in enumerate(sched):
            for i, pieces in enumerate(row):
                rows = slice(bounds[i], bounds[i + 1])
                for p in pieces:
                    covered[b, 0, rows, p.start : p.end] = True
                    if not p.masked:  # unmasked pieces must be fully visible
                        assert bool(mask[b, 0, rows, p.start : p.end].all())
        assert not bool((mask & ~covered).any()), f"rank {r}: a visible pair is not computed"
        assert int(covered.sum()) < covered.numel() // 2, f"rank {r}: most of the dense mask should be skipped"
        assert computed_pairs(bounds, sched) == plan.visible_blocks(8, 16).computed_pairs()

    # packed 16k rows of documents of 256..4096 tokens: computed / visible <= 1.25 at every CP size
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(2):
        lens = []
        while sum(lens) < 16384:
            lens.append(int(torch.randint(256, 4096, (1,), generator=g)))
        lens[-1] -= sum(lens) - 16384
        rows.append([n for n in lens if n > 0])
    batch = packed_batch(rows)
    for n in (1, 2, 4):
        computed = visible = 0
        for r in range(n):
            plan = build_plan(batch, n, r, layout="contiguous")
            computed += computed_pairs(*block_schedule(plan.visible_blocks(128, 128)))
            # query i sees its own document's keys 0..position_ids[i] (positions restart at every document)
            visible += int((plan.local(plan.position_ids) + 1).sum())
        assert visible <= computed <= 1.25 * visible, (n, computed / visible)


@pytest.mark.parametrize("window", [None, 24])
def test_varlen_layout_reproduces_plan_mask(window):
    """The flash-attn varlen segments (CUDA path) with bottom-right causal alignment, emulated here with SDPA per
    segment, give the plan-mask attention of every rank (flash-attn itself needs a GPU)."""
    batch = packed_batch([[40, 3, 70, 44], [1, 100, 56]])
    g = torch.Generator().manual_seed(1)
    for r in range(4):
        plan = build_plan(batch, 4, r, layout="contiguous")
        B, c, T = 2, plan.chunk_len, plan.padded_len
        q = torch.randn(B, 4, c, 8, generator=g, dtype=torch.float64)
        k, v = (torch.randn(B, 2, T, 8, generator=g, dtype=torch.float64) for _ in range(2))
        layout = varlen_layout(plan.doc_ids, plan.token_indices(), torch.arange(T), window)
        q_flat = q.transpose(1, 2).reshape(B * c, 4, 8)
        out = torch.empty_like(q_flat)
        for s, (b, ks, ke) in enumerate(layout.keys):
            q0, q1 = layout.cu_q[s], layout.cu_q[s + 1]
            assert layout.cu_k[s + 1] - layout.cu_k[s] == ke - ks
            nq, nk = q1 - q0, ke - ks
            qi = torch.arange(nq)[:, None] + (nk - nq)  # bottom-right aligned query positions among the keys
            kj = torch.arange(nk)[None, :]
            mask = (kj <= qi) & ((kj > qi - window) if window else True)
            seg = torch.nn.functional.scaled_dot_product_attention(
                q_flat[q0:q1].transpose(0, 1), k[b, :, ks:ke], v[b, :, ks:ke], attn_mask=mask, enable_gqa=True
            )
            out[q0:q1] = seg.transpose(0, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=plan.mask(documents=True, window=window), enable_gqa=True
        )
        # fp64 on both sides, same softmax over the same keys: only summation order differs
        torch.testing.assert_close(out.view(B, c, 4, 8).transpose(1, 2), ref, **FP64_TOL)


def test_bad_inputs_are_rejected():
    batch = packed_batch([[20, 12]])
    plan = build_plan(batch, 2, 1, layout="contiguous")
    q, k = torch.randn(1, 4, 16, 8), torch.randn(1, 2, 32, 8)
    q_pos, kv_pos = plan.token_indices(), torch.arange(32)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        cp_attention(q, k, k, q_pos, kv_pos, plan.doc_ids)
    with pytest.raises(ValueError, match="non-decreasing"):
        cp_attention(q, k, k, q_pos, kv_pos, plan.doc_ids.flip(1), enable_gqa=True)
    with pytest.raises(ValueError, match="outside"):
        cp_attention(q, k, k, q_pos + 16, kv_pos, plan.doc_ids, enable_gqa=True)
    with pytest.raises(ValueError, match="one global index per query"):
        cp_attention(q, k, k, q_pos[:-1], kv_pos, plan.doc_ids, enable_gqa=True)
    with pytest.raises(ValueError, match="strictly ascending"):
        cp_attention(q, k, k, q_pos.flip(0), kv_pos, plan.doc_ids, enable_gqa=True)
    with pytest.raises(ValueError, match="window"):
        cp_attention(q, k, k, q_pos, kv_pos, plan.doc_ids, window=0, enable_gqa=True)
    with pytest.raises(ValueError, match="attention='flash'"):
        cpcompile.options.BackendOptions(attention="flash")
    with pytest.raises(ValueError, match="block_size"):
        cpcompile.options.BackendOptions(block_size=0)


@torch.library.custom_op("cpcompile_test::grad_inside", mutates_args=())
def _grad_inside(x: torch.Tensor) -> torch.Tensor:
    with _compat.autograd_inside_custom_op():
        leaf = x.detach().requires_grad_()
        return torch.autograd.grad((leaf.sin() * leaf).sum(), leaf)[0]


def test_autograd_inside_custom_op():
    """The CUDA path's backward recomputes flex_attention under autograd inside an op implementation."""
    x = torch.randn(5, requires_grad=True)
    torch.testing.assert_close(_grad_inside(x), x.detach().cos() * x.detach() + x.detach().sin(), **ELEMENTWISE_TOL)


def test_fake_kernels_match_real_outputs():
    """The fake (meta) kernels that torch.compile traces with agree with the real ops, strides included (inductor
    checks them), with q/k/v laid out as transformers makes them ([B, T, H, D] transposed: not contiguous)."""
    batch = packed_batch([[20, 13]])
    plan = build_plan(batch, 2, 1, layout="contiguous")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 17, 4, 8, generator=g).transpose(1, 2)
    k, v = (torch.randn(1, 34, 2, 8, generator=g).transpose(1, 2) for _ in range(2))
    positions = (plan.token_indices(), plan.gathered_indices(), plan.doc_ids)
    args = (None, None, True, 8, 8, "loop")
    out, lse = torch.ops.cpcompile.cp_attention(q, k, v, *positions, *args)
    dout = torch.randn(1, 17, 4, 8, generator=g).transpose(1, 2)
    only_fake = ("test_faketensor",)
    torch.library.opcheck(torch.ops.cpcompile.cp_attention.default, (q, k, v, *positions, *args), test_utils=only_fake)
    torch.library.opcheck(
        torch.ops.cpcompile.cp_attention_backward.default,
        (dout, q, k, v, *positions, out, lse, *args),
        test_utils=only_fake,
    )


def _largest_tensor_made(fn) -> int:
    """The most elements of any tensor an aten op returns while ``fn`` runs (inputs excluded)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    Largest.most = max(Largest.most, t.numel())
            return out

    with Largest():
        fn()
    return Largest.most


def test_block_loop_memory_grows_with_the_chunk_not_with_chunk_times_length():
    """The default path never builds a [c, T] mask or score matrix: per call, its largest tensor grows like
    c * block (and the inputs), not like c * T; the dense path, the negative control, grows like c * T."""
    largest = {}
    for T in (512, 2048):  # CP=4: c = 128 and 512
        batch = packed_batch([[T // 2, T // 2]])
        plan = build_plan(batch, 4, 3, layout="contiguous")
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 2, plan.chunk_len, 8, generator=g, requires_grad=True)
        k, v = (torch.randn(1, 2, T, 8, generator=g, requires_grad=True) for _ in range(2))
        positions = (plan.token_indices(), plan.gathered_indices(), plan.doc_ids)
        for name, fn in (
            ("loop", lambda: cp_attention(q, k, v, *positions, block_q=32, block_k=32).sum().backward()),
            ("dense", lambda: dense_cp_attention(q, k, v, *positions).sum().backward()),
        ):
            largest[name, T] = _largest_tensor_made(fn)
    loop_growth, dense_growth = (
        largest["loop", 2048] / largest["loop", 512],
        largest["dense", 2048] / largest["dense", 512],
    )
    assert loop_growth <= 4.5, largest  # linear: the chunk (and the inputs) grew 4x
    assert dense_growth >= 12, largest  # quadratic: c * T grew 16x
