"""Gaussian differential privacy (GDP) and its central-limit (CLT) composition, for reproducing Du.

.. warning::

    Everything here except the exact ``mu``-GDP <-> (epsilon, delta) conversion relies on the
    central limit theorem of Bu, Dong, Long & Su 2020 for Poisson-subsampled Gaussians. That
    approximation **under-reports epsilon** (it is optimistic, not an upper bound; Opacus warns
    about the same): for ``q = 256/60000, T = 4687, sigma = 2.6157, delta = 1e-5`` the CLT says
    epsilon = 0.400 while the RDP accountant says 0.446 (algorithms.md, test vector T11). Use this
    module only to reproduce the schedules and noise multipliers of papers calibrated with it
    (Du et al. 2021, "Dynamic differential-privacy preserving SGD") and the GDP figures of Nguyen et al.
    (``nguyen_mu``, test vectors T8/T9). dpclip never uses it for a
    guarantee: a training run is accounted per step through the ledger with PLD or RDP
    (``dpclip.accounting.epsilon``), and ``--epsilon`` calibrates with those accountants.

Formulas (Dong, Roth & Su 2019/2022; algorithms.md 1.4 and M4):

* ``mu``-GDP -> (epsilon, delta): ``delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``
  (exact for a single Gaussian mechanism with multiplier ``1/mu``; ``gdp_delta``); its inverses
  ``gdp_mu_for`` (mu for a target (epsilon, delta)) and ``gdp_epsilon`` (epsilon for (mu, delta)).
* Poisson CLT: ``T`` steps with rate ``q`` and multipliers ``sigma_t`` are approximately
  ``mu``-GDP with ``mu = q sqrt(sum_t (exp(sigma_t^-2) - 1))`` (``poisson_clt_mu``); for a
  constant sigma the inverse is ``sigma = 1 / sqrt(log(mu^2 / (q^2 T) + 1))``
  (``uniform_sigma_for_mu``).
* Du et al. "Eq. 10" (reference-code convention): per-step ``mu_t = mu_0 rho_mu^(-t/T)``, i.e.
  ``sigma_t = sigma_0 rho_mu^(t/T)`` with ``sigma_0 = 1/mu_0``; ``du_mu0`` finds ``mu_0`` by
  bisection so that the CLT composition of ``t = 0..T-1`` equals ``mu_tot``.

No torch; numpy and scipy only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy.special import log_ndtr, ndtr

__all__ = [
    "du_mu0",
    "nguyen_h",
    "nguyen_mu",
    "du_noise_multipliers",
    "gdp_delta",
    "gdp_epsilon",
    "gdp_mu_for",
    "poisson_clt_epsilon",
    "poisson_clt_mu",
    "uniform_sigma_for_mu",
]

#: Relative tolerance of the bisections (far below the 4-5 digits of the published vectors).
_RTOL = 1e-13
_MAX_ITER = 400


def _positive(name: str, value: float, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    ok = v >= 0 if allow_zero else v > 0
    if not (math.isfinite(v) and ok):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return v


def _delta_arg(delta: float) -> float:
    d = _positive("delta", delta)
    if not d < 1:
        raise ValueError(f"delta must be in (0, 1) (typically 1e-5, below 1/N), got {delta!r}")
    return d


def _sample_rate(q: float) -> float:
    v = _positive("sample_rate", q)
    if v > 1:
        raise ValueError(f"sample_rate must be in (0, 1] (batch size / dataset size), got {q!r}")
    return v


def _steps(steps: int) -> int:
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    return int(steps)


def _ratio(name: str, value: float) -> float:
    v = _positive(name, value)
    if v > 1:
        raise ValueError(
            f"{name} is final / initial and must be in (0, 1] for a decay, got {value!r} "
            f"(a paper's rho > 1 in the C_0 rho^(-t/T) convention is 1 / {name})"
        )
    return v


def _bisect(f, lo: float, hi: float) -> float:
    """Root of an increasing ``f`` in [lo, hi] (``f(lo) <= 0 <= f(hi)``), to ``_RTOL``."""
    for _ in range(_MAX_ITER):
        mid = 0.5 * (lo + hi)
        if f(mid) > 0:
            hi = mid
        else:
            lo = mid
        if hi - lo <= _RTOL * hi:
            break
    return 0.5 * (lo + hi)


def gdp_delta(epsilon: float, mu: float) -> float:
    """delta of a ``mu``-GDP mechanism at ``epsilon``.

    ``delta = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``.

    Exact for one Gaussian mechanism with noise multiplier ``1/mu`` (Dong, Roth & Su, Cor. 2.13;
    Balle & Wang 2018). Computed with ``log Phi`` so that large ``epsilon`` does not overflow.
    Edge cases: ``epsilon >= 0`` and ``mu > 0`` are required (``ValueError`` naming the argument).
    """
    eps = _positive("epsilon", epsilon, allow_zero=True)
    m = _positive("mu", mu)
    a = -eps / m + m / 2
    b = -eps / m - m / 2
    return max(0.0, float(ndtr(a)) - math.exp(eps + float(log_ndtr(b))))


def gdp_mu_for(epsilon: float, delta: float) -> float:
    """The ``mu`` whose GDP curve passes through ``(epsilon, delta)`` (inverse of ``gdp_delta``).

    This is Du et al.'s total budget ``mu_tot`` (their code inverts the analytic Gaussian
    mechanism of Balle & Wang 2018). ``gdp_delta`` increases with ``mu``, so bisection.
    """
    eps = _positive("epsilon", epsilon)
    d = _delta_arg(delta)
    lo, hi = 1e-12, 1.0
    while gdp_delta(eps, hi) < d:
        hi *= 2.0
        if hi > 1e6:  # pragma: no cover - gdp_delta(eps, 1e6) ~ 1
            raise ValueError(f"no mu reaches delta={delta!r} at epsilon={epsilon!r}")
    return _bisect(lambda m: gdp_delta(eps, m) - d, lo, hi)


def gdp_epsilon(mu: float, delta: float) -> float:
    """epsilon of a ``mu``-GDP mechanism at ``delta`` (inverse of ``gdp_delta`` in epsilon).

    Exact for ``mu``-GDP; when ``mu`` comes from ``poisson_clt_mu`` the result inherits the CLT's
    optimism (it UNDER-REPORTS epsilon; see the module warning). Returns 0.0 when ``delta`` is
    already reached at ``epsilon = 0``.
    """
    m = _positive("mu", mu)
    d = _delta_arg(delta)
    if gdp_delta(0.0, m) <= d:
        return 0.0
    hi = 1.0
    while gdp_delta(hi, m) > d:
        hi *= 2.0
    # gdp_delta decreases in epsilon: bisect on its negation
    return _bisect(lambda e: d - gdp_delta(e, m), 0.0, hi)


def poisson_clt_mu(sample_rate: float, noise_multipliers: Sequence[float]) -> float:
    """CLT ``mu`` of Poisson-subsampled Gaussian steps: ``q sqrt(sum_t (exp(sigma_t^-2) - 1))``.

    ``noise_multipliers`` holds one sigma per step (``[sigma] * T`` for a constant schedule).
    Bu, Dong, Long & Su 2020 (Poisson version, as in Opacus ``compute_mu_poisson``).

    .. warning:: an asymptotic approximation that UNDER-REPORTS epsilon; only for reproducing Du.
    """
    q = _sample_rate(sample_rate)
    sig = np.asarray(noise_multipliers, dtype=np.float64)
    if sig.ndim != 1 or sig.size == 0:
        raise ValueError(
            f"noise_multipliers must be a non-empty 1-d sequence (one per step), got shape "
            f"{sig.shape}"
        )
    if not (np.all(np.isfinite(sig)) and np.all(sig > 0)):
        raise ValueError("noise_multipliers must all be finite numbers > 0")
    return q * math.sqrt(float(np.sum(np.expm1(sig**-2.0))))


def poisson_clt_epsilon(
    sample_rate: float, noise_multipliers: Sequence[float], delta: float
) -> float:
    """``gdp_epsilon(poisson_clt_mu(q, sigmas), delta)``: the CLT epsilon that Du et al. report.

    .. warning:: UNDER-REPORTS epsilon (T11: 0.400 by CLT vs 0.446 by RDP); never a guarantee.
    """
    return gdp_epsilon(poisson_clt_mu(sample_rate, noise_multipliers), delta)


def uniform_sigma_for_mu(mu_tot: float, sample_rate: float, steps: int) -> float:
    """Constant sigma whose CLT composition over ``steps`` Poisson steps is ``mu_tot``.

    ``sigma = 1/mu_u``, ``mu_u = sqrt(log(mu_tot^2 / (q^2 T) + 1))`` (inverse of
    ``poisson_clt_mu``): Du et al.'s "vanilla" baseline. CLT: see the module warning.
    """
    m = _positive("mu_tot", mu_tot)
    q = _sample_rate(sample_rate)
    t = _steps(steps)
    return 1.0 / math.sqrt(math.log1p(m * m / (q * q * t)))


def du_noise_multipliers(mu0: float, steps: int, noise_final_over_initial: float) -> np.ndarray:
    """Du et al.'s per-step noise multipliers ``sigma_t = rho_mu^(t/T) / mu_0``, ``t = 0..T-1``.

    ``noise_final_over_initial = rho_mu = sigma_T / sigma_0`` (<= 1: the noise decays; the
    reference code's ``mu_t = mu_0 rho_mu^(-t/T)``). Returns a float64 array of length ``steps``.
    """
    m = _positive("mu0", mu0)
    t = _steps(steps)
    rho = _ratio("noise_final_over_initial", noise_final_over_initial)
    return rho ** (np.arange(t, dtype=np.float64) / t) / m


def du_mu0(mu_tot: float, sample_rate: float, steps: int, noise_final_over_initial: float) -> float:
    """Du et al. "Eq. 10": ``mu_0`` with ``q sqrt(sum_{t<T} (exp(mu_t^2) - 1)) = mu_tot``.

    ``mu_t = mu_0 rho_mu^(-t/T)`` (``rho_mu = noise_final_over_initial``, so ``sigma_t = 1/mu_t``
    decays from ``sigma_0 = 1/mu_0`` to ``rho_mu sigma_0``); bisection in ``mu_0``. With
    ``rho_mu = 1`` this is ``1 / uniform_sigma_for_mu(...)``. Test vector T10: ``mu_tot =
    0.11588, q = 256/60000, T = 4687, rho_mu = 0.7`` gives ``mu_0 = 0.31603`` (sigma_0 = 3.1643,
    sigma_T = 2.2150).

    .. warning:: CLT calibration UNDER-REPORTS epsilon; dpclip calibrates Du's schedule with
       its PLD/RDP accountant instead (``du-dynamic`` strategy). Use this only to reproduce Du.
    """
    m = _positive("mu_tot", mu_tot)
    q = _sample_rate(sample_rate)
    t = _steps(steps)
    rho = _ratio("noise_final_over_initial", noise_final_over_initial)
    growth = rho ** (-np.arange(t, dtype=np.float64) / t)  # mu_t / mu_0

    def excess(mu0: float) -> float:
        with np.errstate(over="ignore"):
            s = float(np.sum(np.expm1((mu0 * growth) ** 2)))
        return q * math.sqrt(s) - m if math.isfinite(s) else math.inf

    hi = 1.0
    while excess(hi) < 0:  # terminates: exp(mu^2) grows without bound (inf on overflow)
        hi *= 2.0
    return _bisect(excess, 0.0, hi)


def nguyen_h(sigma: float) -> float:
    """``h(sigma) = sqrt(e^{sigma^-2} Phi(1.5/sigma) + 3 Phi(-0.5/sigma) - 2)`` (Bu et al. 2020).

    The CLT factor of a uniformly subsampled (without replacement) Gaussian with multiplier
    ``sigma``, as used by Nguyen et al. (their Appendix B.1; algorithms.md 1.4).
    """
    s = _positive("sigma", sigma)
    inv2 = s ** -2.0
    value = math.exp(inv2) * float(ndtr(1.5 / s)) + 3.0 * float(ndtr(-0.5 / s)) - 2.0
    return math.sqrt(max(value, 0.0))


def nguyen_mu(
    epochs: float, batch_size: int, dataset_size: int, noise_multiplier: float, groups: int = 1
) -> float:
    """Nguyen et al.'s GDP ``mu = sqrt(2) c h(sigma / sqrt(L))`` with ``c = sqrt(E m / N)``.

    ``groups = L`` clipping blocks with per-layer noise (each block ``sigma``) compose to an
    effective multiplier ``sigma / sqrt(L)``. Test vectors: T8 (``E = 50, m = 64, N = 54000,
    L = 8, sigma = 2.5``: ``h = 1.5142, mu = 0.5213``) and T9 (``sigma = 1.5``: ``h = 5.7831,
    mu = 1.9909``).

    .. warning:: a CLT approximation (can under-report epsilon); only for reproducing the paper's
       figures. Training runs are accounted with RDP/PLD through the ledger.
    """
    e = _positive("epochs", epochs)
    m = _positive("batch_size", batch_size)
    n = _positive("dataset_size", dataset_size)
    if m > n:
        raise ValueError(f"batch_size ({m}) must be <= dataset_size ({n})")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups must be an int >= 1, got {groups!r}")
    sigma = _positive("noise_multiplier", noise_multiplier) / math.sqrt(groups)
    c = math.sqrt(e * m / n)
    return math.sqrt(2.0) * c * nguyen_h(sigma)
