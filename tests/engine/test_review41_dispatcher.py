"""Forty-first hostile review: torch's Python dispatcher, switched on by the model, ran the model's
Python kernels inside the engine's reduction and inside ``dp_step``'s release.

With the dispatcher on, every ATen operation first calls the Python kernel registered on its
backend key (``OpOverload.py_impl(DispatchKey.CPU)``). On 229816e a model that switched it on in its
constructor, or left it on after its forward, scaled ghost's captured activations after their
check (LOO 47.2 C under ghost and auto) or the clipped sum in the release before the noise
(50 C). Now every engine's ``compute`` and ``dp_step`` run with the dispatcher off
(``isolation.engine_only``), and a forward that leaves it on (or armed: key off, interpreter
kept) is refused.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch._C import DispatchKey

from dpclip.engine import AutoEngine, GhostEngine, VmapEngine
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import Head, loo_distance

_LATE = {"apply_weight_fn", "_weighted_sums", "_Weights"}
_OPS = [torch.ops.aten.mul.Tensor, torch.ops.aten.mm.default, torch.ops.aten.sum.dim_IntList,
        torch.ops.aten.add.Tensor, torch.ops.aten.t.default, torch.ops.aten.div.Tensor]
_KEEP: list = []


class _Kernels:
    """Python kernels on the CPU key of a few ATen operations: inside ghost's reduction, once
    the weights are taken, they scale the captured activations by 50."""

    def __init__(self) -> None:
        self.done: set[int] = set()
        self.busy = False
        self.scaled = 0

    def make(self, op):
        def kernel(*args, **kwargs):
            if not self.busy:
                self.busy = True
                try:
                    self._scale()
                finally:
                    self.busy = False
            with torch._C._DisablePythonDispatcher():
                return op(*args, **kwargs)
        return kernel

    def _scale(self) -> None:
        frames, f = [], sys._getframe(2)
        while f is not None:
            frames.append(f)
            f = f.f_back
        names = {fr.f_code.co_name for fr in frames}
        red = next((fr for fr in frames if fr.f_code.co_name == "_reduce"), None)
        if red is None or not names & _LATE:
            return
        with torch._C._DisablePythonDispatcher(), torch.no_grad():
            for c in red.f_locals.get("live", ()):
                a = getattr(c, "a", None)
                if isinstance(a, torch.Tensor) and id(a) not in self.done:
                    self.done.add(id(a))
                    a.mul_(50.0)
                    self.scaled += 1


@pytest.fixture
def kernels():
    k = _Kernels()
    added = []
    for op in _OPS:
        if DispatchKey.CPU not in op.py_kernels:
            op.py_impl(DispatchKey.CPU)(k.make(op))
            added.append(op)
    try:
        yield k
    finally:
        while _KEEP:
            _KEEP.pop().__exit__(None, None, None)
        for op in added:
            op.py_kernels.pop(DispatchKey.CPU, None)
            op._dispatch_cache.clear()
        key = DispatchKey.PythonDispatcher
        torch._C._dispatch_tls_set_dispatch_key_included(key, False)
        assert not torch._C._dispatch_tls_is_dispatch_key_included(key)


def _batch():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (8,), generator=g))


class _InInit(Head):
    def __init__(self) -> None:
        super().__init__()
        guard = torch._C._EnablePythonDispatcher()
        guard.__enter__()
        _KEEP.append(guard)

    def forward(self, x):
        return self.fc(x * 1.0)


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
def test_a_dispatcher_switched_on_before_the_step_runs_no_kernel_inside(engine, kernels):
    x, y = _batch()
    assert loo_distance(engine, _InInit, x, y, 0.1) <= 1.0 + 1e-9
    assert kernels.scaled == 0


class _LeavesOn(Head):
    def forward(self, x):
        out = self.fc(x * 1.0)
        if type(x) is torch.Tensor:  # (the real run only)
            guard = torch._C._EnablePythonDispatcher()
            guard.__enter__()
            _KEEP.append(guard)
        return out


class _LeavesArmed(Head):
    """The key switched off again by hand: the interpreter torch keeps beside it stays set, and the
    exit of the next dispatcher guard anywhere switches it back on."""

    def forward(self, x):
        out = self.fc(x * 1.0)
        if type(x) is torch.Tensor:
            guard = torch._C._EnablePythonDispatcher()
            guard.__enter__()
            _KEEP.append(guard)
            torch._C._dispatch_tls_set_dispatch_key_included(DispatchKey.PythonDispatcher, False)
        return out


@pytest.mark.parametrize("model", [_LeavesOn, _LeavesArmed])
@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine, VmapEngine])
def test_a_dispatcher_left_on_by_the_forward_is_refused(engine, model, kernels):
    x, y = _batch()
    # (the kernels find the engine's tensors through sys._getframe: since the forty-sixth review
    # that request itself refuses the step where the dispatcher is still on when a kernel runs)
    with pytest.raises(UnsupportedModelError,
                       match="Python dispatcher|was called inside the private step"):
        loo_distance(engine, model, x, y, 0.1)


def test_dp_step_releases_with_the_dispatcher_off(kernels):
    """A kernel that scaled ``release``'s sums before the noise (50 C on 229816e) does not run."""
    from dpclip.clipping import FixedClip, StepContext
    from dpclip.engine import ParamGroups
    from dpclip.noise import make_generator
    from dpclip.training.sampling import PoissonSampler
    from dpclip.training.step import dp_step

    seen = []

    def spy(op):
        def kernel(*args, **kwargs):
            f = sys._getframe(1)
            while f is not None:
                if f.f_code.co_name == "release":
                    seen.append(op)
                    break
                f = f.f_back
            with torch._C._DisablePythonDispatcher():
                return op(*args, **kwargs)
        return kernel

    aten = torch.ops.aten
    ops = [aten.mul.Tensor, aten.add.Tensor, aten.div.Tensor, aten._to_copy.default,
           aten.copy_.default, aten.view.default, aten.cat.default, aten.add_.Tensor,
           aten.mul_.Tensor, aten.div_.Tensor]
    saved = {op: op.py_kernels.pop(DispatchKey.CPU, None) for op in ops}
    for op in ops:
        op.py_impl(DispatchKey.CPU)(spy(op))
        op._dispatch_cache.clear()
    try:
        model = _InInit()  # (the dispatcher on from here)
        x, y = _batch()
        sampler = PoissonSampler(1000, 8.0)
        ctx = StepContext.at(0, steps_per_epoch=sampler.steps_per_epoch, total_steps=1,
                             expected_batch_size=8.0, base_noise_multiplier=1.0)
        out = dp_step(model, x, y, loss_fn=lambda o, t: torch.nn.functional.cross_entropy(
            o, t, reduction="none"), strategy=FixedClip(0.1), state={}, engine=GhostEngine(),
            groups=ParamGroups.flat(model), sampler=sampler, base_noise_multiplier=1.0, ctx=ctx,
            generator=make_generator(0))
        assert out.grads and seen == []
        assert torch._C._dispatch_tls_is_dispatch_key_included(DispatchKey.PythonDispatcher)
    finally:
        for op, kernel in saved.items():
            op.py_kernels.pop(DispatchKey.CPU, None)
            if kernel is not None:
                op.py_kernels[DispatchKey.CPU] = kernel
            op._dispatch_cache.clear()
