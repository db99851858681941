"""Threshold schedules: wrappers that change the ``clip_norm`` of a strategy over the run.

A schedule WRAPS a threshold strategy (any registered strategy with a ``clip_norm`` field: fixed,
auto-s, auto-v, psac, ...); it never subclasses it. The inner strategy's ``clip_norm`` is the
initial threshold ``C0``; before each step ``begin_step`` (public, data-independent) computes the
step's threshold ``C_t`` from the ``StepContext`` and stores it in the state, and ``weights`` /
``sensitivity`` are those of ``dataclasses.replace(inner, clip_norm=C_t)``. The inner's own state
(if any) is threaded through ``state["inner"]`` and its events are passed on unchanged.

=============== =========================================== ===================================
name            threshold ``C_t`` (and noise)               paper
=============== =========================================== ===================================
``yu-linear``   ``C0 s(u)``, ``s = 1/min(2, 1+u)`` or       Yu, Zhang & Chen 2018 [RECON]
                ``max(1/2, 1 - u/2)``, ``u`` = progress
``lin-decay``   ``C0 / t^a``, ``t`` = epoch index from 1    Lin et al. 2022, Decay strategy
``du-dynamic``  ``C0 rho_c^(t/T)``; noise multiplier        Du et al. 2021, dynamic DP-SGD
                ``sigma_base rho_mu^(t/T)``
``transfer``    ``thresholds[t]`` (last value after the     Lin et al. 2022, Transfer strategy
                end), a stored per-epoch schedule
=============== =========================================== ===================================

Privacy: a threshold that depends only on public facts (step, epoch, plan length) costs nothing:
the sensitivity of step ``t`` is the inner's at ``C_t`` and the noise std is ``z_t`` times it, so
``yu-linear``, ``lin-decay`` and ``transfer`` emit exactly the inner's events (``transfer``'s
schedule must come from PUBLIC data, e.g. ``dpclip.search`` run on a public proxy). ``du-dynamic`` also schedules the
noise multiplier; each step's event is ``Gaussian(sigma_t)`` and the run is a heterogeneous
composition accounted step by step through the ledger (PLD/RDP), never with GDP/CLT.

From the command line (``make_strategy``)::

    --strategy yu-linear --param base=auto-s --param clip_norm=1.0 --param base.gamma=0.05 \
        --param variant=linear

``base`` names the inner strategy (default ``fixed``), ``base.<name>`` sets its parameters,
``clip_norm`` is ``C0`` (the inner's ``clip_norm``), the rest are the schedule's own fields.
``describe()`` returns the same flat form, so ``make_strategy(name, s.describe())`` rebuilds ``s``.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping

from torch import Tensor

from dpclip.clipping.base import (
    ClippingStrategy,
    Release,
    State,
    StepContext,
    positive_finite,
)
from dpclip.clipping.capabilities import Capabilities, capabilities_of
from dpclip.clipping.fixed import FixedClip
from dpclip.clipping.registry import (
    STRATEGIES,
    StrategyEntry,
    make_strategy,
    register,
)
from dpclip.events import DpEvent
from dpclip.registry import coerce

__all__ = [
    "DuDynamic",
    "ExpDecay",
    "GRANULARITIES",
    "LinDecay",
    "Transfer",
    "YU_VARIANTS",
    "YuLinear",
    "du_decay",
    "yu_linear_scale",
    "yu_reciprocal_scale",
]

#: When a schedule moves: once per epoch (from the epoch index) or at every step.
GRANULARITIES = ("epoch", "step")

#: Prefix of the inner strategy's parameters in ``from_params`` / ``describe``.
BASE_PREFIX = "base."


def yu_reciprocal_scale(u: float) -> float:
    """``s(u) = 1 / min(2, 1 + u)``: ``C0`` at ``u = 0``, ``C0/2`` from ``u = 1`` on [RECON]."""
    return 1.0 / min(2.0, 1.0 + u)


def yu_linear_scale(u: float) -> float:
    """``s(u) = max(1/2, 1 - u/2)``: straight line from ``C0`` to ``C0/2`` at ``u = 1`` [RECON]."""
    return max(0.5, 1.0 - u / 2.0)


#: Yu et al.'s threshold shape ``s(u)``, by ``variant`` name.
YU_VARIANTS: dict[str, Callable[[float], float]] = {
    "reciprocal": yu_reciprocal_scale,
    "linear": yu_linear_scale,
}


def du_decay(final_over_initial: float, position: int, horizon: int) -> float:
    """``rho^(position / horizon)``: Du et al.'s geometric decay factor.

    The one place where the factor is computed: ``du-dynamic`` uses it for the state (what the
    step emits) and for ``planned_event`` (what calibration plans), so both agree bit for bit.
    """
    return final_over_initial ** (position / horizon)


def _check_ctx(ctx: StepContext, owner: str) -> None:
    if not (ctx.total_steps >= 1 and ctx.steps_per_epoch >= 1 and ctx.step >= 0
            and ctx.epoch >= 0):
        raise ValueError(
            f"{owner}: the step context needs total_steps >= 1, steps_per_epoch >= 1, step >= 0 "
            f"and epoch >= 0, got {ctx!r}"
        )


def _check_choice(name: str, value: str, choices: tuple[str, ...] | list[str], owner: str) -> str:
    if value not in choices:
        raise ValueError(
            f"{owner}: unknown {name} {value!r}; valid: {', '.join(repr(c) for c in choices)}"
        )
    return value


def _check_ratio(name: str, value: float, owner: str) -> float:
    v = positive_finite(name, value, owner)
    if v > 1:
        raise ValueError(
            f"{owner}: {name} is final / initial and must be in (0, 1] (a decay), got {value!r}; "
            f"if your paper writes C0 rho^(-t/T) with rho > 1, pass 1/rho"
        )
    return v


def _has_clip_norm(cls: type) -> bool:
    """A dataclass with a ``clip_norm`` field that clips norms (not a per-example transform)."""
    return (
        dataclasses.is_dataclass(cls)
        and any(f.name == "clip_norm" for f in dataclasses.fields(cls))
        # P-GRAD strategies (AdaClip) need step-level hooks a schedule does not forward
        and not capabilities_of(cls).per_example_grads
    )


def _schedulable() -> list[str]:
    """Registered norm strategies a schedule can wrap: a ``clip_norm`` field, not a wrapper."""
    return sorted(
        n for n, e in STRATEGIES.items()
        if e.kind == "norm" and _has_clip_norm(e.cls) and not hasattr(e.cls, "from_params")
    )


class _ThresholdSchedule:
    """Shared machinery of the schedule wrappers (not a strategy by itself).

    A subclass is a frozen dataclass with an ``inner`` field and its own parameters, and defines
    ``_threshold(ctx)`` (``C_t``) and ``_counters(ctx)`` (the public schedule position stored in
    the state); ``du-dynamic`` also overrides the noise hooks.
    """

    name: ClassVar[str] = ""
    inner: ClippingStrategy

    # -- subclass hooks ---------------------------------------------------------------------------
    def _threshold(self, ctx: StepContext) -> float:
        raise NotImplementedError

    def _counters(self, ctx: StepContext) -> dict[str, Any]:
        raise NotImplementedError

    def _initial_counters(self) -> dict[str, Any]:
        raise NotImplementedError

    def _noise_scale(self, state: State) -> float:
        """Factor applied to the base noise multiplier (1 unless the schedule moves the noise)."""
        return 1.0

    def _planned_noise_scale(self, ctx: StepContext) -> float:
        return 1.0

    # -- helpers ----------------------------------------------------------------------------------
    def _check_inner(self) -> None:
        owner = type(self).__name__
        inner = self.inner
        if isinstance(inner, type) or not isinstance(inner, ClippingStrategy):
            raise TypeError(
                f"{owner}: inner must be a clipping-strategy instance (e.g. FixedClip(1.0)), got "
                f"{inner!r}"
            )
        if not _has_clip_norm(type(inner)):
            raise ValueError(
                f"{owner}: inner strategy {inner!r} has no clip_norm field (or clips transformed "
                f"per-example gradients), so it has no threshold a schedule can drive; wrap one "
                f"of: {', '.join(_schedulable())}"
            )
        # the field must drive the threshold: a strategy that keeps its live threshold in its
        # state (adaptive ones) would silently ignore the schedule (anchors P13)
        state = inner.init_state()
        moved = self._inner_at(2.0 * self.initial_clip_norm)
        if moved.sensitivity(state) == inner.sensitivity(state):
            raise ValueError(
                f"{owner}: the sensitivity of inner strategy {inner!r} does not follow its "
                "clip_norm field (its threshold lives in its state), so a schedule cannot drive "
                f"it; wrap one of: {', '.join(_schedulable())}"
            )

    @property
    def norm_kind(self) -> str:  # type: ignore[override]
        """The inner's (a schedule does not change what norms are computed)."""
        return self.inner.norm_kind

    @property
    def initial_clip_norm(self) -> float:
        """``C0``: the inner strategy's ``clip_norm``."""
        return float(self.inner.clip_norm)  # type: ignore[attr-defined]

    def _inner_at(self, clip_norm: float) -> ClippingStrategy:
        return dataclasses.replace(self.inner, clip_norm=clip_norm)  # type: ignore[type-var]

    def _current(self, state: State) -> ClippingStrategy:
        try:
            c = state["clip_norm"]
        except (KeyError, TypeError):
            raise ValueError(
                f"{self.name}: state {state!r} has no 'clip_norm'; start from "
                "strategy.init_state() and call begin_step before each step"
            ) from None
        return self._inner_at(c)

    def _inner_ctx(self, ctx: StepContext, scale: float) -> StepContext:
        if scale == 1.0:
            return ctx
        return dataclasses.replace(ctx, base_noise_multiplier=ctx.base_noise_multiplier * scale)

    # -- the strategy protocol --------------------------------------------------------------------
    def init_state(self) -> State:
        return {
            "clip_norm": self.initial_clip_norm,
            **self._initial_counters(),
            "inner": dict(self.inner.init_state()),
        }

    def begin_step(self, state: State, ctx: StepContext) -> State:
        _check_ctx(ctx, self.name)
        new = dict(state)
        new["clip_norm"] = self._threshold(ctx)
        new.update(self._counters(ctx))
        inner_ctx = self._inner_ctx(ctx, self._noise_scale(new))
        new["inner"] = dict(self._current(new).begin_step(state["inner"], inner_ctx))
        return new

    def weights(self, norms: Tensor, state: State) -> Tensor:
        return self._current(state).weights(norms, state["inner"])

    def sensitivity(self, state: State) -> float:
        return self._current(state).sensitivity(state["inner"])

    def noise_multiplier(self, state: State, base: float) -> float:
        scaled = base * self._noise_scale(state)
        return self._current(state).noise_multiplier(state["inner"], scaled)

    def planned_event(self, base: float, ctx: StepContext) -> DpEvent:
        _check_ctx(ctx, self.name)
        scale = self._planned_noise_scale(ctx)
        return self._inner_at(self._threshold(ctx)).planned_event(
            base * scale, self._inner_ctx(ctx, scale)
        )

    def update(
        self, state: State, norms: Tensor, ctx: StepContext, release: Release
    ) -> tuple[State, tuple[DpEvent, ...]]:
        inner_ctx = self._inner_ctx(ctx, self._noise_scale(state))
        inner_state, events = self._current(state).update(state["inner"], norms, inner_ctx, release)
        return {**state, "inner": dict(inner_state)}, events

    # -- forwarded hooks of per-group inner strategies (per-layer, alc, alc-zhang) ---------------
    def group_noise(self, state: State) -> tuple[float, ...] | None:
        inner = self._current(state)
        return inner.group_noise(state["inner"]) if capabilities_of(inner).per_group else None

    def bind_groups(self, group_names: Any) -> "_ThresholdSchedule":
        if not capabilities_of(self.inner).per_group:
            return self
        return dataclasses.replace(  # type: ignore[type-var]
            self, inner=self.inner.bind_groups(group_names))

    @property
    def capabilities(self) -> Capabilities:
        """The inner strategy's (per-group clipping, public norms); a schedule never wraps a
        bound-based or P-GRAD strategy (``_has_clip_norm``)."""
        return capabilities_of(self.inner)

    @property
    def grouping(self) -> str:
        return str(self.inner.grouping) if capabilities_of(self.inner).per_group else "layer"

    def public_refresh(self, state: State, public_norms: Tensor) -> State:
        inner = self._current(state)
        return {**state, "inner": dict(inner.public_refresh(state["inner"], public_norms))}

    def describe(self) -> dict[str, Any]:
        """Flat, JSON-friendly: ``base``, ``clip_norm`` (C0), ``base.<k>``, own parameters."""
        inner = {k: v for k, v in self.inner.describe().items() if k != "clip_norm"}
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)  # type: ignore
               if f.name != "inner"}
        return {
            "base": self.inner.name,
            "clip_norm": self.initial_clip_norm,
            **{BASE_PREFIX + k: v for k, v in inner.items()},
            **own,
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> "_ThresholdSchedule":
        """Build from flat (possibly string-valued) CLI/config parameters.

        ``base`` (registered name of the inner strategy, default ``"fixed"``), ``clip_norm``
        (``C0``, the inner's ``clip_norm``), ``base.<k>`` (the inner's other parameters) and the
        schedule's own fields. Unknown parameters raise ``ValueError`` listing the valid ones.
        """
        params = dict(params)
        base = str(params.pop("base", "fixed")).strip()
        eligible = _schedulable()
        if base not in eligible:
            raise ValueError(
                f"strategy {cls.name!r}: base={base!r} cannot be wrapped; valid bases (strategies "
                f"with a clip_norm threshold): {', '.join(eligible)}"
            )
        inner_names = [k for k in STRATEGIES[base].parameters() if k != "clip_norm"]
        own_fields = {f.name: f for f in dataclasses.fields(cls)  # type: ignore[arg-type]
                      if f.name != "inner"}
        valid = ["base", "clip_norm", *(BASE_PREFIX + k for k in inner_names), *own_fields]
        if BASE_PREFIX + "clip_norm" in params:
            raise ValueError(
                f"strategy {cls.name!r}: give the initial threshold as clip_norm=..., not "
                f"base.clip_norm (the schedule sets the inner's clip_norm)"
            )
        unknown = sorted(
            k for k in params
            if k != "clip_norm" and k not in own_fields
            and not (k.startswith(BASE_PREFIX) and k[len(BASE_PREFIX):] in inner_names)
        )
        if unknown:
            raise ValueError(
                f"strategy {cls.name!r} has no parameter(s) {unknown}; valid parameters: "
                f"{', '.join(valid)}"
            )
        inner_params = {k[len(BASE_PREFIX):]: v for k, v in params.items()
                        if k.startswith(BASE_PREFIX)}
        if "clip_norm" in params:
            inner_params["clip_norm"] = params["clip_norm"]
        inner = make_strategy(base, inner_params)
        hints = typing.get_type_hints(cls)
        own = {k: coerce(v, hints.get(k, own_fields[k].type), k, f"strategy {cls.name!r}",
                         "parameter") for k, v in params.items() if k in own_fields}
        return cls(inner=inner, **own)  # type: ignore[call-arg]


@dataclass(frozen=True)
class YuLinear(_ThresholdSchedule):
    """Yu et al.'s decaying threshold: ``C_t = C0 s(u)`` with ``u`` the training progress.

    ``variant="reciprocal"`` (default): ``s(u) = 1/min(2, 1 + u)``; ``variant="linear"``:
    ``s(u) = max(1/2, 1 - u/2)``. Both go from ``C0`` to ``C0/2`` at ``u = 1`` and stay there.
    ``granularity="epoch"`` (default): ``u = epoch / E`` with ``E = ceil(total_steps /
    steps_per_epoch)`` (Lin et al. apply thresholds per epoch), so ``C`` is constant inside an
    epoch; ``granularity="step"``: ``u = step / total_steps``. ``C0`` is the inner's ``clip_norm``.

    Privacy: free (data-independent schedule, constant noise multiplier): sensitivity is the
    inner's at ``C_t``, events are the inner's (``Gaussian(z)`` for fixed / auto-s / auto-v / psac).
    State: ``clip_norm`` (``C_t``), ``progress`` (``u``), ``inner`` (the inner's state).
    Edge cases: steps past the plan (``u > 1``) keep ``C0/2``.
    Paper: D. Yu, H. Zhang, W. Chen, "Improve the gradient perturbation approach for
    differentially private optimization", NeurIPS 2018 workshop. Its formula survives only
    garbled (``C / min(2, 1 + 1/T)`` in Lin et al.); BOTH variants are reconstructions
    (algorithms.md M3, [RECON]), not verified against the original paper.
    """

    name: ClassVar[str] = "yu-linear"

    inner: ClippingStrategy = field(default_factory=FixedClip)
    variant: str = "reciprocal"
    granularity: str = "epoch"

    def __post_init__(self) -> None:
        self._check_inner()
        _check_choice("variant", self.variant, list(YU_VARIANTS), "YuLinear")
        _check_choice("granularity", self.granularity, GRANULARITIES, "YuLinear")

    def progress(self, ctx: StepContext) -> float:
        """``u``: ``epoch / E`` (epoch granularity) or ``step / total_steps`` (step)."""
        if self.granularity == "epoch":
            epochs = math.ceil(ctx.total_steps / ctx.steps_per_epoch)
            return ctx.epoch / epochs
        return ctx.step / ctx.total_steps

    def _threshold(self, ctx: StepContext) -> float:
        return self.initial_clip_norm * YU_VARIANTS[self.variant](self.progress(ctx))

    def _counters(self, ctx: StepContext) -> dict[str, Any]:
        return {"progress": self.progress(ctx)}

    def _initial_counters(self) -> dict[str, Any]:
        return {"progress": 0.0}


@dataclass(frozen=True)
class LinDecay(_ThresholdSchedule):
    """Lin et al.'s Decay strategy: ``C_t = C0 / t^a`` with ``t = epoch + 1`` (epochs count from 1).

    Test vector T12 (``C0 = 1, a = 0.5``): ``C_1 = 1, C_4 = 0.5, C_9 = 0.333``. The threshold
    changes once per epoch. ``C0`` is the inner's ``clip_norm`` (default 1.0, the inner's
    default); Lin et al. take ``C0`` = the mean first-epoch optimum of their greedy search on a
    public proxy dataset (5 runs): give ``c0_from="greedy"`` instead of ``clip_norm`` to
    ``dpclip train``/``dpclip run`` and they resolve it (``dpclip.search.resolve_strategy_params``:
    5 one-epoch greedy searches, seeds 0..4, on the public proxy, cached in the results store),
    recording ``c0_from="greedy:<proxy>:<runs>:<schedule names>"``.

    Privacy: free (data-independent, constant noise multiplier); sensitivity is the inner's at
    ``C_t``; events are the inner's. State: ``clip_norm`` (``C_t``), ``epoch`` (``t``, from 1),
    ``inner``. Parameters: ``a`` in (0, 1] (default 0.5, best on all of Lin's datasets).
    Paper: Lin, Yan, Kou, Huang, Peng, Zhang, Dong, "Understanding adaptive gradient clipping in
    DP-SGD, empirically", Int. J. Intell. Syst. 2022 (Decay strategy; algorithms.md M10).
    """

    name: ClassVar[str] = "lin-decay"

    inner: ClippingStrategy = field(default_factory=FixedClip)
    a: float = 0.5

    #: public provenance of ``C0`` (free text, recorded in the run's params): ``""`` when
    #: ``clip_norm`` was given; ``"greedy:..."`` when the CLI/harness resolved ``C0`` from greedy
    #: searches on a public proxy (``dpclip.search.resolve_strategy_params``). The unresolved
    #: request ``c0_from="greedy"`` is refused here: strategies do no I/O.
    c0_from: str = ""

    def __post_init__(self) -> None:
        self._check_inner()
        if not isinstance(self.c0_from, str):
            raise TypeError(f"LinDecay: c0_from must be a string, got {self.c0_from!r}")
        if self.c0_from.strip() == "greedy":
            raise ValueError(
                "LinDecay: c0_from='greedy' asks for C0 = mean first-epoch greedy threshold on a "
                "public proxy; it is resolved by `dpclip train`/`dpclip run` (or "
                "dpclip.search.resolve_strategy_params) against the results store, not by the "
                "strategy. In library code pass clip_norm=C0 instead"
            )
        a = positive_finite("a", self.a, "LinDecay")
        if a > 1:
            raise ValueError(f"LinDecay: a must be in (0, 1] (Lin et al.; default 0.5), got {a!r}")
        object.__setattr__(self, "a", a)

    def _threshold(self, ctx: StepContext) -> float:
        return self.initial_clip_norm / float(ctx.epoch + 1) ** self.a

    def _counters(self, ctx: StepContext) -> dict[str, Any]:
        return {"epoch": ctx.epoch + 1}

    def _initial_counters(self) -> dict[str, Any]:
        return {"epoch": 1}


@dataclass(frozen=True)
class ExpDecay(_ThresholdSchedule):
    """Geometric per-epoch decay of the master threshold: ``C_t = C0 * rate^t``, ``t`` = epoch.

    Nguyen et al.'s ``C_decay`` (0.9 per epoch in their Table 3), usable on any threshold strategy
    (``base=alc`` for their master constant). Privacy: free (data-independent); events are the
    inner's. State: ``clip_norm``, ``epoch`` (0-based), ``inner``. ``rate`` in (0, 1].
    Paper: Nguyen, Nguyen & van Dijk 2023, Table 3 (algorithms.md M12 (d)).
    """

    name: ClassVar[str] = "exp-decay"

    inner: ClippingStrategy = field(default_factory=FixedClip)
    rate: float = 0.9

    def __post_init__(self) -> None:
        self._check_inner()
        rate = positive_finite("rate", self.rate, "ExpDecay")
        if rate > 1:
            raise ValueError(f"ExpDecay: rate must be in (0, 1] (C_t = C0 rate^epoch), got {rate}")
        object.__setattr__(self, "rate", rate)

    def _threshold(self, ctx: StepContext) -> float:
        return self.initial_clip_norm * self.rate ** ctx.epoch

    def _counters(self, ctx: StepContext) -> dict[str, Any]:
        return {"epoch": ctx.epoch}

    def _initial_counters(self) -> dict[str, Any]:
        return {"epoch": 0}


@dataclass(frozen=True)
class DuDynamic(_ThresholdSchedule):
    """Du et al.'s dynamic DP-SGD: decaying threshold AND decaying noise multiplier.

    With ``T = total_steps`` and ``t`` the schedule position (``granularity="epoch"``, default,
    as the reference code: the global step at the start of the current epoch,
    ``epoch * steps_per_epoch``; ``"step"``: the step index)::

        C_t     = C0 * clip_final_over_initial ** (t / T)
        sigma_t = sigma_base * noise_final_over_initial ** (t / T)

    ``C0`` is the inner's ``clip_norm``; ``sigma_base`` is the run's base noise multiplier. The
    ratios are final / initial (``sigma_T = 0.7 sigma_0`` for the default 0.7; test vector T10:
    ``sigma_0 = 3.1643 -> sigma_T = 2.2150``), exposed instead of a bare ``rho`` because the
    sources disagree on its sign (``C0 rho^(-t/T)`` with ``rho > 1`` vs ``C0 rho^(t/T)``).

    Privacy: the gradient sum of step ``t`` has sensitivity ``S_t`` (the inner's at ``C_t``) and
    noise std ``sigma_t S_t``; the step emits ``Gaussian(sigma_t)`` (``noise_multiplier(state,
    base)`` returns ``sigma_t``, ``planned_event(base, ctx)`` returns the same ``Gaussian(sigma_t)``
    from the same float computation, ``du_decay``). The run is a heterogeneous composition: the
    trainer calibrates ``sigma_base`` with its PLD/RDP accountant so that the whole planned ledger
    meets the target epsilon ("noise calibrated so that the run meets the target"). Du et al.'s
    own calibration uses the GDP central limit theorem (``dpclip.accounting.gdp``), which
    under-reports epsilon; we never use it for a guarantee.
    State: ``clip_norm`` (``C_t``), ``noise_scale`` (``sigma_t / sigma_base``), ``position``
    (``t``), ``inner`` (the inner's state; the inner sees ``sigma_t`` as its base multiplier).
    Edge cases: steps past the plan keep decaying (``t > T``). With ``granularity="step"`` every
    step is a distinct event, so accounting costs ``T`` PLD/RDP compositions (a 500-step ledger:
    ~60 s per epsilon with PLD, ~18 s with RDP; calibration needs about ten): impractical beyond
    a few hundred steps. ``"epoch"`` has one distinct event per epoch.
    Paper: J. Du, S. Li, X. Chen, S. Chen, M. Hong, "Dynamic differential-privacy preserving SGD",
    arXiv 2111.00173 (algorithms.md M4; formulas from the reference code).
    """

    name: ClassVar[str] = "du-dynamic"

    inner: ClippingStrategy = field(default_factory=FixedClip)
    clip_final_over_initial: float = 0.5
    noise_final_over_initial: float = 0.7
    granularity: str = "epoch"

    def __post_init__(self) -> None:
        self._check_inner()
        object.__setattr__(
            self, "clip_final_over_initial",
            _check_ratio("clip_final_over_initial", self.clip_final_over_initial, "DuDynamic"),
        )
        object.__setattr__(
            self, "noise_final_over_initial",
            _check_ratio("noise_final_over_initial", self.noise_final_over_initial, "DuDynamic"),
        )
        _check_choice("granularity", self.granularity, GRANULARITIES, "DuDynamic")

    def position(self, ctx: StepContext) -> int:
        """``t``: ``epoch * steps_per_epoch`` (epoch granularity) or ``step``."""
        return ctx.epoch * ctx.steps_per_epoch if self.granularity == "epoch" else ctx.step

    def _threshold(self, ctx: StepContext) -> float:
        return self.initial_clip_norm * du_decay(
            self.clip_final_over_initial, self.position(ctx), ctx.total_steps
        )

    def _planned_noise_scale(self, ctx: StepContext) -> float:
        return du_decay(self.noise_final_over_initial, self.position(ctx), ctx.total_steps)

    def _noise_scale(self, state: State) -> float:
        return float(state.get("noise_scale", 1.0))

    def _counters(self, ctx: StepContext) -> dict[str, Any]:
        return {"position": self.position(ctx), "noise_scale": self._planned_noise_scale(ctx)}

    def _initial_counters(self) -> dict[str, Any]:
        return {"position": 0, "noise_scale": 1.0}


def _as_thresholds(value: Any, owner: str) -> tuple[float, ...]:
    """A non-empty tuple of positive finite floats from a list/tuple or ``"0.3,0.2"`` text."""
    if isinstance(value, str):
        text = value.strip().strip("[]()")
        value = [p for p in text.replace(";", ",").split(",") if p.strip()]
    if isinstance(value, (int, float)):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(
            f"{owner}: thresholds must be a non-empty list of per-epoch thresholds, e.g. "
            f"thresholds=[0.5, 0.3, 0.2] (or schedule=NAME from the results store), got {value!r}"
        )
    out = []
    for i, v in enumerate(value):
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"{owner}: thresholds[{i}]={v!r} is not a number") from None
        out.append(positive_finite(f"thresholds[{i}]", f, owner))
    return tuple(out)


@dataclass(frozen=True)
class Transfer(_ThresholdSchedule):
    """Lin et al.'s Transfer strategy: replay a per-epoch threshold schedule found elsewhere.

    ``C_t = thresholds[t]`` at epoch ``t`` (0-based here, the schedule's first entry is epoch 1);
    past the end of the list the last value is kept. The schedule comes from Lin et al.'s greedy
    search (``dpclip.search``) run on a PUBLIC proxy dataset with the same architecture, batch
    size, learning rate, noise multiplier and number of epochs. ``schedule`` names the stored
    schedule the thresholds came from (``dpclip schedules``); it is a record only: the CLI and the
    harness resolve ``schedule=NAME`` from the results store into ``thresholds`` (strategies do no
    I/O; ``dpclip.search.resolve_strategy_params``). The inner's ``clip_norm`` is set to
    ``thresholds[0]``.

    Privacy: free when the schedule is public (derived from public data only): the thresholds are
    then data-independent constants, the sensitivity of epoch ``t`` is the inner's at ``C_t``
    (``C_t`` for ``fixed``) and the events are the inner's (``Gaussian(z)``). A schedule searched
    on the private data itself is NOT private; the resolver refuses such stored schedules.
    State: ``clip_norm`` (``C_t``), ``epoch`` (1-based), ``inner``.
    Paper: Lin et al., "Understanding adaptive gradient clipping in DP-SGD, empirically", IJIS
    2022 (Transfer strategy; algorithms.md M9).
    """

    name: ClassVar[str] = "transfer"
    #: parameters the registry contract suite builds it with
    contract_params: ClassVar[dict[str, Any]] = {"thresholds": [1.0, 0.5, 0.25]}

    inner: ClippingStrategy = field(default_factory=FixedClip)
    thresholds: tuple[float, ...] = (1.0,)
    schedule: str = ""

    def __post_init__(self) -> None:
        th = _as_thresholds(self.thresholds, "Transfer")
        object.__setattr__(self, "thresholds", th)
        if not isinstance(self.schedule, str):
            raise TypeError(f"Transfer: schedule must be a name (string), got {self.schedule!r}")
        inner = self.inner
        if isinstance(inner, ClippingStrategy) and not isinstance(inner, type) and \
                _has_clip_norm(type(inner)):
            object.__setattr__(self, "inner", self._inner_at_value(inner, th[0]))
        self._check_inner()

    @staticmethod
    def _inner_at_value(inner: ClippingStrategy, c: float) -> ClippingStrategy:
        return dataclasses.replace(inner, clip_norm=c)  # type: ignore[type-var]

    def threshold_at_epoch(self, epoch: int) -> float:
        """``thresholds[epoch]`` (0-based epoch), the last value past the end."""
        return self.thresholds[min(max(int(epoch), 0), len(self.thresholds) - 1)]

    def _threshold(self, ctx: StepContext) -> float:
        return self.threshold_at_epoch(ctx.epoch)

    def _counters(self, ctx: StepContext) -> dict[str, Any]:
        return {"epoch": ctx.epoch + 1}

    def _initial_counters(self) -> dict[str, Any]:
        return {"epoch": 1}

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["thresholds"] = list(self.thresholds)
        return d

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> "_ThresholdSchedule":
        """As the other schedules, plus: ``thresholds`` (list or ``"0.3,0.2"``) is required;
        ``schedule=NAME`` alone must first be resolved from the results store."""
        params = dict(params)
        if "thresholds" not in params:
            if "schedule" in params:
                raise ValueError(
                    f"strategy 'transfer': schedule={params['schedule']!r} names a stored "
                    "schedule; it is resolved into thresholds by `dpclip train`/`dpclip run` "
                    "(dpclip.search.resolve_strategy_params with a ResultsStore). In library "
                    "code pass thresholds=[...]; `dpclip schedules` lists the stored ones"
                )
            raise ValueError(
                "strategy 'transfer' needs thresholds=[C_1, C_2, ...] (per epoch) or "
                "schedule=NAME (a schedule stored by `dpclip search`; see `dpclip schedules`)"
            )
        th = _as_thresholds(params["thresholds"], "strategy 'transfer'")
        params["thresholds"] = th
        if "clip_norm" in params:
            given = float(params["clip_norm"])
            if given != th[0]:
                raise ValueError(
                    f"strategy 'transfer': clip_norm={given} conflicts with thresholds[0]="
                    f"{th[0]}; the thresholds set the clip norm, leave clip_norm out"
                )
        return super().from_params(params)


register(
    StrategyEntry(
        name="yu-linear",
        cls=YuLinear,
        paper="Yu, Zhang & Chen, Improve the gradient perturbation approach for DP "
        "optimization, NeurIPS 2018 workshop (schedule reconstructed)",
        summary="schedule: C0 -> C0/2 over training, 1/min(2, 1+u) or max(1/2, 1-u/2); wraps "
        "base (fixed, auto-s, ...)",
    )
)
register(
    StrategyEntry(
        name="lin-decay",
        cls=LinDecay,
        paper="Lin et al., Understanding adaptive gradient clipping in DP-SGD, empirically, "
        "IJIS 2022 (Decay)",
        summary="schedule: C_t = C0 / t^a per epoch (t from 1); wraps base (fixed, auto-s, ...)",
    )
)
register(
    StrategyEntry(
        name="exp-decay",
        cls=ExpDecay,
        paper="Nguyen, Nguyen & van Dijk, Batch clipping and adaptive layerwise clipping for DP "
        "SGD, 2023 (C_decay)",
        summary="schedule: C_t = C0 * rate^epoch (default 0.9); wraps base (fixed, alc, ...)",
    )
)
register(
    StrategyEntry(
        name="du-dynamic",
        cls=DuDynamic,
        paper="Du et al., Dynamic differential-privacy preserving SGD, arXiv 2111.00173, 2021",
        summary="schedule: clip C0 rho_c^(t/T) and noise multiplier sigma rho_mu^(t/T), "
        "accounted per step; wraps base",
    )
)
register(
    StrategyEntry(
        name="transfer",
        cls=Transfer,
        paper="Lin et al., Understanding adaptive gradient clipping in DP-SGD, empirically, "
        "IJIS 2022 (Transfer)",
        summary="schedule: per-epoch thresholds replayed from a greedy search on public data "
        "(thresholds=[...] or schedule=NAME); wraps base",
    )
)
