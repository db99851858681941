"""Hostile review 193: the memory watch skipped a tensor on a storage of no bytes before recording
where it lives, so a buffer ``torch.zeros(0)`` resized with dispatch off in the forward, filled
with a value chosen by the whole batch (or with the batch's hidden states), used, and set back to
an empty storage before the loss returned, read memory nobody copied: 12.0 C under ghost and
auto's traced pass; the hidden states of the private batch left in a released buffer under ghost.
Every watched tensor now has its storage address and geometry recorded, empty or not."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from dpclip.engine import ParamGroups, get_engine
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import TRACED_ENGINES, assert_refused_or_bounded, clip_weights
from tests.engine.test_compiled_chains import Text, _ce, _text

_UNSEEN = "by no operation the trace sees"


def _unseen():
    return torch._C.DisableTorchFunction(), _disable_current_modes(), torch.no_grad()


class Grown(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.register_buffer("z", torch.zeros(0, dtype=torch.float64))
        self.l2 = nn.Linear(d, d)

    def forward(self, h):
        out = self.l2(h)
        real = not isinstance(h, torch._subclasses.FakeTensor)
        if real:
            a, b, c = _unseen()
            with a, b, c:
                v = self.z._version
                s = 1000.0 if int((h[:, 0, 0] > 0).sum()) % 2 else -1000.0
                self.z.resize_(1)
                self.z.fill_(s)
                torch._C._autograd._unsafe_set_version_counter((self.z,), (v,))
        out = out * (1 + self.z.sum())
        if real:
            a, b, c = _unseen()
            with a, b, c:
                v = self.z._version
                self.z.set_()  # (back on an empty storage)
                torch._C._autograd._unsafe_set_version_counter((self.z,), (v,))
        return out


class Filled(nn.Module):
    def __init__(self, d):
        super().__init__()
        for i in range(4):  # (one per pass an engine runs)
            self.register_buffer(f"z{i}", torch.zeros(0, dtype=torch.float64))
        self.l2 = nn.Linear(d, d)

    def forward(self, h):
        if not isinstance(h, torch._subclasses.FakeTensor):
            a, b, c = _unseen()
            with a, b, c:
                z = next(getattr(self, f"z{i}") for i in range(4)
                         if getattr(self, f"z{i}").numel() == 0)
                v = z._version
                z.resize_(h.numel())
                z.copy_(h.reshape(-1))
                torch._C._autograd._unsafe_set_version_counter((z,), (v,))
        return self.l2(h)


@pytest.mark.parametrize("engine", TRACED_ENGINES)
def test_an_empty_buffer_grown_and_used_unseen_is_refused_or_bounded(engine):
    x, y = _text(b=16)
    assert_refused_or_bounded(engine, lambda: Text(Grown), x, y, 0.01, _ce, refusal=(_UNSEEN,))


@pytest.mark.parametrize("engine", ["ghost", "auto"])
def test_an_empty_buffer_filled_with_the_batch_unseen_is_refused(engine):
    x, y = _text(b=16)
    model = Text(Filled)
    with pytest.raises(UnsupportedModelError, match=_UNSEEN):
        get_engine(engine).compute(model, _ce, x, y, clip_weights(0.01), ParamGroups.flat(model))
