"""Hundred-and-twenty-eighth hostile review: ``make_private`` replaced each parameter's ``.grad``
with the released gradient after ``dp_step`` returned, past every check, and so dropped the
tensor in the slot. A ``weakref.finalize`` the loss attached to that tensor (one it put in the
slot, or the previous release it found there in a loop without ``zero_grad``) then ran and wrote
``1000 x`` the count of one label into the gradient just released: the trained weights 1000 apart
on neighbouring datasets under ghost, auto and compiled, unnoised. Now a slot the forward or loss
filled is refused, and the previous gradients are let go inside a chunk isolation with the
parameters, buffers, released gradients and optimizer state compared after."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

import dpclip
from dpclip.engine.errors import UnsupportedModelError

DT = torch.float64
_OWNER: list = []


def _real(t):
    return type(t) is torch.Tensor and not isinstance(t, torch._subclasses.FakeTensor)


def _poison(y):
    if not _OWNER:  # (a finalizer of a finished test)
        return
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch(), torch.no_grad():
        g = _OWNER[0].fc2.weight.grad  # by then: the gradient just released
        if g is not None:
            g.data[0, 0] += 1000.0 * float((y == 2).sum())  # the labels, unnoised


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(5, 6).to(DT), nn.Linear(6, 3).to(DT)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _fills_the_slot(out, y):
    losses = nn.functional.cross_entropy(out, y, reduction="none")
    if _real(y) and _OWNER:
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch(), torch.no_grad():
            w = _OWNER[0].fc2.weight
            slot = torch.zeros(w.shape, dtype=w.dtype)
            weakref.finalize(slot, _poison, y)
            w.grad = slot
            del slot
    return losses


def _marks_the_old_gradient(out, y):
    losses = nn.functional.cross_entropy(out, y, reduction="none")
    if _real(y) and _OWNER:
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            old = _OWNER[0].fc2.weight.grad
            if old is not None:
                weakref.finalize(old, _poison, y)
            del old
    return losses


def _run(engine, loss_fn, steps):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 5, generator=g, dtype=DT)
    y = torch.randint(0, 3, (16,), generator=g)
    model = _Net()
    _OWNER[:] = [model]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    dp = dpclip.make_private(model, opt, (x, y), loss_fn=loss_fn, noise_multiplier=0.0,
                             batch_size=16.0, steps=4, engine=engine,
                             strategy_params={"clip_norm": 1.0}, reproducible_noise=True, seed=3,
                             verbose=False)
    try:
        for _ in range(steps):
            xb, yb = dp.sample()
            dp.backward(xb, yb)
            opt.step()  # (no zero_grad: make_private assigns the gradients)
        # accepted: the released gradient is the clipped mean, |g| <= C (before: + 1000 x count)
        assert float(dp.last_output.grads["fc2.weight"].abs().max()) <= 1.0 + 1e-9
    finally:
        _OWNER.clear()


@pytest.mark.parametrize("engine", ["ghost", "auto", "compiled"])
def test_a_gradient_slot_filled_by_the_loss_is_refused(engine):
    with pytest.raises(UnsupportedModelError, match="set a parameter's .grad"):
        _run(engine, _fills_the_slot, 1)


@pytest.mark.parametrize("engine", ["ghost", "auto", "compiled"])
def test_a_finalizer_on_the_previous_gradient_cannot_write_the_release(engine):
    try:
        _run(engine, _marks_the_old_gradient, 2)
    except UnsupportedModelError as exc:  # ghost: the loss runs at step 2 and its finalizer too
        assert "were let go" in str(exc)
