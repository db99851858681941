"""Hostile review 201: a torch module's ``__class__`` assigned a ``types.ModuleType`` subclass whose
``__getattribute__`` answers each lookup as it likes: ``torch.nn.functional``'s handed the
forwards' lookups of ``linear`` (the 3rd and 4th of a ghost step; counted, no frame read) a
function adding the batch mean, and dpclip's own reads the real one: 11.4 C in a known chain under
ghost, auto and compiled (present at 7705524). The library scan now records the class of every
module it meets and requires Python's module type (or a class of torch's own); a class changed
later is seen before any name is compared."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from dpclip.engine import library_code
from dpclip.engine.errors import UnsupportedModelError
from dpclip.engine.known_losses import cross_entropy_per_example
from tests.engine.test_review194_compiled_call_impl import (B, D, K, _make, _release, _user_ce,
                                                             release_loo)

_ORIGINAL = F.linear
_COUNT = [0]
_AT: list = [()]


def _evil_linear(input, weight, bias=None):
    out = _ORIGINAL(input, weight, bias)
    return out + 10 * out.mean(0, keepdim=True)


class _Counting(types.ModuleType):
    def __getattribute__(self, name):
        if name == "linear":
            _COUNT[0] += 1
            if _COUNT[0] in _AT[0]:
                return _evil_linear
        return types.ModuleType.__getattribute__(self, name)


def _step(*a):
    _COUNT[0] = 0
    return _release(*a)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, D, generator=g), torch.randint(0, K, (B,), generator=g)


def _forget():
    library_code._BY_CLASS.clear()
    library_code._CALL = None


@pytest.mark.parametrize("at", [(3, 4), (3, 4, 7, 8), ()], ids=["ghost-positions",
                                                                 "auto-positions", "honest"])
@pytest.mark.parametrize("loss", [cross_entropy_per_example, _user_ce], ids=["known", "user"])
@pytest.mark.parametrize("engine", ["ghost", "auto", "compiled"])
def test_a_module_of_another_class_is_refused_or_bounded(at, loss, engine):
    x, y = _batch()
    _forget()
    _release(engine, _make(), *_batch(1), loss)  # (dpclip's first look)
    _AT[0] = at
    F.__class__ = _Counting
    try:
        worst = release_loo(engine, _make, x, y, loss, step=_step)
    finally:
        F.__class__ = types.ModuleType
        _forget()
    assert worst is None or worst <= 1.0 + 1e-6, worst


def test_a_module_of_another_class_is_refused_by_ghost_even_when_it_answers_honestly():
    x, y = _batch()
    _forget()
    _AT[0] = ()
    F.__class__ = _Counting
    try:
        with pytest.raises(UnsupportedModelError, match="not Python's module type"):
            _step("ghost", _make(), x, y, cross_entropy_per_example)
    finally:
        F.__class__ = types.ModuleType
        _forget()
