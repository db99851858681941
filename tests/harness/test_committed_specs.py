"""The committed evidence specs (``reproductions/*.toml``) stay valid as the harness changes.

A spec that no longer parses, names a strategy or parameter the library lost, or reuses another
spec's experiment name would silently mix or lose evidence in ``reproductions/results.db``; the
long runs that use these specs are started by hand, so they are checked here instead.
"""

from pathlib import Path

import pytest

from dpclip.harness.spec import load_spec

SPECS = sorted((Path(__file__).resolve().parents[2] / "reproductions").glob("*.toml"))


def test_specs_are_found():
    assert len(SPECS) >= 10, f"expected the committed specs, found {[p.name for p in SPECS]}"


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_committed_spec_loads_and_validates(path):
    # load_spec raises SpecError naming the field when the spec does not parse or validate
    # (every strategy, its tuning points, its claims' labels)
    spec = load_spec(path)
    assert spec.strategies and (spec.epsilons or spec.noise_multipliers), path.name


def test_experiment_names_are_unique():
    names = {}
    for path in SPECS:
        name = load_spec(path).name
        assert name not in names, f"{path.name} and {names[name]} share the experiment {name!r}"
        names[name] = path.name
