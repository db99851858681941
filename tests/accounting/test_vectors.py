"""Published accountant values (algorithms.md section 5, T1-T3; performance.md) and Opacus.

Conversions used below:
* ``rdp-classic``: eps = min_alpha RDP(alpha) + log(1/delta)/(alpha-1) (Mironov 2017 Prop. 3),
  the conversion of TF-Privacy's ``compute_dp_sgd_privacy`` and of 2016-2021 papers (T1, T3).
* ``rdp``: dp_accounting's ``compute_epsilon``: eps = min_alpha RDP(alpha) + log1p(-1/alpha)
  - log(delta * alpha)/(alpha-1) (Canonne-Kamath-Steinke 2020 Prop. 12), the same formula as the
  Balle et al. 2020 Thm 21 conversion of Opacus' ``RDPAccountant`` (T2).
"""

import math
import warnings

import pytest

from dpclip.accounting import compute_epsilon, dpsgd_event, epsilon

N = 60_000
DELTA = 1e-5


def tf_privacy_steps(epochs: int, batch_size: int) -> int:
    # TF-Privacy compute_dp_sgd_privacy_lib: steps = int(math.ceil(epochs * n / batch_size)).
    # (epochs * N // B is one step fewer; both round to the same two decimals.)
    return int(math.ceil(epochs * N / batch_size))


def test_t1_tf_privacy_mnist_classic_conversion():
    # N=60000, B=256 (Poisson q=256/60000), sigma=1.1, 60 epochs: TF-Privacy README "3.01".
    ev = dpsgd_event(1.1, tf_privacy_steps(60, 256), 256 / N)
    rep = compute_epsilon(ev, DELTA, accountant="rdp-classic")
    assert rep.epsilon == pytest.approx(3.01, abs=0.005)  # published to two decimals
    assert rep.accountant == "rdp-classic" and rep.adjacency == "add-remove-one"
    assert 2 < rep.optimal_order < 20
    # and with the other step-count convention
    assert epsilon(dpsgd_event(1.1, 60 * N // 256, 256 / N), DELTA, "rdp-classic") == (
        pytest.approx(3.01, abs=0.005)
    )


def test_t2_same_setting_dp_accounting_conversion():
    # Same RDP curve, Balle et al. / Canonne et al. conversion: 2.597 (algorithms.md T2, Opacus).
    eps = epsilon(dpsgd_event(1.1, 60 * N // 256, 256 / N), DELTA, "rdp")
    assert eps == pytest.approx(2.597, abs=5e-4)  # T2 is given to three decimals
    classic = epsilon(dpsgd_event(1.1, 60 * N // 256, 256 / N), DELTA, "rdp-classic")
    assert classic - eps > 0.35  # the two conversions really differ (3.01 vs 2.60)


def test_t2_against_opacus_rdp():
    accountants = pytest.importorskip("opacus.accountants")
    steps = 60 * N // 256
    opacus = accountants.RDPAccountant()
    opacus.history = [(1.1, 256 / N, steps)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = opacus.get_epsilon(DELTA)
    # Same conversion formula; Opacus' default orders are a subset of dp_accounting's and the
    # optimum (alpha = 8.1) lies in both, so the values agree to float precision.
    assert epsilon(dpsgd_event(1.1, steps, 256 / N), DELTA, "rdp") == pytest.approx(ref, abs=1e-6)


def test_t3_tramer_boneh_classic_conversion():
    # B=512, sigma=1.23, 40 epochs: 2.99 with the old conversion (the paper's "epsilon = 3").
    ev = dpsgd_event(1.23, tf_privacy_steps(40, 512), 512 / N)
    assert epsilon(ev, DELTA, "rdp-classic") == pytest.approx(2.99, abs=0.005)
    assert epsilon(ev, DELTA, "rdp") == pytest.approx(2.58, abs=0.005)  # algorithms.md 1.4


@pytest.mark.parametrize(
    "sigma, epochs, rdp_ref, pld_ref",
    [(0.6, 10, 11.04, 9.55), (1.0, 10, 2.86, 2.52), (1.0, 60, 6.96, 6.38), (2.0, 60, 2.40, 2.21)],
)
def test_performance_md_table(sigma, epochs, rdp_ref, pld_ref):
    q = 1024 / N
    ev = dpsgd_event(sigma, int(epochs / q), q)
    assert epsilon(ev, DELTA, "rdp") == pytest.approx(rdp_ref, abs=0.006)  # 2-decimal table
    assert epsilon(ev, DELTA, "pld") == pytest.approx(pld_ref, abs=0.006)


@pytest.mark.parametrize("sigma", [0.8, 1.0, 2.0])
@pytest.mark.parametrize("epochs", [10, 60])
def test_cross_check_opacus(sigma, epochs):
    accountants = pytest.importorskip("opacus.accountants")
    q = 1024 / N
    steps = int(epochs / q)
    ev = dpsgd_event(sigma, steps, q)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rdp = accountants.RDPAccountant()
        rdp.history = [(sigma, q, steps)]
        prv = accountants.PRVAccountant()
        prv.history = [(sigma, q, steps)]
        ref_rdp, ref_prv = rdp.get_epsilon(DELTA), prv.get_epsilon(DELTA)
    ours_rdp = epsilon(ev, DELTA, "rdp")
    ours_pld = epsilon(ev, DELTA, "pld")
    assert ours_rdp == pytest.approx(ref_rdp, abs=0.02)
    # PRV (eps_error 0.01, upper bound) and PLD (1e-3 grid) agree within their error budgets
    assert ours_pld == pytest.approx(ref_prv, abs=0.02)
    assert ours_pld < ours_rdp  # PLD is the tighter accountant in this regime
