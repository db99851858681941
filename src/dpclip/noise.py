"""Gaussian noise: the one place where a noise standard deviation meets random numbers.

Random generators are always explicit (design rule 9). ``make_generator(seed)`` gives a reproducible
(public, NOT secret) generator; ``make_generator(None)`` fills the generator's whole state from the
operating system's CSPRNG (``dpclip.randomness.secure_generator``), which is what private training
uses (through ``dpclip.randomness.PrivateRandomness``). What that does and does not cover
(Mersenne Twister, floating-point attacks): ``dpclip.randomness`` and docs/privacy.md.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
from torch import Tensor

__all__ = ["add_gaussian_noise", "add_gaussian_noise_all", "make_generator", "noise_std"]


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``seed`` (public), or with its whole state from OS
    entropy when ``seed`` is None (``torch.Generator.manual_seed`` keeps only 32 bits of a seed, so
    an OS seed passed through it would allow only 2**32 streams)."""
    if seed is None:
        from dpclip.randomness import secure_generator

        return secure_generator()
    g = torch.Generator()
    g.manual_seed(int(seed))
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


def add_gaussian_noise_all(
    values: Mapping[str, Tensor],
    std: float | Mapping[str, float],
    generator: torch.Generator,
    divide_by: float = 1.0,
) -> dict[str, Tensor]:
    """``(value + N(0, std^2 I)) / divide_by`` for every tensor of ``values`` (new tensors;
    ``values`` is not changed).

    ``std`` is one float, or a mapping ``{name: std}`` (per-layer noise: block ``h`` gets its own).

    One draw of ``sum(numel)`` standard normals from ``generator`` (on the CPU, so a seeded run
    gives the same noise on every device), split in the mapping's order; the additions and the
    division are made on one flat buffer, and the results are views of it (contiguous, shaped as
    the inputs; they share one storage without overlapping). The same distribution as calling
    :func:`add_gaussian_noise` per tensor, with 4 tensor operations per step instead of 4 per
    tensor (for small models the per-operation overhead is a large part of a step).
    """
    if not (math.isfinite(divide_by) and divide_by > 0):
        raise ValueError(f"divide_by must be finite and > 0, got {divide_by!r}")
    names = list(values)
    tensors = [values[n] for n in names]
    if not tensors:
        return {}
    if isinstance(std, Mapping):  # per-tensor std (per-layer noise): one draw, scaled per tensor
        stds = [float(std[n]) for n in names]
        for v in stds:
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"noise std must be finite and >= 0, got {v!r}")
        total = sum(t.numel() for t in tensors)
        z = torch.randn(total, generator=generator, dtype=tensors[0].dtype, device="cpu")
        out = []
        for c, t, sd in zip(z.split([t.numel() for t in tensors]), tensors, stds):
            out.append(t + sd * c.to(device=t.device, dtype=t.dtype).view_as(t))
        if divide_by != 1.0:
            torch._foreach_div_(out, divide_by)
        return dict(zip(names, out))
    if std == 0.0:
        out = [t.clone() for t in tensors]
        if divide_by != 1.0:
            torch._foreach_div_(out, divide_by)
        return dict(zip(names, out))
    dtype, device = tensors[0].dtype, tensors[0].device
    if any(t.dtype != dtype or t.device != device for t in tensors):
        return {n: add_gaussian_noise(t, std, generator) / divide_by
                for n, t in zip(names, tensors)}
    # one flat buffer: concatenate, add the draw, divide (3 operations on one tensor; the CPU
    # foreach kernels loop over the tensors, which costs more than the arithmetic for small
    # models), then hand out views of it, shaped as the inputs (the same values as per tensor)
    sizes = [t.numel() for t in tensors]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    z = torch.randn(flat.numel(), generator=generator, dtype=dtype, device="cpu")
    flat = flat.add_(z.to(device), alpha=std)
    if divide_by != 1.0:
        flat.div_(divide_by)
    return {n: c.view(tuple(t.shape))
            for n, c, t in zip(names, flat.split_with_sizes(sizes), tensors)}
