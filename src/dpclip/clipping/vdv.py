"""Clipping at a DP estimate of the mean gradient norm (van der Veen et al. 2018; algorithms.md M7).

The paper only describes the tool in words ("set the clipping bound from a differentially private
mean of the gradient norms of the previous batch"); the estimator, its noise and the multiplier
``kappa`` are our reconstruction [RECON], documented in ``docs/strategies.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from dpclip.clipping.base import (Release, State, StepContext, StrategyBase, finite_or_inf,
                                  positive_finite, set_positive_finite)
from dpclip.clipping.quantile import NORM_EPS, SplitNoiseMixin
from dpclip.clipping.registry import StrategyEntry, register
from dpclip.events import DpEvent

__all__ = ["MeanNormClip"]

#: ``mean_noise_multiplier = expected_batch_size / MEAN_NOISE_DIVISOR`` when not given: the same
#: multiplier as Andrew et al.'s count (``2 sigma_b = m / 10``), so both adaptive strategies take
#: the same share of the budget.
MEAN_NOISE_DIVISOR = 10.0


@dataclass(frozen=True)
class MeanNormClip(SplitNoiseMixin, StrategyBase):
    """Clip at ``C_t``; set ``C_{t+1} = kappa *`` (DP mean of the clipped norms of batch ``t``).

    Step ``t`` (clip with ``C_t`` first, then update, as for ``quantile``)::

        w_i      = min(1, C_t / (n_i + 1e-6))                    weights (sensitivity C_t)
        S~       = sum_i min(n_i, C_t) + N(0, (sigma_m C_t)^2)   sensitivity C_t
        n_bar    = S~ / B                                        B: PUBLIC expected batch size
        C_{t+1}  = clamp(kappa * n_bar, min_clip_norm, max_clip_norm)

    Privacy: the mean query is released with multiplier ``sigma_m`` (``mean_noise_multiplier``)
    and the gradient sum with ``z_g = (z^-2 - sigma_m^-2)^-1/2`` (the Theorem-1 split of
    algorithms.md 1.4), so ``Composed(Gaussian(z_g), Gaussian(sigma_m))`` -- the event the step
    emits and the plan contains -- is exactly as private as ``Gaussian(z)``: the run meets its
    target like fixed clipping at ``z``. Requires ``z < sigma_m`` (``ValueError`` otherwise).

    Parameters: ``initial_clip_norm`` ``C_0`` (1.0); ``kappa`` (1.0: clip at the mean);
    ``mean_noise_multiplier`` ``sigma_m`` (None: ``expected_batch_size / 10``, so the noise on
    ``n_bar`` has std ``C_t / 10`` and the split costs the gradient ``z_g / z - 1 < 0.1 %`` at
    ``z = 1, B = 256``); ``min_clip_norm`` (1e-6, a positive floor: the noisy mean can be <= 0)
    and ``max_clip_norm`` (1e6).

    Behaviour to know: because the norms are clipped at ``C_t`` (needed for a bounded
    sensitivity), ``E[n_bar] <= C_t``; with ``kappa <= 1`` the threshold can only drift down
    (towards the lower tail of the norm distribution) and never grows from a ``C_0`` below the
    typical norm. ``kappa > 1`` has a fixed point inside the distribution (``C = kappa
    E[min(n, C)]``). Start above the typical norm.

    State: ``{"clip_norm": C_t, "mean_noise_multiplier": sigma_m}`` (``sigma_m`` resolved from the
    public context in ``begin_step``).
    Edge cases: a NaN/inf norm contributes ``C_t`` to the mean (counted as fully clipped; its
    gradient has weight 0). An empty batch releases pure noise.
    Paper: K. L. van der Veen, R. Seggers, P. Bloem, G. Patrini, "Three tools for practical
    differential privacy", NeurIPS 2018 PPML workshop (arXiv 1812.02890).
    """

    name: ClassVar[str] = "vdv"
    _owner: ClassVar[str] = "MeanNormClip"
    _aux_key: ClassVar[str] = "mean_noise_multiplier"
    _aux_name: ClassVar[str] = "mean_noise_multiplier"
    _aux_default: ClassVar[str] = "expected_batch_size / 10"
    norm_kind: ClassVar[str] = "flat"

    initial_clip_norm: float = 1.0
    kappa: float = 1.0
    mean_noise_multiplier: float | None = None
    min_clip_norm: float = 1e-6
    max_clip_norm: float = 1e6

    def __post_init__(self) -> None:
        owner = "MeanNormClip"
        set_positive_finite(self, owner, "initial_clip_norm", "kappa", "min_clip_norm",
                            "max_clip_norm", optional=("mean_noise_multiplier",))
        self._check_clip_range()

    def mean_noise_multiplier_for(self, ctx: StepContext) -> float:
        """``sigma_m``: ``mean_noise_multiplier`` or ``expected_batch_size / 10`` (public)."""
        if self.mean_noise_multiplier is not None:
            return self.mean_noise_multiplier
        return positive_finite(
            "expected_batch_size", ctx.expected_batch_size, "MeanNormClip"
        ) / MEAN_NOISE_DIVISOR

    def _aux_for(self, ctx: StepContext) -> float:
        return self.mean_noise_multiplier_for(ctx)

    def init_state(self) -> State:
        return {
            "clip_norm": self.initial_clip_norm,
            "mean_noise_multiplier": self.mean_noise_multiplier,
        }

    def weights(self, norms: Tensor, state: State) -> Tensor:
        n = finite_or_inf(norms)
        return torch.clamp(float(state["clip_norm"]) / (n + NORM_EPS), max=1.0)

    def sensitivity(self, state: State) -> float:
        return float(state["clip_norm"])

    def next_clip_norm(self, mean_norm: float) -> float:
        """``C_{t+1} = clamp(kappa * n_bar, min_clip_norm, max_clip_norm)``."""
        return min(max(self.kappa * mean_norm, self.min_clip_norm), self.max_clip_norm)

    def update(
        self, state: State, norms: Tensor, ctx: StepContext, release: Release
    ) -> tuple[State, tuple[DpEvent, ...]]:
        clip_norm = float(state["clip_norm"])
        sigma_m = self.mean_noise_multiplier_for(ctx)
        n = finite_or_inf(norms.detach()).reshape(-1).to(torch.float64)
        clipped_sum = torch.clamp(n, max=clip_norm).sum()  # inf -> C_t
        noisy, event = release(clipped_sum, clip_norm, sigma_m)
        mean_norm = float(noisy) / ctx.expected_batch_size  # public denominator
        new_state = {
            **state,
            "clip_norm": self.next_clip_norm(mean_norm),
            "mean_noise_multiplier": sigma_m,
        }
        return new_state, (event,)


register(
    StrategyEntry(
        name="vdv",
        cls=MeanNormClip,
        paper="van der Veen, Seggers, Bloem, Patrini, Three tools for practical differential "
        "privacy, NeurIPS 2018 PPML workshop",
        summary="clip at kappa x a DP mean of the previous batch's clipped norms (Thm-1 style "
        "noise split)",
    )
)
