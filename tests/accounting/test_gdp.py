"""GDP / CLT tools for reproducing Du et al. (test vectors T10, T11)."""

import math

import pytest

from dpclip.accounting import epsilon
from dpclip.accounting import gdp
from dpclip.events import GaussianEvent, PoissonSampledEvent, SelfComposedEvent

Q, T, DELTA = 256 / 60000, 4687, 1e-5


def test_gdp_delta_and_its_inverses():
    # one Gaussian mechanism with multiplier 1 is 1-GDP: delta(eps=1) from the closed form
    phi = lambda x: 0.5 * math.erfc(-x / math.sqrt(2))  # noqa: E731
    assert gdp.gdp_delta(1.0, 1.0) == pytest.approx(phi(-0.5) - math.e * phi(-1.5), rel=1e-12)
    assert gdp.gdp_delta(0.0, 1.0) == pytest.approx(2 * phi(0.5) - 1, rel=1e-12)
    mu = gdp.gdp_mu_for(1.0, 1e-5)
    assert gdp.gdp_delta(1.0, mu) == pytest.approx(1e-5, rel=1e-9)
    assert gdp.gdp_epsilon(mu, 1e-5) == pytest.approx(1.0, rel=1e-9)
    assert gdp.gdp_epsilon(1e-3, 0.5) == 0.0  # delta already met at epsilon 0
    assert math.isfinite(gdp.gdp_delta(800.0, 2.0))  # no overflow of e^eps


def test_t10_du_schedule():
    mu_tot = gdp.gdp_mu_for(0.4, DELTA)
    assert mu_tot == pytest.approx(0.11588, abs=5e-6)
    sigma_u = gdp.uniform_sigma_for_mu(mu_tot, Q, T)
    assert sigma_u == pytest.approx(2.6157, abs=5e-5)
    assert gdp.poisson_clt_mu(Q, [sigma_u] * T) == pytest.approx(mu_tot, rel=1e-12)
    mu0 = gdp.du_mu0(mu_tot, Q, T, 0.7)
    assert mu0 == pytest.approx(0.31603, abs=5e-6)
    assert 1 / mu0 == pytest.approx(3.1643, abs=5e-5)  # sigma_0
    assert 0.7 / mu0 == pytest.approx(2.2150, abs=5e-5)  # sigma_T
    sig = gdp.du_noise_multipliers(mu0, T, 0.7)
    assert len(sig) == T and sig[0] == 1 / mu0
    assert gdp.poisson_clt_mu(Q, sig) == pytest.approx(mu_tot, rel=1e-9)  # Eq. 10 holds
    # rho = 1 is the uniform schedule
    assert 1 / gdp.du_mu0(mu_tot, Q, T, 1.0) == pytest.approx(sigma_u, rel=1e-9)


def test_t11_clt_under_reports_epsilon():
    eps_clt = gdp.poisson_clt_epsilon(Q, [2.6157] * T, DELTA)
    assert eps_clt == pytest.approx(0.400, abs=5e-4)
    run = SelfComposedEvent(PoissonSampledEvent(Q, GaussianEvent(2.6157)), T)
    eps_rdp = epsilon(run, DELTA, accountant="rdp")
    assert eps_rdp == pytest.approx(0.446, abs=5e-4)
    assert eps_clt < eps_rdp


@pytest.mark.parametrize(
    "call, match",
    [(lambda: gdp.gdp_delta(-1, 1), "epsilon"), (lambda: gdp.gdp_delta(1, 0), "mu"),
     (lambda: gdp.gdp_mu_for(1, 1.5), "delta"), (lambda: gdp.gdp_epsilon(1, 0), "delta"),
     (lambda: gdp.poisson_clt_mu(1.5, [1.0]), "sample_rate"),
     (lambda: gdp.poisson_clt_mu(0.1, []), "noise_multipliers"),
     (lambda: gdp.poisson_clt_mu(0.1, [1.0, 0.0]), "noise_multipliers"),
     (lambda: gdp.uniform_sigma_for_mu(0.1, 0.01, 0), "steps"),
     (lambda: gdp.du_mu0(0.1, 0.01, 10, 1.4), r"noise_final_over_initial .*1 / noise"),
     (lambda: gdp.du_mu0(0.0, 0.01, 10, 0.7), "mu_tot")],
)
def test_errors_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_no_torch_and_warning_in_docs():
    import ast
    import inspect

    src = inspect.getsource(gdp)
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            assert all(n.split(".")[0] != "torch" for n in names)
    for fn in (gdp.poisson_clt_mu, gdp.poisson_clt_epsilon, gdp.du_mu0, gdp.gdp_epsilon):
        assert "UNDER-REPORTS" in fn.__doc__


def test_t8_t9_nguyen_gdp():
    # algorithms.md T8/T9: E = 50, m = 64, N = 54000, L = 8 blocks of per-layer noise
    assert gdp.nguyen_h(2.5 / math.sqrt(8)) == pytest.approx(1.5142, abs=5e-5)
    assert gdp.nguyen_mu(50, 64, 54000, 2.5, groups=8) == pytest.approx(0.5213, abs=5e-5)
    assert gdp.nguyen_h(1.5 / math.sqrt(8)) == pytest.approx(5.7831, abs=5e-5)
    assert gdp.nguyen_mu(50, 64, 54000, 1.5, groups=8) == pytest.approx(1.9909, abs=5e-5)
    # the paper's epsilons at delta = 1e-5 (algorithms.md 3.4): 2.09 and 9.94
    assert gdp.gdp_epsilon(gdp.nguyen_mu(50, 64, 54000, 2.5, 8), 1e-5) == pytest.approx(2.09, abs=0.01)
    assert gdp.gdp_epsilon(gdp.nguyen_mu(50, 64, 54000, 1.5, 8), 1e-5) == pytest.approx(9.94, abs=0.01)
    # h grows as the noise shrinks; L = 1 is plain sigma
    assert gdp.nguyen_h(1.0) < gdp.nguyen_h(0.5)
    assert gdp.nguyen_mu(1, 10, 100, 2.0) == pytest.approx(math.sqrt(2 * 0.1) * gdp.nguyen_h(2.0))
    with pytest.raises(ValueError, match="groups"):
        gdp.nguyen_mu(1, 10, 100, 2.0, groups=0)
    with pytest.raises(ValueError, match="batch_size"):
        gdp.nguyen_mu(1, 200, 100, 2.0)
