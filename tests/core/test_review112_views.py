"""Hundred-and-twelfth hostile review: augmentation multiplicity's K-copy view
(``KCopyModel``) shares the model's parameter, buffer and submodule tables but holds the model in a
plain attribute, so the state guard, the isolation check and the proof's key walked the view and
never the model's own ``__dict__``: a forward that kept a tensor (or a Python value read from an
example) on its top-level module carried it into the next call. Under naive 3.89 C (one example
flipping the next ones' sign), under vmap through ``make_private(augment_multiplicity=2)`` 3.91 C
at a step that did not draw the example. Now every walk goes on into the viewed model
(``dpclip.engine.views``)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dpclip.engine import ParamGroups, get_engine
from dpclip.engine.errors import UnsupportedModelError
from dpclip.training.step import private_buffer_guard
from dpclip.training.multiplicity import KCopyModel, k_copy_loss

C, K = 1.0, 2


class _Flip(nn.Module):
    """Keeps the sign of example 0 on its top-level module (a Python float): the next examples'
    outputs are multiplied by it (naive runs them one by one, eagerly)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(6, 3).double()
        self.k = 1.0

    def forward(self, x):
        k = self.k
        out = self.fc(x) * k
        self.k = k * (1.0 if float(x[0, 0]) >= 0 else -1.0)
        return out


class _Keep(nn.Module):
    """Keeps a tensor of its input on its top-level module; the next call multiplies by it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(6, 3).double()
        self.prev = None

    def forward(self, x):
        out = self.fc(x)
        if self.prev is not None:
            out = out * self.prev.min()
        self.prev = torch.sign(x[:, 0]).detach().clone()
        return out


def _loss(o, y):
    return nn.functional.cross_entropy(o, y, reduction="none")


def _release(engine, model_cls, x, y):
    m = model_cls()
    km = KCopyModel(m, K)
    with private_buffer_guard(km):
        r = get_engine(engine).compute(km, k_copy_loss(_loss, K), x, y,
                                       lambda n: torch.clamp(C / n, max=1.0),
                                       ParamGroups.flat(km))
    return torch.cat([g.reshape(-1) for g in r.grads.values()])


@pytest.mark.parametrize("engine", ["naive", "vmap"])
@pytest.mark.parametrize("model_cls", [_Flip, _Keep], ids=["python-value", "tensor"])
def test_state_kept_on_the_viewed_model_is_refused_or_carries_nothing(engine, model_cls):
    torch.manual_seed(1)
    b = 6
    x = torch.rand(b, K, 6, dtype=torch.float64) + 1.0
    x[0] = -x[0]  # example 0 flips the sign the model keeps
    y = torch.randint(0, 3, (b,))
    try:
        full = _release(engine, model_cls, x, y)
        rest = _release(engine, model_cls, x[1:], y[1:])
    except (UnsupportedModelError, RuntimeError) as exc:  # (vmap refuses a Python read itself)
        assert "attribute" in str(exc) or "vmap" in str(exc), exc
        return
    loo = math.sqrt(float(((full - rest) ** 2).sum()))
    assert loo <= C * (1 + 1e-6), loo  # (3.89 C under naive before)


def test_the_walks_reach_the_viewed_model():
    from dpclip.engine.batch_symbol import _modules
    from dpclip.engine.state_guard import _tree

    m = _Keep()
    km = KCopyModel(m, K)
    assert any(mod is m for mod in _modules(km))
    assert any(rec[1] is m for rec in _tree(km)[1])
