"""The public plan of a private run: its events step by step, the noise calibrated to a target
epsilon, and the number of steps the epsilon cap allows.

Everything here is computed before any data is read, from public settings only (the strategy's
planned events, the sampler, the number of steps), so it can be published. Both entry points use
it: ``dpclip.training.private.PrivateTraining`` (the own-model API) and, through it, ``dpclip train``.
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

__all__ = ["API_FLAGS", "CLI_FLAGS", "NOISE_WARNING_THRESHOLD", "Plan", "budget_steps",
           "resolve_noise"]

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


class Plan:
    """The events the run will emit, step by step (public), used for calibration and budget."""

    def __init__(self, strategy: ClippingStrategy, sampler: Any, total_steps: int,
                 units_per_step: float | None = None) -> None:
        self.strategy, self.sampler, self.total_steps = strategy, sampler, total_steps
        #: public number of clipped vectors per step (examples for IC, units for BC/GBC)
        self.units = units_per_step if units_per_step is not None \
            else sampler.expected_batch_size

    def ctx(self, step: int, base: float) -> StepContext:
        spe = self.sampler.steps_per_epoch
        return StepContext(step=step, epoch=step // spe, steps_per_epoch=spe,
                           total_steps=self.total_steps, expected_batch_size=self.units,
                           base_noise_multiplier=base)

    def event(self, step: int, base: float) -> DpEvent:
        return self.event_at(self.ctx(step, base), base)

    def event_at(self, ctx: StepContext, base: float) -> DpEvent:
        """The planned event of the step described by ``ctx`` (``ctx = self.ctx(step, base)``)."""
        return self.sampler.step_event(self.strategy.planned_event(base, ctx))

    def ledger(self, base: float, steps: int | None = None, *, lenient: bool = False) -> Ledger:
        """The planned ledger. ``lenient`` (calibration only): where the strategy rejects ``base``
        (e.g. a noise split needs ``base < 2 sigma_b``), use the plain ``Gaussian(base)`` step,
        which keeps epsilon decreasing in ``base`` so the search can go on below the limit; a
        rejected value is never used for training (building the real plan raises)."""
        led = Ledger()
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


def resolve_noise(plan: Plan, *, epsilon: float | None, noise_multiplier: float | None,
                  delta: float, accountant: str, flags: Mapping[str, str] = API_FLAGS) -> float:
    """The given noise multiplier, or the one calibrated so that the whole plan meets
    ``epsilon``; a ``NoiseWarning`` when it is too large for the model to learn."""
    if noise_multiplier is not None:
        z = float(noise_multiplier)
    else:
        assert epsilon is not None
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
    lo, hi = 0, total  # eps(lo) <= cap < eps(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if eps(mid) <= epsilon:
            lo = mid
        else:
            hi = mid
    from dpclip.errors import BudgetWarning

    e, nm = flags["epsilon"], flags["noise_multiplier"]
    spe = plan.sampler.steps_per_epoch
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
