"""Gaussian noise: the one place where a noise standard deviation meets random numbers.

Random generators are always explicit (design rule 9). ``make_generator(seed)`` gives a reproducible
generator; ``make_generator(None)`` seeds it from the operating system's CSPRNG (``secrets``), which
is what a deployment should use. (torch's generator is a Mersenne Twister, not a CSPRNG: the OS seed
makes its output unpredictable to an outsider but not cryptographically strong; floating-point
attacks on Gaussian sampling are out of scope for this research library, see anchors P11.)
"""

from __future__ import annotations

import math
import secrets

import torch
from torch import Tensor

__all__ = ["add_gaussian_noise", "make_generator", "noise_std"]


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``seed``, or from the OS when ``seed`` is None."""
    g = torch.Generator()
    g.manual_seed(secrets.randbits(63) if seed is None else int(seed))
    return g


def noise_std(noise_multiplier: float, sensitivity: float) -> float:
    """``noise_multiplier * sensitivity``, validated (both finite and >= 0)."""
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier!r}")
    if not (math.isfinite(sensitivity) and sensitivity >= 0):
        raise ValueError(f"sensitivity must be finite and >= 0, got {sensitivity!r}")
    return float(noise_multiplier) * float(sensitivity)


def add_gaussian_noise(value: Tensor, std: float, generator: torch.Generator) -> Tensor:
    """``value + N(0, std^2 I)`` drawn from ``generator`` (a new tensor; ``value`` is unchanged)."""
    if std == 0.0:
        return value.clone()
    z = torch.randn(value.shape, generator=generator, dtype=value.dtype, device="cpu")
    return value + std * z.to(value.device)
