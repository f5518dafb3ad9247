"""A recurrent core whose transformers wrapper resolved a fused kernel (``mamba_ssm``, ``fla``) runs its torch path
under CP, and the kernel outside CP.

transformers' ``use_kernel_func_from_hub_with_fallback`` binds a core (Mamba2's ``mamba2_chunk_scan``, the gated
delta rule) to the fused package's kernel when the package imports, else to the torch path. A kernel is opaque to
the mixing pass, or cut off from the graph by Dynamo, where it runs on this rank's tokens only. No fused package
installs on this CPU machine, so the ranks here install a stand-in ``mamba_ssm`` before transformers' Bamba is
imported (fresh processes): its ``mamba_chunk_scan_combined`` computes the torch path's result, eagerly, behind
``torch.compiler.disable``, as a kernel Dynamo does not trace (a graph break). Model: transformers Bamba (a Mamba2
layer, then an attention layer), T = 37 with the packed documents of tests/test_hybrids_parity.py, CP=2 contiguous.

* With the fix, the core is reported ``head_parallel`` and equals one process (whose eager core is the stand-in).
* Any other function bound to a fused kernel gets its torch path under CP too: the stand-in ``causal_conv1d``'s
  ``causal_conv1d_fn`` (the conv before the scan), whose torch path the mixing pass gives a halo.
* The negative controls (fresh processes too): every wrapper left alone, as before, and the conv's alone, must
  fail the parity check: the stand-ins ran on each rank's own tokens.
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

    calls: dict[str, list] = {"scan": [], "conv": []}

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

    names = ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton", "mamba_ssm.ops.triton.ssd_combined")
    modules = {name: types.ModuleType(name) for name in names}
    for parent, child in zip(names, names[1:]):
        setattr(modules[parent], child.rsplit(".", 1)[1], modules[child])
    modules[names[-1]].mamba_chunk_scan_combined = mamba_chunk_scan_combined

    @torch.compiler.disable
    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, activation=None):
        from transformers.models.bamba import modeling_bamba

        calls["conv"].append(x.shape[-1])
        return modeling_bamba.causal_conv1d_fn.__wrapped__(x, weight, bias, activation=activation)

    modules["causal_conv1d"] = types.ModuleType("causal_conv1d")
    modules["causal_conv1d"].causal_conv1d_fn = causal_conv1d_fn
    sys.modules.update(modules)
    return calls


def _case():
    from tests.test_hybrids_parity import _case as hybrid_case

    return hybrid_case(model="bamba")


def _worker(rank: int, world: int, control: str) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    calls = _install_stand_ins()
    from transformers.models.bamba import modeling_bamba

    from cpcompile import cores
    from tests.test_hybrids_parity import _run

    resolved = [cores._fused_kernel(modeling_bamba.mamba2_chunk_scan) is not None]
    resolved.append(cores._fused_kernel(modeling_bamba.causal_conv1d_fn) is not None)
    if control == "every kernel":  # the wrappers left alone, as before: the kernels run under CP
        cores._fused_kernel = lambda wrapped: None
    if control == "conv":  # the conv's wrapper left alone: its kernel runs under CP
        from cpcompile import fused

        fused.register_fused_functions = lambda: None
    if control:
        from tests.harness.parity import ParityRunner, assert_parity

        bad = ParityRunner(dataclasses.replace(_case(), expected_mixing=None), dist.group.WORLD).run()
        try:
            assert_parity(bad)
        except AssertionError as e:
            return {"resolved": resolved, "caught": True, "message": str(e).splitlines()[0], **bad.errors()}
        return {"resolved": resolved, "caught": False, **bad.errors()}
    cases = _run([_case()], dist.group.WORLD)
    under_cp = {k: sorted(set(v)) for k, v in calls.items()}
    # outside CP, compiled: the replacement calls the kernel as the wrapper does
    from cpcompile.testing import packed_batch, tiny_model
    from tests.test_hybrids_parity import DOCS

    for v in calls.values():
        del v[:]
    torch.compile(tiny_model("bamba"), backend="eager")(**packed_batch([list(d) for d in DOCS]))
    return {"resolved": resolved, "cases": cases, "lengths_under_cp": under_cp, "lengths_outside_cp": calls}


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_a_core_bound_to_a_fused_kernel_runs_its_torch_path_under_cp():
    for got in run_distributed(_worker, 2, "", timeout_s=TIMEOUT_S, fresh=True):
        assert got["resolved"] == [True, True], "transformers' wrappers did not resolve the stand-ins"
        print(f"\n{got['cases']}")
        # the one-process reference ran the stand-ins on the whole sequence (37 tokens); the CP run never ran them
        # (on a rank's 19 tokens)
        assert got["lengths_under_cp"] == {"scan": [37], "conv": [37]}, got
        assert {k: sorted(set(v)) for k, v in got["lengths_outside_cp"].items()} == {"scan": [37], "conv": [37]}, got


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("control", ["every kernel", "conv"])
def test_a_fused_kernel_left_alone_under_cp_fails_parity(control):
    for got in run_distributed(_worker, 2, control, timeout_s=TIMEOUT_S, fresh=True):
        assert got["resolved"] == [True, True], got
        print(f"\ncontrol (the kernel on each rank's own tokens): {got}")
        assert got["caught"], f"the kernel on each rank's own tokens passed the parity check: {got}"
