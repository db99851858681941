"""The state guard's per-model plan (dpclip.engine.state_guard._Plan: addresses, shapes, strides,
dtypes of the state tensors and a kept copy buffer, reused between steps on the CPU) must never
let a write through because it is warm: every change between two guarded steps (a tensor given new
storage, a new shape or dtype on the same storage, a parameter, buffer or attribute replaced or
added) and every write in a step after such a change is still refused and undone."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import Tensor, nn

import dpclip.engine.state_guard as sg
from dpclip.training.step import PrivateBufferError, private_buffer_guard
from tests.core.test_state_guard import Base  # (a buffer, a frozen parameter, a Linear)


def _clean_steps(m: nn.Module, n: int = 2) -> None:
    """Guarded steps that change nothing: the plan is made and then reused."""
    for _ in range(n):
        with private_buffer_guard(m):
            m(torch.randn(2, 4)) if isinstance(m, nn.Linear) else m.lin(torch.randn(2, 4))


def _numpy_write(t: Tensor) -> None:  # no version counter sees it
    t.detach().numpy()[...] = 7.0


# (between the steps: a legitimate change, outside any guard) -> the tensor written in the step
BETWEEN = {
    "new-storage-via-data": lambda m: setattr(m.stat, "data", torch.ones(4)),
    "buffer-replaced": lambda m: setattr(m, "stat", torch.ones(4)),
    "parameter-replaced": lambda m: setattr(m.lin, "weight", nn.Parameter(torch.ones(4, 4))),
    "frozen-replaced-same-storage": lambda m: setattr(
        m, "frozen", nn.Parameter(m.frozen.data, requires_grad=False)),
    "narrowed-same-address": lambda m: setattr(m.stat, "data", m.stat.data[:2]),
    "dtype-view-same-address": lambda m: setattr(m.stat, "data", m.stat.data.view(torch.int32)),
    "attribute-added": lambda m: setattr(m, "cache", torch.zeros(3)),
    "optimizer-like-update": lambda m: m.lin.weight.data.add_(0.5),
    "train-to-eval": lambda m: m.eval(),
}
TARGET = {"parameter-replaced": lambda m: m.lin.weight, "attribute-added": lambda m: m.cache,
          "frozen-replaced-same-storage": lambda m: m.frozen,
          "optimizer-like-update": lambda m: m.lin.weight}


@pytest.mark.parametrize("change", list(BETWEEN))
def test_a_warm_plan_still_catches_a_write_after_a_change_between_steps(change):
    """A plan that kept the address it first saw for each tensor object (no fresh ``data_ptr``
    in the probe) compares the old storage after ``new-storage-via-data`` or
    ``narrowed-same-address`` and misses the write (checked: with such a probe 11 tests of this
    file fail, these among them)."""
    torch.manual_seed(0)
    m = Base()
    _clean_steps(m)
    BETWEEN[change](m)
    _clean_steps(m, 1)  # the changed state passes unchanged (and is planned anew)
    target = TARGET.get(change, lambda m: m.stat)(m)
    before = target.detach().clone()
    with pytest.raises(PrivateBufferError):
        with private_buffer_guard(m):
            _numpy_write(target)
    assert torch.equal(target.detach(), before)  # restored, bitwise
    _clean_steps(m, 1)


@pytest.mark.parametrize("change", list(BETWEEN))
def test_a_warm_plan_catches_a_change_made_in_the_step(change):
    """The same changes made inside the step (a structural one, or new storage / shape / dtype on
    the same object) are refused and undone; a write after them too."""
    torch.manual_seed(0)
    m = Base()
    _clean_steps(m)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    if change in ("optimizer-like-update",):
        with pytest.raises(PrivateBufferError):
            with private_buffer_guard(m):
                BETWEEN[change](m)
    elif change == "train-to-eval":  # not state: passes
        with private_buffer_guard(m):
            BETWEEN[change](m)
    else:
        with pytest.raises(PrivateBufferError):
            with private_buffer_guard(m):
                BETWEEN[change](m)
                _numpy_write(TARGET.get(change, lambda m: m.stat)(m))
    after = m.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)
    assert not hasattr(m, "cache")


def test_set_to_other_storage_in_the_step_is_seen():
    torch.manual_seed(0)
    m = Base()
    _clean_steps(m)
    other = torch.full((4,), 3.0)
    with pytest.raises(PrivateBufferError, match="'stat'"):
        with private_buffer_guard(m):
            m.stat.set_(other.untyped_storage(), 0, (4,), (1,))
    assert torch.equal(m.stat, torch.zeros(4))


def test_nested_guards_on_one_model_both_compare():
    """The plan's buffer serves one guard at a time; an inner guard on the same model snapshots
    on its own, and both refuse a write."""
    m = Base()
    _clean_steps(m)
    with pytest.raises(PrivateBufferError):
        with private_buffer_guard(m, "outer"):
            with pytest.raises(PrivateBufferError, match="inner"):
                with private_buffer_guard(m, "inner"):
                    _numpy_write(m.stat)
            _numpy_write(m.frozen)
    assert torch.equal(m.stat, torch.zeros(4)) and torch.equal(m.frozen, torch.zeros(4))


def test_the_plan_is_used_and_does_not_keep_the_model_alive():
    m = Base()
    _clean_steps(m)
    plan = sg._PLANS.get(m)
    assert plan is not None and plan.ok and plan.buf is not None
    _clean_steps(m)
    assert sg._PLANS.get(m) is plan  # reused while nothing moved
    ref = weakref.ref(m)
    del m, plan
    gc.collect()
    assert ref() is None


def test_nan_and_negative_zero_are_compared_bitwise_on_the_plan():
    m = Base()
    with torch.no_grad():
        m.stat.fill_(float("nan"))
    _clean_steps(m)  # NaN equals itself
    with pytest.raises(PrivateBufferError):
        with private_buffer_guard(m):
            m.frozen.detach().numpy()[0] = -0.0  # -0.0 differs from 0.0
    assert torch.equal(m.frozen, torch.zeros(4)) and not m.frozen[0].signbit()


def test_a_state_the_plan_cannot_read_is_compared_as_before():
    """A non-contiguous buffer: no plan (plan.ok False); the snapshot path still refuses."""
    m = Base()
    m.register_buffer("t", torch.randn(4, 3).t())
    _clean_steps(m)
    assert not sg._PLANS[m].ok
    with pytest.raises(PrivateBufferError, match="'t'"):
        with private_buffer_guard(m):
            m.t.data.add_(1.0)


@pytest.mark.parametrize("flip", ["conj", "neg"])
def test_a_view_that_reads_the_same_bytes_differently_is_seen(flip):
    """A conjugate or negative view has the same address, shape, strides, dtype and bytes, but
    other values: the probe holds both bits (without them the warm plan passed these swaps)."""
    m = Base()
    if flip == "conj":
        m.register_buffer("c", torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64))
        swap = lambda: setattr(m.c, "data", m.c.data.conj())  # noqa: E731
        target = lambda: m.c  # noqa: E731
    else:
        with torch.no_grad():
            m.stat.copy_(torch.arange(4.0) + 1)
        swap = lambda: setattr(m.stat, "data", torch._neg_view(m.stat.data))  # noqa: E731
        target = lambda: m.stat  # noqa: E731
    before = target().detach().clone().resolve_conj().resolve_neg()
    _clean_steps(m)
    with pytest.raises(PrivateBufferError):
        with private_buffer_guard(m):
            swap()
    assert torch.equal(target().detach().resolve_conj().resolve_neg(), before)
