"""The public plan of a private run: its events step by step, the noise calibrated to a target
epsilon, and the number of steps the epsilon cap allows.

Everything here is computed before any data is read, from public settings only (the strategy's
planned events, the sampler, the number of steps), so it can be published. One :class:`Plan`
serves any sampler of examples or users: ``dpclip.training.private.PrivateTraining`` (the own-model
API, and through it ``dpclip train``) plans steps; the federated aggregator
(``dpclip.federated.aggregator.DPAggregator``) and ``dpclip.federated.simulation`` plan rounds
(:meth:`Plan.for_rounds`: one round is one step and one "epoch"). Both refuse an emitted event
that differs from the planned one (:meth:`Plan.check_emitted`).
Messages name the arguments as the caller knows them (``flags``: ``--epsilon`` on the command line,
``epsilon=`` in Python).
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

from dpclip.accounting import Ledger, calibrate_noise_multiplier
from dpclip.accounting import epsilon as ledger_epsilon
from dpclip.clipping import ClippingStrategy, StepContext
from dpclip.events import DpEvent, GaussianEvent

__all__ = ["API_FLAGS", "CLI_FLAGS", "FEDERATED_FLAGS", "NOISE_WARNING_THRESHOLD", "Plan",
           "PlanMismatchError", "budget_steps", "check_prior_events", "resolve_noise"]

#: a noise multiplier above this triggers a NoiseWarning (the model will not learn)
NOISE_WARNING_THRESHOLD = 50.0

#: how arguments are named in messages
CLI_FLAGS: Mapping[str, str] = {"epsilon": "--epsilon", "noise_multiplier": "--noise-multiplier",
                                "batch_size": "--batch-size", "augment": "--augment",
                                "augment_multiplicity": "--augment-multiplicity",
                                "averaging": "--averaging"}
API_FLAGS: Mapping[str, str] = {"epsilon": "epsilon", "noise_multiplier": "noise_multiplier",
                                "batch_size": "batch_size", "augment": "augment=",
                                "augment_multiplicity": "augment_multiplicity",
                                "averaging": "averaging="}
#: DP-FedAvg (``FedAvgConfig``): the user-level names
FEDERATED_FLAGS: Mapping[str, str] = {"epsilon": "target_epsilon",
                                      "noise_multiplier": "noise_multiplier",
                                      "batch_size": "clients_per_round"}


class PlanMismatchError(RuntimeError):
    """A step or round emitted another event than the plan said it would (a privacy bug: the
    accountant would count something else than what was released). Nothing is recorded."""


class Plan:
    """The events the run will emit, step by step (public), used for calibration and budget.

    ``sampler``: of examples (``dpclip.training.sampling``) or of users (the federated
    aggregator's); ``total_steps``: planned steps (or rounds); ``units_per_step``: public number of
    clipped vectors per step (default the sampler's expected batch size; BC/GBC: units);
    ``steps_per_epoch``: default the sampler's (rounds: 1, :meth:`for_rounds`);
    ``prior_events``: releases made from the private data before the first step (e.g. the
    private centre of ``centre="private"``, :mod:`dpclip.data.private_centre`), first in every
    planned ledger, so calibration and budget count them with the steps.
    """

    def __init__(self, strategy: ClippingStrategy, sampler: Any, total_steps: int,
                 units_per_step: float | None = None, steps_per_epoch: int | None = None,
                 prior_events: tuple[DpEvent, ...] = ()) -> None:
        self.strategy, self.sampler, self.total_steps = strategy, sampler, total_steps
        self.prior_events = tuple(prior_events)
        #: public number of clipped vectors per step (examples for IC, units for BC/GBC)
        self.units = units_per_step if units_per_step is not None \
            else sampler.expected_batch_size
        self.steps_per_epoch = int(steps_per_epoch if steps_per_epoch is not None
                                   else sampler.steps_per_epoch)

    @classmethod
    def for_rounds(cls, strategy: ClippingStrategy, user_sampler: Any, rounds: int,
                   units: float | None = None) -> "Plan":
        """The plan of ``rounds`` DP-FedAvg rounds: a round is one step and one "epoch"
        (schedules move per round); the public units are the expected number of sampled users
        (``units``: default ``float(user_sampler.expected_batch_size)``)."""
        m = float(user_sampler.expected_batch_size) if units is None else units
        return cls(strategy, user_sampler, rounds, units_per_step=m, steps_per_epoch=1)

    @staticmethod
    def context(step: int, *, steps_per_epoch: int, total_steps: int, units: float,
                base: float) -> StepContext:
        """The public ``StepContext`` of ``step`` (0-based)."""
        return StepContext(step=int(step), epoch=int(step) // steps_per_epoch,
                           steps_per_epoch=steps_per_epoch, total_steps=max(int(total_steps), 1),
                           expected_batch_size=units, base_noise_multiplier=base)

    def ctx(self, step: int, base: float) -> StepContext:
        return self.context(step, steps_per_epoch=self.steps_per_epoch,
                            total_steps=self.total_steps, units=self.units, base=base)

    def event(self, step: int, base: float) -> DpEvent:
        return self.event_at(self.ctx(step, base), base)

    def event_at(self, ctx: StepContext, base: float) -> DpEvent:
        """The planned event of the step described by ``ctx`` (``ctx = self.ctx(step, base)``)."""
        return self.sampler.step_event(self.strategy.planned_event(base, ctx))

    def check_emitted(self, ctx: StepContext, base: float, event: DpEvent,
                      what: str = "step") -> None:
        """Refuse (:class:`PlanMismatchError`) an emitted ``event`` that is not the planned event
        of the step described by ``ctx``: the ledger would not describe what was released."""
        planned = self.event_at(ctx, base)
        if event != planned:
            raise PlanMismatchError(
                f"privacy bug: strategy {getattr(self.strategy, 'name', self.strategy)!r} emitted "
                f"{event} at {what} {ctx.step} but planned {planned}; refusing to continue"
            )

    def ledger(self, base: float, steps: int | None = None, *, lenient: bool = False) -> Ledger:
        """The planned ledger. ``lenient`` (calibration only): where the strategy rejects ``base``
        (e.g. a noise split needs ``base < 2 sigma_b``), use the plain ``Gaussian(base)`` step,
        which keeps epsilon decreasing in ``base`` so the search can go on below the limit; a
        rejected value is never used for training (building the real plan raises). The
        ``prior_events`` come first, whatever ``steps`` (``steps=0``: those alone)."""
        led = Ledger()
        for prior in self.prior_events:
            led.record(prior)
        for t in range(self.total_steps if steps is None else steps):
            try:
                led.record(self.event(t, base))
            except ValueError:
                if not lenient:
                    raise
                led.record(self.sampler.step_event(GaussianEvent(base)))
        return led


#: relative tolerance within which two calibrated noise multipliers are the same calibration: the
#: last digits of a calibration depend on the numerical libraries (1e-10 relative was seen between
#: the CPU image and a GPU image). Used to reuse stored trials and searches and to resume
#: checkpoints across machines; a deliberate change of the privacy settings is far outside it.
NOISE_MATCH_RTOL = 1e-9


def check_prior_events(plan: Plan, *, epsilon: float, delta: float, accountant: str,
                       flags: Mapping[str, str] = API_FLAGS) -> None:
    """Refuse a plan whose releases before the first step (``prior_events``: e.g. the private
    centre of ``centre="private"``) alone reach the epsilon target: no step would fit."""
    if not plan.prior_events:
        return
    e0 = ledger_epsilon(plan.ledger(1.0, steps=0), delta, accountant=accountant)
    if e0 >= epsilon:
        raise ValueError(
            f"{flags['epsilon']} {epsilon:g}: the releases before the first step "
            f"({', '.join(map(str, plan.prior_events))}, e.g. a private centre) already cost "
            f"epsilon {e0:.4g} at delta {delta:g} ({accountant}), leaving nothing for the steps; "
            f"raise {flags['epsilon']} or the preprocessing's noise multiplier (the dataset "
            "option centre_noise_multiplier)")


def resolve_noise(plan: Plan, *, epsilon: float | None, noise_multiplier: float | None,
                  delta: float, accountant: str, flags: Mapping[str, str] = API_FLAGS) -> float:
    """The given noise multiplier, or the one calibrated so that the whole plan meets
    ``epsilon``; a ``NoiseWarning`` when it is too large for the model to learn."""
    if noise_multiplier is not None:
        z = float(noise_multiplier)
    else:
        assert epsilon is not None
        check_prior_events(plan, epsilon=epsilon, delta=delta, accountant=accountant,
                           flags=flags)
        z = calibrate_noise_multiplier(
            epsilon, delta, lambda x: plan.ledger(x, lenient=True).to_dp_event(),
            accountant=accountant)
    if z > NOISE_WARNING_THRESHOLD:
        from dpclip.errors import NoiseWarning

        origin = (f"given as {flags['noise_multiplier']} {noise_multiplier:g}"
                  if noise_multiplier is not None
                  else f"calibrated for {flags['epsilon']} {epsilon:g} at delta {delta:g}")
        warnings.warn(NoiseWarning(
            f"noise multiplier {z:,.6g} ({origin}) is so large that the model will not learn: the "
            f"noise on each coordinate of the averaged gradient has std {z / plan.units:,.4g} x "
            f"the clip norm (noise multiplier / expected batch size {plan.units:g}), while the "
            f"whole clipped signal is at most 1 x the clip norm. Raise {flags['epsilon']}, lower "
            f"{flags['noise_multiplier']}, or raise {flags['batch_size']} (more examples share "
            "the noise of each step)"
        ), stacklevel=3)
    return z


def budget_steps(plan: Plan, z: float, *, epsilon: float | None, delta: float, accountant: str,
                 flags: Mapping[str, str] = API_FLAGS) -> int:
    """Largest number of planned steps whose epsilon stays within ``epsilon`` (all of them when
    there is no cap). 0 steps: ``ValueError`` before training; fewer than planned:
    ``BudgetWarning``."""
    if epsilon is None:
        return plan.total_steps

    def eps(k: int) -> float:
        return ledger_epsilon(plan.ledger(z, k), delta, accountant=accountant)

    total = plan.total_steps
    if eps(total) <= epsilon:
        return total
    check_prior_events(plan, epsilon=epsilon, delta=delta, accountant=accountant, flags=flags)
    lo, hi = 0, total  # eps(lo) <= cap < eps(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if eps(mid) <= epsilon:
            lo = mid
        else:
            hi = mid
    from dpclip.errors import BudgetWarning

    e, nm = flags["epsilon"], flags["noise_multiplier"]
    spe = plan.steps_per_epoch
    try:  # the noise that fits every planned step into the cap: part of the fix
        z_all = calibrate_noise_multiplier(
            epsilon, delta, lambda x: plan.ledger(x, lenient=True).to_dp_event(),
            accountant=accountant)
        fit = f"{nm} {z_all:.4g} fits all {total} steps in epsilon {epsilon:g}"
    except (ValueError, RuntimeError):
        fit = f"a larger {nm} fits more steps"
    if lo == 0:
        eps1 = eps(1)
        raise ValueError(
            f"{e} {epsilon:g} with {nm} {z:g} allows 0 of the {total} planned steps: a single "
            f"step (sample rate {plan.sampler.sample_rate:.4g}) already costs epsilon {eps1:.4g} "
            f"at delta {delta:g} ({accountant}). Raise {e} above {eps1:.4g}, or raise {nm} "
            f"({fit}), or give only {e} to calibrate the noise"
        )
    warnings.warn(BudgetWarning(
        f"{e} {epsilon:g} with {nm} {z:g} allows only {lo} of the {total} planned steps "
        f"({100.0 * lo / total:.0f}%, {lo / spe:.3g} of {total / spe:.3g} epochs): training stops "
        f"early. To train every step, raise {e} or {nm} ({fit}), or give only {e} to calibrate "
        "the noise"
    ), stacklevel=3)
    return lo
