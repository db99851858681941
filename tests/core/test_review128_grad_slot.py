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
        assert "were let" in str(exc)


# ---------------------------------------------------------------- review 130: the drawn batch

_FIRED: list = []


def _poison_labels(labels, step):
    if not _OWNER or _OWNER[1].steps <= step:  # (an engine's own copy, dropped in the step)
        return
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch(), torch.no_grad():
        _OWNER[0].fc2.weight.data[0, 0] += 1000.0 * sum(1 for v in labels if v == 2)
    _FIRED.append(1)


def _marks_the_batch(out, y):
    """Hundred-and-thirtieth hostile review: the loss sees the drawn labels themselves (a batch of
    32 needs no padding) and attaches a finalizer to their storage, which died when the loop
    dropped the batch, after every check: the weights 6000-18000 apart on neighbouring
    datasets. Now the batch is let go at the next release, inside its check."""
    losses = nn.functional.cross_entropy(out, y, reduction="none")
    if _OWNER and (_real(y) or torch._C._functorch.is_functorch_wrapped_tensor(y)):
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            t = y
            while torch._C._functorch.is_functorch_wrapped_tensor(t):  # (vmap's wrapper)
                t = torch._C._functorch.get_unwrapped(t)
            t = t._base if t._base is not None else t
            storage, labels = t.untyped_storage(), t.reshape(-1).tolist()
        weakref.finalize(storage, _poison_labels, labels, _OWNER[1].steps)
        del storage
    return losses


@pytest.mark.parametrize("engine", ["ghost", "auto", "vmap"])
@pytest.mark.parametrize("inline", [False, True], ids=["loop", "inline"])
def test_a_finalizer_on_the_drawn_batch_cannot_write_the_model_unseen(engine, inline):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 5, generator=g, dtype=DT)
    y = torch.randint(0, 3, (32,), generator=g)
    model = _Net()
    before = model.fc2.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: only a finalizer moves the weights
    dp = dpclip.make_private(model, opt, (x, y), loss_fn=_marks_the_batch, noise_multiplier=0.0,
                             batch_size=32.0, steps=3, engine=engine,
                             strategy_params={"clip_norm": 1.0}, reproducible_noise=True, seed=3,
                             verbose=False)
    _OWNER[:] = [model, dp]
    _FIRED.clear()
    try:
        for _ in range(3):
            if inline:
                dp.step(*dp.sample())
            else:
                xb, yb = dp.sample()
                dp.backward(xb, yb)
                opt.step()
                del xb, yb
    except UnsupportedModelError as exc:
        assert "were let" in str(exc)  # (refused where the finalizer ran)
        return
    finally:
        _OWNER.clear()
    assert torch.equal(model.fc2.weight.detach(), before), _FIRED  # (before: + 1000 x count)


# ---------------------------------------------------------------- review 132: the strategy state

class _Bomb:
    def __init__(self, labels):
        self.labels = labels

    def __del__(self):
        if _OWNER:
            with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch(), \
                    torch.no_grad():
                _OWNER[0].fc2.weight.data[0, 0] += 1000.0 * sum(1 for v in self.labels if v == 2)


def _fills_the_state(out, y):
    """Hundred-and-thirty-second hostile review: the loss put an object into ``dp.state``; the
    strategy's new state replaced it after every check and before the let-go, and its ``__del__``
    wrote the weights with the labels (1000 apart on neighbouring datasets)."""
    losses = nn.functional.cross_entropy(out, y, reduction="none")
    if _real(y) and len(_OWNER) > 1 and isinstance(_OWNER[1].state, dict):
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            _OWNER[1].state[("bomb", id(y))] = _Bomb(y.tolist())
    return losses


@pytest.mark.parametrize("engine", ["ghost", "auto"])
def test_an_object_the_loss_put_in_the_strategy_state_cannot_write_the_model(engine):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 5, generator=g, dtype=DT)
    y = torch.randint(0, 3, (32,), generator=g)
    model = _Net()
    before = model.fc2.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: only the bomb moves the weights
    dp = dpclip.make_private(model, opt, (x, y), loss_fn=_fills_the_state, noise_multiplier=0.0,
                             batch_size=32.0, steps=2, engine=engine, strategy="quantile",
                             reproducible_noise=True, seed=3, verbose=False)
    _OWNER[:] = [model, dp]
    try:
        dp.step(*dp.sample())
    except UnsupportedModelError as exc:
        assert "were let" in str(exc)
        return
    finally:
        _OWNER.clear()
    assert torch.equal(model.fc2.weight.detach(), before)  # (before: + 1000 x count)
