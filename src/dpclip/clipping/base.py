"""The clipping-strategy protocol.

A strategy decides how much each example's gradient counts. For a norm-based strategy the DP step is

    weights = strategy.weights(norms, state)          # pure; ||w_i * g_i|| <= strategy.sensitivity(state)
    sum     = sum_i w_i g_i                           # engine
    noisy   = sum + N(0, (z * k * S)^2)               # z = strategy.noise_multiplier(state, base)
                                                      # k = 1 (add/remove, Poisson), 2 (replace-one)
    state', events = strategy.update(state, norms, ctx, release)

Strategies are frozen dataclasses whose fields are public hyper-parameters. Their mutable part is an
explicit, JSON-serializable ``state`` mapping that the trainer threads through the run and stores in
checkpoints. Strategies never import torch.nn, an engine or the accountant: a private release (for
example a noisy count) goes through the ``release`` callback handed to ``update``, which adds the
noise in one place (``dpclip.noise``) and returns the typed DP event that the strategy passes back to
the trainer for the ledger.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

from dpclip.clipping.capabilities import Capabilities
from dpclip.events import DpEvent, GaussianEvent

__all__ = [
    "ClippingStrategy",
    "Release",
    "State",
    "StepContext",
    "StrategyBase",
    "finite_or_inf",
    "positive_finite",
    "set_positive_finite",
]

#: A strategy's mutable state: a JSON-serializable mapping (numbers, strings, lists).
State = Mapping[str, Any]


@dataclass(frozen=True, kw_only=True)
class StepContext:
    """Public facts about the step being taken (never data-dependent). Keyword-only; build it
    with :meth:`at`, which derives the epoch from the step."""

    step: int  #: 0-based global step index
    epoch: int  #: 0-based epoch index
    steps_per_epoch: int
    total_steps: int  #: planned number of steps of the run
    expected_batch_size: float  #: public normaliser (sample_rate * dataset_size)
    base_noise_multiplier: float  #: the run's noise multiplier (before any strategy schedule)

    @classmethod
    def at(cls, step: int, *, steps_per_epoch: int, total_steps: int,
           expected_batch_size: float, base_noise_multiplier: float) -> "StepContext":
        """The context of 0-based ``step`` (epoch ``step // steps_per_epoch``)."""
        return cls(step=int(step), epoch=int(step) // int(steps_per_epoch),
                   steps_per_epoch=int(steps_per_epoch), total_steps=int(total_steps),
                   expected_batch_size=float(expected_batch_size),
                   base_noise_multiplier=float(base_noise_multiplier))


class Release(Protocol):
    """Callback through which a strategy privatizes an extra statistic of the current batch.

    ``release(value, sensitivity, noise_multiplier)`` returns ``(value + N(0, std^2), event)`` with
    ``std = noise_multiplier * sensitivity * k``, where ``sensitivity`` is the statistic's L2
    sensitivity under add/remove-one adjacency and ``k`` the sampler's factor (1 for Poisson, 2 for
    replace-one); ``event`` is ``GaussianEvent(noise_multiplier)``, the ledger entry of this release.
    Expressing releases by their multiplier keeps a strategy's events independent of the sampler.
    """

    def __call__(
        self, value: Tensor, sensitivity: float, noise_multiplier: float
    ) -> tuple[Tensor, DpEvent]:
        ...


@runtime_checkable
class ClippingStrategy(Protocol):
    """What every norm-based strategy provides (see the module docstring)."""

    #: registry name
    name: ClassVar[str]
    #: "flat": norms of shape (B,); "group": per-example per-group norms of shape (B, G)
    norm_kind: ClassVar[str]

    def init_state(self) -> State:
        """Initial state (JSON-serializable)."""
        ...

    def begin_step(self, state: State, ctx: StepContext) -> State:
        """Public, data-independent state change before the step (schedules). No privacy cost."""
        ...

    def weights(self, norms: Tensor, state: State) -> Tensor:
        """Per-example weights, same shape as ``norms``; pure; ``+inf``/NaN norms get weight 0."""
        ...

    def sensitivity(self, state: State) -> float:
        """L2 bound on ``||w_i g_i||`` for any example under add/remove-one adjacency."""
        ...

    def noise_multiplier(self, state: State, base: float) -> float:
        """Noise multiplier of this step's gradient sum (``base`` unless the strategy schedules it)."""
        ...

    def planned_event(self, base: float, ctx: StepContext) -> DpEvent:
        """The event this strategy will emit at step ``ctx`` (unsampled), used for calibration."""
        ...

    def update(
        self, state: State, norms: Tensor, ctx: StepContext, release: Release
    ) -> tuple[State, tuple[DpEvent, ...]]:
        """Post-step state update; every private release made here is returned as an event."""
        ...

    def describe(self) -> dict[str, Any]:
        """The public hyper-parameters (stored with every run)."""
        ...


class StrategyBase:
    """Default implementations for stateless norm-based strategies (inherit, then override)."""

    name: ClassVar[str] = ""
    norm_kind: ClassVar[str] = "flat"
    #: what the strategy can do (``dpclip.clipping.capabilities``): a plain norm-based strategy
    capabilities: ClassVar[Capabilities] = Capabilities()

    def init_state(self) -> State:
        return {}

    def begin_step(self, state: State, ctx: StepContext) -> State:
        return state

    def noise_multiplier(self, state: State, base: float) -> float:
        return base

    def planned_event(self, base: float, ctx: StepContext) -> DpEvent:
        return GaussianEvent(base)

    def update(
        self, state: State, norms: Tensor, ctx: StepContext, release: Release
    ) -> tuple[State, tuple[DpEvent, ...]]:
        return state, ()

    def describe(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]


def finite_or_inf(norms: Tensor) -> Tensor:
    """Map NaN norms to +inf so that every weight function sends them to weight 0 (one fused op;
    +inf and -inf are kept as they are)."""
    return torch.nan_to_num(norms, nan=math.inf, posinf=math.inf, neginf=-math.inf)


def positive_finite(name: str, value: float, owner: str) -> float:
    """Validate a strictly positive finite hyper-parameter, naming it in the error."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{owner}: {name} must be a number, got {value!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{owner}: {name} must be a finite number > 0, got {value!r}")
    return v


def set_positive_finite(obj: Any, owner: str, *names: str, optional: Sequence[str] = ()) -> None:
    """Check the hyper-parameters ``names`` of the frozen dataclass ``obj`` with
    :func:`positive_finite` (naming ``owner`` in the error) and store them back as floats, in
    order; the ``optional`` ones may also be ``None`` (then left as they are)."""
    for name in (*names, *(n for n in optional if getattr(obj, n) is not None)):
        object.__setattr__(obj, name, positive_finite(name, getattr(obj, name), owner))

