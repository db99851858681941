"""Calibration: the noise multiplier (or the number of steps) that meets a target epsilon.

``calibrate_noise_multiplier`` returns the smallest noise multiplier ``z`` whose epsilon is at
most the target (it never returns a ``z`` that overshoots: every candidate is evaluated and only
a feasible one is returned), within ``tol`` in epsilon. For the PLD accountant the search is
seeded by a fast RDP calibration (the RDP sigma is usually feasible for PLD and the PLD sigma a
few percent below it; performance.md: PLD-only calibration 4-6 s, RDP 0.2-0.3 s), then bracketed
and refined with PLD evaluations only (Illinois regula falsi on log-log axes, keeping a feasible
upper end), so the answer never relies on RDP being looser than PLD (it is not always: with
~1e5 compositions the 1e-3 PLD grid can exceed RDP). ``calibrate_steps`` returns the largest
number of steps within the target, seeded the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Union

from dpclip.accounting.accountants import (
    DEFAULT_PLD_DISCRETIZATION,
    PLDGridTooLarge,
    check_accountant,
    check_delta,
    compute_epsilon,
    refuse_unsupported,
)
from dpclip.accounting.dpsgd import check_noise_multiplier, check_sample_rate, dpsgd_step_event
from dpclip.accounting.ledger import is_dp_event
from dpclip.events import (
    DpEvent,
    GaussianEvent,
    PoissonSampledEvent,
    SelfComposedEvent,
)

__all__ = ["calibrate_dpsgd_noise", "calibrate_noise_multiplier", "calibrate_steps"]

#: Search range of ``calibrate_noise_multiplier`` (noise multipliers outside it are not useful).
MIN_NOISE_MULTIPLIER = 1e-3
MAX_NOISE_MULTIPLIER = 1e6


def _check_target(target_epsilon: float) -> float:
    if (
        isinstance(target_epsilon, bool)
        or not isinstance(target_epsilon, (int, float))
        or not math.isfinite(target_epsilon)
        or target_epsilon <= 0
    ):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}")
    return float(target_epsilon)


def _event_epsilon_fn(
    make_event: Callable, delta: float, accountant: str, vdi: float, orders, what: str
) -> Callable[[float], float]:
    def f(x: float) -> float:
        ev = make_event(x)
        if not is_dp_event(ev):
            raise TypeError(
                f"{what} must return a dpclip.events event, got {type(ev).__name__} for {x!r}"
            )
        try:
            return compute_epsilon(
                ev, delta, accountant, value_discretization_interval=vdi, rdp_orders=orders
            ).epsilon
        except PLDGridTooLarge:  # (a noise multiplier far below any useful one: infeasible)
            return math.inf

    return f


def _ensure_pld_supported(event: DpEvent) -> None:
    refuse_unsupported(event, "pld")


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -745.0  # log of the smallest double: keeps the secant finite


def _illinois_step(x_lo: float, x_hi: float, g_lo: float, g_hi: float) -> float:
    """Regula falsi point between x_lo and x_hi (bisection when a value is infinite)."""
    width = x_hi - x_lo
    if math.isfinite(g_lo) and math.isfinite(g_hi) and g_lo != g_hi:
        m = x_hi - g_hi * width / (g_hi - g_lo)
        return min(max(m, x_lo + 0.01 * width), x_hi - 0.01 * width)
    return 0.5 * (x_lo + x_hi)


def _solve_noise(
    f: Callable[[float], float],
    target: float,
    tol: float,
    guess: float,
    shrink: float,
    accountant: str,
    delta: float,
    slope: float | None = None,
) -> tuple[float, float | None]:
    """Smallest z in [MIN, MAX] with f(z) <= target (f decreasing in z), within tol in epsilon.

    Bracket [lo, hi] with f(lo) > target >= f(hi), refined by Illinois regula falsi on
    (log z, log epsilon), where the curve is close to a straight line, aiming at
    ``target - tol/2`` so that near-solutions land on the feasible side. ``slope`` (d log eps /
    d log z, from an earlier search) sizes the first step below a feasible guess. Returns hi,
    which was evaluated and is feasible, and the final log-log slope of the bracket.
    """
    lo, f_lo = None, math.inf  # infeasible end: f(lo) > target
    grow = 1.0 / shrink
    hi = min(max(guess, MIN_NOISE_MULTIPLIER), MAX_NOISE_MULTIPLIER)
    f_hi = f(hi)
    while f_hi > target:  # grow until feasible
        if hi >= MAX_NOISE_MULTIPLIER:
            hint = (
                " (the classic conversion cannot go below min_alpha log(1/delta)/(alpha-1) over "
                "the RDP orders; use accountant='rdp' or 'pld', or pass larger rdp_orders)"
                if accountant == "rdp-classic"
                else ""
            )
            raise ValueError(
                f"target_epsilon={target!r} is unreachable with accountant={accountant!r}: even "
                f"noise_multiplier={hi:g} gives epsilon={f_hi:.6g} at delta={delta:g}{hint}. "
                "Raise target_epsilon or delta, or reduce the steps / sample rate"
            )
        lo, f_lo = hi, f_hi
        hi = min(hi * grow, MAX_NOISE_MULTIPLIER)
        grow = grow * grow
        f_hi = f(hi)
    if lo is None:  # guess was feasible: find an infeasible lower end
        factor = shrink
        if slope is not None and slope < 0 and f_hi > 0:
            # straight line in log-log through (hi, f_hi) reaches the target at this factor;
            # step 1 % beyond it so that the first candidate is (likely) infeasible
            factor = min(shrink, 0.99 * (f_hi / target) ** (-1.0 / slope))
        while True:
            cand = max(hi * factor, MIN_NOISE_MULTIPLIER)
            if cand >= hi:  # hi is already at the floor
                return hi, None
            f_c = f(cand)
            if f_c > target:
                lo, f_lo = cand, f_c
                break
            hi, f_hi = cand, f_c
            factor = min(factor * factor, shrink)
    aim = _log(target - 0.5 * tol) if tol < target else _log(0.5 * target)
    x_lo, x_hi = math.log(lo), math.log(hi)
    g_lo, g_hi = _log(f_lo) - aim, _log(f_hi) - aim
    side = 0
    for _ in range(200):
        if target - f_hi <= tol or hi - lo <= 1e-12 * hi:
            break
        x_m = _illinois_step(x_lo, x_hi, g_lo, g_hi)
        m = math.exp(x_m)
        f_m = f(m)
        if f_m <= target:
            hi, f_hi, x_hi, g_hi = m, f_m, x_m, _log(f_m) - aim
            if side == +1:
                g_lo *= 0.5
            side = +1
        else:
            lo, f_lo, x_lo, g_lo = m, f_m, x_m, _log(f_m) - aim
            if side == -1:
                g_hi *= 0.5
            side = -1
    final_slope = None
    if math.isfinite(f_lo) and f_lo > 0 and f_hi > 0 and hi > lo:
        final_slope = (math.log(f_lo) - math.log(f_hi)) / (math.log(lo) - math.log(hi))
    return hi, final_slope


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    make_event: Callable[[float], DpEvent],
    accountant: str = "pld",
    *,
    tol: float = 1e-5,
    value_discretization_interval: float = DEFAULT_PLD_DISCRETIZATION,
    rdp_orders: Sequence[float] | None = None,
) -> float:
    """Smallest noise multiplier ``z`` with ``epsilon(make_event(z), delta) <= target_epsilon``.

    Args:
        target_epsilon: finite > 0.
        delta: in (0, 1).
        make_event: ``z -> event`` of the whole run (e.g. ``lambda z: dpsgd_event(z, steps, q)``
            or ``lambda z: plan_ledger(z).to_dp_event()``); epsilon must decrease in ``z``.
        accountant: ``"pld"`` (RDP bracket refined by PLD), ``"rdp"`` or ``"rdp-classic"``.
        tol: absolute tolerance in epsilon: the result satisfies
            ``target_epsilon - tol <= epsilon(z) <= target_epsilon`` (the upper bound always; the
            lower one unless epsilon jumps at the solution, e.g. through PLD discretisation).
        value_discretization_interval, rdp_orders: passed to ``compute_epsilon``.

    Privacy: the returned ``z`` was itself evaluated and is feasible; the search never returns
    an interpolated value. Searches ``z`` in [1e-3, 1e6]; if even ``z = 1e-3`` meets the target,
    1e-3 is returned. Raises ``ValueError`` naming the argument for a bad input and when the
    target is unreachable even with ``z = 1e6`` (e.g. below the floor of the classic RDP
    conversion); ``UnsupportedAccountingError`` for PLD with sampling without replacement.
    """
    target = _check_target(target_epsilon)
    delta = check_delta(delta)
    check_accountant(accountant)
    if not callable(make_event):
        raise TypeError(
            f"make_event must be a callable noise_multiplier -> event, got {make_event!r}"
        )
    if not (isinstance(tol, (int, float)) and tol > 0):
        raise ValueError(f"tol must be > 0 (an absolute tolerance in epsilon), got {tol!r}")
    vdi = value_discretization_interval

    def make(what_acc: str) -> Callable[[float], float]:
        return _event_epsilon_fn(make_event, delta, what_acc, vdi, rdp_orders, "make_event")

    if accountant != "pld":
        return _solve_noise(make(accountant), target, tol, 1.0, 0.5, accountant, delta)[0]

    first = make_event(1.0)
    if not is_dp_event(first):
        raise TypeError(f"make_event must return a dpclip.events event, got {type(first).__name__}")
    _ensure_pld_supported(first)
    try:  # the RDP sigma is a close (usually feasible) starting point for PLD
        guess, slope = _solve_noise(
            make("rdp"), target, 1e-2 * target, 1.0, 0.5, "rdp", delta
        )
        shrink = 0.95
    except ValueError:
        guess, slope, shrink = 1.0, None, 0.5
    return _solve_noise(make("pld"), target, tol, guess, shrink, "pld", delta, slope)[0]


def calibrate_dpsgd_noise(
    target_epsilon: float,
    delta: float,
    sample_rate: float | None,
    steps: int,
    accountant: str = "pld",
    *,
    sampling: str = "poisson",
    dataset_size: int | None = None,
    batch_size: int | None = None,
    tol: float = 1e-5,
    value_discretization_interval: float = DEFAULT_PLD_DISCRETIZATION,
    rdp_orders: Sequence[float] | None = None,
) -> float:
    """Noise multiplier for ``steps`` identical DP-SGD steps to meet ``target_epsilon``.

    Poisson sampling with ``sample_rate`` (or ``batch_size / dataset_size``), add/remove-one; or
    ``sampling="without-replacement"`` with ``dataset_size`` and ``batch_size`` (replace-one:
    the noise std is then ``z`` times the replace-one sensitivity ``2C``; use
    ``accountant="rdp"``, PLD raises ``UnsupportedAccountingError``). See
    ``calibrate_noise_multiplier`` for the guarantees and errors. Note: dp_accounting's RDP of
    sampling without replacement costs ~0.5 s per evaluation at its default orders (the large
    integer orders dominate); a smaller ``rdp_orders`` (e.g. ``range(2, 33)``) is ~20x faster.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    dpsgd_step_event(  # validate the sampling arguments once, with their own messages
        1.0, sample_rate, dataset_size=dataset_size, batch_size=batch_size, sampling=sampling
    )

    def make(z: float) -> DpEvent:
        step = dpsgd_step_event(
            z, sample_rate, dataset_size=dataset_size, batch_size=batch_size, sampling=sampling
        )
        return SelfComposedEvent(step, steps)

    return calibrate_noise_multiplier(
        target_epsilon,
        delta,
        make,
        accountant,
        tol=tol,
        value_discretization_interval=value_discretization_interval,
        rdp_orders=rdp_orders,
    )


StepsSpec = Union[Callable[[int], DpEvent], tuple[float, float]]


def calibrate_steps(
    target_epsilon: float,
    delta: float,
    make_event_for_steps: StepsSpec,
    accountant: str = "pld",
    *,
    max_steps: int = 10**7,
    value_discretization_interval: float = DEFAULT_PLD_DISCRETIZATION,
    rdp_orders: Sequence[float] | None = None,
) -> int:
    """Largest number of steps ``T`` with ``epsilon(make_event_for_steps(T), delta) <= target``.

    ``make_event_for_steps`` is a callable ``T -> event`` (epsilon must increase with ``T``) or a
    pair ``(sample_rate, noise_multiplier)`` for Poisson DP-SGD steps. Returns 0 when even one
    step exceeds the target, and ``max_steps`` when ``max_steps`` steps still fit (the search is
    capped there). For PLD, the RDP answer seeds the search. Raises ``ValueError`` for bad
    inputs, or when zero steps already exceed the target.
    """
    target = _check_target(target_epsilon)
    delta = check_delta(delta)
    check_accountant(accountant)
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"max_steps must be an int >= 1, got {max_steps!r}")
    if isinstance(make_event_for_steps, tuple):
        if len(make_event_for_steps) != 2:
            raise ValueError(
                "make_event_for_steps must be a callable steps -> event or a pair "
                f"(sample_rate, noise_multiplier), got {make_event_for_steps!r}"
            )
        q = check_sample_rate(make_event_for_steps[0])
        z = check_noise_multiplier(make_event_for_steps[1])

        def make(t: int) -> DpEvent:
            return SelfComposedEvent(PoissonSampledEvent(q, GaussianEvent(z)), t)

    elif callable(make_event_for_steps):
        make = make_event_for_steps
    else:
        raise TypeError(
            "make_event_for_steps must be a callable steps -> event or a pair "
            f"(sample_rate, noise_multiplier), got {make_event_for_steps!r}"
        )
    vdi = value_discretization_interval
    f = _event_epsilon_fn(make, delta, accountant, vdi, rdp_orders, "make_event_for_steps")
    f0 = f(0)
    if f0 > target:
        raise ValueError(
            f"target_epsilon={target!r} is unreachable: zero steps already cost epsilon={f0:.6g}"
        )
    guess, growth = 1, 2.0
    if accountant == "pld":
        _ensure_pld_supported(make(1))
        guess = calibrate_steps(
            target, delta, make, "rdp", max_steps=max_steps, rdp_orders=rdp_orders
        )
        if guess >= 64:  # a good seed: PLD is usually within 25 % of it
            growth = 1.25
        guess = max(guess, 1)
    guess = min(guess, max_steps)
    # bracket: f(lo) <= target < f(hi)
    f_g = f(guess)
    if f_g <= target:
        lo, f_lo = guess, f_g
        while True:
            if lo >= max_steps:
                return max_steps
            hi = min(max_steps, max(lo + 1, math.ceil(lo * growth)))
            f_hi = f(hi)
            if f_hi > target:
                break
            lo, f_lo = hi, f_hi
    else:
        hi, f_hi = guess, f_g
        lo = hi // 2
        f_lo = f(lo) if lo > 0 else f0
        while f_lo > target:  # terminates: f(0) = f0 <= target
            hi, f_hi = lo, f_lo
            lo = lo // 2
            f_lo = f(lo) if lo > 0 else f0
    return _refine_steps(f, target, lo, hi, f_lo, f_hi)


def _refine_steps(
    f: Callable[[int], float], target: float, lo: int, hi: int, f_lo: float, f_hi: float
) -> int:
    """Largest feasible integer in [lo, hi) given f(lo) <= target < f(hi), f increasing.

    Interpolates on (log T, log epsilon) (epsilon grows roughly like a power of T), probes the
    integer on the other side of each estimate, and bisects every third round as a safeguard.
    """
    rounds = 0
    while hi - lo > 1:
        if rounds % 3 == 2 or not (f_lo > 0 and math.isfinite(f_hi)):
            m = (lo + hi) // 2
        else:
            x_lo, x_hi = math.log(lo), math.log(hi)
            y_lo, y_hi = math.log(f_lo), math.log(f_hi)
            est = math.exp(x_lo + (math.log(target) - y_lo) * (x_hi - x_lo) / (y_hi - y_lo))
            m = min(max(math.floor(est), lo + 1), hi - 1)
        f_m = f(m)
        if f_m <= target:
            lo, f_lo = m, f_m
            probe = m + 1
        else:
            hi, f_hi = m, f_m
            probe = m - 1
        if lo < probe < hi:
            f_p = f(probe)
            if f_p <= target:
                lo, f_lo = probe, f_p
            else:
                hi, f_hi = probe, f_p
        rounds += 1
    return lo
