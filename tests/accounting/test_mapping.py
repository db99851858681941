"""Event mapping onto dp_accounting, DP-SGD step builders, combined multipliers, package hygiene."""

import ast
import math
from pathlib import Path

import dp_accounting as dpa
import pytest

import dpclip.accounting as acc_pkg
from dpclip.accounting import (
    UnsupportedAccountingError,
    adjacency_of,
    combined_noise_multiplier,
    dpsgd_event,
    dpsgd_step_event,
    epsilon,
    to_dp_accounting,
)
from dpclip.events import (
    ComposedEvent,
    GaussianEvent,
    NoOpEvent,
    PoissonSampledEvent,
    SampledWithoutReplacementEvent,
    SelfComposedEvent,
)


def test_structural_mapping():
    ev = ComposedEvent(
        (
            NoOpEvent(),
            SelfComposedEvent(PoissonSampledEvent(0.25, GaussianEvent(1.5)), 7),
            SampledWithoutReplacementEvent(100, 10, ComposedEvent((GaussianEvent(2.0),))),
        )
    )
    expected = dpa.ComposedDpEvent(
        [
            dpa.NoOpDpEvent(),
            dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.25, dpa.GaussianDpEvent(1.5)), 7),
            dpa.SampledWithoutReplacementDpEvent(
                100, 10, dpa.ComposedDpEvent([dpa.GaussianDpEvent(2.0)])
            ),
        ]
    )
    assert to_dp_accounting(ev) == expected
    with pytest.raises(TypeError, match="Ledger"):
        to_dp_accounting(1.0)


def test_dpsgd_step_event_shapes():
    assert dpsgd_step_event(1.1, 0.01) == PoissonSampledEvent(0.01, GaussianEvent(1.1))
    extra = GaussianEvent(10.0)
    assert dpsgd_step_event(1.1, 0.01, extra=(extra,)) == PoissonSampledEvent(
        0.01, ComposedEvent((GaussianEvent(1.1), extra))
    )
    assert dpsgd_step_event(
        1.1, sampling="without-replacement", dataset_size=1000, batch_size=10
    ) == SampledWithoutReplacementEvent(1000, 10, GaussianEvent(1.1))
    # Poisson rate derived from B / N
    assert dpsgd_step_event(1.0, dataset_size=1000, batch_size=10).sample_rate == 0.01
    assert dpsgd_event(1.0, 5, 0.1) == SelfComposedEvent(
        PoissonSampledEvent(0.1, GaussianEvent(1.0)), 5
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(noise_multiplier=-1.0, sample_rate=0.1), "noise_multiplier"),
        (dict(noise_multiplier=1.0, sample_rate=0.0), "sample_rate"),
        (dict(noise_multiplier=1.0, sample_rate=1.5), "sample_rate"),
        (dict(noise_multiplier=1.0), "sample_rate"),
        (dict(noise_multiplier=1.0, sample_rate=0.1, sampling="shuffle"), "sampling"),
        (dict(noise_multiplier=1.0, sampling="without-replacement"), "dataset_size"),
        (
            dict(noise_multiplier=1.0, sampling="without-replacement", dataset_size=10,
                 batch_size=20),
            "batch_size",
        ),
        (dict(noise_multiplier=1.0, sample_rate=0.5, dataset_size=100, batch_size=10),
         "disagrees"),
        (dict(noise_multiplier=1.0, sample_rate=0.1,
              extra=(PoissonSampledEvent(0.1, GaussianEvent(1.0)),)), "extra"),
    ],
)
def test_dpsgd_step_event_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dpsgd_step_event(**kwargs)


def test_combined_noise_multiplier_values():
    assert combined_noise_multiplier(2.0) == 2.0
    assert combined_noise_multiplier(1.0, 1.0) == pytest.approx(1 / math.sqrt(2), rel=1e-15)
    assert combined_noise_multiplier(3.0, 4.0) == pytest.approx(12 / 5, rel=1e-15)
    # algorithms.md T4 (Andrew Thm 1): z = 1, sigma_b = 5 -> z_delta = 1.005038, i.e. the
    # gradient query at 1.005038 plus the count at 2 * sigma_b compose to z = 1.
    assert combined_noise_multiplier(1.005038, 10.0) == pytest.approx(1.0, abs=1e-6)
    assert combined_noise_multiplier(1.0, 0.0) == 0.0
    assert combined_noise_multiplier(2.0, math.inf) == 2.0
    with pytest.raises(ValueError, match="noise multiplier"):
        combined_noise_multiplier()
    with pytest.raises(ValueError, match="#1"):
        combined_noise_multiplier(1.0, -2.0)


def test_adjacency_detection():
    assert adjacency_of(dpsgd_event(1.0, 3, 0.1)) == "add-remove-one"
    assert adjacency_of(GaussianEvent(1.0)) == "add-remove-one"
    wor = dpsgd_event(1.0, 3, sampling="without-replacement", dataset_size=100, batch_size=10)
    assert adjacency_of(wor) == "replace-one"
    with pytest.raises(ValueError, match="mixes"):
        adjacency_of(ComposedEvent((wor, dpsgd_event(1.0, 3, 0.1))))


def test_nested_sampling_is_refused():
    nested = PoissonSampledEvent(0.5, PoissonSampledEvent(0.5, GaussianEvent(1.0)))
    for acc in ("pld", "rdp"):
        with pytest.raises(UnsupportedAccountingError, match="nested"):
            epsilon(nested, 1e-5, acc)


def test_epsilon_validates_arguments():
    ev = dpsgd_event(1.0, 10, 0.01)
    for bad in (0.0, 1.0, -1e-5, 2):
        with pytest.raises(ValueError, match="delta"):
            epsilon(ev, bad)
    with pytest.raises(ValueError, match="accountant.*'pld'"):
        epsilon(ev, 1e-5, accountant="gdp")
    with pytest.raises(ValueError, match="rdp_orders"):
        epsilon(ev, 1e-5, accountant="rdp", rdp_orders=[1.0, 2.0])
    with pytest.raises(ValueError, match="value_discretization_interval"):
        epsilon(ev, 1e-5, accountant="pld", value_discretization_interval=0.0)


def test_package_never_imports_torch():
    root = Path(acc_pkg.__file__).parent
    files = sorted(root.glob("*.py"))
    assert len(files) >= 5
    for path in files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] != "torch", f"{path.name} imports {name}"


def test_curated_all():
    expected = {
        "ACCOUNTANTS", "DEFAULT_PLD_DISCRETIZATION", "SAMPLING_SCHEMES", "EpsilonReport",
        "Ledger", "UnsupportedAccountingError", "adjacency_of", "calibrate_dpsgd_noise",
        "calibrate_noise_multiplier", "calibrate_steps", "combined_noise_multiplier",
        "compute_epsilon", "dpsgd_event", "dpsgd_step_event", "epsilon", "to_dp_accounting",
    }
    assert set(acc_pkg.__all__) == expected
    assert len(acc_pkg.__all__) == len(expected)
    for name in acc_pkg.__all__:
        assert getattr(acc_pkg, name) is not None
    assert callable(acc_pkg.epsilon)  # the function, not the submodule
    assert issubclass(UnsupportedAccountingError, ValueError)


def test_non_events_are_rejected():
    with pytest.raises(TypeError, match="dpclip.events"):
        epsilon(1.0, 1e-5, "rdp")
    with pytest.raises(TypeError, match="dpclip.events"):
        epsilon(ComposedEvent((GaussianEvent(1.0), "gaussian")), 1e-5, "pld")
