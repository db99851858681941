"""Eighty-third hostile review: a class's attribute lookup replaced (``nn.Linear.__getattribute__``,
``nn.Tanh.__getattribute__`` or ``nn.Module.__getattribute__`` itself) by one that hands
``Module._call_impl`` a ``forward`` wrapped in code adding row 0 to every row of the output.

``library_code`` compared the attributes a module call goes through (``__call__``, ``_call_impl``,
``_wrapped_call_impl``, ``forward``) but not the lookup itself: in a chain of known modules the
wrapped forward ran untraced, and on the traced path the mixing ran between a ruled layer's
computation and the hook that records it. Measured on 609df96 (float32, B 6, C 1): LOO 2.81 C
(Tanh patched after two clean steps, ghost, known loss), 2.55 C (Linear), 2.5467 C (a custom
module, patched before the first step, ghost and auto). ``__getattr__`` (parameters and
submodules) is compared the same way now: a replacement handing ``F.linear`` a weight of a tensor
subclass that mixes the batch is the same attack through the other door."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpclip.engine import AutoEngine, GhostEngine
from dpclip.engine.errors import UnsupportedModelError
from dpclip.engine.known_losses import cross_entropy_per_example
from tests.engine.helpers import DT
from tests.engine.test_separability_attacks import data, loo_distance

_GETATTRIBUTE = object.__getattribute__
_GETATTR = nn.Module.__getattr__


def _wrapping_getattribute(target: type):
    def evil(self, name):
        got = _GETATTRIBUTE(self, name)
        if name == "forward" and isinstance(self, target):
            def mixed(*args, **kwargs):
                out = got(*args, **kwargs)
                return out + 20 * out[:1]
            return mixed
        return got
    return evil


class _Mixing(torch.Tensor):
    """A weight whose ``F.linear`` adds row 0 of the result to every row."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if func is F.linear and isinstance(out, torch.Tensor):
            out = out.as_subclass(torch.Tensor)
            return out + 20 * out[:1]
        return out


def _mixing_getattr(self, name):
    got = _GETATTR(self, name)
    if name == "weight" and isinstance(self, nn.Linear):
        return got.as_subclass(_Mixing)
    return got


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    m = Custom() if kind == "custom" else nn.Sequential(nn.Linear(5, 6), nn.Tanh(),
                                                        nn.Linear(6, 3))
    return m.to(DT)


PATCHES = {
    "Linear.__getattribute__": (nn.Linear, "__getattribute__",
                                _wrapping_getattribute(nn.Linear)),
    "Tanh.__getattribute__": (nn.Tanh, "__getattribute__", _wrapping_getattribute(nn.Tanh)),
    "Module.__getattribute__": (nn.Module, "__getattribute__",
                                _wrapping_getattribute(nn.Linear)),
    "Module.__getattr__": (nn.Module, "__getattr__", _mixing_getattr),
}


@pytest.mark.parametrize("patched_at", [0, 1], ids=["before-step-0", "after-step-0"])
@pytest.mark.parametrize("kind", ["sequential", "custom"])
@pytest.mark.parametrize("patch", list(PATCHES))
@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
def test_a_replaced_attribute_lookup_never_exceeds_c(engine, patch, kind, patched_at):
    cls, name, fn = PATCHES[patch]
    had = name in cls.__dict__
    was = cls.__dict__.get(name)
    eng = engine()
    model = _model(kind)
    got = []
    try:
        for step in range(2):
            if step == patched_at:
                setattr(cls, name, fn)
            x, y = data(seed=step)
            try:
                got.append(loo_distance(eng, model, cross_entropy_per_example, x, y))
            except UnsupportedModelError:
                got.append(None)
    finally:
        if had:
            setattr(cls, name, was)
        else:
            delattr(cls, name)
    assert all(g is None or g <= 1 + 1e-9 for g in got), got
