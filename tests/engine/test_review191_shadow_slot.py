"""Hostile review 191: the memory watch kept one copy per storage address, sized by the first
storage added there. A small buffer over the first element of a NumPy array and a buffer over the
whole array (saved by ``mul``) share one address: the copy covered 8 bytes, and a write past them
with torch functions and dispatch modes off, through a third alias of the array at an offset,
reached the saved buffer's bytes unseen (a value chosen by the whole batch: 16.5 C under ghost).
A larger storage at a watched address now has what was watched compared, then the whole larger
range copied as the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from tests.engine.helpers import TRACED_ENGINES, assert_refused_or_bounded
from tests.engine.test_compiled_chains import Text, _ce, _text

_ALIAS: list = []


class Shadowed(nn.Module):
    def __init__(self, d, shadow=True):
        super().__init__()
        arr = np.ones(d + 1, dtype=np.float64)
        if shadow:  # (the first storage at the array's address: 8 bytes)
            self.register_buffer("a_small", torch.from_numpy(arr[:1]))
        self.register_buffer("w", torch.from_numpy(arr))  # (the same address, the whole array)
        _ALIAS[:] = [torch.from_numpy(arr[1:])]  # (a global alias at an offset)
        self.l2 = nn.Linear(d, d)

    def forward(self, h):
        out = self.l2(h) * self.w[1:]  # (mul saves w[1:])
        if not isinstance(h, torch._subclasses.FakeTensor):
            with torch._C.DisableTorchFunction(), _disable_current_modes(), torch.no_grad():
                s = 1000.0 if int((h[:, 0, 0] > 0).sum()) % 2 else -1000.0
                _ALIAS[0].fill_(s)
        return out


@pytest.mark.parametrize("shadow", [True, False])
@pytest.mark.parametrize("engine", TRACED_ENGINES)
def test_an_unseen_write_past_a_smaller_storage_at_the_same_address_is_refused(shadow, engine):
    x, y = _text(b=16)
    assert_refused_or_bounded(engine, lambda: Text(lambda d: Shadowed(d, shadow)), x, y, 0.01,
                              _ce, refusal=("by no operation the trace sees",))
