"""Loading the model ``cpcompile inspect`` traces: a transformers config (file or folder) or ``module:factory``."""

from __future__ import annotations

import importlib
import os
import re

import torch

__all__ = ["is_config", "load_model"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def load_model(spec: str, *, device: str = "meta", dtype: str | None = None, attn_implementation: str = "sdpa"):
    """Build the model named by ``spec`` on ``device``, in train mode.

    ``spec`` is a transformers config (a ``config.json`` file or a folder holding one; built with
    ``AutoModelForCausalLM.from_config`` and ``attn_implementation``, random weights) or ``module:factory``,
    a function called with no arguments that returns an ``nn.Module`` (or a transformers config). Raises
    ``ValueError`` for a spec that names nothing loadable.
    """
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {sorted(_DTYPES)}")
    if os.path.exists(spec):
        model = _from_config(_load_config(spec), device, attn_implementation)
    elif _FACTORY.match(spec):
        made = _call_factory(spec)
        if isinstance(made, torch.nn.Module):
            model = made.to(device=device)
        elif is_config(made):
            model = _from_config(made, device, attn_implementation)
        else:
            raise ValueError(
                f"model factory {spec!r} returned a {type(made).__name__}; it must return a torch.nn.Module "
                "(or a transformers config)"
            )
    else:
        raise ValueError(
            f"unknown model spec {spec!r}: not an existing config file or folder, and not of the form "
            "'module:factory'; pass a transformers config.json (or the folder holding it) or "
            "'package.module:function' returning the model"
        )
    if dtype is not None:
        model = model.to(dtype=_DTYPES[dtype])
    return model.train()


def is_config(obj: object) -> bool:
    return type(obj).__name__.endswith("Config") and hasattr(obj, "to_dict")


def _load_config(path: str):
    try:
        import transformers
    except ImportError as e:
        raise ValueError(
            f"model spec {path!r} is a config file, which needs transformers: pip install transformers"
        ) from e
    try:
        return transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(
            f"cannot read a transformers config from {path!r} ({type(e).__name__}: {e}); pass a config.json "
            "with a 'model_type' field, or the folder that holds it"
        ) from e


def _from_config(config, device: str, attn_implementation: str):
    import transformers

    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def _call_factory(spec: str):
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"model spec {spec!r}: cannot import module {module_name!r} ({e}); is it on PYTHONPATH?"
        ) from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"model spec {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"model spec {spec!r}: {attr!r} is a {type(obj).__name__}, not a function returning a model")
    return obj()
