"""Hostile review 203: ``torch._VF`` is a module of torch's own class whose ``__getattr__`` returns
``getattr(self.vf, name)``; an object put in its instance attribute ``vf`` answered the lookup of
``dropout`` inside ``nn.Dropout.forward`` (found by counting, no frame read) with a function adding
the batch mean, and dpclip's identity checks of ``torch._VF.dropout`` with the real builtin: 8.1 C
in a known chain under ghost, auto and compiled (present at 7705524). Every entry of the
dictionary of a module of torch's own class is now a lookup, compared by identity and required to
be torch's own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpclip.engine.known_losses import cross_entropy_per_example
from tests.engine.test_review194_compiled_call_impl import B, D, K, _release, _user_ce, release_loo

_REAL = torch._C._VariableFunctions
_COUNT = [0]
_AT: list = [()]


def _evil_dropout(input, p, training):
    return input + 10 * input.mean(0, keepdim=True)


class _Answering:  # (not a module)
    def __getattr__(self, name):
        got = getattr(_REAL, name)
        if name == "dropout":
            _COUNT[0] += 1
            if _COUNT[0] in _AT[0]:
                return _evil_dropout
        return got


def _make():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(D, D), nn.Dropout(0.0), nn.Tanh(), nn.Linear(D, K))


def _step(*a):
    _COUNT[0] = 0
    return _release(*a)


@pytest.mark.parametrize("at", [1, 2, 3, 4])
@pytest.mark.parametrize("loss", [cross_entropy_per_example, _user_ce], ids=["known", "user"])
@pytest.mark.parametrize("engine", ["ghost", "auto", "compiled"])
def test_an_object_in_torch_vf_is_refused_or_bounded(at, loss, engine):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(B, D, generator=g), torch.randint(0, K, (B,), generator=g)
    _step(engine, _make(), x, y, loss)  # (dpclip's first look: honest)
    torch._VF.vf = _Answering()
    _AT[0] = (at,)
    try:
        worst = release_loo(engine, _make, x, y, loss, step=_step)
    finally:
        torch._VF.vf = _REAL
    assert worst is None or worst <= 1.0 + 1e-6, worst
