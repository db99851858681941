"""DP-FedAvg aggregation: the tests that catch known bugs of other implementations.

Oracles: float64 naive loops, the published/derived test vectors T4/T5 (algorithms.md section 5),
dp-accounting's epsilon of the single Gaussian that Theorem 1 says a round is equivalent to.
"""

from __future__ import annotations

import math

import pytest
import torch

from dpclip.accounting import Ledger, combined_noise_multiplier, compute_epsilon
from dpclip.clipping.adaclip import AdaClip
from dpclip.clipping.fixed import FixedClip
from dpclip.clipping.layerwise import PerLayerClip
from dpclip.clipping.quantile import QuantileClip, split_noise_multiplier
from dpclip.clipping.registry import make_strategy
from dpclip.events import (
    ComposedEvent,
    GaussianEvent,
    PoissonSampledEvent,
    SampledWithoutReplacementEvent,
)
from dpclip.federated import DPAggregator, UserWeights, make_user_sampler
from dpclip.randomness import PrivateRandomness


def agg(strategy, *, n_users=1000, m=100, z=0.0, rounds=200, sampling="poisson", seed=0,
        weights=None):
    return DPAggregator(strategy, make_user_sampler(sampling, n_users, m), z, rounds,
                        PrivateRandomness.reproducible(seed), weights)


# -- the clip moves the right way ----------------------------------------------------------------

def test_clip_grows_towards_large_norms_and_shrinks_towards_small_ones():
    for norm, check in ((10.0, lambda c: 5.0 <= c <= 20.0), (0.01, lambda c: c <= 0.02)):
        a = agg(QuantileClip(initial_clip_norm=0.1), m=100, sampling="fixed-size")
        d = torch.zeros(100, 4)
        d[:, 0] = norm
        for _ in range(200):
            a.aggregate(d)
        c = a.state["clip_norm"]
        assert check(c), (norm, c)


def test_geometric_growth_t5():
    """T5: all clipped, gamma = 0.5, eta_C = 0.2, 23 rounds: C grows x9.97."""
    a = agg(QuantileClip(initial_clip_norm=0.1, count_noise_std=1e-12), m=100,
            sampling="fixed-size")
    d = torch.full((100, 1), 1e6)
    for _ in range(23):
        a.aggregate(d)
    assert a.state["clip_norm"] / 0.1 == pytest.approx(math.exp(0.2 * 0.5 * 23), rel=1e-9)
    assert math.exp(0.2 * 0.5 * 23) == pytest.approx(9.97, abs=0.005)


# -- the noise uses the clip of the round --------------------------------------------------------

@pytest.mark.parametrize("sampling,factor", [("poisson", 1), ("fixed-size", 2)])
def test_noise_std_is_z_delta_times_clip_of_the_round(sampling, factor):
    """Zero updates (all unclipped, so C shrinks every round): the released update has std
    ``z_Delta k C_t / m`` with C_t the clip BEFORE the round's update (k = 2 under replace-one)."""
    z, m, d, rounds = 1.0, 100, 10, 2000
    # float64 deltas and a tiny floor: C_t moves (x exp(-0.1)) in every one of the 2000 rounds
    a = agg(QuantileClip(initial_clip_norm=1.0, min_clip_norm=1e-120), m=m, z=z, rounds=rounds,
            sampling=sampling)
    z_delta = split_noise_multiplier(z, 2 * 5.0, "t", "t")
    ratios, ratios_next = [], []
    for _ in range(rounds):
        before = a.state["clip_norm"]
        out = a.aggregate(torch.zeros(m, d, dtype=torch.float64))
        after = a.state["clip_norm"]
        assert out.clip_norm == before and out.noise_multiplier == pytest.approx(z_delta)
        ratios.append(out.update / (z_delta * factor * before / m))
        ratios_next.append(out.update / (z_delta * factor * after / m))
    assert a.state["clip_norm"] < 1e-80  # the clip moved in every round
    std = float(torch.cat(ratios).std())
    assert std == pytest.approx(1.0, rel=0.05)
    # the bug (noise from the updated clip) is exp(0.1) = 1.105 off: outside the tolerance
    assert float(torch.cat(ratios_next).std()) == pytest.approx(math.exp(0.1), rel=0.03)


# -- Theorem 1 -----------------------------------------------------------------------------------

def test_noise_split_test_vectors():
    # T4: z = 1, sigma_b = 5 (m = 100)
    assert split_noise_multiplier(1.0, 2 * 5.0, "t", "t") == pytest.approx(1.005038, abs=1e-6)
    # z = 2, m = 100: sigma_b = m / 20 = 5 by default, through the aggregator
    a = agg(QuantileClip(), m=100, z=2.0)
    out = a.aggregate(torch.zeros(100, 3))
    assert out.noise_multiplier == pytest.approx(2.0412, abs=5e-5)
    assert combined_noise_multiplier(out.noise_multiplier, 2 * 5.0) == pytest.approx(2.0)


def test_split_impossible_fails_at_construction():
    with pytest.raises(ValueError, match="count_noise_std"):
        agg(QuantileClip(count_noise_std=0.5), m=100, z=1.5)


def test_round_event_and_user_level_epsilon_equal_single_gaussian():
    z, q, rounds = 1.1, 0.1, 50
    a = agg(QuantileClip(), n_users=1000, m=100, z=z, rounds=rounds)
    for _ in range(rounds):
        a.aggregate(torch.zeros(0, 2))
    (event, count), = a.ledger.entries
    assert count == rounds
    assert isinstance(event, PoissonSampledEvent) and event.sample_rate == pytest.approx(q)
    assert isinstance(event.event, ComposedEvent)
    zg, zc = (e.noise_multiplier for e in event.event.events)
    assert zc == pytest.approx(10.0) and combined_noise_multiplier(zg, zc) == pytest.approx(z)
    single = Ledger()
    single.record(PoissonSampledEvent(q, GaussianEvent(z)), rounds)
    eps = compute_epsilon(a.ledger, 1e-5).epsilon
    assert eps == pytest.approx(compute_epsilon(single, 1e-5).epsilon, rel=1e-3)


def test_fixed_size_round_event_is_without_replacement():
    a = agg(FixedClip(1.0), n_users=50, m=10, z=1.0, sampling="fixed-size")
    users = a.sample_users()
    assert len(users) == 10 and len(set(users)) == 10
    a.aggregate(torch.zeros(10, 2))
    (event, _), = a.ledger.entries
    assert event == SampledWithoutReplacementEvent(50, 10, GaussianEvent(1.0))


# -- the count: centred, sensitivity 1/2 x sampler factor, public denominator ---------------------

@pytest.mark.parametrize("sampling,factor", [("poisson", 1), ("fixed-size", 2)])
def test_count_noise_std_is_sigma_b_times_factor(sampling, factor):
    """Half the users unclipped: the centred count is exactly 0, so the released fraction's
    deviation from 1/2 is pure noise / m; its std must be sigma_b k / m (k: sampler factor)."""
    m, sigma_b, eta, rounds = 100, 5.0, 0.01, 2000
    a = agg(QuantileClip(initial_clip_norm=1.0, clip_lr=eta, count_noise_std=sigma_b), m=m,
            sampling=sampling, rounds=rounds)
    d = torch.zeros(m, 1)
    d[m // 2:] = 1e9
    noise = []
    for _ in range(rounds):
        before = a.state["clip_norm"]
        a.aggregate(d)
        frac = 0.5 - math.log(a.state["clip_norm"] / before) / eta
        noise.append((frac - 0.5) * m)
    std = float(torch.tensor(noise).std())
    assert std == pytest.approx(sigma_b * factor, rel=0.05)


def test_count_uses_public_denominator_not_realised_clients():
    """20 users, all unclipped, expected m = 100: b~ = (20 * 1/2) / 100 + 1/2 = 0.6 (not 1.0)."""
    a = agg(QuantileClip(initial_clip_norm=1.0, count_noise_std=1e-12), m=100)
    a.aggregate(torch.zeros(20, 1))
    assert a.state["clip_norm"] == pytest.approx(math.exp(-0.2 * (0.6 - 0.5)), rel=1e-9)


# -- empty rounds ----------------------------------------------------------------------------------

def test_empty_round_is_noise_recorded_and_centred():
    z, m = 1.0, 100
    a = agg(QuantileClip(initial_clip_norm=2.0), m=m, z=z)
    out = a.aggregate(torch.zeros(0, 5000))
    assert out.num_clients == 0 and a.ledger.steps == 1
    z_delta = split_noise_multiplier(z, 10.0, "t", "t")
    assert float(out.update.std()) == pytest.approx(z_delta * 2.0 / m, rel=0.05)
    # count of nobody: b~ = noise/m + 1/2, so C barely moves (|log| <= 0.2 * 0.25)
    assert abs(math.log(a.state["clip_norm"] / 2.0)) < 0.05


# -- clipping, sum and normalisation against a float64 naive loop ---------------------------------

def test_clip_sum_divide_matches_naive_loop():
    g = torch.Generator().manual_seed(3)
    deltas = torch.randn(7, 11, generator=g) * torch.tensor([0.1, 0.5, 1, 2, 5, 0.01, 3.0])[:, None]
    C, m = 1.3, 6.0
    a = agg(FixedClip(C), n_users=60, m=m)
    out = a.aggregate(deltas)
    expect = torch.zeros(11, dtype=torch.float64)
    for row in deltas.double():
        n = math.sqrt(sum(float(v) ** 2 for v in row))
        expect += min(1.0, C / (n + 1e-6)) * row
    torch.testing.assert_close(out.update.double(), expect / m, rtol=1e-6, atol=1e-7)
    assert out.noise_std == 0.0


def test_declared_capped_weights_scale_sensitivity_and_denominator():
    counts = [5, 40, 80, 10]
    w = UserWeights.capped_counts(counts, cap=40)
    assert w.weights == (0.125, 1.0, 1.0, 0.25)
    a = agg(FixedClip(1.0), n_users=4, m=2, z=0.0, weights=w)
    deltas = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 2.0], [1.0, 0.0]])
    users = [0, 1, 2, 3]
    out = a.aggregate(deltas, users)
    expected_total = 2 / 4 * sum(w.weights)
    expect = (0.125 * deltas[0] / 5 * 1.0 + 1.0 * deltas[1] + 1.0 * deltas[2] / 2 + 0.25 * deltas[3])
    torch.testing.assert_close(out.update, expect / expected_total, rtol=1e-5, atol=1e-6)
    # with noise: std = z * max_weight * C (max_weight 2 doubles it)
    b = agg(FixedClip(1.0), n_users=4, m=2, z=1.0, weights=UserWeights((2.0, 1.0, 1.0, 0.5), 2.0))
    assert b.aggregate(torch.zeros(0, 2), []).noise_std == pytest.approx(2.0)
    with pytest.raises(ValueError, match="max_weight"):
        UserWeights((1.5, 1.0), 1.0)
    with pytest.raises(ValueError, match="users="):
        b.aggregate(deltas)


def test_nonfinite_delta_gets_weight_zero():
    a = agg(FixedClip(1.0), n_users=10, m=2)
    d = torch.tensor([[float("nan"), 1.0], [0.0, 0.5]])
    out = a.aggregate(d)
    torch.testing.assert_close(out.update, torch.tensor([0.0, 0.25]))


# -- schedules and other norm strategies ----------------------------------------------------------

def test_schedule_clip_follows_rounds():
    s = make_strategy("lin-decay", {"clip_norm": 1.0, "a": 0.5})
    a = agg(s, n_users=100, m=10, z=1.0, rounds=9)
    clips = [a.aggregate(torch.zeros(0, 1)).clip_norm for _ in range(9)]
    assert clips[0] == pytest.approx(1.0) and clips[3] == pytest.approx(0.5)
    assert clips[8] == pytest.approx(1 / 3)


def test_refuses_group_and_per_example_strategies():
    with pytest.raises(ValueError, match="flat"):
        agg(PerLayerClip())
    with pytest.raises(ValueError, match="P-GRAD"):
        agg(AdaClip())


@pytest.mark.parametrize("max_weight", [1.0, 2.5])
def test_capped_weights_sensitivity_is_max_weight_times_clip_on_neighbours(max_weight):
    """Add/remove one user: the clipped weighted sum moves by at most a_max * C, and by exactly
    that for a user of weight a_max whose delta is clipped (so the noise scale is tight)."""
    g = torch.Generator().manual_seed(0)
    n, d, clip = 6, 5, 0.7
    deltas = torch.randn(n, d, generator=g, dtype=torch.float64) * 3
    weights = UserWeights(tuple([max_weight] + [max_weight * k / n for k in range(1, n)]),
                          max_weight)
    a = agg(FixedClip(clip), n_users=n, m=3, z=0.0, weights=weights)
    total = a.denominator
    assert total == pytest.approx(3 / n * sum(weights.weights))
    full = a.aggregate(deltas.float(), list(range(n))).update.double()
    for u in range(n):
        rest = [i for i in range(n) if i != u]
        without = a.aggregate(deltas[rest].float(), rest).update.double()
        diff = float((full - without).norm()) * total  # the sums' difference
        assert diff <= max_weight * clip * (1 + 1e-5)
        if u == 0:  # weight a_max, ||delta|| >> C
            assert diff == pytest.approx(max_weight * clip, rel=1e-5)


# -- the emitted event is the planned one (issue 34: one Plan for steps and rounds) ---------------

class _LoudCount(QuantileClip):
    """A mutant whose count is released with twice the planned multiplier: the ledger would record
    an event the plan (and the calibration) never saw."""

    def update(self, state, norms, ctx, release):
        new, (event,) = super().update(state, norms, ctx, release)
        return new, (GaussianEvent(2 * event.noise_multiplier),)


def test_round_emitting_another_event_than_planned_is_refused_and_not_recorded():
    from dpclip.training.plan import PlanMismatchError

    a = agg(_LoudCount(initial_clip_norm=1.0, count_noise_std=1.0), m=10, n_users=100, z=0.5,
            sampling="fixed-size")
    with pytest.raises(PlanMismatchError, match="privacy bug.*round 0"):
        a.aggregate(torch.ones(10, 4))
    assert a.ledger.steps == 0 and a.round_index == 0  # nothing recorded, the state unchanged
    assert a.state == a.strategy.init_state()


def test_rounds_beyond_the_plan_are_refused():
    a = agg(FixedClip(clip_norm=1.0), m=10, n_users=100, z=1.0, rounds=2, sampling="fixed-size")
    for _ in range(2):
        a.aggregate(torch.ones(10, 3))
    with pytest.raises(RuntimeError,
                       match=r"all 2 planned rounds are done.*FedAvgConfig\(rounds=...\)"):
        a.aggregate(torch.ones(10, 3))
    assert a.ledger.steps == 2


def test_rounds_and_steps_share_one_plan():
    from dpclip.federated import FedAvgConfig, plan_ledger, round_context
    from dpclip.training.plan import Plan

    strategy = QuantileClip(count_noise_std=1.0)
    a = agg(strategy, m=6, n_users=30, z=0.2, rounds=5)
    plan = Plan.for_rounds(strategy, a.sampler, 5)
    for r in range(5):
        assert a.context(r) == plan.ctx(r, 0.2) == round_context(r, 5, 6, 0.2)
        assert a.planned_event(r) == plan.event(r, 0.2)
    cfg = FedAvgConfig(rounds=5, clients_per_round=6, delta=1e-3, noise_multiplier=0.2)
    assert plan_ledger(strategy, cfg, 30, 0.2) == plan.ledger(0.2)
