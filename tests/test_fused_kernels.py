"""A recurrent core whose transformers wrapper resolved a fused kernel (``mamba_ssm``, ``fla``) runs its torch path
under CP, and the kernel outside CP.

transformers' ``use_kernel_func_from_hub_with_fallback`` binds a core (Mamba2's ``mamba2_chunk_scan``, the gated
delta rule) to the fused package's kernel when the package imports, else to the torch path. A kernel is opaque to
the mixing pass, or cut off from the graph by Dynamo, where it runs on this rank's tokens only. No fused package
installs on this CPU machine, so the ranks here install stand-in ``mamba_ssm`` and ``causal_conv1d`` packages before
transformers' model is imported (fresh processes): each kernel computes the torch path's result, eagerly, behind
``torch.compiler.disable``, as a kernel Dynamo does not trace (a graph break): ``mamba_chunk_scan_combined``,
``causal_conv1d_fn`` and ``mamba_inner_fn`` (Mamba's whole mixer fused; equal to its torch path to 0.0 in one
process). Models: transformers Bamba (a Mamba2 layer, then an attention layer) and Mamba (two Mamba layers), T = 37
with the packed documents of tests/test_hybrids_parity.py, CP=2 contiguous.

* With the fix, the core is reported ``head_parallel`` and equals one process (whose eager core is the stand-in).
* Any other function bound to a fused kernel gets its torch path under CP too: ``causal_conv1d_fn`` (the conv
  before the scan), whose torch path the mixing pass gives a halo, and Mamba's ``mamba_inner_fn``, whose torch
  path returns ``None`` so that the mixer runs its own (the conv a halo, the scan head-parallel).
* The negative controls (fresh processes too): Bamba with every wrapper left alone, as before, or the non-core
  ones alone, must fail the parity check (the stand-ins ran on each rank's own tokens); Mamba with its fused mixer
  left alone compiles no graph that mixes tokens, and the step's check raises ``UnsupportedAttentionError``.
* Outside CP (one process, compiled) the stand-in kernel runs: the replacement calls it as the wrapper does.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest

from tests.harness.dist import run_distributed

#: The job's timeout: fresh processes, one Bamba compile.
TIMEOUT_S = 240


def _install_stand_ins() -> dict[str, list]:
    """Put a ``mamba_ssm`` package whose ``mamba_chunk_scan_combined`` is the torch path run eagerly (behind
    ``torch.compiler.disable``) in ``sys.modules``, and a ``causal_conv1d`` package whose ``causal_conv1d_fn`` is;
    returns the lists of the lengths each was called with."""
    import torch

    calls: dict[str, list] = {"scan": [], "conv": [], "inner": []}

    @torch.compiler.disable
    def mamba_chunk_scan_combined(
        x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
        cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
    ):  # fmt: skip
        from transformers.models.bamba import modeling_bamba

        calls["scan"].append(x.shape[1])
        torch_path = modeling_bamba.mamba2_chunk_scan.__wrapped__
        return torch_path(
            x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, initial_states=initial_states,
            dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=return_final_states,
        )  # fmt: skip

    @torch.compiler.disable
    def mamba_inner_fn(
        xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight, out_proj_bias, A,
        B=None, C=None, D=None, delta_bias=None, delta_softplus=True,
    ):  # fmt: skip
        # Mamba's mixer fused: conv, projections, selective scan, gate, out projection (its torch path's math)
        from transformers.models.mamba import modeling_mamba

        calls["inner"].append(xz.shape[-1])
        x, z = xz.chunk(2, dim=1)
        x = modeling_mamba.causal_conv1d_fn.__wrapped__(x, conv1d_weight.squeeze(1), conv1d_bias, activation="silu")
        rank, n = delta_proj_weight.shape[1], A.shape[1]
        dt, b, c = torch.split(torch.nn.functional.linear(x.transpose(1, 2), x_proj_weight), [rank, n, n], dim=-1)
        y = modeling_mamba.mamba_selective_scan.__wrapped__(
            x, delta_proj_weight @ dt.transpose(1, 2), A, b.transpose(1, 2), c.transpose(1, 2), D=D, z=z,
            delta_bias=delta_bias, delta_softplus=delta_softplus,
        )  # fmt: skip
        return torch.nn.functional.linear(y.transpose(1, 2), out_proj_weight, out_proj_bias)

    names = ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton", "mamba_ssm.ops.triton.ssd_combined")
    modules = {name: types.ModuleType(name) for name in (*names, "mamba_ssm.ops.selective_scan_interface")}
    for parent, child in (*zip(names, names[1:]), ("mamba_ssm.ops", "mamba_ssm.ops.selective_scan_interface")):
        setattr(modules[parent], child.rsplit(".", 1)[1], modules[child])
    modules[names[-1]].mamba_chunk_scan_combined = mamba_chunk_scan_combined
    modules["mamba_ssm.ops.selective_scan_interface"].mamba_inner_fn = mamba_inner_fn

    @torch.compiler.disable
    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, activation=None):
        from transformers.models.bamba import modeling_bamba

        calls["conv"].append(x.shape[-1])
        return modeling_bamba.causal_conv1d_fn.__wrapped__(x, weight, bias, activation=activation)  # Mamba's too

    modules["causal_conv1d"] = types.ModuleType("causal_conv1d")
    modules["causal_conv1d"].causal_conv1d_fn = causal_conv1d_fn
    sys.modules.update(modules)
    return calls


def _case(model: str):
    from tests.test_hybrids_parity import _case as hybrid_case

    return hybrid_case(model=model)


#: The functions each model's module binds to the stand-ins.
BOUND = {"bamba": ("mamba2_chunk_scan", "causal_conv1d_fn"), "mamba": ("mamba_inner_fn", "causal_conv1d_fn")}
#: The stand-ins the one-process reference calls, once per layer on the whole sequence (37 tokens); the CP run
#: calls none (it would on a rank's 19 tokens). Mamba's reference runs the fused mixer, conv included.
REFERENCE_CALLS = {"bamba": {"scan": [37], "conv": [37], "inner": []}, "mamba": {"scan": [], "conv": [], "inner": [37]}}


def _worker(rank: int, world: int, model: str, control: str) -> dict:
    import importlib

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    calls = _install_stand_ins()
    module = importlib.import_module(f"transformers.models.{model}.modeling_{model}")

    from cpcompile import cores
    from tests.test_hybrids_parity import _run

    resolved = [cores._fused_kernel(getattr(module, name)) is not None for name in BOUND[model]]
    if control == "every kernel":  # the wrappers left alone, as before: the kernels run under CP
        cores._fused_kernel = lambda wrapped: None
    if control == "non-core":  # the wrappers of the conv and of Mamba's fused mixer left alone
        from cpcompile import fused

        fused.register_fused_functions = lambda: None
    if control:
        import cpcompile
        from tests.harness.parity import ParityRunner, assert_parity

        try:
            bad = ParityRunner(dataclasses.replace(_case(model), expected_mixing=None), dist.group.WORLD).run()
        except cpcompile.UnsupportedAttentionError as e:  # no graph mixed tokens: the step's check refuses it
            return {"resolved": resolved, "caught": True, "error": type(e).__name__, "message": str(e)[:200]}
        try:
            assert_parity(bad)
        except AssertionError as e:
            return {"resolved": resolved, "caught": True, "message": str(e).splitlines()[0], **bad.errors()}
        return {"resolved": resolved, "caught": False, **bad.errors()}
    cases = _run([_case(model)], dist.group.WORLD)
    under_cp = {k: sorted(set(v)) for k, v in calls.items()}
    # outside CP, compiled: the replacement calls the kernel as the wrapper does
    from cpcompile.testing import packed_batch, tiny_model
    from tests.test_hybrids_parity import DOCS

    for v in calls.values():
        del v[:]
    torch.compile(tiny_model(model), backend="eager")(**packed_batch([list(d) for d in DOCS]))
    return {"resolved": resolved, "cases": cases, "lengths_under_cp": under_cp, "lengths_outside_cp": calls}


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("model", ["bamba", "mamba"])
def test_functions_bound_to_fused_kernels_run_their_torch_path_under_cp(model):
    for got in run_distributed(_worker, 2, model, "", timeout_s=TIMEOUT_S, fresh=True):
        assert got["resolved"] == [True, True], "transformers' wrappers did not resolve the stand-ins"
        print(f"\n{got['cases']}")
        assert got["lengths_under_cp"] == REFERENCE_CALLS[model], got
        outside = {k: sorted(set(v)) for k, v in got["lengths_outside_cp"].items()}
        assert outside == REFERENCE_CALLS[model], got


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize(
    ("model", "control"),
    [pytest.param("bamba", "every kernel", marks=pytest.mark.slow), ("bamba", "non-core"), ("mamba", "non-core")],
)
def test_a_fused_kernel_left_alone_under_cp_fails(model, control):
    """Bamba's kernels on each rank's tokens fail the parity check. Mamba's fused mixer is its only op that mixes
    tokens: left alone, no compiled graph mixes tokens and the step's check raises (``token_mixing``)."""
    for got in run_distributed(_worker, 2, model, control, timeout_s=TIMEOUT_S, fresh=True):
        assert got["resolved"] == [True, True], got
        print(f"\ncontrol (the kernel on each rank's own tokens): {got}")
        assert got["caught"], f"the kernel on each rank's own tokens passed the parity check: {got}"
