"""Hundred-and-seventieth hostile review: the batch-size proof runs the user's forward under
``torch.export`` on a public stand-in, but the step had already registered its own batch in
dpclip's registry of past batches (``past_batches._STALE``, weak references, so that a later trace
takes them for mixed data). A forward walked the registry during the proof, read example 0's sign
with torch's dispatch switched off, and made it a literal of the proved program; the real run used
the same literal (kept in a global), matched, and the release turned with example 0: 3.76-6.02 C
under compiled, ghost, auto (a step that proves afresh) and make_private. Now the registry is
empty while the proof's forward runs (``past_batches.past_batches_hidden``)."""

import pytest
import torch
from torch import nn

import dpclip.engine.past_batches as separable  # (the registry's module)
from dpclip.engine import get_engine
from tests.engine.helpers import loo_distance

DT = torch.float64
_KEPT: dict = {}


def _peek():
    """Example 0's first feature's sign, from a registered 2-D float64 tensor (no torch op)."""
    found = None
    with torch._C.DisableTorchFunction():
        g = torch._C._DisableTorchDispatch()
        try:
            for ref, _ in list(separable._STALE.d.values()):
                t = ref()
                if type(t) is torch.Tensor and t.dtype == DT and t.ndim == 2:
                    found = 1.0 if t.numpy()[0, 0] > 0 else -1.0
        finally:
            del g
    return found


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc = nn.Linear(4, 6).to(DT), nn.Linear(6, 3).to(DT)

    def forward(self, x):
        if type(x) is not torch.Tensor:  # the proof's fake tensors: read the registry now
            _KEPT["s"] = _peek()
        s = _KEPT.get("s") or 1.0
        return self.fc(torch.tanh(self.fc1(x))) * (4.0 * s)


def _ce(o, y):
    return nn.functional.cross_entropy(o, y, reduction="none")


@pytest.mark.parametrize("engine", ["compiled", "ghost"])
def test_the_proof_cannot_read_the_step_s_batch_from_dpclip_s_registry(engine):
    torch.manual_seed(1)
    x = torch.randn(16, 4, dtype=DT)
    x[0, 0] = 2.0
    x[1:, 0] = -x[1:, 0].abs() - 0.1  # example 0's sign +, every other's -
    y = torch.randint(0, 3, (16,))
    _KEPT.clear()
    d = loo_distance(lambda: get_engine(engine), _Model, x, y, 0.1, loss=_ce)
    assert d <= 1 + 1e-6, d


def test_the_registry_is_back_after_the_proof():
    """(what the registry held before the proof is there after it: later traces still take the
    step's batch for mixed data)"""
    t = torch.randn(3, 4, dtype=DT)
    separable.mark_past_batch([t])
    with separable.past_batches_hidden():
        assert t not in separable._STALE and _peek() is None
    assert t in separable._STALE
