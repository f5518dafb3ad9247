"""Integrations of cpcompile with training frameworks.

Each submodule imports its framework, so import the one you use:

- :mod:`cpcompile.integrations.transformers`: Hugging Face ``Trainer`` and TRL's ``SFTTrainer``
  (``ContextParallelMixin``, ``CPTrainer``).
"""

__all__: list[str] = []
