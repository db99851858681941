"""Ninth hostile review (of c386841): user code behind the model's tables, and tensors restrided
with no operation.

* A module's ``_modules`` (or ``_parameters``, ``_buffers``, a hook table) that is a ``dict``
  subclass runs its ``items`` wherever the engine (or ``dp_step``'s state guard) walks the model,
  outside every chunk: it wrote the previous call's example (recorded in the forward with torch
  functions and dispatch off) into a registered buffer before the step's watch and guard took
  their copies. Measured on c386841: the next call moved by 0.75 C under ghost, auto and vmap,
  3.13 C under naive; the same through ``dp_step``. A ``requires_grad`` property on an
  ``nn.Parameter`` subclass did the same (0.75 C). Now every engine, ``dp_step`` and
  ``make_private`` refuse tables that are not plain dicts or sets and parameters or buffers of a
  tensor class of the model's own (``isolation.check_structure``), before any of the model's
  methods runs.
* A tensor of the call restrided in place with no operation the trace sees (``as_strided_`` with
  dispatch off and its version counter set back, or ``torch._C._swap_tensor_impl`` with another
  view of the same storage): same object, storage, bytes and version, other elements: its rows
  read other examples. Measured on c386841: ghost and auto LOO 3.70 C. Now the memory watch keeps
  each tensor's sizes, strides and offset with its storage (``memory_watch._geometry``).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from dpclip.clipping import FixedClip, StepContext
from dpclip.engine import AutoEngine, GhostEngine, NaiveEngine, VmapEngine
from dpclip.engine.base import ParamGroups
from dpclip.engine.errors import UnsupportedModelError
from dpclip.noise import make_generator
from dpclip.training.sampling import PoissonSampler
from dpclip.training.step import dp_step
from tests.engine.helpers import DT
from tests.engine.test_isolation import _first, _modes_off
from tests.engine.test_separability_attacks import C, ce, clipped_sum, data, loo_distance

_PENDING: list[float] = []
_MODEL: list[nn.Module] = []


def _record(x: Tensor) -> None:
    f, d = _modes_off()
    with f, d:
        if not is_fake(x) and not torch._C._functorch.is_functorch_wrapped_tensor(x):
            _PENDING.append(_first(x))


def _release() -> None:
    if _PENDING and _MODEL:
        v = _PENDING.pop()
        _PENDING.clear()
        f, d = _modes_off()
        with torch.no_grad(), f, d:
            _MODEL[0].buf.fill_(v)


class _Table(dict):
    def items(self):  # the engine's walk of the model, outside the chunks
        _release()
        return super().items()


class _TableCarry(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "_modules", _Table())
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)
        self.register_buffer("buf", torch.zeros(1))

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x) + 0.2 * self.buf  # the previous call's example
        _record(x)
        return self.fc2(torch.tanh(h))


class _P(nn.Parameter):
    @property
    def requires_grad(self):  # read by the engine's scan, outside the chunks
        _release()
        return nn.Parameter.requires_grad.__get__(self)

    @requires_grad.setter
    def requires_grad(self, v):
        nn.Parameter.requires_grad.__set__(self, v)


class _ParamCarry(_TableCarry):
    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)
        self.scale = _P(torch.ones(6))
        self.register_buffer("buf", torch.zeros(1))

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x) * self.scale + 0.2 * self.buf
        _record(x)
        return self.fc2(torch.tanh(h))


def _fresh(cls) -> nn.Module:
    torch.manual_seed(0)
    model = cls().to(DT)
    _MODEL[:] = [model]
    _PENDING.clear()
    return model


@pytest.mark.parametrize("cls,what", [(_TableCarry, "the table _modules of module '<root>' is a "
                                                    "_Table, not a plain dict"),
                                      (_ParamCarry, "parameter 'scale' of module '<root>' is a _P")],
                         ids=["dict-subclass-table", "parameter-subclass"])
@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine, VmapEngine, NaiveEngine],
                         ids=["ghost", "auto", "vmap", "naive"])
def test_user_code_behind_the_model_tables_is_refused(engine, cls, what):
    x, y = data()
    model = _fresh(cls)
    try:
        with pytest.raises(UnsupportedModelError, match=what):
            for first in (0, 1):
                model.buf.zero_()
                clipped_sum(engine(), model, ce, x[first:first + 2], y[first:first + 2])
                clipped_sum(engine(), model, ce, x[4:], y[4:])
    finally:
        _MODEL.clear()


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine, VmapEngine, NaiveEngine],
                         ids=["ghost", "auto", "vmap", "naive"])
def test_dp_step_refuses_it_before_any_walk(engine):
    x, y = data()
    model = _fresh(_TableCarry)
    ctx = StepContext.at(0, steps_per_epoch=10, total_steps=10, expected_batch_size=4.0,
                         base_noise_multiplier=0.0)
    groups = ParamGroups(("all",), (("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"),))
    try:
        with pytest.raises(UnsupportedModelError, match=r"dp_step: the table _modules"):
            dp_step(model, x, y, loss_fn=ce, strategy=FixedClip(C), state={}, engine=engine(),
                    groups=groups, sampler=PoissonSampler(100, 4.0), base_noise_multiplier=0.0,
                    ctx=ctx, generator=make_generator(0))
    finally:
        _MODEL.clear()


def test_plain_tables_torch_hooks_and_torch_parameters_pass():
    from dpclip.engine.isolation import check_structure

    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT)
    model.register_forward_hook(lambda m, i, o: None)  # (torch's own hook table: a plain dict)
    model.register_buffer("b", torch.zeros(2, dtype=DT))
    model[0].weight = nn.Parameter(model[0].weight.detach().clone())
    check_structure(model, "vmap engine")  # no error


class _Restrides(nn.Module):
    def __init__(self, swap: bool) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)
        self.swap = swap

    def forward(self, x: Tensor) -> Tensor:
        s = self.fc1(x)
        v = s.view(-1, 6)
        f, d = _modes_off()
        with f, d:
            if not is_fake(v) and not torch._C._functorch.is_functorch_wrapped_tensor(v):
                b = v.shape[0]
                if self.swap:  # another view of the same storage, swapped in
                    torch._C._swap_tensor_impl(v, v.as_strided((b, 6), (1, b)))
                else:  # restrided in place, its version counter set back
                    version = v._version
                    v.as_strided_((b, 6), (1, b))
                    torch._C._autograd._unsafe_set_version_counter((v,), (version,))
        return self.fc2(torch.tanh(v))


@pytest.mark.parametrize("swap", [False, True], ids=["as_strided_", "swap_tensor_impl"])
@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine], ids=["ghost", "auto"])
def test_a_tensor_restrided_unseen_is_refused(engine, swap):
    torch.manual_seed(0)
    model = _Restrides(swap).to(DT)
    x, y = data()
    try:
        loo = loo_distance(engine(), model, ce, x, y)
    except UnsupportedModelError as exc:
        assert "restrided" in str(exc)
    else:
        assert loo <= 1.0 + 1e-9, f"LOO {loo:.4f} C"


def test_the_check_runs_no_code_of_the_model():
    """Classes and tables are compared by identity: a metaclass's ``__hash__`` or ``__eq__``
    (user code, run wherever a class is a dict key or compared) is never called."""
    from dpclip.engine.isolation import check_structure

    calls: list[str] = []

    class Meta(type):
        def __hash__(cls):
            calls.append("hash")
            return 0

        def __eq__(cls, other):
            calls.append("eq")
            return True

    class M(nn.Module, metaclass=Meta):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x: Tensor) -> Tensor:
            return self.fc(x)

    class Table(dict, metaclass=Meta):
        pass

    check_structure(M(), "vmap engine")  # no error
    model = M()
    object.__setattr__(model, "_buffers", Table())
    with pytest.raises(UnsupportedModelError, match="the table _buffers of module '<root>'"):
        check_structure(model, "vmap engine")
    assert calls == []
