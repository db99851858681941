"""Epsilon of a ledger (or of one event) with dp_accounting's PLD or RDP accountants.

Accountants (``accountant=``):

* ``"pld"`` (default): ``dp_accounting.pld.PLDAccountant`` (privacy loss distributions, Koskela
  et al. / Doroshenko et al. 2022), pessimistic discretisation with
  ``value_discretization_interval`` (default 1e-3: within ~0.0025 of 1e-4 and 5-10x faster,
  docs performance.md). The tightest of the three; supports Poisson-subsampled and unsampled
  Gaussians under add/remove-one adjacency. It does NOT support fixed-size sampling without
  replacement: that raises ``UnsupportedAccountingError`` (use ``accountant="rdp"``).
* ``"rdp"``: ``dp_accounting.rdp.RdpAccountant`` over its default orders
  (1.1..10.9 step 0.1, 11..63, 128, 256, 512, 1024). The RDP curve of each distinct step event
  is computed once by an ``RdpAccountant`` and cached (RDP composes additively), so evaluating a
  growing ledger every epoch or searching over step counts stays cheap. Its RDP -> (epsilon,
  delta) conversion (``dp_accounting.rdp.compute_epsilon``, also what
  ``RdpAccountant.get_epsilon`` returns) is the improved bound of Canonne, Kamath & Steinke 2020
  (Prop. 12; the same formula as Balle et al. 2020, Thm 21, which Opacus uses)::

      epsilon = min_alpha  RDP(alpha) + log1p(-1/alpha) - log(delta * alpha) / (alpha - 1)

  restricted to alpha > 1.01, plus epsilon = 0 wherever the KL bound
  ``delta >= sqrt(1 - exp(-RDP(alpha)))`` already holds; the result is clamped at 0. Supports
  sampling without replacement under replace-one adjacency (Wang, Balle & Kasiviswanathan 2019).
* ``"rdp-classic"``: the same RDP curve converted with the OLD bound of Mironov 2017 (Prop. 3)
  used by older TF-Privacy releases (``rdp_accountant.get_privacy_spent``, behind
  ``compute_dp_sgd_privacy``) and Abadi-era papers (2016-2021)::

      epsilon = min_alpha  RDP(alpha) + log(1/delta) / (alpha - 1)

  Looser; use it only to reproduce the sigmas / epsilons of papers calibrated with it
  (algorithms.md 1.4, test vectors T1 and T3).

Neighbouring relation: add-remove-one unless the event contains fixed-size sampling without
replacement (replace-one); a ledger mixing both raises ``ValueError``.
Edge cases: an empty ledger (or no-op event) has epsilon 0; epsilon is never negative; a noise
multiplier of 0 gives ``math.inf``.

dp_accounting's own log lines (absl warnings such as "_compute_log_a_frac failed to converge ...
Excluding this order from the epsilon computation") are kept from the user: they are recorded and
dropped by a logging filter scoped to each call (:func:`quiet_dp_accounting`). An order excluded
that way only removes one term of the minimum over orders, so the epsilon reported stays a valid
upper bound.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from dp_accounting import dp_event as dpa_event
from dp_accounting.pld import PLDAccountant
from dp_accounting.privacy_accountant import NeighboringRelation, UnsupportedEventError
from dp_accounting.rdp import RdpAccountant
from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon as rdp_compute_epsilon

from dpclip.accounting.convert import (
    LedgerOrEvent,
    UnsupportedAccountingError,
    adjacency_of,
    flatten_for_accounting,
    to_dp_accounting,
)
from dpclip.accounting.ledger import Ledger
from dpclip.events import REPLACE_ONE

__all__ = [
    "ACCOUNTANTS",
    "DEFAULT_PLD_DISCRETIZATION",
    "EpsilonReport",
    "compute_epsilon",
    "epsilon",
]

#: Accountant names accepted by ``compute_epsilon`` / ``epsilon`` and the calibrators.
ACCOUNTANTS = ("pld", "rdp", "rdp-classic")

#: Default PLD ``value_discretization_interval`` (performance.md: within 0.0025 of 1e-4, fast).
DEFAULT_PLD_DISCRETIZATION = 1e-3


@dataclass(frozen=True)
class EpsilonReport:
    """Epsilon of a ledger plus everything needed to state the guarantee honestly.

    Fields: ``epsilon`` (>= 0, ``math.inf`` if there is no guarantee), ``delta``, ``accountant``
    (``"pld"``, ``"rdp"`` or ``"rdp-classic"``), ``adjacency`` (the neighbouring relation:
    ``"add-remove-one"`` or ``"replace-one"``), ``optimal_order`` (the minimising RDP order for
    the RDP accountants, ``None`` for PLD or when there is nothing to account), ``steps`` (the
    number of ledger steps, ``None`` when a bare event was given) and
    ``value_discretization_interval`` (PLD only).
    """

    epsilon: float
    delta: float
    accountant: str
    adjacency: str
    optimal_order: float | None = None
    steps: int | None = None
    value_discretization_interval: float | None = None

    @property
    def neighbouring_relation(self) -> str:
        """Alias of ``adjacency``."""
        return self.adjacency


class _DpAccountingLogFilter(logging.Filter):
    """Drops (and keeps a copy of) the records dp_accounting logs below ERROR."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        from_dp_accounting = record.name == "absl" or "dp_accounting" in (record.pathname or "")
        if from_dp_accounting and record.levelno < logging.ERROR:
            self.dropped.append(record.getMessage())
            return False
        return True


@contextlib.contextmanager
def quiet_dp_accounting() -> Iterator[list[str]]:
    """Within the block, dp_accounting's warnings (absl logger for RDP, the root logger for PLD)
    do not reach the user; yields the list of dropped messages. Other loggers and other records
    are untouched, and the filters are removed on exit."""
    filt = _DpAccountingLogFilter()
    loggers = (logging.getLogger("absl"), logging.getLogger())
    for lg in loggers:
        lg.addFilter(filt)
    try:
        yield filt.dropped
    finally:
        for lg in loggers:
            lg.removeFilter(filt)


def check_delta(delta: float, name: str = "delta") -> float:
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 < delta < 1:
        raise ValueError(
            f"{name} must be a number in (0, 1), got {delta!r} (typically 1e-5, below 1/N)"
        )
    return float(delta)


def refuse_unsupported(event: Any, accountant: str) -> None:
    """The ONE refusal of an accountant/event pair dp-accounting cannot account: the PLD
    accountant and sampling without replacement (fixed-size batches, GBC mini-sets; replace-one
    adjacency). Raises :class:`UnsupportedAccountingError` naming the fix (RDP, or Poisson)."""
    if accountant == "pld" and adjacency_of(event) == REPLACE_ONE:
        raise UnsupportedAccountingError(
            "the PLD accountant (Poisson subsampling only) does not support sampling without "
            f"replacement (fixed-size batches, replace-one adjacency), found in {event!r}; use "
            "accountant='rdp' (or 'rdp-classic'; CLI --accountant rdp), or Poisson sampling")


def check_accountant(accountant: str) -> str:
    if accountant not in ACCOUNTANTS:
        raise ValueError(
            f"accountant must be one of {', '.join(repr(a) for a in ACCOUNTANTS)}, got "
            f"{accountant!r}"
        )
    return accountant


def _check_orders(orders: Sequence[float] | None) -> Sequence[float] | None:
    if orders is None:
        return None
    arr = np.asarray(orders, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0 or not np.all(np.isfinite(arr)) or np.any(arr <= 1):
        raise ValueError(
            f"rdp_orders must be a non-empty sequence of finite orders > 1, got {orders!r}"
        )
    return [float(a) for a in arr]


def _classic_conversion(orders: np.ndarray, rdp: np.ndarray, delta: float) -> tuple[float, float]:
    """Mironov 2017 Prop. 3: ``eps = min_alpha RDP(alpha) + log(1/delta)/(alpha - 1)``."""
    with np.errstate(invalid="ignore", over="ignore"):
        eps = rdp + math.log(1.0 / delta) / (orders - 1.0)
    eps = np.where(np.isnan(eps), np.inf, eps)
    i = int(np.argmin(eps))
    return float(eps[i]), float(orders[i])


def compute_epsilon(
    ledger_or_event: LedgerOrEvent,
    delta: float,
    accountant: str = "pld",
    *,
    value_discretization_interval: float = DEFAULT_PLD_DISCRETIZATION,
    rdp_orders: Sequence[float] | None = None,
) -> EpsilonReport:
    """(epsilon, delta)-DP guarantee of a ``Ledger`` or a ``dpclip.events`` event.

    Args:
        ledger_or_event: the run's ``Ledger`` or any event (e.g. ``Ledger.to_dp_event()``).
        delta: target delta in (0, 1).
        accountant: ``"pld"`` (tightest, default), ``"rdp"`` (dp_accounting's RDP with the
            Canonne-Kamath-Steinke / Balle et al. conversion) or ``"rdp-classic"`` (RDP with the
            old ``min RDP + log(1/delta)/(alpha-1)`` conversion of TF-Privacy and 2016-2021
            papers). See the module docstring.
        value_discretization_interval: PLD grid (ignored by RDP); smaller is tighter and slower.
        rdp_orders: RDP orders (> 1); default dp_accounting's ``DEFAULT_RDP_ORDERS``.

    Returns an ``EpsilonReport``. Raises ``ValueError`` for a bad ``delta`` / ``accountant`` or a
    ledger mixing Poisson and without-replacement sampling, and ``UnsupportedAccountingError``
    (a ``ValueError``) when the accountant cannot handle an event (PLD with sampling without
    replacement: use ``accountant="rdp"``).
    """
    delta = check_delta(delta)
    check_accountant(accountant)
    orders = _check_orders(rdp_orders)
    if accountant == "pld" and not (
        isinstance(value_discretization_interval, (int, float))
        and 0 < value_discretization_interval < 1
    ):
        raise ValueError(
            "value_discretization_interval must be in (0, 1) (default 1e-3), got "
            f"{value_discretization_interval!r}"
        )
    steps = ledger_or_event.steps if isinstance(ledger_or_event, Ledger) else None
    adjacency = adjacency_of(ledger_or_event)
    leaves = flatten_for_accounting(ledger_or_event)
    pld_interval = float(value_discretization_interval) if accountant == "pld" else None

    def report(eps: float, order: float | None) -> EpsilonReport:
        if math.isnan(eps):
            raise RuntimeError(
                f"the {accountant} accountant returned NaN for {ledger_or_event!r}; "
                "try another accountant"
            )
        return EpsilonReport(
            epsilon=max(0.0, float(eps)),
            delta=delta,
            accountant=accountant,
            adjacency=adjacency,
            optimal_order=order,
            steps=steps,
            value_discretization_interval=pld_interval,
        )

    if not leaves:
        return report(0.0, None)

    relation = (
        NeighboringRelation.REPLACE_ONE
        if adjacency == REPLACE_ONE
        else NeighboringRelation.ADD_OR_REMOVE_ONE
    )
    if accountant == "pld":
        for leaf, _ in leaves:
            refuse_unsupported(leaf, accountant)
        composed = dpa_event.ComposedDpEvent(
            [dpa_event.SelfComposedDpEvent(to_dp_accounting(leaf), n) for leaf, n in leaves]
        )
        _refuse_huge_pld_grid(composed, float(value_discretization_interval))
        acc = PLDAccountant(
            relation, value_discretization_interval=float(value_discretization_interval)
        )
        with quiet_dp_accounting():
            try:
                acc.compose(composed)
            except UnsupportedEventError as err:  # pragma: no cover - guarded above
                raise UnsupportedAccountingError(
                    f"the PLD accountant cannot account for {ledger_or_event!r} ({err}); "
                    "use accountant='rdp'"
                ) from err
            pld_eps = acc.get_epsilon(delta)
        return report(pld_eps, None)

    orders_key = tuple(orders) if orders is not None else _DEFAULT_ORDERS
    rdp = np.zeros(len(orders_key), dtype=np.float64)
    for leaf, n in leaves:
        rdp = rdp + n * _rdp_curve(leaf, orders_key, relation)
    orders_arr = np.asarray(orders_key, dtype=np.float64)
    if accountant == "rdp":
        with quiet_dp_accounting():
            eps, order = rdp_compute_epsilon(orders_arr, rdp, delta)
        return report(float(eps), float(order) if math.isfinite(eps) else None)
    eps, order = _classic_conversion(orders_arr, rdp, delta)
    return report(eps, order if math.isfinite(eps) else None)


_DEFAULT_ORDERS: tuple[float, ...] = tuple(float(a) for a in DEFAULT_RDP_ORDERS)

#: most points one Gaussian's PLD grid may have: dp-accounting's time grows about linearly with
#: it (~3 us a point at one thread: 5.4 s at 1.8e6, noise multiplier 0.03, an epsilon near 700
#: already); at noise multiplier 1e-3 it asked for 3.8 GiB or ran for tens of minutes
PLD_MAX_GRID_POINTS = 2 * 10**6


def _noise_multipliers(event: Any) -> list[float]:
    """The Gaussian noise multipliers inside a dp_accounting event."""
    z = getattr(event, "noise_multiplier", None)
    if isinstance(z, (int, float)):
        return [float(z)]
    found: list[float] = []
    for attr in ("event", "events"):
        inner = getattr(event, attr, None)
        for e in inner if isinstance(inner, (list, tuple)) else [inner] if inner else []:
            found += _noise_multipliers(e)
    return found


def pld_grid_points(noise_multiplier: float, value_discretization_interval: float) -> float:
    """About how many points the PLD of one Gaussian mechanism has: its privacy losses span
    ``2 t / z + 1 / z**2`` (the truncated tails at ``t ~ 10`` standard deviations, sensitivity
    1 in units of the noise) on a grid of ``value_discretization_interval``."""
    z = max(float(noise_multiplier), 1e-300)
    return (20.0 / z + 1.0 / z ** 2) / value_discretization_interval


class PLDGridTooLarge(UnsupportedAccountingError):
    """A Gaussian's PLD grid would be too large (a tiny noise multiplier): use RDP."""


def _refuse_huge_pld_grid(event: Any, interval: float) -> None:
    """A tiny noise multiplier under PLD: refused before dp-accounting allocates it (ninety-eighth
    review: ``noise_multiplier=1e-3`` asked for a 3.8 GiB array, or ran for over 20 minutes)."""
    for z in _noise_multipliers(event):
        if z > 0 and pld_grid_points(z, interval) > PLD_MAX_GRID_POINTS:
            raise PLDGridTooLarge(
                f"the PLD accountant at noise_multiplier={z:g} needs a grid of about "
                f"{pld_grid_points(z, interval):.2g} points (value_discretization_interval="
                f"{interval:g}): gigabytes of memory and minutes of work, for an epsilon that "
                "large anyway; use accountant='rdp', a coarser value_discretization_interval, "
                "or a larger noise multiplier")


@functools.lru_cache(maxsize=4096)
def _rdp_curve(
    leaf: object, orders: tuple[float, ...], relation: NeighboringRelation
) -> np.ndarray:
    """RDP of ONE application of ``leaf`` at ``orders`` (dp_accounting ``RdpAccountant``).

    Cached: RDP composes additively, so ``T`` steps cost ``T * curve`` and evaluating a growing
    ledger (or searching over step counts) needs one curve per distinct step event.
    """
    acc = RdpAccountant(list(orders), relation)
    with quiet_dp_accounting():  # e.g. "_compute_log_a_frac failed to converge": order excluded
        try:
            acc.compose(to_dp_accounting(leaf))  # type: ignore[arg-type]
        except UnsupportedEventError as err:  # pragma: no cover - our leaves are all supported
            raise UnsupportedAccountingError(
                f"the RDP accountant cannot account for {leaf!r}: {err}"
            ) from err
    curve = acc.rdp
    curve.setflags(write=False)
    return curve


def epsilon(
    ledger_or_event: LedgerOrEvent,
    delta: float,
    accountant: str = "pld",
    *,
    value_discretization_interval: float = DEFAULT_PLD_DISCRETIZATION,
    rdp_orders: Sequence[float] | None = None,
) -> float:
    """Epsilon (a float >= 0, ``math.inf`` without a guarantee) of a ledger or event.

    Shorthand for ``compute_epsilon(...).epsilon``; see ``compute_epsilon`` for the accountants,
    the neighbouring relation and the errors.
    """
    return compute_epsilon(
        ledger_or_event,
        delta,
        accountant,
        value_discretization_interval=value_discretization_interval,
        rdp_orders=rdp_orders,
    ).epsilon
