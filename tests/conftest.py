"""Fixtures shared by the in-process test modules: fake CP groups and a clean Dynamo state per test."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpcompile import _compat


def _fake_group(rank: int):
    if dist.is_initialized():
        pytest.fail("a process group is already initialised in the pytest process; tests must not leave one")
    _compat.init_fake_process_group(rank=rank, world_size=2)
    yield dist.group.WORLD
    dist.destroy_process_group()


#: Test files whose spawned fixtures take longest, heaviest first (measured by ``make test --durations``; see
#: docs/testing.md). They are collected first so that ``--dist loadfile`` starts them first and the two workers
#: finish together instead of one running a heavy file alone at the end.
HEAVY_FIRST = (
    "test_flex.py",
    "test_comm.py",
    "test_rl_step.py",
    "test_fsdp_cp.py",
    "test_misuse.py",
    "test_layouts_parity.py",
    "test_parity.py",
    "test_library_patterns_parity.py",
    "test_mixing_parity.py",
    "test_integration_transformers.py",
    "test_flex_exchange.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(HEAVY_FIRST)))  # stable: the rest keep their order


def pytest_sessionfinish(session, exitstatus):
    """Close the pooled test ranks when the session ends: an xdist worker may exit without running atexit hooks,
    and its ranks would outlive it (idle, holding memory) through the rest of the run."""
    from tests.harness.dist import _close_pools

    _close_pools()


@pytest.fixture(scope="module")
def world():
    """A fake default process group of size 2 for the module; this process is rank 0."""
    yield from _fake_group(0)


@pytest.fixture(scope="module")
def last_rank():
    """A fake default process group of size 2 for the module; this process is rank 1 (it holds the padding)."""
    yield from _fake_group(1)


@pytest.fixture
def fresh_dynamo():
    """Reset Dynamo around the test: every test compiles a fresh model, and without a reset Dynamo would
    accumulate guards on the shared forward code objects and, past its recompile limit, run them eagerly."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
