"""Builders for the DP event of one DP-SGD step.

One DP-SGD step releases the noisy clipped sum (a Gaussian with multiplier ``z`` relative to the
sensitivity under the run's adjacency) plus, for some strategies, auxiliary Gaussian queries on
the same batch (``extra``, e.g. Andrew et al.'s noisy clipped count), all on a sampled batch:

* Poisson sampling with rate ``q`` (add/remove-one): ``PoissonSampledEvent(q, inner)``;
* fixed-size sampling of ``batch_size`` out of ``dataset_size`` without replacement
  (replace-one, the clipped sum has sensitivity ``2C``, so the noise std must be ``2 z C``):
  ``SampledWithoutReplacementEvent(dataset_size, batch_size, inner)``;

where ``inner = GaussianEvent(z)`` or ``ComposedEvent((GaussianEvent(z), *extra))``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dpclip.accounting.ledger import is_dp_event
from dpclip.events import (
    ComposedEvent,
    DpEvent,
    GaussianEvent,
    PoissonSampledEvent,
    SampledWithoutReplacementEvent,
    SelfComposedEvent,
)

__all__ = ["SAMPLING_SCHEMES", "dpsgd_event", "dpsgd_step_event"]

#: Sampling schemes understood by the DP-SGD helpers.
SAMPLING_SCHEMES = ("poisson", "without-replacement")


def check_noise_multiplier(z: float, name: str = "noise_multiplier") -> float:
    if isinstance(z, bool) or not isinstance(z, (int, float)) or not math.isfinite(z) or z < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {z!r}")
    return float(z)


def check_sample_rate(q: float, name: str = "sample_rate") -> float:
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 < q <= 1:
        raise ValueError(
            f"{name} must be in (0, 1] (expected batch size / dataset size), got {q!r}"
        )
    return float(q)


def _check_size(x: object, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ValueError(f"{name} must be an int >= 1, got {x!r}")
    return x


def dpsgd_step_event(
    noise_multiplier: float,
    sample_rate: float | None = None,
    *,
    dataset_size: int | None = None,
    batch_size: int | None = None,
    sampling: str = "poisson",
    extra: Sequence[DpEvent] = (),
) -> DpEvent:
    """The DP event of one DP-SGD step.

    Args:
        noise_multiplier: ``z``: noise std / sensitivity of the clipped sum (>= 0).
        sample_rate: Poisson rate ``q`` in (0, 1]. For Poisson it may instead be derived from
            ``batch_size / dataset_size``; for without-replacement it is optional and, if
            given, must equal ``batch_size / dataset_size``.
        dataset_size, batch_size: ``N`` and ``B``; required for ``"without-replacement"``.
        sampling: ``"poisson"`` (add/remove-one) or ``"without-replacement"`` (replace-one).
        extra: further unsampled events run on the same batch (Gaussian queries); a sampled
            event here is an error (sampling happens once per step).

    Returns ``PoissonSampledEvent(q, inner)`` or ``SampledWithoutReplacementEvent(N, B, inner)``
    with ``inner = GaussianEvent(z)`` when ``extra`` is empty, else
    ``ComposedEvent((GaussianEvent(z), *extra))``.
    """
    z = check_noise_multiplier(noise_multiplier)
    extra = tuple(extra)
    for i, e in enumerate(extra):
        if not is_dp_event(e):
            raise TypeError(f"extra[{i}] must be a dpclip.events event, got {type(e).__name__}")
        if isinstance(e, (PoissonSampledEvent, SampledWithoutReplacementEvent)):
            raise ValueError(
                f"extra[{i}] is a sampled event ({type(e).__name__}); extra events run on the "
                "step's batch, so pass the unsampled mechanism (e.g. GaussianEvent)"
            )
    inner: DpEvent = GaussianEvent(z) if not extra else ComposedEvent((GaussianEvent(z), *extra))
    if sampling == "poisson":
        if sample_rate is None:
            if dataset_size is None or batch_size is None:
                raise ValueError(
                    "sample_rate is required for Poisson sampling (or give both dataset_size "
                    "and batch_size, then sample_rate = batch_size / dataset_size)"
                )
            n = _check_size(dataset_size, "dataset_size")
            b = _check_size(batch_size, "batch_size")
            sample_rate = b / n
        q = check_sample_rate(sample_rate)
        if dataset_size is not None and batch_size is not None:
            if not math.isclose(q, batch_size / dataset_size, rel_tol=1e-12):
                raise ValueError(
                    f"sample_rate={q!r} disagrees with batch_size / dataset_size = "
                    f"{batch_size}/{dataset_size}; give one or the other"
                )
        return PoissonSampledEvent(q, inner)
    if sampling == "without-replacement":
        if dataset_size is None or batch_size is None:
            raise ValueError(
                "sampling='without-replacement' needs dataset_size and batch_size (the fixed "
                "batch size B out of N records)"
            )
        n = _check_size(dataset_size, "dataset_size")
        b = _check_size(batch_size, "batch_size")
        if b > n:
            raise ValueError(f"batch_size ({b}) must be <= dataset_size ({n})")
        if sample_rate is not None and not math.isclose(sample_rate, b / n, rel_tol=1e-12):
            raise ValueError(
                f"sample_rate={sample_rate!r} disagrees with batch_size / dataset_size = {b}/{n}; "
                "for sampling without replacement leave sample_rate=None"
            )
        return SampledWithoutReplacementEvent(n, b, inner)
    raise ValueError(f"sampling must be one of {SAMPLING_SCHEMES}, got {sampling!r}")


def dpsgd_event(
    noise_multiplier: float,
    steps: int,
    sample_rate: float | None = None,
    *,
    dataset_size: int | None = None,
    batch_size: int | None = None,
    sampling: str = "poisson",
    extra: Sequence[DpEvent] = (),
) -> SelfComposedEvent:
    """``steps`` identical DP-SGD steps: ``SelfComposedEvent(dpsgd_step_event(...), steps)``."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    step = dpsgd_step_event(
        noise_multiplier,
        sample_rate,
        dataset_size=dataset_size,
        batch_size=batch_size,
        sampling=sampling,
        extra=extra,
    )
    return SelfComposedEvent(step, steps)
