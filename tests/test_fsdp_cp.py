"""FSDP2 x context parallelism: every optimizer step equals one single-process step on the global batch.

Every CP batch uses the balanced layout, with a block of 4 tokens so that these short rows are really
redistributed (``LAYOUT``; each case asserts that some rank holds more than one run of tokens).

One spawned run of 4 gloo processes (module fixture ``runs``) trains the same 3 AdamW steps as
(dp, cp) = (1, 2) [inductor] and (2, 1) side by side on ranks {0, 1} and {2, 3}, then (1, 1) on rank 3, then
(2, 2) on all four, plus two wrong setups that must fail: the seed's (FSDP over the dp mesh only, the CP
ranks' partial gradients never summed) and FSDP's default averaging over dp x cp. The same run checks
gathered log-probs / entropy / per-sample means with CP=4, ``clip_grad_norm_`` on DTensor gradients and
examples/train_fsdp_cp.py's training function (dp=2, cp=2) with its own single-process check. The fast tier runs
(2, 2) with the rewritten graph as traced (``inner="eager"``), the wrong setups, the log-probs, per-sample means
and clipping; the slow tier runs (2, 2) under ``aot_eager`` instead, and adds (1, 2) with inductor, (2, 1), (1, 1)
and the example. Every
expected value comes from the unsharded eager model (or ``torch.nn.utils.clip_grad_norm_``) in the pytest
process.
"""

from __future__ import annotations

import math

import pytest
import torch

from cpcompile.plan import Workload
from cpcompile.testing import packed_batch, tiny_model
from tests.harness.dist import run_distributed
from tests.harness.parity import cp_step, reference_step
from tests.harness.tiers import runs_slow, slow
from tests.harness.tolerances import (
    EXACT,
    GRAD_TOL,
    LOGITS_TOL,
    LOSS_TOL,
    NORM_TOL,
    PARAM_TOL,
    REDUCTION_TOL,
    SCALAR_ATOL,
)

#: The layout of every CP batch here: balanced, on blocks of 4 tokens (the default block of 128 would keep these
#: short rows contiguous).
LAYOUT = {"layout": "balanced", "workload": Workload(block_size=4)}

#: The slow tier's meshes: (dp, cp) = (1, 1), (1, 2) under inductor, (2, 1); (2, 2) and the wrong setups are in
#: the fast tier.
SLOW_MESHES = ("dp1_cp1", "dp1_cp2_inductor", "dp2_cp1")
STEPS = 3
MAX_NORM = 1.0  # below the tiny model's gradient norm (1.16-1.27 in these steps): clipping is active
LR = 1e-2
# AdamW's step lr * m / (sqrt(v) + eps) is normalised: a gradient rounding error delta changes it by up to
# ~2 * lr * delta / (|g| + eps). With the default eps=1e-8 a near-zero gradient entry (|g| ~ 1e-9, pure
# rounding noise) turns delta into a ~lr/10 parameter difference between a correct CP run and one process
# (measured 1e-5 after one step with eps=1e-6 and inductor). eps=1e-4 caps that amplification at lr/eps = 100
# while gradients of the size that matter here (~1e-3..1e-2) are normalised as usual.
EPS = 1e-4
ROWS = [[7, 20, 18], [45], [12, 12, 21], [30, 15]]  # 4 rows of 45 tokens: CP=2 pads to 46, dp=2 takes 2 rows each


def global_batch(step: int) -> dict[str, torch.Tensor]:
    rows = ROWS[step % len(ROWS) :] + ROWS[: step % len(ROWS)]
    return packed_batch(rows, seed=100 + step)


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, eps=EPS)


# -- the 4-process run ------------------------------------------------------------------------------------
def _full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(mesh, *, inner: str, mode: str = "cpcompile", be=None):
    """3 steps of FSDP2 + compiled CP on ``mesh`` (dims dp, cp); returns (record, backend)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import cpcompile

    dp_group, cp_group = mesh.get_group("dp"), mesh.get_group("cp")
    dp, cp = mesh.size(0), mesh.size(1)
    dp_rank = mesh.get_local_rank("dp")
    model = tiny_model("qwen3", seed=0)
    if mode == "seed":  # the seed's setup: FSDP over the dp mesh only, per-DP-rank denominator
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    else:
        cpcompile.fully_shard_dp_cp(model, mesh)
        if mode == "averaged":  # FSDP2's default: average over all dp x cp ranks
            for m in model.modules():
                if hasattr(m, "set_gradient_divide_factor"):
                    m.set_gradient_divide_factor(float(dp * cp))
    if be is None:
        # A new backend adds cache entries for every compiled frame; transformers' deprecation wrapper shares
        # one code object between the model's and the layers' forward, so a few configurations in one process
        # would pass Dynamo's recompile limit (and that frame would then run uncompiled, without CP attention).
        torch.compiler.reset()
        be = cpcompile.backend(cp_group, inner=inner)
    compiled = torch.compile(model, backend=be)
    opt = make_optimizer(model.parameters())
    rec = {"loss": [], "norm": [], "grads": [], "params": [], "runs": []}
    rows = 4 // dp
    for step in range(STEPS):
        batch = {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in global_batch(step).items()}
        kwargs = {} if mode == "seed" else {"dp_group": dp_group}
        rec["runs"].append(_runs(batch, cp_group))
        result = cp_step(
            compiled,
            model,
            batch,
            cp_group,
            layout=LAYOUT["layout"],
            shard_kwargs={"workload": LAYOUT["workload"]},
            full_grads=_full_grads,
            **kwargs,
        )
        loss = result.loss  # CP shares add up to the rows' loss
        dist.all_reduce(loss, group=dp_group)
        if mode == "seed":
            loss /= dp  # the seed averages DP ranks' losses
        rec["loss"].append(loss)
        rec["grads"].append(result.grads)
        rec["norm"].append(cpcompile.clip_grad_norm_(model.parameters(), MAX_NORM))
        opt.step()
        opt.zero_grad()
        rec["params"].append({n: _full(p) for n, p in model.named_parameters()})
    return rec, be


def _runs(batch, cp_group) -> int:
    """The most runs of consecutive tokens one rank holds when ``shard`` places ``batch`` with :data:`LAYOUT`."""
    import torch.distributed as dist

    import cpcompile
    from cpcompile.plan import count_runs

    plan = cpcompile.plan.build_plan(batch, dist.get_world_size(cp_group), 0, **LAYOUT)
    return int(count_runs(plan.indices).max())


def _full_grads(model, group) -> dict[str, torch.Tensor]:
    """FSDP2 already reduced every gradient over dp x cp: the whole gradient of every parameter."""
    return {n: _full(p.grad) for n, p in model.named_parameters()}


LOGPROB_ROWS = [[5, 30, 11], [12, 20, 14]]  # T=46 -> 48, CP=4, c=12: [5,35) spans ranks 0-2; [0,5) and [0,12) one rank
ENT_COEF = 0.01


def logprob_batch() -> dict[str, torch.Tensor]:
    batch = packed_batch(LOGPROB_ROWS, seed=7)
    batch["advantages"] = torch.randn(batch["input_ids"].shape, generator=torch.Generator().manual_seed(8))
    return batch


def _logprobs(world: int):
    """CP=4 over the world group: gathered log-probs/entropy, both per-sample-mean loss styles, their gradients."""
    import torch.distributed as dist

    import cpcompile

    group = dist.new_group(list(range(world)))
    model = tiny_model("qwen3", seed=3)
    torch.compiler.reset()  # see _train
    # inner="eager": the rewritten graph runs as traced (no AOTAutograd); the training cases cover the compilers
    compiled = torch.compile(model, backend=cpcompile.backend(group, inner="eager"))
    params = list(model.parameters())
    batch = logprob_batch()
    doc_full = _doc_ids(batch["position_ids"])
    mask_full = _shifted(batch["labels"]) != -100
    res = {}
    with cpcompile.shard(batch, group, **LAYOUT) as local:
        res["runs"] = _runs(batch, group)
        out = compiled(**local)
        lp_local = cpcompile.token_logprobs(out.logits, local["shift_labels"])
        ent_local = cpcompile.token_entropy(out.logits)
        lp, ent = cpcompile.gather(lp_local), cpcompile.gather(ent_local)
        # style 1: the same full-sequence loss on every CP rank, from gathered tensors
        loss_gather = reference_per_sample_mean(-lp * batch["advantages"] - ENT_COEF * ent, mask_full, doc_full)
        grads_gather = torch.autograd.grad(loss_gather, params, retain_graph=True)
        # style 2: local numerator, full-sample denominator
        mask = local["shift_labels"] != -100
        loss_local = cpcompile.per_sample_mean(-lp_local * local["advantages"], mask)
        grads_local = torch.autograd.grad(loss_local, params)
    for g in (*grads_gather, *grads_local):
        dist.all_reduce(g, group=group)  # CP ranks hold partial gradients: sum them
    loss_local = loss_local.detach().clone()
    dist.all_reduce(loss_local, group=group)
    res.update(
        logprobs=lp.detach(),
        entropy=ent.detach(),
        loss_gather=loss_gather.detach(),
        loss_local=loss_local,
        grads_gather=[g.clone() for g in grads_gather],
        grads_local=[g.clone() for g in grads_local],
    )
    return res


#: (mesh, norm type, value planted in one gradient): "1d" shards every DTensor gradient over the 4 ranks
#: (FSDP2); "2d" is a (Replicate, Shard) 2 x 2 mesh (HSDP), where the replicated copy must not count twice.
CLIP_CASES = [
    *[("1d", p, bad) for p in (2.0, 1.0, math.inf) for bad in (None, math.nan, math.inf)],
    ("2d", 2.0, None),
    ("2d", math.inf, None),
]
PSM_ROWS = [[5, 30, 11], [46], [20, 20, 6], [9, 9, 9, 19]]  # 4 rows of 46 tokens: dp=2 x cp=2


def psm_values() -> torch.Tensor:
    return torch.randn(len(PSM_ROWS), 46, generator=torch.Generator().manual_seed(9))


def _per_sample_mean_dp(mesh):
    """per_sample_mean with dp_group on a (2, 2) mesh: shares and gradients must add up over all 4 ranks."""
    import torch.distributed as dist

    import cpcompile

    dp_rank = mesh.get_local_rank("dp")
    values = psm_values().requires_grad_(True)
    batch = packed_batch(PSM_ROWS, seed=10)
    rows = slice(2 * dp_rank, 2 * dp_rank + 2)
    mine = {**{k: v[rows] for k, v in batch.items()}, "values": values[rows]}
    with cpcompile.shard(mine, mesh.get_group("cp"), dp_group=mesh.get_group("dp"), **LAYOUT) as local:
        runs = _runs(mine, mesh.get_group("cp"))
        loss = cpcompile.per_sample_mean(local["values"], local["shift_labels"] != -100, dp_group=mesh.get_group("dp"))
    loss.backward()
    loss, grad = loss.detach().clone(), values.grad.clone()
    dist.all_reduce(loss)  # the world is the (2, 2) mesh: every rank's share
    dist.all_reduce(grad)
    return {"loss": loss, "grad": grad, "runs": runs}


CLIP_SHAPES = [(7, 3), (3, 5), (16,)]  # uneven shards over 4 ranks; (3, 5) leaves rank 3 an empty shard


def clip_tensors(nonfinite: float | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    sharded = [torch.randn(s, generator=g) for s in CLIP_SHAPES]
    plain = torch.randn(4, 4, generator=g)
    if nonfinite is not None:
        sharded[0][6, 1] = nonfinite  # lives on the last rank's shard
    return sharded, plain


def _clip(rank: int, world: int):
    """clip_grad_norm_ on DTensor (Shard over 4 ranks / Replicate x Shard) and plain gradients."""
    from unittest import mock

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import cpcompile

    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
    out = {}
    meshes = {"1d": (mesh1, [Shard(0)]), "2d": (mesh2, [Replicate(), Shard(0)])}
    for mesh_name, norm_type, nonfinite in CLIP_CASES:
        mesh, placements = meshes[mesh_name]
        sharded, plain = clip_tensors(nonfinite)
        params = []
        for t in sharded:
            p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(t), mesh, placements))
            p.grad = distribute_tensor(t, mesh, placements)
            params.append(p)
        q = torch.nn.Parameter(torch.zeros_like(plain))
        q.grad = plain.clone()
        unused = torch.nn.Parameter(torch.zeros(5))  # no gradient: skipped
        calls = []
        real = dist.all_reduce
        with mock.patch.object(dist, "all_reduce", lambda *a, **k: calls.append(1) or real(*a, **k)):
            norm = cpcompile.clip_grad_norm_([*params, q, unused], MAX_NORM, norm_type)
        out[(mesh_name, norm_type, repr(nonfinite))] = {
            "norm": norm,
            "grads": [_full(p.grad) for p in params] + [q.grad.clone()],
            "all_reduces": len(calls),
        }
    sharded, plain = clip_tensors(math.nan)
    p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(sharded[0]), mesh1, [Shard(0)]))
    p.grad = distribute_tensor(sharded[0], mesh1, [Shard(0)])
    with pytest.raises(RuntimeError, match="non-finite"):
        cpcompile.clip_grad_norm_([p], MAX_NORM, error_if_nonfinite=True)
    with pytest.raises(ValueError, match="not both"):
        with cpcompile.shard(global_batch(0), mesh1.get_group(), num_items_in_batch=5, dp_group=mesh1.get_group()):
            pass
    return out


def _worker(rank: int, world: int, with_slow: bool):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    def mesh(ranks):  # every rank creates every mesh (group creation is collective); members use it
        return DeviceMesh("cpu", torch.tensor(ranks), mesh_dim_names=("dp", "cp"))

    m12, m21, m11, m22 = mesh([[0, 1]]), mesh([[2], [3]]), mesh([[3]]), mesh([[0, 1], [2, 3]])
    res = {}
    if not with_slow:
        pass
    elif rank in (0, 1):
        rec, _ = _train(m12, inner="inductor")
        res["dp1_cp2_inductor"] = rec
    else:
        # cp = 1: nothing to rewrite, the graph runs as traced
        rec, _ = _train(m21, inner="eager")
        res["dp2_cp1"] = rec
        if rank == 3:
            res["dp1_cp1"], _ = _train(m11, inner="eager")
    dist.barrier()
    inner = "aot_eager" if with_slow else "eager"  # the fast tier: the rewritten graph as traced
    res["dp2_cp2"], be = _train(m22, inner=inner)
    res["seed_dp2_cp2"], _ = _train(m22, inner=inner, mode="seed", be=be)
    res["averaged_dp2_cp2"], _ = _train(m22, inner=inner, mode="averaged", be=be)
    res["logprobs"] = _logprobs(world)
    res["per_sample_dp"] = _per_sample_mean_dp(m22)
    res["clip"] = _clip(rank, world)
    if with_slow:
        res["example"] = _example()
    return res


def _example():
    """examples/train_fsdp_cp.py's training function with dp=2, cp=2 and --check (its own comparison); its
    second step balances on the block of 4 tokens the first step's compilation recorded."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "examples" / "train_fsdp_cp.py"
    spec = importlib.util.spec_from_file_location("train_fsdp_cp", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = example.parse_args(
        "--dp 2 --cp 2 --steps 2 --seq-len 61 --layers 1 --hidden 32 --compile-inner eager --block-size 4 "
        "--check".split()
    )
    torch.compiler.reset()  # see _train
    return example.train(args, torch.device("cpu"))


@pytest.fixture(scope="module")
def runs(request):
    return run_distributed(_worker, 4, runs_slow(request), timeout_s=600)


# -- single-process references ----------------------------------------------------------------------------
def _shifted(labels: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(labels, -100)
    out[:, :-1] = labels[:, 1:]
    return out


def _doc_ids(position_ids: torch.Tensor) -> torch.Tensor:
    return (position_ids == 0).long().cumsum(-1)


def reference_per_sample_mean(values: torch.Tensor, mask: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """Mean over (row, document) samples of each sample's masked token mean, by explicit loops."""
    means = []
    for b in range(values.shape[0]):
        for d in doc[b].unique().tolist():
            sel = (doc[b] == d) & mask[b]
            if sel.any():
                means.append(values[b][sel].sum() / sel.sum())
    return torch.stack(means).mean()


@pytest.fixture(scope="module")
def reference():
    model = tiny_model("qwen3", seed=0)
    opt = make_optimizer(model.parameters())
    rec = {"loss": [], "norm": [], "grads": [], "params": []}
    for step in range(STEPS):
        result = reference_step(model, global_batch(step))
        rec["loss"].append(result.loss)
        rec["grads"].append(result.grads)
        rec["norm"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        opt.step()
        opt.zero_grad()
        rec["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})
    return rec


def assert_matches_reference(rec: dict, ref: dict) -> dict[str, float]:
    """Assert every step's loss, grad norm, gradients and parameters; return the largest differences."""
    worst = {"loss": 0.0, "norm": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(STEPS):
        for kind, tol in (("loss", LOSS_TOL), ("norm", NORM_TOL)):
            msg = f"step {step} {kind}"
            torch.testing.assert_close(rec[kind][step], ref[kind][step], **tol, msg=lambda m: f"{msg}: {m}")
        for kind, tol in (("grads", GRAD_TOL), ("params", PARAM_TOL)):
            for name, want in ref[kind][step].items():
                got = rec[kind][step][name]
                torch.testing.assert_close(got, want, **tol, msg=lambda m: f"step {step} {kind} {name}: {m}")
                key = "grad" if kind == "grads" else "param"
                worst[key] = max(worst[key], (got - want).abs().max().item())
        worst["loss"] = max(worst["loss"], (rec["loss"][step] - ref["loss"][step]).abs().item())
        worst["norm"] = max(worst["norm"], (rec["norm"][step] - ref["norm"][step]).abs().item())
    return worst


def _case(runs, name):
    found = [r[name] for r in runs if name in r]
    assert found, f"no rank reported {name}"
    return found[0]


# -- the tests --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [*(pytest.param(c, marks=slow) for c in SLOW_MESHES), "dp2_cp2"])
def test_fsdp_cp_steps_equal_single_process(runs, reference, case):
    rec = _case(runs, case)
    worst = assert_matches_reference(rec, reference)
    print(case, {k: f"{v:.1e}" for k, v in worst.items()}, "runs per step", rec["runs"])
    if "_cp1" not in case:
        assert max(rec["runs"]) > 1, f"{case}: the balanced layout kept contiguous chunks in every step"


def test_all_ranks_hold_the_same_parameters(runs):
    final = [r["dp2_cp2"]["params"][-1] for r in runs]
    for other in final[1:]:
        for name, p in final[0].items():
            torch.testing.assert_close(other[name], p, **EXACT)


@pytest.mark.parametrize("case", ["seed_dp2_cp2", "averaged_dp2_cp2"])
def test_wrong_cp_gradient_combination_is_caught(runs, reference, case):
    """The comparison above fails, by far more than its tolerances, when CP gradients are not summed right."""
    rec = _case(runs, case)
    with pytest.raises(AssertionError):
        assert_matches_reference(rec, reference)
    rel = (rec["norm"][0] - reference["norm"][0]).abs() / reference["norm"][0]
    assert rel > 0.2, f"{case}: step-0 grad norm only {rel:.1e} off the global batch's"
    grad_err = max((rec["grads"][0][n] - g).abs().max().item() for n, g in reference["grads"][0].items())
    assert grad_err > 1000 * GRAD_TOL["atol"], f"{case}: step-0 gradients only {grad_err:.1e} off"
    param_err = max((rec["params"][-1][n] - p).abs().max().item() for n, p in reference["params"][-1].items())
    print(f"{case}: step-0 norm off by {rel:.2f} (relative), gradients by {grad_err:.1e}, params by {param_err:.1e}")


def test_gathered_logprobs_and_per_sample_means(runs):
    model = tiny_model("qwen3", seed=3)
    params = list(model.parameters())
    batch = logprob_batch()
    logits = model(**batch, use_cache=False).logits.float()
    targets = _shifted(batch["labels"])
    mask = targets != -100
    logp_all = torch.log_softmax(logits, -1)
    lp = logp_all.gather(-1, targets.clamp(min=0)[..., None])[..., 0] * mask
    ent = -(logp_all.exp() * logp_all).sum(-1)
    doc = _doc_ids(batch["position_ids"])
    loss_gather = reference_per_sample_mean(-lp * batch["advantages"] - ENT_COEF * ent, mask, doc)
    grads_gather = torch.autograd.grad(loss_gather, params, retain_graph=True)
    loss_local = reference_per_sample_mean(-lp * batch["advantages"], mask, doc)
    grads_local = torch.autograd.grad(loss_local, params)
    for rank, r in enumerate(runs):
        got = r["logprobs"]
        assert got["runs"] > 1, "the balanced layout kept contiguous chunks"
        # per-token functions of the logits, which differ from the single process by fp32 reassociation
        torch.testing.assert_close(got["logprobs"], lp, **LOGITS_TOL, msg=lambda m: f"rank {rank}: {m}")
        torch.testing.assert_close(got["entropy"], ent, **LOGITS_TOL, msg=lambda m: f"rank {rank}: {m}")
        torch.testing.assert_close(got["loss_gather"], loss_gather, **LOSS_TOL)
        torch.testing.assert_close(got["loss_local"], loss_local, **LOSS_TOL)
        for g, want in zip(got["grads_gather"], grads_gather, strict=True):
            torch.testing.assert_close(g, want, **GRAD_TOL)
        for g, want in zip(got["grads_local"], grads_local, strict=True):
            torch.testing.assert_close(g, want, **GRAD_TOL)


def test_per_sample_mean_with_data_parallelism(runs):
    values = psm_values().requires_grad_(True)
    batch = packed_batch(PSM_ROWS, seed=10)
    mask = _shifted(batch["labels"]) != -100
    want = reference_per_sample_mean(values, mask, _doc_ids(batch["position_ids"]))
    want.backward()
    assert max(r["per_sample_dp"]["runs"] for r in runs) > 1, "the balanced layout kept contiguous chunks"
    for r in runs:
        torch.testing.assert_close(r["per_sample_dp"]["loss"], want.detach(), **LOSS_TOL)
        torch.testing.assert_close(r["per_sample_dp"]["grad"], values.grad, **GRAD_TOL)


@pytest.mark.parametrize(("mesh_name", "norm_type", "nonfinite"), CLIP_CASES)
def test_clip_grad_norm_dtensor(runs, mesh_name, norm_type, nonfinite):
    sharded, plain = clip_tensors(nonfinite)
    ref_params = [torch.nn.Parameter(torch.zeros_like(t)) for t in (*sharded, plain)]
    for p, t in zip(ref_params, (*sharded, plain), strict=True):
        p.grad = t.clone()
    want = torch.nn.utils.clip_grad_norm_(ref_params, MAX_NORM, norm_type)
    for rank, r in enumerate(runs):
        got = r["clip"][(mesh_name, norm_type, repr(nonfinite))]
        # a sum of a few dozen fp32 squares in another order
        torch.testing.assert_close(got["norm"], want, **REDUCTION_TOL, equal_nan=True)
        assert got["all_reduces"] == (0 if norm_type == math.inf else 1), got["all_reduces"]
        if nonfinite is None:
            expected = [p.grad for p in ref_params]  # torch's clipped gradients
        else:
            expected = [*sharded, plain]  # left unscaled; the non-finite norm is returned
        for g, e in zip(got["grads"], expected, strict=True):
            torch.testing.assert_close(g, e, **REDUCTION_TOL, equal_nan=True, msg=lambda m: f"rank {rank}: {m}")


@slow
def test_example_matches_one_process(runs):
    """The example's own --check: losses, grad norms and first-step gradients equal one process's."""
    checked = [r["example"]["check"] for r in runs if r["example"]["check"] is not None]
    assert len(checked) == 1, "rank 0 runs the single-process check"
    diffs = checked[0]
    print("example --check", {k: f"{v:.1e}" for k, v in diffs.items()})
    assert diffs["loss"] < SCALAR_ATOL, diffs
    assert diffs["grad_norm"] < SCALAR_ATOL, diffs
    assert diffs["grad"] < GRAD_TOL["atol"], diffs
    for r in runs:  # every rank reports the same global loss
        assert r["example"]["losses"] == runs[0]["example"]["losses"]


def test_clip_grad_norm_plain_single_process():
    import cpcompile

    g = torch.Generator().manual_seed(5)
    for norm_type in (2.0, 1.0, 3.0, math.inf):
        params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(3, 4), (5,), (2, 2)]]
        for p in params[:2]:
            p.grad = torch.randn(p.shape, generator=g)
        ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for p, r in zip(params, ref, strict=True):
            r.grad = None if p.grad is None else p.grad.clone()
        want = torch.nn.utils.clip_grad_norm_(ref, 0.5, norm_type)
        got = cpcompile.clip_grad_norm_(params, 0.5, norm_type)
        torch.testing.assert_close(got, want, **REDUCTION_TOL)
        assert params[2].grad is None
        for p, r in zip(params[:2], ref[:2], strict=True):
            torch.testing.assert_close(p.grad, r.grad, **REDUCTION_TOL)
    assert cpcompile.clip_grad_norm_([torch.nn.Parameter(torch.ones(2))], 1.0).item() == 0.0
    with pytest.raises(ValueError, match="norm_type"):
        cpcompile.clip_grad_norm_(params, 1.0, -1)
    with pytest.raises(ValueError, match="max_norm"):
        cpcompile.clip_grad_norm_(params, float("nan"))


def test_bad_input_is_refused_with_the_fix():
    import cpcompile

    with pytest.raises(ValueError, match="cp must be a positive int"):
        cpcompile.init_dp_cp_mesh(2, 0)
    with pytest.raises(TypeError, match="DeviceMesh"):
        cpcompile.fsdp.dp_cp_mesh("not a mesh")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        cpcompile.fully_shard_dp_cp(object(), None)
    logits = torch.zeros(2, 5, 7)
    with pytest.raises(ValueError, match="shift_labels"):
        cpcompile.token_logprobs(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        cpcompile.token_entropy(logits, temperature=0.0)
    with pytest.raises(RuntimeError, match="no cpcompile.shard context is active"):
        cpcompile.per_sample_mean(torch.zeros(2, 5), torch.ones(2, 5, dtype=torch.bool))
