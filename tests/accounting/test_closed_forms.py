"""Closed forms and exact identities the accountants must reproduce."""

import math

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS
from scipy.optimize import brentq
from scipy.stats import norm

from dpclip.accounting import (
    Ledger,
    UnsupportedAccountingError,
    combined_noise_multiplier,
    compute_epsilon,
    dpsgd_event,
    dpsgd_step_event,
    epsilon,
)
from dpclip.events import (
    ComposedEvent,
    GaussianEvent,
    PoissonSampledEvent,
    SelfComposedEvent,
)

DELTA = 1e-5
ORDERS = np.array(DEFAULT_RDP_ORDERS, dtype=float)


def analytic_gaussian_epsilon(sigma: float, delta: float) -> float:
    """Balle & Wang 2018: delta(eps) = Phi(-eps s + 1/(2s)) - e^eps Phi(-eps s - 1/(2s))."""

    def gap(eps: float) -> float:
        return (
            norm.cdf(-eps * sigma + 1 / (2 * sigma))
            - math.exp(eps) * norm.cdf(-eps * sigma - 1 / (2 * sigma))
            - delta
        )

    return brentq(gap, 0.0, 100.0, xtol=1e-12)


@pytest.mark.parametrize("sigma", [0.5, 1.0, 3.0, 10.0])
def test_pld_single_gaussian_is_the_analytic_gaussian(sigma):
    exact = analytic_gaussian_epsilon(sigma, DELTA)
    ours = epsilon(GaussianEvent(sigma), DELTA, "pld")
    # pessimistic discretisation: never below the truth, and within the 1e-3 grid's error
    assert exact - 1e-9 <= ours <= exact + 1e-4


@pytest.mark.parametrize("sigma, k", [(2.0, 4), (5.0, 25), (8.0, 100)])
def test_k_gaussians_equal_one_with_sigma_over_sqrt_k(sigma, k):
    led = Ledger()
    for _ in range(k):
        led.record(GaussianEvent(sigma))
    exact = analytic_gaussian_epsilon(sigma / math.sqrt(k), DELTA)
    assert exact - 1e-9 <= epsilon(led, DELTA, "pld") <= exact + 1e-4
    one = GaussianEvent(sigma / math.sqrt(k))
    assert epsilon(led, DELTA, "rdp") == pytest.approx(epsilon(one, DELTA, "rdp"), rel=1e-12)


def test_distinct_gaussians_compose_to_the_combined_multiplier():
    # Three different Gaussian releases (PLD really composes three distributions here).
    ev = ComposedEvent((GaussianEvent(1.0), GaussianEvent(2.0), GaussianEvent(3.0)))
    z = combined_noise_multiplier(1.0, 2.0, 3.0)
    assert z == pytest.approx((1 + 1 / 4 + 1 / 9) ** -0.5, rel=1e-15)
    exact = analytic_gaussian_epsilon(z, DELTA)
    assert exact - 1e-9 <= epsilon(ev, DELTA, "pld") <= exact + 1e-4
    assert epsilon(ev, DELTA, "rdp") == pytest.approx(
        epsilon(GaussianEvent(z), DELTA, "rdp"), rel=1e-12
    )


def test_same_batch_queries_equal_the_combined_multiplier():
    # Gradient sum G(z1) and a noisy count G(z2) on the same Poisson batch == G(combined).
    q, z1, z2, steps = 0.02, 1.2, 3.0, 500
    both = dpsgd_event(z1, steps, q, extra=(GaussianEvent(z2),))
    single = dpsgd_event(combined_noise_multiplier(z1, z2), steps, q)
    for acc in ("pld", "rdp"):
        assert epsilon(both, DELTA, acc) == pytest.approx(epsilon(single, DELTA, acc), abs=1e-9)
    # dp_accounting's own reduction of the structural event agrees
    ref = RdpAccountant().compose(
        dpa.SelfComposedDpEvent(
            dpa.PoissonSampledDpEvent(
                q, dpa.ComposedDpEvent([dpa.GaussianDpEvent(z1), dpa.GaussianDpEvent(z2)])
            ),
            steps,
        )
    )
    assert epsilon(both, DELTA, "rdp") == pytest.approx(ref.get_epsilon(DELTA), rel=1e-12)
    # and the auxiliary query is not free
    assert epsilon(both, DELTA, "rdp") > epsilon(dpsgd_event(z1, steps, q), DELTA, "rdp") + 0.01


@pytest.mark.parametrize("sigma", [2.0, 5.0])
def test_rdp_of_gaussian_and_both_conversions(sigma):
    rdp = ORDERS / (2 * sigma**2)  # RDP of the Gaussian mechanism: alpha / (2 sigma^2)
    # classic: min_alpha RDP + log(1/delta)/(alpha - 1)
    classic = rdp + math.log(1 / DELTA) / (ORDERS - 1)
    rep = compute_epsilon(GaussianEvent(sigma), DELTA, "rdp-classic")
    assert rep.epsilon == pytest.approx(classic.min(), rel=1e-12)
    # continuous minimiser alpha* = 1 + sigma sqrt(2 log(1/delta)):
    # eps* = 1/(2 sigma^2) + sqrt(2 log(1/delta)) / sigma; the order grid is fine near alpha*
    root = math.sqrt(2 * math.log(1 / DELTA))
    eps_star, alpha_star = 1 / (2 * sigma**2) + root / sigma, 1 + sigma * root
    assert eps_star - 1e-12 <= rep.epsilon <= eps_star + 1e-3
    assert rep.optimal_order == pytest.approx(alpha_star, abs=0.6)
    # dp_accounting's conversion (Canonne-Kamath-Steinke 2020 Prop. 12)
    mask = ORDERS > 1.01
    a, r = ORDERS[mask], rdp[mask]
    improved = r + np.log1p(-1 / a) - np.log(DELTA * a) / (a - 1)
    assert epsilon(GaussianEvent(sigma), DELTA, "rdp") == pytest.approx(improved.min(), rel=1e-12)
    assert improved.min() < classic.min()


@pytest.mark.parametrize("steps", [1, 10])
def test_poisson_rate_one_is_no_sampling(steps):
    sampled = dpsgd_event(2.0, steps, 1.0)
    plain = SelfComposedEvent(GaussianEvent(2.0), steps)
    assert epsilon(sampled, DELTA, "rdp") == pytest.approx(epsilon(plain, DELTA, "rdp"), rel=1e-12)
    assert epsilon(sampled, DELTA, "pld") == pytest.approx(epsilon(plain, DELTA, "pld"), abs=1e-3)
    assert epsilon(sampled, DELTA, "pld") == pytest.approx(
        analytic_gaussian_epsilon(2.0 / math.sqrt(steps), DELTA), abs=1e-3
    )


def test_heterogeneous_noise_matches_dp_accounting_directly():
    q = 256 / 60000
    led = Ledger()
    led.record(PoissonSampledEvent(q, GaussianEvent(1.0)), 300)
    led.record(PoissonSampledEvent(q, GaussianEvent(2.0)), 200)
    led.record(PoissonSampledEvent(q, GaussianEvent(0.8)), 100)

    def direct(acc):
        for z, n in ((1.0, 300), (2.0, 200), (0.8, 100)):
            acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), n)
        return acc.get_epsilon(DELTA)

    assert epsilon(led, DELTA, "rdp") == pytest.approx(direct(RdpAccountant()), rel=1e-12)
    pld_ref = direct(PLDAccountant(value_discretization_interval=1e-3))
    assert epsilon(led, DELTA, "pld") == pytest.approx(pld_ref, abs=1e-9)
    # and it lies strictly between the homogeneous runs at the extreme multipliers
    lo = epsilon(dpsgd_event(2.0, 600, q), DELTA, "rdp")
    hi = epsilon(dpsgd_event(0.8, 600, q), DELTA, "rdp")
    assert lo < epsilon(led, DELTA, "rdp") < hi


def test_fixed_size_sampling_costs_about_twice_poisson():
    n, b, sigma, steps = 60000, 256, 1.1, 60 * 60000 // 256
    wor = dpsgd_event(sigma, steps, sampling="without-replacement", dataset_size=n, batch_size=b)
    poisson = dpsgd_event(sigma, steps, b / n)
    rep = compute_epsilon(wor, DELTA, "rdp")
    assert rep.adjacency == "replace-one"
    assert compute_epsilon(poisson, DELTA, "rdp").adjacency == "add-remove-one"
    assert rep.epsilon > 1.5 * epsilon(poisson, DELTA, "rdp")
    with pytest.raises(UnsupportedAccountingError, match="rdp") as info:
        epsilon(wor, DELTA, "pld")
    assert "SampledWithoutReplacement" in str(info.value)


def test_zero_noise_is_infinite_epsilon():
    for acc in ("pld", "rdp", "rdp-classic"):
        assert epsilon(dpsgd_event(0.0, 10, 0.01), DELTA, acc) == math.inf
        assert epsilon(GaussianEvent(0.0), DELTA, acc) == math.inf
    # ... but a step that samples nothing or releases nothing is free
    assert epsilon(dpsgd_step_event(1.0, 1.0, extra=()), DELTA, "rdp") > 0
    assert epsilon(PoissonSampledEvent(0.0, GaussianEvent(0.0)), DELTA, "pld") == 0.0
