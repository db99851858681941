"""quantile (Andrew et al. 2021): Thm-1 split, update rule, public denominator, convergence."""

import logging
import math
from statistics import NormalDist

import pytest
import torch

from dpclip.accounting import epsilon
from dpclip.clipping import StepContext, make_strategy
from dpclip.clipping.quantile import QuantileClip, split_noise_multiplier
from dpclip.events import ComposedEvent, GaussianEvent, PoissonSampledEvent, SelfComposedEvent
from dpclip.training.trainer import TrainConfig, train


def ctx(b: float = 100.0, step: int = 0) -> StepContext:
    return StepContext(step=step, epoch=0, steps_per_epoch=10, total_steps=10,
                       expected_batch_size=b, base_noise_multiplier=1.0)


class NoNoise:
    """A release without noise that records what the strategy asked to release."""

    def __init__(self):
        self.calls = []

    def __call__(self, value, sensitivity, noise_multiplier):
        self.calls.append((float(value), sensitivity, noise_multiplier))
        return value, GaussianEvent(noise_multiplier)


class GaussianRelease:
    """The step's release (Poisson, k = 1): value + N(0, (multiplier * sensitivity)^2)."""

    def __init__(self, seed):
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, value, sensitivity, noise_multiplier):
        noise = torch.randn((), generator=self.gen, dtype=torch.float64)
        return value + noise_multiplier * sensitivity * noise, GaussianEvent(noise_multiplier)


def run(strategy, norm_batches, b, release=None):
    """Thread the state through begin_step/weights/update; returns the C_t used at each step."""
    release = release or NoNoise()
    state, used = strategy.init_state(), []
    for t, norms in enumerate(norm_batches):
        c = ctx(b, t)
        state = strategy.begin_step(state, c)
        used.append(strategy.sensitivity(state))
        n = torch.as_tensor(norms, dtype=torch.float64)
        w = strategy.weights(n, state)
        expected = torch.nan_to_num(torch.clamp(used[-1] / (n + 1e-6), max=1.0), nan=0.0)
        assert torch.equal(w, expected)  # clipped with the CURRENT C_t
        state, events = strategy.update(state, n, c, release)
        assert len(events) == 1
    return used, state


# ---- T4 and the noise split ----------------------------------------------------------------
def test_T4_theorem1_split():
    assert split_noise_multiplier(1.0, 10.0, "x", "y") == pytest.approx(1.005038, abs=1e-6)
    s = QuantileClip()  # default sigma_b = expected batch size / 20 = 5 at m = 100
    st = s.begin_step(s.init_state(), ctx(100.0))
    assert st["count_noise_std"] == 5.0
    assert s.noise_multiplier(st, 1.0) == pytest.approx(1.005038, abs=1e-6)
    assert QuantileClip(count_noise_std=5.0).planned_event(1.0, ctx(37.0)) == ComposedEvent(
        (GaussianEvent(split_noise_multiplier(1.0, 10.0, "x", "y")), GaussianEvent(10.0)))
    assert s.noise_multiplier(st, 0.0) == 0.0  # no noise stays no noise


@pytest.mark.parametrize("base", [1.0, 1.6, 3.0])
def test_base_at_or_above_twice_sigma_b_is_refused(base):
    s = QuantileClip(count_noise_std=0.8)  # 2 sigma_b = 1.6
    st = s.begin_step(s.init_state(), ctx())
    if base < 1.6:
        assert s.noise_multiplier(st, base) > base
        return
    with pytest.raises(ValueError, match=r"must be < 2 \* count_noise_std = 1\.6"):
        s.noise_multiplier(st, base)
    with pytest.raises(ValueError, match="count_noise_std"):
        s.planned_event(base, ctx())


def test_P4a_epsilon_equals_fixed_clipping_at_the_users_sigma():
    logging.getLogger("absl").setLevel(logging.ERROR)
    z, q, steps, delta = 1.1, 0.01, 2000, 1e-5
    s = QuantileClip()  # sigma_b = 256 / 20
    adaptive = SelfComposedEvent(PoissonSampledEvent(q, s.planned_event(z, ctx(256.0))), steps)
    fixed = SelfComposedEvent(PoissonSampledEvent(q, GaussianEvent(z)), steps)
    z_delta = s.planned_event(z, ctx(256.0)).events[0].noise_multiplier
    buggy = SelfComposedEvent(PoissonSampledEvent(q, GaussianEvent(z_delta)), steps)
    for acc in ("rdp", "pld"):
        e_adaptive, e_fixed = epsilon(adaptive, delta, acc), epsilon(fixed, delta, acc)
        assert e_adaptive == pytest.approx(e_fixed, rel=1e-9)
        # the pre-1.6 Opacus bug: accounting the gradient multiplier alone under-reports
        assert epsilon(buggy, delta, acc) < e_fixed * 0.9995


# ---- the update rule ----------------------------------------------------------------------
def test_T5_geometric_growth_when_everything_is_clipped():
    s = QuantileClip(initial_clip_norm=0.1, target_quantile=0.5, clip_lr=0.2)
    used, state = run(s, [[1e3] * 10] * 23, b=10.0)
    assert state["clip_norm"] / 0.1 == pytest.approx(9.97, abs=0.005)
    assert state["clip_norm"] / 0.1 == pytest.approx(math.exp(0.2 * 0.5 * 23), rel=1e-12)
    assert used[1] > used[0]  # grows step by step


def test_hand_traced_five_steps_geometric_and_linear():
    # expected batch size 4; gamma = 0.3; eta = 0.5; zero count noise
    norms = [
        [0.5, 0.9, 1.5, 3.0],  # C0 = 1.0: 2 unclipped of 4 -> b~ = (2 - 2)/4 + 1/2 = 0.5
        [0.1, 0.2, 0.3],  # realised 3: centred (3 - 1.5) -> b~ = 1.5/4 + 0.5 = 0.875
        [5.0, 6.0, 7.0, 8.0, 9.0],  # none unclipped: centred -2.5 -> b~ = -2.5/4 + .5 -> 0 (clamp)
        [],  # empty batch: centred 0 -> b~ = 0.5
        [0.0, float("nan"), float("inf"), 0.6],  # NaN/inf count as clipped: 2 of 4 -> 0.5
    ]
    fractions = [0.5, 0.875, 0.0, 0.5, 0.5]
    c = [1.0]
    for f in fractions:
        c.append(c[-1] * math.exp(-0.5 * (f - 0.3)))
    s = QuantileClip(initial_clip_norm=1.0, target_quantile=0.3, clip_lr=0.5)
    used, state = run(s, norms, b=4.0)
    assert used == pytest.approx(c[:5], rel=1e-14)
    assert state["clip_norm"] == pytest.approx(c[5], rel=1e-14)
    # in numbers (catches a formula that drifts together with the expression above)
    assert c[1:] == pytest.approx([0.904837, 0.678752, 0.788597, 0.713552, 0.645649], rel=1e-5)

    lin = [1.0]
    for f in fractions:
        lin.append(lin[-1] - 0.5 * (f - 0.3))
    s = QuantileClip(initial_clip_norm=1.0, target_quantile=0.3, clip_lr=0.5,
                     update_rule="linear")
    used, state = run(s, norms, b=4.0)
    assert used == pytest.approx(lin[:5], rel=1e-14)
    assert state["clip_norm"] == pytest.approx(lin[5], rel=1e-14)


def test_clip_norm_stays_within_bounds():
    s = QuantileClip(initial_clip_norm=0.1, clip_lr=1.0, update_rule="linear",
                     min_clip_norm=0.05, max_clip_norm=2.0)
    _, st = run(s, [[1e-3] * 4] * 3, b=4.0)  # all unclipped: C - 0.5 per step -> floor
    assert st["clip_norm"] == 0.05
    s = QuantileClip(initial_clip_norm=1.0, clip_lr=1.0, max_clip_norm=2.0)
    _, st = run(s, [[1e3] * 4] * 10, b=4.0)  # all clipped: grows -> ceiling
    assert st["clip_norm"] == 2.0


def test_P4b_count_is_divided_by_the_expected_not_the_realised_batch_size():
    s = QuantileClip(initial_clip_norm=1.0, target_quantile=0.5, clip_lr=0.2,
                     count_noise_std=2.0)
    unclipped, clipped = [0.1] * 6, [9.0] * 4
    results = {}
    for name, norms in {"6 unclipped": unclipped, "6 unclipped + 4 clipped": unclipped + clipped,
                        "12 unclipped": unclipped * 2}.items():
        rel = NoNoise()
        _, st = run(s, [norms], b=10.0, release=rel)
        value, sens, mult = rel.calls[0]
        # the released statistic is the centred count; its noise is public (independent of B')
        assert (sens, mult) == (0.5, 4.0)
        results[name] = (value, st["clip_norm"])
    expected = {"6 unclipped": (3.0, 0.8), "6 unclipped + 4 clipped": (1.0, 0.6),
                "12 unclipped": (6.0, 1.0)}  # b~ = centred / 10 + 1/2 (clamped)
    for name, (value, fraction) in expected.items():
        assert results[name][0] == value
        assert results[name][1] == pytest.approx(math.exp(-0.2 * (fraction - 0.5)), rel=1e-14)
    # the realised-size denominator would give 1.0 for the first batch, not 0.8
    assert results["6 unclipped"][1] != pytest.approx(math.exp(-0.2 * 0.5), rel=1e-6)


def test_empty_batch_still_releases_the_count():
    s = QuantileClip()
    rel = NoNoise()
    state = s.begin_step(s.init_state(), ctx(64.0))
    state, events = s.update(state, torch.empty(0), ctx(64.0), rel)
    assert rel.calls == [(0.0, 0.5, 2 * 64.0 / 20)]
    assert events == (GaussianEvent(2 * 64.0 / 20),)
    assert state["clip_norm"] == pytest.approx(0.1)  # b~ = 1/2 = gamma: unchanged


@pytest.mark.parametrize("bad,match", [
    ({"target_quantile": 0.0}, "target_quantile"), ({"target_quantile": 1.5}, "target_quantile"),
    ({"update_rule": "exp"}, "update_rule"), ({"clip_lr": -1}, "clip_lr"),
    ({"count_noise_std": 0}, "count_noise_std"),
    ({"initial_clip_norm": 10.0, "max_clip_norm": 1.0}, "max_clip_norm"),
])
def test_bad_parameters_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        QuantileClip(**bad)


def test_registry_parses_cli_strings():
    s = make_strategy("quantile", {"count_noise_std": "none", "update_rule": "linear",
                                   "target_quantile": "0.7"})
    assert s == QuantileClip(update_rule="linear", target_quantile=0.7)


# ---- closed loop: Andrew et al. Fig. 2 (log-normal norms) --------------------------------
@pytest.mark.parametrize("gamma", [0.1, 0.3, 0.5, 0.7, 0.9])
def test_converges_to_the_target_quantile_on_lognormal_norms(gamma):
    m, rounds, last = 100, 300, 50
    s = QuantileClip(initial_clip_norm=0.1, target_quantile=gamma, clip_lr=0.2)  # sigma_b = m/20
    gen = torch.Generator().manual_seed(1000 + int(gamma * 10))
    batches = [torch.exp(torch.randn(m, generator=gen, dtype=torch.float64))
               for _ in range(rounds)]
    used, _ = run(s, batches, b=float(m), release=GaussianRelease(seed=7))
    true_quantile = math.exp(NormalDist().inv_cdf(gamma))
    estimate = math.exp(sum(math.log(c) for c in used[-last:]) / last)
    assert abs(estimate / true_quantile - 1) < 0.10, (estimate, true_quantile)
    assert used[0] == 0.1


# ---- end to end ---------------------------------------------------------------------------
def test_train_with_target_epsilon_meets_it_and_adapts():
    logging.getLogger("absl").setLevel(logging.ERROR)
    cfg = TrainConfig(dataset="synthetic", model="mlp", strategy="quantile",
                      strategy_params={"initial_clip_norm": 0.05}, epsilon=3.0, delta=1e-5,
                      epochs=2, batch_size=64, lr=0.5, optimizer="momentum", seed=0)
    res = train(cfg, progress=False)
    s = res.summary
    assert s["epsilon"] <= 3.0 and not s["stopped_by_budget"]
    assert s["steps"] == res.ledger.steps == 16
    # every step records the Thm-1 pair whose combination is the calibrated sigma
    (event, count), = res.ledger.entries
    inner = event.event
    assert count == 16 and isinstance(inner, ComposedEvent)
    z_g, z_b = (e.noise_multiplier for e in inner.events)
    assert z_b == 2 * 64 / 20
    assert (z_g**-2 + z_b**-2) ** -0.5 == pytest.approx(s["noise_multiplier"], rel=1e-12)
    assert res.history[-1]["clip_threshold"] > 0.05 * 1.5  # the threshold grew from C0
