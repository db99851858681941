"""Hundred-and-seventy-seventh hostile review: review 176's attack without a dispatch mode. The
forward pushed a saved-tensor hook pair right before ``z * c`` whose pack POPPED ITSELF (inside
autograd, before the tracer's step) and handed the tensor to the step watch's own pack, and whose
unpack answered the checks with the true value through the watch and the backward with +-1000 by
the sign of example 0's first feature: every check after the pack found the watch on top, 13.25 C
at B = 8 (56.6 C at 32) under ghost, auto's traced pass and make_private, with the operation
called as ``z * c`` or ``torch.ops.aten.mul.Tensor(z, c)``. Now the watch must be on top when each
of torch's functions is called (``ProgramMatch.fn_enter``), before any of its operations packs."""

import pytest
import torch
from torch import nn

from dpclip.engine import get_engine
from dpclip.engine.memory_watch import SavedTensorWatch
from tests.engine.helpers import TRACED_ENGINES, assert_refused_or_bounded, loo_distance
from tests.engine.test_review137_neg_bit_dtype import C, DT, _ce, _data, _first_bit, _real

_AC = torch._C._autograd


class _Model(nn.Module):
    def __init__(self, forge=True, op=False):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc = nn.Linear(4, 6).to(DT), nn.Linear(6, 3).to(DT)
        self.register_buffer("c", torch.ones(6, dtype=DT))
        self.forge, self.op = forge, op

    def _mul(self, z):
        return torch.ops.aten.mul.Tensor(z, self.c) if self.op else z * self.c

    def forward(self, x):
        z = self.fc1(x)
        if self.forge and _real(x):
            k = 1000.0 if _first_bit(x) else -1000.0
            wpack = _AC._top_saved_tensors_default_hooks(True)[0]

            def pack(t):
                _AC._pop_saved_tensors_default_hooks()
                return wpack(t)

            def unpack(p):
                if torch._C._current_graph_task_id() != -1:
                    return torch.full((6,), k, dtype=DT)
                return SavedTensorWatch.unpack(p)

            _AC._push_saved_tensors_default_hooks(pack, unpack)
        return self.fc(torch.tanh(self._mul(z)))


@pytest.mark.parametrize("op", [False, True], ids=["operator", "aten"])
@pytest.mark.parametrize("engine", TRACED_ENGINES + ("auto",))
def test_a_pack_hook_that_pops_itself_is_refused_or_bounded(engine, op):
    x, y = _data(8, "value")
    assert_refused_or_bounded(engine, lambda: _Model(op=op), x, y, C, _ce,
                              ("saved-tensor hooks",))


def test_the_model_is_accepted_without_the_hooks():
    x, y = _data(8, "value")
    assert loo_distance(lambda: get_engine("ghost"), lambda: _Model(forge=False), x, y, C,
                        loss=_ce) == pytest.approx(1.0)
