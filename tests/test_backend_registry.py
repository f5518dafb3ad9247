"""``torch.compile(model, backend="cpcompile")`` finds the backend through its entry point."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpcompile.backend import _registry_backend


def test_backend_is_registered_under_its_name():
    from torch._dynamo.backends.registry import lookup_backend

    # the torch_dynamo_backends entry point of the installed package (pyproject.toml)
    assert lookup_backend("cpcompile") is _registry_backend


def test_backend_by_name_needs_torch_distributed():
    assert not dist.is_initialized()
    torch._dynamo.reset()
    fn = torch.compile(lambda x: x * 2, backend="cpcompile")
    with pytest.raises(Exception, match="torch.distributed is not initialized"):
        fn(torch.ones(3))
