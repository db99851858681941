"""Seventh hostile review: fresh loss objects built from constants still miss the proof cache.

``_canon`` keys dicts/lists/sets/tensors by identity, so any loss made afresh each step whose
parts include a NEW container gets a NEW key: ``nn.CrossEntropyLoss()`` (its ``_parameters``,
``_buffers``, hook dicts), ``functools.partial(ce, ...)`` (its ``keywords`` dict, new per partial),
a ``lambda`` with a keyword-only default (its ``__kwdefaults__`` dict, new per function object),
an object of a class with ``__slots__`` (no ``__dict__``: by identity).
Every call then gets a fresh proof, which takes the global written by the previous call (with
torch functions and dispatch off) as a public constant; the real run matches it.
Now the canonical form holds lists, dicts and sets by their items and ``__slots__`` objects by
their slots (``batch_symbol._canon``): a new loss built from constants hits, and the match refuses
the carried constant.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from dpclip.engine import AutoEngine, GhostEngine
from dpclip.engine.errors import UnsupportedModelError
from dpclip.training.step import PrivateBufferError
from tests.engine.helpers import DT
from tests.engine.test_review5_fresh_proof import _G, _GlobalCarry
from tests.engine.test_separability_attacks import C, ce, clipped_sum, data


class _Slotted:
    """A loss class with ``__slots__`` (no ``__dict__``): keyed by identity."""

    __slots__ = ("smoothing",)

    def __init__(self) -> None:
        self.smoothing = 0.0

    def __call__(self, o: Tensor, y: Tensor) -> Tensor:
        return ce(o, y)


def _kwonly():
    return lambda o, y, *, w=1.0: ce(o, y) * w


VARIANTS = {  # a new loss object per step, built from constants only
    "nn-loss-module": lambda: nn.CrossEntropyLoss(reduction="none"),
    "partial": lambda: functools.partial(F.cross_entropy, reduction="none"),
    "kwonly-lambda": _kwonly,
    "slotted-object": _Slotted,
}


def _next_call_moved(engine, loss) -> float | None:
    torch.manual_seed(0)
    model = _GlobalCarry(0.2, False).to(DT)
    x, y = data()
    got = []
    try:
        for first in (0, 1):
            _G["k"] = 0.0
            clipped_sum(engine(), model, loss(), x[first:first + 2], y[first:first + 2])
            got.append(clipped_sum(engine(), model, loss(), x[4:], y[4:])[0])
    except (UnsupportedModelError, PrivateBufferError):
        return None
    return float((got[0] - got[1]).norm()) / C


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine], ids=["ghost", "auto"])
def test_a_fresh_loss_built_from_constants_cannot_carry_a_global(engine, name):
    moved = _next_call_moved(engine, VARIANTS[name])
    print(f"{name}: next call moved {moved} C")
    assert moved is None or moved <= 1e-12, moved
