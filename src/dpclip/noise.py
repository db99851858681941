"""Gaussian noise: the one place where a noise standard deviation meets random numbers.

Random generators are always explicit (design rule 9). ``make_generator(seed)`` gives a reproducible
(public, NOT secret) generator; ``make_generator(None)`` fills the generator's whole state from the
operating system's CSPRNG (``dpclip.randomness.secure_generator``), which is what private training
uses (through ``dpclip.randomness.PrivateRandomness``). What that does and does not cover
(Mersenne Twister, floating-point attacks): ``dpclip.randomness`` and docs/privacy.md.

No float32 tail cap. Gaussian samplers are Box-Muller transforms ``z = r cos(theta), r sin(theta)``
with radius ``r = sqrt(-2 ln u)`` and angle ``theta = 2 pi v`` (``u, v`` uniform). torch's float32
sampler uses 24-bit uniforms (CPU; 32-bit on CUDA), so its radius never exceeds
``sqrt(2 * 24 ln 2) = 5.77`` (6.66 on CUDA), and an output beyond that can only come from the
neighbour dataset that holds a worst-case example: about 9e-7 of delta per sampled step at noise
multiplier 1. dpclip's radius always comes from a 53-bit uniform: its cap is
``sqrt(2 * 53 ln 2) = 8.57`` sigma (:data:`TAIL_BOUND`), where the leak is about 1e-14 per step.
How (:func:`standard_normal`):

* CPU generator, any dtype but float64 (the usual float32 gradients), at least 2048 normals:
  dpclip's own Box-Muller transform, :func:`_box_muller_cpu`. The radius is computed in float64
  from a 53-bit uniform ``u = 1 - k 2**-53`` (``k`` 53 random bits: ``u`` in
  ``{2**-53, ..., 1}``, exact), the angle from a 24-bit float32 uniform with float32
  ``cos``/``sin``, and both outputs of each pair are used.
  The angle only rotates the radius between the two outputs, so a float32 angle does not cut the
  tail (``max |z| = TAIL_BOUND``, reached at ``k = 2**53 - 1, theta = 0``); what it sets is
  the output resolution (about 2**-24 relative: float32's own). Cost: about 2x a float32
  draw, against about 4-6x for a float64 draw (benchmarks/results/noise_cpu.md).
* float64 outputs, generators on a GPU, and draws of fewer than 2048 normals (there the
  sampler's fixed cost is larger): ``torch.randn`` in float64 on the generator's device (53-bit
  uniforms for radius and angle), then cast. On a GPU the draw is memory-bound and small
  either way.

Why this keeps the distribution exact, and the resolution: docs/privacy.md ("No float32 tail cap").
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
from torch import Tensor
from dpclip.randomness import secure_cuda_generator, secure_generator

__all__ = ["TAIL_BOUND", "add_gaussian_noise", "add_gaussian_noise_all", "make_generator",
           "noise_std", "standard_normal", "tail_bound"]

#: float64 draws (float64 outputs, GPU generators): 53-bit uniforms, radius at most sqrt(2*53 ln 2)
_DRAW_DTYPE = torch.float64


def tail_bound(uniform_bits: int) -> float:
    """The largest |z| a Box-Muller sampler on ``uniform_bits``-bit uniforms can output:
    ``sqrt(-2 ln 2**-bits)`` (the smallest nonzero ``1 - u`` is ``2**-bits``)."""
    return math.sqrt(2.0 * uniform_bits * math.log(2.0))


#: support bound of dpclip's noise draws (53-bit radius uniforms): about 8.57 sigma
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
    """``n`` i.i.d. standard normals from ``generator``, drawn on the generator's own device (no
    host round trip when it is the gradient's device), then cast to ``dtype`` on ``device``.

    Every draw has a 53-bit radius, so its support reaches :data:`TAIL_BOUND` (8.57), not
    float32's 5.77 (module docstring): a CPU generator and any ``dtype`` but float64 use
    :func:`_box_muller_cpu` (float64 radius, float32 angle: about 2x a float32 draw) from
    ``_SMALL_DRAW`` normals on; float64 outputs, GPU generators and smaller draws (where the
    sampler's fixed cost of a dozen tensor operations exceeds torch's float64 draw) use
    ``torch.randn`` in float64. A generator on another device than ``device`` (e.g. a CPU
    generator for CUDA gradients) draws where it lives and the result is copied. The values for
    a seed depend on ``n`` as a whole (a draw of ``m < n`` normals is not the first ``m`` of a
    draw of ``n``)."""
    n = int(n)
    if generator.device.type == "cpu" and dtype != torch.float64 and n >= _SMALL_DRAW:
        z = _box_muller_cpu(n, generator)
    else:
        z = torch.randn(n, generator=generator, dtype=_DRAW_DTYPE, device=generator.device)
    return z.to(device=device, dtype=dtype)


#: smaller CPU draws use torch's float64 sampler (faster below about 2048 normals on the CPU)
_SMALL_DRAW = 2048
#: pairs per block of :func:`_box_muller_cpu` (bounds its temporaries: 1.25 MiB per block)
_PAIRS_PER_BLOCK = 1 << 16
_TWO_PI = 2.0 * math.pi


def _box_muller_cpu(n: int, generator: torch.Generator) -> Tensor:
    """``n`` standard normals (float32, CPU) from a CPU ``generator``: Box-Muller with a float64
    radius and a float32 angle, drawn block by block (``_PAIRS_PER_BLOCK`` pairs at a time).

    Per block of ``k`` pairs: ``k`` float64 uniforms ``w = k' 2**-53`` (torch's CPU sampler: 53
    random bits ``k'``), then ``k`` float32 angles ``theta = 2 pi v`` (``v``: 24 random bits,
    the product rounded to float32); radius ``r = sqrt(-2 ln(1 - w))`` (``1 - w`` is exact and at
    least ``2**-53``; the logarithm in float64, ``-2 ln`` rounded to float32, then the square
    root); the block's outputs are ``r cos`` (``k`` values) then ``r sin`` (``k`` values, one
    fewer at an odd end of the draw). ``max |z| = TAIL_BOUND`` (``k' = 2**53 - 1``: all bits
    set, and ``v = 0``)."""
    out = torch.empty(n, dtype=torch.float32)
    pairs = min(_PAIRS_PER_BLOCK, (n + 1) // 2)
    w = torch.empty(pairs, dtype=torch.float64)
    v = torch.empty(pairs, dtype=torch.float32)
    r = torch.empty(pairs, dtype=torch.float32)
    pos = 0
    while pos < n:
        k = min(pairs, (n - pos + 1) // 2)
        m = min(k, n - pos - k)  # sines used: k, or k - 1 at an odd end
        wk, vk, rk = (w, v, r) if k == pairs else (w[:k], v[:k], r[:k])
        wk.uniform_(generator=generator)  # 53 bits: k' 2**-53, k' in [0, 2**53)
        vk.uniform_(0.0, _TWO_PI, generator=generator)  # 24 bits: 2 pi v' 2**-24 (float32)
        # -2 ln(1 - w): 1 - w exact, the logarithm in float64 (log1p is far slower), stored float32
        torch.mul(wk.neg_().add_(1.0).log_(), -2.0, out=rk).sqrt_()
        torch.mul(rk, torch.cos(vk), out=out[pos:pos + k])
        torch.mul(rk[:m], vk[:m].sin_(), out=out[pos + k:pos + k + m])
        pos += k + m
    return out


def add_gaussian_noise(value: Tensor, std: float, generator: torch.Generator,
                       draw_dtype: torch.dtype | None = None) -> Tensor:
    """``value + N(0, std^2 I)`` drawn from ``generator`` (a new tensor; ``value`` is unchanged).
    The normals have a 53-bit radius (no float32 tail cap: :func:`standard_normal`).
    ``draw_dtype``: the dtype the normals are drawn in (default ``value``'s): a float64 sum that
    is released as float32 (``dpclip.training.release``) draws float32 normals, as its float32
    sum did, and adds them in float64."""
    if std == 0.0:
        return value.clone()
    z = standard_normal(value.numel(), generator, draw_dtype or value.dtype, value.device)
    if z.dtype == value.dtype:
        return value + std * z.view(value.shape)
    return value.add(z.view(value.shape), alpha=std)


def add_gaussian_noise_all(
    values: Mapping[str, Tensor],
    std: float | Mapping[str, float],
    generator: torch.Generator,
    divide_by: float = 1.0,
    draw_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
) -> dict[str, Tensor]:
    """``(value + N(0, std^2 I)) / divide_by`` for every tensor of ``values`` (new tensors;
    ``values`` is not changed).

    ``std`` is one float, or a mapping ``{name: std}`` (per-layer noise: block ``h`` gets its own).
    ``draw_dtype``: the dtype the normals are drawn in (default: the tensors' own, float64 when
    they differ); ``out_dtype``: every result cast to it after the division (default: each
    tensor's dtype). The release passes float64 sums of float32 parameters with both float32:
    the noise is added to the uncast sum, and the cast is post-processing.

    One draw of ``sum(numel)`` standard normals from ``generator`` (:func:`standard_normal`),
    split in the mapping's order (tensors of mixed dtypes or devices: one std, a draw per tensor;
    per-tensor stds, one float64 draw cast per tensor); the additions and the division are made
    on one flat buffer, and the results are views of it (contiguous, shaped as the inputs; they
    share one storage without overlapping). The same distribution as calling
    :func:`add_gaussian_noise` per tensor, with 4 tensor operations per step instead of 4 per
    tensor (for small models the per-operation overhead is a large part of a step).
    """
    if not (math.isfinite(divide_by) and divide_by > 0):
        raise ValueError(f"divide_by must be finite and > 0, got {divide_by!r}")
    names = list(values)
    tensors = [values[n] for n in names]
    if not tensors:
        return {}
    if not isinstance(std, (int, float, dict)) and isinstance(std, Mapping):
        std = dict(std)  # (the release passes a float or a dict: no abc / typing code inside it)
    if isinstance(std, dict):  # per-tensor std (per-layer noise): one draw, scaled per tensor
        stds = [float(std[n]) for n in names]
        for v in stds:
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"noise std must be finite and >= 0, got {v!r}")
        total = sum(t.numel() for t in tensors)
        dtype, device = tensors[0].dtype, tensors[0].device
        if any(t.dtype != dtype or t.device != device for t in tensors):  # mixed: float64, cast
            dtype, device = _DRAW_DTYPE, generator.device
        z = standard_normal(total, generator, draw_dtype or dtype, device)
        out = []
        for c, t, sd in zip(z.split([t.numel() for t in tensors]), tensors, stds):
            c = c.to(device=t.device).view_as(t)
            out.append(t + sd * c.to(t.dtype) if c.dtype == t.dtype or draw_dtype is None
                       else t.add(c, alpha=sd))
        if divide_by != 1.0:
            torch._foreach_div_(out, divide_by)
        return _cast_all(dict(zip(names, out)), out_dtype)
    if std == 0.0:
        out = [t.clone() for t in tensors]
        if divide_by != 1.0:
            torch._foreach_div_(out, divide_by)
        return _cast_all(dict(zip(names, out)), out_dtype)
    dtype, device = tensors[0].dtype, tensors[0].device
    if any(t.dtype != dtype or t.device != device for t in tensors):
        return _cast_all({n: add_gaussian_noise(t, std, generator, draw_dtype) / divide_by
                          for n, t in zip(names, tensors)}, out_dtype)
    # one flat buffer: concatenate, add the draw, divide (3 operations on one tensor; the CPU
    # foreach kernels loop over the tensors, which costs more than the arithmetic for small
    # models), cast once, then hand out views of it, shaped as the inputs (the same values as per
    # tensor)
    sizes = [t.numel() for t in tensors]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    flat = flat.add_(standard_normal(flat.numel(), generator, draw_dtype or dtype, device),
                     alpha=std)
    if divide_by != 1.0:
        flat.div_(divide_by)
    if out_dtype is not None and out_dtype != flat.dtype:
        flat = flat.to(out_dtype)
    return {n: c.view(tuple(t.shape))
            for n, c, t in zip(names, flat.split_with_sizes(sizes), tensors)}


def _cast_all(values: dict[str, Tensor], dtype: torch.dtype | None) -> dict[str, Tensor]:
    """``values`` cast to ``dtype`` (``None``: as they are)."""
    if dtype is None:
        return values
    return {n: v if v.dtype == dtype else v.to(dtype) for n, v in values.items()}
