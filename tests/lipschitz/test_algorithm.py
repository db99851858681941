"""Lip-DP-SGD / Fix-Lip-DP-SGD as training strategies: the privacy argument, checked.

* every per-example SCALED gradient (vmap, float64) has norm <= the certified sensitivity, on a
  real batch (breast-cancer) and on adversarial inputs (huge, NaN, and inputs optimised by gradient
  ascent on the scaled gradient norm), per layer and globally;
* neighbour datasets: the noiseless released sums of D and D - {i} differ by <= Delta, of D and
  D with one example replaced by <= 2 Delta;
* ClipWeights (rescale only above the bound) and the Fix- variant (always normalise);
* per-layer noise: per-layer stds and the composed event; global noise: one Gaussian;
* an end-to-end run meets its epsilon, keeps the weight bound, and refuses unsupported layers.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from dpclip.accounting import Ledger, epsilon as ledger_epsilon
from dpclip.clipping import STRATEGIES, StepContext, make_strategy
from dpclip.data import load_dataset
from dpclip.engine import ParamGroups, get_engine
from dpclip.events import ComposedEvent, GaussianEvent, PoissonSampledEvent
from dpclip.lipschitz import UnsupportedLayerError, tabular_mlp
from dpclip.lipschitz.strategy import FixLipDpSgd, LipDpSgd, clip_inputs
from dpclip.training.sampling import make_sampler
from dpclip.training.step import dp_step
from dpclip.training.trainer import TrainConfig, train

DT = torch.float64
TOL = 1 + 1e-9


def ctx(z: float = 1.0) -> StepContext:
    return StepContext(step=0, epoch=0, steps_per_epoch=10, total_steps=10,
                       expected_batch_size=8.0, base_noise_multiplier=z)


def conv_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(3, 4, 3),
        nn.Tanh(), nn.Flatten(), nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3),
    ).to(DT)


def mlp_model(width: int = 30, classes: int = 2) -> nn.Module:
    torch.manual_seed(2)
    return tabular_mlp((width,), classes, hidden=16).to(DT)


def scaled_per_example_norms(model, strategy, cert, x, y):
    """(global (B,), {layer: (B,)}) norms of the per-example scaled gradients, after input clipping."""
    loss = strategy.loss()
    params = {k: v.detach() for k, v in model.named_parameters()}
    xc = strategy.scale_inputs(x)

    def one(p, xi, yi):
        return loss(functional_call(model, p, (xi[None],)), yi[None]).sum()

    grads = vmap(grad(one), in_dims=(None, 0, 0))(params, xc, y)
    sq = {n: (g.flatten(1) * cert.scales[n]).pow(2).sum(dim=1) for n, g in grads.items()}
    per_layer = {
        layer.name: sum(sq[p] for p in layer.parameter_grad_bounds).sqrt()
        for layer in cert.bound.layers
    }
    return sum(sq.values()).sqrt(), per_layer


@pytest.mark.parametrize("cls", [LipDpSgd, FixLipDpSgd])
@pytest.mark.parametrize("scaling", ["r2", "none"])
def test_real_batch_scaled_gradients_within_sensitivity(cls, scaling):
    data = load_dataset("breast-cancer", seed=0)
    x, y = data.train.inputs[:128].to(DT), data.train.targets[:128]
    model = mlp_model()
    strategy = cls(input_norm=3.0, weight_bound=2.0, scaling=scaling)
    # a few heavy weights: the bound is exercised above and below the cap
    with torch.no_grad():
        model.fc1.weight.mul_(4.0)
    _, cert = strategy.certify(model, strategy.loss(), (30,), strategy.init_state())
    total, per_layer = scaled_per_example_norms(model, strategy, cert, x, y)
    assert (total <= cert.sensitivity * TOL).all()
    for name, norms in per_layer.items():
        assert (norms <= cert.layer_sensitivities[name] * TOL).all()
    assert total.max() > 0.05 * cert.sensitivity  # not vacuous


@pytest.mark.parametrize("make_model,shape", [(conv_model, (1, 6, 6)), (mlp_model, (30,))])
def test_adversarial_inputs_cannot_exceed_sensitivity(make_model, shape):
    model = make_model()
    classes = model[-1].out_features
    strategy = LipDpSgd(input_norm=2.0, temperature=0.5)
    _, cert = strategy.certify(model, strategy.loss(), shape, strategy.init_state())
    g = torch.Generator().manual_seed(0)
    n = 24
    y = torch.randint(0, classes, (n,), generator=g)
    x = torch.randn((n, *shape), generator=g, dtype=DT)
    x[0] *= 1e6                    # huge: clipped to X_0
    x[1] = float("nan")            # non-finite: becomes 0
    x[2] *= 1e-9                   # tiny
    total, _ = scaled_per_example_norms(model, strategy, cert, x, y)
    assert torch.isfinite(total).all() and (total <= cert.sensitivity * TOL).all()
    # projected gradient ascent on the scaled per-example gradient norm (double backward)
    z = torch.randn((n, *shape), generator=g, dtype=DT).requires_grad_(True)
    opt = torch.optim.Adam([z], lr=0.1)
    best = 0.0
    for _ in range(40):
        total, _ = scaled_per_example_norms(model, strategy, cert, z, y)
        assert (total.detach() <= cert.sensitivity * TOL).all()
        best = max(best, float(total.detach().max()))
        opt.zero_grad()
        (-total.sum()).backward()
        opt.step()
    assert best > 0.05 * cert.sensitivity  # the attack has power (R2 bounds are not tight)


def released_sum(model, strategy, state, x, y, sampler):
    """The noiseless (z = 0) released scaled sum, times the expected batch size."""
    out = dp_step(model, x, y, loss_fn=strategy.loss(), strategy=strategy, state=state,
                  engine=get_engine("summed"), groups=ParamGroups.flat(model), sampler=sampler,
                  base_noise_multiplier=0.0, ctx=ctx(0.0), generator=torch.Generator())
    flat = torch.cat([out.grads[n].flatten() for n, _ in model.named_parameters()])
    return flat * sampler.expected_batch_size, out


@pytest.mark.parametrize("noise", ["global", "per-layer"])
def test_neighbour_datasets(noise):
    model = conv_model()
    strategy = LipDpSgd(input_norm=5.0, noise=noise).bind(model, (1, 6, 6))
    sampler = make_sampler("poisson", 100, 8)
    state = strategy.init_state()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(11, 1, 6, 6, generator=g, dtype=DT) * 3
    x[3] *= 1e4
    x[5] = float("nan")
    y = torch.randint(0, 3, (11,), generator=g)
    full, out = released_sum(model, strategy, state, x, y, sampler)
    s = out.sensitivity  # global Delta (sampler factor 1)
    worst = 0.0
    for i in range(11):
        keep = [j for j in range(11) if j != i]
        removed, _ = released_sum(model, strategy, state, x[keep], y[keep], sampler)
        worst = max(worst, float((full - removed).norm()))
        x2, y2 = x.clone(), y.clone()
        x2[i], y2[i] = -x[(i + 1) % 11] * 7, (y[i] + 1) % 3
        replaced, _ = released_sum(model, strategy, state, x2, y2, sampler)
        assert float((full - replaced).norm()) <= 2 * s * TOL
    assert 0 < worst <= s * TOL


def test_certificate_is_computed_from_weights_not_batch():
    model = mlp_model()
    strategy = LipDpSgd(input_norm=2.0)
    sampler = make_sampler("poisson", 100, 8)
    g = torch.Generator().manual_seed(0)
    a = dp_step(model, torch.randn(5, 30, dtype=DT, generator=g), torch.zeros(5, dtype=torch.long),
                loss_fn=strategy.loss(), strategy=strategy, state=strategy.init_state(),
                engine=get_engine("summed"), groups=ParamGroups.flat(model), sampler=sampler,
                base_noise_multiplier=1.0, ctx=ctx(), generator=torch.Generator())
    b = dp_step(model, 1e3 * torch.randn(9, 30, dtype=DT, generator=g),
                torch.ones(9, dtype=torch.long), loss_fn=strategy.loss(), strategy=strategy,
                state=strategy.init_state(), engine=get_engine("summed"),
                groups=ParamGroups.flat(model), sampler=sampler, base_noise_multiplier=1.0,
                ctx=ctx(), generator=torch.Generator())
    assert a.sensitivity == b.sensitivity and a.state["sensitivity"] == b.state["sensitivity"]
    assert a.event == b.event == PoissonSampledEvent(0.08, GaussianEvent(1.0))


def test_per_example_engine_gives_the_same_sum():
    model = conv_model()
    strategy = LipDpSgd(input_norm=2.0)
    sampler = make_sampler("poisson", 100, 8)
    x = torch.randn(7, 1, 6, 6, dtype=DT, generator=torch.Generator().manual_seed(1)) * 4
    y = torch.arange(7) % 3
    res = {}
    for name in ("summed", "vmap"):
        out = dp_step(model, x, y, loss_fn=strategy.loss(), strategy=strategy,
                      state=strategy.init_state(), engine=get_engine(name),
                      groups=ParamGroups.flat(model), sampler=sampler, base_noise_multiplier=0.0,
                      ctx=ctx(0.0), generator=torch.Generator())
        res[name] = out
    for n in res["summed"].grads:
        torch.testing.assert_close(res["summed"].grads[n], res["vmap"].grads[n])
    assert res["vmap"].norms.shape == (7,)


def test_per_layer_noise_stds_and_event():
    model = mlp_model()
    strategy = LipDpSgd(input_norm=2.0, noise="per-layer").bind(model, (30,))
    assert strategy.num_layers == 2
    sampler = make_sampler("poisson", 1000, 10)
    x = torch.zeros(0, 30, dtype=DT)  # empty batch: the released value is pure noise
    y = torch.zeros(0, dtype=torch.long)
    out = dp_step(model, x, y, loss_fn=strategy.loss(), strategy=strategy,
                  state=strategy.init_state(), engine=get_engine("summed"),
                  groups=ParamGroups.flat(model), sampler=sampler, base_noise_multiplier=3.0,
                  ctx=ctx(3.0), generator=torch.Generator().manual_seed(0))
    _, cert = strategy.certify(model, strategy.loss(), (30,), strategy.init_state())
    for layer, names in (("fc1", ("fc1.weight", "fc1.bias")), ("fc2", ("fc2.weight", "fc2.bias"))):
        noise = torch.cat([out.grads[n].flatten() for n in names]) * 10
        expected = 3.0 * cert.layer_sensitivities[layer]
        assert abs(float(noise.std()) / expected - 1) < (0.35 if layer == "fc2" else 0.15)
    planned = strategy.planned_event(3.0, ctx(3.0))
    assert planned == ComposedEvent((GaussianEvent(3.0), GaussianEvent(3.0)))
    assert out.event == sampler.step_event(planned)
    # L Gaussians with multiplier z  ==  one Gaussian with z / sqrt(L)
    a, b = Ledger(), Ledger()
    a.record(sampler.step_event(planned))
    b.record(sampler.step_event(GaussianEvent(3.0 / math.sqrt(2))))
    assert ledger_epsilon(a, 1e-5) == pytest.approx(ledger_epsilon(b, 1e-5), rel=1e-3)
    with pytest.raises(ValueError, match="bind"):
        LipDpSgd(noise="per-layer").planned_event(1.0, ctx())


def test_global_noise_std():
    model = mlp_model()
    strategy = LipDpSgd(input_norm=2.0)
    sampler = make_sampler("poisson", 1000, 10)
    out = dp_step(model, torch.zeros(0, 30, dtype=DT), torch.zeros(0, dtype=torch.long),
                  loss_fn=strategy.loss(), strategy=strategy, state=strategy.init_state(),
                  engine=get_engine("summed"), groups=ParamGroups.flat(model), sampler=sampler,
                  base_noise_multiplier=2.0, ctx=ctx(2.0),
                  generator=torch.Generator().manual_seed(0))
    noise = torch.cat([g.flatten() for g in out.grads.values()]) * 10
    assert float(noise.std()) == pytest.approx(2.0 * out.sensitivity, rel=0.1)
    # replace-one (fixed-size sampling) doubles the sensitivity
    fixed = make_sampler("fixed-size", 1000, 10)
    out2 = dp_step(model, torch.zeros(0, 30, dtype=DT), torch.zeros(0, dtype=torch.long),
                   loss_fn=strategy.loss(), strategy=strategy, state=strategy.init_state(),
                   engine=get_engine("summed"), groups=ParamGroups.flat(model), sampler=fixed,
                   base_noise_multiplier=2.0, ctx=ctx(2.0), generator=torch.Generator())
    assert out2.sensitivity == pytest.approx(2 * out.sensitivity)


def _op_norm(w):
    return float(torch.linalg.matrix_norm(w.detach().double(), ord=2))


def test_clip_weights_semantics():
    model = mlp_model()
    with torch.no_grad():
        model.fc1.weight.mul_(10.0 / _op_norm(model.fc1.weight))  # above the bound
        model.fc2.weight.mul_(0.5 / _op_norm(model.fc2.weight))   # below it
    before2 = model.fc2.weight.clone()
    bias = model.fc1.bias.clone()
    lip = LipDpSgd(weight_bound=2.0)
    factors = lip.post_step(model, lip.init_state(), input_shape=(30,))
    assert set(factors) == {"fc1"}
    assert _op_norm(model.fc1.weight) == pytest.approx(2.0, rel=1e-6)
    assert torch.equal(model.fc2.weight, before2) and torch.equal(model.fc1.bias, bias)
    fix = FixLipDpSgd(weight_bound=2.0)
    fix.post_step(model, fix.init_state(), input_shape=(30,))
    assert _op_norm(model.fc1.weight) == pytest.approx(2.0, rel=1e-5)
    assert _op_norm(model.fc2.weight) == pytest.approx(2.0, rel=1e-6)
    # conv layers: the proven operator-norm bound is brought to the cap
    conv = conv_model()
    fix.post_step(conv, fix.init_state(), input_shape=(1, 6, 6))
    _, cert = fix.certify(conv, fix.loss(), (1, 6, 6), fix.init_state())
    for layer in cert.bound.layers:
        assert layer.operator_norm == pytest.approx(2.0, rel=1e-4)


def test_input_clipping():
    x = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0], [math.nan, 1.0], [math.inf, 0.0]])
    out = clip_inputs(x, 1.0)
    torch.testing.assert_close(out[0], torch.tensor([0.6, 0.8]))
    assert torch.equal(out[1], x[1]) and torch.equal(out[2], x[2])
    assert torch.equal(out[3:], torch.zeros(2, 2))


def test_plain_cross_entropy_function_is_refused():
    strategy = LipDpSgd()

    def ce(out, y):
        return nn.functional.cross_entropy(out, y, reduction="none")

    with pytest.raises(ValueError, match="LipschitzLoss"):
        strategy.certify(mlp_model(), ce, (30,), strategy.init_state())


def test_registry_and_parameters():
    assert STRATEGIES["lip-dp-sgd"].kind == STRATEGIES["fix-lip-dp-sgd"].kind == "bound"
    s = make_strategy("fix-lip-dp-sgd", {"input_norm": "2.5", "noise": "per-layer"})
    assert isinstance(s, FixLipDpSgd) and s.input_norm == 2.5
    with pytest.raises(ValueError, match="scaling"):
        make_strategy("lip-dp-sgd", {"scaling": "r3"})
    with pytest.raises(ValueError, match="input_norm"):
        make_strategy("lip-dp-sgd", {"input_norm": "0"})
    assert math.isnan(LipDpSgd().sensitivity(LipDpSgd().init_state()))


@pytest.mark.parametrize("name,noise", [("lip-dp-sgd", "global"), ("fix-lip-dp-sgd", "per-layer")])
def test_end_to_end_training_meets_epsilon(name, noise):
    config = TrainConfig(
        dataset="breast-cancer", model="tabular-mlp", strategy=name,
        strategy_params={"input_norm": 2.0, "weight_bound": 1.5, "noise": noise},
        epsilon=1.0, epochs=2, batch_size=64, lr=0.01, optimizer="adam", engine="auto", seed=3,
    )
    result = train(config, progress=False)
    s = result.summary
    assert s["epsilon"] <= 1.0 + 1e-6 and s["steps"] == s["planned_steps"]
    assert s["engine"] == "summed"
    assert 0.0 <= s["test_accuracy"] <= 1.0
    model = result.model
    for layer in (model.fc1, model.fc2):
        norm = _op_norm(layer.weight)
        assert norm <= 1.5 * (1 + 1e-5)
        if name == "fix-lip-dp-sgd":
            assert norm == pytest.approx(1.5, rel=1e-5)
    assert all(math.isfinite(r["clip_threshold"]) for r in result.history)


def test_unsupported_layer_is_a_clear_error():
    # the registry's mlp (tanh) is supported; a BatchNorm model is refused, naming the layer
    config = TrainConfig(dataset="breast-cancer", model="mlp", strategy="lip-dp-sgd",
                         noise_multiplier=1.0, epochs=1, batch_size=64, engine="auto")
    data = load_dataset("breast-cancer", seed=0)
    model = nn.Sequential(nn.Linear(30, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    with pytest.raises(UnsupportedLayerError, match="BatchNorm1d"):
        LipDpSgd().bind(model, data.input_shape)
    assert train(config, progress=False).summary["engine"] == "summed"
