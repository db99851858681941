"""A private step under the profilers users run (found profiling a bench step): the engines switch
the interpreter's trace and profile callbacks off around their reductions and put them back after
(thirty-ninth hostile review). Put back with ``sys.setprofile``, ``cProfile``'s profiler (set from
C, not callable) became a Python-level call of an object that is not callable: the step failed
with ``TypeError: 'Profile' object is not callable``, as it did under
``torch.profiler.profile(with_stack=True)`` (``'TraceContext' object is not callable``).

Now (``dpclip.engine.frames_guard.callbacks_off`` / ``put_back_callbacks``): cProfile's profiler is
put back by its own C ``enable``; a callback set from C that Python cannot put back (torch's stack
tracer) stays on; Python callables are switched off and put back as before. The result is the same
as without a profiler, the profiler is still on after the step, and it recorded the step."""

from __future__ import annotations

import cProfile
import io
import pstats
import sys

import pytest
import torch
from torch import nn

from dpclip.engine import AutoEngine, GhostEngine, VmapEngine
from dpclip.engine import frames_guard
from dpclip.engine.known_losses import cross_entropy_per_example
from tests.engine.helpers import DT
from tests.engine.test_separability_attacks import clipped_sum, data


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)


ENGINES = [GhostEngine, AutoEngine, VmapEngine]


@pytest.mark.parametrize("engine", ENGINES)
def test_step_under_cprofile_is_the_step_without_it(engine):
    model = _model()
    x, y = data()
    plain, _ = clipped_sum(engine(), model, cross_entropy_per_example, x, y)
    prof = cProfile.Profile()
    prof.enable()
    try:
        got, _ = clipped_sum(engine(), model, cross_entropy_per_example, x, y)
        assert sys.getprofile() is prof  # still on after the step
    finally:
        prof.disable()
    torch.testing.assert_close(got, plain, rtol=0, atol=0)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).print_stats()
    assert "compute" in out.getvalue()  # it recorded the step


def test_dp_step_under_cprofile_keeps_the_profiler_on():
    from dpclip.bench import _make_step

    step = _make_step("dpclip-ghost", "mlp", 32)
    step()
    prof = cProfile.Profile()
    prof.enable()
    try:
        for _ in range(2):
            step()
        assert sys.getprofile() is prof
    finally:
        prof.disable()


@pytest.mark.parametrize("engine", ENGINES)
def test_step_under_torch_profiler_with_stack(engine):
    model = _model()
    x, y = data()
    plain, _ = clipped_sum(engine(), model, cross_entropy_per_example, x, y)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                with_stack=True) as prof:
        tracer = sys.getprofile()
        got, _ = clipped_sum(engine(), model, cross_entropy_per_example, x, y)
        assert sys.getprofile() is tracer
    torch.testing.assert_close(got, plain, rtol=0, atol=0)
    assert any("addmm" in e.key or "mm" in e.key for e in prof.key_averages())


def test_a_python_profile_function_is_off_inside_and_put_back():
    """A Python-level profile function (set with sys.setprofile) is switched off and put back,
    as before: it sees no frame of the engine's reductions."""
    seen: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            seen.append(frame.f_code.co_name)

    model = _model()
    x, y = data()
    sys.setprofile(profile)
    try:
        clipped_sum(GhostEngine(), model, cross_entropy_per_example, x, y)
        assert sys.getprofile() is profile
    finally:
        sys.setprofile(None)
    assert "forward" in seen  # on in the forward
    assert "_reduce" not in seen and "apply_weight_fn" not in seen  # off in the reduction


def test_cprofile_put_back_by_its_own_enable_not_a_subclass_override():
    called = []

    class Sub(cProfile.Profile):
        def enable(self, *a, **k):  # user code: not run by the put-back
            called.append(1)
            return super().enable(*a, **k)

    prof = Sub()
    cProfile.Profile.enable(prof)
    try:
        found, left = frames_guard.callbacks_off()
        assert found[1] is prof and left[1] is None and sys.getprofile() is None
        frames_guard.put_back_callbacks(*found)
        assert sys.getprofile() is prof and not called
    finally:
        prof.disable()


def test_an_object_set_from_c_that_python_cannot_put_back_stays_on():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                with_stack=True):
        tracer = sys.getprofile()
        assert tracer is not None and not callable(tracer)
        found, left = frames_guard.callbacks_off()
        assert left[1] is tracer and sys.getprofile() is tracer
        frames_guard.put_back_callbacks(*found)
        assert sys.getprofile() is tracer
