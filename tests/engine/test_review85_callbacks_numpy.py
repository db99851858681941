"""Eighty-fifth hostile review (of a434213: the profilers' put-back and numpy in ghost's CPU passes).

1. ``frames_guard.put_back_callbacks`` is a plain function that the audit hook lets set interpreter
   callbacks (the engine's own put-back). A forward called it to install its own profile
   function, which hid itself from the chunk's settings snapshot, multiplied the result's
   gradients by 50 on a return outside the reductions and removed itself before the step's final
   compare: LOO 110.9 C under ghost, vmap and auto's first step. Now it installs nothing inside a
   step but ``None`` and the callbacks the step began with; the step is refused.
2. ``numpy.einsum`` replaced (from the forward, or after ``import dpclip``) by one shrinking one
   example's Gram rows by 0.02: ghost's norm of that example 1.19 against a true 3.80, LOO 3.18 C
   (ghost and auto). The engine now calls numpy's functions as bound when it was imported
   (``ghost_rules._NP_VECDOT``, ``_NP_MUL``, ...): rebinding them in numpy's namespace does not
   reach it."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpclip.engine import AutoEngine, GhostEngine, VmapEngine
from dpclip.engine import frames_guard
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.test_separability_attacks import clip_weights, loo_distance

C = 1.0


class _Installs(nn.Module):
    """Calls the engine's put-back from its forward to install ``profile``."""

    def __init__(self, profile) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 8)
        self.l2 = nn.Linear(8, 2)
        self.profile = profile
        self.armed = False

    def forward(self, x):
        if self.armed:
            self.armed = False
            frames_guard.put_back_callbacks(sys.gettrace(), self.profile)
        return self.l2(torch.tanh(self.l1(x)))


def _loss(out, y):
    return F.cross_entropy(out, y, reduction="none")


@pytest.mark.parametrize("engine", [GhostEngine, VmapEngine, AutoEngine])
def test_the_put_back_installs_nothing_the_step_did_not_begin_with(engine):
    ran = []

    def profile(frame, event, arg):
        if event == "return" and isinstance(getattr(arg, "grads", None), dict):
            ran.append(frame.f_code.co_name)
            for g in arg.grads.values():
                g.mul_(50)

    torch.manual_seed(0)
    model = _Installs(profile)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    eng = engine()
    before = (sys.gettrace(), sys.getprofile())
    eng.compute(model, _loss, x, y, clip_weights(C), eng_groups(model))  # a clean step first
    model.armed = True
    with pytest.raises(UnsupportedModelError, match="put_back_callbacks"):
        eng.compute(model, _loss, x, y, clip_weights(C), eng_groups(model))
    assert not ran
    assert (sys.gettrace(), sys.getprofile()) == before


def test_the_put_back_of_the_callers_own_profiler_is_allowed():
    """The same call with the callbacks the step began with (the engine's own use) passes."""
    import cProfile

    prof = cProfile.Profile()

    class Same(_Installs):
        def forward(self, x):
            frames_guard.put_back_callbacks(sys.gettrace(), sys.getprofile())
            return self.l2(torch.tanh(self.l1(x)))

    torch.manual_seed(0)
    model = Same(None)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    prof.enable()
    try:
        GhostEngine().compute(model, _loss, x, y, clip_weights(C), eng_groups(model))
        assert sys.getprofile() is prof
    finally:
        prof.disable()


def eng_groups(model):
    from dpclip.engine import ParamGroups

    return ParamGroups.flat(model)


def _shrinking(real, factor):
    def evil(*args, **kwargs):
        return real(*args, **kwargs) * factor
    return evil


class _Patches(nn.Module):
    """Replaces numpy's functions from its forward (each call), on (B, T, d) inputs: the Linear
    layers' Gram path."""

    def __init__(self, names) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 32)
        self.l2 = nn.Linear(32, 16)
        self.names = names

    def forward(self, x):
        for name in self.names:
            if not getattr(getattr(np, name), "_evil", False):
                evil = _shrinking(getattr(np, name), 0.02)
                evil._evil = True
                setattr(np, name, evil)
        return self.l2(torch.tanh(self.l1(x))).sum(1)


@pytest.mark.parametrize("names", [("einsum",), ("vecdot",), ("multiply", "absolute", "abs"),
                                   ("einsum", "vecdot", "multiply", "absolute", "abs",
                                    "greater")],
                         ids=["einsum", "vecdot", "ufuncs", "all"])
@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
def test_numpy_replaced_from_the_forward_does_not_reach_the_engine(engine, names):
    saved = {n: getattr(np, n) for n in names if hasattr(np, n)}
    torch.manual_seed(0)
    model = _Patches([n for n in names if n in saved])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 5, 4, generator=g)
    x[0] = 1.5  # (the review's target: constant over positions)
    y = torch.randint(0, 16, (8,), generator=g)
    try:
        eng = engine()
        got = []
        for _ in range(2):
            try:
                got.append(loo_distance(eng, model, _loss, x, y))
            except UnsupportedModelError:
                got.append(None)
    finally:
        for n, f in saved.items():
            setattr(np, n, f)
    assert all(v is None or v <= 1 + 1e-5 for v in got), got


def test_numpy_error_handling_is_off_inside_the_reductions():
    """numpy's passes in ghost's reduction run with its floating-point error handling off: a
    ``np.seterrcall`` function (Python) or a warning (``warnings.showwarning``) would otherwise
    run inside the reduction on an infinity or NaN of a non-finite example."""
    from dpclip.engine._common import exact_float32

    old = np.seterr(all="call")
    old_call = np.seterrcall(lambda *a: None)
    try:
        with exact_float32():
            inside = np.geterr()
            with np.errstate(all="ignore"):
                pass
            assert set(np.geterr().values()) == {"ignore"}
        assert set(inside.values()) == {"ignore"}
        assert set(np.geterr().values()) == {"call"}  # put back after
    finally:
        np.seterr(**old)
        np.seterrcall(old_call)
