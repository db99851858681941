"""Tied parameters (one ``nn.Parameter`` held by several modules) in the Lipschitz certificate.

The gradient of a tied parameter is the plain SUM of its per-use contributions, so its certified
bound must be the sum of the per-use bounds (triangle inequality), not their root sum of squares.
Oracles: float64 ``vmap(grad)`` per-example gradients (``functional_call`` ties the weights), on a
hand-built worst case, random inputs and inputs optimised by gradient ascent on the gradient norm.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from dpclip.engine import ParamGroups, get_engine
from dpclip.lipschitz import TemperedCrossEntropy, lipschitz_bounds
from dpclip.lipschitz.strategy import FixLipDpSgd, LipDpSgd
from tests.lipschitz.helpers import project_ball

DT = torch.float64
TOL = 1 + 1e-9


def tied_pair(c: float = 3.0) -> nn.Module:
    """``y = W (W x)`` with one ``W = c I`` held by two Linear modules (no bias)."""
    a, b = nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        a.weight.copy_(c * torch.eye(2))
    b.weight = a.weight
    return nn.Sequential(a, b).to(DT)


def tied_mlp() -> nn.Module:
    """Linear -> ReLU -> Linear (weight tied to the first) -> Linear, with biases."""
    torch.manual_seed(4)
    m = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    with torch.no_grad():
        m[0].weight.mul_(3.0)
    m[2].weight = m[0].weight
    return m.to(DT)


def per_example_grads(model: nn.Module, loss, x, y) -> dict[str, torch.Tensor]:
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, xi, yi):
        return loss(functional_call(model, p, (xi[None],)), yi[None]).sum()

    return vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)


def scaled_norms(model, loss, x, y, scales) -> torch.Tensor:
    g = per_example_grads(model, loss, x, y)
    return sum((t.flatten(1) * scales[n]).pow(2).sum(dim=1) for n, t in g.items()).sqrt()


def adversarial_max(model, loss, shape, radius, classes, scales, steps=60) -> float:
    """Projected gradient ascent on the per-example scaled gradient norm (lower bound of sup)."""
    gen = torch.Generator().manual_seed(0)
    n = 16
    y = torch.randint(0, classes, (n,), generator=gen)
    x = torch.randn((n, *shape), generator=gen, dtype=DT).requires_grad_(True)
    opt = torch.optim.Adam([x], lr=0.1 * radius)
    best = 0.0
    for _ in range(steps):
        with torch.no_grad():
            x.copy_(project_ball(x, radius))
        norms = scaled_norms(model, loss, x, y, scales)
        best = max(best, float(norms.detach().max()))
        opt.zero_grad()
        (-norms.sum()).backward()
        opt.step()
    return best


def test_tied_weight_bound_is_the_sum_of_per_use_bounds_and_covers_the_worst_case() -> None:
    model, loss = tied_pair(3.0), TemperedCrossEntropy(1.0)
    bound = lipschitz_bounds(model, loss, input_shape=(2,), input_norm_bound=1.0)
    # worst case by hand: x = (1, -1)/sqrt2, label 1 (the wrong class): logits 9x,
    # grad = 2c g x^T with ||g|| -> sqrt 2, i.e. 6 sqrt 2 = 8.49; the per-use bounds are 3 sqrt 2
    # each, so a root sum of squares would certify only 6
    x = torch.tensor([[1.0, -1.0]], dtype=DT) / math.sqrt(2.0)
    y = torch.tensor([1])
    actual = float(per_example_grads(model, loss, x, y)["0.weight"].flatten(1).norm(dim=1)[0])
    assert actual <= bound.grad_bound * TOL
    assert actual >= 0.99 * bound.grad_bound  # and the sum is tight here
    assert [n for n, _ in model.named_parameters()] == ["0.weight"]
    per_use = [layer.parameter_grad_bounds["0.weight"] for layer in bound.layers]
    assert len(per_use) == 2 and per_use[0] == pytest.approx(per_use[1])  # 3 sqrt 2 each
    assert bound.parameter_grad_bounds["0.weight"] == pytest.approx(sum(per_use))
    assert bound.grad_bound == pytest.approx(sum(per_use))
    assert actual > 1.4 * math.sqrt(sum(b * b for b in per_use))


def test_tied_mlp_bound_covers_random_and_adversarial_inputs() -> None:
    model, loss = tied_mlp(), TemperedCrossEntropy(0.5)
    bound = lipschitz_bounds(model, loss, input_shape=(3,), input_norm_bound=2.0)
    uses = bound.parameter_uses
    assert [layer.name for layer in uses["0.weight"]] == ["0", "2"]
    assert set(bound.parameter_grad_bounds) == {n for n, _ in model.named_parameters()}
    ones = {n: 1.0 for n, _ in model.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    x = project_ball(torch.randn(64, 3, generator=gen, dtype=DT) * 3, 2.0)
    y = torch.randint(0, 2, (64,), generator=gen)
    g = per_example_grads(model, loss, x, y)
    for name, b in bound.parameter_grad_bounds.items():
        assert float(g[name].flatten(1).norm(dim=1).max()) <= b * TOL, name
    assert float(scaled_norms(model, loss, x, y, ones).max()) <= bound.grad_bound * TOL
    worst = adversarial_max(model, loss, (3,), 2.0, 2, ones)
    assert worst <= bound.grad_bound * TOL
    assert worst > 0.2 * bound.grad_bound  # not vacuous


@pytest.mark.parametrize("scaling", ["r2", "r1", "none"])
def test_strategy_noise_covers_the_hand_worst_case(scaling: str) -> None:
    model = tied_pair(3.0)
    s = LipDpSgd(input_norm=1.0, scaling=scaling).bind(model, (2,))
    _, cert = s.certify(model, s.loss(), (2,), s.init_state())
    x = torch.tensor([[1.0, -1.0]], dtype=DT) / math.sqrt(2.0)
    y = torch.tensor([1])
    with s.gradient_context(model):
        g = get_engine("summed").compute(model, s.loss(), x, y, None, ParamGroups.flat(model))
    actual = float(g.grads["0.weight"].norm()) * cert.scales["0.weight"]
    assert actual <= cert.param_sensitivity["0.weight"] * TOL
    assert actual >= 0.5 * cert.param_sensitivity["0.weight"]


@pytest.mark.parametrize("scaling", ["r2", "none"])
@pytest.mark.parametrize("noise", ["global", "per-layer"])
def test_strategy_certificate_covers_scaled_tied_gradients(scaling: str, noise: str) -> None:
    model = tied_mlp()
    s = LipDpSgd(input_norm=2.0, temperature=0.5, scaling=scaling, noise=noise).bind(model, (3,))
    _, cert = s.certify(model, s.loss(), (3,), s.init_state())
    worst = adversarial_max(model, s.loss(), (3,), 2.0, 2, cert.scales)
    assert worst <= cert.sensitivity * TOL
    assert worst > 0.2 * cert.sensitivity  # not vacuous
    # the two layers sharing the weight form one noise block; the last layer is its own
    assert list(cert.layer_sensitivities) == ["0+2", "4"]
    assert s.num_layers == 2
    assert set(cert.scales) == {n for n, _ in model.named_parameters()}
    gen = torch.Generator().manual_seed(2)
    x = s.scale_inputs(torch.randn(64, 3, generator=gen, dtype=DT) * 3)
    y = torch.randint(0, 2, (64,), generator=gen)
    g = per_example_grads(model, s.loss(), x, y)
    for name, t in g.items():  # each parameter's noise covers its (block's) scaled gradient
        assert float((t.flatten(1) * cert.scales[name]).norm(dim=1).max()) \
            <= cert.param_sensitivity[name] * TOL, name
    block = {"0.weight", "0.bias", "2.bias"}
    block_norm = sum((g[n].flatten(1) * cert.scales[n]).pow(2).sum(dim=1) for n in block).sqrt()
    assert float(block_norm.max()) <= cert.layer_sensitivities["0+2"] * TOL


def test_r1_certificate_covers_tied_weight() -> None:
    model = tied_mlp()
    s = LipDpSgd(input_norm=2.0, temperature=0.5, scaling="r1").bind(model, (3,))
    _, cert = s.certify(model, s.loss(), (3,), s.init_state())
    assert cert.scales["0.weight"] == 1.0
    eng = get_engine("summed")
    gen = torch.Generator().manual_seed(5)
    x = s.scale_inputs(torch.randn(30, 3, generator=gen, dtype=DT) * 3)
    x[1] *= 1e-6  # tiny input: its normalised weight gradient is as large as any
    y = torch.randint(0, 2, (30,), generator=gen)
    worst = 0.0
    for i in range(30):
        with s.gradient_context(model):
            gi = eng.compute(model, s.loss(), x[i:i + 1], y[i:i + 1], None,
                             ParamGroups.flat(model)).grads
        total = math.sqrt(sum(float((t * cert.scales[n]).pow(2).sum()) for n, t in gi.items()))
        assert total <= cert.sensitivity * TOL
        worst = max(worst, total)
    assert worst > 0.1 * cert.sensitivity


@pytest.mark.parametrize("cls", [LipDpSgd, FixLipDpSgd])
def test_weight_clipping_rescales_a_tied_weight_once(cls) -> None:
    model = tied_pair(3.0)
    s = cls(input_norm=1.0, weight_bound=1.0)
    factors = s.post_step(model, s.init_state(), input_shape=(2,))
    assert factors == pytest.approx({"0": 1 / 3, "1": 1 / 3})
    assert float(torch.linalg.matrix_norm(model[0].weight.detach(), ord=2)) == pytest.approx(1.0, rel=1e-4)
