"""Thirty-eighth hostile review (of b7bc681): what runs inside, or is left around, the engines'
reductions. Each attack below was accepted before (LOO above C, or silently wrong sums) and is
refused or sound now.

* a profile function the forward sets and leaves runs inside the engine's own code: on the return
  of ``apply_weight_fn`` it multiplied the weights by 50 (LOO 50 C under ghost, auto, vmap and
  naive), on the return of the noise sampler it zeroed the noise; the interpreter callbacks are
  now a watched setting of each chunk's isolation (refused, put back);
* the vmap / naive reduction under the user's ``torch.autocast``: the weighted sum ran in bfloat16
  while the bound assumed float32 (1.16 C at B 64); it runs in ``exact_float32`` too;
* a user's ``torch.set_flush_denormal(True)`` at tiny C: subnormal partial sums were flushed,
  which the underflow floors do not cover (2.08 C at C = 1.5e-38 under ghost); gradual underflow
  inside the reductions;
* parameters used only through ``F.linear(x, self.fc.weight)``, no layer called: ghost returned
  zero sums silently (no hooked call, so the use count was never taken); refused, auto runs vmap.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpclip.engine import AutoEngine, GhostEngine, ParamGroups, VmapEngine
from dpclip.engine.errors import UnsupportedModelError
from dpclip.engine.naive import NaiveEngine
from tests.engine import test_exact_float32 as r37
from tests.engine.helpers import Head, assert_equal_to_the_loop, ce, clip_weights, loo_distance

ENGINES = {"ghost": GhostEngine, "auto": AutoEngine, "vmap": VmapEngine, "naive": NaiveEngine}


def _heads_batch():
    """Eight float64 examples of 4 features for the Head models (seed 1), labels in 0..2."""
    g = torch.Generator().manual_seed(1)
    return (torch.randn(8, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (8,), generator=g))


def _scale_weights(frame, event, arg):
    if event == "return" and frame.f_code.co_name == "apply_weight_fn" \
            and isinstance(arg, torch.Tensor):
        arg.mul_(50.0)


class LeavesAProfiler(Head):
    def forward(self, x):
        if sys.getprofile() is None:
            sys.setprofile(_scale_weights)
        return self.fc(x)


@pytest.mark.parametrize("name", list(ENGINES))
def test_a_profile_function_left_by_the_forward_is_refused_and_removed(name):
    x, y = _heads_batch()
    try:
        with pytest.raises(UnsupportedModelError, match="interpreter callbacks"):
            loo_distance(ENGINES[name], LeavesAProfiler, x, y, 0.1)
        assert sys.getprofile() is None  # put back
    finally:
        sys.setprofile(None)


D = 16


class OutsideThenLayer(nn.Module):
    """``fc``'s parameters used outside its layer: ghost refuses, auto runs vmap."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.fc2 = nn.Linear(D, 3), nn.Linear(3, 3)

    def forward(self, x):
        return self.fc2(F.linear(x, self.fc.weight, self.fc.bias))


def _aligned(b: int = 64):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(1, D, generator=g)
    x = base.expand(b, D) + 1e-3 * torch.randn(b, D, generator=g)
    return x.contiguous(), torch.zeros(b, dtype=torch.long)


@pytest.mark.parametrize("name", ["auto", "vmap", "naive"])
def test_materialising_reductions_under_autocast_stay_within_c(name):
    x, y = _aligned()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert loo_distance(ENGINES[name], OutsideThenLayer, x, y, 1e-3, exact=True) <= 1.0


def _release(engine, xs, ys, c):
    m = r37.Alternating()
    res = engine().compute(m, ce, xs, ys, clip_weights(c), ParamGroups.flat(m))
    return torch.cat([g.reshape(-1).clone() for g in res.grads.values()])


@pytest.mark.parametrize("name", ["ghost", "vmap"])
@pytest.mark.parametrize("c", [1e-36, 3e-38, 1.5e-38])
def test_a_flush_to_zero_step_stays_within_c(name, c):
    """The releases under the user's flush-to-zero; the distances measured with gradual
    underflow (under denormals-are-zero the measurement itself would read subnormals as 0)."""
    x, y = r37._sequences()
    engine = ENGINES[name]
    try:
        torch.set_flush_denormal(True)
        full = _release(engine, x, y, c)
        left = [_release(engine, x[[i for i in range(8) if i != j]],
                         y[[i for i in range(8) if i != j]], c) for j in range(8)]
    finally:
        torch.set_flush_denormal(False)
    assert max(float((full.double() - v.double()).norm()) / c for v in left) <= 1.0


class OnlyFunctional(nn.Module):
    """No layer is called: the parameters are read by F.linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3).to(torch.float64)

    def forward(self, x):
        return F.linear(x, self.fc.weight, self.fc.bias)


def test_parameters_used_without_any_layer_call_are_refused_not_summed_as_zero():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (6,), generator=g)
    model = OnlyFunctional()
    with pytest.raises(UnsupportedModelError, match="used outside their layer"):
        GhostEngine().compute(model, ce, x, y, clip_weights(1.0), ParamGroups.flat(model))
    res = AutoEngine().compute(model, ce, x, y, clip_weights(1.0), ParamGroups.flat(model))
    assert_equal_to_the_loop(res, model, ce, x, y, ParamGroups.flat(model), engine="vmap")


# -- thirty-ninth hostile review (of 5e0cab9) --------------------------------------------------

_HITS: list[int] = []


def _scale_then_leave(frame, event, arg):
    if event == "return" and frame.f_code.co_name == "apply_weight_fn" \
            and isinstance(arg, torch.Tensor):
        arg.mul_(50.0)
        _HITS.append(1)
        sys.setprofile(None)
    elif event == "return" and frame.f_code.co_name in ("_chunk", "add_chunk", "run"):
        sys.setprofile(None)  # (never left past the chunk's isolation)


class SelfRemovingProfiler(Head):
    """The profile function removes itself before the chunk's isolation compares the settings:
    it acted inside ghost's reduction, which runs inside that isolation (LOO 50 C under ghost and
    auto). Interpreter callbacks are cleared inside every reduction now."""

    def forward(self, x):
        sys.setprofile(_scale_then_leave)
        return self.fc(x)


@pytest.mark.parametrize("name", list(ENGINES))
def test_a_self_removing_profile_function_does_not_act_inside_the_reduction(name):
    x, y = _heads_batch()
    _HITS.clear()
    try:
        assert loo_distance(ENGINES[name], SelfRemovingProfiler, x, y, 0.1) <= 1.0 + 1e-9
    except UnsupportedModelError:
        pass  # refused: sound
    finally:
        sys.setprofile(None)
    assert not _HITS


def _install_scaler():
    def prof(frame, event, arg):
        if event == "return" and frame.f_code.co_name == "compute" and hasattr(arg, "grads"):
            for v in arg.grads.values():
                v.mul_(50.0)
            sys.setprofile(None)
    sys.setprofile(prof)


class FinalizerOnTheChunk(Head):
    """A finalizer on the chunk slice the forward receives (once) installs a profile function
    that scales the engine's result on the return of ``compute``. The slices were released when
    ghost's chunk loop returned, outside every isolation (93.5 C under ghost)."""

    def forward(self, x):
        import weakref

        if type(x) is torch.Tensor and _ARMED[0]:  # (a global: the isolation compares attributes)
            _ARMED[0] = False
            weakref.finalize(x, _install_scaler)
        return self.fc(x)


_ARMED = [False]


def _chunked(engine):
    return lambda: engine(max_physical_batch=4)


def test_a_finalizer_on_a_chunk_slice_fires_inside_the_isolation():
    x, y = _heads_batch()
    _ARMED[0] = True
    try:
        with pytest.raises(UnsupportedModelError, match="interpreter callbacks"):
            loo_distance(_chunked(GhostEngine), FinalizerOnTheChunk, x, y, 0.1)
    finally:
        sys.setprofile(None)
        _ARMED[0] = False

