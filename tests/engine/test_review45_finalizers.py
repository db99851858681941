"""Forty-fifth hostile review: a finalizer the engine's own code released, after the last chunk's
isolation, set a profile function that scaled the engine's result on the return of ``compute``
(on 20c4c83: LOO 50 C under ghost and auto; the forward walked the frames to ghost's own list of
chunks and appended an object with a ``__del__``). Every engine call and ``dp_step`` now put the
interpreter callbacks back when they return and refuse the call (``isolation.engine_only``)."""

from __future__ import annotations

import sys

import pytest
import torch

from dpclip.engine import AutoEngine, GhostEngine
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import Head, loo_distance
from tests.engine.test_review38_reduction import _install_scaler  # (scales on compute's return)


class _Bomb:
    def __del__(self):
        _install_scaler()


class _PlantsInTheEngine(Head):
    def forward(self, x):
        if type(x) is torch.Tensor:  # (the real run only)
            f = sys._getframe(1)
            while f is not None:
                if "chunks" in f.f_locals and isinstance(f.f_locals["chunks"], list):
                    f.f_locals["chunks"].append(_Bomb())
                    break
                f = f.f_back
        return self.fc(x)


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
def test_a_callback_set_by_a_finalizer_the_engine_released_is_refused(engine):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (8,), generator=g)
    try:
        with pytest.raises(UnsupportedModelError, match="interpreter callback"):
            loo_distance(engine, _PlantsInTheEngine, x, y, 0.1)
        assert sys.getprofile() is None  # (put back)
    finally:
        sys.setprofile(None)
