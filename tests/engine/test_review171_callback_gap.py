"""Hundred-and-seventy-first hostile review: a trace or profile function set before the step ran
between one of torch's functions returning and the tracer's stamp of what it made (the mode put
the callback back, then called ``gc.enable()`` and ``ProgramMatch.fn_exit``: both raise events).
There it rewrote the node an in-place write made (review 159's forged saved-tensor unpack: the
check reads the true saved tensor through the step's watch, the backward reads +-1000 with the
sign of example 0's first feature); the stamp then took the forged node as the write's own:
13.25 C under ghost, auto (a profiler sends auto to its traced pass) and make_private. Now the
callbacks are switched off (and the collector paused) from before the checks of the function to
after the stamp; a rewrite after the stamp is refused at the next operation."""

import gc
import sys

import pytest
import torch
from torch import nn

from dpclip.engine import AutoEngine, get_engine
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import loo_distance
from tests.engine.test_review137_neg_bit_dtype import C, DT, _ce, _data, _real

_AC = torch._C._autograd
_STATE: dict = {}


def _rewrite(h, z, x, c):
    """Rebuild ``h``'s node as ``h.mul_(z)`` with an unpack hook that answers the checks with the
    true saved tensor (through the step's watch) and the backward with +-1000."""
    top = _AC._top_saved_tensors_default_hooks(True)
    watch = top[1] if isinstance(top, tuple) else (lambda p: p[0])
    with torch._C.DisableTorchFunction():
        guard = torch._C._DisableTorchDispatch()
        try:
            k = 1000.0 if bool(x[0, 0] > 0) else -1000.0
            v, n = h._version, h.grad_fn._sequence_nr()
            keep = h.detach().clone()
            h.detach_()

            def unpack(t):
                if torch._C._current_graph_task_id() != -1:
                    return torch.full(t.shape, k, dtype=t.dtype)
                return watch([t, t._version])

            with torch.no_grad():
                h.copy_(c.expand_as(h))
            _AC._push_saved_tensors_default_hooks(lambda t: t, unpack)
            try:
                h.mul_(z)
            finally:
                _AC._pop_saved_tensors_default_hooks()
            with torch.no_grad():
                h.copy_(keep)
            h.grad_fn._set_sequence_nr(n)
            _AC._unsafe_set_version_counter((h,), (v,))
        finally:
            del guard


def _callback(frame, event, arg):
    """At the first event after the matched ``h.mul_(z)`` wrote ``h``: the rewrite."""
    s = _STATE.get("armed")
    if s is not None and s[0]._version != s[4] and event != "return":
        del _STATE["armed"]
        _rewrite(*s[:4])
        _STATE["fired"] = _STATE.get("fired", 0) + 1
    return None


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc = nn.Linear(4, 6).to(DT), nn.Linear(6, 3).to(DT)
        self.register_buffer("c", torch.ones(6, dtype=DT))

    def forward(self, x):
        z = self.fc1(x)
        h = self.c.expand_as(z).clone()
        if _real(x):
            _STATE["armed"] = (h, z, x, self.c, h._version)
        h.mul_(z)
        _STATE.pop("armed", None)
        return self.fc(torch.tanh(h))


_ENGINES = {"ghost": lambda: get_engine("ghost"), "auto": lambda: get_engine("auto"),
            "auto-traced": lambda: AutoEngine(compiled=False)}


@pytest.mark.parametrize("engine", sorted(_ENGINES))
@pytest.mark.parametrize("setter", [sys.setprofile, sys.settrace], ids=["profile", "trace"])
def test_a_callback_between_a_function_and_its_stamp_cannot_forge_the_node(engine, setter):
    x, y = _data(8, "value")
    _STATE.clear()
    was = (sys.gettrace(), sys.getprofile())
    setter(_callback)
    try:
        d = loo_distance(_ENGINES[engine], _Model, x, y, C, loss=_ce)
    except UnsupportedModelError as e:
        assert "history was rewritten" in str(e) or "program" in str(e), e
        return
    finally:
        sys.settrace(was[0])
        sys.setprofile(was[1])
    assert d <= 1 + 1e-6, (engine, d, _STATE.get("fired"))


def test_the_model_is_accepted_and_bounded_without_a_callback():
    """(the control: the in-place product is a proved program, not refused for itself)"""
    x, y = _data(8, "value")
    _STATE.clear()
    assert loo_distance(_ENGINES["ghost"], _Model, x, y, C, loss=_ce) == pytest.approx(1.0)
    assert gc.isenabled()
