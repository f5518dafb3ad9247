"""The one-thread gloo backend (``cpcompile.gloo_backend()``) and the warning about CP groups on stock gloo.

torch's ``ProcessGroupGloo`` runs each group's collectives on two worker threads that write the group's status
string without a lock; two collectives finishing together free its buffer twice (``cpcompile.runtime.gloo``).
Every multi-process test of this suite runs on the one-thread backend (``tests.harness.dist``); this file checks
that its groups, and the groups derived from them, really have one worker thread and compute what stock gloo
computes, and that a CP group on stock gloo gets the warning that names the fix.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from tests.harness.dist import run_distributed


def _threads_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import cpcompile
    from cpcompile import _compat
    from cpcompile.failsafe.state import group_state
    from cpcompile.runtime.gloo import BACKEND, gloo_worker_threads

    out = {"name": dist.get_backend(), "registered": cpcompile.gloo_backend()}
    ours = dist.new_group(list(range(world)))
    stock = dist.new_group(list(range(world)), backend="gloo")
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "cp"))
    out["threads"] = {
        "world": gloo_worker_threads(dist.group.WORLD),
        "new_group": gloo_worker_threads(ours),
        "mesh cp": gloo_worker_threads(mesh.get_group("cp")),
        "mesh dp": gloo_worker_threads(mesh.get_group("dp")),
        "stock gloo": gloo_worker_threads(stock),
    }
    # the functional all-gather (what compiled graphs issue) and an eager all-reduce give stock gloo's results
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * rank
    results = {}
    for label, group in (("ours", ours), ("stock", stock)):
        name = _compat.group_name_of(group)
        gathered = torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.all_gather_into_tensor(x, world, name)
        )
        summed = x.clone()
        dist.all_reduce(summed, group=group)
        results[label] = (gathered, summed)
    out["results"] = results
    out["expected"] = (
        torch.cat([torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * r for r in range(world)]),
        sum(torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * r for r in range(world)),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        group_state(ours)
        ours_warnings = [str(w.message) for w in caught]
        group_state(stock)
        group_state(dist.new_group(list(range(world)), backend="gloo"))  # a second stock group: warned once
    out["warnings"] = {"ours": ours_warnings, "stock": [str(w.message) for w in caught][len(ours_warnings) :]}
    out["backend_name"] = BACKEND
    return out


def test_one_thread_gloo_groups_compute_like_stock_gloo_and_stock_cp_groups_are_warned_about():
    for rank, out in enumerate(run_distributed(_threads_worker, 2)):
        assert out["name"] == out["registered"] == out["backend_name"], out["name"]
        assert out["threads"] == {"world": 1, "new_group": 1, "mesh cp": 1, "mesh dp": 1, "stock gloo": 2}, rank
        for label in ("ours", "stock"):
            for got, expected in zip(out["results"][label], out["expected"], strict=True):
                torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert out["warnings"]["ours"] == [], out["warnings"]
        stock = [w for w in out["warnings"]["stock"] if "worker threads" in w]
        assert len(stock) == 1, out["warnings"]["stock"]
        assert "gloo group with 2 worker threads" in stock[0]
        assert "cpcompile.gloo_backend()" in stock[0] and "heap corruption" in stock[0]
