"""Seventh hostile review: a write the forward DEFERS past the chunk's end escapes the isolation.

``Isolated`` compares the model's state when the chunk exits, and takes whatever is there when the
next chunk enters as the caller's. A forward that starts a ``threading.Timer`` (model code only)
writes the example into a plain attribute AFTER the exit check: the write is never seen, and the
next call reads it (under ``vmap`` directly; under ghost / auto the changed attribute is in the
proof-cache key, so the next call gets a fresh proof that takes it as a constant and matches).
Measured on bd7cb88: the next call moved (sound: 0).
Now a thread started in the chunk and still running at its end is refused
(``isolation.Isolated``); a low-level thread, a signal handler or a finalizer stays outside
(docs/engines.md, trust boundary).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from dpclip.engine import AutoEngine, GhostEngine, VmapEngine
from dpclip.engine.errors import UnsupportedModelError
from dpclip.training.step import PrivateBufferError
from tests.engine.helpers import DT
from tests.engine.test_isolation import _first, _modes_off
from tests.engine.test_separability_attacks import C, ce, clipped_sum, data


class _Deferred(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)
        self.k = 0.0

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x) + 0.2 * self.k  # the previous call's example
        f, d = _modes_off()
        with f, d:
            if not is_fake(x):
                v = _first(x)
                threading.Timer(1.5, setattr, (self, "k", v)).start()  # after the chunk's check
        return self.fc2(torch.tanh(h))


@pytest.mark.parametrize("engine", [VmapEngine, GhostEngine, AutoEngine],
                         ids=["vmap", "ghost", "auto"])
def test_a_deferred_write_cannot_carry_an_example_into_the_next_call(engine):
    torch.manual_seed(0)
    model = _Deferred().to(DT)
    x, y = data()
    got = []
    try:
        for first in (0, 1):
            model.k = 0.0
            clipped_sum(engine(), model, ce, x[first:first + 2], y[first:first + 2])
            time.sleep(3.0)  # (the loop's data loading)
            got.append(clipped_sum(engine(), model, ce, x[4:], y[4:])[0])
            time.sleep(3.0)
    except (UnsupportedModelError, PrivateBufferError):
        got = None
    moved = None if got is None else float((got[0] - got[1]).norm()) / C
    print(f"next call moved {moved} C")
    assert moved is None or moved <= 1e-12, moved
