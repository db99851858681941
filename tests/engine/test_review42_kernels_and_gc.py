"""Forty-second hostile review: Python kernels registered over ATen operations with
``torch.library``, and the cyclic garbage collector's callbacks, ran inside the engine's arithmetic
and ``dp_step``'s release.

On 737689b: a kernel over ``aten::nextafter`` (an operation only ghost's reduction runs) registered
by the model's constructor or forward divided the norms by 1000 (LOO 1000 C under ghost and auto);
kernels over ``cat`` / ``normal_`` scaled the clipped sum in the release and zeroed the noise
(1000 C, no noise at all); a ``gc.callbacks`` entry with collection threshold 1, set in the
constructor, scaled the sums in the release before the noise (1000 C). Now every engine's
``compute`` and ``dp_step`` refuse a Python kernel over an ATen operation and run with the collector
paused (``isolation.engine_only``), and a forward that registers such a kernel or changes the
collector is refused (watched settings). Open and documented: a call queued with
``Py_AddPendingCall`` through ctypes (raw interpreter access, as raw memory writes).
"""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from dpclip.engine import AutoEngine, GhostEngine, VmapEngine
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import Head, loo_distance

_LIBS: list = []


@pytest.fixture
def libraries():
    yield _LIBS
    while _LIBS:
        _LIBS.pop()._destroy()
    assert "aten/nextafter/CPU" not in torch.library._impls


def _register(op: str, fn, key: str = "CPU") -> None:
    import warnings

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ("overriding a previously registered kernel")
        lib.impl(op, fn, key)
    _LIBS.append(lib)


def _nextafter(a, b):  # the norms' last rounding step, divided by 1000
    with torch._C._DisableTorchDispatch():
        return a / 1000.0


class _RegistersInInit(Head):
    def __init__(self) -> None:
        super().__init__()
        _register("nextafter", _nextafter)

    def forward(self, x):
        return self.fc(x)


class _RegistersInForward(Head):
    def forward(self, x):
        if type(x) is torch.Tensor and not _LIBS:  # (the real run only)
            _register("nextafter", _nextafter)
        return self.fc(x)


class _Plain(Head):
    def forward(self, x):
        return self.fc(x)


def _batch():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (8,), generator=g))


@pytest.mark.parametrize("model", [_RegistersInInit, _RegistersInForward])
@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine, VmapEngine])
def test_a_python_kernel_over_aten_is_refused(engine, model, libraries):
    x, y = _batch()
    with pytest.raises(UnsupportedModelError, match="Python kernels over ATen|registered from "
                                                    "Python over ATen"):
        loo_distance(engine, model, x, y, 0.01)


def _dp_step(model):
    from dpclip.clipping import FixedClip, StepContext
    from dpclip.engine import ParamGroups
    from dpclip.noise import make_generator
    from dpclip.training.sampling import PoissonSampler
    from dpclip.training.step import dp_step

    x, y = _batch()
    sampler = PoissonSampler(1000, 8.0)
    ctx = StepContext.at(0, steps_per_epoch=sampler.steps_per_epoch, total_steps=1,
                         expected_batch_size=8.0, base_noise_multiplier=1.0)
    return dp_step(model, x, y, loss_fn=lambda o, t: torch.nn.functional.cross_entropy(
        o, t, reduction="none"), strategy=FixedClip(0.1), state={}, engine=GhostEngine(),
        groups=ParamGroups.flat(model), sampler=sampler, base_noise_multiplier=1.0, ctx=ctx,
        generator=make_generator(0))


def test_dp_step_refuses_a_python_kernel_over_the_noise(libraries):
    """``normal_`` zeroed (the noise gone: 1000 C and no privacy at all on 737689b)."""
    def no_noise(self, *args, **kwargs):
        with torch._C._DisableTorchDispatch():
            return self.zero_()

    _register("normal_", no_noise)
    with pytest.raises(UnsupportedModelError, match=r"aten/normal_/CPU"):
        _dp_step(_Plain())


def test_no_collector_callback_runs_inside_dp_step():
    """A callback with collection threshold 1, set before the step, ran in the release before the
    noise (on 737689b it scaled the sums x1000 there)."""
    inside = []

    def callback(phase, info):
        f = sys._getframe(1)
        while f is not None:
            if f.f_code.co_name in ("release", "add_gaussian_noise_all", "_reduce"):
                inside.append(f.f_code.co_name)
                break
            f = f.f_back

    threshold = gc.get_threshold()
    gc.callbacks.append(callback)
    gc.set_threshold(1, 1, 1)
    try:
        out = _dp_step(_Plain())
    finally:
        gc.callbacks.remove(callback)
        gc.set_threshold(*threshold)
    assert out.grads and inside == []
    assert gc.isenabled()


class _CollectsInForward(Head):
    def forward(self, x):
        if type(x) is torch.Tensor:
            gc.callbacks.append(lambda phase, info: None)
        return self.fc(x)


def test_a_forward_that_changes_the_collector_is_refused():
    x, y = _batch()
    n = len(gc.callbacks)
    try:
        with pytest.raises(UnsupportedModelError, match="garbage collector"):
            loo_distance(GhostEngine, _CollectsInForward, x, y, 0.1)
        assert len(gc.callbacks) == n  # (put back)
    finally:
        del gc.callbacks[n:]


def _mixing_tanh(x):
    """vmap's batching key: the kernel receives the whole batch and gives every row its sum."""
    from torch._C import _functorch as F

    level = F.maybe_current_level()
    value, bdim = F._unwrap_batched(x, level)
    value = value.movedim(bdim, 0)
    out = torch.tanh(value) + 50.0 * torch.sin(7 * value.sum(0, keepdim=True))
    return F._add_batch_dim(out, 0, level)


class _BatchedKernel(Head):
    """Forty-fourth hostile review: a kernel over ``tanh`` on ``FuncTorchBatched``, the key where
    vmap's batching rules run (4.81 C under vmap and auto on 8ef7ebf)."""

    def __init__(self) -> None:
        super().__init__()
        _register("tanh", _mixing_tanh, "FuncTorchBatched")

    def forward(self, x):
        return self.fc(torch.tanh(x))


@pytest.mark.parametrize("engine", [AutoEngine, VmapEngine])
def test_a_python_kernel_on_vmaps_batching_key_is_refused(engine, libraries):
    x, y = _batch()
    with pytest.raises(UnsupportedModelError, match="aten/tanh/FuncTorchBatched"):
        loo_distance(engine, _BatchedKernel, x, y, 0.1)


def test_torchs_own_kernels_are_not_refused():
    from torch.func import vmap

    from dpclip.engine.proved_program import foreign_aten_kernels

    vmap(lambda t: t.sin().sum())(torch.randn(3, 4))  # (torch's lazy vmap decompositions)
    assert foreign_aten_kernels() == frozenset()
