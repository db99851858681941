"""Hostile review 195: a data descriptor (a property) on a torch layer CLASS under a name the
instance holds outranks the instance's dictionary. ``nn.Linear._forward_hooks`` (and the other
hook tables) made properties handed ``nn.Module._call_impl`` a hook adding the batch mean while
dpclip's checks read empty tables: 11.4 C (nn.Linear) and 8.6 C (nn.Tanh) in a known chain under
ghost, auto and compiled. ``_call_impl`` reads ``self`` from a cell (a nested function captures
it): the scan of torch's code took only ``LOAD_FAST self`` for the module, so none of those reads
was compared. And ``nn.Linear.weight`` made a property after the first step (a name the class did
not have, found through ``__getattr__``) handed ``F.linear`` a tensor subclass: 11.4 C. The call
path is now scanned against each layer class with ``self`` in a cell too, and a name found on the
instance is recorded as absent from the class, compared at every step."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from dpclip.engine.known_losses import cross_entropy_per_example
from tests.engine.test_review194_compiled_call_impl import (B, D, K, _make, _release,
                                                             _user_ce, release_loo)

_NAMES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_LAST: dict = {}
_ARMED: set = set()


def _hook(mod, args, out):
    _ARMED.discard(id(mod))
    return out + 10 * out.mean(0, keepdim=True)


_EVIL = collections.OrderedDict({987654: _hook})


def _prop(name):
    """The table for dpclip's checks (which read _forward_hooks first); the hook for
    _call_impl's fast-path test (which reads _backward_hooks, _backward_pre_hooks, then
    _forward_hooks)."""
    def get(self):
        last = _LAST.setdefault(id(self), [])
        if name == "_forward_hooks" and (id(self) in _ARMED or
                                         last[-2:] == ["_backward_hooks", "_backward_pre_hooks"]):
            _ARMED.add(id(self))
            got = _EVIL
        else:
            got = self.__dict__[name]
        last.append(name)
        del last[:-2]
        return got

    def put(self, v):
        self.__dict__[name] = v
    return property(get, put)


def _loo(engine, x, y, loss):
    return release_loo(engine, _make, x, y, loss)


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, D, generator=g), torch.randint(0, K, (B,), generator=g)


@pytest.mark.parametrize("cls", [nn.Linear, nn.Tanh])
@pytest.mark.parametrize("loss", [cross_entropy_per_example, _user_ce], ids=["known", "user"])
@pytest.mark.parametrize("engine", ["ghost", "auto", "compiled"])
def test_class_level_hook_table_properties_are_refused_or_bounded(cls, loss, engine):
    x, y = _batch()
    for n in _NAMES:
        setattr(cls, n, _prop(n))
    _LAST.clear()
    _ARMED.clear()
    try:
        worst = _loo(engine, x, y, loss)
    finally:
        for n in _NAMES:
            delattr(cls, n)
    assert worst is None or worst <= 1.0 + 1e-6, worst


class _Shifted(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*[a.as_subclass(torch.Tensor) if isinstance(a, _Shifted) else a
                         for a in args], **kwargs)
        if func is nn.functional.linear:
            out = out + 10 * out.mean(0, keepdim=True)
        return out


def _weight(self):
    p = self.__dict__.get("_parameters", {}).get("weight")
    if p is None:  # (during construction: Module.__setattr__ registers the parameter)
        raise AttributeError("weight")
    return p.as_subclass(_Shifted)


@pytest.mark.parametrize("engine", ["ghost", "auto", "compiled"])
def test_a_weight_property_added_to_the_class_after_the_first_step_is_refused_or_bounded(engine):
    x, y = _batch()
    _release(engine, _make(), x, y, cross_entropy_per_example)  # (dpclip's first look)
    nn.Linear.weight = property(_weight)
    try:
        worst = _loo(engine, x, y, cross_entropy_per_example)
    finally:
        del nn.Linear.weight
    assert worst is None or worst <= 1.0 + 1e-6, worst
