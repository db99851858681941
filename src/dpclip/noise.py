"""Gaussian noise: the one place where a noise standard deviation meets random numbers.

Random generators are always explicit (design rule 9). ``make_generator(seed)`` gives a reproducible
(public, NOT secret) generator; ``make_generator(None)`` fills the generator's whole state from the
operating system's CSPRNG (``dpclip.randomness.secure_generator``), which is what private training
uses (through ``dpclip.randomness.PrivateRandomness``). What that does and does not cover
(Mersenne Twister, floating-point attacks): ``dpclip.randomness`` and docs/privacy.md.

No tail cap. Every standard normal is drawn in float64 (:func:`standard_normal`), on the
generator's device, and only then cast to the gradient's dtype. torch's samplers are Box-Muller
transforms of uniforms: a float32 draw uses 24-bit uniforms (CPU; 32-bit on CUDA), so its radius
``sqrt(-2 ln u)`` never exceeds ``sqrt(2 * 24 ln 2) = 5.77`` (6.66 on CUDA), and an output beyond
that can only come from the neighbour dataset that holds a worst-case example: about 9e-7 of delta
per sampled step at noise multiplier 1. Float64 draws use 53-bit uniforms: the cap moves to
``sqrt(2 * 53 ln 2) = 8.57`` sigma (:data:`TAIL_BOUND`), where the leak is about 1e-14 per step.
The cost: about 3-4x a float32 draw on the CPU (benchmarks/results/noise_cpu.md); on a GPU the draw
is memory-bound and small either way.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
from torch import Tensor
from dpclip.randomness import secure_cuda_generator, secure_generator

__all__ = ["TAIL_BOUND", "add_gaussian_noise", "add_gaussian_noise_all", "make_generator",
           "noise_std", "standard_normal", "tail_bound"]

#: float64 draws: the uniforms have 53 bits, so Box-Muller's radius is at most sqrt(2*53 ln 2)
_DRAW_DTYPE = torch.float64


def tail_bound(uniform_bits: int) -> float:
    """The largest |z| a Box-Muller sampler on ``uniform_bits``-bit uniforms can output:
    ``sqrt(-2 ln 2**-bits)`` (the smallest nonzero ``1 - u`` is ``2**-bits``)."""
    return math.sqrt(2.0 * uniform_bits * math.log(2.0))


#: support bound of dpclip's noise draws (float64, 53-bit uniforms): about 8.57 sigma
TAIL_BOUND = tail_bound(53)


def make_generator(seed: int | None, device: "torch.device | str" = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` (default the CPU) seeded with ``seed`` (public), or with
    its whole state from OS entropy when ``seed`` is None (``torch.Generator.manual_seed`` keeps
    only 32 bits of a seed on the CPU, so an OS seed passed through it would allow only 2**32
    streams; on CUDA the Philox key and offset come from ``os.urandom``: dpclip.randomness)."""
    dev = torch.device(device)
    if seed is None:
        return secure_cuda_generator(dev) if dev.type == "cuda" else secure_generator()
    g = torch.Generator(device=dev)
    g.manual_seed(int(seed))
    return g


def noise_std(noise_multiplier: float, sensitivity: float) -> float:
    """``noise_multiplier * sensitivity``, validated (both finite and >= 0)."""
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier!r}")
    if not (math.isfinite(sensitivity) and sensitivity >= 0):
        raise ValueError(f"sensitivity must be finite and >= 0, got {sensitivity!r}")
    return float(noise_multiplier) * float(sensitivity)


def standard_normal(n: int, generator: torch.Generator, dtype: torch.dtype,
                    device: "torch.device | str") -> Tensor:
    """``n`` i.i.d. standard normals from ``generator``: drawn in float64 on the generator's own
    device (no host round trip when it is the gradient's device), then cast to ``dtype`` on
    ``device``. The float64 draw is what removes the float32 tail cap (module docstring).
    A generator on another device than ``device`` (e.g. a CPU generator for CUDA gradients)
    draws where it lives and the result is copied."""
    z = torch.randn(int(n), generator=generator, dtype=_DRAW_DTYPE, device=generator.device)
    return z.to(device=device, dtype=dtype)


def add_gaussian_noise(value: Tensor, std: float, generator: torch.Generator) -> Tensor:
    """``value + N(0, std^2 I)`` drawn from ``generator`` (a new tensor; ``value`` is unchanged).
    The normals are drawn in float64, then cast (:func:`standard_normal`)."""
    if std == 0.0:
        return value.clone()
    z = standard_normal(value.numel(), generator, value.dtype, value.device)
    return value + std * z.view(value.shape)


def add_gaussian_noise_all(
    values: Mapping[str, Tensor],
    std: float | Mapping[str, float],
    generator: torch.Generator,
    divide_by: float = 1.0,
) -> dict[str, Tensor]:
    """``(value + N(0, std^2 I)) / divide_by`` for every tensor of ``values`` (new tensors;
    ``values`` is not changed).

    ``std`` is one float, or a mapping ``{name: std}`` (per-layer noise: block ``h`` gets its own).

    One draw of ``sum(numel)`` standard normals from ``generator`` (float64 on the generator's
    device, then cast: :func:`standard_normal`), split in the mapping's order; the additions and the
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
        z = torch.randn(total, generator=generator, dtype=_DRAW_DTYPE, device=generator.device)
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
    flat = flat.add_(standard_normal(flat.numel(), generator, dtype, device), alpha=std)
    if divide_by != 1.0:
        flat.div_(divide_by)
    return {n: c.view(tuple(t.shape))
            for n, c, t in zip(names, flat.split_with_sizes(sizes), tensors)}
