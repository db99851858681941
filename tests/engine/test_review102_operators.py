"""Hundred-and-second hostile review: the state of torch's operator objects, which is no
dictionary entry the names' watch compares. A forward that set ``torch.ops.aten.relu.default._op``
(an attribute of the overload object) to a wrapper mixing the batch from its eleventh call: the
engines' dispatch modes and the compiled graph called operators through that attribute (``func(
*args)``, ``n.target._op``), so the proof's trace ran the honest function and later steps the
mixing one: LOO 7.98 C under ghost, 8.68 C under auto and compiled (5.6 times the bound through
make_private); ``torch._ops.OpOverload.__call__`` replaced on the class, 10.93 C under ghost.

Now every engine calls an operator through torch's compiled entry made anew from the name of the
schema it analysed (``separable.call_op``, ``_Meta.op``), and the operator classes are watched
whole."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dpclip.engine import ParamGroups, get_engine
from dpclip.engine.errors import UnsupportedModelError

C = 1.0
_OV = torch.ops.aten.relu.default


#: the plant, made at the forward's first call (a global: the model's own attributes are
#: guarded)
_PLANT: list = [None]


class _Net(nn.Module):
    def __init__(self, plant) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)
        _PLANT[0] = plant

    def forward(self, x):
        if _PLANT[0] is not None:
            plant, _PLANT[0] = _PLANT[0], None
            plant()
        return self.fc2(torch.relu(self.fc1(x)))


def _loss(o, y):
    return ((o - y) ** 2).sum(1)


def _mixing(real, calls, arm=10):
    def fn(*args, **kwargs):
        calls[0] += 1
        out = real(*args, **kwargs)
        if calls[0] > arm and isinstance(out, torch.Tensor) and out.dim() == 2:
            out = out + 5.0 * out.sum(0, keepdim=True)
        return out
    return fn


def _plant_op(calls):
    real = _OV._op

    def plant():
        _OV._op = _mixing(real, calls)
    return plant, lambda: setattr(_OV, "_op", real)


def _plant_call(calls):
    cls = torch._ops.OpOverload
    real = cls.__dict__["__call__"]

    def call(self, *args, **kwargs):
        if self is _OV:
            return _mixing(lambda *a, **k: real(self, *a, **k), calls)(*args, **kwargs)
        return real(self, *args, **kwargs)

    def plant():
        cls.__call__ = call
    return plant, lambda: setattr(cls, "__call__", real)


PLANTS = {"op-attribute": _plant_op, "OpOverload.__call__": _plant_call}


@pytest.mark.parametrize("plant", list(PLANTS))
@pytest.mark.parametrize("engine", ["ghost", "auto", "compiled"])
def test_an_operator_s_own_state_does_not_reach_the_step(engine, plant):
    calls = [0]
    arm, restore = PLANTS[plant](calls)
    torch.manual_seed(0)
    model = _Net(arm)
    x, y = torch.randn(8, 6), 10 * torch.randn(8, 3)
    eng = get_engine(engine)
    groups = ParamGroups.flat(model)

    def weights(n):
        return torch.clamp(C / n, max=1.0)

    try:
        for _ in range(5):
            try:
                full = eng.compute(model, _loss, x, y, weights, groups)
                rest = eng.compute(model, _loss, x[1:], y[1:], weights, groups)
            except UnsupportedModelError:
                continue
            loo = math.sqrt(sum(float(((full.grads[n].double() - rest.grads[n].double()) ** 2)
                                      .sum()) for n in full.grads))
            assert loo <= C * (1 + 1e-5), loo
    finally:
        _PLANT[0] = None
        restore()


def test_the_operator_run_is_the_one_analysed():
    from dpclip.engine.separable import _meta, call_op

    x = torch.randn(5)
    real = _OV._op
    try:
        _OV._op = torch.ops.aten.neg.default._op  # (another compiled function)
        assert torch.equal(call_op(_OV, (x,), {}), x.clamp(min=0))  # (relu, not neg)
        assert _meta(_OV).op is not _OV._op
    finally:
        _OV._op = real
