"""Eighty-ninth hostile review: names the engine looks up at run time outside torch's namespace.
A forward rebound ``builtins.min`` (never put back) with a wrapper that, for the engine's
``min(i + 64, batch)``, returned ``batch``: ``ghost_rules._bk_blocks`` then cut the book-keeping
product of a Linear on positions into overlapping blocks, every example from row 64 on summed two
to four times with its weight computed once: LOO 3.72 C under ghost, auto and compiled (B 200
against 199, steps 0-2). ``dpclip.engine.torch_names`` now watches the builtins module's whole
dictionary and the attributes of other libraries' modules that dpclip's code looks up
(``math.isfinite``, ``numpy.errstate``, ``gc.isenabled``, ``sys.gettrace``). (Adapted from the
review's script.)"""

from __future__ import annotations

import builtins
import math

import pytest
import torch
from torch import nn

from dpclip.engine import ParamGroups, get_engine
from dpclip.engine.errors import UnsupportedModelError

_MIN = builtins.min
_ISFINITE = math.isfinite


def _evil_min(*a, **k):
    if len(a) == 2 and not k and type(a[0]) is int and type(a[1]) is int \
            and a[0] % 64 == 0 and a[1] % 32 == 0 and 64 <= a[0] < a[1]:
        return a[1]  # slice(i, batch): overlapping blocks
    return _MIN(*a, **k)


def _lying_isfinite(v):
    return True if v != v else _ISFINITE(v)


class Rebinds(nn.Module):
    def __init__(self, what: str) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.what = what

    def forward(self, x):
        if self.what == "min":
            builtins.min = _evil_min  # from inside the step, never put back
        elif self.what == "isfinite":
            math.isfinite = _lying_isfinite
        return self.fc(x).sum(1)  # a Linear on positions (B, T, 8) -> (B, 4)


def _loss(out, y):
    return ((out - y) ** 2).sum(1)


@pytest.fixture
def restored():
    yield
    builtins.min = _MIN
    math.isfinite = _ISFINITE


def _loo(engine: str, what: str) -> float:
    torch.manual_seed(0)
    model = Rebinds(what)
    x, y = torch.randn(200, 6, 8) * 3, torch.randn(200, 4)
    keep = torch.arange(199)
    eng = get_engine(engine)
    groups = ParamGroups.flat(model)
    wf = lambda n: torch.clamp(1.0 / n, max=1.0)  # noqa: E731
    out = 0.0
    for _ in range(2):
        full = eng.compute(model, _loss, x, y, wf, groups)
        rest = eng.compute(model, _loss, x[keep], y[keep], wf, groups)
        out = max(out, math.sqrt(sum(((full.grads[n].double() - rest.grads[n].double()) ** 2)
                                     .sum().item() for n in full.grads)))
    return out


@pytest.mark.parametrize("engine", ["ghost", "auto", "compiled"])
@pytest.mark.parametrize("what", ["min", "isfinite"])
def test_a_builtin_or_math_function_rebound_from_the_forward_is_refused_and_put_back(
        restored, engine, what):
    with pytest.raises(UnsupportedModelError, match="builtins.min|math.isfinite"):
        _loo(engine, what)  # (3.72 C with min before)
    assert builtins.min is _MIN and math.isfinite is _ISFINITE  # put back


def test_a_replacement_made_before_the_step_is_allowed(restored):
    def same_min(*a, **k):
        return _MIN(*a, **k)

    builtins.min = same_min  # (a library patching a builtin at import)
    assert _loo("ghost", "none") <= 1.0 + 1e-4
    assert builtins.min is same_min
