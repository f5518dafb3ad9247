"""What an RL step compiles, in one process on a fake CP group of 2: every variant compiles, none is refused.

Under FSDP2 each decoder layer is a graph of its own and transformers' mask graph hands its mask on. An RL step
compiles many variants of the same frames (a policy and a reference model, each FSDP2-wrapped instance of its
own class; grad and no-grad calls; a new length every step), which must neither be refused nor hit Dynamo's
recompile limit (made a hard failure under CP). Numbers are checked against one process in
``tests/test_rl_step.py``; here only that the variants compile.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cpcompile
from cpcompile import _compat
from cpcompile.testing import packed_batch, tiny_model

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture(scope="module")
def mesh():
    _compat.init_fake_process_group(rank=0, world_size=2)
    try:
        yield cpcompile.init_dp_cp_mesh(1, 2)
    finally:
        dist.destroy_process_group()


def _sharded(mesh, seed: int):
    model = tiny_model("qwen3", seed=seed)
    cpcompile.fully_shard_dp_cp(model, mesh)
    return model


def _forward(compiled, local, grad: bool):
    kwargs = {k: local[k] for k in ("input_ids", "position_ids")}
    with torch.set_grad_enabled(grad):
        return compiled(**kwargs, use_cache=False).logits


def test_mask_graph_recompiled_at_a_new_length_is_not_refused(mesh):
    """The mask graph gets the hidden states' length as a size input of its own, apart from its position_ids'
    symbol, once a second length makes it dynamic: that size is the local length too (it was read as an unknown
    size, and the mask's position lookups were refused as mixing)."""
    group = mesh.get_group("cp")
    compiled = torch.compile(_sharded(mesh, 0), backend=cpcompile.backend(group, inner="eager"))
    for T in (64, 80, 96):
        with cpcompile.shard(packed_batch([[T // 2, T // 2]], seed=T), group, check_batch=False) as local:
            assert _forward(compiled, local, grad=False).shape[1] == T // 2


def test_policy_and_reference_with_backends_of_their_own_stay_within_the_recompile_limit(mesh):
    group = mesh.get_group("cp")
    policy, reference = _sharded(mesh, 0), _sharded(mesh, 1)
    reference.requires_grad_(False)
    compiled = {
        "policy": torch.compile(policy, backend=cpcompile.backend(group, inner="eager")),
        "reference": torch.compile(reference, backend=cpcompile.backend(group, inner="eager")),
    }
    for step in range(2):
        with cpcompile.shard(packed_batch([[20, 44]], seed=step), group, check_batch=False) as local:
            _forward(compiled["policy"], local, grad=False)
            _forward(compiled["reference"], local, grad=False)
            _forward(compiled["policy"], local, grad=True).sum().backward()
