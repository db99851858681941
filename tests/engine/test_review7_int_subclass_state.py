"""Seventh hostile review: an ``int`` subclass attribute's own ``__dict__`` is in the proof-cache key
but not in the isolation's snapshot.

``_python_state`` keeps a module attribute that is an instance of an ``int`` / ``float`` subclass via
``_canon``, which keys an object with a ``__dict__`` by its type and its attributes' VALUES. The
isolation (``Isolated``) compares that attribute by identity only (not an exact plain type). So a
forward that writes the example into ``self.tag.k`` (the same ``tag`` object: the isolation sees no
change) changes the key on every call and every chunk: a fresh proof each time, which bakes
``self.tag.k`` (the previous call's / chunk's example) in as a public constant; the real run
matches it. Model code only; no global, no help from the loop.
Now a plain attribute is in the key by its type and builtin value only
(``batch_symbol._plain``): the key hits and the match refuses the carried constant.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from dpclip.engine import AutoEngine, GhostEngine
from dpclip.engine.errors import UnsupportedModelError
from dpclip.training.step import PrivateBufferError
from tests.engine.helpers import DT
from tests.engine.test_separability_attacks import C, ce, clipped_sum, data


class _Tag(int):
    """An int with a ``__dict__`` (any int / float subclass without ``__slots__``: an enum-like)."""


class _Carry(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)
        self.scale = scale
        self.tag = _Tag(1)
        self.tag.k = 0.0

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x) + self.scale * self.tag.k  # the previous call's example, as a constant
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            if not is_fake(x):
                self.tag.k = float(x.reshape(x.shape[0], -1)[0].sum())
        return self.fc2(torch.tanh(h))


def _next_call_moved(engine) -> float | None:
    torch.manual_seed(0)
    model = _Carry(0.2).to(DT)
    x, y = data()
    got = []
    try:
        for first in (0, 1):
            model.tag.k = 0.0
            clipped_sum(engine(), model, ce, x[first:first + 2], y[first:first + 2])
            got.append(clipped_sum(engine(), model, ce, x[4:], y[4:])[0])
    except (UnsupportedModelError, PrivateBufferError):
        return None
    return float((got[0] - got[1]).norm()) / C


def _chunks_loo(engine) -> float | None:
    torch.manual_seed(0)
    model = _Carry(5.0).to(DT)
    x, y = data()
    try:
        model.tag.k = 0.0
        full, _ = clipped_sum(engine(max_physical_batch=1), model, ce, x, y)
        worst = 0.0
        for j in range(x.shape[0]):
            keep = [i for i in range(x.shape[0]) if i != j]
            model.tag.k = 0.0
            part, _ = clipped_sum(engine(max_physical_batch=1), model, ce, x[keep], y[keep])
            worst = max(worst, float((full - part).norm()) / C)
    except (UnsupportedModelError, PrivateBufferError):
        return None
    return worst


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine], ids=["ghost", "auto"])
def test_an_int_subclass_attribute_cannot_carry_into_the_next_call(engine):
    moved = _next_call_moved(engine)
    print(f"next call moved {moved} C")
    assert moved is None or moved <= 1e-12, moved


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine], ids=["ghost", "auto"])
def test_chunks_of_one_cannot_read_each_other_through_an_int_subclass(engine):
    loo = _chunks_loo(engine)
    print(f"LOO at max_physical_batch=1 {loo} C")
    assert loo is None or loo <= 1 + 1e-9, loo
