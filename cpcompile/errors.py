"""Every exception cpcompile raises for a user to catch, in one place.

* at compile time (``torch.compile`` passes these to the caller unchanged; all are ``RuntimeError`` subclasses):
  :class:`UnsupportedAttentionError` (an attention call that cannot run across CP ranks exactly),
  :class:`UnsupportedPositionError` (a position computed from the local sequence length that cannot be made
  global exactly);
* at run time: :class:`MaskMismatchError` (the model's own attention mask differs from the one cpcompile
  applies), :class:`RankFailedError` and its ``ValueError``/``TypeError`` variants (a rank of the CP group
  failed: raised on every rank), :class:`RanksDivergedError` (the ranks took different paths through a step).

Bad arguments raise the built-in ``ValueError``/``TypeError`` with the value, what was expected and the fix.
The modules that raise these errors import them from here.
"""

from __future__ import annotations

from collections.abc import Sequence

from cpcompile import _compat

__all__ = [
    "MaskMismatchError",
    "RankFailedError",
    "RankFailedTypeError",
    "RankFailedValueError",
    "RanksDivergedError",
    "UnsupportedAttentionError",
    "UnsupportedMixingError",
    "UnsupportedPositionError",
]


class UnsupportedAttentionError(_compat.PassThroughCompileError):
    """An attention call that cpcompile cannot run across CP ranks with exactly the model's semantics.

    Raised while compiling; ``torch.compile`` passes it to the caller unchanged (a ``RuntimeError``). A flex site
    whose mods read a per-token tensor made before its graph raises it at run time instead, on every rank, when
    that tensor was not made exactly (:func:`cpcompile.ops.exact_input`).
    """


class UnsupportedPositionError(_compat.PassThroughCompileError):
    """A value the model computes from the local sequence length that cpcompile cannot make global exactly.

    Raised while compiling; ``torch.compile`` passes it to the caller unchanged (a ``RuntimeError``).

    ``functions``: the module-level functions of the model's code running when it made the refused op, innermost
    first, when the op is one a sequence mixer makes (a scan, a product over the sequence, a token picked by its
    index, the local length used as a value), else ``()``: those :func:`cpcompile.backend` tries to run
    head-parallel (``regions="found"``).
    """

    functions: tuple = ()


class UnsupportedMixingError(_compat.PassThroughCompileError):
    """An op that mixes tokens along the sharded sequence and that cpcompile cannot make exact across ranks.

    Raised while compiling; ``torch.compile`` passes it to the caller unchanged (a ``RuntimeError``).

    ``functions``: the module-level functions of the model's code running when it made the refused op, innermost
    first, when the op is one a sequence mixer makes (a scan, a product over the sequence, a token picked by its
    index, the local length used as a value), else ``()``: those :func:`cpcompile.backend` tries to run
    head-parallel (``regions="found"``).
    """

    functions: tuple = ()


class MaskMismatchError(RuntimeError):
    """The attention mask a model built differs from the mask cpcompile would apply across ranks."""


class RankFailedError(RuntimeError):
    """A rank of the CP group failed (raised, died, or stopped responding): raised on every rank of the group.

    The message names the ranks that failed with their errors, the ranks that died, and the ranks that did not
    report. The group's collectives are out of step afterwards: every later ``shard`` on it raises this error
    again; destroy the group and create a new one, or restart the job. When the first failing rank's error
    was a ``ValueError`` or ``TypeError`` (bad input), the error is a :class:`RankFailedValueError` or
    :class:`RankFailedTypeError`, so ``except ValueError`` catches it on every rank.

    Attributes: ``failed`` (CP rank -> ``"Type: message"`` of its error), ``dead`` (ranks whose process is
    gone), ``silent`` (ranks that did not report), ``step`` (the ``shard`` step of the failure, counted from 1).
    """

    def __init__(
        self,
        message: str,
        *,
        failed: dict[int, str] | None = None,
        dead: Sequence[int] = (),
        silent: Sequence[int] = (),
        step: int = 0,
    ) -> None:
        super().__init__(message)
        self.failed = dict(failed or {})
        self.dead = tuple(dead)
        self.silent = tuple(silent)
        self.step = step

    def __reduce__(self):
        kwargs = {"failed": self.failed, "dead": self.dead, "silent": self.silent, "step": self.step}
        return _rebuild, (type(self), str(self), kwargs)


class RanksDivergedError(RankFailedError):
    """The CP ranks arrived at different control rounds (another kind of check, another attention site, another
    step, or a round one rank skipped): they took different paths through the step. Raised on every rank that
    takes part in the round; the group's collectives may be out of step, so the group cannot be used again.
    """


class RankFailedValueError(RankFailedError, ValueError):
    """:class:`RankFailedError` whose first failing rank raised a ``ValueError``."""


class RankFailedTypeError(RankFailedError, TypeError):
    """:class:`RankFailedError` whose first failing rank raised a ``TypeError``."""


def _rebuild(cls, message, kwargs):
    return cls(message, **kwargs)
