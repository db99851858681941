"""Forty-sixth hostile review: code a private step runs reached the engine's frames.

On 46818f2 a ``weakref.finalize`` attached in the forward to a Linear layer's input fired when ghost
released the last chunk (after the reduction and its checks) and walked ``sys._getframe`` up to
ghost's weighted sum, scaling it by 50 (LOO 50 C under ghost and auto); a finalizer that planted an
object in ghost's list of chunks had it finalized after every isolation (50 C); through
``make_private`` that object cloned the secret noise generator from ``dp_step``'s frame and
subtracted the very noise the release then added (the released gradient: the noiseless clipped
mean to 1e-7). Every engine call and ``dp_step`` now refuse frame and object introspection in the
thread that runs them (``dpclip.engine.frames_guard``, an audit hook): the asking call raises, and
the step is refused even when the asking code swallowed the error or ran in a finalizer.
"""

from __future__ import annotations

import gc
import inspect
import logging
import sys
import weakref

import pytest
import torch

import dpclip
from dpclip.engine import AutoEngine, GhostEngine, VmapEngine
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import Head, ce, loo_distance

_REFUSED = "was called inside the private step"


def _data(n: int = 8):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (n,), generator=g))


def _scale_part():
    """The review's finalizer: up the frames to ghost's weighted sum, scaled by 50."""
    f = sys._getframe(1)
    while f is not None:
        p = f.f_locals.get("part")
        if isinstance(p, dict) and p and all(isinstance(v, torch.Tensor) for v in p.values()):
            with torch.no_grad():
                for v in p.values():
                    v.mul_(50)
            return
        f = f.f_back


class _FinalizerScales(Head):
    def forward(self, x):
        h = x * 1.0
        if type(x) is torch.Tensor:  # (the real run only)
            weakref.finalize(h, _scale_part)
        return self.fc(h)


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
def test_a_finalizer_that_walks_the_frames_to_the_sum_is_refused(engine):
    x, y = _data()
    with pytest.raises(UnsupportedModelError, match=_REFUSED):
        loo_distance(engine, _FinalizerScales, x, y, 0.1)


class _Late:
    """Planted in the engine's own list of chunks: finalized outside every isolation."""

    def __del__(self):
        f = sys._getframe(1)
        while f is not None:
            s = f.f_locals.get("sums")
            if isinstance(s, dict) and s:
                with torch.no_grad():
                    for v in s.values():
                        if isinstance(v, torch.Tensor):
                            v.mul_(50)
                return
            f = f.f_back


def _plant():
    f = sys._getframe(1)
    while f is not None:
        if isinstance(f.f_locals.get("carry"), list):
            f.f_locals["carry"].append(_Late())
            return
        f = f.f_back


class _Plants(Head):
    def forward(self, x):
        h = x * 1.0
        if type(x) is torch.Tensor:
            weakref.finalize(h, _plant)
        return self.fc(h)


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
def test_a_finalizer_planted_in_the_engines_list_is_refused(engine):
    x, y = _data()
    with pytest.raises(UnsupportedModelError, match=_REFUSED):
        loo_distance(engine, _Plants, x, y, 0.1)


class _ReadsTheNoise(Head):
    """Through make_private: the forward looks for dp_step's secret noise generator."""

    seen: list = []

    def forward(self, x):
        if type(x) is torch.Tensor:
            try:
                f = sys._getframe(1)
                while f is not None:
                    if isinstance(f.f_locals.get("generator"), torch.Generator):
                        self.seen.append(f.f_locals["generator"].get_state())
                    f = f.f_back
            except RuntimeError:  # (FrameAccessRefused, swallowed: the step is refused all the same)
                pass
        return self.fc(x * 1.0)


@pytest.mark.parametrize("engine", ["ghost", "auto", "vmap"])
def test_the_noise_generator_is_out_of_reach_of_the_forward(engine):
    x, y = _data(64)
    model = _ReadsTheNoise()
    _ReadsTheNoise.seen = []
    dp = dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y),
                             noise_multiplier=1.0, steps=4, batch_size=16.0, engine=engine,
                             strategy_params={"clip_norm": 1.0}, loss_fn=ce, verbose=False)
    xs, ys = dp.sample()
    with pytest.raises(UnsupportedModelError, match=_REFUSED):
        dp.backward(xs, ys)
    assert _ReadsTheNoise.seen == []


class _Introspects(Head):
    how = "stack"

    def forward(self, x):
        if type(x) is torch.Tensor:
            if self.how == "stack":
                inspect.stack()
            elif self.how == "gc":
                gc.get_objects()
            elif self.how == "referrers":
                gc.get_referrers(x)
            elif self.how == "traceback":
                try:
                    raise ValueError("x")
                except ValueError as exc:
                    exc.__traceback__.tb_frame.f_back
            elif self.how == "generator":
                g = (i for i in range(2))
                g.gi_frame
            elif self.how == "logging_frame":  # logging's lambda, not called by findCaller
                logging.currentframe()
            elif self.how == "settrace":
                sys.settrace(None)
        return self.fc(x)


@pytest.mark.parametrize("how", ["stack", "gc", "referrers", "traceback", "generator",
                                 "logging_frame", "settrace"])
@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine, VmapEngine])
def test_every_way_to_a_frame_or_an_object_is_refused(engine, how):
    x, y = _data()

    class M(_Introspects):
        pass

    M.how = how
    with pytest.raises(UnsupportedModelError, match=_REFUSED):
        loo_distance(engine, M, x, y, 0.1)


class _Logs(Head):
    def forward(self, x):
        logging.getLogger("dpclip.tests.review46").warning("forward of %d rows", 2)
        return self.fc(x)


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
def test_logging_in_a_forward_still_runs(engine, caplog):
    """logging reads its caller's frame (findCaller) and hands out names only: allowed."""
    x, y = _data()
    with caplog.at_level(logging.WARNING, logger="dpclip.tests.review46"):
        assert loo_distance(engine, _Logs, x, y, 0.1) <= 1.0 + 1e-9
    assert any("forward of 2 rows" in r.getMessage() for r in caplog.records)


def test_outside_a_step_frames_are_the_users():
    f = sys._getframe()
    assert f.f_code.co_name == "test_outside_a_step_frames_are_the_users"
    assert isinstance(gc.get_referrers(f), list)


def test_the_window_refuses_even_a_swallowed_request_and_ends_cleanly():
    from dpclip.engine.frames_guard import FrameAccessRefused, guarded

    with pytest.raises(UnsupportedModelError, match="sys._getframe " + _REFUSED):
        with guarded():
            try:
                sys._getframe()
            except FrameAccessRefused:
                pass
    with guarded():  # (a new window starts clean)
        pass
    sys._getframe()
