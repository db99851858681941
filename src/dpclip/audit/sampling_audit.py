"""Audit of the sampling claim: does the batch sampler behave as the event it reports?

A step's epsilon depends on amplification by sampling, which the sampler's ``step_event`` claims
(``PoissonSampled(q, .)``: every record joins each batch independently with probability ``q``).
:func:`presence_audit` draws epochs from the sampler itself and tests one property of that claim
that any record-level observer could check: the probability that a record appears at least once
in an epoch of ``K`` steps, which is ``1 - (1 - q)^K`` under Poisson sampling. A two-sided
Clopper-Pearson interval that excludes it refutes the claim (at the stated significance). The
sampler is then accounted as what it was seen to be, without amplification: a record in every
epoch exactly once (epoch-wise shuffling into fixed batches) costs one ``Gaussian(z)`` per epoch;
any other refuted sampler costs one ``Gaussian(z)`` per step. The mechanism is flagged when that
epsilon exceeds the claimed one. This catches "Poisson epsilon reported for shuffled fixed batches"
(anchors P1); it is an accounting audit (the epsilons are the accountant's, PLD), not a
distinguishing attack on the model. The audit's generator is seeded (reproducible, NOT private).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dpclip._checks import check_open_unit
from dpclip.audit.estimators import clopper_pearson_upper
from dpclip.events import GaussianEvent, SelfComposedEvent
from dpclip.accounting import epsilon

__all__ = ["PresenceAudit", "presence_audit"]


@dataclass(frozen=True)
class PresenceAudit:
    """``claimed_epsilon``: the sampler's own events over ``epochs``; ``epsilon``: the epsilon of
    the scheme as observed (equal to the claim when nothing is refuted); ``presence_lower`` /
    ``presence_upper``: Clopper-Pearson interval of the per-epoch presence rate;
    ``poisson_presence``: the rate the claim implies; ``flagged``: refuted and ``epsilon`` above
    the claim."""

    claimed_epsilon: float
    epsilon: float
    presence_lower: float
    presence_upper: float
    poisson_presence: float
    always_once: bool
    refuted: bool
    flagged: bool
    trials: int
    significance: float


def presence_audit(
    sampler: Any,
    *,
    noise_multiplier: float,
    epochs: int,
    delta: float,
    trials: int = 300,
    significance: float = 0.05,
    seed: int = 0,
    record: int = 0,
) -> PresenceAudit:
    """Draw ``trials`` epochs of ``sampler.steps_per_epoch`` batches and test record ``record``'s
    per-epoch presence against the Poisson claim (module docstring)."""
    if trials < 10:
        raise ValueError(f"trials must be >= 10, got {trials!r}")
    check_open_unit("significance", significance)
    k = int(sampler.steps_per_epoch)
    q = float(sampler.sample_rate)
    z = float(noise_multiplier)
    claimed = float(epsilon(SelfComposedEvent(sampler.step_event(GaussianEvent(z)), k * epochs),
                            delta, "pld"))
    gen = torch.Generator().manual_seed(int(seed))
    present, exactly_once = 0, 0
    for _ in range(trials):
        hits = sum(int((sampler.sample(gen) == record).sum()) for _ in range(k))
        present += hits > 0
        exactly_once += hits == 1
    half = significance / 2.0
    upper = float(clopper_pearson_upper(present, trials, half))
    lower = 1.0 - float(clopper_pearson_upper(trials - present, trials, half))
    poisson = 1.0 - (1.0 - q) ** k
    refuted = not (lower <= poisson <= upper)
    always_once = exactly_once == trials
    if refuted:
        steps_charged = epochs if always_once else k * epochs
        scheme = float(epsilon(SelfComposedEvent(GaussianEvent(z), steps_charged), delta, "pld"))
    else:
        scheme = claimed
    return PresenceAudit(claimed, scheme, lower, upper, poisson, always_once, refuted,
                         refuted and scheme > claimed, trials, significance)
