"""Hundred-and-seventy-sixth hostile review: a forward entered a ``TorchDispatchMode`` of its own
(above the engine's tracer, left before returning) and pushed a saved-tensor hook pair (the step
watch's own pack; an unpack that answers the checks with the true saved tensor through the watch
and the backward with +-1000 by the sign of example 0's first feature) right before ``z * c``. Its
mode, which runs between autograd (which had packed ``c`` through the forged pair) and the
tracer's step, popped the pair: every check found the watch on top and the node genuine, while the
backward read the forged values: 13.25 C at B = 8 (56.6 C at 32) under ghost, auto's traced pass
and make_private. Now one of torch's own functions called while any dispatch mode but the tracer
(or one of torch's infrastructure modes) is active makes the forward not proved."""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dpclip.engine import AutoEngine, get_engine
from dpclip.engine.errors import UnsupportedModelError
from dpclip.engine.memory_watch import SavedTensorWatch
from tests.engine.helpers import TRACED_ENGINES, assert_refused_or_bounded, loo_distance
from tests.engine.test_review137_neg_bit_dtype import C, DT, _ce, _data, _first_bit, _real

_AC = torch._C._autograd
_ST: dict = {}


class _PopMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _ST.get("armed") and func is torch.ops.aten.mul.Tensor:
            _ST["armed"] = False
            _AC._pop_saved_tensors_default_hooks()
        return func(*args, **(kwargs or {}))


class _Model(nn.Module):
    def __init__(self, forge=True):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc = nn.Linear(4, 6).to(DT), nn.Linear(6, 3).to(DT)
        self.register_buffer("c", torch.ones(6, dtype=DT))
        self.forge = forge

    def forward(self, x):
        z = self.fc1(x)
        if self.forge and _real(x):
            k = 1000.0 if _first_bit(x) else -1000.0
            pack = _AC._top_saved_tensors_default_hooks(True)[0]

            def unpack(p):
                if torch._C._current_graph_task_id() != -1:
                    return torch.full((6,), k, dtype=DT)
                return SavedTensorWatch.unpack(p)

            with _PopMode():
                _AC._push_saved_tensors_default_hooks(pack, unpack)
                _ST["armed"] = True
                h = z * self.c
        else:
            h = z * self.c
        return self.fc(torch.tanh(h))


@pytest.mark.parametrize("engine", TRACED_ENGINES + ("auto",))
def test_a_dispatch_mode_entered_in_the_forward_is_refused_or_bounded(engine):
    x, y = _data(8, "value")
    _ST.clear()
    # (the forged pair on top when `z * c` is called: review 177's check refuses it first)
    assert_refused_or_bounded(engine, _Model, x, y, C, _ce, ("dispatch mode", "saved-tensor hooks"))


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _ModeOnly(nn.Module):
    """A dispatch mode of the forward's own around one operation, nothing else."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc = nn.Linear(4, 6).to(DT), nn.Linear(6, 3).to(DT)

    def forward(self, x):
        z = self.fc1(x)
        if _real(x):
            with _Passthrough():
                z = z * 2.0
        else:
            z = z * 2.0
        return self.fc(torch.tanh(z))


def test_any_dispatch_mode_entered_in_the_forward_is_refused():
    """(whatever the mode does: its code runs between autograd and the tracer's checks; auto
    falls back to vmap for such a forward)"""
    x, y = _data(8, "value")
    with pytest.raises(UnsupportedModelError, match="dispatch mode"):
        loo_distance(lambda: get_engine("ghost"), _ModeOnly, x, y, C, loss=_ce)
    assert loo_distance(lambda: AutoEngine(compiled=False), _ModeOnly, x, y, C, loss=_ce) <= 1 + 1e-6
