"""A closed step skips the state guard, and nothing else does (issue 32's CPU step time).

``dp_step`` hands ``GhostEngine`` / ``AutoEngine`` a ``StepWeights``; the engine enters the state
guard itself (dpclip.engine.state_guard), except for a closed program: a plain chain of known
modules whose forwards look up torch's own code, a known loss, plain tensors, and exactly
``FixedClip``. No user code runs in such a step, so nothing can write private data into the
model's state. Every other step is guarded as before: each test below writes private data into
the model's state from the one place that makes the step not closed, and must be refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import dpclip.engine.ghost as ghost_mod
from dpclip.clipping.base import StepContext
from dpclip.clipping.fixed import FixedClip
from dpclip.engine import AutoEngine, GhostEngine
from dpclip.engine.base import ParamGroups
from dpclip.engine.errors import UnsupportedModelError
from dpclip.engine.known_losses import cross_entropy_per_example
from dpclip.noise import make_generator
from dpclip.training.sampling import PoissonSampler
from dpclip.training.step import PrivateBufferError, _closed_weights, dp_step


def _step(model: nn.Module, loss, strategy, engine, x: Tensor | None = None,
          y: Tensor | None = None):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=g) if x is None else x
    y = torch.randint(0, 3, (8,), generator=g) if y is None else y
    sampler = PoissonSampler(1000, 8.0)
    ctx = StepContext.at(0, steps_per_epoch=sampler.steps_per_epoch, total_steps=1,
                         expected_batch_size=8.0, base_noise_multiplier=0.0)
    return dp_step(model, x, y, loss_fn=loss, strategy=strategy, state={}, engine=engine,
                   groups=ParamGroups.flat(model), sampler=sampler, base_noise_multiplier=0.0,
                   ctx=ctx, generator=make_generator(0))


def _chain() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    m.register_buffer("stat", torch.zeros(3))  # (a buffer of the container: guarded state)
    return m


class _Spy:
    """Counts the state guards the ghost engine enters."""

    def __init__(self, monkeypatch) -> None:
        self.n = 0
        real = ghost_mod.state_guard

        def spy(*a, **k):
            self.n += 1
            return real(*a, **k)
        monkeypatch.setattr(ghost_mod, "state_guard", spy)


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
def test_closed_step_skips_the_guard_and_equals_the_guarded_step(engine, monkeypatch):
    model = _chain()
    guarded = _step(model, lambda o, y: cross_entropy_per_example(o, y), FixedClip(1.0),
                    engine())  # a user loss: not closed, guarded
    spy = _Spy(monkeypatch)
    closed = _step(model, cross_entropy_per_example, FixedClip(1.0), engine())
    assert spy.n == 0
    for n in guarded.grads:
        torch.testing.assert_close(closed.grads[n], guarded.grads[n], rtol=1e-6, atol=1e-7)


def _stat_writer(o: Tensor, y: Tensor, model: nn.Module) -> Tensor:
    model.stat.numpy()[:] = o.detach().numpy().mean(0)  # private data into a buffer
    return cross_entropy_per_example(o, y)


class _WritingFixed(FixedClip):
    """A FixedClip subclass whose weights write the norms into the model."""

    target: nn.Module | None = None

    def weights(self, norms: Tensor, state) -> Tensor:
        type(self).target.stat.numpy()[:] = float(norms.mean())
        return super().weights(norms, state)


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
def test_a_user_loss_writing_state_is_refused(engine):
    model = _chain()
    with pytest.raises((PrivateBufferError, UnsupportedModelError)):  # (ghost: .numpy())
        _step(model, lambda o, y: _stat_writer(o, y, model), FixedClip(1.0), engine())
    assert float(model.stat.abs().sum()) == 0.0  # restored


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
def test_a_strategy_subclass_writing_state_is_refused(engine):
    model = _chain()
    _WritingFixed.target = model
    with pytest.raises(PrivateBufferError, match="stat"):
        _step(model, cross_entropy_per_example, _WritingFixed(1.0), engine())
    assert float(model.stat.abs().sum()) == 0.0


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
def test_an_instance_weights_writing_state_is_refused(engine):
    model = _chain()
    strategy = FixedClip(1.0)
    real = strategy.weights

    def writing(norms: Tensor, state) -> Tensor:
        model.stat.numpy()[:] = float(norms.mean())
        return real(norms, state)
    object.__setattr__(strategy, "weights", writing)
    assert not _closed_weights(strategy)
    with pytest.raises(PrivateBufferError, match="stat"):
        _step(model, cross_entropy_per_example, strategy, engine())


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
def test_a_forward_hook_writing_state_is_refused(engine):
    model = _chain()

    def hook(mod, args, out):
        model.stat.numpy()[:] = out.detach().numpy().mean(0)
    model[2].register_forward_hook(hook)
    with pytest.raises((PrivateBufferError, UnsupportedModelError)):  # (ghost: a foreign hook)
        _step(model, cross_entropy_per_example, FixedClip(1.0), engine())
    assert float(model.stat.abs().sum()) == 0.0


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
def test_a_replaced_torch_function_writing_state_is_refused(engine):
    """``torch.tanh`` replaced (what nn.Tanh's forward looks up): not a closed program."""
    model = _chain()
    real = torch.tanh

    def tanh(x, *a, **k):
        out = real(x, *a, **k)
        if out.dim() == 2 and out.shape[-1] == 3:
            model.stat.numpy()[:] = out.detach().numpy().mean(0)
        return out
    model2 = nn.Sequential(model[0], model[1], model[2], nn.Tanh())
    model2.register_buffer("stat", model.stat)
    model = model2
    torch.tanh = tanh
    try:
        with pytest.raises((PrivateBufferError, UnsupportedModelError)) as info:
            _step(model, cross_entropy_per_example, FixedClip(1.0), engine())
    finally:
        torch.tanh = real
    assert float(model.stat.abs().sum()) == 0.0, info.value


def test_auto_on_vmap_and_its_probe_are_guarded(monkeypatch):
    """A model the ghost engine refuses: AutoEngine's public probe and its vmap steps run
    inside the engine's state guard."""
    class Mixing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x: Tensor) -> Tensor:
            out = self.lin(x)
            return out - out.mean(0)  # mixes: refused by the ghost engine

    torch.manual_seed(0)
    spy = _Spy(monkeypatch)
    _step(Mixing(), cross_entropy_per_example, FixedClip(1.0), AutoEngine())
    assert spy.n == 2  # the probe, then the vmap step


def test_closed_weights_is_exactly_fixed_clip():
    assert _closed_weights(FixedClip(1.0))
    assert not _closed_weights(_WritingFixed(1.0))
    s = FixedClip(1.0)
    object.__setattr__(s, "extra", lambda: None)
    assert not _closed_weights(s)


def test_a_direct_engine_call_is_not_guarded_by_the_engine(monkeypatch):
    """Only dp_step's StepWeights makes the engine guard (direct callers keep their behaviour)."""
    spy = _Spy(monkeypatch)
    model = _chain()
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    GhostEngine().compute(model, lambda o, t: F.cross_entropy(o, t, reduction="none"), x, y,
                          lambda n: torch.ones_like(n), ParamGroups.flat(model))
    assert spy.n == 0
