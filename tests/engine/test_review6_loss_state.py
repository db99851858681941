"""Sixth hostile review: the canonical proof-cache key makes the LOSS OBJECT's own state a key.

cefbb22 keys the proof cache on ``_canon(loss_fn)``: a loss object by its type and its attributes'
VALUES (a closure by its cells' values). The isolation (``dpclip.engine.isolation.Isolated``)
snapshots the MODEL only, never the loss. So a loss that keeps the previous call's example in its
own attribute (written with torch functions and dispatch off, so no trace sees it) changes the key
on every call: every call misses, gets a fresh proof, and that proof bakes the carried value in as
a public constant; the real run then matches it. The carrier and the cache-miss trigger are the
same attribute. On 524171e (key: the loss object by identity) the cached proof held the first
call's constant and the match refused ("argument 1 of operation 8 (mul) differs from the
proof's"); on cefbb22 it is accepted:

* a later call moved by 0.74 C (sound: 0);
* LOO at ``max_physical_batch=1`` 1.88 C (ghost), 2.11 C (auto) (sound: 1 C).

The same with a closure over a list cell ``box`` (``box[0] = ...``) and with an ``nn.Module`` loss
(``self.k``): identical numbers. Under vmap a loss object's internals are the accepted-open
"Python objects under vmap"; under ghost / auto this is a regression of cefbb22 (refused at
524171e: all twelve cases below pass there).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from dpclip.engine import AutoEngine, GhostEngine
from dpclip.engine.errors import UnsupportedModelError
from dpclip.training.step import PrivateBufferError
from tests.engine.helpers import DT
from tests.engine.test_separability_attacks import C, ce, clipped_sum, data


def _carry(o: Tensor) -> float:
    return 5.0 * float(o.detach()[0].sum())  # (the chunk's first example)


class _Loss:
    """A loss object that keeps the last call's example in an attribute and adds it next call."""

    def __init__(self) -> None:
        self.k = 0.0

    def __call__(self, o: Tensor, y: Tensor) -> Tensor:
        out = ce(o, y) + self.k * o[:, 0]
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            if not is_fake(o):
                self.k = _carry(o)
        return out


def _closure_loss():
    box = [0.0]

    def loss(o: Tensor, y: Tensor) -> Tensor:
        out = ce(o, y) + box[0] * o[:, 0]
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            if not is_fake(o):
                box[0] = _carry(o)
        return out
    return loss


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class _LossModule(nn.Module):
    """The same as a ``torch.nn`` loss module (a plain attribute; the isolation snapshots the model's
    modules, not the loss's)."""

    def __init__(self) -> None:
        super().__init__()
        self.k = 0.0

    def forward(self, o: Tensor, y: Tensor) -> Tensor:
        out = ce(o, y) + self.k * o[:, 0]
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            if not is_fake(o):
                self.k = _carry(o)
        return out


LOSSES = {"object": _Loss, "closure": _closure_loss, "module": _LossModule}


def _next_call_moved(engine, make_loss) -> float | None:
    torch.manual_seed(0)
    model = _Net().to(DT)
    x, y = data()
    got = []
    try:
        for first in (0, 1):
            loss = make_loss()
            clipped_sum(engine(), model, loss, x[first:first + 2], y[first:first + 2])
            got.append(clipped_sum(engine(), model, loss, x[4:], y[4:])[0])
    except (UnsupportedModelError, PrivateBufferError):
        return None
    return float((got[0] - got[1]).norm()) / C


def _chunks_loo(engine, make_loss) -> float | None:
    torch.manual_seed(0)
    model = _Net().to(DT)
    x, y = data()
    try:
        full, _ = clipped_sum(engine(max_physical_batch=1), model, make_loss(), x, y)
        worst = 0.0
        for j in range(x.shape[0]):
            keep = [i for i in range(x.shape[0]) if i != j]
            part, _ = clipped_sum(engine(max_physical_batch=1), model, make_loss(), x[keep],
                                  y[keep])
            worst = max(worst, float((full - part).norm()) / C)
    except (UnsupportedModelError, PrivateBufferError):
        return None
    return worst


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine], ids=["ghost", "auto"])
def test_a_loss_cannot_carry_an_example_into_the_next_call(engine, name):
    moved = _next_call_moved(engine, LOSSES[name])
    print(f"{name}: next call moved {moved} C")
    assert moved is None or moved <= 1e-12, moved


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine], ids=["ghost", "auto"])
def test_chunks_of_one_cannot_read_each_other_through_the_loss(engine, name):
    loo = _chunks_loo(engine, LOSSES[name])
    print(f"{name}: LOO at max_physical_batch=1 {loo} C")
    assert loo is None or loo <= 1 + 1e-9, loo


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine], ids=["ghost", "auto"])
def test_a_literal_made_in_inference_mode_is_refused_not_a_crash(engine):
    """(Sixth review, side finding: ``torch.tensor(0)`` made under ``torch.inference_mode`` in the
    forward crashed the match with "Inference tensors do not track version counter".)"""

    class _Inference(_Net):
        def forward(self, x: Tensor) -> Tensor:
            with torch.inference_mode():
                k = torch.tensor(0.5, dtype=x.dtype)
            return self.fc2(torch.tanh(self.fc1(x))) + k  # (add saves no operand)

    torch.manual_seed(0)
    model = _Inference().to(DT)
    x, y = data()
    try:
        clipped_sum(engine(), model, ce, x, y)
    except (UnsupportedModelError, PrivateBufferError) as exc:
        assert "inference" in str(exc).lower() or "not proven" in str(exc).lower(), exc
