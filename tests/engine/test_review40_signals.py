"""Fortieth hostile review: Python signal handlers ran inside the engines' reductions.

A handler runs in the main thread between any two bytecodes, so neither the paused collector nor
the cleared trace / profile functions of ``exact_float32`` kept the model's code out of the
engine's own arithmetic. On fc55817: a ``SIGALRM`` handler installed by the model's constructor
switched CPU autocast on inside ghost's reduction and off again before the settings were compared
(LOO 1.188 C under ghost and auto); one installed by the forward scaled the captured activations
after their check (LOO 47-136 C). Now no Python handler runs inside an engine's ``compute`` or
``dp_step`` (``isolation.signals_deferred``: the signals are handed over afterwards) and a handler
installed by the forward is refused (a watched setting of each chunk).
"""

from __future__ import annotations

import signal
import sys

import pytest
import torch

from dpclip.engine import AutoEngine, GhostEngine, VmapEngine
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import Head, loo_distance
from tests.engine.test_exact_float32 import Alternating, _sequences

pytestmark = pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs setitimer")

_LATE = {"apply_weight_fn", "_weighted_sums"}


def _names(frame) -> set[str]:
    out = set()
    while frame is not None:
        out.add(frame.f_code.co_name)
        frame = frame.f_back
    return out


class _Switch:
    """Autocast (bfloat16) on while the reduction accumulates its norms, off once the weights are
    taken: the reduction's closing comparison sees the settings unchanged."""

    def __init__(self) -> None:
        self.late = self.busy = False
        self.hits = 0

    def __call__(self, signum, frame) -> None:
        if self.busy:
            return
        self.busy = True
        try:
            names = _names(frame)
            if "_reduce" not in names and "add_chunk" not in names:
                self.late = False
            elif names & _LATE:
                self.late = True
                torch.set_autocast_enabled("cpu", False)
            elif not self.late and not torch.is_autocast_enabled("cpu"):
                torch.set_autocast_dtype("cpu", torch.bfloat16)
                torch.set_autocast_enabled("cpu", True)
                self.hits += 1
        finally:
            self.busy = False


@pytest.fixture
def timer():
    """A repeating 50 us SIGALRM timer; the process's own handler and autocast put back after."""
    old = signal.getsignal(signal.SIGALRM)
    yield lambda: signal.setitimer(signal.ITIMER_REAL, 5e-5, 5e-5)
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)
    torch.set_autocast_enabled("cpu", False)


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
def test_a_handler_installed_before_the_step_does_not_run_in_the_reduction(engine, timer):
    switch = _Switch()
    signal.signal(signal.SIGALRM, switch)
    timer()
    x, y = _sequences()
    assert loo_distance(engine, Alternating, x, y, 1e-3, exact=True) <= 1.0
    assert switch.hits == 0


class _Scale:
    """Scales the activations ghost captured, once each, after the norms were taken."""

    def __init__(self) -> None:
        self.done: set[int] = set()
        self.busy = False

    def __call__(self, signum, frame) -> None:
        if self.busy:
            return
        self.busy = True
        try:
            self._scale(frame)
        finally:
            self.busy = False

    def _scale(self, frame) -> None:
        red, names, f = None, _names(frame), frame
        while f is not None:
            if f.f_code.co_name == "_reduce":
                red = f
            f = f.f_back
        if red is None or not (names & (_LATE | {"_Weights"})):
            return
        for c in red.f_locals.get("live", ()):
            a = getattr(c, "a", None)
            if isinstance(a, torch.Tensor) and id(a) not in self.done:
                self.done.add(id(a))
                with torch.no_grad():
                    a.mul_(50.0)


class _Installs(Head):
    def forward(self, x):
        with torch._C.DisableTorchFunction():
            if type(x) is torch.Tensor:  # (the real run only: not the proof's fake tensors)
                signal.signal(signal.SIGALRM, _Scale())
                signal.setitimer(signal.ITIMER_REAL, 5e-5, 5e-5)
        return self.fc(x * 1.0)


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine, VmapEngine])
def test_a_handler_installed_by_the_forward_is_refused(engine, timer):
    # (the process's own handler: the forward's is put back to it, and the timer's signals that
    # arrive after the refusal go there, not to the default action that ends the process)
    seen = []
    signal.signal(signal.SIGALRM, lambda s, f: seen.append(s))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (8,), generator=g)
    with pytest.raises(UnsupportedModelError, match="signal handlers"):
        loo_distance(engine, _Installs, x, y, 0.1)


def test_signals_arriving_inside_are_handed_over_after():
    from dpclip.engine.isolation import signals_deferred

    seen = []
    old = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        with signals_deferred():
            signal.raise_signal(signal.SIGUSR1)
            signal.raise_signal(signal.SIGUSR1)
            for _ in range(100):  # (a handler would have run by now)
                pass
            assert seen == []
        assert seen == [signal.SIGUSR1]  # (once: a pending signal is delivered once)
        assert signal.getsignal(signal.SIGUSR1) is not None and seen
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_keyboard_interrupt_is_raised_after_the_block():
    from dpclip.engine.isolation import signals_deferred

    done = []
    with pytest.raises(KeyboardInterrupt):
        with signals_deferred():
            signal.raise_signal(signal.SIGINT)
            done.append(1)
    assert done == [1]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_outside_the_main_thread_nothing_changes():
    import threading

    got = []
    th = threading.Thread(target=lambda: got.append(_run_deferred()))
    th.start()
    th.join()
    assert got == [True]


def _run_deferred() -> bool:
    from dpclip.engine.isolation import signals_deferred

    with signals_deferred():
        return signal.getsignal(signal.SIGINT) is signal.default_int_handler


if sys.platform == "win32":  # pragma: no cover
    pytestmark = pytest.mark.skip(reason="POSIX signals")
