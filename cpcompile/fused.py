"""Functions of transformers models that transformers bound to a fused kernel, other than the recurrent cores of
:mod:`cpcompile.cores`: their torch path under CP.

transformers' ``use_kernel_func_from_hub_with_fallback`` binds a function (``causal_conv1d_fn``, ``mamba_inner_fn``)
to a fused package's kernel when the package imports (``causal_conv1d``, ``mamba_ssm``), and to its torch path
otherwise. A kernel is opaque to the passes, or cut off from the graph by Dynamo, where it runs on this rank's
tokens only. While a :func:`cpcompile.shard` context of more than one rank is active, Dynamo traces the torch path
instead, which runs on this rank's tokens as the rest of the graph does: the passes see it and make it exact (the
conv before a mixer: a halo region) or refuse it. Outside CP the kernel runs, called as the wrapper calls it.

This module is apart from :mod:`cpcompile.cores` on purpose: the nodes traced inside a core's replacement run on the
whole sequence of some heads (:func:`cpcompile.cores.traced_in_core` reads the replacement's file in their stack
trace), and these functions' torch paths run on this rank's tokens.
"""

from __future__ import annotations

import inspect
import sys
import types

import torch

from cpcompile import _compat, cores

__all__ = ["fused_functions", "register_fused_functions"]

#: ``"module.function"`` -> each function given its torch path under CP (:func:`register_fused_functions`).
_FUSED: dict[str, types.FunctionType] = {}
#: transformers' model modules already searched.
_SEARCHED: set[str] = set()


def fused_functions() -> dict[str, types.FunctionType]:
    """``"module.function"`` -> the functions bound to a fused kernel that run their torch path under CP."""
    return dict(_FUSED)


def _torch_path_under_cp(torch_fn, kernel, params: tuple[str, ...], site: str):
    """Outside CP the kernel, called as the wrapper calls it (``kwargs`` filtered to ``params``; under
    ``torch.export`` the wrapper takes its torch path, and so does this); under CP ``torch_fn``, called as the
    wrapper calls its torch path, which cannot keep packed sequences apart: a ``seq_idx``/``cu_seqlens`` is refused
    while tracing."""
    signature = tuple(inspect.signature(torch_fn).parameters.values())
    open_kwargs = any(p.kind is p.VAR_KEYWORD for p in signature)
    torch_params = tuple(p.name for p in signature)

    def fused_function(*args, **kwargs):
        if cores.HEADS_GROUP is None and not torch.compiler.is_exporting():  # Dynamo guards on HEADS_GROUP
            return kernel(*args, **{k: v for k, v in kwargs.items() if k in params})
        if kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None:
            like = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
            fix = "pass none (its torch path does not keep documents apart)"
            torch.ops.cpcompile.heads_refusal(
                like, f"{site} under context parallelism got seq_idx or cu_seqlens; {fix}"
            )
        return torch_fn(*args, **(kwargs if open_kwargs else {k: v for k, v in kwargs.items() if k in torch_params}))

    return fused_function


def register_fused_functions() -> None:
    """Give every function of an imported transformers model module that transformers bound to a fused kernel, and
    that is not a core of :data:`cpcompile.cores.CORES`, its torch path under CP (once per process and function)."""
    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers.models.") or name in _SEARCHED or module is None:
            continue
        _SEARCHED.add(name)
        for attr, fn in list(vars(module).items()):
            key = f"{name}.{attr}"
            if key in cores.CORES or not isinstance(fn, types.FunctionType) or _compat.substituted_in_graph(fn):
                continue
            found = cores._fused_kernel(fn)
            if found is not None:
                torch.compiler.substitute_in_graph(fn, skip_signature_check=True)(_torch_path_under_cp(*found, key))
                _FUSED[key] = fn
