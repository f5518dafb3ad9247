"""Store I/O of the fail-together protocols: JSON records under the CP group's store (keys under ``cpcompile/``),
and store failures turned into :class:`~cpcompile.errors.RankFailedError`."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

from cpcompile.errors import RankFailedError
from cpcompile.failsafe.state import GroupState, clip, mark_agreed

__all__ = ["has_key", "load_json", "put_json", "store_errors"]


# -- store helpers -----------------------------------------------------------------------------------------
def put_json(state: GroupState, key: str, value: object) -> int:
    data = json.dumps(value).encode()
    state.store.set(key, data)
    return len(data)


def has_key(state: GroupState, key: str) -> bool:
    return state.store.check([key])


def load_json(state: GroupState, key: str) -> dict:
    return json.loads(state.store.get(key))


@contextlib.contextmanager
def store_errors(state: GroupState, cause: BaseException | None) -> Iterator[None]:
    """Store failures (the process hosting the store died) become a :class:`RankFailedError`."""
    try:
        yield
    except (RuntimeError, OSError) as e:
        if isinstance(e, RankFailedError):
            raise
        err = RankFailedError(
            f"the control store of CP group {state.name!r} failed ({type(e).__name__}: {clip(str(e), 300)}): "
            "the process hosting the job's store (the launcher, or global rank 0) has probably died; "
            "restart the job",
            step=state.step,
        )
        state.broken = err
        mark_agreed(err)
        raise err from (cause or e)
