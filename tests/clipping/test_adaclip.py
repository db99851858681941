"""adaclip (Pichapati et al. 2019): whitening, unit clip, noise placement, moments, checkpoints."""

import logging
import math

import pytest
import torch
from torch import nn

from dpclip.clipping import FixedClip, StepContext
from dpclip.clipping.capabilities import capabilities_of
from dpclip.clipping.adaclip import AdaClip
from dpclip.engine import ParamGroups, get_engine, naive_per_example_grads
from dpclip.events import GaussianEvent
from dpclip.noise import make_generator
from dpclip.training.sampling import FixedSizeSampler, PoissonSampler
from dpclip.training.step import GradientTransform, dp_step, transformed_sum
from dpclip.training.trainer import TrainConfig, train


def ce(out, y):
    return nn.functional.cross_entropy(out, y, reduction="none")


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def run_step(strategy, state, model, x, y, *, z=0.0, engine="vmap", sampler=None, seed=0):
    sampler = sampler or PoissonSampler(100, 10.0)
    return dp_step(model, x, y, loss_fn=ce, strategy=strategy, state=state,
                   engine=get_engine(engine), groups=ParamGroups.flat(model), sampler=sampler,
                   base_noise_multiplier=z, generator=make_generator(seed),
                   ctx=StepContext.at(0, steps_per_epoch=10, total_steps=10,
                                      expected_batch_size=sampler.expected_batch_size,
                                      base_noise_multiplier=z))


def test_is_a_gradient_transform_with_unit_whitened_clip():
    s = AdaClip()
    assert isinstance(s, GradientTransform) and capabilities_of(s).per_example_grads
    n = torch.tensor([0.0, 0.5, 1.0, 4.0, math.inf, math.nan], dtype=torch.float64)
    expected = torch.tensor([1.0, 1.0, 1 / (1 + 1e-6), 1 / (4 + 1e-6), 0.0, 0.0],
                            dtype=torch.float64)
    assert torch.equal(s.weights(n, s.init_state()), expected) and s.sensitivity({}) == 1.0


@pytest.mark.parametrize("engine", ["vmap", "naive", "auto"])
def test_first_step_equals_abadi_clipping_at_initial_clip_norm(engine):
    model = small_model()
    gen = torch.Generator().manual_seed(1)
    x, y = 3 * torch.randn(9, 6, generator=gen, dtype=torch.float64), torch.arange(9) % 3
    c = 2.0
    ada = run_step(AdaClip(initial_clip_norm=c), AdaClip().init_state(), model, x, y,
                   engine=engine)
    fixed = run_step(FixedClip(c), {}, model, x, y, engine=engine)
    # oracle: naive loop, clip at C (the 1e-6 guard acts on the whitened norm ||g|| / C)
    per_ex = naive_per_example_grads(model, ce, x, y)
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in per_ex.values()))
    w = torch.clamp(c / (norms + c * 1e-6), max=1.0)
    assert (norms > c).sum() >= 3 and (norms < c).sum() >= 1  # both regimes exercised
    for name, g in per_ex.items():
        oracle = (w.view(-1, *[1] * (g.ndim - 1)) * g).sum(0) / 10.0
        assert torch.allclose(ada.grads[name], oracle, rtol=1e-12, atol=1e-15), name
        diff = (ada.grads[name] - fixed.grads[name]).norm()
        assert diff <= 1e-6 * fixed.grads[name].norm(), name  # only the guard's place differs
    assert ada.event == fixed.event and ada.sensitivity == 1.0


def random_state(model, seed):
    gen = torch.Generator().manual_seed(seed)
    m, s = {}, {}
    for n, p in model.named_parameters():
        m[n] = (0.05 * torch.randn(p.numel(), generator=gen, dtype=torch.float64)).tolist()
        s[n] = (10 ** (-4 + 2 * torch.rand(p.numel(), generator=gen,
                                           dtype=torch.float64))).tolist()
    return {"m": m, "s": s}


@pytest.mark.parametrize("engine", ["vmap", "naive", "auto"])
def test_whitened_sum_has_sensitivity_one(engine):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.Tanh(), nn.Flatten(),
                          nn.Linear(3 * 4 * 4, 5), nn.ReLU(), nn.Linear(5, 4)).double()
    s = AdaClip(noise_mode="per_sample")
    state = random_state(model, 0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, 1, 6, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (11,), generator=g)
    x[3] *= 1e4
    x[5] = float("nan")
    x[7] *= 1e-8

    def whitened_sum(xs, ys):
        res = transformed_sum(get_engine(engine), s, state, model, ce, xs, ys,
                              ParamGroups.flat(model))
        out = torch.cat([res.grads[n].flatten() for n, _ in model.named_parameters()])
        assert torch.isfinite(out).all()
        return out, res.norms

    full, norms = whitened_sum(x, y)
    assert math.isinf(norms[5]) and (norms[torch.isfinite(norms)] > 1).sum() >= 2
    worst = 0.0
    for i in range(11):
        keep = [j for j in range(11) if j != i]
        worst = max(worst, (full - whitened_sum(x[keep], y[keep])[0]).norm().item())
        x2 = x.clone()
        x2[i] = -x[(i + 1) % 11] * 3
        assert (full - whitened_sum(x2, y)[0]).norm().item() <= 2 * (1 + 1e-9)
    assert 0.5 < worst <= 1 + 1e-9


SEEN_NOISE_STD = []


class SpyAdaClip(AdaClip):
    """Records the per-coordinate noise std that dp_step hands to ``untransform``."""

    def untransform(self, mean, state, noise_std):
        SEEN_NOISE_STD.append(noise_std)
        return super().untransform(mean, state, noise_std)


@pytest.mark.parametrize("sampler,factor", [(PoissonSampler(10_000, 16.0), 1),
                                            (FixedSizeSampler(10_000, 16), 2)])
def test_noise_placement_batch_vs_per_sample(sampler, factor):
    # empty batch: the output is pure noise, b * N(0, (z k r)^2) / B + m with m = 0, b = C
    model = nn.Linear(200, 50)
    x, y = torch.zeros(0, 200), torch.zeros(0, dtype=torch.long)
    stds = {}
    for mode, r in (("batch", 1.0), ("per_sample", 4.0)):
        s = SpyAdaClip(initial_clip_norm=0.5, noise_mode=mode)
        SEEN_NOISE_STD.clear()
        out = run_step(s, s.init_state(), model, x, y, z=1.3, sampler=sampler)
        # the variance correction gets the noise std of the whitened MEAN: z k r / B
        assert SEEN_NOISE_STD == [pytest.approx(1.3 * factor * r / 16.0, rel=1e-12)]
        noise = torch.cat([g.flatten() for g in out.grads.values()])
        stds[mode] = noise.std().item()
        assert out.event == sampler.step_event(GaussianEvent(1.3))  # accounted at sigma
        assert abs(noise.mean().item()) < 5 * stds[mode] / math.sqrt(noise.numel())
    expected = 0.5 * 1.3 * factor / 16.0
    assert stds["batch"] == pytest.approx(expected, rel=0.03)
    # per-sample noise: sqrt(EXPECTED batch size) = 4 times more (the realised size here is 0)
    assert stds["per_sample"] == pytest.approx(4 * expected, rel=0.03)


def test_moment_update_by_hand():
    s = AdaClip(beta1=0.5, beta2=0.75, h1=0.2, h2=0.05)  # Lin's order h1 > h2: clamp [.05, .2]
    state = {"m": {"w": [0.1, -0.2], "b": [0.0]}, "s": {"w": [0.04, 0.01], "b": [0.09]}}
    mean = {"w": torch.tensor([1.0, -2.0], dtype=torch.float64),
            "b": torch.tensor([0.5], dtype=torch.float64)}
    grads, new = s.untransform(mean, state, noise_std=0.1)
    # b_j = s_j^(1/4) (sum_k sqrt(s_k))^(1/2), sum_k sqrt(s_k) = 0.2 + 0.1 + 0.3 = 0.6
    b = [0.04**0.25 * 0.6**0.5, 0.01**0.25 * 0.6**0.5, 0.09**0.25 * 0.6**0.5]
    g = [b[0] * 1.0 + 0.1, b[1] * -2.0 - 0.2, b[2] * 0.5]
    assert grads["w"].tolist() == pytest.approx(g[:2], rel=1e-14)
    assert grads["b"].tolist() == pytest.approx(g[2:], rel=1e-14)
    # v = (g~ - m)^2 - (b * noise_std)^2 = b^2 (u^2 - 0.01) = [0.1188, 0.2394, 0.0432]
    v = [0.12 * 0.99, min(0.06 * 3.99, 0.2), max(0.18 * 0.24, 0.05)]
    assert new["m"]["w"] == pytest.approx([0.5 * 0.1 + 0.5 * g[0], 0.5 * -0.2 + 0.5 * g[1]],
                                          rel=1e-14)
    assert new["m"]["b"] == pytest.approx([0.5 * g[2]], rel=1e-14)
    assert new["s"]["w"] == pytest.approx([0.75 * 0.04 + 0.25 * v[0], 0.75 * 0.01 + 0.25 * v[1]],
                                          rel=1e-12)
    assert new["s"]["b"] == pytest.approx([0.75 * 0.09 + 0.25 * v[2]], rel=1e-12)
    assert state["m"]["w"] == [0.1, -0.2]  # pure: the input state is untouched


def test_transform_whitens_with_the_state():
    s = AdaClip()
    state = {"m": {"w": [1.0, 2.0]}, "s": {"w": [0.16, 0.01]}}  # sqrt sum 0.5
    g = torch.tensor([[3.0, 2.5]], dtype=torch.float64)
    u = s.transform({"w": g}, state)["w"]
    b = torch.tensor([0.16**0.25, 0.01**0.25], dtype=torch.float64) * 0.5**0.5
    assert torch.allclose(u, (g - torch.tensor([1.0, 2.0], dtype=torch.float64)) / b, rtol=1e-14)
    with pytest.raises(ValueError, match="do not match"):
        s.transform({"v": g}, state)


@pytest.mark.parametrize("engine", ["summed", "ghost"])
def test_engines_without_per_example_gradients_are_refused(engine):
    model = small_model()
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.arange(4) % 3
    with pytest.raises(ValueError, match=f"per-example gradients.*'{engine}'.*vmap"):
        run_step(AdaClip(), AdaClip().init_state(), model, x, y, engine=engine)


@pytest.mark.parametrize("bad,match", [({"noise_mode": "sample"}, "noise_mode"),
                                       ({"beta1": 1.0}, "beta1"), ({"h2": 0}, "h2"),
                                       ({"initial_clip_norm": -1}, "initial_clip_norm")])
def test_bad_parameters_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        AdaClip(**bad)


def test_train_meets_epsilon_and_resumes_from_a_checkpoint(tmp_path):
    logging.getLogger("absl").setLevel(logging.ERROR)
    cfg = TrainConfig(dataset="synthetic", model="mlp", strategy="adaclip",
                      strategy_params={"initial_clip_norm": 0.5}, epsilon=3.0, delta=1e-5,
                      epochs=1, batch_size=64, lr=0.5, optimizer="momentum", seed=0,
                      reproducible_noise=True)  # the full run replays the same noise
    full = train(cfg, progress=False)
    assert full.summary["epsilon"] <= 3.0 and full.summary["steps"] == 8
    assert full.summary["test_accuracy"] > 0.5  # 4 classes
    part = train(cfg, checkpoint_dir=tmp_path, progress=False, stop_after_steps=3)
    assert part.summary.get("interrupted")
    ck = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    sizes = {n: p.numel() for n, p in full.model.named_parameters()}
    assert {n: len(v) for n, v in ck["private"]["strategy_state"]["s"].items()} == sizes
    resumed = train(cfg, checkpoint_dir=tmp_path, progress=False)
    assert resumed.ledger == full.ledger
    assert resumed.summary["epsilon"] == full.summary["epsilon"]
    for (n, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), n
