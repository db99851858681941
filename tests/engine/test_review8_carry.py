"""Eighth hostile review: state carried from one call into the next OUTSIDE the chunks.

The forward records the example in a plain Python list of the user's module (torch functions and
Python dispatch off, in the real run only); before the next call's watch is taken, user code
writes it into a global tensor that the forward reads (``fc1(x) + 0.2 * H``). Two doors:

* an override of a ``torch.nn.Module`` method the engine itself calls outside the chunks
  (``named_parameters``): measured on a5fd978, the next call moved by 0.75 C and LOO 2.06 C at
  ``max_physical_batch=1``, on ghost, auto (ran ghost) and vmap alike. Now every engine refuses a
  model class that defines such a method (``isolation.check_structure``), also when the class
  names its ``__module__`` after torch's (``isolation.origin``);
* the caller's loop writing the global between steps (no override): the proof named ``H`` by
  identity and compared it only with its value when the call started (0.75 C on a5fd978). Now a tensor from outside
  the call must hold the values it had when the last matched call that read it ended
  (``proved_program._LAST``): ghost and auto stop. (``vmap`` never knew the tensor: a global
  written with torch functions and dispatch off stays outside its checks, docs/engines.md,
  trust boundary.)
* a class attribute written from the example, in a class whose ``__module__`` names torch's: the
  isolation skipped library classes by that name (vmap: 0.75 C on a5fd978); it now asks
  :func:`~dpclip.engine.isolation.origin`.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from dpclip.engine import AutoEngine, GhostEngine, NaiveEngine, SummedEngine, VmapEngine
from dpclip.engine.base import ParamGroups
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import DT
from tests.engine.test_isolation import _first, _modes_off
from tests.engine.test_separability_attacks import C, ce, clipped_sum, data

_H = torch.zeros(1, dtype=DT)  # a global: never a parameter, buffer or attribute of the model
_PENDING: list[float] = []  # a plain list of the user's module


def _record(x: Tensor) -> None:
    f, d = _modes_off()
    with f, d:
        if not is_fake(x):
            _PENDING.append(_first(x))


def _release() -> None:
    if _PENDING:
        v = _PENDING.pop()
        _PENDING.clear()
        f, d = _modes_off()
        with torch.no_grad(), f, d:
            _H.fill_(v)


class _Carries(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x) + 0.2 * _H  # the previous call's example
        _record(x)
        return self.fc2(torch.tanh(h))


class _Override(_Carries):
    def named_parameters(self, *a, **k):  # user code the engine runs before its watch
        _release()
        return super().named_parameters(*a, **k)


class _Disguised(_Override):
    __module__ = "torch.nn.modules.linear"  # a name only: torch's module does not hold it


def _moved(engine, model_cls, between=None) -> float:
    torch.manual_seed(0)
    model = model_cls().to(DT)
    x, y = data()
    got = []
    for first in (0, 1):
        _H.zero_()
        _PENDING.clear()
        clipped_sum(engine(), model, ce, x[first:first + 2], y[first:first + 2])
        if between is not None:
            between()
        got.append(clipped_sum(engine(), model, ce, x[4:], y[4:])[0])
    return float((got[0] - got[1]).norm()) / C


@pytest.mark.parametrize("model_cls", [_Override, _Disguised], ids=["override", "disguised"])
@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine, VmapEngine, NaiveEngine],
                         ids=["ghost", "auto", "vmap", "naive"])
def test_user_code_in_a_structure_method_is_refused_by_every_engine(engine, model_cls):
    with pytest.raises(UnsupportedModelError, match="defines named_parameters"):
        _moved(engine, model_cls)


def test_the_summed_engine_refuses_it_too():
    model = _Override().to(DT)
    x, y = data()
    with pytest.raises(UnsupportedModelError, match="summed engine: class .*_Override"):
        SummedEngine().compute(model, ce, x, y, None, ParamGroups.flat(model))


@pytest.mark.parametrize("name", ["__getattr__", "__getattribute__", "parameters", "modules",
                                  "state_dict", "__class__", "__dict__"])
def test_each_structure_name_is_refused_in_a_submodule(name):
    from dpclip.engine.isolation import check_structure

    body = {"__getattr__": lambda self, k: nn.Module.__getattr__(self, k),
            "__getattribute__": lambda self, k: object.__getattribute__(self, k),
            "parameters": lambda self, recurse=True: nn.Module.parameters(self, recurse),
            "modules": lambda self: nn.Module.modules(self),
            "state_dict": lambda self, *a, **k: nn.Module.state_dict(self, *a, **k),
            "__class__": property(lambda self: nn.Tanh),
            "__dict__": property(lambda self: {})}[name]
    inner = type("Inner", (nn.Tanh,), {name: body})  # (no parameters: __init__ runs)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), inner(), nn.Linear(4, 3))
    with pytest.raises(UnsupportedModelError, match=f"Inner of module '2' defines {name}"):
        check_structure(model, "vmap")


def test_library_classes_and_plain_user_models_pass():
    from dpclip.engine.isolation import check_structure, origin

    class Plain(nn.Module):  # a forward of its own, nothing else: the common case
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(5, 4), nn.GELU(), nn.LayerNorm(4))

        def forward(self, x: Tensor) -> Tensor:
            return self.body(x)

    check_structure(Plain(), "ghost")  # no error
    assert origin(nn.Linear) == "torch" and origin(nn.Sequential) == "torch"
    assert origin(_Disguised) == "" and origin(Plain) == ""
    assert origin(_Carries) == "tests"  # (the top package of the module that holds it)


def test_origin_knows_transformers_classes():
    from dpclip.engine.isolation import origin

    modeling = pytest.importorskip("transformers.models.bert.modeling_bert")
    assert origin(modeling.BertModel) == "transformers"
    assert origin(modeling.BertSelfAttention) == "transformers"


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine], ids=["ghost", "auto"])
def test_a_global_written_between_steps_stops_a_proved_engine(engine):
    """No override: the caller's loop moves the carried value into the global between steps."""
    try:
        moved = _moved(engine, _Carries, between=_release)
    except UnsupportedModelError as exc:
        assert "holds other values than when the previous step" in str(exc)
    else:
        assert moved <= 1e-9, f"the next call moved by {moved:.4f} C"


_G = torch.full((1,), 0.5, dtype=DT)  # a global that nobody writes


class _ReadsConstant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x) + 0.2 * _G))


def test_an_unchanged_global_keeps_running_on_ghost():
    """A global read by the forward and never written: ghost runs every call, and the sums of
    the same batch are equal (the control of the test above)."""
    torch.manual_seed(0)
    model = _ReadsConstant().to(DT)
    x, y = data()
    a, info = clipped_sum(GhostEngine(), model, ce, x[4:], y[4:])
    clipped_sum(GhostEngine(), model, ce, x[:2], y[:2])
    b, _ = clipped_sum(GhostEngine(), model, ce, x[4:], y[4:])
    assert info["engine"] == "ghost"
    assert torch.equal(a, b)


class _ClassCarry(nn.Module):
    """A class attribute written from the example: the isolation snapshots user classes' attributes
    but skipped a class whose ``__module__`` named torch's."""

    __module__ = "torch.nn.modules.module"
    k = 0.0

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x) + 0.2 * type(self).k
        f, d = _modes_off()
        with f, d:
            if not is_fake(x):
                type(self).k = _first(x)
        return self.fc2(torch.tanh(h))


def test_a_disguised_class_is_still_snapshot():
    torch.manual_seed(0)
    model = _ClassCarry().to(DT)
    x, y = data()
    try:
        got = []
        for first in (0, 1):
            _ClassCarry.k = 0.0
            clipped_sum(VmapEngine(), model, ce, x[first:first + 2], y[first:first + 2])
            got.append(clipped_sum(VmapEngine(), model, ce, x[4:], y[4:])[0])
    except UnsupportedModelError as exc:
        assert "_ClassCarry" in str(exc) or "class" in str(exc)
    else:
        moved = float((got[0] - got[1]).norm()) / C
        assert moved <= 1e-9, f"the next call moved by {moved:.4f} C"
    finally:
        _ClassCarry.k = 0.0
