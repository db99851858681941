"""Hundred-and-first hostile review (of the unit guard, ``dpclip.engine.unit_guard``): a unit's
value written into memory that something outside torch also holds, read back by the next unit or
a later call: a NumPy view or a ``torch.frombuffer`` / ``from_numpy`` over a global buffer, an
``out=`` tensor made before the unit, a raw pointer or storage taken from a fresh tensor before the
write. Each carried the sign of one unit's example to the next: **4.0 C** against the declared
2 C through ``unit_sum`` and ``make_private(unit="gbc")``, 2.0 C into BC calls that did not draw
the example (should be 0). Every write went through the dispatcher: the destination was untagged
(made outside the unit) and only tagged after the write, and its memory outlived the tag.

Now a unit may write its values only into its own memory (tensors it computed from its examples,
or that the dispatcher made during the unit), and a tensor made during the unit may not leave
the dispatcher (``.numpy()``, ``data_ptr``, ``untyped_storage``) any more than a tagged one."""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest
import torch
from torch import nn

from dpclip.engine import ParamGroups
from dpclip.engine.unit_guard import UnitDataRefused
from dpclip.training.units import unit_sum

C = 1.0


def _wf(n):
    return torch.clamp(C / n, max=1.0)


def _loss(o, y):
    return o.sum(dim=1) + 0 * y


class _NumpyOfFresh:
    def __init__(self):
        self.keep = []

    def get(self):
        return float(self.keep[-1][0]) if self.keep else None

    def put(self, t):
        b = torch.zeros(1)
        n = b.numpy()
        b.copy_(t.reshape(1))
        self.keep.append(n)


class _OutIntoGlobal:
    def __init__(self):
        self.g = [torch.zeros(1) for _ in range(8)]  # (made outside every unit, one per write)
        self.n = [g.numpy() for g in self.g]
        self.i = 0

    def get(self):
        return float(self.n[self.i - 1][0]) if self.i else None

    def put(self, t):
        torch.sign(t.reshape(1), out=self.g[self.i])
        self.i += 1


class _FromNumpySlice:
    def __init__(self):
        self.arr = np.zeros(4, dtype=np.float32)

    def get(self):
        return float(self.arr[0]) or None

    def put(self, t):
        torch.from_numpy(self.arr[0:1]).index_put_((torch.tensor([0]),), t.reshape(1))


class _FromBuffer:
    def __init__(self):
        self.buf = bytearray(4)

    def get(self):
        t = torch.frombuffer(self.buf, dtype=torch.float32)
        return t[0].clone() if t.abs().sum() > 0 else None

    def put(self, t):
        torch.frombuffer(self.buf, dtype=torch.float32).copy_(t.reshape(1))


class _Pointer:
    def __init__(self):
        self.keep = []

    def get(self):
        return ctypes.c_float.from_address(self.keep[-1][1]).value if self.keep else None

    def put(self, t):
        b = torch.zeros(1)
        p = b.data_ptr()
        b.copy_(t.reshape(1))
        self.keep.append((b, p))


class _Storage:
    def __init__(self):
        self.keep = []

    def get(self):
        if not self.keep:
            return None
        return float(np.frombuffer(bytes(self.keep[-1]), dtype=np.float32)[0])

    def put(self, t):
        b = torch.zeros(1)
        st = b.untyped_storage()
        b.copy_(t.reshape(1))
        self.keep.append(st)


CHANNELS = {"numpy-of-fresh": _NumpyOfFresh, "out-into-global": _OutIntoGlobal,
            "from-numpy-slice": _FromNumpySlice, "frombuffer": _FromBuffer,
            "pointer": _Pointer, "storage": _Storage}


def _model(chan):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2, bias=False)

        def forward(self, x):
            s = chan.get()
            out = self.fc(x) * (1.0 if s is None else s)
            chan.put(torch.sign(x[:, 0].sum()).detach())
            return out
    torch.manual_seed(0)
    return M()


def _batches():
    x = torch.tensor([3.0, 1.0, 1.0, 1.0]).repeat(2, 2, 1)  # 2 units of 2
    xp = x.clone()
    xp[0, 0] = -100.0 * x[0, 0]  # one example of unit 0 replaced
    return x, xp, torch.zeros(2, 2)


def _dist(a, b):
    return math.sqrt(sum(float(((a.grads[n].double() - b.grads[n].double()) ** 2).sum())
                         for n in a.grads))


@pytest.mark.parametrize("channel", list(CHANNELS))
def test_gbc_a_unit_cannot_write_into_shared_memory(channel):
    x, xp, y = _batches()
    got = []
    try:
        for xx in (x, xp):
            m = _model(CHANNELS[channel]())
            got.append(unit_sum(m, _loss, xx, y, _wf, ParamGroups.flat(m)))
    except UnitDataRefused as exc:
        assert "unit clipping" in str(exc)
        return
    assert _dist(*got) <= 2 * C * (1 + 1e-6)  # (4.0 C before)


@pytest.mark.parametrize("channel", list(CHANNELS))
def test_bc_a_call_without_the_example_does_not_see_it(channel):
    x, xp, y = _batches()
    got = []
    try:
        for first in (x, xp):
            m = _model(CHANNELS[channel]())
            unit_sum(m, _loss, first[:1].reshape(1, 2, 4), y[:1], _wf, ParamGroups.flat(m))
            got.append(unit_sum(m, _loss, x[1:].reshape(1, 2, 4), y[1:], _wf,
                                ParamGroups.flat(m)))
    except UnitDataRefused as exc:
        assert "unit clipping" in str(exc)
        return
    assert _dist(*got) <= 1e-6  # (2.0 C before)


def test_a_forward_may_still_build_and_fill_its_own_tensors():
    """Writing the unit's values into a tensor the forward makes (zeros, then a slice filled, an
    out= into an empty one) is the unit's own memory: accepted, and equal to the plain forward."""

    class Pad(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 2)

        def forward(self, x):
            buf = torch.zeros(x.shape[0], 6)
            buf[:, :4] = x
            tmp = torch.empty(x.shape[0], 2)
            torch.tanh(x[:, :2], out=tmp)
            buf[:, 4:].copy_(tmp)
            return self.fc(buf)

    torch.manual_seed(0)
    m = Pad()
    x = torch.randn(2, 3, 4)
    y = torch.zeros(2, 3)
    got = unit_sum(m, _loss, x, y, _wf, ParamGroups.flat(m))
    assert all(torch.isfinite(g).all() for g in got.grads.values())
