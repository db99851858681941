"""Hundred-and-seventy-third hostile review: ``make_private``'s loop guard kept the drawn batch's
tensors (to check them unchanged) until the release, and the guard is reachable from a module
global of dpclip (``training.loop_guard._ACTIVE``: optimizer -> guard). The forward, while the
batch-size proof ran it on a public stand-in, read example 0's sign from there (torch's dispatch
off, ``.numpy()``) and made it a literal of the proved program; the real run matched it and the
release turned with example 0: 3.76 C at B = 8 under compiled, ghost and auto (auto: the public
probe's proof). Now the guard lets go of the tensors once ``dp.backward`` checked them."""

import pytest
import torch
from torch import nn

import dpclip
import dpclip.training.loop_guard as loop_guard

DT = torch.float64
_KEPT: dict = {}


def _peek():
    found = None
    with torch._C.DisableTorchFunction():
        g = torch._C._DisableTorchDispatch()
        try:
            for guard in list(loop_guard._ACTIVE.values()):
                for t, _ in list(guard._drawn_versions or ()):
                    if type(t) is torch.Tensor and t.dtype == DT and t.ndim == 2:
                        found = 1.0 if t.numpy()[0, 0] > 0 else -1.0
        finally:
            del g
    return found


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc = nn.Linear(4, 6).to(DT), nn.Linear(6, 3).to(DT)

    def forward(self, x):
        if type(x) is not torch.Tensor:  # the proof's fake tensors: read the drawn batch now
            _KEPT["s"] = _peek()
        s = _KEPT.get("s") or 1.0
        return self.fc(torch.tanh(self.fc1(x)) + 5.0 * s)


def _ce(o, y):
    return nn.functional.cross_entropy(o, y, reduction="none")


def _released_sum(x, y, engine, c):
    """The clipped sum make_private releases (noise 0, the whole dataset the batch)."""
    _KEPT.clear()
    model = _Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    dp = dpclip.make_private(model, opt, (x, y), noise_multiplier=0.0, steps=2,
                             batch_size=float(len(x)), engine=engine, strategy="fixed",
                             strategy_params={"clip_norm": c}, loss_fn=_ce,
                             reproducible_noise=True, seed=3, verbose=False)
    xb, yb = dp.sample()
    assert len(xb) == len(x)
    dp.backward(xb, yb)
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]) * len(x)


@pytest.mark.parametrize("engine", ["compiled", "auto", "ghost"])
def test_the_proof_cannot_read_the_drawn_batch_from_the_loop_guard(engine):
    torch.manual_seed(1)
    x = torch.randn(8, 4, dtype=DT)
    x[0, 0] = 2.0
    x[1:, 0] = -x[1:, 0].abs() - 0.1  # example 0's sign +, every other's -
    y = torch.randint(0, 3, (8,))
    c = 0.1
    full = _released_sum(x, y, engine, c)
    part = _released_sum(x[1:], y[1:], engine, c)
    assert float((full - part).norm()) / c <= 1 + 1e-6


def test_the_guard_still_refuses_a_second_draw_after_a_failed_release():
    """(letting go of the tensors keeps the batch unreleased: a failed backward still blocks the
    next draw and a checkpoint)"""
    guard = loop_guard.LoopGuard()
    t = torch.zeros(3)
    guard.record_draw((t, t))
    guard.check_batch()
    guard.let_go_of_batch()
    assert guard._drawn_versions == []
    guard.on_failed_release()
    with pytest.raises(loop_guard.LoopRuleError):
        guard.on_draw()
    with pytest.raises(loop_guard.LoopRuleError):
        guard.check_checkpoint()


_SOURCES: list = []


class _Reader(_Model):
    """Keeps what the step's seed source is (a context variable any code can read)."""

    def forward(self, x):
        from dpclip.engine import generators

        _SOURCES.append(generators._SOURCE.get())
        return self.fc(torch.tanh(self.fc1(x)))


def _held(obj):
    """What an object of dpclip's seed sources holds (its slots, a partial's parts)."""
    out = [getattr(obj, a, None) for a in getattr(type(obj), "__slots__", ())]
    out += [getattr(obj, "func", None), getattr(getattr(obj, "func", None), "__self__", None)]
    out += list(getattr(obj, "args", ()))
    return out


@pytest.mark.parametrize("direct", [False, True], ids=["make_private", "dp_step"])
def test_the_seed_source_a_forward_can_read_holds_no_generator(direct):
    """The step's chunk seeds come from an object in a context variable: it held the private
    randomness (make_private: a bound method of dp.rng) or the noise generator itself (a direct
    dp_step), whose state before the step's noise draw a forward could read."""
    from dpclip.randomness import PrivateRandomness
    from dpclip.training.step import _SeedsOf

    _SOURCES.clear()
    torch.manual_seed(1)
    x, y = torch.randn(8, 4, dtype=DT), torch.randint(0, 3, (8,))
    if direct:
        g = torch.Generator().manual_seed(5)
        src = _SeedsOf(g)
        held = _held(src)
    else:
        model = _Reader()
        dp = dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y),
                                 noise_multiplier=1.0, steps=2, batch_size=8.0, engine="ghost",
                                 loss_fn=_ce, verbose=False)
        dp.backward(*dp.sample())
        assert _SOURCES and _SOURCES[0] is not None
        held = _held(_SOURCES[0])
    assert not any(isinstance(h, (torch.Generator, PrivateRandomness)) for h in held), held
