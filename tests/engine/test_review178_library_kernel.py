"""Hundred-and-seventy-eighth hostile review: a Python kernel the forward registered with
``torch.library`` on the Conjugate dispatch key (between Autograd and Python) and destroyed before
returning ran INSIDE ``torch.exp`` on a conjugate-bit tensor: it ran the operation below itself
(the tracer's step saw the step watch on top), then pushed review 177's self-popping saved-tensor
pair, through which autograd packed exp's result: the checks read the true value, the backward
+-1000 by example 0's sign: 13.9 C at B = 8 (28.7 C at 16) under ghost, auto's traced pass and
make_private. The checks at the step's start and the chunk's end compare the ledger's entries,
the same again after the destroy. Now the ledger and its version must be as at the match's start
whenever one of torch's functions is called (``ProgramMatch.fn_enter``)."""

import pytest
import torch
from torch import nn
from torch.library import Library

from tests.engine.helpers import TRACED_ENGINES, assert_refused_or_bounded
from tests.engine.test_review137_neg_bit_dtype import C, DT, _ce, _data, _first_bit, _real

_AC = torch._C._autograd
_BELOW = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Conjugate)
_OP = torch.ops.aten.exp.default
_STATE: dict = {}


def _kernel(ks, a):
    out = _OP.redispatch(ks & _BELOW, a)
    k = _STATE.pop("armed", None)
    if k is not None:
        wpack, wunpack = _AC._top_saved_tensors_default_hooks(True)

        def pack(t):
            _AC._pop_saved_tensors_default_hooks()
            return wpack(t)

        def unpack(p):
            if torch._C._current_graph_task_id() != -1:
                t = wunpack(p)
                return torch.full(t.shape, k, dtype=t.dtype)
            return wunpack(p)

        _AC._push_saved_tensors_default_hooks(pack, unpack)
    return out


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc = nn.Linear(4, 6).to(DT), nn.Linear(6, 3).to(DT)

    def forward(self, x):
        z = self.fc1(x)
        zn = z.to(torch.complex128).conj()  # (a conjugate view: the Conjugate key, in the proof too)
        lib = Library("aten", "IMPL")
        lib.impl("exp", _kernel, "Conjugate", with_keyset=True)
        try:
            if _real(x):
                _STATE["armed"] = 1000.0 if _first_bit(x) else -1000.0
            e = torch.exp(zn)
        finally:
            _STATE.pop("armed", None)
            lib._destroy()
        return self.fc(torch.tanh(e.real))


@pytest.mark.parametrize("engine", TRACED_ENGINES)
def test_a_kernel_registered_in_the_forward_is_refused_or_bounded(engine):
    x, y = _data(8, "value")
    _STATE.clear()
    try:
        assert_refused_or_bounded(engine, _Model, x, y, C, _ce, ("torch.library",))
    finally:
        _STATE.clear()
