"""The one door of every private release: where a noise standard deviation meets data.

    noisy    <- sum + N(0, (z s)^2)          s: the sum's L2 sensitivity (one value or per tensor)
    released <- noisy / divisor              a PUBLIC constant (expected batch size, units, users)
                cast to the parameters' dtype  (out_dtypes: the sum reaches the noise in float64)
    state'   <- strategy.update(state, norms, ctx, Releaser)   every extra release (a count, a
                                                               mean) comes back through here
    event    <- sampler.step_event(compose(mechanism, *extra)) the typed event of the whole step

:func:`release` is called by :func:`dpclip.training.step.dp_step` and
:func:`~dpclip.training.step.bound_step` (engine + release) and by the federated aggregator
(:meth:`dpclip.federated.aggregator.DPAggregator.aggregate`: weighted client deltas + release).
:class:`Releaser` is the ``Release`` callback handed to strategies for their own statistics. No
other module of ``src/dpclip`` draws Gaussian noise (``tests/core/test_release.py`` checks it on
the source), so whoever changes how noise is drawn (the generator, the dtype, a sharded draw)
changes it here.

Privacy: the noise std is ``noise_multiplier * sensitivity`` on the SUM (``dpclip.noise.noise_std``
validates both), drawn from the secret device generator of ``dpclip.randomness`` with a 53-bit
Box-Muller radius (``dpclip.noise.standard_normal``: no float32 tail cap), and the noisy sum is
divided once by a public constant: never by the realised batch size. The event returned is the
one the caller checks against its plan (:meth:`dpclip.training.plan.Plan.check_emitted`) and
records in its ledger.

Two ways to draw, kept so that results stay bit for bit what they were: ``per_tensor=False`` (the
flat-clipping step: one draw for all tensors, added on one flat buffer,
``dpclip.noise.add_gaussian_noise_all``), ``per_tensor=True`` (the bound step and the
aggregator: one draw per tensor, ``dpclip.noise.add_gaussian_noise``). Both add the same
distribution.

Distributed runs (``shard=``, a :class:`dpclip.training.noise_shard.NoiseShard`): ``sums`` are
this rank's LOCAL clipped sums; the rank adds ``N(0, (z s)^2)`` on its own block of coordinates
only (``standard_normal`` from its own stream), the ranks' contributions are all-reduced
(so every coordinate carries exactly one draw, made by the rank that owns it), and the result is
divided once. The strategies' statistics are noised the same way (``Releaser``). Which rank draws
what, and why the sum has std ``z s`` exactly: :mod:`dpclip.training.noise_shard`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

import torch
from torch import Tensor

from dpclip.clipping.base import ClippingStrategy, State, StepContext
from dpclip.events import ComposedEvent, DpEvent, GaussianEvent
from dpclip.engine.isolation import collector_paused
from dpclip.noise import add_gaussian_noise, add_gaussian_noise_all, noise_std, standard_normal

__all__ = ["NoiseShardLike", "Released", "Releaser", "release"]


class NoiseShardLike(Protocol):
    """What a sharded release asks of its shard (:class:`dpclip.training.noise_shard.NoiseShard`):
    which coordinates of a ``total``-coordinate release this process noises, from which
    generator, and the SUM of the processes' contributions (in place)."""

    def draws(self, total: int, generator: torch.Generator
              ) -> list[tuple[int, int, torch.Generator]]: ...

    def all_reduce_(self, t: Tensor) -> None: ...


class Releaser:
    """The ``Release`` callback handed to strategies (``strategy.update(..., release)``): adds
    ``N(0, (z * sensitivity * k)^2)`` to ``value`` from the step's noise generator and returns the
    noisy value with its typed ``GaussianEvent(z)``. ``k`` is the sampler's (or unit's)
    sensitivity factor: 2 under replace-one adjacency. ``shard`` (a distributed run): ``value``
    is the same global statistic on every rank; each rank draws the noise of its own coordinates
    only, the noise vector is all-reduced (each coordinate: one draw plus exact zeros) and added
    on every rank."""

    def __init__(self, generator: torch.Generator, sensitivity_factor: int,
                 shard: NoiseShardLike | None = None) -> None:
        self.generator = generator
        self.factor = sensitivity_factor
        self.shard = shard

    def __call__(
        self, value: Tensor, sensitivity: float, noise_multiplier: float
    ) -> tuple[Tensor, DpEvent]:
        if not (sensitivity > 0):
            raise ValueError(f"release: sensitivity must be > 0, got {sensitivity!r}")
        std = noise_std(noise_multiplier, sensitivity * self.factor)
        if self.shard is None:
            noisy = add_gaussian_noise(value, std, self.generator)
        else:
            noise = torch.zeros(value.numel(), dtype=value.dtype, device=value.device)
            if std != 0.0:
                for lo, hi, gen in self.shard.draws(value.numel(), self.generator):
                    if hi > lo:
                        noise[lo:hi] = std * standard_normal(hi - lo, gen, value.dtype,
                                                             value.device)
            self.shard.all_reduce_(noise)
            noisy = value + noise.view(value.shape)
        return noisy, GaussianEvent(noise_multiplier)


@dataclass
class Released:
    """What one release gives back: the noisy sums divided by the divisor, the strategy state
    after its update, the step's typed event and the noise std on the SUM (one value, or one per
    tensor)."""

    values: dict[str, Tensor]
    state: State
    event: DpEvent
    std: float | dict[str, float]


def release(
    sums: Mapping[str, Tensor],
    *,
    noise_multiplier: float,
    sensitivity: float | Mapping[str, float],
    divisor: float,
    generator: torch.Generator,
    strategy: ClippingStrategy,
    state: State,
    norms: Tensor,
    ctx: StepContext,
    sampler: Any,
    sensitivity_factor: int,
    mechanism: DpEvent | None = None,
    noise_scale: float = 1.0,
    per_tensor: bool = False,
    untransform: bool = False,
    shard: NoiseShardLike | None = None,
    out_dtypes: Mapping[str, torch.dtype] | None = None,
) -> Released:
    """Release ``sums`` (clipped sums, unnoised) once: noise, divide, update, event.

    Args:
        sums: ``{name: tensor}``, the clipped (weighted) sum of the step or round; not changed.
        noise_multiplier: ``z`` of this release (already the strategy's, e.g. Theorem 1's split).
        sensitivity: the sum's L2 sensitivity ``s`` (the sensitivity factor included), or a
            mapping ``{name: s_name}`` for per-block noise (per-layer noise, Lip-DP-SGD's
            per-parameter certificate).
        divisor: the PUBLIC constant the noisy sum is divided by (expected batch size, expected
            number of units or users, expected total weight); never a realised count.
        generator: the secret noise generator (``PrivateRandomness.noise``).
        strategy, state, norms, ctx: ``strategy.update(state, norms, ctx, Releaser)`` after the
            noise (``state`` is the state the sum was clipped with; ``norms`` are the per-example
            norms, NON-PRIVATE, which the strategy releases only through the ``Releaser``).
        sampler: its ``step_event`` wraps the step's inner event (sampling amplification).
        sensitivity_factor: ``k`` for the strategy's own releases (2 under replace-one / units).
        mechanism: the event of the sum's release (default ``GaussianEvent(z)``; the bound step
            passes its strategy's ``step_event(z)``).
        noise_scale: public multiplier ``>= 1`` of the std (P-GRAD's ``noise_scale``); the event
            stays ``mechanism`` (a conservative bound).
        per_tensor: one draw per tensor instead of one joint draw (see the module docstring).
        untransform: P-GRAD: map the released mean back with ``strategy.untransform(values,
            state, std / divisor)`` (post-processing) before the update.
        shard: a distributed run's :class:`~dpclip.training.noise_shard.NoiseShard` (``None``:
            one process). ``sums`` are then this rank's LOCAL sums and ``generator`` this rank's
            own stream (``shard.generator(step)``); the values returned are the global ones,
            identical on every rank (module docstring). Not with ``untransform``.
        out_dtypes: ``{name: dtype}``, the dtype each released value is cast to AFTER the noise
            and the division (post-processing); ``None``: the sums' own. ``dp_step`` hands the
            engines' float64 sums of float32 (and half) parameters here uncast
            (``dpclip.engine._common.wide_sums``): a cast before the noise rounds the sum on the
            grid of the whole batch's sum (one unit in the last place of ``||S||``, reached by a
            designed batch: 1.11 C at B = 2^20). The normals are then drawn in the sum dtype of
            the released dtype (float32 for float32 and half parameters: the same draws as a
            float32 sum's) and added in float64.

    Raises ``ValueError`` for a non-finite or negative multiplier, sensitivity or divisor.
    """
    # (a per-tensor sensitivity as a plain dict before the window: inside, isinstance(..,
    # Mapping) ran typing's and abc's Python, which a forward could replace: the noise zeroed
    # through make_private, ninety-second hostile review)
    if not isinstance(sensitivity, (int, float, dict)) and isinstance(sensitivity, Mapping):
        sensitivity = dict(sensitivity)
    with collector_paused():  # (a collector callback or cyclic finalizer scaled the sums before
        # the noise: 1000 C, forty-second hostile review)
        return _release(sums, noise_multiplier, sensitivity, divisor, generator, strategy, state,
                        norms, ctx, sampler, sensitivity_factor, mechanism, noise_scale,
                        per_tensor, untransform, shard,
                        None if out_dtypes is None else dict(out_dtypes))


def _release(sums: Mapping[str, Tensor], noise_multiplier: float,
             sensitivity: float | Mapping[str, float], divisor: float,
             generator: torch.Generator, strategy: ClippingStrategy, state: State, norms: Tensor,
             ctx: StepContext, sampler: Any, sensitivity_factor: int, mechanism: DpEvent | None,
             noise_scale: float, per_tensor: bool, untransform: bool,
             shard: NoiseShardLike | None,
             out_dtypes: dict[str, torch.dtype] | None = None) -> Released:
    z = noise_multiplier
    draw, out = _draw_and_out(sums, out_dtypes)
    std: float | dict[str, float]
    if isinstance(sensitivity, dict):
        std = {n: noise_std(z, sensitivity[n]) for n in sums}
    else:
        std = noise_std(z, sensitivity) * noise_scale
    if shard is not None:
        if untransform:
            raise ValueError("release: a sharded (distributed) release cannot untransform "
                             "(P-GRAD strategies train in one process)")
        values = _sharded_noisy_sums(sums, std, generator, shard, divisor, draw)
    elif per_tensor:
        values = {n: add_gaussian_noise(
            v, std[n] if isinstance(std, dict) else std, generator, draw) / divisor
            for n, v in sums.items()}
    else:
        values = add_gaussian_noise_all(sums, std, generator, divide_by=divisor,
                                        draw_dtype=draw, out_dtype=out)
    if out_dtypes is not None:  # (the cast of the noisy values: post-processing)
        values = {n: v if n not in out_dtypes or v.dtype == out_dtypes[n]
                  else v.to(out_dtypes[n]) for n, v in values.items()}
    if untransform:  # back to parameter space: post-processing of the released mean
        assert not isinstance(std, dict)
        values, state = strategy.untransform(values, state, std / divisor)  # type: ignore[attr-defined]
    new_state, extra = strategy.update(state, norms, ctx,
                                       Releaser(generator, sensitivity_factor, shard))
    inner = GaussianEvent(z) if mechanism is None else mechanism
    if extra:
        inner = ComposedEvent((inner, *extra))
    return Released(values=values, state=new_state, event=sampler.step_event(inner), std=std)


def _draw_and_out(sums: Mapping[str, Tensor], out_dtypes: dict[str, torch.dtype] | None
                  ) -> tuple[torch.dtype | None, torch.dtype | None]:
    """``(draw dtype, common out dtype)`` of a release with ``out_dtypes``: the normals are
    drawn in the released dtypes' sum dtype (float32 for float32 and half; float64 when they
    differ), ``None`` for the sums' own; the common out dtype when every value is cast to one."""
    if out_dtypes is None:
        return None, None
    outs = {out_dtypes.get(n, v.dtype) for n, v in sums.items()}
    if len(outs) != 1:
        return (torch.float64 if any(v.dtype == torch.float64 for v in sums.values())
                else None), None
    (one,) = outs
    return (torch.float32 if one in (torch.float16, torch.bfloat16) else one), one


def _sharded_noisy_sums(sums: Mapping[str, Tensor], std: float | dict[str, float],
                        generator: torch.Generator, shard: NoiseShardLike,
                        divisor: float, draw: torch.dtype | None = None) -> dict[str, Tensor]:
    """``(all-reduce(local sums + this rank's noise shard)) / divisor`` (the module docstring):
    the coordinates are numbered over the tensors of ``sums`` in their order; the rank draws
    ``shard.draws(total)``'s blocks (``standard_normal`` in the tensors' dtype; float64, cast to
    each tensor's dtype, when their dtypes or devices differ) and scales each coordinate by its
    tensor's std. New tensors; ``sums`` is not changed."""
    if not (math.isfinite(divisor) and divisor > 0):
        raise ValueError(f"divide_by must be finite and > 0, got {divisor!r}")
    names = list(sums)
    tensors = [sums[n] for n in names]
    stds = [float(std[n]) if isinstance(std, dict) else float(std) for n in names]
    sizes = [t.numel() for t in tensors]
    total = sum(sizes)
    dtype, device = (tensors[0].dtype, tensors[0].device) if tensors else (None, None)
    flat_ok = all(t.dtype == dtype and t.device == device for t in tensors)
    # one buffer per dtype/device class: the whole flat vector (the usual case) or per tensor
    bufs = [torch.cat([t.reshape(-1) for t in tensors])] if tensors and flat_ok \
        else [t.detach().reshape(-1).clone() for t in tensors]
    if any(sd != 0.0 for sd in stds):
        for lo, hi, gen in shard.draws(total, generator):
            if hi <= lo:
                continue
            z = standard_normal(hi - lo, gen, draw or (dtype if flat_ok else torch.float64),
                                device if flat_ok else gen.device)
            offset = 0
            for i, (size, sd) in enumerate(zip(sizes, stds)):
                a, b = max(lo, offset), min(hi, offset + size)  # this tensor's part of the block
                if a < b and sd != 0.0:
                    buf, base = (bufs[0], 0) if flat_ok else (bufs[i], offset)
                    buf[a - base:b - base].add_(
                        z[a - lo:b - lo].to(device=buf.device,
                                            dtype=buf.dtype if draw is None else z.dtype),
                        alpha=sd)
                offset += size
    for buf in bufs:
        shard.all_reduce_(buf)
        buf.div_(divisor)
    if flat_ok:
        return {n: c.view(tuple(t.shape))
                for n, c, t in zip(names, bufs[0].split_with_sizes(sizes), tensors)} \
            if tensors else {}
    return {n: b.view(tuple(t.shape)) for n, b, t in zip(names, bufs, tensors)}
