"""Mapping ``dpclip.events`` onto ``dp_accounting.dp_event`` and normalising events for accounting.

``to_dp_accounting`` is the faithful, structural mapping (one ``dp_accounting`` event per
``dpclip`` event). ``flatten_for_accounting`` is what the accountants actually compose: the event
tree flattened into independent leaves with multiplicities, where every sampled event carries a
single equivalent Gaussian (several Gaussian queries on the same batch are exactly one Gaussian
with ``z = (sum z_i^-2)^-1/2``, algorithms.md 1.4 / Mironov et al. 2019 section 3), identical
leaves are merged (composition is commutative) and no-ops are dropped.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Union

import dp_accounting
from dp_accounting import dp_event as dpa_event

from dpclip.accounting.ledger import Ledger
from dpclip.events import (
    ADD_REMOVE,
    REPLACE_ONE,
    ComposedEvent,
    DpEvent,
    GaussianEvent,
    NoOpEvent,
    PoissonSampledEvent,
    SampledWithoutReplacementEvent,
    SelfComposedEvent,
)

__all__ = [
    "UnsupportedAccountingError",
    "adjacency_of",
    "combined_noise_multiplier",
    "flatten_for_accounting",
    "to_dp_accounting",
]

LedgerOrEvent = Union[Ledger, DpEvent]


class UnsupportedAccountingError(ValueError):
    """The requested accountant cannot account for an event (the message names event and fix)."""


def combined_noise_multiplier(*noise_multipliers: float) -> float:
    """Noise multiplier of one Gaussian equivalent to several Gaussian queries on the same data.

    ``z = (sum_i z_i^-2)^-1/2`` (algorithms.md 1.4): releasing ``G(z_1), ..., G(z_k)`` of queries
    with unit sensitivity on the same batch has exactly the privacy loss of one Gaussian with
    multiplier ``z`` (e.g. a clipped gradient sum plus a noisy clipped count, Andrew et al. 2021
    Thm 1). Edge cases: a zero multiplier (no noise) gives 0.0; ``math.inf`` (a query that
    releases nothing) contributes nothing; all-``inf`` gives ``inf``. Raises ``ValueError`` on no
    argument, a negative or NaN multiplier.
    """
    if not noise_multipliers:
        raise ValueError("combined_noise_multiplier: give at least one noise multiplier")
    total = 0.0
    for i, z in enumerate(noise_multipliers):
        if isinstance(z, bool) or not isinstance(z, (int, float)) or math.isnan(z) or z < 0:
            raise ValueError(
                f"combined_noise_multiplier: noise multiplier #{i} must be a number >= 0, got {z!r}"
            )
        if z == 0:
            return 0.0
        total += float(z) ** -2
    return math.inf if total == 0 else total**-0.5


# --------------------------------------------------------------------------------------------
# structural mapping
# --------------------------------------------------------------------------------------------
def to_dp_accounting(event: LedgerOrEvent) -> dpa_event.DpEvent:
    """Map a ``dpclip.events`` event (or a ``Ledger``) onto the ``dp_accounting`` event classes.

    NoOp -> NoOpDpEvent, Gaussian -> GaussianDpEvent, Composed -> ComposedDpEvent,
    PoissonSampled -> PoissonSampledDpEvent, SampledWithoutReplacement ->
    SampledWithoutReplacementDpEvent, SelfComposed -> SelfComposedDpEvent. A ledger maps through
    ``Ledger.to_dp_event``. Raises ``TypeError`` for anything else.
    """
    if isinstance(event, Ledger):
        event = event.to_dp_event()
    if isinstance(event, NoOpEvent):
        return dp_accounting.NoOpDpEvent()
    if isinstance(event, GaussianEvent):
        return dp_accounting.GaussianDpEvent(float(event.noise_multiplier))
    if isinstance(event, ComposedEvent):
        return dp_accounting.ComposedDpEvent([to_dp_accounting(e) for e in event.events])
    if isinstance(event, PoissonSampledEvent):
        return dp_accounting.PoissonSampledDpEvent(
            float(event.sample_rate), to_dp_accounting(event.event)
        )
    if isinstance(event, SampledWithoutReplacementEvent):
        return dp_accounting.SampledWithoutReplacementDpEvent(
            int(event.source_size), int(event.sample_size), to_dp_accounting(event.event)
        )
    if isinstance(event, SelfComposedEvent):
        return dp_accounting.SelfComposedDpEvent(to_dp_accounting(event.event), int(event.count))
    raise TypeError(
        f"to_dp_accounting: expected a dpclip.events event or a Ledger, got "
        f"{type(event).__name__}: {event!r}"
    )


# --------------------------------------------------------------------------------------------
# normalisation for the accountants
# --------------------------------------------------------------------------------------------
def _sampling_kinds(event: DpEvent, found: set[str]) -> None:
    if isinstance(event, PoissonSampledEvent):
        found.add(ADD_REMOVE)
        _sampling_kinds(event.event, found)
    elif isinstance(event, SampledWithoutReplacementEvent):
        found.add(REPLACE_ONE)
        _sampling_kinds(event.event, found)
    elif isinstance(event, ComposedEvent):
        for e in event.events:
            _sampling_kinds(e, found)
    elif isinstance(event, SelfComposedEvent):
        _sampling_kinds(event.event, found)


def adjacency_of(event: LedgerOrEvent) -> str:
    """The neighbouring relation the event must be accounted under.

    ``"replace-one"`` when it contains fixed-size sampling without replacement,
    ``"add-remove-one"`` otherwise (Poisson sampling, or unsampled Gaussians only). Raises
    ``ValueError`` when Poisson and without-replacement events are mixed: epsilons under
    different neighbouring relations cannot be composed (never report one as the other).
    """
    if isinstance(event, Ledger):
        events: list[DpEvent] = [e for e, _ in event.entries]
    else:
        events = [event]
    found: set[str] = set()
    for e in events:
        _sampling_kinds(e, found)
    if len(found) > 1:
        raise ValueError(
            "cannot account for a ledger/event that mixes Poisson sampling (add-remove-one "
            "adjacency) with fixed-size sampling without replacement (replace-one adjacency): "
            "the two neighbouring relations do not compose. Use one sampler for the whole run."
        )
    return found.pop() if found else ADD_REMOVE


def _same_batch_noise(event: DpEvent, outer: DpEvent) -> float:
    """Equivalent noise multiplier of the queries run on one sampled batch (inf: no release)."""
    if isinstance(event, NoOpEvent):
        return math.inf
    if isinstance(event, GaussianEvent):
        return float(event.noise_multiplier)
    if isinstance(event, ComposedEvent):
        zs = [_same_batch_noise(e, outer) for e in event.events]
        return combined_noise_multiplier(*zs) if zs else math.inf
    if isinstance(event, SelfComposedEvent):
        if event.count == 0:
            return math.inf
        z = _same_batch_noise(event.event, outer)
        return z / math.sqrt(event.count)
    if isinstance(event, (PoissonSampledEvent, SampledWithoutReplacementEvent)):
        raise UnsupportedAccountingError(
            f"nested sampling is not supported: {type(event).__name__} inside {outer!r}. "
            "Record the sampled event at the top level of each step."
        )
    raise TypeError(f"not a dpclip.events event: {type(event).__name__}: {event!r}")


Leaf = Union[GaussianEvent, PoissonSampledEvent, SampledWithoutReplacementEvent]


def _flatten(event: DpEvent, mult: int, out: Counter) -> None:
    if isinstance(event, NoOpEvent):
        return
    if isinstance(event, GaussianEvent):
        out[GaussianEvent(float(event.noise_multiplier))] += mult
    elif isinstance(event, ComposedEvent):
        for e in event.events:
            _flatten(e, mult, out)
    elif isinstance(event, SelfComposedEvent):
        if event.count > 0:
            _flatten(event.event, mult * event.count, out)
    elif isinstance(event, PoissonSampledEvent):
        z = _same_batch_noise(event.event, event)
        if event.sample_rate == 0 or z == math.inf:
            return
        out[PoissonSampledEvent(float(event.sample_rate), GaussianEvent(z))] += mult
    elif isinstance(event, SampledWithoutReplacementEvent):
        z = _same_batch_noise(event.event, event)
        if event.sample_size == 0 or z == math.inf:
            return
        leaf = SampledWithoutReplacementEvent(
            int(event.source_size), int(event.sample_size), GaussianEvent(z)
        )
        out[leaf] += mult
    else:
        raise TypeError(
            f"expected a dpclip.events event or a Ledger, got {type(event).__name__}: {event!r}"
        )


def flatten_for_accounting(event: LedgerOrEvent) -> list[tuple[Leaf, int]]:
    """Independent leaves ``(event, count)`` whose composition is exactly ``event``.

    Leaves are unsampled ``GaussianEvent``s or sampled events wrapping a single
    ``GaussianEvent`` (the same-batch equivalent). No-ops, zero rates, zero counts and sampled
    events that release nothing are dropped; identical leaves are merged. An empty list means
    the event costs no privacy. Raises ``UnsupportedAccountingError`` for nested sampling.
    """
    out: Counter = Counter()
    if isinstance(event, Ledger):
        for e, c in event.entries:
            _flatten(e, c, out)
    else:
        _flatten(event, 1, out)
    return [(leaf, n) for leaf, n in out.items() if n > 0]
