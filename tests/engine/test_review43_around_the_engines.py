"""Forty-third hostile review: user code around the engines, outside ghost's checks.

On 901b2df: a torch function mode entered by the model's constructor (never left) ran inside the
vmap / naive / batch-clipping reductions and ``dp_step``'s release (the norms divided by 1000: LOO
190 C under vmap and naive; the noise zeroed through ``make_private(engine="vmap")``): ghost
refused it at its chunks, the other engines did not look. A gradient hook on a parameter scaled
Lip-DP-SGD's summed gradient (16.9 times the certified sensitivity). An ``Augmentation`` subclass
("batch mixup", 6.01 C) or a ``Scattering`` subclass (3.66 C) ran on the whole drawn batch before
any engine. Now every engine's ``compute`` and ``dp_step`` refuse an active mode or saved-tensor
hooks (``isolation.engine_only``), the Lipschitz check refuses parameter hooks, and only the
library's own ``Augmentation`` / ``Scattering`` classes are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import dpclip
from dpclip.data.augment import Augmentation, parse_augment
from dpclip.data.features import Scattering
from dpclip.engine import AutoEngine, GhostEngine, NaiveEngine, VmapEngine
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import Head, loo_distance

DT = torch.float64


class _Shrink(TorchFunctionMode):
    """Divides every vector norm by 1000 (the reducers' norms)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out / 1000.0 if func is torch.linalg.vector_norm else out


class _EntersAMode(Head):
    def __init__(self) -> None:
        super().__init__()
        self.mode = _Shrink()
        self.mode.__enter__()  # (never left by the model: the test leaves it)

    def forward(self, x):
        return self.fc(x)


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine, VmapEngine, NaiveEngine])
def test_a_mode_left_active_before_the_step_is_refused_by_every_engine(engine):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g, dtype=DT), torch.randint(0, 3, (8,), generator=g)
    made = []

    def make():
        made.append(_EntersAMode())
        return made[-1]

    try:
        with pytest.raises(UnsupportedModelError, match="torch function mode"):
            loo_distance(engine, make, x, y, 0.01)
    finally:
        for m in reversed(made):
            m.mode.__exit__(None, None, None)
    assert torch._C._len_torch_function_stack() == 0


def test_a_mode_left_active_is_refused_by_make_private_on_vmap():
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(40, 4, generator=g), torch.randint(0, 3, (40,), generator=g))
    model = nn.Linear(4, 3)
    dp = dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                             noise_multiplier=1.0, steps=2, batch_size=8.0, engine="vmap",
                             verbose=False)
    xs, ys = dp.sample()
    mode = _Shrink()
    mode.__enter__()
    try:
        with pytest.raises(UnsupportedModelError, match="torch function mode"):
            dp.step(xs, ys)
    finally:
        mode.__exit__(None, None, None)


def test_a_parameter_gradient_hook_is_refused_under_a_lipschitz_strategy():
    from dpclip.lipschitz.bounds import UnsupportedLayerError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    model[0].weight.register_hook(lambda grad: 50.0 * grad)
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(40, 5, generator=g, dtype=DT), torch.randint(0, 3, (40,), generator=g))
    dp = dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                             noise_multiplier=1.0, steps=2, batch_size=8.0,
                             strategy="lip-dp-sgd", strategy_params={"input_norm": 1.0},
                             input_shape=(5,), verbose=False)
    xs, ys = dp.sample()
    with pytest.raises(UnsupportedLayerError, match=r"parameter '0.weight' has a gradient hook"):
        dp.step(xs, ys)


@dataclass(frozen=True)
class _BatchMixup(Augmentation):
    def apply(self, x, params):  # mixes the drawn batch
        return x + 10.0 * x.sum(0, keepdim=True)


def test_an_augmentation_subclass_is_refused():
    with pytest.raises(TypeError, match="_BatchMixup is not dpclip's own Augmentation"):
        parse_augment(_BatchMixup(flip=True))
    assert type(parse_augment("flip")) is Augmentation


class _MixingFeatures(Scattering):
    def transform_images(self, x):
        f = x.flatten(1)
        return f + 10.0 * f.sum(0, keepdim=True)


def test_a_scattering_subclass_is_refused():
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 3, (16,), generator=g))
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 3))
    with pytest.raises(TypeError, match="features= must be 'scattering'"):
        dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                            noise_multiplier=1.0, steps=2, batch_size=4.0,
                            features=_MixingFeatures(J=2), verbose=False)
