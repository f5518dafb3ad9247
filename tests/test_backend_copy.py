"""A backend survives wrappers that copy or pickle their arguments (Lightning's ``torch.compile`` deep-copies them).

The copy/pickle checks run in new processes forked from the test harness's fork server, with a fake process group
(no other test's default group in the way); the Lightning check runs CP=2 on two gloo processes that imported
``lightning`` first.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.harness.dist import run_alone, run_distributed
from tests.harness.tiers import slow
from tests.harness.tolerances import LOGITS_TOL, LOSS_TOL


def _copies() -> dict:
    import copy
    import pickle

    import cpcompile
    from cpcompile import _compat

    with _compat.fake_process_group(0, 2) as group:
        b = cpcompile.backend(group, inner="aot_eager", block_size=64)
        return {
            "deepcopy_is_same": copy.deepcopy(b) is b,
            "copy_is_same": copy.copy(b) is b,
            "deepcopy_in_dict_is_same": copy.deepcopy({"backend": b, "mode": None})["backend"] is b,
            "unpickled_is_same": pickle.loads(pickle.dumps(b)) is b,
            "payload": pickle.dumps(b),
        }


def _unpickled(payload: bytes) -> dict:
    import pickle

    from cpcompile import _compat

    out = {}
    try:
        pickle.loads(payload)
        out["without_group"] = "no error"
    except TypeError as e:
        out["without_group"] = str(e)
    with _compat.fake_process_group(1, 2):
        b = pickle.loads(payload)
        out["type"] = type(b).__name__
        out["group_name"], out["cp_rank"], out["cp_size"] = b.group_name, b.cp_rank, b.cp_size
        out["inner"], out["block_size"] = b.options.inner, b.options.block_size
    return out


def test_copy_and_pickle_give_the_backend_back():
    same = run_alone(_copies)
    for key in ("deepcopy_is_same", "copy_is_same", "deepcopy_in_dict_is_same", "unpickled_is_same"):
        assert same[key] is True, key

    other = run_alone(_unpickled, same["payload"])
    # no group of that name in a new process: a TypeError that names the fix
    assert "process group '0' is not registered in this process" in other["without_group"], other
    assert "cpcompile.backend(cp_group)" in other["without_group"], other
    # with the same groups created, a new backend over this process's rank of the group, with the same options
    assert other["type"] == "CPBackend"
    assert (other["group_name"], other["cp_rank"], other["cp_size"]) == ("0", 1, 2)
    assert (other["inner"], other["block_size"]) == ("aot_eager", 64)


def _compile_after_lightning(rank: int, world: int) -> dict:
    import lightning  # noqa: F401  (replaces torch.compile with a wrapper that deep-copies its keyword arguments)

    import cpcompile
    from cpcompile.testing import packed_batch, tiny_model

    assert hasattr(torch.compile, "__wrapped__"), "lightning did not wrap torch.compile; the test checks nothing"
    batch = packed_batch([[10, 20, 6], [30, 6]], seed=1)
    reference = tiny_model("qwen3", seed=0)
    ref = reference(**batch, use_cache=False)
    model = tiny_model("qwen3", seed=0)
    cp_backend = cpcompile.backend(dist.group.WORLD, inner="eager")
    compiled = torch.compile(model, backend=cp_backend)
    with cpcompile.shard(batch, dist.group.WORLD) as local:
        out = compiled(**local)
        logits = cpcompile.gather(out.logits).detach()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)  # the per-rank shares add up to the global mean
    return {
        "stored_backend_is_ours": compiled._compile_kwargs["backend"] is cp_backend,
        "rewritten": sum(r.action == "rewritten" for r in cp_backend.reports),
        "loss": (loss, ref.loss.detach()),
        "logits": (logits, ref.logits.detach()),
    }


@slow  # an integration: lightning's import and its deep copy; the copy itself is tested above
def test_torch_compile_after_import_lightning():
    pytest.importorskip("lightning", reason="lightning is an optional test dependency (pip install lightning)")
    for rank, result in enumerate(run_distributed(_compile_after_lightning, 2, fresh=True)):
        assert result["stored_backend_is_ours"], f"rank {rank}: lightning kept a copy of the backend"
        assert result["rewritten"] == 2, f"rank {rank}: {result['rewritten']} SDPA sites rewritten (2 layers)"
        torch.testing.assert_close(*result["loss"], **LOSS_TOL)
        torch.testing.assert_close(*result["logits"], **LOGITS_TOL)
