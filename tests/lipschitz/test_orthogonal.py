"""Orthogonal layers (OrthLinear, OrthConv2d), the MaxMin GroupSort and the lip-orth-cnn model:
the projection really orthonormalises, the certificate of the projected weights is a proven upper
bound (brute-force Jacobian / explicit matrix norms, per-example gradients on random and
adversarial inputs), and the gradient-norm preservation claimed in docs/lipschitz.md holds."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.func import grad, vmap

from dpclip.lipschitz import (
    GroupSort,
    OrthConv2d,
    OrthLinear,
    TemperedCrossEntropy,
    check_upper_bound,
    lip_orth_convnet,
    lipschitz_bounds,
    orthogonalize,
)
from dpclip.lipschitz.strategy import FixLipDpSgd, LipDpSgd
from dpclip.models import build_model
from tests.lipschitz.helpers import DT, explicit_matrix, jacobian_norm, random_ball
from tests.lipschitz.test_network import _adversarial, _check


@pytest.mark.parametrize("shape", [(7, 7), (5, 12), (12, 5), (1, 9)])
@pytest.mark.parametrize("method", ["polar", "bjorck"])
def test_orthogonalize_gives_orthonormal_rows_or_columns(shape, method) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=gen, dtype=DT) + 0.3
    q = orthogonalize(w, method, iterations=40)
    r, c = shape
    gram = q @ q.T if r <= c else q.T @ q
    assert torch.allclose(gram, torch.eye(min(r, c), dtype=DT), atol=1e-9)
    u, _, vh = torch.linalg.svd(w, full_matrices=False)
    assert torch.allclose(q, u @ vh, atol=1e-8)  # both methods: the polar factor
    assert torch.allclose(orthogonalize(q, method), q, atol=1e-9)  # a projection: idempotent


def test_orthogonalize_errors_and_zero() -> None:
    z = torch.zeros(3, 4)
    assert torch.equal(orthogonalize(z), z)
    with pytest.raises(ValueError, match="2-D"):
        orthogonalize(torch.ones(2, 2, 2))
    with pytest.raises(ValueError, match="method"):
        orthogonalize(torch.ones(2, 2), "qr")
    with pytest.raises(ValueError, match="iterations"):
        orthogonalize(torch.ones(2, 2), "bjorck", 0)
    with pytest.raises(ValueError, match="non-finite"):
        orthogonalize(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="OrthLinear: method"):
        OrthLinear(3, 3, method="cayley")
    with pytest.raises(ValueError, match="OrthConv2d: iterations"):
        OrthConv2d(1, 2, 3, iterations=0)


def test_forward_is_the_base_forward() -> None:
    """The analysis reuses the Linear / Conv2d rules for these exact types: sound only because
    the forward is not overridden."""
    assert OrthLinear.forward is nn.Linear.forward
    assert OrthConv2d.forward is nn.Conv2d.forward
    assert OrthConv2d._conv_forward is nn.Conv2d._conv_forward


def test_orth_linear_certificate_and_isometry() -> None:
    torch.manual_seed(0)
    for fin, fout in ((6, 6), (4, 9), (9, 4)):
        layer = OrthLinear(fin, fout, bias=False).to(DT)
        layer.project_()  # again in float64
        sv = torch.linalg.svdvals(layer.weight.detach())
        assert torch.allclose(sv, torch.ones_like(sv), atol=1e-12)
        b = lipschitz_bounds(nn.Sequential(layer), TemperedCrossEntropy(),
                             input_shape=(fin,), input_norm_bound=1.0)
        x = torch.randn(fin, dtype=DT)
        assert b.layers[0].operator_norm >= jacobian_norm(layer, x)
        assert b.layers[0].operator_norm == pytest.approx(1.0, rel=1e-5)
        if fout >= fin:  # tall / square: an isometry
            assert float(layer(x).detach().norm()) == pytest.approx(float(x.norm()), rel=1e-12)


def test_orth_conv_projection_certificate_and_interior_isometry() -> None:
    """The reshaped kernel is orthonormal; with c_out >= c_in k^2 (1 -> 16 channels, 3x3) the
    convolution is exactly 3 x an isometry on images supported away from the border (every pixel
    is read by 9 patches). After the strategy's post_step the PROVEN bound is <= 1 and upper-bounds
    the exact operator norm of the explicit convolution matrix."""
    torch.manual_seed(0)
    conv = OrthConv2d(1, 16, 3, padding=1, bias=False).to(DT)
    conv.project_()  # again in float64
    mat = conv.weight.detach().reshape(16, -1)
    assert torch.allclose(mat.T @ mat, torch.eye(9, dtype=DT), atol=1e-10)
    x = torch.zeros(1, 1, 8, 8, dtype=DT)
    x[..., 1:-1, 1:-1] = torch.randn(1, 1, 6, 6, dtype=DT)
    assert float(conv(x).detach().norm()) == pytest.approx(3.0 * float(x.norm()), rel=1e-10)
    for c_in, c_out, groups in ((1, 16, 1), (4, 6, 1), (4, 8, 2)):
        net = nn.Sequential(OrthConv2d(c_in, c_out, 3, padding=1, groups=groups, bias=False),
                            nn.Flatten(), OrthLinear(c_out * 36, 3, bias=False)).to(DT)
        with torch.no_grad():
            net[0].weight.add_(0.5 * torch.randn_like(net[0].weight))
        strategy = LipDpSgd(input_norm=1.0, weight_bound=1.0)
        strategy.post_step(net, strategy.init_state(), input_shape=(c_in, 6, 6))
        per_group = net[0].weight.detach().reshape(groups, c_out // groups, -1)
        for block in per_group:  # orthonormal up to the common scale of the weight clipping
            q = block / torch.linalg.svdvals(block)[0]
            small = min(q.shape)
            gram = q @ q.T if q.shape[0] <= q.shape[1] else q.T @ q
            assert torch.allclose(gram, torch.eye(small, dtype=DT), atol=1e-9)
        b = lipschitz_bounds(net, TemperedCrossEntropy(), input_shape=(c_in, 6, 6),
                             input_norm_bound=1.0)
        rho = b.layer("0").operator_norm
        exact = float(torch.linalg.svdvals(explicit_matrix(net[0], (1, c_in, 6, 6)).detach())[0])
        check_upper_bound(rho, exact, "orthogonal conv")
        assert rho <= 1.0 + 1e-3 and exact <= rho


def test_groupsort_maxmin_matches_sort_and_routes_gradients_by_a_permutation() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, 4, 4, generator=gen, dtype=DT)
    x[:, 1] = x[:, 0]  # ties in the first pair
    g2, g4 = GroupSort(2), GroupSort(4)
    assert torch.equal(g2(x), x.unflatten(1, (4, 2)).sort(dim=2).values.flatten(1, 2))
    w = torch.randn_like(x)
    xr = x.clone().requires_grad_(True)
    (g2(xr) * w).sum().backward()
    # the gradient is w permuted within pairs: same multiset per pair, norm preserved
    assert xr.grad is not None
    pairs_g = xr.grad.unflatten(1, (4, 2)).sort(dim=2).values
    pairs_w = w.unflatten(1, (4, 2)).sort(dim=2).values
    assert torch.equal(pairs_g, pairs_w)
    # vmap(grad) (used by the per-example checks) agrees with the batched gradient
    per = vmap(grad(lambda xi, wi: (g2(xi[None]) * wi[None]).sum()))(x, w)
    assert torch.allclose(per, xr.grad)
    assert torch.equal(g4(x), x.unflatten(1, (2, 4)).sort(dim=2).values.flatten(1, 2))


def test_orthogonal_groupsort_chain_preserves_gradient_norms() -> None:
    """Square OrthLinear + GroupSort: every layer's Jacobian is orthogonal, so the per-example
    input gradient has exactly the norm of the logit gradient (gradient-norm preserving), and the
    weight gradients of each layer have norm ||dl/dy_k|| ||x_{k-1}|| = ||dl/dz|| ||x||, which is
    the certificate's lambda_k X_{k-1} G_k / L_loss * ||dl/dz|| on the sphere ||x|| = X_0."""
    torch.manual_seed(0)
    net = nn.Sequential(OrthLinear(8, 8, bias=False), GroupSort(2), OrthLinear(8, 8, bias=False),
                        GroupSort(2), OrthLinear(8, 8, bias=False)).to(DT)
    for layer in net[::2]:
        layer.project_()  # again in float64
    loss = TemperedCrossEntropy(0.5)
    x = random_ball((8,), 2.0, 16, torch.Generator().manual_seed(0))
    y = torch.randint(0, 8, (16,), generator=torch.Generator().manual_seed(1))
    xr = x.clone().requires_grad_(True)
    z = net(xr)
    z.retain_grad()
    loss(z, y).sum().backward()
    assert xr.grad is not None and z.grad is not None
    assert torch.allclose(xr.grad.norm(dim=1), z.grad.norm(dim=1), rtol=1e-10)
    b = lipschitz_bounds(net, loss, input_shape=(8,), input_norm_bound=2.0)
    from tests.lipschitz.helpers import per_example_grad_norms

    norms = per_example_grad_norms(net, loss, x, y)
    for name, n in norms.items():
        expected = z.grad.norm(dim=1) * x.norm(dim=1)
        assert torch.allclose(n, expected, rtol=1e-8), name
        # bound = X_0 * sqrt(2)/tau * 1.0001^k (slack): n / bound = ||dl/dz|| ||x|| / (X_0 L)
        assert float(n.max()) <= b.parameter_grad_bounds[name]


def test_lip_orth_cnn_registry_model_and_certificate() -> None:
    model = build_model("lip-orth-cnn", (1, 28, 28), 10)
    assert sum(p.numel() for p in model.parameters()) == 20_432
    assert [type(m).__name__ for m in model] == [
        "OrthConv2d", "GroupSort", "AvgPool2d", "OrthConv2d", "GroupSort", "AvgPool2d", "Flatten",
        "OrthLinear"]
    with pytest.raises(ValueError, match="pool must be one of"):
        lip_orth_convnet(pool="max")
    strategy = FixLipDpSgd(input_norm=10.0, weight_bound=1.0, temperature=0.1)
    strategy.post_step(model, strategy.init_state(), input_shape=(1, 28, 28))
    _, cert = strategy.certify(model, strategy.loss(), (1, 28, 28), strategy.init_state())
    rho = {n.name: n.lipschitz for n in cert.bound.trace}
    for name in ("conv1", "conv2", "fc", "pool1", "pool2"):
        assert rho[name] == pytest.approx(1.0, rel=2e-4), name  # scaled sum pool: exactly 1
    # R2 sensitivity: lambda_k G_k with lambda = 3 (3x3 conv), 1 (dense), G = sqrt(2)/tau
    expected = math.sqrt(2) / 0.1 * math.sqrt(9 + 9 + 1)
    assert cert.sensitivity == pytest.approx(expected, rel=1e-3)


def test_lip_orth_cnn_per_example_gradients_within_the_certificate() -> None:
    """A narrow lip-orth-cnn after the strategy's projection and weight clipping, in float64:
    per-example gradients on random and adversarial inputs never exceed the certificate. The
    attack reaches only about a quarter of the bound (0.27 here): the certificate stays loose even
    for an orthogonal net (the conv weight factor sqrt(k_h k_w), the loss constant sqrt(2)/tau
    reached only by saturated wrong predictions; docs/lipschitz.md)."""
    torch.manual_seed(0)
    model = lip_orth_convnet((1, 12, 12), 4, channels=(4, 6)).to(DT)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    strategy = LipDpSgd(input_norm=2.0, weight_bound=1.0)
    strategy.post_step(model, strategy.init_state(), input_shape=(1, 12, 12))
    loss = TemperedCrossEntropy(0.5)
    bound = lipschitz_bounds(model, loss, input_shape=(1, 12, 12), input_norm_bound=2.0)
    gen = torch.Generator().manual_seed(1)
    x = random_ball((1, 12, 12), 2.0, 16, gen)
    y = torch.randint(0, 4, (16,), generator=gen)
    _check(model, loss, bound, x, y)
    worst = _adversarial(model, loss, bound, x[:6], y[:6], 2.0, steps=15)
    assert 0.2 < worst <= 1.0


def test_frozen_convolutions_leave_only_the_dense_layer_in_the_certificate() -> None:
    model = build_model("lip-orth-cnn", (1, 28, 28), 10, freeze_convs=True)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["fc.weight"]
    strategy = LipDpSgd(input_norm=10.0, weight_bound=1.0, temperature=0.1)
    strategy.post_step(model, strategy.init_state(), input_shape=(1, 28, 28))
    conv = model.conv2.weight.detach().clone()
    with torch.no_grad():
        model.fc.weight.add_(0.1 * torch.randn_like(model.fc.weight))
    strategy.post_step(model, strategy.init_state(), input_shape=(1, 28, 28))
    assert torch.equal(model.conv2.weight, conv)  # frozen: neither projected nor rescaled again
    sv = torch.linalg.svdvals(model.fc.weight.detach().double())
    assert torch.allclose(sv, torch.ones_like(sv), atol=1e-5)  # the trained layer: re-projected
    _, cert = strategy.certify(model, strategy.loss(), (1, 28, 28), strategy.init_state())
    assert cert.layer_sensitivities["conv1"] == cert.layer_sensitivities["conv2"] == 0.0
    assert cert.sensitivity == pytest.approx(math.sqrt(2) / 0.1, rel=2e-4)
