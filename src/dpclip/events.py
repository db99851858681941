"""Typed differential-privacy events: the vocabulary shared by samplers, strategies and the ledger.

Every private release in dpclip is described by one of these small frozen dataclasses. They carry
no torch and no accounting code, so samplers (``dpclip.training.sampling``), strategies
(``dpclip.clipping``) and the accountant (``dpclip.accounting``) can all speak about privacy
without importing each other. ``dpclip.accounting`` maps them onto ``dp_accounting`` events.

Conventions
-----------
* ``GaussianEvent(noise_multiplier)``: a Gaussian mechanism whose noise standard deviation is
  ``noise_multiplier`` times the L2 sensitivity of the released sum under the run's neighbouring
  relation (add/remove-one for Poisson sampling, replace-one for fixed-size sampling, where the
  sensitivity of a clipped sum is ``2 * C``).
* ``ComposedEvent(events)``: the events run on the same data (the same batch).
* ``PoissonSampledEvent(sample_rate, event)``: ``event`` run on a Poisson subsample
  (add/remove-one adjacency).
* ``SampledWithoutReplacementEvent(source_size, sample_size, event)``: ``event`` run on a uniformly
  random subset of fixed size, drawn afresh at every step (replace-one adjacency).
* ``SelfComposedEvent(event, count)``: ``count`` independent repetitions.
* ``NoOpEvent()``: a step that releases nothing about the data.

Every event round-trips through ``to_dict`` / ``event_from_dict`` (JSON-friendly), which is how
ledgers are checkpointed and stored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Union

__all__ = [
    "ADD_REMOVE",
    "REPLACE_ONE",
    "ComposedEvent",
    "DpEvent",
    "GaussianEvent",
    "NoOpEvent",
    "PoissonSampledEvent",
    "SampledWithoutReplacementEvent",
    "SelfComposedEvent",
    "event_from_dict",
]

#: Neighbouring relations (the "adjacency" field of every mechanism and result row).
ADD_REMOVE = "add-remove-one"
REPLACE_ONE = "replace-one"


@dataclass(frozen=True)
class NoOpEvent:
    """A release that reveals nothing about the data (costs no privacy)."""

    def to_dict(self) -> dict[str, Any]:
        return {"type": "noop"}


@dataclass(frozen=True)
class GaussianEvent:
    """Gaussian mechanism with noise std = ``noise_multiplier`` x L2 sensitivity."""

    noise_multiplier: float

    def __post_init__(self) -> None:
        z = self.noise_multiplier
        if not (isinstance(z, (int, float)) and math.isfinite(z) and z >= 0):
            raise ValueError(
                f"GaussianEvent: noise_multiplier must be a finite number >= 0, got {z!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {"type": "gaussian", "noise_multiplier": float(self.noise_multiplier)}


@dataclass(frozen=True)
class ComposedEvent:
    """Several mechanisms run on the same data (for example a gradient sum and a noisy count)."""

    events: tuple["DpEvent", ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "events", tuple(self.events))

    def to_dict(self) -> dict[str, Any]:
        return {"type": "composed", "events": [e.to_dict() for e in self.events]}


@dataclass(frozen=True)
class PoissonSampledEvent:
    """``event`` applied to a Poisson subsample: each record kept independently with ``sample_rate``."""

    sample_rate: float
    event: "DpEvent"

    def __post_init__(self) -> None:
        q = self.sample_rate
        if not (isinstance(q, (int, float)) and 0.0 <= q <= 1.0):
            raise ValueError(f"PoissonSampledEvent: sample_rate must be in [0, 1], got {q!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "poisson",
            "sample_rate": float(self.sample_rate),
            "event": self.event.to_dict(),
        }


@dataclass(frozen=True)
class SampledWithoutReplacementEvent:
    """``event`` applied to a uniformly random subset of ``sample_size`` of ``source_size`` records.

    Accounted under replace-one adjacency (``source_size`` is public).
    """

    source_size: int
    sample_size: int
    event: "DpEvent"

    def __post_init__(self) -> None:
        if not (0 <= self.sample_size <= self.source_size and self.source_size > 0):
            raise ValueError(
                "SampledWithoutReplacementEvent: need 0 <= sample_size <= source_size and "
                f"source_size > 0, got sample_size={self.sample_size}, "
                f"source_size={self.source_size}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "without_replacement",
            "source_size": int(self.source_size),
            "sample_size": int(self.sample_size),
            "event": self.event.to_dict(),
        }


@dataclass(frozen=True)
class SelfComposedEvent:
    """``count`` independent repetitions of ``event``."""

    event: "DpEvent"
    count: int

    def __post_init__(self) -> None:
        if not (isinstance(self.count, int) and self.count >= 0):
            raise ValueError(f"SelfComposedEvent: count must be an int >= 0, got {self.count!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"type": "self_composed", "count": int(self.count), "event": self.event.to_dict()}


DpEvent = Union[
    NoOpEvent,
    GaussianEvent,
    ComposedEvent,
    PoissonSampledEvent,
    SampledWithoutReplacementEvent,
    SelfComposedEvent,
]


def event_from_dict(d: dict[str, Any]) -> DpEvent:
    """Inverse of ``DpEvent.to_dict``; raises ``ValueError`` on an unknown ``type``."""
    kind = d.get("type")
    if kind == "noop":
        return NoOpEvent()
    if kind == "gaussian":
        return GaussianEvent(float(d["noise_multiplier"]))
    if kind == "composed":
        return ComposedEvent(tuple(event_from_dict(e) for e in d["events"]))
    if kind == "poisson":
        return PoissonSampledEvent(float(d["sample_rate"]), event_from_dict(d["event"]))
    if kind == "without_replacement":
        return SampledWithoutReplacementEvent(
            int(d["source_size"]), int(d["sample_size"]), event_from_dict(d["event"])
        )
    if kind == "self_composed":
        return SelfComposedEvent(event_from_dict(d["event"]), int(d["count"]))
    raise ValueError(
        f"unknown DP event type {kind!r}; expected one of noop, gaussian, composed, poisson, "
        "without_replacement, self_composed"
    )
