"""Calibration round trips (sigma and steps) and input validation."""

import math

import pytest

from dpclip.accounting import (
    Ledger,
    UnsupportedAccountingError,
    calibrate_dpsgd_noise,
    calibrate_noise_multiplier,
    calibrate_steps,
    dpsgd_event,
    dpsgd_step_event,
    epsilon,
)
from dpclip.events import ComposedEvent, GaussianEvent, SelfComposedEvent

DELTA = 1e-5
Q = 256 / 60000


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_sigma_round_trip(accountant):
    steps, target = 2000, 1.0
    z = calibrate_dpsgd_noise(target, DELTA, Q, steps, accountant)
    eps = epsilon(dpsgd_event(z, steps, Q), DELTA, accountant)
    assert target - 1e-4 <= eps <= target
    # smallest: a slightly smaller multiplier overshoots
    assert epsilon(dpsgd_event(z * 0.999, steps, Q), DELTA, accountant) > target


def test_accountant_ordering_of_calibrated_sigmas():
    steps = 60 * 60000 // 256
    z_pld = calibrate_dpsgd_noise(3.0, DELTA, Q, steps, "pld")
    z_rdp = calibrate_dpsgd_noise(3.0, DELTA, Q, steps, "rdp")
    z_classic = calibrate_dpsgd_noise(3.0, DELTA, Q, steps, "rdp-classic")
    assert z_pld < z_rdp < z_classic
    # the classic conversion reproduces the TF-Privacy tutorial's sigma (1.1 gives 3.01)
    assert 1.1 < z_classic < 1.105


def test_calibrate_generic_ledger_maker():
    # A per-step event with an auxiliary same-batch query at 10x the noise (Andrew-style).
    def make(z):
        led = Ledger()
        led.record(dpsgd_step_event(z, 0.05, extra=(GaussianEvent(10 * z),)), 300)
        return led.to_dp_event()

    z = calibrate_noise_multiplier(1.5, DELTA, make, accountant="rdp")
    assert 1.5 - 1e-4 <= epsilon(make(z), DELTA, "rdp") <= 1.5


def test_without_replacement_calibration():
    kw = dict(sampling="without-replacement", dataset_size=60000, batch_size=256)
    with pytest.raises(UnsupportedAccountingError, match="rdp"):
        calibrate_dpsgd_noise(2.0, DELTA, None, 1000, "pld", **kw)
    # integer orders 2..32 (the optimum here is ~10): dp_accounting's without-replacement RDP
    # is ~25x slower at its default orders, which go up to 1024
    orders = list(range(2, 33))
    z = calibrate_dpsgd_noise(2.0, DELTA, None, 1000, "rdp", rdp_orders=orders, **kw)
    ev = dpsgd_event(z, 1000, **kw)
    rep_eps = epsilon(ev, DELTA, "rdp", rdp_orders=orders)
    assert 2.0 - 1e-4 <= rep_eps <= 2.0
    poisson_z = calibrate_dpsgd_noise(2.0, DELTA, Q, 1000, "rdp", rdp_orders=orders)
    assert z > poisson_z  # replace-one costs more


@pytest.mark.parametrize("accountant", ["pld", "rdp", "rdp-classic"])
def test_steps_round_trip(accountant):
    z, target = 1.1, 1.5
    t = calibrate_steps(target, DELTA, (Q, z), accountant)
    assert t > 10
    assert epsilon(dpsgd_event(z, t, Q), DELTA, accountant) <= target
    assert epsilon(dpsgd_event(z, t + 1, Q), DELTA, accountant) > target


def test_steps_callable_edges():
    wor = dict(sampling="without-replacement", dataset_size=1000, batch_size=100)
    orders = list(range(2, 33))
    t = calibrate_steps(2.0, DELTA, lambda s: dpsgd_event(2.0, s, **wor), "rdp", rdp_orders=orders)
    assert epsilon(dpsgd_event(2.0, t, **wor), DELTA, "rdp", rdp_orders=orders) <= 2.0
    assert epsilon(dpsgd_event(2.0, t + 1, **wor), DELTA, "rdp", rdp_orders=orders) > 2.0
    # one step already too expensive -> 0 steps
    assert calibrate_steps(0.1, DELTA, (0.5, 0.5), "rdp") == 0
    # capped search
    assert calibrate_steps(5.0, DELTA, (1e-4, 5.0), "rdp", max_steps=1000) == 1000
    # a fixed cost that already exceeds the target
    fixed = lambda s: ComposedEvent((GaussianEvent(0.5), SelfComposedEvent(GaussianEvent(9.0), s)))
    with pytest.raises(ValueError, match="unreachable"):
        calibrate_steps(1.0, DELTA, fixed, "rdp")


def test_unreachable_target():
    # the classic conversion cannot go below min_alpha log(1/delta)/(alpha-1) ~ 0.0113
    with pytest.raises(ValueError, match="unreachable.*rdp-classic"):
        calibrate_dpsgd_noise(0.005, DELTA, Q, 100, "rdp-classic")
    # ... while the modern one can
    z = calibrate_dpsgd_noise(0.005, DELTA, Q, 100, "rdp")
    assert epsilon(dpsgd_event(z, 100, Q), DELTA, "rdp") <= 0.005


@pytest.mark.parametrize(
    "args, match",
    [
        ((0.0, DELTA, Q, 100), "target_epsilon"),
        ((-1.0, DELTA, Q, 100), "target_epsilon"),
        ((math.inf, DELTA, Q, 100), "target_epsilon"),
        ((math.nan, DELTA, Q, 100), "target_epsilon"),
        ((1.0, 0.0, Q, 100), "delta"),
        ((1.0, 1.0, Q, 100), "delta"),
        ((1.0, DELTA, 0.0, 100), "sample_rate"),
        ((1.0, DELTA, 1.5, 100), "sample_rate"),
        ((1.0, DELTA, Q, 0), "steps"),
        ((1.0, DELTA, Q, 100, "moments"), "accountant"),
    ],
)
def test_calibration_validation(args, match):
    with pytest.raises(ValueError, match=match):
        calibrate_dpsgd_noise(*args)


def test_more_validation():
    with pytest.raises(ValueError, match="tol"):
        calibrate_noise_multiplier(1.0, DELTA, lambda z: GaussianEvent(z), "rdp", tol=0)
    with pytest.raises(TypeError, match="make_event"):
        calibrate_noise_multiplier(1.0, DELTA, "not callable", "rdp")
    with pytest.raises(TypeError, match="make_event"):
        calibrate_noise_multiplier(1.0, DELTA, lambda z: z, "rdp")
    with pytest.raises(ValueError, match="sample_rate"):
        calibrate_steps(1.0, DELTA, (0.0, 1.0))
    with pytest.raises(ValueError, match="noise_multiplier"):
        calibrate_steps(1.0, DELTA, (0.1, -1.0))
    with pytest.raises(ValueError, match="max_steps"):
        calibrate_steps(1.0, DELTA, (0.1, 1.0), max_steps=0)
