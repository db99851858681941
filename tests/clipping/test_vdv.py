"""vdv (van der Veen et al. 2018): DP mean of clipped norms, noise split, events."""

import logging
import math

import pytest
import torch

from dpclip.accounting import epsilon
from dpclip.clipping import StepContext, make_strategy
from dpclip.clipping.vdv import MeanNormClip
from dpclip.events import ComposedEvent, GaussianEvent, PoissonSampledEvent, SelfComposedEvent
from dpclip.training.trainer import TrainConfig, train


def ctx(b: float = 100.0) -> StepContext:
    return StepContext(step=0, epoch=0, steps_per_epoch=10, total_steps=10,
                       expected_batch_size=b, base_noise_multiplier=1.0)


class NoNoise:
    def __init__(self, shift=0.0):
        self.calls, self.shift = [], shift

    def __call__(self, value, sensitivity, noise_multiplier):
        self.calls.append((float(value), sensitivity, noise_multiplier))
        return value + self.shift, GaussianEvent(noise_multiplier)


def step(strategy, state, norms, b, release):
    state = strategy.begin_step(state, ctx(b))
    return strategy.update(state, torch.tensor(norms, dtype=torch.float64), ctx(b), release)


def test_update_is_kappa_times_the_public_mean_of_clipped_norms():
    s = MeanNormClip(initial_clip_norm=1.0, kappa=1.5, mean_noise_multiplier=4.0)
    rel = NoNoise()
    # realised 5, expected 4: sum of min(n, 1) = 0.2 + 0.5 + 1 + 1 + 1 (inf -> C_t) = 3.7
    state, events = step(s, s.init_state(), [0.2, 0.5, 3.0, 1.0, math.inf], 4.0, rel)
    assert rel.calls == [(pytest.approx(3.7, rel=1e-15), 1.0, 4.0)]  # sensitivity C_t
    assert events == (GaussianEvent(4.0),)
    assert state["clip_norm"] == pytest.approx(1.5 * 3.7 / 4.0, rel=1e-15)
    # the next step clips with the new C_t and releases with sensitivity C_t
    rel2 = NoNoise()
    state2, _ = step(s, state, [0.2, 3.0], 4.0, rel2)
    c1 = 1.5 * 3.7 / 4.0
    assert rel2.calls[0][:2] == (pytest.approx(0.2 + c1, rel=1e-15), c1)
    w = s.weights(torch.tensor([0.2, 3.0], dtype=torch.float64), state)
    assert torch.equal(w, torch.clamp(c1 / (torch.tensor([0.2, 3.0], dtype=torch.float64)
                                            + 1e-6), max=1.0))
    assert state2["clip_norm"] == pytest.approx(1.5 * (0.2 + c1) / 4.0, rel=1e-15)


def test_floor_when_the_noisy_mean_is_not_positive():
    s = MeanNormClip(min_clip_norm=0.01)
    state, _ = step(s, s.init_state(), [0.5, 0.5], 2.0, NoNoise(shift=-5.0))
    assert state["clip_norm"] == 0.01


def test_with_kappa_one_the_threshold_drifts_down_from_the_mean():
    # documented behaviour: E[min(n, C)] <= C, so kappa = 1 never grows the threshold
    s = MeanNormClip(initial_clip_norm=100.0, kappa=1.0)
    gen = torch.Generator().manual_seed(0)
    state, cs = s.init_state(), []
    for _ in range(30):
        norms = torch.exp(torch.randn(100, generator=gen, dtype=torch.float64)).tolist()
        state, _ = step(s, state, norms, 100.0, NoNoise())
        cs.append(state["clip_norm"])
    assert 1.2 < cs[0] < 2.2  # first step: the (unclipped) mean, E = e^0.5 = 1.65
    assert all(b <= a * 1.05 for a, b in zip(cs, cs[1:]))
    assert cs[-1] < 0.6 * cs[0]


def test_noise_split_and_events():
    s = MeanNormClip()  # sigma_m = expected batch size / 10
    st = s.begin_step(s.init_state(), ctx(50.0))
    assert st["mean_noise_multiplier"] == 5.0
    z_grad = (1.0 - 1 / 25) ** -0.5
    assert s.noise_multiplier(st, 1.0) == pytest.approx(z_grad, rel=1e-15)
    assert s.planned_event(1.0, ctx(50.0)) == ComposedEvent(
        (GaussianEvent(s.noise_multiplier(st, 1.0)), GaussianEvent(5.0)))
    with pytest.raises(ValueError, match="mean_noise_multiplier = 5"):
        s.noise_multiplier(st, 5.0)
    with pytest.raises(ValueError, match="mean_noise_multiplier"):
        s.planned_event(7.0, ctx(50.0))


def test_accounting_equals_fixed_clipping_at_the_users_sigma():
    logging.getLogger("absl").setLevel(logging.ERROR)
    z, q, steps = 0.9, 0.02, 500
    ev = MeanNormClip(mean_noise_multiplier=3.0).planned_event(z, ctx())
    adaptive = SelfComposedEvent(PoissonSampledEvent(q, ev), steps)
    fixed = SelfComposedEvent(PoissonSampledEvent(q, GaussianEvent(z)), steps)
    grad_only = SelfComposedEvent(PoissonSampledEvent(q, ev.events[0]), steps)
    e_fixed = epsilon(fixed, 1e-5, "rdp")
    assert epsilon(adaptive, 1e-5, "rdp") == pytest.approx(e_fixed, rel=1e-9)
    assert epsilon(grad_only, 1e-5, "rdp") < 0.99 * e_fixed


@pytest.mark.parametrize("bad,match", [({"kappa": 0}, "kappa"),
                                       ({"mean_noise_multiplier": -1}, "mean_noise_multiplier"),
                                       ({"initial_clip_norm": 0.0}, "initial_clip_norm")])
def test_bad_parameters_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        MeanNormClip(**bad)


def test_train_plan_matches_the_emitted_events():
    logging.getLogger("absl").setLevel(logging.ERROR)
    cfg = TrainConfig(dataset="synthetic", model="mlp", strategy="vdv",
                      strategy_params={"kappa": "2.0"}, noise_multiplier=1.0, delta=1e-5,
                      epochs=1, batch_size=64, lr=0.5, seed=0)
    res = train(cfg, progress=False)
    assert res.summary["steps"] == 8
    assert make_strategy("vdv", {"kappa": "2.0"}).kappa == 2.0
    (event, count), = res.ledger.entries
    assert event.event.events[1] == GaussianEvent(6.4) and count == 8


@pytest.mark.parametrize("cls, owner, key, default", [
    ("QuantileClip", "QuantileClip", "count_noise_std", "expected_batch_size / 20"),
    ("MeanNormClip", "MeanNormClip", "mean_noise_multiplier", "expected_batch_size / 10"),
])
def test_split_noise_mixin_messages(cls: str, owner: str, key: str, default: str) -> None:
    """quantile and vdv share SplitNoiseMixin (issue 34): each still names itself, its state key
    and its default, and refuses a clip range out of order."""
    from dpclip.clipping.quantile import QuantileClip
    from dpclip.clipping.vdv import MeanNormClip

    c = {"QuantileClip": QuantileClip, "MeanNormClip": MeanNormClip}[cls]
    with pytest.raises(ValueError, match=rf"^{owner}: need min_clip_norm <= initial_clip_norm"):
        c(initial_clip_norm=5.0, max_clip_norm=1.0)
    s = c()
    with pytest.raises(ValueError, match=rf"^{owner}: the state has no {key}; call begin_step"
                                         rf".*{default}"):
        s.noise_multiplier({"clip_norm": 1.0}, 0.5)
