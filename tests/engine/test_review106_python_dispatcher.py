"""Hundred-and-sixth hostile review: a forward that switched torch's Python dispatcher on for one
operation (and off again before returning), with a Python kernel in that operator's own
``py_kernels`` (no torch.library entry): the engines' call of the operation went back into Python
below every mode, and the kernel gave every row example 0's values: LOO 12.4 C under ghost, auto
and vmap (5.95 times the bound through make_private), from a later step on.

Now the engines run each operation with the Python dispatcher off, and an operation that a
forward runs with it on is refused (the tracer and vmap's function mode)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch._C import DispatchKey
from torch._dispatch.python import enable_python_dispatcher

from dpclip.engine import ParamGroups, get_engine
from dpclip.engine.errors import UnsupportedModelError

C = 1.0
_RELU = torch.ops.aten.relu.default
_CALLS = [0]


def _row0(x):
    return x[:1].expand_as(x).clone()  # every row is example 0's


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        _CALLS[0] += 1
        h = self.fc1(x)
        if _CALLS[0] > 4:
            _RELU.py_kernels[DispatchKey.CPU] = _row0
            _RELU._dispatch_cache.clear()
            try:
                with enable_python_dispatcher():
                    h = torch.relu(h)
            finally:
                _RELU.py_kernels.pop(DispatchKey.CPU, None)
                _RELU._dispatch_cache.clear()
        else:
            h = torch.relu(h)
        return self.fc2(torch.tanh(h))


def _loss(o, y):
    return ((o - y) ** 2).sum(1)


@pytest.mark.parametrize("engine", ["ghost", "auto-traced", "vmap"])
def test_a_python_kernel_switched_on_by_the_forward_never_runs_in_the_engine(engine):
    _CALLS[0] = 0
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(8, 6)
    x[0] = -x[1] * 5 * 30
    y = 10 * torch.ones(8, 3)
    eng = get_engine("auto", compiled=False) if engine == "auto-traced" else get_engine(engine)
    groups = ParamGroups.flat(model)

    def weights(n):
        return torch.clamp(C / n, max=1.0)

    for _ in range(5):
        try:
            full = eng.compute(model, _loss, x, y, weights, groups)
            rest = eng.compute(model, _loss, x[1:], y[1:], weights, groups)
        except UnsupportedModelError as exc:
            assert "Python dispatcher" in str(exc)
            continue
        loo = math.sqrt(sum(float(((full.grads[n].double() - rest.grads[n].double()) ** 2)
                                  .sum()) for n in full.grads))
        assert loo <= C * (1 + 1e-5), loo
    assert DispatchKey.CPU not in _RELU.py_kernels
