"""White-box audit of ONE private step for any strategy x engine x clipping unit x sampling.

:func:`audit_step` runs the real :func:`dpclip.training.step.dp_step` (or a ``step_fn`` with its signature:
the mutation tests pass broken steps) and returns epsilon lower bounds next to the epsilon the
step claims. Every canary takes part in ONE step only, with its own fair inclusion coin drawn
before that step, so by adaptive composition the claim it is compared with is the epsilon of one
step's inner event (the sampler's amplification wrapper stripped: the canaries are in the batch
when included), the largest over the steps run.

Two designs, chosen by the strategy and the unit:

* ``dirac`` (per-example units ``ic``, norm-based strategies): ``canaries_per_step`` canaries per
  step on a model ``sum_h Linear_h(m, 1)`` (``L = 3`` groups for per-group strategies, else 1)
  whose per-example loss is linear, so canary ``j``'s gradient is ``a e_j`` in every group
  (``a`` = ``canary_norm``, default 100 x the sensitivity: every strategy clips it to its bound).
  Poisson sampling (add/remove): an included canary is in the batch, an excluded one is not;
  fixed-size sampling (replace-one): slot ``j`` holds the canary ``+a e_j`` or its replacement
  ``-a e_j``, so the batch size is constant. Canary ``j``'s score is coordinate ``j`` of the
  released gradient (or, for P-GRAD strategies, of the released whitened mean), divided by the
  step's public per-coordinate noise std and averaged over the groups.
* ``trial`` (batch units ``bc``/``gbc`` and bound-based strategies): one canary per step, each
  step an independent run from the initial state; ``D`` holds public anchor examples and ``D'``
  adds (Poisson) or swaps in (fixed-size) the canary. Two noiseless runs of the same step give the
  deterministic outputs on ``D`` and ``D'`` (gradient and every extra release the strategy makes,
  seen through :class:`ObservedStrategy`); the score is the likelihood-ratio projection of the
  noisy outputs on their difference, standardised, so an exact Gaussian step gives ``N(0, 1)``
  against ``N(mu, 1)`` with ``mu`` the step's true privacy parameter for this pair.

Estimators: :func:`~dpclip.audit.estimators.one_run_epsilon` (no assumption),
:func:`~dpclip.audit.estimators.one_run_fdp_epsilon` (Gaussian trade-off) and
:func:`~dpclip.audit.estimators.gaussian_shift_epsilon` (Gaussian release, the white-box fit of
Nasr et al. 2023: the tight one; its ratio to the claim is the figure to read). The audit's own
coins and noise come from generators seeded with ``seed`` (reproducible and NOT private: the audit
releases nothing about real data; its canaries are synthetic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor, nn

from dpclip._checks import check_integer, check_nonnegative, check_open_unit
from dpclip.audit.estimators import (
    AuditResult,
    GaussianShiftResult,
    gaussian_mu_for,
    gaussian_shift_epsilon,
    one_run_epsilon,
    one_run_fdp_epsilon,
)
from dpclip.clipping.base import State, StepContext
from dpclip.clipping.capabilities import capabilities_of
from dpclip.engine import get_engine
from dpclip.events import DpEvent, GaussianEvent, PoissonSampledEvent, SampledWithoutReplacementEvent
from dpclip.noise import make_generator, noise_std
from dpclip.training.private import bind_clipping_groups
from dpclip.training.sampling import FixedSizeSampler, PoissonSampler
from dpclip.training.step import dp_step
from dpclip.training.units import MiniSetSampler, UnitConfig
from dpclip.accounting import epsilon

__all__ = ["ObservedStrategy", "StepAudit", "audit_step", "inner_event", "step_epsilon"]

StepFn = Callable[..., Any]
SAMPLINGS = ("poisson", "fixed-size")


class ObservedStrategy:
    """Wraps a strategy and records what it releases (the audit's white-box view).

    Everything is delegated to the wrapped strategy, except that ``update``'s ``release`` callback
    is wrapped to record every extra release ``(noisy value, noise std)`` in :attr:`releases` and,
    with ``noiseless=True``, to return the value WITHOUT noise (the audit's reference runs), and
    ``untransform`` (P-GRAD strategies) records the whitened noisy mean and its noise std. The
    events are the wrapped strategy's own."""

    def __init__(self, inner: Any, *, noiseless: bool = False) -> None:
        self._inner = inner
        self._noiseless = noiseless
        self.releases: list[tuple[Tensor, float]] = []
        self.whitened: tuple[dict[str, Tensor], float] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def update(self, state: State, norms: Tensor, ctx: StepContext, release: Any) -> Any:
        factor = float(getattr(release, "factor", 1))

        def observed(value: Tensor, sensitivity: float, noise_multiplier: float):
            if self._noiseless:
                noisy, event = value.detach().clone(), GaussianEvent(noise_multiplier)
            else:
                noisy, event = release(value, sensitivity, noise_multiplier)
            self.releases.append((noisy.detach().double().reshape(-1).clone(),
                                  noise_std(noise_multiplier, sensitivity * factor)))
            return noisy, event

        return self._inner.update(state, norms, ctx, observed)

    def untransform(self, mean: Any, state: State, noise_std_: float) -> Any:
        self.whitened = ({n: v.detach().clone() for n, v in mean.items()}, float(noise_std_))
        return self._inner.untransform(mean, state, noise_std_)


@dataclass(frozen=True)
class StepAudit:
    """Result of :func:`audit_step` (scores are NON-PRIVATE audit data about synthetic canaries).

    ``claimed_epsilon``: the largest per-step epsilon (PLD) of the steps' inner events; ``claimed_mu``
    the GDP parameter with that epsilon at ``delta``. ``ratio`` = Gaussian-fit bound / claim.
    """

    strategy: str
    engine: str
    unit: str
    sampling: str
    design: str
    noise_multiplier: float
    delta: float
    significance: float
    n_canaries: int
    steps: int
    seed: int | None
    claimed_epsilon: float
    claimed_mu: float
    one_run: AuditResult
    one_run_fdp: AuditResult
    gaussian: GaussianShiftResult
    in_scores: np.ndarray = field(repr=False)
    out_scores: np.ndarray = field(repr=False)
    engine_ran: str = ""
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """Gaussian-fit lower bound / claimed epsilon (``inf`` claims give 0)."""
        c = self.claimed_epsilon
        return 0.0 if math.isinf(c) or c == 0 else self.gaussian.epsilon / c

    @property
    def lower_bound(self) -> float:
        """The largest of the three lower bounds."""
        return max(self.one_run.epsilon, self.one_run_fdp.epsilon, self.gaussian.epsilon)

    @property
    def violates_claim(self) -> bool:
        """Some lower bound exceeds the claim: the step leaks more than it says."""
        return self.lower_bound > self.claimed_epsilon

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready row (no scores)."""
        return {
            "strategy": self.strategy, "engine": self.engine, "engine_ran": self.engine_ran,
            "unit": self.unit, "sampling": self.sampling, "design": self.design,
            "params": self.params, "noise_multiplier": self.noise_multiplier,
            "delta": self.delta, "significance": self.significance,
            "claimed_epsilon": self.claimed_epsilon, "claimed_mu": self.claimed_mu,
            "one_run_epsilon": self.one_run.epsilon, "one_run_fdp_epsilon": self.one_run_fdp.epsilon,
            "gaussian_epsilon": self.gaussian.epsilon, "mu_hat": self.gaussian.mu_hat,
            "mu_lower": self.gaussian.mu_lower, "ratio": self.ratio,
            "lower_bound": self.lower_bound, "violates_claim": self.violates_claim,
            "canaries": self.n_canaries, "steps": self.steps, "seed": self.seed,
        }


def inner_event(event: DpEvent) -> DpEvent:
    """The step's event without its sampling wrapper (the canaries are in the batch when in)."""
    if isinstance(event, (PoissonSampledEvent, SampledWithoutReplacementEvent)):
        return event.event
    return event


def step_epsilon(event: DpEvent, delta: float) -> float:
    """PLD epsilon of one step's inner event (``inf`` when some Gaussian has multiplier 0)."""
    inner = inner_event(event)
    if _has_zero_noise(inner):
        return math.inf
    key = (repr(inner), float(delta))
    if key not in _EPS_CACHE:  # the accountant costs ~0.1 s; a step's event repeats
        _EPS_CACHE[key] = float(epsilon(inner, delta, "pld"))
    return _EPS_CACHE[key]


_EPS_CACHE: dict[tuple[str, float], float] = {}


def _has_zero_noise(event: Any) -> bool:
    if isinstance(event, GaussianEvent):
        return event.noise_multiplier == 0
    return any(_has_zero_noise(e) for e in getattr(event, "events", ()) or ()) or (
        _has_zero_noise(event.event) if hasattr(event, "event") else False)


class _DiracNet(nn.Module):
    """``sum_h Linear_h(x)`` with L bias-free ``Linear(d, 1)`` heads (one clipping group each)."""

    def __init__(self, d: int, groups: int) -> None:
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(d, 1, bias=False) for _ in range(groups))
        for h in self.heads:
            h.weight.data.zero_()

    def forward(self, x: Tensor) -> Tensor:
        return sum(h(x) for h in self.heads)  # type: ignore[return-value]


def _linear_loss(output: Tensor, target: Tensor) -> Tensor:
    """Per-example loss ``w . x``: the gradient of head h is the input itself."""
    return output.reshape(output.shape[0], -1).sum(dim=1)


def _group_factors(strategy: Any, state: State) -> tuple[float, ...] | None:
    """A per-group strategy's noise factors (``None``: one flat noise std)."""
    return strategy.group_noise(state) if capabilities_of(strategy).per_group else None


def _resolve(strategy: Any, model: nn.Module, input_shape: tuple[int, ...]) -> tuple[Any, Any]:
    """Bind the strategy to the model (groups, Lipschitz layers) and give its groups."""
    if capabilities_of(strategy).bound_based:
        strategy = strategy.bind(model, input_shape)
    return bind_clipping_groups(strategy, model)


def _initial_state(strategy: Any, groups: Any) -> State:
    state = strategy.init_state()
    if capabilities_of(strategy).public_norms:  # equal public block norms: ratios 1
        state = strategy.public_refresh(state, torch.ones(4, len(groups), dtype=torch.float64))
    return state


def audit_step(
    strategy: Any,
    *,
    noise_multiplier: float,
    delta: float,
    engine: str | Any = "vmap",
    unit: str = "ic",
    sampling: str = "poisson",
    n_canaries: int = 4000,
    canaries_per_step: int = 1000,
    significance: float = 0.05,
    canary_norm: float | None = None,
    miniset_size: int = 2,
    seed: int | None = 0,
    step_fn: StepFn = dp_step,
    progress: bool = False,
    params: dict[str, Any] | None = None,
    trial: bool = False,
) -> StepAudit:
    """Audit one step of ``strategy`` (see the module docstring); returns :class:`StepAudit`.

    Args:
        strategy: a strategy object (``dpclip.clipping.make_strategy``), unbound (the audit binds
            it to its own model's groups / Lipschitz layers).
        noise_multiplier: the run's base multiplier ``z`` (the claim is one step's inner event).
        delta: the delta of every bound and of the claim.
        engine: engine name or instance (IC units; bound-based: ``summed`` by default via
            ``"auto"``); ignored by ``bc``/``gbc`` (unit sums).
        unit: ``ic`` | ``bc`` | ``gbc`` (``gbc`` needs ``sampling="fixed-size"``).
        sampling: ``poisson`` (add/remove) or ``fixed-size`` (replace-one, sensitivity x2).
        n_canaries: total canaries (dirac: rounded up to whole steps of ``canaries_per_step``;
            trial: one per step).
        canary_norm: the canary's gradient norm per group (dirac; default 100 x the initial
            sensitivity) or input scale (trial).
        miniset_size: examples per GBC mini-set.
        seed: the audit's coins and noise (reproducible, NOT private); ``None``: OS entropy.
        step_fn: the step under audit (``dp_step`` or a deliberately broken variant).
        progress: a tqdm bar over the steps.
        trial: use the ``trial`` design for a per-example norm-based strategy too (one canary
            per step, every extra release, e.g. quantile's count, enters the score).
    """
    check_integer("n_canaries", n_canaries, 8)
    check_nonnegative("noise_multiplier", noise_multiplier)
    check_open_unit("delta", delta)
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")
    UnitConfig(unit=unit, miniset_size=miniset_size if unit == "gbc" else None)  # validates unit
    if unit == "gbc" and sampling != "fixed-size":
        raise ValueError("unit=gbc needs sampling='fixed-size' (as in training; see dpclip.training.units)")
    bound = capabilities_of(strategy).bound_based
    if bound and unit != "ic":
        raise ValueError(f"strategy {strategy.name!r} is bound-based and runs with unit=ic only")
    if isinstance(engine, str):
        if bound and engine == "auto":
            engine = "summed"
        eng = get_engine(engine)
    else:
        eng = engine
    if unit == "ic" and not bound and not trial:
        return _dirac(strategy, eng, sampling, float(noise_multiplier), float(delta), int(n_canaries),
                      int(canaries_per_step), float(significance), canary_norm, seed, step_fn,
                      progress, params or {})
    return _trials(strategy, eng, unit, sampling, float(noise_multiplier), float(delta),
                   int(n_canaries), float(significance), canary_norm, int(miniset_size), seed,
                   step_fn, progress, params or {})


def _bar(total: int, progress: bool, desc: str) -> Any:
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, leave=False)


def _estimate(ins: np.ndarray, outs: np.ndarray, delta: float, significance: float):
    return (one_run_epsilon(ins, outs, significance=significance, delta=delta),
            one_run_fdp_epsilon(ins, outs, significance=significance, delta=delta),
            gaussian_shift_epsilon(ins, outs, significance=significance, delta=delta))


def _dirac(strategy: Any, eng: Any, sampling: str, z: float, delta: float, n_canaries: int,
           per_step: int, significance: float, canary_norm: float | None, seed: int | None,
           step_fn: StepFn, progress: bool, params: dict[str, Any]) -> StepAudit:
    m = max(8, min(per_step, n_canaries))
    steps = math.ceil(n_canaries / m)
    n_groups = 3 if strategy.norm_kind == "group" else 1
    model = _DiracNet(m, n_groups)
    strategy, groups = _resolve(strategy, model, (m,))
    state = _initial_state(strategy, groups)
    a = canary_norm if canary_norm is not None else 100.0 * float(strategy.sensitivity(state))
    if not (math.isfinite(a) and a > 0):
        raise ValueError(f"canary_norm must be finite and > 0, got {a!r}")
    fixed = sampling == "fixed-size"
    sampler: Any = FixedSizeSampler(2 * m, m) if fixed else PoissonSampler(2 * m, m / 2.0)
    denom = sampler.expected_batch_size
    rng = np.random.default_rng(seed)
    generator = make_generator(None if seed is None else seed + 1)
    ins, outs, claims, ran = [], [], [], set()
    eye = torch.eye(m)
    bar = _bar(steps, progress, f"audit {strategy.name}")
    for t in range(steps):
        coins = rng.random(m) < 0.5
        if fixed:  # slot j: the canary +a e_j or its replacement -a e_j
            inputs = a * eye * torch.as_tensor(np.where(coins, 1.0, -1.0), dtype=torch.float32)[:, None]
        else:
            inputs = a * eye[torch.as_tensor(np.flatnonzero(coins), dtype=torch.long)]
        targets = torch.zeros(inputs.shape[0])
        ctx = StepContext.at(t, steps_per_epoch=1, total_steps=steps, expected_batch_size=denom,
                             base_noise_multiplier=z)
        observed = ObservedStrategy(strategy)
        public_state = strategy.begin_step(state, ctx)  # public: the std the step will use
        out = step_fn(model, inputs, targets, loss_fn=_linear_loss, strategy=observed,
                      state=state, engine=eng, groups=groups, sampler=sampler,
                      base_noise_multiplier=z, ctx=ctx, generator=generator)
        ran.add(str((out.engine_info or {}).get("engine", getattr(eng, "name", "?"))))
        claims.append(step_epsilon(out.event, delta))
        score = np.zeros(m)
        if observed.whitened is not None:  # P-GRAD: the whitened noisy mean, std known
            mean, sd = observed.whitened
            for name in groups.members[0] if n_groups == 1 else [n for g in groups.members for n in g]:
                score += mean[name].detach().double().reshape(-1).numpy() / max(sd, 1e-300)
            score /= n_groups
        else:
            factors = _group_factors(strategy, public_state)
            for h, members in enumerate(groups.members):
                if factors is not None:
                    sd = noise_std(out.noise_multiplier, sampler.sensitivity_factor * factors[h])
                else:
                    sd = noise_std(out.noise_multiplier, out.sensitivity)
                sd = sd / denom if sd > 0 else 1.0 / denom  # no noise: raw values (scale-free)
                for name in members:
                    score += out.grads[name].detach().double().reshape(-1).numpy() / sd
            score /= n_groups
        ins.append(score[coins])
        outs.append(score[~coins])
        state = out.state
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    in_s, out_s = np.concatenate(ins), np.concatenate(outs)
    one, fdp, gauss = _estimate(in_s, out_s, delta, significance)
    claim = max(claims)
    return StepAudit(
        strategy=strategy.name, engine=getattr(eng, "name", str(eng)), unit="ic",
        sampling=sampling, design="dirac", noise_multiplier=z, delta=delta,
        significance=significance, n_canaries=m * steps, steps=steps, seed=seed,
        claimed_epsilon=claim, claimed_mu=gaussian_mu_for(claim, delta),
        one_run=one, one_run_fdp=fdp, gaussian=gauss, in_scores=in_s, out_scores=out_s,
        engine_ran="+".join(sorted(ran)), params=params)


def _flat_outputs(out: Any, observed: ObservedStrategy) -> tuple[np.ndarray, list[float]]:
    """All released values of a step as one vector, with the per-entry noise std source."""
    parts = [g.detach().double().reshape(-1) for g in out.grads.values()]
    rel = [v for v, _ in observed.releases]
    return torch.cat(parts + rel).numpy(), [len(p) for p in parts] + [len(v) for v in rel]


def _trial_sampler(unit: str, fixed: bool, s: int) -> Any:
    """The trial design's sampler: one mini-set of ``s`` (gbc), 2 of 8 (fixed-size) or rate
    1.5/8 (Poisson)."""
    if unit == "gbc":
        return MiniSetSampler(4 * s, s, 1)
    return FixedSizeSampler(8, 2) if fixed else PoissonSampler(8, 1.5)


def _trials(strategy: Any, eng: Any, unit: str, sampling: str, z: float, delta: float,
            n_trials: int, significance: float, canary_norm: float | None, s: int,
            seed: int | None, step_fn: StepFn, progress: bool,
            params: dict[str, Any]) -> StepAudit:
    bound = capabilities_of(strategy).bound_based
    fixed = sampling == "fixed-size"
    d = 4
    if bound:
        torch.manual_seed(0 if seed is None else seed)  # public: the audited model's weights
        model: nn.Module = nn.Sequential(nn.Linear(d, 3))
        strategy, groups = _resolve(strategy, model, (d,))
        loss_fn = strategy.loss()
        x0 = float(strategy.input_norm)
        canary = torch.tensor([x0, 0.0, 0.0, 0.0])
        anchor = torch.zeros(d)
        canary_y, other_y = 0, 1
        # replace-one: the same input with another label; add/remove: the canary joins D
        examples = {"anchor": (anchor, 2), "in": (canary, canary_y), "out": (canary, other_y)}
    else:
        model = _DiracNet(d, 3 if strategy.norm_kind == "group" else 1)
        strategy, groups = _resolve(strategy, model, (d,))
        loss_fn = _linear_loss
        st0 = _initial_state(strategy, groups)
        a = canary_norm if canary_norm is not None else 100.0 * float(strategy.sensitivity(st0))
        e0 = torch.zeros(d)
        e0[0] = 1.0
        # bc/gbc replace-one: unit [0, +-2a e0] has mean +-a e0; bc Poisson: D = {-a e0},
        # D' = {-a e0, 3a e0} (means -a e0 and +a e0): both move the clipped unit by 2 C
        if unit == "ic":
            examples = {"anchor": (torch.zeros(d), 0), "in": (a * e0, 0), "out": (-a * e0, 0)}
        elif fixed:
            examples = {"anchor": (torch.zeros(d), 0), "in": (2 * a * e0, 0),
                        "out": (-2 * a * e0, 0)}
        else:
            examples = {"anchor": (-a * e0, 0), "in": (3 * a * e0, 0), "out": None}

    def batch(include: bool) -> tuple[Tensor, Tensor]:
        anchor_x, anchor_y = examples["anchor"]
        rows = [(anchor_x, anchor_y)]
        if include:
            rows.append(examples["in"])
        elif fixed:  # replace-one: the canary's slot holds its replacement
            rows.append(examples["out"])
        x = torch.stack([r[0] for r in rows])
        y = torch.tensor([r[1] for r in rows])
        if unit == "bc":
            return x[None], y[None]
        if unit == "gbc":  # one mini-set of s examples: the rows padded with zero-gradient fillers
            pad = s - x.shape[0]
            if pad < 0:
                raise ValueError(f"miniset_size must be >= {x.shape[0]} for the audit, got {s}")
            x = torch.cat([x, torch.zeros(pad, d)])
            y = torch.cat([y, torch.zeros(pad, dtype=y.dtype)])
            return x[None], y[None]
        return x, y

    sampler = _trial_sampler(unit, fixed, s)
    unit_cfg = None if unit == "ic" else UnitConfig(unit=unit,
                                                    miniset_size=s if unit == "gbc" else None)
    state0 = _initial_state(strategy, groups)
    units = sampler.expected_batch_size if unit == "ic" else (
        1.0 if unit == "bc" else float(sampler.expected_units))
    ctx = StepContext.at(0, steps_per_epoch=1, total_steps=1, expected_batch_size=units,
                         base_noise_multiplier=z)

    def run(include: bool, noiseless: bool, generator: torch.Generator) -> tuple[Any, Any]:
        obs = ObservedStrategy(strategy, noiseless=noiseless)
        x, y = batch(include)
        out = step_fn(model, x, y, loss_fn=loss_fn, strategy=obs, state=state0, engine=eng,
                      groups=groups, sampler=sampler, base_noise_multiplier=0.0 if noiseless
                      else z, ctx=ctx, generator=generator, **({} if unit_cfg is None
                                                                else {"unit": unit_cfg}))
        return out, obs

    cert_sd: dict[str, float] | None = None
    if bound:  # per-parameter noise std of bound_step: z k Delta_p (public certificate)
        _, cert = strategy.certify(model, loss_fn, (d,), strategy.begin_step(state0, ctx))
        k = sampler.sensitivity_factor
        cert_sd = {n: noise_std(z, k * cert.param_sensitivity[n]) for n in cert.param_sensitivity}
    g0 = torch.Generator().manual_seed(0)
    ref_in, obs_in = run(True, True, g0)
    ref_out, obs_out = run(False, True, g0)
    v_in, _ = _flat_outputs(ref_in, obs_in)
    v_out, _ = _flat_outputs(ref_out, obs_out)
    rng = np.random.default_rng(seed)
    generator = make_generator(None if seed is None else seed + 1)
    ins, outs, claims, ran = [], [], [], set()
    bar = _bar(n_trials, progress, f"audit {strategy.name} ({unit})")
    for _ in range(n_trials):
        coin = bool(rng.random() < 0.5)
        out, obs = run(coin, False, generator)
        ran.add(str((out.engine_info or {}).get("engine", unit)))
        claims.append(step_epsilon(out.event, delta))
        v, sizes = _flat_outputs(out, obs)
        if v.shape != v_in.shape:
            raise RuntimeError("audit: the step released a different number of values than its "
                               "noiseless reference run")
        sd = _output_stds(out, obs, groups, sampler, strategy, state0, ctx, sizes, unit_cfg,
                          cert_sd)
        diff = (v_in - v_out) / sd
        norm = float(np.linalg.norm(diff))
        score = float(np.dot((v - v_out) / sd, diff) / norm) if norm > 0 else 0.0
        (ins if coin else outs).append(score)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if len(ins) < 3 or len(outs) < 3:
        raise ValueError("too few canaries on one side; raise n_canaries")
    in_s, out_s = np.asarray(ins), np.asarray(outs)
    one, fdp, gauss = _estimate(in_s, out_s, delta, significance)
    claim = max(claims)
    return StepAudit(
        strategy=strategy.name, engine=getattr(eng, "name", str(eng)) if unit == "ic" else "unit",
        unit=unit, sampling=sampling, design="trial", noise_multiplier=z, delta=delta,
        significance=significance, n_canaries=n_trials, steps=n_trials, seed=seed,
        claimed_epsilon=claim, claimed_mu=gaussian_mu_for(claim, delta), one_run=one,
        one_run_fdp=fdp, gaussian=gauss, in_scores=in_s, out_scores=out_s,
        engine_ran="+".join(sorted(ran)), params=params)


def _output_stds(out: Any, obs: ObservedStrategy, groups: Any, sampler: Any, strategy: Any,
                 state0: State, ctx: StepContext, sizes: list[int],
                 unit_cfg: UnitConfig | None,
                 cert_sd: dict[str, float] | None = None) -> np.ndarray:
    """Per-entry noise std of the released vector (gradient entries, then extra releases), from
    public quantities only (the step's multiplier and sensitivity); 1 where no noise is added."""
    names = list(out.grads)
    denom = float(ctx.expected_batch_size)
    stds: list[np.ndarray] = []
    factors = _group_factors(strategy, strategy.begin_step(state0, ctx))
    k = unit_cfg.sensitivity_factor if unit_cfg is not None else sampler.sensitivity_factor
    for name, size in zip(names, sizes):
        if cert_sd is not None:
            sd = cert_sd[name]
        elif factors is not None:
            h = next(i for i, mem in enumerate(groups.members) if name in mem)
            sd = noise_std(out.noise_multiplier, k * factors[h])
        else:
            sd = noise_std(out.noise_multiplier, out.sensitivity)
        stds.append(np.full(size, sd / denom))
    for (_, sd), size in zip(obs.releases, sizes[len(names):]):
        stds.append(np.full(size, sd))
    arr = np.concatenate(stds)
    return np.where(arr > 0, arr, 1.0)

