"""White-box Dirac-canary audit of dp_step: exact arithmetic, tightness against the ideal Gaussian,
validity against the claim, and detection of a step that leaks more than it claims."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from dpclip.accounting import epsilon
from dpclip.audit.whitebox import DiracAudit, dirac_canary_audit, ideal_bounds
from dpclip.clipping import FixedClip
from dpclip.events import GaussianEvent

DELTA = 1e-5


def test_noise_free_scores_are_the_clipped_canary_over_the_expected_batch():
    # oracle: canary j adds C * a / (a + 1e-6) on coordinate j, divided once by m / 2
    m, c, a = 64, 0.7, 5.0
    r = dirac_canary_audit(FixedClip(c), n_canaries=m, noise_multiplier=0.0, delta=DELTA,
                           canary_norm=a, seed=3)
    want = c * a / (a + 1e-6) / (m / 2)
    # the engines bound the norm of what they sum, rounding included (vmap's float64 reducer of
    # issue 33), so a canary's contribution sits at C minus at most a few float32 rounding units
    # per coordinate summed: never above the claim, within 1e-4 below it
    assert np.all(r.in_scores <= want * (1 + 1e-12))
    np.testing.assert_allclose(r.in_scores, want, rtol=1e-4)
    np.testing.assert_array_equal(r.out_scores, 0.0)
    assert r.in_scores.size + r.out_scores.size == m and 0 < r.in_scores.size < m
    assert r.claimed_epsilon == math.inf and r.mu_claimed == math.inf


@pytest.mark.parametrize("z,steps", [(1.0, 1), (2.0, 4)])
def test_bound_is_valid_and_as_tight_as_an_exact_gaussian(z, steps):
    # mu = sqrt(steps) / z = 1 in both cases: the claim (PLD of the steps' own events) is the
    # epsilon of 1-GDP, and the bounds sit near those of an exact 1-GDP score experiment
    r = dirac_canary_audit(FixedClip(1.0), n_canaries=4000, noise_multiplier=z, delta=DELTA,
                           steps=steps, seed=0)
    assert isinstance(r, DiracAudit)
    assert r.mu_claimed == pytest.approx(1.0)
    assert r.claimed_epsilon == pytest.approx(4.377, abs=0.01)  # 1-GDP at delta 1e-5
    assert 0 < r.one_run.epsilon < r.one_run_fdp.epsilon < r.claimed_epsilon
    assert r.one_run.epsilon == pytest.approx(r.ideal_one_run, rel=0.25)
    # the f-DP bound leans on the most extreme scores: over 12 seeds it spread over
    # 0.85x..1.5x of the ideal value (one-run: 0.9x..1.15x); only its lower side is pinned here
    assert r.one_run_fdp.epsilon > 0.6 * r.ideal_one_run_fdp


def test_removing_the_noise_is_caught():
    # the intended run claims z = 4 (epsilon 0.93 at delta 1e-5); a step that drops its noise
    # gives bounds many times the claim
    claim = epsilon(GaussianEvent(4.0), DELTA, "pld")
    r = dirac_canary_audit(FixedClip(1.0), n_canaries=4000, noise_multiplier=0.0, delta=DELTA,
                           seed=0)
    assert claim == pytest.approx(0.926, abs=0.01)
    assert r.one_run.epsilon > 3 * claim
    assert r.one_run_fdp.epsilon > 8 * claim
    honest = dirac_canary_audit(FixedClip(1.0), n_canaries=4000, noise_multiplier=4.0,
                                delta=DELTA, seed=0)
    assert honest.one_run_fdp.epsilon < honest.claimed_epsilon == pytest.approx(claim)


@dataclass(frozen=True)
class UnderstatedSensitivity(FixedClip):
    """A broken strategy: clips to C but reports C / 10, so the step adds 10x too little noise."""

    def sensitivity(self, state):
        return self.clip_norm / 10


def test_understated_sensitivity_is_caught():
    r = dirac_canary_audit(UnderstatedSensitivity(1.0), n_canaries=4000, noise_multiplier=4.0,
                           delta=DELTA, canary_norm=10.0, seed=0)
    # the steps' events still claim Gaussian(4): epsilon 0.93; the canaries see mu = 2.5
    assert r.claimed_epsilon == pytest.approx(0.926, abs=0.01)
    assert r.one_run.epsilon > 2 * r.claimed_epsilon
    assert r.one_run_fdp.epsilon > 4 * r.claimed_epsilon
    assert r.one_run_fdp.epsilon > 5 * r.ideal_one_run_fdp  # far outside the honest range


def test_engines_agree():
    a = dirac_canary_audit(FixedClip(0.5), n_canaries=200, noise_multiplier=1.0, delta=DELTA,
                           seed=7, engine="vmap")
    b = dirac_canary_audit(FixedClip(0.5), n_canaries=200, noise_multiplier=1.0, delta=DELTA,
                           seed=7, engine="ghost")
    # the engines' float32 sums differ by ~1.02e-7 in every score (the same before and after the
    # float64 noise draw of issue 32); atol 1e-7 passed only while no score came close to 0.
    # Since the ghost engine takes its norms' rounding factor for its public chunk size (4096
    # examples: about 2.5e-4 relative, vmap's for its 256; hundred-and-twentieth review), its
    # clipped vectors are that much shorter: the scores (~1e-2) differ by up to ~1.3e-6
    np.testing.assert_allclose(a.in_scores, b.in_scores, rtol=5e-4, atol=3e-6)
    np.testing.assert_allclose(a.out_scores, b.out_scores, rtol=5e-4, atol=3e-6)


def test_ideal_bounds_grow_with_mu():
    vals = [ideal_bounds(mu, 1000, 1000, delta=DELTA) for mu in (0.0, 0.5, 1.0, 2.0, math.inf)]
    assert vals[0] == (0.0, 0.0)
    for (a0, b0), (a1, b1) in zip(vals, vals[1:]):
        assert a1 > a0 and b1 > b0


@pytest.mark.parametrize("kwargs,match", [
    ({"n_canaries": 1}, "n_canaries"),
    ({"steps": 0}, "steps"),
    ({"noise_multiplier": -1.0}, "noise_multiplier"),
    ({"delta": 0.0}, "delta"),
    ({"canary_norm": 0.0}, "canary_norm"),
])
def test_argument_errors(kwargs, match):
    args = {"n_canaries": 10, "noise_multiplier": 1.0, "delta": DELTA}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        dirac_canary_audit(FixedClip(1.0), **args)


def test_bound_based_strategy_is_refused():
    @dataclass(frozen=True)
    class Bound(FixedClip):
        kind = "bound"

    with pytest.raises(ValueError, match="norm-based"):
        dirac_canary_audit(Bound(1.0), n_canaries=10, noise_multiplier=1.0, delta=DELTA)


def test_torch_default_dtype_untouched():
    dirac_canary_audit(FixedClip(1.0), n_canaries=10, noise_multiplier=1.0, delta=DELTA, seed=0)
    assert torch.get_default_dtype() == torch.float32
