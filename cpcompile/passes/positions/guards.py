"""guards: decisions the model's Python code took on the local sequence length, checked against the global one.

Dynamo runs a model's Python code on the local length ``c`` of a rank and records every decision that code takes
on a dynamic size as a shape guard of the compiled graph: ``if T > 24:`` not taken becomes ``T <= 24``, and a RoPE
cache that the model fills on the call that finds it short (``if self.rows < T: refill``) becomes
``T <= rows`` once it holds ``rows`` rows. The graph serves every later call whose *local* length satisfies the
guards. The whole-sequence run decides on the *global* length ``T``, so wherever a guard that holds for ``c``
fails for ``T``, the one-process model takes the other branch and a CP run would be silently wrong.

:func:`length_guards` keeps the guards of the graph being compiled whose only symbols are the local length's
(other symbols' values are not known at run time); :meth:`LengthGuards.check` evaluates them for the global
length of a plan, once per length, and raises :class:`UnsupportedPositionError` naming the model's line and the
decision. The backend checks them when it compiles (the plan is active then) and again before every call of the
graph under another global length. A static trace has no symbol for the length and keeps its decisions as
constants, which no guard can show: the positions pass refuses its position sources for that reason.
"""

from __future__ import annotations

import sympy

from cpcompile import _compat, cores
from cpcompile.errors import UnsupportedPositionError
from cpcompile.passes.positions.model import FIX, SequenceLength

#: The symbol a guard is written in: every symbol of the local length stands for the one sequence length.
_T = sympy.Symbol("T", integer=True, positive=True)

#: The fix a refused decision names, before :data:`~cpcompile.passes.positions.model.FIX`.
GUARD_FIX = (
    "take the decision from the global length (one more than the largest of the position_ids cpcompile.shard "
    "passes, or a config value such as the maximum sequence length), not from the length of a tensor; a cache "
    "the model fills on the call that finds it short must hold a row for every position of the whole sequence "
    "before the training call (fill it at init for the longest sequence, or once on a whole-sequence call "
    "outside cpcompile.shard); or "
)


class LengthGuards:
    """The decisions of one compiled graph on its local length: ``(condition in T, the model's line)`` pairs."""

    def __init__(self, guards: tuple[tuple[object, str], ...]) -> None:
        self.guards = guards
        self._checked: dict[int, str | None] = {}  # global length -> refusal text (None: every guard holds)

    def __bool__(self) -> bool:
        return bool(self.guards)

    def failed(self, seq_len: int) -> tuple[object, str] | None:
        """The first guard that does not hold for a global length of ``seq_len`` tokens, else ``None``."""
        for expr, where in self.guards:
            if expr.xreplace({_T: sympy.Integer(seq_len)}) is not sympy.true:
                return expr, where
        return None

    def refusal(self, seq_len: int, chunk_len: int) -> str | None:
        """The refusal's text when a decision taken on the local length ``chunk_len`` differs for the global
        length ``seq_len``, else ``None``; each length is evaluated once."""
        if seq_len not in self._checked:
            bad = self.failed(seq_len)
            self._checked[seq_len] = None if bad is None else _refusal_text(*bad, seq_len, chunk_len)
        return self._checked[seq_len]

    def check(self, seq_len: int, chunk_len: int) -> None:
        """Raise :class:`UnsupportedPositionError` with :meth:`refusal`'s text, if any."""
        text = self.refusal(seq_len, chunk_len)
        if text is not None:
            raise UnsupportedPositionError(text)


def length_guards(seq: SequenceLength | None) -> LengthGuards:
    """The shape guards recorded so far for the frame being compiled that involve only the local length's symbols,
    written in one length ``T``; those that hold for every ``T`` (``Eq(s0, s1)`` of two inputs of the local
    length) are dropped, and so are those of a head-parallel core (taken at its lines, :func:`cpcompile.cores.in_core`,
    or while Dynamo traced it, :func:`cpcompile.cores.guard_in_core`), which decided on the whole sequence."""
    if seq is None or seq.static:
        return LengthGuards(())
    kept = []
    for i, (expr, where) in enumerate(_compat.shape_guards()):
        symbols = getattr(expr, "free_symbols", set())
        if not symbols or not symbols <= seq.symbols or cores.in_core(where) or cores.guard_in_core(i):
            continue
        in_t = expr.xreplace({s: _T for s in symbols})
        if in_t is not sympy.true:
            kept.append((in_t, where))
    return LengthGuards(tuple(kept))


def _located(where: str) -> str:
    """Dynamo's ``code  # file:line in function`` as ``file:line in function (code)``."""
    code, sep, place = where.rpartition("  # ")
    return f"{place.strip()} ({code.strip()})" if sep and code.strip() else where.strip()


def _refusal_text(expr: object, where: str, seq_len: int, chunk_len: int) -> str:
    line = _located(where) if where else "a line of the model (Dynamo recorded no source line for it)"
    return (
        f"cpcompile cannot make the model's code at {line} exact across CP ranks: it decided `{expr}` from the "
        f"length T of the sequence it was given, which under CP is this rank's {chunk_len} tokens; the whole "
        f"sequence has {seq_len} tokens, for which the decision differs, so the one-process model takes the other "
        f"branch. Fix: {GUARD_FIX}{FIX}"
    )
