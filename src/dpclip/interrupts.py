"""Ctrl-C during training: stop between two steps, checkpoint, say how to resume.

:func:`defer_sigint` wraps :func:`dpclip.training.trainer.train`: while it runs, the first SIGINT (Ctrl-C,
or Jupyter's "interrupt") only sets a flag, which the loop reads between two steps
(:func:`interrupt_requested`). The loop then writes its checkpoint and raises
:class:`TrainingInterrupted` (a ``KeyboardInterrupt``), so no step is ever cut in half: the
ledger, the model, the optimizer and the secret generators in the checkpoint all describe the
same step. A second Ctrl-C raises ``KeyboardInterrupt`` at once, as without dpclip.

Privacy: nothing is released by an interruption. The checkpoint holds the secret randomness
state (store it like the data, docs/privacy.md); the message quotes the step count and the
epsilon spent so far, both functions of the public plan.

Edge cases: under ``torchrun`` (``WORLD_SIZE`` > 1) nothing is deferred, since the ranks could
stop at different steps and wait for each other forever; outside the main thread (signals cannot
be handled there), or when the program has installed its own SIGINT handler, nothing is deferred
and Ctrl-C behaves as the program decides.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

__all__ = ["TrainingInterrupted", "defer_sigint", "deferred_sigint", "interrupt_requested"]

F = TypeVar("F", bound=Callable[..., Any])


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped by Ctrl-C between two steps; the checkpoint (when there is one) resumes
    it. Attributes: ``step`` (steps done), ``total_steps`` (planned), ``epsilon`` (spent so far),
    ``checkpoint`` (the file written, or ``None`` without a checkpoint directory)."""

    def __init__(self, step: int, total_steps: int, epsilon: float,
                 checkpoint: Path | None) -> None:
        self.step, self.total_steps = int(step), int(total_steps)
        self.epsilon, self.checkpoint = float(epsilon), checkpoint
        super().__init__(self.message("call train() again with the same checkpoint_dir"))

    def message(self, how_to_resume: str = "run the same command") -> str:
        """``interrupted at step 79/117; <how_to_resume> to resume`` (or why it cannot)."""
        head = f"interrupted at step {self.step}/{self.total_steps}"
        if self.checkpoint is None:
            return (f"{head} (epsilon so far {self.epsilon:.4g}); no checkpoint was written, so "
                    "it cannot be resumed: pass checkpoint_dir= to train() to make it resumable")
        return f"{head}; {how_to_resume} to resume"


class _State:
    active = False
    requested = False
    previous: Any = None


_STATE = _State()


def interrupt_requested() -> bool:
    """True once Ctrl-C was pressed inside :func:`deferred_sigint`: stop before the next step."""
    return _STATE.requested


def _handler(signum: int, frame: Any) -> None:
    _STATE.requested = True
    # a second Ctrl-C stops at once (the handler the program had before, normally
    # KeyboardInterrupt)
    signal.signal(signal.SIGINT, _STATE.previous)
    print("\ndpclip: stopping after this step and writing the checkpoint (Ctrl-C again to stop "
          "at once)", file=sys.stderr, flush=True)


@contextmanager
def deferred_sigint() -> Iterator[None]:
    """Defer the first SIGINT to the next :func:`interrupt_requested` check (see the module
    docstring). Re-entrant: an inner use inside an active one does nothing."""
    if _STATE.active or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 \
            or threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    _STATE.active, _STATE.requested = True, False
    _STATE.previous = signal.signal(signal.SIGINT, _handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, _STATE.previous)
        _STATE.active, _STATE.requested = False, False


def defer_sigint(fn: F) -> F:
    """Decorator: run ``fn`` inside :func:`deferred_sigint`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with deferred_sigint():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
