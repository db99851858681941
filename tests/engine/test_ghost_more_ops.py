"""Operations of ordinary models that sent them to whole-model vmap under ``auto`` (no separability
rule): ``F.unfold`` / ``F.fold`` (``im2col`` / ``col2im``), ``glu``, ``hardswish``, the backwards
of the elementwise activations and of softmax (met in per-layer replays), ``channel_shuffle``,
``torch.cdist``, ``F.grid_sample`` with ``F.affine_grid`` (a spatial transformer), ``max_unpool``.
Each rule has a use across the batch beside it that stays refused. Oracle: the float64
per-example loop.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from dpclip.engine import AutoEngine, GhostEngine, ParamGroups, UnsupportedModelError
from dpclip.engine.batch import padded_rows
from tests.engine.helpers import DT, assert_equal_to_the_loop, ce, clip_weights

B = 5


def _img() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, 2, 6, 6, generator=g, dtype=DT), torch.randint(0, 3, (B,), generator=g)


class Net(nn.Module):
    """``fc(body(conv(x)))``: a convolution, a parameter-free body, a classifier."""

    def __init__(self, body, n: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)  # (4, 4, 4)
        self.body = body
        self.fc = nn.Linear(n, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.body(torch.tanh(self.conv(x))).flatten(1))


def _grid(h: Tensor) -> Tensor:
    theta = torch.tensor([[1.0, 0.2, 0.1], [-0.1, 0.9, 0.0]], dtype=h.dtype)
    return F.affine_grid(theta.expand(h.shape[0], 2, 3), list(h.shape), align_corners=False)


BODIES = {
    "unfold-fold": (lambda h: F.fold(F.unfold(h, 2, stride=1) * 0.5, (4, 4), 2, stride=1), 64),
    "glu-hardswish": (lambda h: F.hardswish(F.glu(h, 1)), 32),
    "channel-shuffle": (lambda h: F.channel_shuffle(h, 2), 64),
    "cdist": (lambda h: torch.cdist(h.flatten(2), h.flatten(2).flip(2)), 16),
    "grid-sample": (lambda h: F.grid_sample(h, _grid(h), align_corners=False), 64),
    "max-unpool": (lambda h: F.max_unpool2d(*F.max_pool2d(h, 2, return_indices=True), 2), 64),
}


class _Body(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, h: Tensor) -> Tensor:
        return self.fn(h)


def _check(model: nn.Module, x: Tensor, y: Tensor, per_layer: tuple[str, ...] = ()) -> None:
    for groups in (ParamGroups.flat(model), ParamGroups.per_parameter(model)):
        for engine in (AutoEngine(), GhostEngine(max_physical_batch=2)):
            res = engine.compute(model, ce, x, y, clip_weights(0.3), groups)
            assert res.engine_info["engine"] == "ghost" and res.engine_info["fallback"] is None
            assert (res.engine_info.get("per_layer") or ()) == per_layer
            assert_equal_to_the_loop(res, model, ce, x, y, groups)


@pytest.mark.parametrize("name", list(BODIES))
def test_operations_run_on_ghost_equal_to_the_loop(name):
    fn, n = BODIES[name]
    x, y = _img()
    torch.manual_seed(0)
    _check(Net(_Body(fn), n).to(DT), x, y)


class SpatialTransformer(nn.Module):
    """The spatial transformer network: a localisation head predicts each image's affine grid."""

    def __init__(self) -> None:
        super().__init__()
        self.loc = nn.Linear(72, 6)
        self.conv = nn.Conv2d(2, 2, 3)
        self.fc = nn.Linear(32, 3)
        with torch.no_grad():
            self.loc.weight.mul_(0.1)
            self.loc.bias.copy_(torch.tensor([1.0, 0, 0, 0, 1, 0]))

    def forward(self, x: Tensor) -> Tensor:
        theta = self.loc(x.flatten(1)).view(-1, 2, 3)
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        return self.fc(torch.tanh(self.conv(F.grid_sample(x, grid, align_corners=False)))
                       .flatten(1))


def test_a_spatial_transformer():
    x, y = _img()
    torch.manual_seed(0)
    _check(SpatialTransformer().to(DT), x, y)


class Activations(nn.Module):
    """A module with its own parameter (the per-layer path: its replay runs the backwards of
    every activation under vmap)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1.5, 1.5, 8, dtype=DT))

    def forward(self, h: Tensor) -> Tensor:
        h = h * self.w
        # (not mish: vmap batches its backward as ones.sub_(data), whose constant operand the
        # trace sees only after the write: refused in a per-layer module, fine elsewhere)
        acts = [F.elu(h), F.hardshrink(h, 0.3), F.hardsigmoid(h), F.hardtanh(h), F.relu6(h * 4),
                F.hardswish(h), F.leaky_relu(h, 0.1), F.softplus(h), F.softshrink(h),
                F.logsigmoid(h), F.selu(h), F.celu(h), h.softmax(1), h.log_softmax(1),
                F.glu(h, 1)]
        return torch.cat(acts, 1)


def test_activation_backwards_in_a_per_layer_replay():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(B, 4, generator=g, dtype=DT), torch.randint(0, 3, (B,), generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Activations(), nn.Linear(14 * 8 + 4, 3)).to(DT)
    _check(model, x, y, ("1",))


ACROSS = {
    # the batch where each operation combines positions
    "glu-over-batch": (lambda h: F.glu(torch.cat([h, h.flip(0)]), 0), 64),
    "shuffle-batch-as-channels": (lambda h: F.channel_shuffle(
        torch.cat([h, h]).transpose(0, 1), 2).transpose(0, 1)[: h.shape[0]], 64),
    # (as wide as the rows the engine runs: the batch padded to the row block)
    "cdist-between-examples": (lambda h: torch.cdist(h.flatten(1), h.flatten(1)),
                               padded_rows(B)),
    "unpool-other-indices": (lambda h: F.max_unpool2d(
        F.max_pool2d(h, 2), F.max_pool2d(h, 2, return_indices=True)[1].roll(1, 0), 2), 64),
    "grid-of-other-image": (lambda h: F.grid_sample(h, _grid(h).roll(1, 0) + h[:, :1, :, :1]
                                                    .roll(1, 0).permute(0, 2, 3, 1) * 0.1,
                                                    align_corners=False), 64),
}


@pytest.mark.parametrize("name", list(ACROSS))
def test_the_same_operations_across_the_batch_stay_refused(name):
    fn, n = ACROSS[name]
    x, y = _img()
    torch.manual_seed(0)
    model = Net(_Body(fn), n).to(DT)
    with pytest.raises(UnsupportedModelError):
        GhostEngine().compute(model, ce, x, y, clip_weights(0.3), ParamGroups.flat(model))


def test_unfold_and_fold_with_the_batch_elsewhere_than_in_front_are_mixing():
    from dpclip.engine.separable import MIXED, SeparabilityTracer

    h = torch.randn(4, 4, B, 4, dtype=DT)  # the examples as the height
    tr = SeparabilityTracer(B)
    tr.mark(h, (2, 1))
    with tr:
        cols = F.unfold(h, (2, 1))
        back = F.fold(torch.randn(4, 8, 16, dtype=DT) + cols[:, :8, :16], (5, 4), (2, 1))
    assert tr.layout(cols) is MIXED and tr.layout(back) is MIXED
