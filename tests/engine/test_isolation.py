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
from dpclip.engine.isolation import _SETTINGS, settings
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
        now = dict(zip((name for name, _, _ in _SETTINGS), settings()))
        assert now["flush denormal"] == (True, True)
    finally:
        torch.set_flush_denormal(False)


# ---------------------------------------------------- third hostile review (ab7cb53): more state
#
# A marked example (feature sum > 100) in call 1 leaves state behind; call 2 runs on other data.
# On ab7cb53 call 2's release moved (sound: 0): a class swapped (``self.__class__ = B``, a class the
# proof cache keys on: 4.51 C, LOO 3.71 C at max_physical_batch=1), the FPU rounding mode
# (``fesetround``: 3.39 C), an instance ``forward`` (4.51 C), and under vmap a number kept in a
# list, a class attribute or a forward hook (4.51 C); a ``requires_grad_`` toggle or a replaced
# ``.data`` stayed after a refusal. Each is refused now and put back.

_LIBC = __import__("ctypes").CDLL(None)
_FE_TONEAREST = _LIBC.fegetround()


class _Marked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)
        self.box = [1.0]

    def mid(self, h: Tensor) -> Tensor:
        return h

    def forward(self, x: Tensor) -> Tensor:
        out = self.fc2(torch.tanh(self.mid(self.fc1(x))))
        f, d = _modes_off()
        with f, d:
            if not is_fake(x) and _first(x) > 100:
                self.carry()
        return out

    def carry(self) -> None:
        raise NotImplementedError


class _Swapped(_Marked):
    def mid(self, h: Tensor) -> Tensor:
        return -3 * h


class _SwapsClass(_Marked):
    def carry(self) -> None:
        self.__class__ = _SwappedClass


class _SwappedClass(_SwapsClass):
    def mid(self, h: Tensor) -> Tensor:
        return -3 * h


class _Rounds(_Marked):
    def mid(self, h: Tensor) -> Tensor:
        return h + 3 * (((torch.ones_like(h) + 1e-17) - 1.0) * 1e16)  # 0, or 6.66 rounding up

    def carry(self) -> None:
        _LIBC.fesetround(0x800 if _FE_TONEAREST == 0 else 0)


class _InstanceForward(_Marked):
    def carry(self) -> None:
        fc1 = self.fc1
        fc1.forward = lambda t: -3 * nn.Linear.forward(fc1, t)


class _KeepsInList(_Marked):
    def mid(self, h: Tensor) -> Tensor:
        return h * self.box[0]

    def carry(self) -> None:
        self.box[0] = -3.0


class _ClassAttribute(_Marked):
    scale = 1.0

    def mid(self, h: Tensor) -> Tensor:
        return h * type(self).scale

    def carry(self) -> None:
        type(self).scale = -3.0


class _RegistersHook(_Marked):
    def carry(self) -> None:
        self.fc1.register_forward_hook(lambda m, a, o: -3 * o)


class _FreezesParameter(_Marked):
    def carry(self) -> None:
        self.fc2.weight.requires_grad_(False)


class _ReplacesData(_Marked):
    def carry(self) -> None:
        self.fc2.weight.data = self.fc2.weight.data * -3


LEFT = {"class": _SwapsClass, "rounding-mode": _Rounds, "instance-forward": _InstanceForward,
        "list": _KeepsInList, "class-attribute": _ClassAttribute, "hook": _RegistersHook,
        "requires-grad": _FreezesParameter, "data": _ReplacesData}


def _fingerprint(model: nn.Module) -> tuple:
    return (type(model), tuple(model.box), _ClassAttribute.scale, len(model.fc1._forward_hooks),
            "forward" in vars(model.fc1), model.fc2.weight.requires_grad,
            model.fc2.weight.data_ptr(), _LIBC.fegetround())


@pytest.mark.parametrize("kw", [{}, {"max_physical_batch": 1}], ids=["batch", "chunks-of-one"])
@pytest.mark.parametrize("name", list(LEFT))
@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_marked_example_leaves_nothing_behind(engine, name, kw):
    """Call 1 with a marked example is refused (an error that stops the run) and leaves the model
    and the process as they were; call 2, on other data, equals call 2 after an unmarked call 1."""
    torch.manual_seed(0)
    model = LEFT[name]().to(DT)
    x, y = data()
    before = _fingerprint(model)
    # (under vmap, functorch itself refuses requires_grad_ and .data writes in the transform)
    refusal = RuntimeError if engine == "vmap" and name in ("requires-grad", "data") \
        else UnsupportedModelError
    try:
        x[0] = 30.0
        with pytest.raises(refusal):
            clipped_sum(ENGINES[engine](**kw), model, ce, x, y)
        assert _fingerprint(model) == before
    finally:
        _LIBC.fesetround(_FE_TONEAREST)
        _ClassAttribute.scale = 1.0
