"""Hundred-and-thirty-sixth hostile review: the separability rules take torch's recurrent time
steps (``recurrent._lstm``) as a whole, and that code calls the builtin ``zip``; a forward that
replaced ``builtins.zip`` in an eager call BEFORE the first step (a ``zip`` subclass rewriting an
LSTM's final states as their batch sum) had every step's snapshot hold the fake, and the
time-step rule gave each example the other examples' gradients: 5.37 C under ghost and auto,
7.99 C through make_private. Now a builtin the trusted code looks up must be Python's own."""

from __future__ import annotations

import builtins

import pytest
import torch
from torch import nn

from dpclip.engine import get_engine
from dpclip.engine.errors import UnsupportedModelError
from dpclip.engine.library_code import _python_builtin
from tests.engine.helpers import loo_distance

_ZIP = builtins.zip


class _Zip(_ZIP):
    def __new__(cls, *args, **kwargs):
        if len(args) == 1 and isinstance(args[0], tuple) and len(args[0]) == 2 and all(
                isinstance(t, torch.Tensor) and t.ndim == 2 for t in args[0]):
            args = (tuple(t + t.sum(0, keepdim=True) for t in args[0]),)
        return _ZIP.__new__(cls, *args, **kwargs)


class _Lstm(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.r = nn.LSTM(3, 4, batch_first=True).double()
        self.head = nn.Linear(4, 2).double()

    def forward(self, x):
        _, (h, _) = self.r(x)
        return self.head(h[-1])


def _ce(o, y):
    return nn.functional.cross_entropy(o, y, reduction="none")


@pytest.mark.parametrize("name", ["ghost", "auto"])
def test_a_builtin_replaced_before_the_step_is_refused_or_bounded(name):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 5, 3, generator=g, dtype=torch.float64)
    y = torch.randint(0, 2, (8,), generator=g)
    builtins.zip = _Zip
    try:
        d = loo_distance(lambda: get_engine(name), _Lstm, x, y, 1.0, loss=_ce)
    except UnsupportedModelError:
        return  # refused: sound
    finally:
        builtins.zip = _ZIP
    assert d <= 1 + 1e-9, f"{name}: LOO {d:.3f} C"


def test_python_s_own_builtins_pass_and_a_subclass_does_not():
    assert all(_python_builtin(n, o) for n, o in vars(builtins).items())
    assert not _python_builtin("zip", _Zip)
    assert not _python_builtin("len", lambda x: 0)
