"""Per-layer constants versus brute force: Jacobian spectral norms at random and adversarial inputs
(gradient ascent on ``||f(x+d) - f(x)|| / ||d||``) and adversarially maximised output norms."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from torch import nn

from dpclip.lipschitz import GroupSort, LipGroupNorm, LipResidual, module_lipschitz
from dpclip.models import TemperedSigmoid
from tests.lipschitz.helpers import (
    DT,
    jacobian_norm,
    max_lipschitz_ratio,
    max_output_norm,
    random_ball,
)


def _cases() -> list[tuple[str, nn.Module, tuple[int, ...]]]:
    torch.manual_seed(0)
    big_bias = nn.Linear(6, 5)
    with torch.no_grad():
        big_bias.bias.mul_(10)
    return [
        ("linear", nn.Linear(6, 5), (6,)),
        ("linear-big-bias", big_bias, (6,)),
        ("linear-sequence", nn.Linear(4, 3), (3, 4)),
        ("conv", nn.Conv2d(2, 3, 3, padding=1), (2, 5, 5)),
        ("conv-stride", nn.Conv2d(2, 3, 3, stride=2, padding=1), (2, 6, 5)),
        ("conv-groups-dilation", nn.Conv2d(4, 4, 2, dilation=2, groups=2), (4, 5, 5)),
        ("relu", nn.ReLU(), (7,)),
        ("leaky-relu", nn.LeakyReLU(0.1), (7,)),
        ("leaky-relu-steep", nn.LeakyReLU(2.0), (7,)),
        ("tanh", nn.Tanh(), (7,)),
        ("sigmoid", nn.Sigmoid(), (7,)),
        ("tempered-sigmoid", TemperedSigmoid(3.0, 0.5, 1.0), (7,)),
        ("tempered-sigmoid-tanh", TemperedSigmoid(), (2, 3)),
        ("tempered-sigmoid-no-offset", TemperedSigmoid(2.0, 3.0, 0.0), (7,)),
        ("groupsort2", GroupSort(2), (6,)),
        ("groupsort3-channels", GroupSort(3), (6, 2, 2)),
        ("maxpool-2x2-s1", nn.MaxPool2d(2, 1), (1, 4, 4)),
        ("maxpool-3x3-s2-pad", nn.MaxPool2d(3, 2, padding=1), (2, 5, 5)),
        ("maxpool-2x2-s2", nn.MaxPool2d(2), (1, 4, 4)),
        ("maxpool-dilated", nn.MaxPool2d(2, 1, dilation=2), (1, 5, 5)),
        ("avgpool-2x2-s1", nn.AvgPool2d(2, 1), (1, 4, 4)),
        ("avgpool-pad-exclude", nn.AvgPool2d(3, 2, padding=1, count_include_pad=False), (1, 5, 5)),
        ("avgpool-pad-include", nn.AvgPool2d(3, 1, padding=1), (1, 4, 4)),
        ("avgpool-ceil", nn.AvgPool2d(2, ceil_mode=True), (1, 5, 5)),
        ("adaptive-avgpool", nn.AdaptiveAvgPool2d((2, 2)), (2, 5, 5)),
        ("groupnorm", nn.GroupNorm(2, 4, eps=0.1, affine=False), (4, 2)),
        ("lip-groupnorm", LipGroupNorm(2, 3.0), (4, 2)),
        ("flatten", nn.Flatten(), (2, 3, 2)),
        ("unflatten", nn.Unflatten(1, (2, 3)), (6,)),
        ("identity", nn.Identity(), (5,)),
        (
            "residual",
            LipResidual(nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 5))),
            (5,),
        ),
        (
            "sequential",
            nn.Sequential(
                nn.Conv2d(1, 2, 3, padding=1),
                nn.ReLU(),
                nn.MaxPool2d(2, 1),
                nn.Flatten(),
                nn.Linear(18, 4),
                nn.Sigmoid(),
            ),
            (1, 4, 4),
        ),
    ]


CASES = _cases()


@pytest.mark.parametrize(("name", "module", "shape"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("radius", [0.3, 3.0])
def test_lipschitz_and_output_bounds_hold_under_brute_force(
    name: str, module: nn.Module, shape: tuple[int, ...], radius: float
) -> None:
    module = module.to(DT)
    bound = module_lipschitz(module, shape, radius)
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))

    def one(x: torch.Tensor) -> torch.Tensor:
        return module(x[None])[0]

    # Jacobian spectral norms (autograd's Jacobian, kinks included) at random points
    for x in random_ball(shape, radius, 6, gen):
        assert jacobian_norm(one, x) <= bound.lipschitz * (1 + 1e-9), name
    # adversarial Lipschitz ratio and output norm over the ball
    ratio = max_lipschitz_ratio(module, shape, radius, gen, n=8, steps=25)
    out = max_output_norm(module, shape, radius, gen, n=8, steps=25)
    assert ratio <= bound.lipschitz * (1 + 1e-9)
    assert out <= bound.output_norm_bound * (1 + 1e-9)
    if name != "sequential":  # single layers: the attack gets close, so the check has power
        assert ratio >= 0.6 * bound.lipschitz and out >= 0.5 * bound.output_norm_bound


def test_trace_bounds_hold_for_every_intermediate_layer() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1),
        nn.Tanh(),
        nn.MaxPool2d(2, 1),
        nn.Conv2d(3, 2, 2, stride=2),
        TemperedSigmoid(3.0, 1.0, 0.5),
        nn.Flatten(),
        nn.Linear(2 * 2 * 2, 6),
        nn.ReLU(),
        nn.Linear(6, 3),
    ).to(DT)
    shape, radius = (1, 5, 5), 2.0
    bound = module_lipschitz(model, shape, radius)
    seen: dict[str, list[float]] = {}
    hooks = [
        m.register_forward_hook(
            lambda mod, inp, out, n=n: seen.setdefault(n, []).append(
                float(out.detach().flatten(1).norm(dim=1).max())
            )
        )
        for n, m in model.named_children()
    ]
    gen = torch.Generator().manual_seed(0)
    try:
        max_output_norm(model, shape, radius, gen, n=8, steps=30)
        model(random_ball(shape, radius, 32, gen))
    finally:
        for h in hooks:
            h.remove()
    for node in bound.trace:
        assert max(seen[node.name]) <= node.output_norm_bound * (1 + 1e-9), node


def test_t14_overlapping_max_pool_2x2_stride_1_has_bound_2() -> None:
    """T14: the l2 Lipschitz bound of a 2x2 stride-1 max pool is 2, and it is attained."""
    pool = nn.MaxPool2d(2, stride=1)
    bound = module_lipschitz(pool, (1, 5, 5))
    assert bound.lipschitz == 2.0
    spike = torch.zeros(1, 5, 5, dtype=DT)
    spike[0, 2, 2] = 1.0  # the max of the 4 windows that contain it
    assert jacobian_norm(lambda x: pool(x[None])[0], spike) == pytest.approx(2.0)
    assert pool(spike[None]).norm() == pytest.approx(2.0 * spike.norm())
    # non-overlapping pools are 1-Lipschitz; 3x3 stride 1 -> 3
    assert module_lipschitz(nn.MaxPool2d(2), (1, 4, 4)).lipschitz == 1.0
    assert module_lipschitz(nn.MaxPool2d(3, 1), (1, 5, 5)).lipschitz == 3.0


def test_pool_and_norm_constants() -> None:
    assert module_lipschitz(nn.AvgPool2d(2, 1), (1, 6, 6)).lipschitz == pytest.approx(1.0)
    # count_include_pad=False at a corner: column sums of the averaging matrix exceed 1 there
    excl = module_lipschitz(nn.AvgPool2d(3, 1, padding=1, count_include_pad=False), (1, 4, 4))
    assert excl.lipschitz > 1.0
    assert module_lipschitz(
        nn.GroupNorm(1, 2, eps=0.04, affine=False), (2, 3)
    ).lipschitz == pytest.approx(5.0)
    assert module_lipschitz(LipGroupNorm(1, 2.5), (2, 3)).lipschitz == 2.5
    assert module_lipschitz(TemperedSigmoid(2.0, 3.0, 1.0), (3,)).lipschitz == pytest.approx(1.5)
    assert module_lipschitz(nn.Sigmoid(), (3,)).lipschitz == 0.25
    res = module_lipschitz(LipResidual(nn.Sequential(nn.Tanh(), nn.Sigmoid())), (3,))
    assert res.lipschitz == 1.25


def test_groupnorm_lipschitz_is_attained_near_constant_groups() -> None:
    """The 1/sqrt(eps) constant is tight: a constant group makes the Jacobian 1/sqrt(eps)."""
    gn = nn.GroupNorm(1, 4, eps=0.01, affine=False).to(DT)
    x = torch.ones(4, 1, dtype=DT)
    assert jacobian_norm(lambda v: gn(v[None])[0], x) == pytest.approx(10.0, rel=1e-6)
    lgn = LipGroupNorm(1, 10.0).to(DT)
    assert jacobian_norm(lambda v: lgn(v[None])[0], x) == pytest.approx(10.0)
    assert torch.isfinite(
        torch.func.jacrev(lambda v: lgn(v[None])[0])(torch.zeros(4, 1, dtype=DT))
    ).all()


def test_groupsort_is_a_permutation() -> None:
    x = torch.randn(3, 6, 2)
    y = GroupSort(3)(x)
    assert torch.allclose(y.norm(dim=(1, 2)), x.norm(dim=(1, 2)))
    assert torch.equal(y.view(3, 2, 3, 2), x.view(3, 2, 3, 2).sort(dim=2).values)
    with pytest.raises(ValueError, match="multiple of the group size"):
        GroupSort(4)(x)
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match="group_size"):
            GroupSort(bad)  # type: ignore[arg-type]


def test_linear_bias_enters_the_output_bound_soundly() -> None:
    lin = nn.Linear(3, 4).to(DT)
    with torch.no_grad():
        lin.weight.zero_()
        lin.bias.fill_(2.0)
    b = module_lipschitz(lin, (5, 3), 1.0)  # 5 positions share the bias
    assert (
        b.output_norm_bound
        >= float(lin(torch.zeros(1, 5, 3, dtype=DT)).detach().norm())
        == pytest.approx(2 * math.sqrt(20))
    )
