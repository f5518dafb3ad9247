"""The root namespace: at most 20 names, each resolving without a warning; every name that left it still resolves
from the root for one release, with a ``DeprecationWarning`` naming its new home, and CHANGELOG.md lists it there."""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path

import pytest

import cpcompile

CHANGELOG = Path(__file__).resolve().parents[1] / "CHANGELOG.md"


def test_root_namespace_holds_at_most_20_names_that_resolve_without_a_warning():
    assert len(cpcompile.__all__) <= 20, cpcompile.__all__
    assert len(set(cpcompile.__all__)) == len(cpcompile.__all__)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in cpcompile.__all__:
            getattr(cpcompile, name)
    assert not set(cpcompile.MOVED) & set(cpcompile.__all__)


@pytest.mark.parametrize("name", sorted(cpcompile.MOVED))
def test_moved_name_warns_with_its_new_home_and_resolves_to_it(name):
    module, attr = cpcompile.MOVED[name]
    with pytest.warns(DeprecationWarning) as caught:
        got = getattr(cpcompile, name)
    (warning,) = caught
    assert f"cpcompile.{name} moved to {module}.{attr}" in str(warning.message)
    assert warning.filename == __file__  # the warning points at the caller's line
    assert got is getattr(importlib.import_module(module), attr)


def test_current_plan_and_counters_resolve_from_the_root():
    """The two names code written against the previous README used."""
    from cpcompile.passes import counters
    from cpcompile.runtime import current_plan

    with pytest.warns(DeprecationWarning, match="cpcompile.runtime.current_plan"):
        assert cpcompile.current_plan is current_plan
    with pytest.warns(DeprecationWarning, match="cpcompile.passes.counters"):
        assert cpcompile.counters is counters
    with pytest.warns(DeprecationWarning):
        from cpcompile import current_plan as via_from  # noqa: F401 - `from cpcompile import` goes through it too
    assert via_from is current_plan


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        cpcompile.not_a_name  # noqa: B018


@pytest.mark.parametrize("name", sorted(cpcompile.MOVED))
def test_changelog_lists_every_moved_name_with_its_home(name):
    module, attr = cpcompile.MOVED[name]
    assert f"`cpcompile.{name}` -> `{module}.{attr}`" in CHANGELOG.read_text(), name
