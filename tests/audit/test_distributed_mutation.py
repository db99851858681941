"""Mutation test on the REAL multi-process step (issue 16, item 4): 2 gloo ranks on localhost.

Every rank runs the white-box Dirac audit (``audit_step``, same seed: the same canaries, coins
and shared noise generator on every rank, as ``dpclip.training.distributed.shared_randomness`` arranges in
training); its step is ``dp_step`` with :class:`dpclip.training.distributed.DistributedEngine`: each rank
clips its contiguous shard of the batch and the clipped sums are all-reduced over gloo.

* Control: the after-reduce placement (``DistributedEngine``; ``make_private``'s own placement
  since issue 32, each rank noising its block, is audited in ``test_distributed_shard_audit.py``).
  ``dp_step`` adds ``N(0, (z S)^2)`` once, after the all-reduce, from the shared generator (every
  rank makes the same single draw).
* Mutation (a real bug pattern when noise is moved "into the ranks"): each rank adds its own
  "share" of the noise to its local clipped sum before the all-reduce, from its own generator,
  splitting the STANDARD DEVIATION linearly (``z S / W`` per rank) instead of the variance
  (``z S / sqrt(W)``). The all-reduced noise then has std ``z S / sqrt(W)``: with ``W = 2`` the
  step is a Gaussian mechanism of multiplier ``z / sqrt(2)`` while it still claims ``z``.

The audit must flag the mutation (a lower bound above the claim) and not the control. The launch
is time-bounded (``tests/distributed/_launch.py``: a hang fails the test).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.distributed._launch import launch

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is not available")

Z = 2.0  # claimed: one step of Gaussian(2), epsilon 1.99 at delta 1e-5
DELTA = 1e-5
WORLD = 2


def _audit_on_rank(ctx, mutated: bool) -> dict:
    """Runs on every rank: the Dirac audit of one distributed step (see the module docstring)."""
    from dpclip.audit.step_audit import audit_step
    from dpclip.clipping import FixedClip
    from dpclip.training.distributed import DistributedEngine, shard_bounds
    from dpclip.events import GaussianEvent
    from dpclip.training.step import dp_step

    class RankNoiseEngine(DistributedEngine):
        """The mutation: every rank adds N(0, share^2) to its LOCAL clipped sum (own generator)
        before the all-reduce."""

        share = 0.0
        rank_generator = torch.Generator().manual_seed(1000 + ctx.rank)  # independent per rank

        def _all_reduce_grads(self, grads):
            noisy = {n: g + self.share * torch.randn(g.shape, generator=self.rank_generator,
                                                     dtype=g.dtype) for n, g in grads.items()}
            return super()._all_reduce_grads(noisy)

    def step(model, x, y, *, engine, sampler, base_noise_multiplier, strategy, state, ctx: object,
             **kw):
        start, stop = shard_bounds(int(x.shape[0]), WORLD, _ctx.rank)
        z = base_noise_multiplier
        if not mutated:  # the library's step: noise once, after the all-reduce
            return dp_step(model, x[start:stop], y[start:stop], engine=DistributedEngine(
                engine, _ctx), sampler=sampler, base_noise_multiplier=z, strategy=strategy,
                state=state, ctx=ctx, **kw)
        eng = RankNoiseEngine(engine, _ctx)
        s = sampler.sensitivity_factor * float(strategy.sensitivity(state))
        eng.share = z * s / WORLD  # the bug: std split linearly (should be z s / sqrt(W))
        out = dp_step(model, x[start:stop], y[start:stop], engine=eng, sampler=sampler,
                      base_noise_multiplier=0.0, strategy=strategy, state=state, ctx=ctx, **kw)
        return dataclasses.replace(out, noise_multiplier=z, sensitivity=s,
                                   event=sampler.step_event(GaussianEvent(z)))

    _ctx = ctx
    r = audit_step(FixedClip(1.0), noise_multiplier=Z, delta=DELTA, engine="ghost",
                   n_canaries=4000, canaries_per_step=2000, seed=0, step_fn=step)
    d = r.to_dict()
    d["engine_ran"] = r.engine_ran
    return d


@pytest.mark.parametrize("mutated", [False, True], ids=["control", "noise-share-per-rank"])
def test_real_two_process_noise_placement(tmp_path, mutated):
    rows = launch(_audit_on_rank, WORLD, tmp_path, mutated, timeout=120.0)
    r = rows[0]
    assert rows[1]["gaussian_epsilon"] == r["gaussian_epsilon"]  # every rank released the same
    assert r["engine_ran"] == "ghost"
    assert r["claimed_epsilon"] == pytest.approx(1.993, abs=0.01)
    if not mutated:
        assert not r["violates_claim"], r
        assert r["gaussian_epsilon"] > 0.8 * r["claimed_epsilon"], r  # the audit sees the step
        assert r["mu_hat"] == pytest.approx(1 / Z, rel=0.1)
    else:
        assert r["violates_claim"], r
        # the Gaussian fit's lower confidence bound: 1.23x the claim at seed 0 (the true epsilon
        # of multiplier z / sqrt(2) is 2.94, 1.48x); its point estimate of mu is sqrt(W) / z
        assert r["gaussian_epsilon"] > 1.1 * r["claimed_epsilon"], r
        assert r["mu_hat"] == pytest.approx(math.sqrt(WORLD) / Z, rel=0.1)
