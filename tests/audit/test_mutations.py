"""Mutation tests (issue 16, item 4): deliberately broken mechanisms must be flagged by the audit
(a lower bound above the claimed epsilon), and the unbroken mechanism, audited the same way, must
not be (the control). Each mutation is a step function, strategy or sampler that is wrong in one
way while still emitting the honest step's DP event, so the claim does not move."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from dpclip.accounting import epsilon
from dpclip.audit import clopper_pearson_epsilon
from dpclip.audit.step_audit import _DiracNet, _linear_loss, audit_step, step_epsilon
from dpclip.audit.sampling_audit import presence_audit
from dpclip.clipping import FixedClip
from dpclip.clipping.quantile import QuantileClip
from dpclip.clipping.base import StepContext, finite_or_inf
from dpclip.engine import ParamGroups, get_engine
from dpclip.events import GaussianEvent, PoissonSampledEvent, SelfComposedEvent
from dpclip.training.sampling import PoissonSampler
from dpclip.training.step import dp_step

DELTA = 1e-5
Z = 2.0  # claimed: one step of Gaussian(2), epsilon 1.99 at delta 1e-5
CANARIES = 4000


def audit(strategy=None, step_fn=dp_step, **kw):
    args = dict(noise_multiplier=Z, delta=DELTA, engine="ghost", n_canaries=CANARIES,
                canaries_per_step=2000, seed=0, step_fn=step_fn)
    args.update(kw)
    return audit_step(strategy or FixedClip(1.0), **args)


@pytest.fixture(scope="module")
def honest():
    r = audit()
    assert r.claimed_epsilon == pytest.approx(1.993, abs=0.01)
    assert not r.violates_claim, r.to_dict()  # the control of every gradient mutation below
    assert r.gaussian.epsilon > 0.8 * r.claimed_epsilon  # and the audit is tight for it
    return r


def claiming(z_factor: float):
    """A step that adds ``z_factor`` times the noise but claims the full multiplier."""

    def step(model, x, y, *, base_noise_multiplier, sampler, **kw):
        out = dp_step(model, x, y, base_noise_multiplier=base_noise_multiplier * z_factor,
                      sampler=sampler, **kw)
        return dataclasses.replace(out, noise_multiplier=base_noise_multiplier,
                                   event=sampler.step_event(GaussianEvent(base_noise_multiplier)))
    return step


def test_no_noise_is_flagged(honest):
    r = audit(step_fn=claiming(0.0))
    assert r.one_run.epsilon > 1.5 * r.claimed_epsilon  # assumption-free estimator already
    assert r.violates_claim


def test_half_the_noise_is_flagged(honest):
    r = audit(step_fn=claiming(0.5))
    assert r.claimed_epsilon == honest.claimed_epsilon
    assert r.gaussian.epsilon > 1.5 * r.claimed_epsilon, r.to_dict()
    assert r.gaussian.mu_hat == pytest.approx(1.0, rel=0.1)  # mu doubled: 1 / (z / 2)


@dataclass(frozen=True)
class NoClipping(FixedClip):
    """Clipping skipped: every finite gradient keeps weight 1; the sensitivity still says C."""

    def weights(self, norms, state):
        return torch.isfinite(norms).to(norms.dtype)


def test_clipping_skipped_is_flagged(honest):
    r = audit(NoClipping(1.0))
    assert r.one_run.epsilon > 1.5 * r.claimed_epsilon
    assert r.violates_claim


@dataclass(frozen=True)
class HalfSensitivity(FixedClip):
    """Clips to C but reports C / 2: the step adds half the noise it should."""

    def sensitivity(self, state):
        return self.clip_norm / 2


def test_understated_sensitivity_2x_is_flagged(honest):
    r = audit(HalfSensitivity(1.0))
    assert r.gaussian.epsilon > 1.5 * r.claimed_epsilon, r.to_dict()


def multiprocess(world_size: int, noise_on_every_rank: bool):
    """A simulated ``world_size``-process step: each rank clips its shard of the batch, the
    clipped sums are all-reduced (summed). Correct: noise added once (rank 0, multiplier z).
    Mutation: every rank adds its 'share' z / P of the noise (standard deviations added as if
    they summed linearly), so the all-reduced noise has std z S / sqrt(P), not z S."""

    def step(model, x, y, *, base_noise_multiplier, sampler, generator, **kw):
        z = base_noise_multiplier
        outs = []
        for rank, (xs, ys) in enumerate(zip(x.tensor_split(world_size), y.tensor_split(world_size))):
            zr = z / world_size if noise_on_every_rank else (z if rank == 0 else 0.0)
            g = torch.Generator().manual_seed(int(torch.randint(2**62, (1,), generator=generator)))
            outs.append(dp_step(model, xs, ys, base_noise_multiplier=zr, sampler=sampler,
                                generator=g, **kw))
        grads = {n: sum(o.grads[n] for o in outs) for n in outs[0].grads}
        return dataclasses.replace(outs[0], grads=grads, noise_multiplier=z,
                                   sensitivity=outs[0].sensitivity,
                                   event=sampler.step_event(GaussianEvent(z)))
    return step


def test_noise_on_every_process_is_flagged():
    control = audit(step_fn=multiprocess(4, noise_on_every_rank=False))
    assert not control.violates_claim, control.to_dict()
    r = audit(step_fn=multiprocess(4, noise_on_every_rank=True))
    assert r.gaussian.epsilon > 1.5 * r.claimed_epsilon, r.to_dict()


@dataclass(frozen=True)
class FlippedQuantile(QuantileClip):
    """The centred count's sign flipped: sum_i (b_i + 1/2) instead of sum_i (b_i - 1/2). Its
    sensitivity is 3/2, while the release (and the Theorem-1 noise split) still assume 1/2."""

    def update(self, state, norms, ctx, release):
        clip_norm = float(state["clip_norm"])
        sigma_b = self.count_noise_std_for(ctx)
        unclipped = finite_or_inf(norms.detach()).reshape(-1) <= clip_norm
        count = (unclipped.to(torch.float64) + 0.5).sum()
        noisy, event = release(count, 0.5, self.count_noise_multiplier(sigma_b))
        fraction = min(max(float(noisy) / ctx.expected_batch_size - 0.5, 0.0), 1.0)
        return {**state, "clip_norm": self.next_clip_norm(clip_norm, fraction),
                "count_noise_std": sigma_b}, (event,)


@pytest.mark.parametrize("cls,flagged", [(QuantileClip, False), (FlippedQuantile, True)])
def test_quantile_count_sign_flip_is_flagged(cls, flagged):
    # the count gets most of the budget (multiplier 2.1 of the total 2) and the canary is NOT
    # clipped (norm 0.5 < C = 1), so the count moves by 1/2 (honest) or 3/2 (mutation)
    s = cls(initial_clip_norm=1.0, count_noise_std=1.05)
    r = audit_step(s, noise_multiplier=Z, delta=DELTA, unit="ic", engine="vmap",
                   n_canaries=1200, canary_norm=0.5, seed=0, trial=True)
    assert r.claimed_epsilon == pytest.approx(1.993, abs=0.01)
    assert r.violates_claim is flagged, r.to_dict()
    if flagged:
        assert r.gaussian.epsilon > 2 * r.claimed_epsilon
    else:
        assert r.gaussian.epsilon > 0.5 * r.claimed_epsilon  # the count is really seen


def _realised_batch_trials(divide_by_realised: bool, trials: int = 300):
    """D = {anchor}, D' = {anchor, canary with a ZERO gradient}: the honest step releases the
    same distribution on both; dividing by the realised batch size halves the release on D'.
    Score: minus the release's norm; Clopper-Pearson over repeated runs."""
    d = 64
    model = _DiracNet(d, 1)
    groups = ParamGroups.flat(model)
    engine = get_engine("vmap")
    sampler = PoissonSampler(8, 1.5)
    anchor = torch.full((d,), 10.0)
    gen = torch.Generator().manual_seed(1)
    rng = np.random.default_rng(2)
    ins, outs = [], []
    z = 4.0
    for _ in range(2 * trials):
        coin = bool(rng.random() < 0.5)
        x = torch.stack([anchor, torch.zeros(d)]) if coin else anchor[None]
        ctx = StepContext.at(0, steps_per_epoch=1, total_steps=1,
                             expected_batch_size=sampler.expected_batch_size, base_noise_multiplier=z)
        out = dp_step(model, x, torch.zeros(len(x)), loss_fn=_linear_loss,
                      strategy=FixedClip(1.0), state={}, engine=engine, groups=groups,
                      sampler=sampler, base_noise_multiplier=z, ctx=ctx, generator=gen)
        g = out.grads["heads.0.weight"].reshape(-1)
        if divide_by_realised:
            g = g * sampler.expected_batch_size / len(x)
        (ins if coin else outs).append(-float(g.norm()))
    claim = step_epsilon(out.event, DELTA)
    return clopper_pearson_epsilon(ins, outs, delta=DELTA).epsilon, claim


def test_division_by_realised_batch_size_is_flagged():
    broken, claim = _realised_batch_trials(True)
    honest, _ = _realised_batch_trials(False)
    assert claim == pytest.approx(0.926, abs=0.01)
    assert broken > 2 * claim
    assert honest < claim


class ShuffledBatches:
    """Epoch-wise shuffling into fixed batches (every example exactly once per epoch), passed off
    as Poisson sampling: the mutation claims the Poisson event (amplification by q)."""

    def __init__(self, n: int, batch: int) -> None:
        self.dataset_size, self.batch = n, batch
        self.sample_rate = batch / n
        self.steps_per_epoch = n // batch
        self._queue: list[torch.Tensor] = []

    def sample(self, generator):
        if not self._queue:
            self._queue = list(torch.randperm(self.dataset_size, generator=generator)
                               .split(self.batch))
        return self._queue.pop(0).sort().values

    def step_event(self, inner):
        return PoissonSampledEvent(self.sample_rate, inner)


@pytest.mark.parametrize("shuffled", [False, True])
def test_poisson_epsilon_claimed_for_shuffled_batches_is_flagged(shuffled):
    n, batch, z, epochs = 100, 10, 1.0, 1
    sampler = ShuffledBatches(n, batch) if shuffled else PoissonSampler(n, float(batch))
    r = presence_audit(sampler, noise_multiplier=z, epochs=epochs, delta=DELTA, trials=1000,
                       significance=1e-3, seed=0)
    claim = epsilon(SelfComposedEvent(PoissonSampledEvent(batch / n, GaussianEvent(z)),
                                      n // batch * epochs), DELTA, "pld")
    assert r.claimed_epsilon == pytest.approx(claim, rel=1e-6)
    assert r.flagged is shuffled, r
    if shuffled:
        assert r.epsilon > r.claimed_epsilon
        assert r.presence_lower > r.poisson_presence
    else:
        assert r.epsilon == r.claimed_epsilon
