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
