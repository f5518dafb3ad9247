"""``torch.compile(model, backend="cpcompile")`` finds the backend through its entry point."""

from __future__ import annotations

import subprocess
import sys

from cpcompile.backend import _registry_backend


def test_backend_is_registered_under_its_name():
    from torch._dynamo.backends.registry import lookup_backend

    # the torch_dynamo_backends entry point of the installed package (pyproject.toml)
    assert lookup_backend("cpcompile") is _registry_backend


def test_backend_by_name_needs_torch_distributed():
    # a fresh interpreter: other tests of this session may hold a default process group
    code = "import torch; torch.compile(lambda x: x * 2, backend='cpcompile')(torch.ones(3))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "torch.distributed is not initialized" in proc.stderr, proc.stderr[-2000:]
