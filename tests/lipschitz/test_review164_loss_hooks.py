"""Hundred-and-sixty-fourth hostile review: the bound-based step checked the model's layers for
hooks and instance code (tenth review) but not the certified LOSS module: a forward hook, a
forward pre-hook or an instance ``forward`` on the ``TemperedCrossEntropy`` that
``make_private`` exposes as ``dp.loss_fn`` (or that is passed to ``dp_step``) scaled every
example's gradient past the certificate, 490 to 780 times its sensitivity under every engine.
The loss is checked like a layer at every step now."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpclip
from dpclip.lipschitz.bounds import UnsupportedLayerError

DT = torch.float64


def _private():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).to(DT)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(100, 6, generator=g, dtype=DT)
    y = torch.randint(0, 3, (100,), generator=g)
    return dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y),
                               noise_multiplier=1.0, steps=5, batch_size=8,
                               strategy="lip-dp-sgd", input_shape=(6,), reproducible_noise=True,
                               seed=0, verbose=False)


def _scale(how):
    def apply(loss):
        if how == "forward-hook":
            loss.register_forward_hook(lambda m, i, o: 1000.0 * o)
        elif how == "pre-hook":
            loss.register_forward_pre_hook(lambda m, a: (1000.0 * a[0],) + tuple(a[1:]))
        else:
            real = loss.forward
            loss.forward = lambda *a, **k: 1000.0 * real(*a, **k)
    return apply


@pytest.mark.parametrize("how", ["forward-hook", "pre-hook", "instance-forward"])
def test_a_hooked_lipschitz_loss_is_refused(how):
    dp = _private()
    _scale(how)(dp.loss_fn)
    x, y = next(iter(dp.loader))
    with pytest.raises(UnsupportedLayerError, match="loss_fn"):
        dp.backward(x, y)


def test_the_plain_lipschitz_loss_still_trains():
    dp = _private()
    x, y = next(iter(dp.loader))
    dp.backward(x, y)
    assert all(p.grad is not None for p in dp.model.parameters() if p.requires_grad)
