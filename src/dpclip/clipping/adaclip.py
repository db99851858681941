"""AdaCliP: coordinate-wise adaptive clipping (Pichapati et al. 2019; algorithms.md M5).

The one strategy of class P-GRAD: it transforms each materialized per-example gradient before
clipping, so ``dpclip.training.step.dp_step`` runs it through its per-example-transform path (see
``dpclip.training.step.GradientTransform``) instead of ``engine.compute``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Mapping

import torch
from torch import Tensor

from dpclip.clipping.base import (Release, State, StepContext, StrategyBase, finite_or_inf,
                                  positive_finite, set_positive_finite)
from dpclip.clipping.capabilities import Capabilities
from dpclip.clipping.quantile import NORM_EPS
from dpclip.clipping.registry import StrategyEntry, register
from dpclip.events import DpEvent

__all__ = ["AdaClip"]

NOISE_MODES = ("batch", "per_sample")


@dataclass(frozen=True)
class AdaClip(StrategyBase):
    """Whiten each per-example gradient coordinate-wise, clip it to unit norm, noise, un-whiten.

    With running estimates ``m`` (mean) and ``s`` (second moment) in ``R^d`` (d = number of
    trainable parameters), step ``t`` is (algorithms.md M5)::

        b_j     = s_j^(1/4) * (sum_k sqrt(s_k))^(1/2)             variance-optimal scale
        u_i     = (g_i - m) / b                                   whitened, coordinate-wise
        w_i     = min(1, 1 / (||u_i|| + 1e-6))                    clip to unit norm (sensitivity 1)
        u_bar   = (sum_i w_i u_i + N(0, (z k r)^2 I)) / B         B: public expected batch size
        g~      = b * u_bar + m                                   the privatized gradient
        m'      = beta1 m + (1 - beta1) g~
        v       = clamp((g~ - m)^2 - (b z k r / B)^2, h_lo, h_hi)   minus the known noise variance
        s'      = beta2 s + (1 - beta2) v

    with ``k`` the sampler's sensitivity factor (1 Poisson, 2 replace-one), ``h_lo = min(h1, h2)``,
    ``h_hi = max(h1, h2)`` and ``r = 1`` for ``noise_mode="batch"``, ``r = sqrt(B)`` for
    ``noise_mode="per_sample"``.

    Privacy: in whitened space every contribution has norm <= 1, so ``sensitivity = 1`` and the
    step's event is ``Gaussian(z)``, exactly Abadi's DP-SGD with multiplier ``z``. ``m``, ``s``,
    ``b`` are functions of earlier privatized gradients only (post-processing). ``weights`` is the
    unit-norm clip on WHITENED norms (the contract and neighbour suites, which call it on raw
    norms, see an Abadi clip at 1).

    ``noise_mode="per_sample"`` reproduces Lin et al.'s AdaClip baseline, where noise is added to
    every example before averaging: the std on the whitened sum is ``z k sqrt(B)`` with the PUBLIC
    expected batch size ``B`` (the realised size would make the noise scale data-dependent, and an
    empty batch noiseless; anchors P4b). The ledger still records ``Gaussian(z)``, a valid,
    conservative bound (the release is ``Gaussian(z sqrt(B))``, a post-processing of it), which is
    how Lin accounted for it: at the same epsilon this mode adds ``sqrt(B)`` times more noise.

    Parameters: ``initial_clip_norm`` ``C_init`` (1.0): ``s_0 = (C_init^2 / d) 1`` and ``m_0 = 0``
    make ``b = C_init`` everywhere, so the first step is exactly Abadi clipping at ``C_init`` (up
    to where the 1e-6 guard sits); ``beta1`` (0.9) and ``beta2`` (0.99), the authors' choice;
    ``h1`` (1e-2) and ``h2`` (1e-4), Lin et al.'s MNIST clamp of ``v`` (their tables list
    ``h1 > h2``, so we clamp with the min/max of the pair); ``noise_mode`` (``"batch"``).

    State: ``{"m": {param: [floats]}, "s": {param: [floats]}}``, flat JSON lists per trainable
    parameter (float64 values), empty until the first step (then ``m_0``, ``s_0`` are implied, as
    ``d`` is only known from the gradients). Lists round-trip exactly through checkpoints and the
    contract's JSON check; they cost ``O(d)`` Python floats per step (fine for the papers' CNNs,
    slow for models with millions of parameters).
    Edge cases: a non-finite per-example gradient whitens to a non-finite vector and gets weight 0
    (engine rule); ``s >= min(s_0, h_lo) > 0`` always, so ``b`` never vanishes. An empty batch
    releases noise only; ``m``, ``s`` still update from it (post-processing).
    Paper: V. Pichapati, A. T. Suresh, F. X. Yu, S. J. Reddi, S. Kumar, "AdaCliP: adaptive
    clipping for private SGD", arXiv 1908.07643 (2019); the per-sample baseline: Lin et al. 2022.
    """

    name: ClassVar[str] = "adaclip"
    norm_kind: ClassVar[str] = "flat"
    #: class P-GRAD: ``dp_step`` materializes per-example gradients and calls ``transform``
    capabilities: ClassVar[Capabilities] = Capabilities(per_example_grads=True)

    initial_clip_norm: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.99
    h1: float = 1e-2
    h2: float = 1e-4
    noise_mode: str = "batch"

    def __post_init__(self) -> None:
        owner = "AdaClip"
        set_positive_finite(self, owner, "initial_clip_norm", "h1", "h2")
        for f in ("beta1", "beta2"):
            v = getattr(self, f)
            try:
                ok = 0.0 <= float(v) < 1.0
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise ValueError(f"{owner}: {f} must be a number in [0, 1), got {v!r}")
            object.__setattr__(self, f, float(v))
        if self.noise_mode not in NOISE_MODES:
            raise ValueError(
                f"{owner}: noise_mode must be one of {', '.join(NOISE_MODES)}, "
                f"got {self.noise_mode!r}"
            )

    # ---- the norm-strategy protocol (in whitened space) --------------------------------------
    def init_state(self) -> State:
        return {"m": {}, "s": {}}

    def weights(self, norms: Tensor, state: State) -> Tensor:
        n = finite_or_inf(norms)
        return torch.clamp(1.0 / (n + NORM_EPS), max=1.0)

    def sensitivity(self, state: State) -> float:
        return 1.0

    def update(
        self, state: State, norms: Tensor, ctx: StepContext, release: Release
    ) -> tuple[State, tuple[DpEvent, ...]]:
        # m and s are updated in ``untransform`` (from the privatized gradient); no release here
        return state, ()

    # ---- the per-example-transform hooks used by dp_step -------------------------------------
    def moments(
        self, state: State, shapes: Mapping[str, torch.Size]
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """``(m, s)`` as float64 tensors of the given parameter shapes (``m_0``, ``s_0`` if new)."""
        m_state, s_state = state.get("m", {}), state.get("s", {})
        if not m_state and not s_state:
            d = sum(math.prod(shape) for shape in shapes.values())
            s0 = self.initial_clip_norm**2 / max(d, 1)
            return (
                {n: torch.zeros(shape, dtype=torch.float64) for n, shape in shapes.items()},
                {n: torch.full(shape, s0, dtype=torch.float64) for n, shape in shapes.items()},
            )
        if set(m_state) != set(shapes) or set(s_state) != set(shapes):
            raise ValueError(
                "AdaClip: the state's parameters do not match the model's trainable parameters "
                f"(state: {sorted(m_state)}, model: {sorted(shapes)}); a state belongs to one "
                "model: start from strategy.init_state()"
            )
        m, s = {}, {}
        for n, shape in shapes.items():
            if len(m_state[n]) != math.prod(shape) or len(s_state[n]) != math.prod(shape):
                raise ValueError(
                    f"AdaClip: state for parameter {n!r} has {len(m_state[n])} values, the "
                    f"parameter has {math.prod(shape)}; start from strategy.init_state()"
                )
            m[n] = torch.tensor(m_state[n], dtype=torch.float64).reshape(shape)
            s[n] = torch.tensor(s_state[n], dtype=torch.float64).reshape(shape)
        return m, s

    @staticmethod
    def scales(s: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``b_j = s_j^(1/4) (sum_k sqrt(s_k))^(1/2)`` over all coordinates of all parameters."""
        total = sum(float(v.sqrt().sum()) for v in s.values())
        return {n: v.pow(0.25) * math.sqrt(total) for n, v in s.items()}

    def noise_scale(self, ctx: StepContext) -> float:
        """Factor ``r`` on the step's noise std: 1 (batch) or ``sqrt(B)`` (per_sample, public B)."""
        if self.noise_mode == "batch":
            return 1.0
        return math.sqrt(positive_finite("expected_batch_size", ctx.expected_batch_size, "AdaClip"))

    def transform(self, grads: Mapping[str, Tensor], state: State) -> dict[str, Tensor]:
        """Whiten per-example gradients ``{name: (b, *shape)}``: ``(g_i - m) / b`` (pure)."""
        shapes = {n: g.shape[1:] for n, g in grads.items()}
        m, s = self.moments(state, shapes)
        b = self.scales(s)
        out = {}
        for n, g in grads.items():
            like = {"device": g.device, "dtype": g.dtype}
            out[n] = (g - m[n].to(**like)) / b[n].to(**like)
        return out

    def untransform(
        self, mean: Mapping[str, Tensor], state: State, noise_std: float
    ) -> tuple[dict[str, Tensor], State]:
        """Un-whiten the privatized whitened mean and update ``m``, ``s`` (post-processing).

        ``mean[name]`` is ``(sum_i w_i u_i + noise) / B``; ``noise_std`` is the per-coordinate std
        of its noise (``z k r / B``). Returns ``g~ = b * mean + m`` (in the dtype of ``mean``) and
        the new state.
        """
        shapes = {n: v.shape for n, v in mean.items()}
        m, s = self.moments(state, shapes)
        b = self.scales(s)
        h_lo, h_hi = min(self.h1, self.h2), max(self.h1, self.h2)
        grads: dict[str, Tensor] = {}
        new_m: dict[str, list[float]] = {}
        new_s: dict[str, list[float]] = {}
        for n, u in mean.items():
            g = b[n] * u.detach().to("cpu", torch.float64) + m[n]
            grads[n] = g.to(device=u.device, dtype=u.dtype)
            v = (g - m[n]).square() - (b[n] * noise_std).square()
            v = v.clamp(min=h_lo, max=h_hi)
            new_m[n] = (self.beta1 * m[n] + (1 - self.beta1) * g).reshape(-1).tolist()
            new_s[n] = (self.beta2 * s[n] + (1 - self.beta2) * v).reshape(-1).tolist()
        return grads, {**state, "m": new_m, "s": new_s}


register(
    StrategyEntry(
        name="adaclip",
        cls=AdaClip,
        paper="Pichapati, Suresh, Yu, Reddi, Kumar, AdaCliP: adaptive clipping for private SGD, "
        "arXiv 1908.07643 (2019)",
        summary="coordinate-wise whitening with running mean/variance, unit-norm clipping in "
        "whitened space (needs materialized per-example gradients: vmap or naive engine)",
    )
)
