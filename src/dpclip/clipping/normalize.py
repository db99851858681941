"""Per-example normalisation: automatic clipping (Auto-S / Auto-V, NSGD) and DP-PSAC.

These strategies replace the ``min(1, C/n)`` of flat clipping by a smooth weight that rescales
EVERY per-example gradient (not only the large ones), ``g_i -> w(||g_i||) g_i`` with
``w(n) n <= C``, so the clipped sum still has sensitivity ``C`` and a step is exactly the plain
subsampled Gaussian of fixed clipping (same events, same epsilon).

===========  =============================  ==========================================
name         weight ``w(n)``                paper
===========  =============================  ==========================================
``auto-s``   ``C / (n + gamma)``            Bu et al. 2022 (Auto-S); Yang et al. 2022 (NSGD)
``auto-v``   ``C / max(n, 1e-12)``          Bu et al. 2022 (Auto-V, vanilla normalisation)
``psac``     ``C / (n + r / (n + r))``      Xia et al. 2023 (DP-PSAC)
===========  =============================  ==========================================

All three map ``+inf`` / NaN norms (non-finite gradients, reported as ``+inf`` by the engines) to
weight 0, have no state and make no extra release.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from dpclip.clipping.base import State, StrategyBase, finite_or_inf, set_positive_finite
from dpclip.clipping.registry import StrategyEntry, register

__all__ = ["AUTO_V_MIN_NORM", "AutoS", "AutoV", "PSAC"]

#: Auto-V divides by ``max(n, AUTO_V_MIN_NORM)``: the weight stays finite at ``n = 0`` (where the
#: gradient is 0, so any finite weight is sound) and ``w(n) n = C n / max(n, tiny) <= C`` always.
AUTO_V_MIN_NORM = 1e-12

_F32 = torch.finfo(torch.float32)


def _check_range(owner: str, small: str, value: float, max_weight: float, fix: str) -> None:
    """The weights are taken in the norms' dtype (float32 for a float32 model): the stability
    constant ``small`` must be a normal float32 (below, ``n + small`` rounds to 0 at ``n = 0``) and
    the largest weight (Auto-S, Auto-V: at a zero gradient) finite there. Otherwise a step failed or not
    according to whether the batch held an example with an exactly zero gradient: one bit about
    the data, no noise over it (hundred-and-twenty-fifth hostile review)."""
    if value < _F32.tiny:
        raise ValueError(f"{owner}: {small} must be at least {_F32.tiny:.4g} (the smallest normal "
                         f"float32, in which the weights are taken), got {value!r}")
    if not max_weight <= _F32.max:
        raise ValueError(f"{owner}: the largest weight it gives ({max_weight:.4g}) overflows "
                         f"float32 (max {_F32.max:.4g}); {fix}")


@dataclass(frozen=True)
class AutoS(StrategyBase):
    """Automatic clipping, stable version: ``w(n) = C / (n + gamma)`` (= NSGD with ``r = gamma``).

    Every per-example gradient is normalised to norm ``C n / (n + gamma) < C``: large gradients to
    about ``C``, tiny ones are amplified up to the weight ``C / gamma`` (test vector T7: max weight
    10 / 100 for gamma 0.1 / 0.01 with ``C = 1``).

    Privacy: sensitivity ``C`` (``clip_norm``; strict, ``w(n) n < C`` for finite ``n``); no state,
    no extra release: the step is the plain ``Gaussian(z)`` of fixed clipping.
    Edge cases: ``n = 0`` gets the finite weight ``C / gamma`` (the gradient is 0); ``+inf``/NaN
    norms get weight 0. ``C`` only rescales the update (it couples with the learning rate), so the
    papers take ``C = 1`` and tune the learning rate.
    Parameters: ``clip_norm`` (C, default 1.0), ``gamma`` (the stability constant, called ``r`` by
    Yang / Xia; default 0.01 as fastDP's ``numerical_stability_constant``), both finite > 0.
    Papers: Z. Bu, Y.-X. Wang, S. Zha, G. Karypis, "Automatic clipping: differentially private deep
    learning made easier and stronger", NeurIPS 2023 (arXiv 2206.07136); X. Yang, H. Zhang, W.
    Chen, T.-Y. Liu, "Normalized/clipped SGD with perturbation for differentially private
    non-convex optimization", arXiv 2206.13033.
    """

    name: ClassVar[str] = "auto-s"
    norm_kind: ClassVar[str] = "flat"

    clip_norm: float = 1.0
    gamma: float = 0.01

    def __post_init__(self) -> None:
        set_positive_finite(self, "AutoS", "clip_norm", "gamma")
        _check_range("AutoS", "gamma", self.gamma, self.clip_norm / self.gamma,
                     "raise gamma or lower clip_norm")

    def weights(self, norms: Tensor, state: State) -> Tensor:
        n = finite_or_inf(norms)
        return self.clip_norm / (n + self.gamma)  # +inf -> 0

    def sensitivity(self, state: State) -> float:
        return self.clip_norm


@dataclass(frozen=True)
class AutoV(StrategyBase):
    """Automatic clipping, vanilla version (normalisation): ``w(n) = C / n``.

    Every non-zero per-example gradient is rescaled to norm exactly ``C``.

    Privacy: sensitivity ``C`` (``clip_norm``); no state, no extra release (``Gaussian(z)``).
    Edge cases: ``C / n`` is undefined at ``n = 0``; we use ``C / max(n, 1e-12)``
    (``AUTO_V_MIN_NORM``), which is finite, equals ``C / n`` for every ``n >= 1e-12`` and keeps
    ``w(n) n <= C`` for all ``n`` (a zero gradient contributes 0 whatever its weight). ``+inf`` /
    NaN norms get weight 0. Bu et al. note Auto-V's "lazy region" (gradients that are tiny but
    not 0 are blown up to norm ``C``); Auto-S is the stable alternative.
    Paper: Z. Bu, Y.-X. Wang, S. Zha, G. Karypis, "Automatic clipping: differentially private deep
    learning made easier and stronger", NeurIPS 2023 (arXiv 2206.07136).
    """

    name: ClassVar[str] = "auto-v"
    norm_kind: ClassVar[str] = "flat"

    clip_norm: float = 1.0

    def __post_init__(self) -> None:
        set_positive_finite(self, "AutoV", "clip_norm")
        _check_range("AutoV", "clip_norm", self.clip_norm, self.clip_norm / AUTO_V_MIN_NORM,
                     f"clip_norm must be at most {_F32.max * AUTO_V_MIN_NORM:.4g}")

    def weights(self, norms: Tensor, state: State) -> Tensor:
        n = finite_or_inf(norms)
        return self.clip_norm / torch.clamp(n, min=AUTO_V_MIN_NORM)  # +inf -> 0

    def sensitivity(self, state: State) -> float:
        return self.clip_norm


@dataclass(frozen=True)
class PSAC(StrategyBase):
    """DP-PSAC per-sample adaptive clipping: ``w(n) = C / (n + r / (n + r))``.

    Like Auto-S it normalises every gradient, but the amplification of tiny gradients is bounded
    by ``C / (2 sqrt(r) - r)`` (reached at ``n* = sqrt(r) - r``) instead of ``C / r``: test vector
    T6, with ``C = 1``: max weight 1.8781 at ``n = 0.2162`` (r = 0.1), 5.2632 at ``n = 0.09``
    (r = 0.01). ``w(0) = C``; for large ``n``, ``w ~ C / n``.

    Privacy: sensitivity ``C`` (``clip_norm``; strict: ``w(n) n < C`` for finite ``n`` because
    ``r / (n + r) > 0``); no state, no extra release (``Gaussian(z)``).
    Edge cases: ``n = 0`` is safe (``w = C``, and the gradient is 0); ``+inf`` / NaN norms get
    weight 0. Parameters: ``clip_norm`` (C, default 1.0; couples with the learning rate, the
    paper takes 1), ``r`` in (0, 1] as in the paper (default 0.1, "near-optimal; results
    insensitive to r").
    Paper: T. Xia, S. Shen, S. Yao, X. Fu, K. Xu, X. Xu, X. Fu, "Differentially private learning
    with per-sample adaptive clipping", AAAI 2023 (arXiv 2212.00328).
    """

    name: ClassVar[str] = "psac"
    norm_kind: ClassVar[str] = "flat"

    clip_norm: float = 1.0
    r: float = 0.1

    def __post_init__(self) -> None:
        set_positive_finite(self, "PSAC", "clip_norm", "r")
        if self.r > 1:
            raise ValueError(f"PSAC: r must be in (0, 1] (Xia et al.; 0.1 recommended), got "
                             f"{self.r!r}")
        _check_range("PSAC", "r", self.r, self.clip_norm / (2 * self.r ** 0.5 - self.r),
                     "raise r or lower clip_norm")

    def weights(self, norms: Tensor, state: State) -> Tensor:
        n = finite_or_inf(norms)
        return self.clip_norm / (n + self.r / (n + self.r))  # +inf -> C / inf = 0

    def sensitivity(self, state: State) -> float:
        return self.clip_norm


register(
    StrategyEntry(
        name="auto-s",
        cls=AutoS,
        paper="Bu et al., Automatic clipping, NeurIPS 2023 (Auto-S); Yang et al., NSGD, 2022",
        summary="normalise every per-example gradient: w = clip_norm / (norm + gamma)",
    )
)
register(
    StrategyEntry(
        name="auto-v",
        cls=AutoV,
        paper="Bu et al., Automatic clipping, NeurIPS 2023 (Auto-V)",
        summary="vanilla normalisation: w = clip_norm / norm (every gradient to norm clip_norm)",
    )
)
register(
    StrategyEntry(
        name="psac",
        cls=PSAC,
        paper="Xia et al., DP learning with per-sample adaptive clipping (DP-PSAC), AAAI 2023",
        summary="w = clip_norm / (norm + r / (norm + r)); bounded amplification of tiny gradients",
    )
)
