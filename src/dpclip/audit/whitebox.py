"""White-box Dirac-canary audit of :func:`dpclip.training.step.dp_step` (one run, gradient space).

The audit runs the REAL step (engine, clipping strategy, noise, normalisation) on a model built so
that every example is a canary whose per-example gradient is a Dirac: canary ``j`` has the gradient
``a e_j`` (``a = canary_norm``, larger than the clipping bound), so after clipping it adds a vector
of norm at most ``S`` on coordinate ``j`` only. Each of the ``m`` canaries is included
independently with probability 1/2 (the audit's own coin, drawn before the run); the included ones
form the batch of every step. The auditor observes the released noisy gradients and scores canary
``j`` by the sum over steps of coordinate ``j``; the one-run estimators of
:mod:`dpclip.audit.estimators` turn the scores into epsilon lower bounds.

What is audited: the Gaussian mechanism of the step WITHOUT subsampling amplification (the
canaries are in every batch when included), composed over ``steps``. The claim it is compared
with is therefore the epsilon of the step's inner event (``out.event`` without its Poisson
sampling wrapper) composed ``steps`` times, from the project's PLD accountant
(:func:`dpclip.accounting.epsilon`). Under add/remove-one adjacency a step that clips each canary
to ``S`` and adds ``N(0, (z S)^2)`` to the sum makes the scores ``N(mu, 1)`` (in) against
``N(0, 1)`` (out) after scaling, with ``mu = sqrt(sum_t 1 / z_t^2)``: :func:`ideal_bounds` gives
the bound such an exact mechanism yields with the same numbers of canaries (deterministic score
quantiles), the yardstick for "as tight as theory allows". One-run bounds at small ``delta`` are far
below the claimed epsilon even for an exact Gaussian mechanism (about 0.4 of it for the f-DP bound
with a few thousand canaries): a white-box audit detects a step that leaks MORE than claimed
(missing noise, understated sensitivity), it does not certify the claim.

Scope: norm-based strategies (``kind != "bound"``) with a Poisson sampler (add/remove adjacency,
factor 1). The audit's scores and coins are NON-PRIVATE audit data (they describe canaries only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from dpclip._checks import check_integer, check_nonnegative, check_open_unit
from dpclip.audit.estimators import AuditResult, one_run_epsilon, one_run_fdp_epsilon
from dpclip.clipping.base import ClippingStrategy, State, StepContext
from dpclip.clipping.capabilities import capabilities_of, strategy_name
from dpclip.engine import ParamGroups, get_engine
from dpclip.engine.base import Engine
from dpclip.events import ComposedEvent, DpEvent, PoissonSampledEvent
from dpclip.noise import make_generator
from dpclip.training.sampling import PoissonSampler
from dpclip.training.step import dp_step
from dpclip.accounting import epsilon

__all__ = ["DiracAudit", "dirac_canary_audit", "ideal_bounds"]


@dataclass(frozen=True)
class DiracAudit:
    """Result of :func:`dirac_canary_audit`.

    ``one_run`` / ``one_run_fdp``: the estimators' results on the observed scores.
    ``claimed_epsilon``: epsilon at ``delta`` of the steps' own events (sampling stripped,
    composed), PLD accountant. ``mu_claimed = sqrt(sum_t 1 / z_t^2)`` from the noise multipliers the
    steps report; ``ideal_one_run`` / ``ideal_one_run_fdp``: the bounds an exact ``mu_claimed``-GDP
    mechanism gives with the same canary counts (:func:`ideal_bounds`). ``in_scores`` /
    ``out_scores``: the canaries' scores (NON-PRIVATE audit data).
    """

    one_run: AuditResult
    one_run_fdp: AuditResult
    claimed_epsilon: float
    mu_claimed: float
    ideal_one_run: float
    ideal_one_run_fdp: float
    n_canaries: int
    steps: int
    delta: float
    significance: float
    in_scores: np.ndarray
    out_scores: np.ndarray


def ideal_bounds(
    mu: float, n_in: int, n_out: int, *, delta: float, significance: float = 0.05
) -> tuple[float, float]:
    """(one-run, one-run f-DP) bounds of an exact ``mu``-GDP score experiment.

    In-scores are the ``n_in`` midpoint quantiles of ``N(mu, 1)``, out-scores those of ``N(0, 1)``
    (no sampling noise): what the estimators give on a mechanism that is exactly as private as
    claimed. ``mu = inf`` (no noise) separates the scores perfectly.
    """
    if not (mu >= 0):
        raise ValueError(f"mu must be >= 0, got {mu!r}")
    from scipy import stats

    def quantiles(n: int) -> np.ndarray:
        return stats.norm.ppf((np.arange(n) + 0.5) / n)

    ins = quantiles(n_in) + (1e6 if math.isinf(mu) else mu)
    outs = quantiles(n_out)
    a = one_run_epsilon(ins, outs, significance=significance, delta=delta).epsilon
    b = one_run_fdp_epsilon(ins, outs, significance=significance, delta=delta).epsilon
    return a, b


class _DiracLoss:
    """Per-example loss ``w . x``: its gradient with respect to ``w`` is ``x`` (the canary)."""

    def __call__(self, output: Tensor, target: Tensor) -> Tensor:
        return output.squeeze(-1)


def _inner_event(event: DpEvent) -> DpEvent:
    if isinstance(event, PoissonSampledEvent):
        return event.event
    raise ValueError(f"dirac_canary_audit expects a Poisson-sampled step event, got {event!r}")


def dirac_canary_audit(
    strategy: ClippingStrategy,
    *,
    n_canaries: int,
    noise_multiplier: float,
    delta: float,
    steps: int = 1,
    significance: float = 0.05,
    canary_norm: float | None = None,
    engine: str | Engine = "vmap",
    state: State | None = None,
    seed: int | None = None,
) -> DiracAudit:
    """Audit ``dp_step`` with ``n_canaries`` Dirac canaries over ``steps`` steps (module docstring).

    Args:
        strategy: a norm-based clipping strategy (``kind = "bound"`` is refused: its sensitivity
            comes from the weights, not from clipping).
        n_canaries: ``m >= 2``; each canary has its own coordinate of a ``Linear(m, 1)`` model.
        noise_multiplier: the step's ``base_noise_multiplier``; 0 runs the step without noise
            (the claimed epsilon is then infinite; compare with the claim of the intended run).
        delta: in (0, 1), for the claim and the estimators.
        steps: number of steps; the canaries stay in (or out) for all of them, scores are summed.
        canary_norm: norm ``a`` of each canary's raw gradient; default ``10 * S`` with ``S`` the
            strategy's initial sensitivity, so a clipping step brings it down to ``S``.
        engine: engine name or instance (``"vmap"``: the reference).
        state: initial strategy state (default ``strategy.init_state()`` when it exists, else {}).
        seed: seeds the audit's coins and the step's noise generator (reproducible, NOT private:
            fine for an audit, whose canaries are synthetic). ``None``: OS entropy.

    Returns:
        :class:`DiracAudit`.
    """
    check_integer("n_canaries", n_canaries, 2)
    check_integer("steps", steps, 1)
    check_nonnegative("noise_multiplier", noise_multiplier)
    check_open_unit("delta", delta)
    if capabilities_of(strategy).bound_based:
        raise ValueError(
            f"strategy {strategy_name(strategy)!r} is bound-based (sensitivity from "
            "the weights); the Dirac-canary audit needs a norm-based (clipping) strategy"
        )
    m = int(n_canaries)
    if state is None:
        init = getattr(strategy, "init_state", None)
        state = init() if callable(init) else {}
    s0 = float(strategy.sensitivity(state))
    if canary_norm is None:
        canary_norm = 10.0 * s0
    if not (math.isfinite(canary_norm) and canary_norm > 0):
        raise ValueError(f"canary_norm must be finite and > 0, got {canary_norm!r}")
    eng = get_engine(engine) if isinstance(engine, str) else engine

    coins = np.random.default_rng(seed).random(m) < 0.5  # the audit's inclusion coins
    included = np.flatnonzero(coins)
    model = nn.Linear(m, 1, bias=False)
    model.weight.data.zero_()
    groups = ParamGroups.flat(model)
    inputs = torch.zeros(included.size, m)
    inputs[torch.arange(included.size), torch.as_tensor(included)] = float(canary_norm)
    targets = torch.zeros(included.size)
    sampler = PoissonSampler(m, m / 2.0)  # public expected batch size m/2 (the coin's mean)
    generator = make_generator(None if seed is None else seed + 1)
    loss_fn = _DiracLoss()

    scores = np.zeros(m)
    inner: list[DpEvent] = []
    inv_z2 = 0.0
    for t in range(int(steps)):
        ctx = StepContext.at(t, steps_per_epoch=int(steps), total_steps=int(steps),
                             expected_batch_size=sampler.expected_batch_size,
                             base_noise_multiplier=float(noise_multiplier))
        out = dp_step(model, inputs, targets, loss_fn=loss_fn, strategy=strategy, state=state,
                      engine=eng, groups=groups, sampler=sampler,
                      base_noise_multiplier=float(noise_multiplier), ctx=ctx,
                      generator=generator)
        state = out.state
        scores += out.grads["weight"].detach().double().reshape(-1).numpy()
        inner.append(_inner_event(out.event))
        inv_z2 += math.inf if out.noise_multiplier == 0 else 1.0 / out.noise_multiplier ** 2

    in_scores, out_scores = scores[coins], scores[~coins]
    one = one_run_epsilon(in_scores, out_scores, significance=significance, delta=delta)
    fdp = one_run_fdp_epsilon(in_scores, out_scores, significance=significance, delta=delta)
    claimed = _claimed_epsilon(inner, delta)
    mu = math.sqrt(inv_z2)
    ideal = ideal_bounds(mu, in_scores.size, out_scores.size, delta=delta,
                         significance=significance)
    return DiracAudit(
        one_run=one, one_run_fdp=fdp, claimed_epsilon=claimed, mu_claimed=mu,
        ideal_one_run=ideal[0], ideal_one_run_fdp=ideal[1], n_canaries=m, steps=int(steps),
        delta=float(delta), significance=float(significance), in_scores=in_scores,
        out_scores=out_scores,
    )


def _claimed_epsilon(events: list[DpEvent], delta: float) -> float:
    if any(getattr(e, "noise_multiplier", 1.0) == 0 for e in events):
        return math.inf
    event: Any = events[0] if len(events) == 1 else ComposedEvent(tuple(events))
    return float(epsilon(event, delta, "pld"))
