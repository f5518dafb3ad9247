"""``torch.compile(model, backend="cpcompile")`` finds the backend through its entry point."""

from __future__ import annotations

from cpcompile.backend import _registry_backend
from tests.harness.dist import run_alone


def test_backend_is_registered_under_its_name():
    from torch._dynamo.backends.registry import lookup_backend

    # the torch_dynamo_backends entry point of the installed package (pyproject.toml)
    assert lookup_backend("cpcompile") is _registry_backend


def _compile_by_name() -> str:
    import torch

    try:
        torch.compile(lambda x: x * 2, backend="cpcompile")(torch.ones(3))
    except Exception as e:  # noqa: BLE001 - the test asserts which error
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_backend_by_name_needs_torch_distributed():
    # a new process forked from the harness's fork server: other tests of this session may hold a default group
    message = run_alone(_compile_by_name)
    assert "torch.distributed is not initialized" in message, message
