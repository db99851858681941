"""Per-layer clipping and adaptive layerwise clipping (algorithms.md M12).

The gradient is split into ``L`` blocks (parameter groups: one per layer by default, per tensor, or
user-defined groups to keep ``L`` small), and block ``h`` of every clipped unit is clipped to
``C_h = clip_norm * r_h``::

    w_{i,h} = min(1, C_h / (||g_{i,h}|| + 1e-6))        ||w_i g_i|| <= S = sqrt(sum_h C_h^2)

Two noise placements (``noise``):

* ``flat`` (McMahan et al. 2018, Opacus' per-layer optimizer): one std ``z k S`` on every
  coordinate; accounted as ``Gaussian(z)``. Default split ``r_h = 1/sqrt(L)`` (``S = clip_norm``).
* ``per-layer`` (Nguyen et al. LC): block ``h`` gets std ``sigma k C_h`` where ``sigma`` is the
  run's noise multiplier. Each block is a Gaussian mechanism with multiplier ``sigma``; the ``L``
  blocks compose to one Gaussian with multiplier ``sigma / sqrt(L)`` (divide block ``h`` by
  ``C_h``: every block has sensitivity 1, the whitened vector ``sqrt(L)``, its noise ``sigma``), so
  the step's event is ``Gaussian(sigma / sqrt(L))``. Default ``r_h = 1``. ``--epsilon`` calibrates
  ``sigma`` through that event, so a per-layer run at a target epsilon is as private as a flat one.

Adaptive layerwise clipping re-estimates the ratios at the start of every epoch from per-unit,
per-group gradient norms on a PUBLIC split (the trainer computes them with the current weights,
which are already released, and calls :meth:`public_refresh`; no privacy cost, no event):

* ``alc`` (Nguyen et al.'s enhanced ALC, master constant): ``r_h = e_h / max_h e_h`` so the
  largest block gets ``clip_norm``;
* ``alc-zhang`` (Zhang et al. 2018, dp-GAN): ``C_h = e_h`` (``r_h = e_h``, ``clip_norm`` a scale,
  default 1).

``e_h`` is the mean over public units of ``||g_{u,h}||``; the unit is the run's clipping unit
(one example for IC, a public mini-set of the same size for BC/GBC), so the estimate describes the
vectors that are clipped [our choice; Nguyen writes per-example norms]. Any master-``clip_norm``
schedule (``yu-linear``, ``lin-decay``, ``du-dynamic``, ``exp-decay``, ...) can wrap these
strategies (``base=alc``).

``L`` is the number of independently clipped blocks of the model (``bind_groups``, done by the
trainer from ``grouping``), never hard-coded.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch
from torch import Tensor

from dpclip.clipping.base import (State, StepContext, StrategyBase, finite_or_inf,
                                  positive_finite, set_positive_finite)
from dpclip.clipping.capabilities import Capabilities
from dpclip.clipping.fixed import NORM_EPS
from dpclip.clipping.registry import StrategyEntry, register
from dpclip.events import DpEvent, GaussianEvent

__all__ = ["AdaptiveLayerwiseClip", "PerLayerClip", "ZhangLayerwiseClip", "parse_ratios"]

NOISE_MODES = ("flat", "per-layer")


def parse_ratios(text: str | Sequence[float] | None) -> tuple[float, ...] | None:
    """``"0.5,1,2"`` (or a sequence) -> positive finite floats; ``None``/``""`` -> ``None``."""
    if text is None:
        return None
    if isinstance(text, str):
        if not text.strip():
            return None
        parts = [p for p in text.replace(";", ",").split(",") if p.strip()]
    else:
        parts = list(text)
    return tuple(positive_finite("each ratio (of 'r1,r2,...')", p, "ratios") for p in parts)


@dataclass(frozen=True)
class PerLayerClip(StrategyBase):
    """Per-layer (per-group) clipping with flat or per-layer noise (module docstring).

    Parameters: ``clip_norm`` (master ``C``), ``noise`` (``flat`` | ``per-layer``), ``ratios``
    (``"r_1,...,r_L"``: ``C_h = C r_h``; default ``1/sqrt(L)`` for flat noise, ``1`` for per-layer
    noise), ``grouping`` (``layer``: one block per module owning parameters, ``parameter``: one per
    tensor, or ``"prefix,prefix;prefix"``: ``;``-separated groups of module-name prefixes),
    ``num_groups`` (``L``; set by the trainer from the model, 0 = unbound).
    State: ``ratios`` (the ``r_h`` in force). Sensitivity ``sqrt(sum_h C_h^2)``.
    Paper: McMahan, Ramage, Talwar & Zhang, Learning differentially private recurrent language
    models, ICLR 2018 (flat noise); Nguyen, Nguyen & van Dijk, Batch clipping and adaptive
    layerwise clipping for differential private SGD, 2023 (per-layer noise).
    """

    name: ClassVar[str] = "per-layer"
    norm_kind: ClassVar[str] = "group"
    capabilities: ClassVar[Capabilities] = Capabilities(per_group=True)
    #: the contract suite runs every strategy with 3 groups
    contract_params: ClassVar[dict[str, Any]] = {"num_groups": 3}

    clip_norm: float = 1.0
    noise: str = "flat"
    ratios: str | None = None
    grouping: str = "layer"
    num_groups: int = 0

    def __post_init__(self) -> None:
        owner = type(self).__name__
        set_positive_finite(self, owner, "clip_norm")
        if self.noise not in NOISE_MODES:
            raise ValueError(
                f"{owner}: noise={self.noise!r}; valid: flat (one std z*S everywhere) or "
                "per-layer (std sigma*C_h on block h, accounted as sigma/sqrt(L))"
            )
        if isinstance(self.num_groups, bool) or not isinstance(self.num_groups, int) \
                or self.num_groups < 0:
            raise ValueError(f"{owner}: num_groups must be an int >= 0, got {self.num_groups!r}")
        if not isinstance(self.grouping, str) or not self.grouping.strip():
            raise ValueError(f"{owner}: grouping must be 'layer', 'parameter' or a group spec")
        r = parse_ratios(self.ratios)
        object.__setattr__(self, "ratios", None if r is None else ",".join(repr(x) for x in r))
        if r is not None and self.num_groups and len(r) != self.num_groups:
            raise ValueError(
                f"{owner}: ratios has {len(r)} entries but the model has L = {self.num_groups} "
                f"clipping groups ({self.grouping!r}); give one ratio per group"
            )

    # -- binding ----------------------------------------------------------------------------------
    @property
    def L(self) -> int:
        return max(self.num_groups, 1)

    def bind_groups(self, group_names: Sequence[str]) -> "PerLayerClip":
        """The strategy for a model with these clipping groups (sets ``L``)."""
        return dataclasses.replace(self, num_groups=len(group_names))

    def _default_ratios(self) -> list[float]:
        explicit = parse_ratios(self.ratios)
        if explicit is not None:
            return list(explicit)
        r = 1.0 / math.sqrt(self.L) if self.noise == "flat" else 1.0
        return [r] * self.L

    # -- the protocol -----------------------------------------------------------------------------
    def init_state(self) -> State:
        return {"ratios": self._default_ratios()}

    def _ratios(self, state: State) -> list[float]:
        try:
            r = [float(x) for x in state["ratios"]]
        except (KeyError, TypeError):
            raise ValueError(
                f"{self.name}: state {state!r} has no 'ratios'; start from strategy.init_state()"
            ) from None
        if len(r) != self.L:
            raise ValueError(
                f"{self.name}: state has {len(r)} ratios for L = {self.L} groups; bind the strategy "
                "to the model's groups (bind_groups) before init_state()"
            )
        return r

    def thresholds(self, state: State) -> list[float]:
        """``C_h`` for every group."""
        return [self.clip_norm * r for r in self._ratios(state)]

    def weights(self, norms: Tensor, state: State) -> Tensor:
        c = self.thresholds(state)
        if norms.dim() == 1 and len(c) == 1:  # one group: engines give flat (B,) norms
            return self.weights(norms[:, None], state)[:, 0]
        if norms.dim() != 2 or norms.shape[1] != len(c):
            raise ValueError(
                f"{self.name}: expected per-example per-group norms of shape (B, {len(c)}), got "
                f"{tuple(norms.shape)}; the engine's groups must match the strategy's L = {len(c)} "
                "(the trainer binds them; in library code call bind_groups(groups.names))"
            )
        n = finite_or_inf(norms)
        ch = torch.tensor(c, dtype=n.dtype, device=n.device)
        w = torch.clamp(ch / (n + NORM_EPS), max=1.0)
        return torch.where(torch.isinf(n), torch.zeros_like(w), w)

    def sensitivity(self, state: State) -> float:
        return math.sqrt(sum(c * c for c in self.thresholds(state)))

    def noise_multiplier(self, state: State, base: float) -> float:
        return base if self.noise == "flat" else base / math.sqrt(self.L)

    def planned_event(self, base: float, ctx: StepContext) -> DpEvent:
        return GaussianEvent(base if self.noise == "flat" else base / math.sqrt(self.L))

    def group_noise(self, state: State) -> tuple[float, ...] | None:
        """Per-group noise factors ``f_h``: block ``h`` gets std ``z k f_h`` with ``z`` the event's
        multiplier (``sqrt(L) C_h``, so ``sigma k C_h``); ``None`` for flat noise (``z k S``)."""
        if self.noise == "flat":
            return None
        root = math.sqrt(self.L)
        return tuple(root * c for c in self.thresholds(state))


@dataclass(frozen=True)
class AdaptiveLayerwiseClip(PerLayerClip):
    """Nguyen et al.'s enhanced ALC: ``C_h = C e_h / max_h e_h`` from public norms each epoch.

    ``e_h`` = mean public per-unit norm of block ``h`` at the current weights (module docstring).
    Defaults: per-layer noise (the paper's LC), master ``clip_norm`` 0.2 (their BN-LeNet-5 optimum).
    Until the first refresh every block gets ``C`` (the trainer refreshes before step 0).
    State: ``ratios``, ``public_means`` (the last ``e_h``), ``refreshes``.
    Paper: Nguyen, Nguyen & van Dijk 2023, sections 3.3 and 4.1 (algorithms.md M12 (d)).
    """

    name: ClassVar[str] = "alc"
    capabilities: ClassVar[Capabilities] = Capabilities(per_group=True, public_norms=True)

    clip_norm: float = 0.2
    noise: str = "per-layer"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ratios is not None:
            raise ValueError(
                f"{type(self).__name__}: ratios are estimated from public data each epoch; drop "
                "ratios= (or use the 'per-layer' strategy for fixed ratios)"
            )

    def _default_ratios(self) -> list[float]:
        return [1.0] * self.L

    def init_state(self) -> State:
        return {"ratios": self._default_ratios(), "public_means": None, "refreshes": 0}

    def _ratios_from(self, means: list[float]) -> list[float]:
        top = max(means)
        return [m / top for m in means] if top > 0 else [1.0] * len(means)

    def public_refresh(self, state: State, public_norms: Tensor) -> State:
        """New ratios from per-unit per-group norms ``(n, L)`` of PUBLIC data (pure); with one
        group the flat ``(n,)`` norms of the engines are read as ``(n, 1)``."""
        if public_norms.dim() == 1 and self.L == 1:
            public_norms = public_norms[:, None]
        if public_norms.dim() != 2 or public_norms.shape[1] != self.L:
            raise ValueError(
                f"{self.name}: public norms must have shape (n, {self.L}), got "
                f"{tuple(public_norms.shape)}"
            )
        finite = torch.isfinite(public_norms).all(dim=1)
        rows = public_norms[finite].double()
        if rows.shape[0] == 0:  # nothing usable: keep the current ratios
            return {**state, "refreshes": int(state.get("refreshes", 0)) + 1}
        means = [float(x) for x in rows.mean(dim=0)]
        ratios = self._ratios_from(means)
        ratios = [r if r > 0 else 1e-12 for r in ratios]  # a dead layer: clip it to ~0
        return {**state, "ratios": ratios, "public_means": means,
                "refreshes": int(state.get("refreshes", 0)) + 1}


@dataclass(frozen=True)
class ZhangLayerwiseClip(AdaptiveLayerwiseClip):
    """Zhang et al.'s ALC (dp-GAN): ``C_h = clip_norm * e_h`` (the public mean block norm).

    ``clip_norm`` is a plain scale (default 1: exactly the public mean). Per-layer noise by default.
    Paper: Zhang, Ji & Wang, Differentially private releasing via deep generative model,
    arXiv 1801.01594, 2018 (as described by Nguyen et al.; algorithms.md M12 (c)).
    """

    name: ClassVar[str] = "alc-zhang"

    clip_norm: float = 1.0

    def _ratios_from(self, means: list[float]) -> list[float]:
        return list(means)


register(StrategyEntry(
    name="per-layer",
    cls=PerLayerClip,
    paper="McMahan et al., ICLR 2018 (flat noise); Nguyen et al. 2023 (per-layer noise LC)",
    summary="per-group clipping C_h = C r_h (default C/sqrt(L)); noise flat (z*S) or per-layer "
    "(sigma*C_h, accounted as sigma/sqrt(L))",
))
register(StrategyEntry(
    name="alc",
    cls=AdaptiveLayerwiseClip,
    paper="Nguyen, Nguyen & van Dijk, Batch clipping and adaptive layerwise clipping for DP SGD, "
    "2023 (enhanced ALC)",
    summary="adaptive layerwise clipping: C_h = C e_h / max e_h from public norms each epoch, "
    "per-layer noise",
))
register(StrategyEntry(
    name="alc-zhang",
    cls=ZhangLayerwiseClip,
    paper="Zhang, Ji & Wang, dp-GAN, arXiv 1801.01594, 2018 (ALC)",
    summary="adaptive layerwise clipping: C_h = public mean block norm e_h each epoch, "
    "per-layer noise",
))
