"""Per-example gradient norms of small networks (``vmap(grad)``) never exceed the certified bounds,
for random inputs on and inside the ball ``||x|| <= X_0`` and for inputs optimised by gradient
ascent on the per-example gradient norm."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import dpclip.lipschitz as lip
import dpclip.lipschitz.bounds as bounds_mod
from dpclip.lipschitz import (
    CosineSimilarityLoss,
    GroupSort,
    LipGroupNorm,
    LipResidual,
    LipschitzLoss,
    MulticlassHingeLoss,
    NetworkBound,
    TemperedCrossEntropy,
    lip_mnist_convnet,
    lip_small_convnet,
    lipschitz_bounds,
)
from dpclip.lipschitz.norms import OperatorNormBound
from dpclip.models import TemperedSigmoid, build_model
from tests.lipschitz.helpers import DT, per_example_grad_norms, project_ball, random_ball


def _scale_weights(model: nn.Module, factor: float) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(factor)
    return model


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 4)
    )


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2, 1),
        nn.Conv2d(4, 4, 3, stride=2, padding=1),
        TemperedSigmoid(3.0, 1.0, 1.0),
        nn.AvgPool2d(2, 1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


def _residual() -> nn.Module:
    return nn.Sequential(
        nn.Linear(6, 8),
        LipResidual(nn.Sequential(nn.Linear(8, 8), GroupSort(2), nn.Linear(8, 8, bias=False))),
        LipGroupNorm(2, 2.0),
        nn.Sigmoid(),
        LipResidual(nn.Linear(8, 8)),
        nn.Linear(8, 3),
    )


def _conv_gn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 2, bias=False),
        nn.GroupNorm(2, 4, eps=0.5, affine=False),
        nn.LeakyReLU(0.2),
        LipResidual(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.Tanh())),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(16, 5),
    )


NETWORKS = [
    ("mlp", _mlp, (8,), 4, TemperedCrossEntropy(0.5), 1.5),
    ("cnn", _cnn, (2, 4, 4), 3, MulticlassHingeLoss(1.0, "sum"), 2.0),
    ("residual", _residual, (6,), 3, CosineSimilarityLoss(0.5), 1.0),
    ("conv-gn", _conv_gn, (1, 5, 5), 5, MulticlassHingeLoss(0.5, "max"), 3.0),
    ("mlp-ce1", _mlp, (8,), 4, TemperedCrossEntropy(1.0), 4.0),
]


def _check(
    model: nn.Module, loss: LipschitzLoss, bound: NetworkBound, x: torch.Tensor, y: torch.Tensor
) -> float:
    """Assert every per-example norm is within its bound; return the largest ratio seen."""
    norms = per_example_grad_norms(model, loss, x, y)
    pb = bound.parameter_grad_bounds
    assert set(norms) == set(pb)
    worst = 0.0
    for name, n in norms.items():
        assert float(n.max()) <= pb[name] * (1 + 1e-9), (name, float(n.max()), pb[name])
        worst = max(worst, float(n.max()) / pb[name])
    for layer in bound.layers:
        layer_norm = torch.sqrt(sum(norms[p] ** 2 for p in layer.parameter_grad_bounds))
        assert float(layer_norm.max()) <= layer.grad_bound * (1 + 1e-9)
    total = torch.sqrt(sum(n**2 for n in norms.values()))
    assert float(total.max()) <= bound.grad_bound * (1 + 1e-9)
    return worst


def _adversarial(
    model: nn.Module,
    loss: LipschitzLoss,
    bound: NetworkBound,
    x: torch.Tensor,
    y: torch.Tensor,
    radius: float,
    steps: int,
) -> float:
    """Projected gradient ascent on sum_k (||g_k|| / bound_k)^2; checks the bound at every step."""
    pb = bound.parameter_grad_bounds
    x = x.clone().requires_grad_(True)
    opt = torch.optim.Adam([x], lr=0.1 * radius)
    worst = 0.0
    for _ in range(steps):
        worst = max(worst, _check(model, loss, bound, x.detach(), y))
        norms = per_example_grad_norms(model, loss, x, y)
        objective = sum(((n / pb[k]) ** 2).sum() for k, n in norms.items())
        opt.zero_grad()
        (-objective).backward()
        opt.step()
        with torch.no_grad():
            x.copy_(project_ball(x, radius))
    return max(worst, _check(model, loss, bound, x.detach(), y))


@pytest.mark.parametrize(
    ("name", "build", "shape", "classes", "loss", "radius"), NETWORKS, ids=[n[0] for n in NETWORKS]
)
def test_per_example_gradients_never_exceed_the_bounds(
    name: str, build, shape: tuple[int, ...], classes: int, loss: LipschitzLoss, radius: float
) -> None:
    torch.manual_seed(0)
    model = _scale_weights(build().to(DT), 1.5)
    bound = lipschitz_bounds(model, loss, input_shape=shape, input_norm_bound=radius)
    gen = torch.Generator().manual_seed(1)
    x = random_ball(shape, radius, 24, gen)
    y = torch.randint(0, classes, (24,), generator=gen)
    _check(model, loss, bound, x, y)
    worst = _adversarial(model, loss, bound, x[:8], y[:8], radius, steps=12)
    assert 0.0 < worst <= 1.0


def test_bounds_are_reasonably_tight_on_a_single_linear_layer() -> None:
    """One Linear + CE: the weight bound sqrt(2)/tau * X_0 is approached by confident mistakes,
    so the per-example check above is not vacuous."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3)).to(DT)
    loss = TemperedCrossEntropy(0.1)
    bound = lipschitz_bounds(model, loss, input_shape=(5,), input_norm_bound=10.0)
    assert bound.layer("0").weight_grad_bound == pytest.approx(math.sqrt(2) / 0.1 * 10.0, rel=1e-5)
    x = random_ball((5,), 10.0, 16, torch.Generator().manual_seed(0))
    y = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(0))
    assert _adversarial(model, loss, bound, x, y, 10.0, steps=15) > 0.8


def test_an_underestimated_norm_is_caught_by_the_brute_force_check(monkeypatch) -> None:
    """Privacy breaks silently if a norm is under-estimated: with the dense norms halved (as an
    unchecked power-iteration estimate could do), real per-example gradients exceed the claimed
    bound, and the oracle of these tests detects it."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 6, bias=False), nn.Linear(6, 6, bias=False), nn.Linear(6, 3, bias=False)
    ).to(DT)
    with torch.no_grad():
        for layer in model:
            nn.init.orthogonal_(layer.weight)  # all singular values 1: the norm bound is tight
    real = lipschitz_bounds(model, TemperedCrossEntropy(), input_shape=(6,), input_norm_bound=1.0)
    honest = bounds_mod.linear_operator_norm_bound
    monkeypatch.setattr(
        bounds_mod,
        "linear_operator_norm_bound",
        lambda layer, method="svd": OperatorNormBound(0.5 * honest(layer).value, "underestimate"),
    )
    fake = lipschitz_bounds(model, TemperedCrossEntropy(), input_shape=(6,), input_norm_bound=1.0)
    assert fake.grad_bound < real.grad_bound
    gen = torch.Generator().manual_seed(0)
    x = random_ball((6,), 1.0, 32, gen)
    y = torch.randint(0, 3, (32,), generator=gen)
    _check(model, TemperedCrossEntropy(), real, x, y)
    with pytest.raises(AssertionError):
        _check(model, TemperedCrossEntropy(), fake, x, y)


def test_registry_model_papernot_cnn_with_overlapping_pools() -> None:
    torch.manual_seed(0)
    model = build_model("papernot-cnn", (1, 28, 28), 10).to(DT)
    loss = TemperedCrossEntropy(1.0)
    bound = lipschitz_bounds(model, loss, input_shape=(1, 28, 28), input_norm_bound=1.0)
    assert [lb.name for lb in bound.layers] == ["conv1", "conv2", "fc1", "fc2"]
    assert {n.name: n.lipschitz for n in bound.trace}["pool1"] == 2.0  # T14 inside A1
    gen = torch.Generator().manual_seed(0)
    x = random_ball((1, 28, 28), 1.0, 8, gen)
    y = torch.randint(0, 10, (8,), generator=gen)
    _adversarial(model, loss, bound, x[:4], y[:4], 1.0, steps=3)
    _check(model, loss, bound, x, y)


def test_t13_lip_mnist_convnet() -> None:
    """T13: 1,625,866 parameters; the stride-2 pool is 1-Lipschitz; biases get their own bounds."""
    torch.manual_seed(0)
    model = lip_mnist_convnet()
    assert sum(p.numel() for p in model.parameters()) == 1_625_866
    bound = lipschitz_bounds(
        model, TemperedCrossEntropy(), input_shape=(1, 28, 28), input_norm_bound=1.0
    )
    assert {n.name: n.lipschitz for n in bound.trace}["pool"] == 1.0
    assert set(bound.parameter_grad_bounds) == {n for n, _ in model.named_parameters()}
    no_bias = lip_mnist_convnet(activation="groupsort", bias=False)
    nb = lipschitz_bounds(
        no_bias, TemperedCrossEntropy(), input_shape=(1, 28, 28), input_norm_bound=1.0
    )
    assert all(lb.bias_grad_bound is None for lb in nb.layers)
    # no bias and norm-preserving activations: X_k = X_0 * prod of operator norms
    expected = 1.0
    for lb in nb.layers:
        assert lb.input_norm_bound == pytest.approx(expected)
        expected *= lb.operator_norm


def test_lip_small_convnet_bounds_hold() -> None:
    """The small Lipschitz CNN: 20,490 parameters, its 2x2/2 average pools are 1/2-Lipschitz
    (exact Schur constant), and per-example gradients (random and adversarial inputs, small
    weights scaled up so the bounds are not slack) stay within the certificate."""
    torch.manual_seed(0)
    model = lip_small_convnet()
    assert sum(p.numel() for p in model.parameters()) == 20_490
    with_hidden = lip_small_convnet(channels=(8,), hidden=16, activation="groupsort")
    assert [type(m).__name__ for m in with_hidden] == [
        "Conv2d", "GroupSort", "AvgPool2d", "Flatten", "Linear", "GroupSort", "Linear"]
    with pytest.raises(ValueError, match="divisible by 2\\*\\*3"):
        lip_small_convnet((1, 28, 28), channels=(4, 4, 4))
    model = _scale_weights(lip_small_convnet(channels=(4, 6)).to(DT), 3.0)
    loss = TemperedCrossEntropy()
    bound = lipschitz_bounds(model, loss, input_shape=(1, 28, 28), input_norm_bound=1.0)
    rho = {n.name: n.lipschitz for n in bound.trace}
    assert rho["pool1"] == pytest.approx(0.5, rel=1e-6) and rho["pool2"] == pytest.approx(0.5, rel=1e-6)
    gen = torch.Generator().manual_seed(1)
    x = random_ball((1, 28, 28), 1.0, 8, gen)
    y = torch.randint(0, 10, (8,), generator=gen)
    _adversarial(model, loss, bound, x[:4], y[:4], 1.0, steps=3)
    _check(model, loss, bound, x, y)


def test_bound_structure_and_r2_scaling() -> None:
    torch.manual_seed(0)
    model = _residual().to(DT)
    loss = CosineSimilarityLoss(0.5)
    b = lipschitz_bounds(model, loss, input_shape=(6,), input_norm_bound=2.0)
    assert b.loss_lipschitz == 2.0
    assert [lb.name for lb in b.layers] == ["0", "1.block.0", "1.block.2", "4.block", "5"]
    assert b.grad_bound == pytest.approx(
        math.sqrt(sum(v**2 for v in b.parameter_grad_bounds.values()))
    )
    assert b.scaled_grad_bound == pytest.approx(
        math.sqrt(sum((lb.grad_bound / lb.input_norm_bound) ** 2 for lb in b.layers))
    )
    first = b.layer("0")
    assert first.input_norm_bound == 2.0
    assert first.weight_grad_bound == pytest.approx(first.output_grad_bound * 2.0)
    # the gradient reaching the first layer of a residual block skips the identity path
    blk0, blk2 = b.layer("1.block.0"), b.layer("1.block.2")
    assert blk0.output_grad_bound == pytest.approx(
        blk2.output_grad_bound * blk2.operator_norm * 1.0
    )
    assert first.output_grad_bound == pytest.approx(
        blk2.output_grad_bound * (1 + blk0.operator_norm * blk2.operator_norm) * 1.0
    )
    with pytest.raises(KeyError, match="no parametrised layer"):
        b.layer("nope")
    # frozen parameters propagate but get no gradient bound
    model[0].bias.requires_grad_(False)
    frozen = lipschitz_bounds(model, loss, input_shape=(6,), input_norm_bound=2.0)
    assert (
        "0.bias" not in frozen.parameter_grad_bounds and "0.weight" in frozen.parameter_grad_bounds
    )


@pytest.mark.parametrize(
    ("loss", "classes", "value"),
    [
        (TemperedCrossEntropy(1.0), 5, math.sqrt(2)),
        (TemperedCrossEntropy(4.0), 5, math.sqrt(2) / 4),
        (CosineSimilarityLoss(0.25), 5, 4.0),
        (MulticlassHingeLoss(1.0, "max"), 5, math.sqrt(2)),
        (MulticlassHingeLoss(1.0, "sum"), 5, math.sqrt(20)),
    ],
)
def test_loss_constants_bound_the_logit_gradient(
    loss: LipschitzLoss, classes: int, value: float
) -> None:
    assert loss.lipschitz(classes) == pytest.approx(value)
    gen = torch.Generator().manual_seed(0)
    z = torch.cat(
        [
            torch.randn(64, classes, generator=gen, dtype=DT) * s
            for s in (0.01, 0.3, 1.0, 10.0, 100.0)
        ]
        + [torch.zeros(4, classes, dtype=DT), torch.ones(4, classes, dtype=DT)]
    )
    y = torch.randint(0, classes, (z.shape[0],), generator=gen)
    # adversarial: ascend the gradient norm w.r.t. the logits
    z = z.requires_grad_(True)
    opt = torch.optim.Adam([z], lr=0.1)
    worst = 0.0
    for _ in range(30):
        (g,) = torch.autograd.grad(loss(z, y).sum(), z, create_graph=True)
        n = g.norm(dim=1)
        top = float(n.detach().max())
        assert top <= value * (1 + 1e-9)
        worst = max(worst, top)
        opt.zero_grad()
        (-n.sum()).backward()
        opt.step()
    assert worst >= 0.9 * value  # the constants are tight


def test_losses_match_their_definitions() -> None:
    z = torch.randn(6, 4, dtype=DT)
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    assert torch.allclose(
        TemperedCrossEntropy(2.0)(z, y), nn.functional.cross_entropy(z / 2, y, reduction="none")
    )
    mm = nn.MultiMarginLoss(margin=0.7, reduction="none")(z, y) * 4
    assert torch.allclose(MulticlassHingeLoss(0.7, "sum")(z, y), mm)
    zt = z.gather(1, y[:, None])
    other = z.masked_fill(nn.functional.one_hot(y, 4).bool(), -math.inf).amax(1, keepdim=True)
    assert torch.allclose(
        MulticlassHingeLoss(1.0, "max")(z, y), (1 - zt + other).clamp_min(0).squeeze(1)
    )
    big = z * 100
    assert torch.allclose(
        CosineSimilarityLoss(0.1)(big, y),
        1 - nn.functional.cosine_similarity(big, nn.functional.one_hot(y, 4).to(DT), dim=1),
    )
    with pytest.raises(ValueError, match="temperature"):
        TemperedCrossEntropy(0.0)
    with pytest.raises(ValueError, match="min_norm"):
        CosineSimilarityLoss(0.0)
    with pytest.raises(ValueError, match="aggregation"):
        MulticlassHingeLoss(1.0, "mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="class-index targets"):
        TemperedCrossEntropy()(z, y[:3])


def test_all_is_curated() -> None:
    assert sorted(lip.__all__) == sorted(set(lip.__all__))
    for name in lip.__all__:
        assert hasattr(lip, name), name
