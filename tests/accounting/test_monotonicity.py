"""Epsilon grows with steps and sample rate, falls with the noise multiplier, is never negative."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpclip.accounting import ACCOUNTANTS, dpsgd_event, epsilon

DELTA = 1e-5


@pytest.mark.parametrize("accountant", ACCOUNTANTS)
def test_grid_monotonicity(accountant):
    q, z = 0.01, 1.5
    by_steps = [epsilon(dpsgd_event(z, t, q), DELTA, accountant) for t in (10, 100, 1000, 4000)]
    by_rate = [epsilon(dpsgd_event(z, 500, r), DELTA, accountant) for r in (0.002, 0.01, 0.05)]
    by_sigma = [epsilon(dpsgd_event(s, 500, q), DELTA, accountant) for s in (0.9, 1.5, 3.0, 8.0)]
    assert all(b > a for a, b in zip(by_steps, by_steps[1:])), by_steps
    assert all(b > a for a, b in zip(by_rate, by_rate[1:])), by_rate
    assert all(b < a for a, b in zip(by_sigma, by_sigma[1:])), by_sigma
    assert min(by_steps + by_rate + by_sigma) > 0


@pytest.mark.parametrize("accountant", ACCOUNTANTS)
def test_never_negative_with_huge_noise(accountant):
    for z in (1e2, 1e4):
        eps = epsilon(dpsgd_event(z, 10, 0.01), DELTA, accountant)
        assert 0.0 <= eps < 0.1
        assert not math.isnan(eps)


ORDERS = list(range(2, 65))  # integer orders: fast exact RDP, the same monotonicity


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    q=st.floats(1e-3, 0.3),
    z=st.floats(0.7, 8.0),
    steps=st.integers(1, 3000),
)
def test_rdp_monotone_random(q, z, steps):
    def eps(z_, steps_, q_):
        return epsilon(dpsgd_event(z_, steps_, q_), DELTA, "rdp", rdp_orders=ORDERS)

    e = eps(z, steps, q)
    assert e >= 0.0
    assert eps(z, 2 * steps, q) >= e
    assert eps(z, steps, min(1.0, 2 * q)) >= e
    assert eps(1.5 * z, steps, q) <= e
