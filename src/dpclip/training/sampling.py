"""Batch samplers. Each sampler names the DP event and the neighbouring relation it supports, so the
trainer takes the event from the sampler and the accountant can never disagree with the data.

* ``PoissonSampler``: every example joins the batch independently with probability
  ``q = expected_batch_size / dataset_size`` (variable batch size; an empty batch is a valid step).
  Adjacency add/remove-one; the clipped sum has sensitivity ``C`` (factor 1).
* ``FixedSizeSampler``: every step draws a fresh uniformly random subset of exactly ``batch_size``
  examples (without replacement inside the batch). Adjacency replace-one; the clipped sum has
  sensitivity ``2 C`` (factor 2). This is what the sampled-without-replacement RDP bound covers.
  An epoch-wise shuffle (each example exactly once per epoch) is a different mechanism whose
  amplification is not covered by either event, so dpclip does not offer it with an amplified epsilon
  (anchors P1: never report a Poisson epsilon for shuffled batches).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor

from dpclip.events import (
    ADD_REMOVE,
    REPLACE_ONE,
    DpEvent,
    PoissonSampledEvent,
    SampledWithoutReplacementEvent,
)

__all__ = ["FixedSizeSampler", "PoissonSampler", "Sampler", "SAMPLERS", "make_sampler"]

_TWO53 = 2**53


@runtime_checkable
class Sampler(Protocol):
    name: ClassVar[str]
    adjacency: ClassVar[str]
    #: multiplier of a strategy's (add/remove) sensitivity under this sampler's adjacency
    sensitivity_factor: ClassVar[int]
    dataset_size: int

    @property
    def expected_batch_size(self) -> float: ...

    @property
    def sample_rate(self) -> float: ...

    @property
    def steps_per_epoch(self) -> int: ...

    def sample(self, generator: torch.Generator) -> Tensor: ...

    def step_event(self, inner: DpEvent) -> DpEvent: ...


def _check_sizes(owner: str, dataset_size: int, batch_size: float) -> None:
    if not (isinstance(dataset_size, int) and dataset_size > 0):
        raise ValueError(f"{owner}: dataset_size must be a positive int, got {dataset_size!r}")
    if not (math.isfinite(batch_size) and 0 < batch_size <= dataset_size):
        raise ValueError(
            f"{owner}: batch_size must be in (0, dataset_size={dataset_size}], got {batch_size!r}; "
            "lower batch_size (CLI --batch-size)"
        )


@dataclass(frozen=True)
class PoissonSampler:
    """Poisson (Bernoulli) subsampling with rate ``expected_batch_size / dataset_size``."""

    name: ClassVar[str] = "poisson"
    adjacency: ClassVar[str] = ADD_REMOVE
    sensitivity_factor: ClassVar[int] = 1

    dataset_size: int
    batch_size: float  #: the EXPECTED batch size (public)

    def __post_init__(self) -> None:
        _check_sizes("PoissonSampler", self.dataset_size, self.batch_size)

    @property
    def expected_batch_size(self) -> float:
        return float(self.batch_size)

    @property
    def sample_rate(self) -> float:
        return float(self.batch_size) / self.dataset_size

    @property
    def steps_per_epoch(self) -> int:
        return max(1, round(self.dataset_size / self.batch_size))

    @property
    def inclusion_threshold(self) -> int:
        """``floor(q * 2**53)``: an example joins when its uniform 53-bit integer is below it."""
        return math.floor(self.sample_rate * _TWO53)  # exact: scaling by a power of 2

    @property
    def inclusion_probability(self) -> float:
        """The exact probability with which :meth:`sample` includes an example:
        ``floor(q 2**53) / 2**53``, in ``(q - 2**-53, q]``. Never above the accounted ``q``, so the
        accountant's Poisson event (rate ``q``) is an upper bound (epsilon grows with ``q``)."""
        return self.inclusion_threshold / _TWO53

    def sample(self, generator: torch.Generator) -> Tensor:
        """Indices of one batch (sorted); may be empty.

        Each example draws a uniform integer in ``[0, 2**53)`` and joins when it is below
        ``floor(q 2**53)``: inclusion probability exactly :attr:`inclusion_probability` <= q.
        (A float32 uniform lies on a 2**-24 grid, which rounds the inclusion probability UP by up
        to 6e-8: that would sample more often than accounted.)"""
        u = torch.randint(0, _TWO53, (self.dataset_size,), generator=generator, dtype=torch.int64,
                          device=generator.device)
        # drawn on the generator's device (the GPU's own generator in a CUDA run: no mask crosses
        # PCIe). nonzero() synchronises with the host on CUDA: the batch's rows must be gathered
        # into tensors whose shape is the realised (private) batch size; that size stays inside
        # the process, is never logged and never divides (the step divides by the expected size)
        return (u < self.inclusion_threshold).nonzero(as_tuple=True)[0]

    def step_event(self, inner: DpEvent) -> DpEvent:
        return PoissonSampledEvent(self.sample_rate, inner)


@dataclass(frozen=True)
class FixedSizeSampler:
    """A fresh uniform random subset of exactly ``batch_size`` examples at every step."""

    name: ClassVar[str] = "fixed-size"
    adjacency: ClassVar[str] = REPLACE_ONE
    sensitivity_factor: ClassVar[int] = 2

    dataset_size: int
    batch_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int):
            raise ValueError(
                f"FixedSizeSampler: batch_size must be an int, got {self.batch_size!r}"
            )
        _check_sizes("FixedSizeSampler", self.dataset_size, self.batch_size)

    @property
    def expected_batch_size(self) -> float:
        return float(self.batch_size)

    @property
    def sample_rate(self) -> float:
        return self.batch_size / self.dataset_size

    @property
    def steps_per_epoch(self) -> int:
        return max(1, round(self.dataset_size / self.batch_size))

    def sample(self, generator: torch.Generator) -> Tensor:
        idx = torch.randperm(self.dataset_size, generator=generator,
                             device=generator.device)[: self.batch_size]
        return idx.sort().values

    def step_event(self, inner: DpEvent) -> DpEvent:
        return SampledWithoutReplacementEvent(self.dataset_size, self.batch_size, inner)


SAMPLERS: dict[str, type] = {"poisson": PoissonSampler, "fixed-size": FixedSizeSampler}


def make_sampler(name: str, dataset_size: int, batch_size: float) -> Sampler:
    """Build a sampler by name (``poisson`` or ``fixed-size``)."""
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampling {name!r}; valid: {', '.join(SAMPLERS)}")
    if name == "fixed-size":
        if float(batch_size) != int(batch_size):
            raise ValueError(f"fixed-size sampling needs an integer batch_size, got {batch_size}")
        return FixedSizeSampler(dataset_size, int(batch_size))
    return PoissonSampler(dataset_size, float(batch_size))
