"""Hundred-and-seventeenth hostile review: an in-place write through a view whose layout already
read MIXED (``h.view(-1)[H:]``: ``(B - 1) H`` elements) was skipped by the tracer (the layout did
not change), so the storage was never tainted and ``h`` kept its layout ``(0, 1)`` while each row
held other examples' data (row ``i + 1`` <- row ``i``): LOO 2.05 C (3.63 C added eight times,
4.72 C in the loss) under ghost and auto. Now a MIXED write taints the storage whatever the
view's layout.

Hundred-and-eighteenth: compiled autograd (a process-wide C switch,
``torch._C._dynamo.compiled_autograd.set_autograd_compiler``) switched on by a finalizer the
forward set: the next step's backward (a proved graph, no user code) went to the model's
compiler, which returned every row's output gradient with example 0's added 50 times: LOO 14.8 C
under auto, compiled and make_private. Now every engine's backward runs with compiled autograd off
and refuses it where it was on."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn

from dpclip.engine import ParamGroups, get_engine
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import loo_distance

C, D, H = 0.01, 4, 5


def _shift_flat(h):
    v = h.view(-1)[H:]
    v.copy_(h.view(-1)[:-H].clone())  # row i + 1 <- row i
    return h


def _spread(h):
    f = h.view(-1)
    for _ in range(8):
        f[H:].add_(f[:-H].clone())
    return h


class _Net(nn.Module):
    def __init__(self, mix) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(D, H).double()
        self.fc2 = nn.Linear(H, 3).double()
        self.mix = mix

    def forward(self, x):
        return self.fc2(self.mix(self.fc1(x)))


def _loss(o, y):
    return nn.functional.cross_entropy(o, y, reduction="none")


def _shifted_loss(o, y):
    o = o * 1.0
    f = o.view(-1)
    for _ in range(8):
        f[3:].add_(f[:-3].clone())
    return nn.functional.cross_entropy(o, y, reduction="none")


def _data(n=9):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    x[3] *= 30
    return x, torch.randint(0, 3, (n,), generator=g)


@pytest.mark.parametrize("engine", ["ghost", "auto"])
@pytest.mark.parametrize("case", ["shift", "spread", "loss"])
def test_a_write_through_a_mixed_view_taints_the_storage(engine, case):
    x, y = _data()
    mix = {"shift": _shift_flat, "spread": _spread, "loss": lambda h: h}[case]
    loss = _shifted_loss if case == "loss" else _loss
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            d = loo_distance(lambda: get_engine(engine), lambda: _Net(mix), x, y, C, loss=loss,
                             exact=True)
        except UnsupportedModelError as exc:
            assert engine == "ghost" and "mix" in str(exc), exc
            return
    assert d <= 1.0 + 1e-6, d  # (2.05 / 3.63 / 4.72 C before)


def _compiler_on():
    import torch._dynamo.compiled_autograd as ca

    def compiler(gm):
        def run(*args):
            return gm.forward(*args)
        return run

    torch._C._dynamo.compiled_autograd.set_autograd_compiler(
        functools.partial(ca.AutogradCompilerInstance, compiler), False)


def _compiler_off():
    torch._C._dynamo.compiled_autograd.set_autograd_compiler(None, False)


@pytest.mark.parametrize("engine", ["ghost", "auto", "compiled", "vmap", "naive"])
def test_compiled_autograd_switched_on_is_refused(engine):
    x, y = _data()
    model = _Net(lambda h: h)
    eng = get_engine(engine)
    _compiler_on()
    try:
        with pytest.raises(UnsupportedModelError, match="compiled autograd is switched on"):
            eng.compute(model, _loss, x, y, lambda n: torch.clamp(C / n, max=1.0),
                        ParamGroups.flat(model))
    finally:
        _compiler_off()
    # and off again, the engine runs
    eng.compute(model, _loss, x, y, lambda n: torch.clamp(C / n, max=1.0),
                ParamGroups.flat(model))
