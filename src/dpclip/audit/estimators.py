"""Epsilon lower bounds from membership guesses on canaries (imports numpy and scipy only).

An *audit* plants canaries, observes a released artefact (a model, a noisy gradient) and gives each
canary a *score*: higher means "more likely included". From the scores of the canaries that were
really included (``in_scores``) and of those that were not (``out_scores``) each estimator returns
an ``epsilon`` such that, with probability at least ``1 - significance`` over the randomness of the
audit, the mechanism is **not** ``(epsilon', delta)``-DP for any ``epsilon' < epsilon`` (one-run
f-DP: not ``mu``-GDP for the ``mu`` whose ``(epsilon, delta)`` curve passes through that point, see
:func:`one_run_fdp_epsilon`). An audit can only refute a privacy claim, never prove one; a bound of
0 means "nothing refuted".

Estimators
----------
* :func:`one_run_epsilon`: Steinke, Nasr & Jagielski (2023), "Privacy Auditing with One (1)
  Training Run", arXiv:2305.08846. ``m`` canaries in ONE run, each included independently with
  probability 1/2; the auditor guesses "in" for the ``r`` canaries scoring at least a threshold and
  abstains on the others; ``v`` guesses are right. Under ``(eps, delta)``-DP, ``v`` is
  stochastically dominated by ``Binomial(r, e^eps / (1 + e^eps))`` up to a ``delta`` term; the
  bound is the largest ``eps`` whose p-value is still at most ``significance``.
* :func:`one_run_fdp_epsilon`: Mahloujifar, Melis & Chaudhuri (2024), "Auditing f-Differential
  Privacy in One Run", arXiv:2410.22235, with the Gaussian trade-off family (as jax_privacy's
  ``CanaryScoreAuditor.epsilon_one_run_fdp``): the same guesses, a tighter test of the hypothesis
  "the mechanism is ``mu``-GDP".
* :func:`clopper_pearson_epsilon`: the classical many-run audit (Jagielski, Ullman & Oprea 2020,
  arXiv:2006.07709; Nasr et al. 2021, arXiv:2101.04535): ``T`` independent runs with the canary in
  and ``T`` without; a threshold test's FNR and FPR get one-sided Clopper-Pearson upper bounds and
  ``eps >= log((1 - delta - FNR_ub) / FPR_ub)`` (and the same with the roles swapped).

Choosing the threshold (multiple testing)
-----------------------------------------
Every estimator may pick its threshold after seeing which canaries were in; it pays for the choice
with a Bonferroni correction: ``significance`` is divided by the number ``K`` of guessing rules it
could have picked from. Each rule must be a function of the released scores only (never of the
in/out labels). ``thresholds=``

* ``"grid"`` (one-run default): the rule "in if the score is at least the ``r``-th largest of the
  ``m`` pooled scores", for ``r`` in :func:`rank_grid` (about 4 values per doubling, fixed by ``m``
  before the scores are seen; 54 rules for ``m = 20000``). Valid as stated, and cheap in ``K``,
  which matters for the one-run bound: its ``delta`` term is at least ``2 m delta / v``, so a large
  ``K`` (a small ``significance / K``) can leave nothing to refute.
* ``"all"`` (Clopper-Pearson default): every cut of the pooled scores, ``K = m + 1``; Clopper-
  Pearson evaluates every cut, the one-run estimators search the ROC hull vertices (a subset, so
  ``K`` covers it).
* ``"hull"``: the vertices of the upper convex hull of the empirical ROC curve, ``K`` = their
  number, as jax_privacy's default ``Bonferroni()`` strategy (its published test values are
  reproduced with it). The hull depends on the labels, so this ``K`` is not a strict union bound;
  use it to compare with jax_privacy, not to claim a violation.

``threshold=t`` fixes the rule beforehand (``K = 1``); ``t`` must not come from the same scores.
For :func:`clopper_pearson_epsilon` the scores come from separate runs and a threshold searched on
them is the conventional practice (Bonferroni over the candidate cuts, as in the literature); for a
strict guarantee choose ``t`` on other runs and pass it.

All functions validate their arguments and raise ``ValueError`` naming the argument.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike
from scipy import optimize, special, stats

__all__ = [
    "AuditResult",
    "GaussianShiftResult",
    "Thresholds",
    "clopper_pearson_epsilon",
    "clopper_pearson_upper",
    "gaussian_epsilon_for",
    "gaussian_mu_for",
    "gaussian_shift_epsilon",
    "one_run_epsilon",
    "one_run_epsilon_from_counts",
    "one_run_fdp_epsilon",
    "one_run_fdp_epsilon_from_counts",
    "one_run_p_value",
    "rank_grid",
    "roc_hull",
]

Thresholds = Literal["grid", "all", "hull"]


@dataclass(frozen=True)
class AuditResult:
    """An epsilon lower bound and how it was obtained.

    ``epsilon`` is 0 when nothing is refuted. ``threshold`` is the chosen score threshold (guess
    "in" for ``score >= threshold``; ``inf`` means no guess at all); ``n_guesses`` / ``n_correct``
    are the one-run ``r`` and ``v`` at that threshold (for Clopper-Pearson: the number of scores
    at or above the threshold and how many of them are in-canaries). ``n_hypotheses`` is the
    Bonferroni factor ``K`` that divided ``significance``; ``direction`` says which likelihood ratio
    gave the bound: ``"TPR/FPR"`` (the region ``score >= t``), or for two-sided Clopper-Pearson
    ``"TNR/FNR"`` (the region ``score < t``, neighbouring datasets swapped).
    """

    epsilon: float
    method: str
    threshold: float
    n_guesses: int
    n_correct: int
    n_in: int
    n_out: int
    significance: float
    delta: float
    n_hypotheses: int
    thresholds: str
    direction: str = "TPR/FPR"


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------


def _scores(name: str, values: ArrayLike) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of scores, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} must be non-empty (pass the score of every {name[:-7]} canary)")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite; map NaN/inf scores to finite values first")
    return arr


def _check_significance(significance: float, upper: float = 1.0) -> float:
    s = float(significance)
    if not (0.0 < s < upper):
        raise ValueError(f"significance must be in (0, {upper:g}), got {significance!r}")
    return s


def _check_delta(delta: float, allow_zero: bool) -> float:
    d = float(delta)
    ok = (0.0 <= d < 1.0) if allow_zero else (0.0 < d < 1.0)
    if not ok:
        rng = "[0, 1)" if allow_zero else "(0, 1)"
        raise ValueError(f"delta must be in {rng}, got {delta!r}")
    return d


def _check_thresholds(thresholds: str) -> str:
    if thresholds not in ("grid", "all", "hull"):
        raise ValueError(f"thresholds must be 'grid', 'all' or 'hull', got {thresholds!r}")
    return thresholds


def _check_counts(m: int, n_guess: int, n_correct: int) -> None:
    for name, v in (("m", m), ("n_guess", n_guess), ("n_correct", n_correct)):
        if isinstance(v, bool) or int(v) != v:
            raise ValueError(f"{name} must be an integer, got {v!r}")
    if not (m >= 1):
        raise ValueError(f"m (number of canaries) must be >= 1, got {m}")
    if not (0 <= n_correct <= n_guess <= m):
        raise ValueError(
            f"need 0 <= n_correct <= n_guess <= m, got n_correct={n_correct}, n_guess={n_guess}, "
            f"m={m}"
        )


# --------------------------------------------------------------------------------------------
# ROC counts and hull
# --------------------------------------------------------------------------------------------


def _counts(in_scores: np.ndarray, out_scores: np.ndarray):
    """Candidate thresholds (distinct scores, then +inf) and, at each, the number of in/out
    canaries scoring BELOW it (false negatives / true negatives of the rule ``score >= t``)."""
    thresholds = np.concatenate([np.union1d(in_scores, out_scores), [np.inf]])
    fn = np.searchsorted(np.sort(in_scores), thresholds, side="left")
    tn = np.searchsorted(np.sort(out_scores), thresholds, side="left")
    return thresholds, fn.astype(np.int64), tn.astype(np.int64)


def roc_hull(fn: ArrayLike, tn: ArrayLike) -> np.ndarray:
    """Indices of the vertices of the upper convex hull of the points ``(fn_i, tn_i)``.

    The points are the empirical ROC curve in (false-negative, true-negative) counts, ordered by
    increasing threshold (both coordinates non-decreasing). A point on or below the segment joining
    two others is dropped (a randomised mix of those two thresholds does at least as well), so
    collinear points are dropped too; the first and last points are always kept. Andrew's monotone
    chain, ``O(n)``.
    """
    x = np.asarray(fn, dtype=np.float64)
    y = np.asarray(tn, dtype=np.float64)
    if x.ndim != 1 or x.shape != y.shape or x.size < 2:
        raise ValueError(f"fn and tn must be 1-D of equal length >= 2, got {x.shape}, {y.shape}")
    if np.any(np.diff(x) < 0) or np.any(np.diff(y) < 0):
        raise ValueError("fn and tn must be non-decreasing (ROC points in threshold order)")
    hull: list[int] = []
    for i in range(x.size):
        while len(hull) >= 2:
            o, a = hull[-2], hull[-1]
            cross = (x[a] - x[o]) * (y[i] - y[o]) - (y[a] - y[o]) * (x[i] - x[o])
            if cross >= 0:  # a is on or below the chord o -> i: not a strict upper-hull vertex
                hull.pop()
            else:
                break
        hull.append(i)
    return np.asarray(hull, dtype=np.int64)


def rank_grid(m: int, per_octave: int = 4) -> np.ndarray:
    """The guess counts of ``thresholds="grid"``: ``ceil(2^(j / per_octave))`` for ``j = 0, 1, ...``
    up to ``m``, and ``m`` itself; distinct, increasing. Depends on ``m`` only (fixed before the
    scores are seen). ``m = 20000`` gives 54 counts."""
    if isinstance(m, bool) or int(m) != m or m < 1:
        raise ValueError(f"m must be an integer >= 1, got {m!r}")
    if isinstance(per_octave, bool) or int(per_octave) != per_octave or per_octave < 1:
        raise ValueError(f"per_octave must be an integer >= 1, got {per_octave!r}")
    j_max = int(math.ceil(per_octave * math.log2(m))) if m > 1 else 0
    grid = np.ceil(2.0 ** (np.arange(j_max + 1) / per_octave)).astype(np.int64)
    return np.unique(np.append(grid[grid <= m], m))


class _Roc:
    """The candidate thresholds of one pair of score arrays, their counts and Bonferroni factor.

    ``all``/``hull``: the vertices of the ROC hull (``roc_hull``) are searched (with ``every_cut``,
    ``all`` searches every cut instead); ``K`` is ``m + 1`` (every rank of the pooled scores, fixed
    in advance) or the number of hull vertices (data-dependent, as jax_privacy). ``grid``: the
    rule "in if the score is at least the ``r``-th largest pooled score" for each ``r`` of
    ``rank_grid(m)`` (ties included: a function of the released scores only, not of the labels);
    ``K`` = the grid size.
    """

    def __init__(
        self, in_scores: np.ndarray, out_scores: np.ndarray, mode: str, every_cut: bool = False
    ) -> None:
        self.n_in = int(in_scores.size)
        self.n_out = int(out_scores.size)
        m = self.n_in + self.n_out
        if mode == "grid":
            pooled = np.sort(np.concatenate([in_scores, out_scores]))[::-1]
            grid = rank_grid(m)
            thr = np.unique(pooled[grid - 1])  # ties collapse equal rules
            fn = np.searchsorted(np.sort(in_scores), thr, side="left")
            tn = np.searchsorted(np.sort(out_scores), thr, side="left")
            self.k = int(grid.size)
        else:
            thr, fn, tn = _counts(in_scores, out_scores)
            idx = roc_hull(fn, tn)
            self.k = m + 1 if mode == "all" else int(idx.size)
            if not (every_cut and mode == "all"):
                thr, fn, tn = thr[idx], fn[idx], tn[idx]
        self.thresholds = thr
        self.fn = fn.astype(np.int64)
        self.tn = tn.astype(np.int64)
        self.tp = self.n_in - self.fn
        self.fp = self.n_out - self.tn


# --------------------------------------------------------------------------------------------
# one run (Steinke, Nasr, Jagielski 2023)
# --------------------------------------------------------------------------------------------


def one_run_p_value(m: int, n_guess: int, n_correct: int, epsilon: float, delta: float) -> float:
    """p-value of ``n_correct`` or more right guesses out of ``n_guess`` under ``(eps, delta)``-DP.

    With ``q = e^eps / (1 + e^eps)``, ``W ~ Binomial(n_guess, q)``, ``v = n_correct``:

        beta  = P[W >= v]
        alpha = max_{i = 1..v} P[v - i <= W < v] / i
        p     = min(1, beta + 2 m delta alpha)

    (Steinke, Nasr & Jagielski 2023, the delta-corrected tail bound: any ``(eps, delta)``-DP
    mechanism with ``m`` canaries, each included independently with probability 1/2, gives
    ``P[#correct >= v] <= p`` for every guessing rule that abstains on the others.)
    """
    _check_counts(m, n_guess, n_correct)
    if not (epsilon >= 0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon must be finite and >= 0, got {epsilon!r}")
    _check_delta(delta, allow_zero=True)
    return _p_value(int(m), int(n_guess), int(n_correct), float(epsilon), float(delta))


def _p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    if v == 0:
        return 1.0
    q = special.expit(eps)
    beta = float(stats.binom.sf(v - 1, r, q))
    if delta == 0.0:
        return beta
    i = np.arange(1, v + 1)
    window = stats.binom.sf(v - i - 1, r, q) - beta  # P[v - i <= W <= v - 1]
    alpha = float(np.max(window / i))
    return min(1.0, beta + 2.0 * m * delta * max(alpha, 0.0))


def _largest_root(objective, eps_lo: float) -> float:
    """sup {eps >= eps_lo : objective(eps) > 0} for an objective decreasing in eps, or eps_lo."""
    if objective(eps_lo) <= 0:
        return eps_lo
    lo, hi = eps_lo, max(1.0, 2.0 * eps_lo)
    while objective(hi) > 0:
        lo, hi = hi, 2.0 * hi
        if hi > 1e4:  # a perfect attack on many canaries: the bound is as large as we search
            return lo
    return float(optimize.brentq(objective, lo, hi, xtol=1e-9, rtol=1e-12))


def one_run_epsilon_from_counts(
    m: int, n_guess: int, n_correct: int, significance: float, delta: float
) -> float:
    """The one-run bound for given counts: the largest ``eps`` whose p-value is ``<= significance``.

    0 when even ``eps = 0`` is not rejected. ``m`` is the total number of canaries (in and out).
    """
    _check_counts(m, n_guess, n_correct)
    significance = _check_significance(significance)
    delta = _check_delta(delta, allow_zero=True)
    return _one_run_eps(0.0, int(m), int(n_guess), int(n_correct), significance, delta)


def _one_run_eps(eps_lo: float, m: int, r: int, v: int, alpha: float, delta: float) -> float:
    if _p_value(m, r, v, eps_lo, 0.0) > alpha:  # cannot reject even with delta = 0
        return eps_lo
    return _largest_root(lambda e: alpha - _p_value(m, r, v, e, delta), eps_lo)


# --------------------------------------------------------------------------------------------
# one run, f-DP (Mahloujifar, Melis, Chaudhuri 2024), Gaussian trade-off family
# --------------------------------------------------------------------------------------------


def _log_delta_gaussian(mu: float, eps: float) -> float:
    """log delta(eps) of mu-GDP (Balle & Wang 2018, eq. 6; Dong, Roth & Su 2019, Cor. 2.13)."""
    x = special.log_ndtr(mu / 2.0 - eps / mu)
    y = eps + special.log_ndtr(-mu / 2.0 - eps / mu)
    return x + math.log1p(-math.exp(y - x)) if y < x else -math.inf


def gaussian_mu_for(epsilon: float, delta: float) -> float:
    """The ``mu`` such that ``mu``-GDP (the Gaussian mechanism with sensitivity 1 and noise std
    ``1/mu``) is exactly ``(epsilon, delta)``-DP and no better: the root of

        delta = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu).

    ``inf`` for ``epsilon = inf``; ``delta`` must be in (0, 1).
    """
    if not (epsilon >= 0):
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    _check_delta(delta, allow_zero=False)
    if math.isinf(epsilon):
        return math.inf
    if epsilon == 0.0:
        return 2.0 * float(special.ndtri((1.0 + delta) / 2.0))
    log_delta = math.log(delta)

    def gap(log_mu: float) -> float:
        return _log_delta_gaussian(math.exp(log_mu), epsilon) - log_delta

    lo, hi = -1.0, 1.0
    while gap(lo) > 0:
        lo -= 2.0
    while gap(hi) < 0:
        hi += 2.0
    return math.exp(optimize.brentq(gap, lo, hi, xtol=1e-14, rtol=1e-14))


def _fdp_objective(eps: float, m: int, r: int, v: int, alpha: float, delta: float) -> float:
    """> 0 iff ``v`` right out of ``r`` guesses among ``m`` canaries refutes ``mu(eps, delta)``-GDP.

    The recursion of Mahloujifar et al. (2024) for a trade-off function ``f`` (here Gaussian,
    ``f^{-1}``-type map ``g(x) = Phi(Phi^{-1}(x) - mu)``): start from ``rho = alpha v / m`` and
    ``eta = alpha (r - v) / m`` (the significance-scaled fractions of right and wrong guesses);
    for ``i = v-1, ..., 0``: ``eta' = max(eta, g(rho))``, ``rho = min(1, rho + i / (r - i) *
    (eta' - eta))``, ``eta = eta'`` (stop early once ``eta`` no longer moves). The claim is refuted
    when ``rho + eta > r / m``.
    """
    mu = gaussian_mu_for(eps, delta)
    rho = alpha * v / m
    eta = alpha * (r - v) / m
    for i in range(v - 1, -1, -1):
        g = 0.0 if math.isinf(mu) else float(special.ndtr(special.ndtri(rho) - mu))
        eta_new = max(eta, g)
        if eta_new == eta:
            break
        rho = min(rho + (i / (r - i)) * (eta_new - eta), 1.0)
        eta = eta_new
    return rho + eta - r / m


def one_run_fdp_epsilon_from_counts(
    m: int, n_guess: int, n_correct: int, significance: float, delta: float
) -> float:
    """The one-run f-DP (Gaussian family) bound for given counts; 0 if ``eps = 0`` is not
    refuted."""
    _check_counts(m, n_guess, n_correct)
    significance = _check_significance(significance)
    delta = _check_delta(delta, allow_zero=False)
    return _fdp_eps(0.0, int(m), int(n_guess), int(n_correct), significance, delta)


def _fdp_eps(eps_lo: float, m: int, r: int, v: int, alpha: float, delta: float) -> float:
    if v == 0:
        return eps_lo
    return _largest_root(lambda e: _fdp_objective(e, m, r, v, alpha, delta), eps_lo)


# --------------------------------------------------------------------------------------------
# public one-run API
# --------------------------------------------------------------------------------------------


def _one_run(
    method: str,
    in_scores: ArrayLike,
    out_scores: ArrayLike,
    significance: float,
    delta: float,
    thresholds: str,
    threshold: float | None,
) -> AuditResult:
    ins = _scores("in_scores", in_scores)
    outs = _scores("out_scores", out_scores)
    significance = _check_significance(significance)
    delta = _check_delta(delta, allow_zero=(method == "one_run"))
    thresholds = _check_thresholds(thresholds)
    m = int(ins.size + outs.size)
    solve = _one_run_eps if method == "one_run" else _fdp_eps

    if threshold is not None:
        t = float(threshold)
        if math.isnan(t):
            raise ValueError("threshold must be a number (or None to search), got nan")
        tp = int(np.sum(ins >= t))
        r = tp + int(np.sum(outs >= t))
        eps = solve(0.0, m, r, tp, significance, delta)
        return AuditResult(eps, method, t, r, tp, ins.size, outs.size, significance, delta, 1,
                           "explicit")

    roc = _Roc(ins, outs, thresholds)
    k = roc.k
    alpha = significance / k
    r_all = roc.tp + roc.fp
    v_all = roc.tp
    # search order: decreasing Clopper-Pearson lower bound on the precision (a heuristic so the
    # best thresholds come first and the rest are pruned cheaply); every candidate is examined
    prec_lb = 1.0 - clopper_pearson_upper(roc.fp, np.maximum(r_all, 1), alpha)
    order = np.argsort(-np.where(r_all > 0, prec_lb, -np.inf), kind="stable")
    best, best_idx = 0.0, int(np.argmin(r_all))  # fewest guesses (the +inf threshold if present)
    alive = r_all > 0
    if method == "one_run":
        alive &= _beta_vector(r_all, v_all, 0.0) <= alpha
    for idx in order:
        if not alive[idx]:
            continue
        eps = solve(best, m, int(r_all[idx]), int(v_all[idx]), alpha, delta)
        if eps > best:
            best, best_idx = eps, int(idx)
            if method == "one_run":  # exact pruning: p-value(delta=0) grows with eps
                alive &= _beta_vector(r_all, v_all, best) <= alpha
    return AuditResult(
        float(best), method, float(roc.thresholds[best_idx]), int(r_all[best_idx]),
        int(v_all[best_idx]), ins.size, outs.size, significance, delta, k, thresholds,
    )


def _beta_vector(r: np.ndarray, v: np.ndarray, eps: float) -> np.ndarray:
    """``P[Binomial(r, expit(eps)) >= v]`` elementwise (the delta = 0 one-run p-value)."""
    out = stats.binom.sf(v - 1, r, special.expit(eps))
    return np.where(v > 0, out, 1.0)


def one_run_epsilon(
    in_scores: ArrayLike,
    out_scores: ArrayLike,
    *,
    significance: float = 0.05,
    delta: float,
    thresholds: Thresholds = "grid",
    threshold: float | None = None,
) -> AuditResult:
    """One-run epsilon lower bound (Steinke, Nasr & Jagielski 2023) from canary scores.

    ``in_scores`` / ``out_scores``: attack scores of the canaries that were / were not included
    (higher = "in"). Assumptions, which the caller must guarantee: each of the ``m = n_in + n_out``
    canaries was included independently with probability 1/2 (a fair coin per canary, drawn before
    the run, independent of everything else), and the scores are computed from the released
    artefact only. The auditor guesses "in" for ``score >= t`` and abstains below; ``t`` is the
    candidate (``thresholds``: ``"grid"``, ``"all"`` or ``"hull"``, module docstring) that gives
    the largest bound at level ``significance / K``, or the given ``threshold`` (``K = 1``).

    Returns an :class:`AuditResult`; ``epsilon = 0`` when nothing is refuted (e.g. in-scores not
    larger than out-scores). Only one-sided guesses (``k_- = 0`` in the paper) are made.
    """
    return _one_run("one_run", in_scores, out_scores, significance, delta, thresholds, threshold)


def one_run_fdp_epsilon(
    in_scores: ArrayLike,
    out_scores: ArrayLike,
    *,
    significance: float = 0.05,
    delta: float,
    thresholds: Thresholds = "grid",
    threshold: float | None = None,
) -> AuditResult:
    """One-run f-DP epsilon lower bound (Mahloujifar, Melis & Chaudhuri 2024), Gaussian family.

    Same data, assumptions and threshold search as :func:`one_run_epsilon`, but the null
    hypothesis is "the mechanism is ``mu``-GDP" with ``mu = gaussian_mu_for(eps, delta)``: the
    reported ``epsilon`` is the largest ``eps`` for which that Gaussian trade-off curve is refuted.
    This is tighter than the ``(eps, delta)`` test, and it is a lower bound on the ``epsilon`` of an
    ``(eps, delta)`` claim only for mechanisms whose trade-off curve is Gaussian-shaped (the
    Gaussian mechanism, DP-SGD under the usual GDP approximation); for an arbitrary
    ``(eps, delta)``-DP mechanism use :func:`one_run_epsilon`. ``delta`` must be in (0, 1).
    """
    return _one_run("one_run_fdp", in_scores, out_scores, significance, delta, thresholds,
                    threshold)


# --------------------------------------------------------------------------------------------
# Clopper-Pearson over repeated runs
# --------------------------------------------------------------------------------------------


def clopper_pearson_upper(k: ArrayLike, n: ArrayLike, significance: float) -> np.ndarray:
    """One-sided Clopper-Pearson upper bound on a binomial rate from ``k`` successes in ``n``.

    The ``p`` with ``P[Binomial(n, p) <= k] = significance``, i.e. the ``1 - significance``
    quantile of ``Beta(k + 1, n - k)``; 1 when ``k = n``.
    """
    k = np.asarray(k)
    n = np.asarray(n)
    significance = _check_significance(significance)
    if np.any(k < 0) or np.any(k > n):
        raise ValueError("clopper_pearson_upper: need 0 <= k <= n")
    with np.errstate(invalid="ignore"):
        val = stats.beta.ppf(1.0 - significance, k + 1, np.maximum(n - k, 1))
    return np.where(k < n, val, 1.0)


def clopper_pearson_epsilon(
    in_scores: ArrayLike,
    out_scores: ArrayLike,
    *,
    significance: float = 0.05,
    delta: float = 0.0,
    two_sided: bool = True,
    thresholds: Thresholds = "all",
    threshold: float | None = None,
) -> AuditResult:
    """Epsilon lower bound from repeated runs, with Clopper-Pearson intervals on FPR and FNR.

    ``in_scores``: one score per run trained WITH the canary; ``out_scores``: one per run
    WITHOUT it (runs independent). For the rule "in if ``score >= t``" with ``FN`` misses among the
    ``n_in`` in-runs and ``FP`` false alarms among the ``n_out`` out-runs, ``FNR_ub`` and ``FPR_ub``
    are one-sided Clopper-Pearson upper bounds at level ``significance / (2 K)`` each (``K``:
    Bonferroni factor over thresholds, module docstring), and

        eps >= max( log((1 - delta - FNR_ub) / FPR_ub),  log((1 - delta - FPR_ub) / FNR_ub) )

    (the second term only when ``two_sided``), the maximum taken over thresholds, and clipped at
    0. It follows from the hypothesis-testing view of DP: ``FPR + e^eps FNR >= 1 - delta`` and
    ``FNR + e^eps FPR >= 1 - delta`` (Kairouz, Oh & Viswanath 2015), i.e. the likelihood ratios
    TPR/FPR on ``score >= t`` and TNR/FNR on ``score < t``. Scores must be oriented (higher =
    "in"; negate them otherwise): a rule "in if ``score < t``" is not tried. ``delta`` is in [0, 1).

    Multiple testing: taking the best of ``K`` thresholds is paid for by ``significance / K``;
    reusing the same scores for other estimators, or several ``(significance, delta)`` pairs, is
    not accounted for here.
    """
    ins = _scores("in_scores", in_scores)
    outs = _scores("out_scores", out_scores)
    significance = _check_significance(significance)
    delta = _check_delta(delta, allow_zero=True)
    thresholds = _check_thresholds(thresholds)
    n_in, n_out = int(ins.size), int(outs.size)
    if threshold is not None:
        t = float(threshold)
        if math.isnan(t):
            raise ValueError("threshold must be a number (or None to search), got nan")
        thr = np.asarray([t])
        fn = np.asarray([int(np.sum(ins < t))])
        tn = np.asarray([int(np.sum(outs < t))])
        k, mode = 1, "explicit"
    else:
        roc = _Roc(ins, outs, thresholds, every_cut=True)
        thr, fn, tn = roc.thresholds, roc.fn, roc.tn
        k, mode = roc.k, thresholds
    level = significance / (2 * k)
    fnr_ub = clopper_pearson_upper(fn, n_in, level)
    fpr_ub = clopper_pearson_upper(n_out - tn, n_out, level)

    def log_ratio(num_ub: np.ndarray, den_ub: np.ndarray) -> np.ndarray:
        numer = 1.0 - delta - num_ub
        with np.errstate(divide="ignore", invalid="ignore"):
            out = np.log(numer) - np.log(den_ub)
        return np.where(numer > 0, out, -np.inf)

    forward = log_ratio(fnr_ub, fpr_ub)
    i_f = int(np.argmax(forward))
    best, idx, direction = float(forward[i_f]), i_f, "TPR/FPR"
    if two_sided:
        reverse = log_ratio(fpr_ub, fnr_ub)
        i_r = int(np.argmax(reverse))
        if reverse[i_r] > best:
            best, idx, direction = float(reverse[i_r]), i_r, "TNR/FNR"
    tp = n_in - int(fn[idx])
    fp = n_out - int(tn[idx])
    eps = max(0.0, best)
    return AuditResult(eps, "clopper_pearson", float(thr[idx]), tp + fp, tp, n_in, n_out,
                       significance, delta, k, mode, direction)


# --------------------------------------------------------------------------------------------
# white-box Gaussian-shift estimator (Nasr et al. 2023)
# --------------------------------------------------------------------------------------------


def gaussian_epsilon_for(mu: float, delta: float) -> float:
    """``epsilon`` of ``mu``-GDP at ``delta`` (the inverse of :func:`gaussian_mu_for`): the root of
    ``delta = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu)``; 0 when ``mu``-GDP is already
    ``(0, delta)``-DP, ``inf`` for ``mu = inf``."""
    if not (mu >= 0):
        raise ValueError(f"mu must be >= 0, got {mu!r}")
    _check_delta(delta, allow_zero=False)
    if math.isinf(mu):
        return math.inf
    if mu == 0.0 or _log_delta_gaussian(mu, 0.0) <= math.log(delta):
        return 0.0
    log_delta = math.log(delta)
    hi = max(1.0, mu * mu)
    while _log_delta_gaussian(mu, hi) > log_delta:
        hi *= 2.0
    return float(optimize.brentq(lambda e: _log_delta_gaussian(mu, e) - log_delta, 0.0, hi,
                                 xtol=1e-12, rtol=1e-12))


@dataclass(frozen=True)
class GaussianShiftResult:
    """Result of :func:`gaussian_shift_epsilon`.

    ``epsilon`` = ``gaussian_epsilon_for(mu_lower, delta)``; ``mu_hat`` the point estimate
    ``(mean_in - mean_out) / sd``; ``mu_lower`` its lower confidence bound; ``sd_in`` / ``sd_out``
    the two samples' standard deviations (a Gaussian mechanism has them equal);
    ``variance_p_value`` the two-sided F-test p-value of equal variances (small: the release is
    not a pure shift, see the estimator's docstring).
    """

    epsilon: float
    mu_hat: float
    mu_lower: float
    sd_in: float
    sd_out: float
    variance_p_value: float
    n_in: int
    n_out: int
    significance: float
    delta: float
    method: str = "gaussian"


def gaussian_shift_epsilon(
    in_scores: ArrayLike, out_scores: ArrayLike, *, significance: float = 0.05, delta: float
) -> GaussianShiftResult:
    """White-box lower bound for a release that is a deterministic value plus Gaussian noise.

    **Assumption** (checked only through the variance test, not proven): the in-scores are
    ``N(a_in, s^2)`` and the out-scores ``N(a_out, s'^2)``, independent draws, one per canary (a
    canary in one step only, or one repeated run each), as for a Dirac or projected-gradient
    canary on the noisy gradient of ``dp_step``. Then the pair is a Gaussian mechanism with
    ``mu >= (a_in - a_out) / max(s, s')``, which is exactly ``mu``-GDP and no better, so it is not
    ``(eps, delta)``-DP for ``eps < gaussian_epsilon_for(mu, delta)``. This is the "Gaussian fit"
    of Nasr, Hayes, Steinke, Balle, Tramer, Jagielski, Carlini & Terzis, "Tight Auditing of
    Differentially Private Machine Learning", USENIX Security 2023 (arXiv:2302.07956): far more
    powerful than the nonparametric estimators (its ratio to the claim approaches 1 with a few
    thousand canaries), and meaningful ONLY for such releases (a black-box loss score is not
    Gaussian: use :func:`one_run_epsilon` there).

    Confidence ``1 - significance``, split in half: a one-sided normal bound on the mean
    difference (``z_{1-s/2}`` times its standard error) and a one-sided chi-square upper bound on
    each standard deviation (``s/4`` each), ``mu_lower = max(0, diff_lower) / max(sd_ub)``.
    Unequal variances only make the bound more conservative (the larger one is used).
    """
    ins = _scores("in_scores", in_scores)
    outs = _scores("out_scores", out_scores)
    significance = _check_significance(significance)
    delta = _check_delta(delta, allow_zero=False)
    n_in, n_out = ins.size, outs.size
    if n_in < 3 or n_out < 3:
        raise ValueError(f"gaussian_shift_epsilon needs >= 3 in and >= 3 out scores, got "
                         f"{n_in} and {n_out}")
    var_in, var_out = float(np.var(ins, ddof=1)), float(np.var(outs, ddof=1))
    diff = float(np.mean(ins) - np.mean(outs))
    se = math.sqrt(var_in / n_in + var_out / n_out)
    diff_lb = diff - float(stats.norm.ppf(1.0 - significance / 2.0)) * se
    q = significance / 4.0

    def sd_ub(var: float, n: int) -> float:
        return math.sqrt((n - 1) * var / float(stats.chi2.ppf(q, n - 1)))

    sd_max = max(sd_ub(var_in, n_in), sd_ub(var_out, n_out))
    pooled = math.sqrt(((n_in - 1) * var_in + (n_out - 1) * var_out) / (n_in + n_out - 2))
    if sd_max == 0.0:  # no noise at all: any positive shift is perfectly distinguishable
        mu_hat = mu_lb = math.inf if diff > 0 else 0.0
    else:
        mu_hat = diff / pooled if pooled > 0 else math.inf
        mu_lb = max(0.0, diff_lb) / sd_max
    if var_in > 0 and var_out > 0:
        f = var_in / var_out
        cdf = float(stats.f.cdf(f, n_in - 1, n_out - 1))
        p_var = min(1.0, 2.0 * min(cdf, 1.0 - cdf))
    else:
        p_var = 1.0 if var_in == var_out else 0.0
    eps = gaussian_epsilon_for(mu_lb, delta)
    return GaussianShiftResult(eps, float(mu_hat), float(mu_lb), math.sqrt(var_in),
                               math.sqrt(var_out), p_var, n_in, n_out, significance, delta)
