"""Nothing a call leaves in process state reaches the next call (issue 31,
``dpclip.engine.isolation``).

Found by the second hostile review of the chunk of one (d997b70): at the end of its forward, with
torch functions and Python dispatch off (and not during the proof), a model keeps its example

* in a plain Python attribute (``self.k = float(x[0].sum())``, added to the next call's hidden
  layer): the proof cache keys on the model's plain attributes, so the next call got a fresh
  proof traced with the carried value as its constant, and matched it;
* in torch's flush-denormal flag (``torch.set_flush_denormal(x[0].sum() > 0)``), which decides
  whether the next call's ``((1 * 1e-300) * 1e-9) * 1e9 * 1e300`` is 1 or 0: every operation and
  argument is the proof's.

On d997b70 a later call moved by 3.67 C and 2.33 C (sound: 0), LOO at ``max_physical_batch=1``
2.06 C and 2.38 C, under ghost and ``auto``. Each is refused now (the attribute or setting is put
back); the same programs with a constant instead of the example are refused as well (the change,
not its value, is what the engine sees), and the same models changed between calls by the caller
run.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from dpclip.engine import AutoEngine, GhostEngine, SummedEngine, VmapEngine
from dpclip.engine.errors import UnsupportedModelError
from dpclip.engine.isolation import settings
from tests.engine.helpers import DT
from tests.engine.test_separability_attacks import ce, clipped_sum, data


def _modes_off():
    return torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch()


def _first(x: Tensor) -> float:
    """The first example's feature sum, read past vmap's wrappers."""
    while torch._C._functorch.is_functorch_wrapped_tensor(x):
        x = torch._C._functorch.get_unwrapped(x)
    return float(x.reshape(x.shape[0], -1)[0].sum())


class _KeepsAttr(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)
        self.k = 0.0

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x) + 0.2 * self.k
        f, d = _modes_off()
        with f, d:
            if not is_fake(x):
                self.k = _first(x)
        return self.fc2(torch.tanh(h))


class _SetsDenormal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        h = h + 2 * (((torch.ones_like(h) * 1e-300) * 1e-9) * 1e9 * 1e300)  # 1, or 0 if flushed
        f, d = _modes_off()
        with f, d:
            if not is_fake(x):
                torch.set_flush_denormal(_first(x) > 0)
        return self.fc2(torch.tanh(h))


ATTACKS = {"python-attribute": _KeepsAttr, "flush-denormal": _SetsDenormal}
ENGINES = {"ghost": GhostEngine, "auto": AutoEngine, "vmap": VmapEngine}


def test_the_flag_changes_the_arithmetic():
    """The attack's premise (else the test below proves nothing)."""
    one = torch.ones(3, dtype=DT)
    try:
        torch.set_flush_denormal(True)
        flushed = ((one * 1e-300) * 1e-9) * 1e9 * 1e300
    finally:
        torch.set_flush_denormal(False)
    kept = ((one * 1e-300) * 1e-9) * 1e9 * 1e300
    assert flushed.tolist() == [0.0] * 3 and kept.tolist() != [0.0] * 3


@pytest.mark.parametrize("attack", list(ATTACKS))
@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_call_cannot_leave_state_for_the_next(engine, attack):
    torch.manual_seed(0)
    model = ATTACKS[attack]().to(DT)
    x, y = data()
    x[0] = x[0].abs() + 0.1  # (a first example whose sum is positive: the flag set, k moved)
    before = settings()
    for kw in ({}, {"max_physical_batch": 1}):
        with pytest.raises(UnsupportedModelError, match="changed (the model's Python attribute "
                           "'k'|torch's global setting 'flush denormal') during a private step"):
            clipped_sum(ENGINES[engine](**kw), model, ce, x, y)
        assert settings() == before and getattr(model, "k", 0.0) == 0.0  # put back


def test_the_summed_engine_is_isolated_too():
    torch.manual_seed(0)
    model = _KeepsAttr().to(DT)
    x, y = data()
    with pytest.raises(UnsupportedModelError, match="Python attribute 'k'"):
        SummedEngine().compute(model, ce, x, y, None, __import__("dpclip").engine.ParamGroups.flat(
            model))
    assert model.k == 0.0


def test_what_the_caller_changes_between_calls_is_the_callers():
    """The caller's own changes between steps are not the call's: the next call starts from
    them (a new proof for a new attribute value)."""
    torch.manual_seed(0)
    model = _KeepsAttr().to(DT)
    model.forward = lambda x: model.fc2(torch.tanh(model.fc1(x) + 0.2 * model.k))
    x, y = data()
    first, _ = clipped_sum(GhostEngine(), model, ce, x, y)
    model.k = 1.5
    second, _ = clipped_sum(GhostEngine(), model, ce, x, y)
    assert not torch.equal(first, second)
    try:
        torch.set_flush_denormal(True)
        clipped_sum(GhostEngine(), model, ce, x, y)
        assert settings()[-1] is True
    finally:
        torch.set_flush_denormal(False)
