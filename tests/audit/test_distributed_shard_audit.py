"""The white-box Dirac audit of the REAL sharded distributed step (issue 32 item 5): 2 gloo ranks.

Every rank runs the audit with the same seed (the same canaries and coins); its step is
``dp_step`` with :class:`dpclip.training.noise_shard.ShardNoiseEngine`, the engine
``make_private`` uses: each rank clips its shard of the batch, adds the noise of its own block of
coordinates (half of the canaries' coordinates each) from its own stream, and the release
all-reduces. The noise key follows the audit's seed (reproducible, NOT private: an audit releases
nothing about real data).

* Control: the library's placement: not flagged, and the Gaussian fit sees multiplier ``z``.
* Mutation: rank 1 draws nothing for its block (a rank that skips its draw, e.g. a bounds bug):
  half of the coordinates are released without noise, while the step still claims ``z``:
  flagged. (A generator shared by the ranks, the other way to break one draw per coordinate, is
  refused before any draw: docs/errors.md entry 93.)

The companion file ``test_distributed_mutation.py`` audits the after-reduce placement of
:class:`~dpclip.training.distributed.DistributedEngine` with a shared generator (unchanged).
"""

from __future__ import annotations

import itertools

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
    from dpclip.audit.step_audit import audit_step
    from dpclip.clipping import FixedClip
    from dpclip.randomness import PrivateRandomness
    from dpclip.training.distributed import shard_bounds
    from dpclip.training.noise_shard import NoiseShard, ShardNoiseEngine
    from dpclip.training.step import dp_step

    class SkippingShard(NoiseShard):
        """The mutation: rank 1 draws nothing for its block."""

        def draws(self, total, generator):
            got = super().draws(total, generator)
            return [] if self.rank == 1 else got

    rng = PrivateRandomness.reproducible(0)  # the same key on every rank (seeded audit)
    steps = itertools.count()
    _ctx = ctx

    def step(model, x, y, *, engine, generator, **kw):
        start, stop = shard_bounds(int(x.shape[0]), WORLD, _ctx.rank)
        eng = ShardNoiseEngine(engine, _ctx, rng)
        if mutated:
            eng.noise_shard = SkippingShard(_ctx, rng)
        return dp_step(model, x[start:stop], y[start:stop], engine=eng,
                       generator=eng.noise_shard.generator(next(steps)), **kw)

    r = audit_step(FixedClip(1.0), noise_multiplier=Z, delta=DELTA, engine="ghost",
                   n_canaries=4000, canaries_per_step=2000, seed=0, step_fn=step)
    d = r.to_dict()
    d["engine_ran"] = r.engine_ran
    return d


@pytest.mark.parametrize("mutated", [False, True], ids=["control", "rank-skips-its-block"])
def test_real_two_process_sharded_noise(tmp_path, mutated):
    rows = launch(_audit_on_rank, WORLD, tmp_path, mutated, timeout=120.0)
    r = rows[0]
    assert rows[1]["gaussian_epsilon"] == r["gaussian_epsilon"]  # every rank released the same
    assert r["claimed_epsilon"] == pytest.approx(1.993, abs=0.01)
    if not mutated:  # seed 0: mu_hat 0.44-0.48 for 0.5 (it moves with the stream's layout)
        assert not r["violates_claim"], r
        assert r["gaussian_epsilon"] > 0.7 * r["claimed_epsilon"], r  # the audit sees the step
        # an estimate from 4000 canaries: above 1.1 / Z would be a violation; well below would
        # mean the audit does not see the step
        assert 0.7 / Z < r["mu_hat"] < 1.1 / Z, r
    else:  # seed 0: Gaussian fit 2.48 (1.24x the claim), mu_hat 0.695
        assert r["violates_claim"], r
        assert r["gaussian_epsilon"] > 1.1 * r["claimed_epsilon"], r
        assert r["mu_hat"] > 1.2 / Z, r
