"""Fifth hostile review: the SSE rounding mode (MXCSR) alone is a channel from one call to the next.

``dpclip.engine.isolation`` reads the rounding mode with the C library's ``fegetround()``; on
x86-64 glibc that reads the x87 control word only. ``fesetenv`` with an environment whose x87
control word says "to nearest" and whose MXCSR says "upward" changes the rounding of every SSE/AVX
operation (all of torch's CPU kernels and Python floats) while ``fegetround()`` still returns
FE_TONEAREST: the isolation sees no change, puts nothing back, and the next call's arithmetic
depends on the previous call's example. On 524171e the next call moved by 3.24 C under ghost, auto
and vmap (sound: 0). Now the isolation compares both control words (``fegetenv``) and puts the
whole environment back.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from dpclip.engine import AutoEngine, GhostEngine, VmapEngine
from dpclip.engine.errors import UnsupportedModelError
from dpclip.training.step import PrivateBufferError
from tests.engine.helpers import DT
from tests.engine.test_separability_attacks import C, ce, clipped_sum, data

_LIBM = ctypes.CDLL(ctypes.util.find_library("m"))


class _Fenv(ctypes.Structure):  # glibc x86-64 fenv_t
    _fields_ = [("cw", ctypes.c_ushort), ("u1", ctypes.c_ushort), ("sw", ctypes.c_ushort),
                ("u2", ctypes.c_ushort), ("tags", ctypes.c_ushort), ("u3", ctypes.c_ushort),
                ("eip", ctypes.c_uint), ("cs", ctypes.c_ushort), ("op", ctypes.c_ushort),
                ("dp", ctypes.c_uint), ("ds", ctypes.c_ushort), ("u5", ctypes.c_ushort),
                ("mxcsr", ctypes.c_uint)]


def _set_sse_rounding(bits: int) -> None:
    """MXCSR rounding control only (0: nearest, 2: upward); the x87 word is left as it is."""
    env = _Fenv()
    _LIBM.fegetenv(ctypes.byref(env))
    env.mxcsr = (env.mxcsr & ~0x6000) | (bits << 13)
    _LIBM.fesetenv(ctypes.byref(env))


def _first(x: Tensor) -> float:
    while torch._C._functorch.is_functorch_wrapped_tensor(x):
        x = torch._C._functorch.get_unwrapped(x)
    return float(x.reshape(x.shape[0], -1)[0].sum())


class _SseRounds(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        h = h + 3 * (((torch.ones_like(h) + 1e-17) - 1.0) * 1e16)  # 0, or 6.66 rounding upward
        out = self.fc2(torch.tanh(h))
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            if not is_fake(x) and _first(x) > 100:  # a marked example
                _set_sse_rounding(2)
        return out


def test_the_premise_fegetround_does_not_see_it():
    try:
        _set_sse_rounding(2)
        assert _LIBM.fegetround() == 0
        t = torch.ones(3, dtype=DT)
        assert float((((t + 1e-17) - 1.0) * 1e16)[0]) > 2
    finally:
        _set_sse_rounding(0)


def _moved(engine, kw) -> float:
    """How far call 2 (examples 2..7) moves when call 1 carries a marked example or not."""
    torch.manual_seed(0)
    model = _SseRounds().to(DT)
    x, y = data()
    got = []
    try:
        for mark in (False, True):
            x1 = x[:2].clone()
            if mark:
                x1[0] = 30.0
            try:
                clipped_sum(engine(**kw), model, ce, x1, y[:2])
            except (UnsupportedModelError, PrivateBufferError):
                pass  # a refusal that does not put the setting back still carries it
            got.append(clipped_sum(engine(**kw), model, ce, x[2:], y[2:])[0])
    finally:
        _set_sse_rounding(0)
    return float((got[0] - got[1]).norm()) / C


@pytest.mark.parametrize("kw", [{}, {"max_physical_batch": 1}], ids=["batch", "chunks-of-one"])
@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine, VmapEngine],
                         ids=["ghost", "auto", "vmap"])
def test_a_call_cannot_leave_the_sse_rounding_mode_for_the_next(engine, kw):
    moved = _moved(engine, kw)
    print(f"moved {moved:.3f} C")
    assert moved <= 1e-12, moved
