"""Quantile-based adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021).

The threshold ``C_t`` tracks a target quantile of the per-example gradient norms, estimated online
from a differentially private count of the examples that were NOT clipped (algorithms.md M6, in its
example-level DP-SGD adaptation: user = example, Poisson sampling, ``m`` = expected batch size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from dpclip.clipping.base import (Release, State, StepContext, StrategyBase, finite_or_inf,
                                  positive_finite, set_positive_finite)
from dpclip.clipping.registry import StrategyEntry, register
from dpclip.events import ComposedEvent, DpEvent, GaussianEvent

__all__ = ["QuantileClip", "SplitNoiseMixin", "split_noise_multiplier"]

#: Guard inside the ``min`` (Opacus convention, as in ``fixed``): ``min(1, C / (n + 1e-6))``.
NORM_EPS = 1e-6
#: L2 sensitivity of the centred count ``sum_i (b_i - 1/2)`` under add/remove-one adjacency.
COUNT_SENSITIVITY = 0.5
#: ``count_noise_std = expected_batch_size / COUNT_NOISE_DIVISOR`` when not given (Andrew: m/20).
COUNT_NOISE_DIVISOR = 20.0
UPDATE_RULES = ("geometric", "linear")


def split_noise_multiplier(base: float, aux: float, owner: str, aux_name: str) -> float:
    """Gradient-sum multiplier ``z_g = (base^-2 - aux^-2)^-1/2`` of a Theorem-1 noise split.

    Releasing the gradient sum with multiplier ``z_g`` and an auxiliary query on the same batch
    with multiplier ``aux`` is exactly as private as one Gaussian with multiplier ``base``
    (algorithms.md 1.4; Andrew et al. 2021, Thm 1, with ``aux = 2 sigma_b``). ``base = 0`` (no
    noise) gives 0. Raises ``ValueError`` naming ``aux_name`` when ``base >= aux``: then no split
    exists (the auxiliary query alone already costs at least the whole budget; Opacus #757).
    """
    if not (math.isfinite(base) and base >= 0):
        raise ValueError(f"{owner}: noise multiplier must be finite and >= 0, got {base!r}")
    if base == 0.0:
        return 0.0
    if base >= aux:
        raise ValueError(
            f"{owner}: the run's noise multiplier {base:g} must be < {aux_name} = {aux:g}: the "
            f"privacy budget of multiplier {base:g} is split between the gradient sum and the "
            f"auxiliary query (Andrew et al. 2021, Thm 1), whose own multiplier {aux:g} already "
            f"spends all of it. Raise {aux_name} (for the default, a larger expected batch size) "
            "or target a larger epsilon / smaller noise multiplier. (If this appeared while "
            "calibrating to a target epsilon, the search probed this multiplier: set the "
            "strategy parameter explicitly above the noise you need.)"
        )
    return (base**-2 - aux**-2) ** -0.5


class SplitNoiseMixin:
    """The noise split of a strategy that releases one auxiliary Gaussian query per step.

    Shared by ``QuantileClip`` (the noisy clipped count) and ``MeanNormClip`` (the noisy mean
    norm): ``begin_step`` resolves the auxiliary value from the public context into the state
    under ``_aux_key``; the gradient sum gets the Theorem-1 split multiplier
    (:func:`split_noise_multiplier`); the planned event composes both Gaussians.
    Privacy: everything here is a function of public values (``base``, the context); no data.
    Subclasses set ``_owner``, ``_aux_key``, ``_aux_name`` (the multiplier's name in errors) and
    ``_aux_default`` (how the default is resolved), and define ``_aux_for(ctx)``; they override
    ``_aux_multiplier`` when the state holds a std rather than a multiplier.
    """

    _owner: ClassVar[str]
    _aux_key: ClassVar[str]
    _aux_name: ClassVar[str]
    _aux_default: ClassVar[str]

    def _check_clip_range(self) -> None:
        """``min_clip_norm <= initial_clip_norm <= max_clip_norm`` (both adaptive thresholds are
        kept in that range), else a ``ValueError`` naming the three fields."""
        lo, c0, hi = (self.min_clip_norm, self.initial_clip_norm,  # type: ignore[attr-defined]
                      self.max_clip_norm)  # type: ignore[attr-defined]
        if not (lo <= c0 <= hi):
            raise ValueError(
                f"{self._owner}: need min_clip_norm <= initial_clip_norm <= max_clip_norm, got "
                f"{lo} <= {c0} <= {hi}"
            )

    def _aux_for(self, ctx: StepContext) -> float:
        raise NotImplementedError

    def _aux_multiplier(self, aux: float) -> float:
        """The auxiliary query's noise multiplier (std / sensitivity) for the state value."""
        return aux

    def _gradient_multiplier(self, base: float, aux: float) -> float:
        return split_noise_multiplier(base, self._aux_multiplier(aux), self._owner,
                                      self._aux_name)

    def begin_step(self, state: State, ctx: StepContext) -> State:
        return {**state, self._aux_key: self._aux_for(ctx)}

    def noise_multiplier(self, state: State, base: float) -> float:
        aux = state.get(self._aux_key)
        if aux is None:
            raise ValueError(
                f"{self._owner}: the state has no {self._aux_key}; call begin_step(state, ctx) "
                f"first (it resolves the default {self._aux_default})"
            )
        return self._gradient_multiplier(base, float(aux))

    def planned_event(self, base: float, ctx: StepContext) -> DpEvent:
        aux = self._aux_for(ctx)
        return ComposedEvent(
            (GaussianEvent(self._gradient_multiplier(base, aux)),
             GaussianEvent(self._aux_multiplier(aux)))
        )


@dataclass(frozen=True)
class QuantileClip(SplitNoiseMixin, StrategyBase):
    """Clip at ``C_t`` and move ``C_t`` towards the ``target_quantile`` of the per-example norms.

    Step ``t`` (Andrew et al. 2021, Alg. 1, example-level; the paper's order: clip with ``C_t``,
    then update to ``C_{t+1}``)::

        w_i      = min(1, C_t / (n_i + 1e-6))                       weights (sensitivity C_t)
        b_i      = 1[n_i <= C_t]                                    unclipped indicator
        count~   = sum_i (b_i - 1/2) + N(0, sigma_b^2)              centred, sensitivity 1/2
        b~       = clamp(count~ / B + 1/2, 0, 1)                    B: PUBLIC expected batch size
        C_{t+1}  = C_t * exp(-clip_lr (b~ - gamma))                 update_rule="geometric"
                   C_t - clip_lr (b~ - gamma)                        update_rule="linear"
        C_{t+1}  = clamp(C_{t+1}, min_clip_norm, max_clip_norm)

    ``gamma = target_quantile`` is the target UNCLIPPED fraction (0.5: the median). If more than a
    ``gamma`` fraction is unclipped, ``C`` shrinks.

    Privacy (Thm 1): the count is released with multiplier ``2 sigma_b`` (std ``sigma_b`` under
    Poisson sampling) and the gradient sum with ``z_g = (z^-2 - (2 sigma_b)^-2)^-1/2``, where
    ``z`` is the run's (calibrated) noise multiplier. The step event is
    ``Composed(Gaussian(z_g), Gaussian(2 sigma_b))``, exactly as private as ``Gaussian(z)``: the
    accountant sees the user's ``z`` (anchors P4a), never ``z_g`` alone. Requires
    ``z < 2 sigma_b`` (``ValueError`` otherwise; Opacus #757). Under fixed-size sampling
    (replace-one) the count's sensitivity is 1 and its std ``2 sigma_b``: same event.

    Parameters: ``initial_clip_norm`` ``C_0`` (0.1, start low: geometric growth is x10 per ~23
    all-clipped steps at the defaults); ``target_quantile`` ``gamma`` in (0, 1) (0.5);
    ``clip_lr`` ``eta_C`` (0.2); ``update_rule`` ``"geometric"`` (default, the paper's) or
    ``"linear"`` (``eta_C`` is then in norm units); ``count_noise_std`` ``sigma_b`` (None:
    ``expected_batch_size / 20``, the paper's ``m/20``, read from the public step context);
    ``min_clip_norm`` (1e-6) / ``max_clip_norm`` (1e6): bounds on ``C_t`` (the linear rule can
    cross zero; a positive floor keeps the sensitivity positive).

    State: ``{"clip_norm": C_t, "count_noise_std": sigma_b}`` (``sigma_b`` is resolved from the
    public context in ``begin_step``).

    Edge cases: NaN/inf norms count as clipped (``b_i = 0``; their weight is 0 too). An empty
    batch still releases the count (pure noise, centred at 0, i.e. ``b~ ~ 1/2``). The count is
    divided by the public expected batch size, never the realised one (anchors P4b).
    Paper: G. Andrew et al., "Differentially private learning with adaptive clipping", NeurIPS
    2021 (arXiv 1905.03871); centred count and public denominator as in TF-Privacy's
    ``QuantileEstimatorQuery``.
    """

    name: ClassVar[str] = "quantile"
    _owner: ClassVar[str] = "QuantileClip"
    _aux_key: ClassVar[str] = "count_noise_std"
    _aux_name: ClassVar[str] = "2 * count_noise_std"
    _aux_default: ClassVar[str] = "expected_batch_size / 20"
    norm_kind: ClassVar[str] = "flat"

    initial_clip_norm: float = 0.1
    target_quantile: float = 0.5
    clip_lr: float = 0.2
    update_rule: str = "geometric"
    count_noise_std: float | None = None
    min_clip_norm: float = 1e-6
    max_clip_norm: float = 1e6

    def __post_init__(self) -> None:
        owner = "QuantileClip"
        set_positive_finite(self, owner, "initial_clip_norm", "clip_lr", "min_clip_norm",
                            "max_clip_norm", optional=("count_noise_std",))
        try:
            gamma = float(self.target_quantile)
        except (TypeError, ValueError):
            gamma = math.nan
        if not (0.0 < gamma < 1.0):
            raise ValueError(
                f"{owner}: target_quantile (the target unclipped fraction) must be in (0, 1), "
                f"got {self.target_quantile!r}"
            )
        object.__setattr__(self, "target_quantile", gamma)
        if self.update_rule not in UPDATE_RULES:
            raise ValueError(
                f"{owner}: update_rule must be one of {', '.join(UPDATE_RULES)}, "
                f"got {self.update_rule!r}"
            )
        self._check_clip_range()

    # ---- public, data-independent parts ----------------------------------------------------
    def count_noise_std_for(self, ctx: StepContext) -> float:
        """``sigma_b``: ``count_noise_std`` or ``expected_batch_size / 20`` (public)."""
        if self.count_noise_std is not None:
            return self.count_noise_std
        return positive_finite(
            "expected_batch_size", ctx.expected_batch_size, "QuantileClip"
        ) / COUNT_NOISE_DIVISOR

    def count_noise_multiplier(self, sigma_b: float) -> float:
        """Multiplier of the count release: std ``sigma_b`` at sensitivity 1/2 -> ``2 sigma_b``."""
        return sigma_b / COUNT_SENSITIVITY

    def _aux_for(self, ctx: StepContext) -> float:
        return self.count_noise_std_for(ctx)

    def _aux_multiplier(self, aux: float) -> float:
        return self.count_noise_multiplier(aux)

    def init_state(self) -> State:
        return {"clip_norm": self.initial_clip_norm, "count_noise_std": self.count_noise_std}

    # ---- weights and sensitivity -------------------------------------------------------------
    def weights(self, norms: Tensor, state: State) -> Tensor:
        n = finite_or_inf(norms)
        return torch.clamp(float(state["clip_norm"]) / (n + NORM_EPS), max=1.0)

    def sensitivity(self, state: State) -> float:
        return float(state["clip_norm"])

    # ---- the private update ------------------------------------------------------------------
    def next_clip_norm(self, clip_norm: float, unclipped_fraction: float) -> float:
        """``C_{t+1}`` from ``C_t`` and the (privatized, clamped) unclipped fraction ``b~``."""
        err = unclipped_fraction - self.target_quantile
        if self.update_rule == "geometric":
            new = clip_norm * math.exp(-self.clip_lr * err)
        else:
            new = clip_norm - self.clip_lr * err
        return min(max(new, self.min_clip_norm), self.max_clip_norm)

    def update(
        self, state: State, norms: Tensor, ctx: StepContext, release: Release
    ) -> tuple[State, tuple[DpEvent, ...]]:
        clip_norm = float(state["clip_norm"])
        sigma_b = self.count_noise_std_for(ctx)
        unclipped = finite_or_inf(norms.detach()).reshape(-1) <= clip_norm  # NaN/inf: clipped
        centred = (unclipped.to(torch.float64) - 0.5).sum()
        noisy, event = release(centred, COUNT_SENSITIVITY, self.count_noise_multiplier(sigma_b))
        fraction = float(noisy) / ctx.expected_batch_size + 0.5  # public denominator (P4b)
        fraction = min(max(fraction, 0.0), 1.0)
        new_state = {
            **state,
            "clip_norm": self.next_clip_norm(clip_norm, fraction),
            "count_noise_std": sigma_b,
        }
        return new_state, (event,)


register(
    StrategyEntry(
        name="quantile",
        cls=QuantileClip,
        paper="Andrew, Thakkar, McMahan, Ramaswamy, Differentially private learning with adaptive "
        "clipping, NeurIPS 2021",
        summary="clip at a DP online estimate of a target quantile of the per-example norms "
        "(noisy centred unclipped count; Thm-1 noise split)",
    )
)
