"""dpclip.audit estimators: published values, closed forms, naive oracles, validity."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from scipy import stats

from dpclip.audit import (
    AuditResult,
    clopper_pearson_epsilon,
    clopper_pearson_upper,
    gaussian_mu_for,
    one_run_epsilon,
    one_run_epsilon_from_counts,
    one_run_fdp_epsilon,
    one_run_fdp_epsilon_from_counts,
    one_run_p_value,
    rank_grid,
    roc_hull,
)


def quantile_normal(mu: float, n: int) -> np.ndarray:
    """n deterministic N(mu, 1) scores: the quantiles at the midpoints (k + 1/2) / n."""
    return stats.norm.ppf((np.arange(n) + 0.5) / n) + mu


# ---------------------------------------------------------------- published values (jax_privacy)

# jax_privacy/auditing_test.py, test_epsilon_one_run_close: 10,000 in and 10,000 out canaries with
# deterministic N(shift, 1) / N(0, 1) scores, significance 0.05, delta 1e-6, Bonferroni over the
# ROC hull; their tolerance is rtol=1e-5.
PUBLISHED = [
    (1.0, 1.13346, 2.164749),
    (2.0, 2.311945, 4.7218075),
    (4.0, 4.395568, 9.133752),
]


@pytest.fixture(scope="module")
def out10k() -> np.ndarray:
    return quantile_normal(0.0, 10_000)


@pytest.mark.parametrize("shift,one_run,fdp", PUBLISHED)
def test_published_one_run_values(out10k, shift, one_run, fdp):
    ins = quantile_normal(shift, 10_000)
    r = one_run_epsilon(ins, out10k, significance=0.05, delta=1e-6, thresholds="hull")
    np.testing.assert_allclose(r.epsilon, one_run, rtol=1e-5)
    f = one_run_fdp_epsilon(ins, out10k, significance=0.05, delta=1e-6, thresholds="hull")
    np.testing.assert_allclose(f.epsilon, fdp, rtol=1e-5)
    # the reported guesses reproduce the bound through the count-level functions
    alpha = 0.05 / r.n_hypotheses
    assert r.epsilon == pytest.approx(
        one_run_epsilon_from_counts(20_000, r.n_guesses, r.n_correct, alpha, 1e-6), rel=1e-7)
    assert r.n_correct == int(np.sum(ins >= r.threshold))
    assert r.n_guesses == r.n_correct + int(np.sum(out10k >= r.threshold))


@pytest.mark.parametrize("estimator", [one_run_epsilon, one_run_fdp_epsilon])
@pytest.mark.parametrize("thresholds", ["grid", "all", "hull"])
@pytest.mark.parametrize("shift", [0.0, -0.5, -3.0])
def test_zero_or_negative_shift_gives_zero(out10k, estimator, thresholds, shift):
    ins = quantile_normal(shift, 10_000)
    r = estimator(ins, out10k, significance=0.05, delta=1e-6, thresholds=thresholds)
    assert r.epsilon == 0.0


@pytest.mark.parametrize("estimator", [one_run_epsilon, one_run_fdp_epsilon])
def test_bound_grows_with_shift(estimator):
    outs = quantile_normal(0.0, 2000)
    eps = [estimator(quantile_normal(s, 2000), outs, delta=1e-5).epsilon
           for s in (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0)]
    assert eps[0] >= 0.0 and eps[-1] > 1.0
    assert all(b > a for a, b in zip(eps[1:], eps[2:])), eps
    assert all(b >= a for a, b in zip(eps, eps[1:])), eps


def test_grid_is_more_powerful_than_hull_here(out10k):
    # the delta term of the one-run p-value is >= 2 m delta / v: a small K matters
    ins = quantile_normal(1.0, 10_000)
    grid = one_run_epsilon(ins, out10k, delta=1e-6)
    hull = one_run_epsilon(ins, out10k, delta=1e-6, thresholds="hull")
    assert grid.thresholds == "grid" and grid.n_hypotheses == rank_grid(20_000).size == 54
    assert grid.epsilon > hull.epsilon > 1.0
    # ... and K = m + 1 leaves nothing to refute at this delta
    assert one_run_epsilon(ins, out10k, delta=1e-6, thresholds="all").epsilon == 0.0


# ---------------------------------------------------------------- p-value and counts


def _naive_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """From the definition, with exact binomial coefficients and a plain loop."""
    q = math.exp(eps) / (1.0 + math.exp(eps))
    pmf = [math.comb(r, k) * q**k * (1 - q) ** (r - k) for k in range(r + 1)]
    beta = sum(pmf[v:])
    alpha = 0.0
    window = 0.0
    for i in range(1, v + 1):
        window += pmf[v - i]
        alpha = max(alpha, window / i)
    return min(1.0, beta + 2 * m * delta * alpha)


@pytest.mark.parametrize("m,r,v", [(10, 1, 1), (40, 10, 9), (100, 30, 20), (100, 60, 60),
                                   (1000, 80, 50), (50, 20, 0)])
@pytest.mark.parametrize("eps", [0.0, 0.5, 1.3])
@pytest.mark.parametrize("delta", [0.0, 1e-5, 1e-2])
def test_p_value_matches_naive_loop(m, r, v, eps, delta):
    got = one_run_p_value(m, r, v, eps, delta)
    assert got == pytest.approx(_naive_p_value(m, r, v, eps, delta), rel=1e-9, abs=1e-15)


def test_one_run_from_counts_is_the_root_of_the_p_value():
    eps = one_run_epsilon_from_counts(1000, 200, 180, 0.05, 1e-5)
    assert eps > 1.0
    assert one_run_p_value(1000, 200, 180, eps, 1e-5) == pytest.approx(0.05, rel=1e-6)
    assert one_run_p_value(1000, 200, 180, eps * 0.99, 1e-5) < 0.05
    # delta = 0: the classical binomial tail, eps_lb = logit of a Clopper-Pearson lower bound
    eps0 = one_run_epsilon_from_counts(1000, 200, 180, 0.05, 0.0)
    q_lb = 1.0 - clopper_pearson_upper(20, 200, 0.05)  # precision lower bound
    assert eps0 == pytest.approx(math.log(q_lb / (1 - q_lb)), rel=1e-6)
    assert eps0 > eps
    # more correct guesses at the same count: a larger bound; none correct beyond chance: 0
    assert one_run_epsilon_from_counts(1000, 200, 190, 0.05, 1e-5) > eps
    assert one_run_epsilon_from_counts(1000, 200, 100, 0.05, 1e-5) == 0.0


def test_fdp_from_counts_dominates_one_run_on_perfect_guesses():
    # all guesses right: f-DP (Gaussian family) refutes more than the (eps, delta) test
    for r in (50, 500, 5000):
        a = one_run_epsilon_from_counts(20_000, r, r, 0.05, 1e-6)
        b = one_run_fdp_epsilon_from_counts(20_000, r, r, 0.05, 1e-6)
        assert b > a > 0


# ---------------------------------------------------------------- Gaussian mu


@pytest.mark.parametrize("eps,delta", [(0.0, 1e-6), (0.5, 1e-5), (1.0, 1e-6), (4.4, 1e-6),
                                       (9.13, 1e-6), (30.0, 1e-3), (1e-9, 0.5)])
def test_gaussian_mu_matches_dp_accounting(eps, delta):
    want = 1.0 / dp_accounting.get_sigma_gaussian(eps, delta)
    assert gaussian_mu_for(eps, delta) == pytest.approx(want, rel=1e-9)
    # and it is exactly tight: the mu-GDP delta at eps is delta
    mu = gaussian_mu_for(eps, delta)
    got = stats.norm.cdf(mu / 2 - eps / mu) - math.exp(eps) * stats.norm.cdf(-mu / 2 - eps / mu)
    assert got == pytest.approx(delta, rel=1e-6)


# ---------------------------------------------------------------- Clopper-Pearson


@pytest.mark.parametrize("k,n", [(0, 50), (3, 50), (25, 100), (99, 100)])
def test_clopper_pearson_upper_is_the_binomial_quantile(k, n):
    ub = float(clopper_pearson_upper(k, n, 0.05))
    assert stats.binom.cdf(k, n, ub) == pytest.approx(0.05, rel=1e-7)
    if k == 0:
        assert ub == pytest.approx(1.0 - 0.05 ** (1.0 / n), rel=1e-10)
    assert float(clopper_pearson_upper(n, n, 0.05)) == 1.0


def test_clopper_pearson_explicit_threshold_hand_computed():
    # 100 runs with the canary: 90 score >= 0.5; 100 runs without: 5 do
    ins = np.r_[np.full(90, 1.0), np.full(10, 0.0)]
    outs = np.r_[np.full(5, 1.0), np.full(95, 0.0)]
    r = clopper_pearson_epsilon(ins, outs, significance=0.05, delta=1e-5, threshold=0.5)
    fnr_ub = stats.beta.ppf(1 - 0.025, 10 + 1, 100 - 10)  # FN = 10
    fpr_ub = stats.beta.ppf(1 - 0.025, 5 + 1, 100 - 5)  # FP = 5
    want = max(math.log((1 - 1e-5 - fnr_ub) / fpr_ub), math.log((1 - 1e-5 - fpr_ub) / fnr_ub))
    assert r.epsilon == pytest.approx(want, rel=1e-12)
    assert (r.n_hypotheses, r.thresholds, r.direction) == (1, "explicit", "TPR/FPR")
    assert (r.n_guesses, r.n_correct) == (95, 90)
    one = clopper_pearson_epsilon(ins, outs, significance=0.05, delta=1e-5, threshold=0.5,
                                  two_sided=False)
    assert one.epsilon == pytest.approx(math.log((1 - 1e-5 - fnr_ub) / fpr_ub), rel=1e-12)


def test_clopper_pearson_search_perfect_separation_closed_form():
    # in-runs all score 1, out-runs all 0: the best cut has FN = FP = 0, and with K = m + 1
    # thresholds each bound is 1 - (alpha / 2K)^(1/n) (Clopper-Pearson at k = 0)
    n = 50
    r = clopper_pearson_epsilon(np.ones(n), np.zeros(n), significance=0.05, delta=1e-5)
    k = 2 * n + 1
    u = 1.0 - (0.05 / (2 * k)) ** (1.0 / n)
    assert r.n_hypotheses == k and r.threshold == 1.0
    assert r.epsilon == pytest.approx(math.log((1 - 1e-5 - u) / u), rel=1e-9)


def test_clopper_pearson_second_ratio_hand_computed():
    # in-runs all score 1 (FN = 0); 30 of 50 out-runs score 1 too: TPR/FPR is weak, but the
    # region score < 1 has TNR = 0.4 against FNR = 0, which the two-sided test uses
    n = 50
    ins = np.ones(n)
    outs = np.r_[np.ones(30), np.zeros(20)]
    r = clopper_pearson_epsilon(ins, outs, significance=0.05, delta=1e-5)
    level = 0.05 / (2 * (2 * n + 1))
    fnr_ub = 1.0 - level ** (1.0 / n)  # FN = 0
    fpr_ub = stats.beta.ppf(1 - level, 30 + 1, n - 30)  # FP = 30
    assert (r.threshold, r.direction) == (1.0, "TNR/FNR")
    assert r.epsilon == pytest.approx(math.log((1 - 1e-5 - fpr_ub) / fnr_ub), rel=1e-9)
    one = clopper_pearson_epsilon(ins, outs, significance=0.05, delta=1e-5, two_sided=False)
    assert one.direction == "TPR/FPR"
    assert one.epsilon == pytest.approx(max(0.0, math.log((1 - 1e-5 - fnr_ub) / fpr_ub)),
                                        abs=1e-12)
    assert one.epsilon < r.epsilon


# ---------------------------------------------------------------- validity on real mechanisms


def test_one_run_randomized_response_is_valid_and_tight():
    # eps-DP randomized response on each canary's bit: the bound must not exceed eps, and with
    # 20,000 canaries it gets close (Steinke et al.: tight for many guesses and pure DP)
    eps = 1.0
    rng = np.random.default_rng(1234)
    m = 20_000
    included = rng.random(m) < 0.5
    keep = rng.random(m) < math.exp(eps) / (1 + math.exp(eps))
    release = np.where(keep, included, ~included).astype(float)
    r = one_run_epsilon(release[included], release[~included], delta=1e-6)
    assert 0.85 < r.epsilon <= eps, r


def test_bounds_below_the_gaussian_mechanism_epsilon():
    # mu-GDP mechanism (score = N(mu * in, 1)), random canaries: every bound stays below the
    # exact epsilon of mu-GDP at this delta
    mu, delta = 2.0, 1e-5
    true_eps = dp_accounting.get_epsilon_gaussian(1.0 / mu, delta)
    rng = np.random.default_rng(99)
    included = rng.random(10_000) < 0.5
    scores = rng.normal(size=10_000) + mu * included
    a = one_run_epsilon(scores[included], scores[~included], delta=delta)
    b = one_run_fdp_epsilon(scores[included], scores[~included], delta=delta)
    c = clopper_pearson_epsilon(scores[included], scores[~included], delta=delta)
    assert 0 < a.epsilon < b.epsilon < true_eps
    assert 0 < c.epsilon < true_eps


# ---------------------------------------------------------------- thresholds: hull, grid, explicit


@pytest.mark.parametrize("points,expected", [
    ([[0, 0], [1, 1]], [0, 1]),
    ([[0, 0], [1, 1], [2, 2], [3, 3]], [0, 3]),  # collinear points dropped
    ([[0, 0], [0, 2], [3, 2], [3, 5], [5, 5]], [0, 1, 3, 4]),
    ([[0, 0], [0, 2], [2, 2], [2, 3], [3, 3], [3, 5], [5, 5]], [0, 1, 5, 6]),
    ([[0, 0], [0, 2], [1, 2], [1, 4], [3, 4], [3, 5], [5, 5]], [0, 1, 3, 5, 6]),
])
def test_roc_hull_hand_checked(points, expected):
    p = np.asarray(points)
    np.testing.assert_array_equal(roc_hull(p[:, 0], p[:, 1]), expected)


def test_roc_hull_matches_brute_force():
    # ROC points: each step raises the false- or the true-negative count (or both)
    rng = np.random.default_rng(0)
    for _ in range(5):
        steps = rng.integers(0, 3, size=(40, 2))
        steps[steps.sum(axis=1) == 0, 1] = 1
        x, y = np.cumsum(steps[:, 0]), np.cumsum(steps[:, 1])
        hull = set(roc_hull(x, y).tolist())
        assert {0, 39} <= hull
        for j in range(1, 39):  # a vertex iff strictly above every chord (i, k) around it
            below = any(
                (x[k] - x[i]) * (y[j] - y[i]) - (y[k] - y[i]) * (x[j] - x[i]) <= 0
                for i in range(j) for k in range(j + 1, 40)
            )
            assert (j in hull) == (not below), j


def test_rank_grid():
    g = rank_grid(20_000)
    assert g[0] == 1 and g[-1] == 20_000 and np.all(np.diff(g) > 0)
    assert np.all(g[1:] / g[:-1] <= 2.0)
    np.testing.assert_array_equal(rank_grid(1), [1])


def test_explicit_threshold_uses_k_one():
    ins, outs = quantile_normal(2.0, 1000), quantile_normal(0.0, 1000)
    r = one_run_epsilon(ins, outs, delta=1e-5, threshold=2.5)
    tp, fp = int(np.sum(ins >= 2.5)), int(np.sum(outs >= 2.5))
    assert (r.n_hypotheses, r.n_guesses, r.n_correct) == (1, tp + fp, tp)
    assert r.epsilon == pytest.approx(one_run_epsilon_from_counts(2000, tp + fp, tp, 0.05, 1e-5))
    assert isinstance(r, AuditResult) and r.method == "one_run"


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs,match", [
    ({"significance": 0.0}, "significance"),
    ({"significance": 1.0}, "significance"),
    ({"delta": -0.1}, "delta"),
    ({"delta": 1.0}, "delta"),
    ({"thresholds": "best"}, "thresholds"),
    ({"threshold": float("nan")}, "threshold"),
])
@pytest.mark.parametrize("estimator", [one_run_epsilon, one_run_fdp_epsilon,
                                       clopper_pearson_epsilon])
def test_argument_errors(estimator, kwargs, match):
    args = {"significance": 0.05, "delta": 1e-5}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        estimator([1.0, 2.0], [0.0, 1.0], **args)


@pytest.mark.parametrize("ins,outs,match", [
    ([], [0.0], "in_scores"),
    ([1.0], [], "out_scores"),
    ([[1.0]], [0.0], "in_scores"),
    ([1.0, float("nan")], [0.0], "in_scores"),
    ([1.0], [float("inf")], "out_scores"),
])
def test_score_errors(ins, outs, match):
    with pytest.raises(ValueError, match=match):
        one_run_epsilon(ins, outs, delta=1e-5)


def test_fdp_needs_positive_delta_and_counts_are_checked():
    with pytest.raises(ValueError, match="delta"):
        one_run_fdp_epsilon([1.0], [0.0], delta=0.0)
    with pytest.raises(ValueError, match="n_correct"):
        one_run_epsilon_from_counts(10, 5, 6, 0.05, 1e-5)
    with pytest.raises(ValueError, match="n_guess"):
        one_run_p_value(10, 11, 0, 0.5, 1e-5)
    with pytest.raises(ValueError, match="epsilon"):
        one_run_p_value(10, 5, 3, -1.0, 1e-5)
    with pytest.raises(ValueError, match="delta"):
        gaussian_mu_for(1.0, 0.0)
