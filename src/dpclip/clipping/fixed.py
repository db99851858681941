"""Fixed flat clipping (Abadi et al. 2016)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from dpclip.clipping.base import State, StrategyBase, finite_or_inf, set_positive_finite

__all__ = ["FixedClip"]

#: Guard inside the ``min`` (Opacus convention): ``min(1, C / (n + 1e-6))``.
NORM_EPS = 1e-6


@dataclass(frozen=True)
class FixedClip(StrategyBase):
    """Clip every per-example gradient to L2 norm ``clip_norm``: ``w_i = min(1, C / (||g_i|| + 1e-6))``.

    Privacy: sensitivity ``C`` (add/remove-one); the step adds ``N(0, (z C)^2)`` to the sum; no
    state, no extra releases, so a run is a plain subsampled Gaussian with multiplier ``z``.
    Edge cases: a zero gradient gets weight 1; a non-finite gradient (norm ``inf``/NaN) weight 0.
    Paper: M. Abadi et al., "Deep learning with differential privacy", CCS 2016.
    """

    name: ClassVar[str] = "fixed"
    norm_kind: ClassVar[str] = "flat"

    clip_norm: float = 1.0

    def __post_init__(self) -> None:
        set_positive_finite(self, "FixedClip", "clip_norm")

    def weights(self, norms: Tensor, state: State) -> Tensor:
        # min(1, C / (n + eps)), in place on one temporary (the same arithmetic as the expression)
        return finite_or_inf(norms).add_(NORM_EPS).reciprocal_().mul_(self.clip_norm).clamp_(max=1.0)

    def sensitivity(self, state: State) -> float:
        return self.clip_norm
