"""The two test tiers: ``make test`` runs the tests not marked ``slow``, ``make test-all`` runs every test.

A test file whose tests share one spawned run (a module fixture that runs every case on one group of ranks, each
test then checking its part) marks its slow tests and asks :func:`runs_slow` in the fixture: the fixture computes
the slow tests' cases only when the session runs one of them. The rule for new tests is in docs/testing.md.
"""

from __future__ import annotations

import pytest

#: The marker of the slow tier (registered in pyproject.toml).
slow = pytest.mark.slow


def runs_slow(request: pytest.FixtureRequest) -> bool:
    """Whether this session runs a test of the fixture's module marked ``slow`` (after ``-m``/``-k`` selection;
    under ``pytest-xdist --dist loadfile`` every test of a file runs in the process that runs its fixtures)."""
    return any(item.module is request.module and item.get_closest_marker("slow") for item in request.session.items)
