"""Fourteenth hostile review (of 87ade37, the per-layer replay of the thirteenth's fix): two ways a
value shaped by the private batch size B reached an example's gradient, each failing on 87ade37.

1. The replay evaluates the proof's numbers for ONE example but read a public tensor with B in a
   non-leading dimension (``zeros(1, B, d)``, passed as an argument or read from a global) whole:
   ``F.reshape(-1, d)`` has no symbolic number, so one example's replay broadcast to B_real rows,
   and ``reshape(B, d, -1).prod(-1)`` (an identity over a size-1 dimension in the real run)
   multiplied them: the replayed gradient was ``B x^B s^(B-1) b``, its direction flipping with the
   parity of B. LOO 3.09 C under ghost and auto (no fallback); with ``sum``, B times the gradient
   (1.29 C). Fixed: the proof records every operation's output shape; an argument or a read whose
   proof shape involves B other than as its rows is refused, and every replayed operation must
   give the proof's shape at one example.
2. The batch-size proof tracked a constant shaped by B only while its shape held B: ``zeros(8, B)``
   with row 0 filled, cut to a B-free ``(1, 1)`` slice and read with ``as_strided`` at storage
   offset 7 (or flattened and sliced ``[7:8]``), gives 1 when B >= 8 and 0 when B = 7, multiplied
   into every example's activation: LOO 2.81 C under ghost and auto (no per-layer module). Fixed:
   a constant shaped by B may not be cut to a shape without B."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dpclip.engine import AutoEngine, GhostEngine, UnsupportedModelError
from tests.engine.helpers import DT
from tests.engine.test_separability_attacks import ce, clipped_sum, data, loo_distance

D = 3
_G: dict = {}


class _Fold(nn.Module):
    """Reads ``F`` (zeros(1, B, d)) as an argument or from ``_G``; ``prod`` or ``sum`` over the
    trailing size-1 dimension."""

    def __init__(self, reduce: str, read: bool) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(D))
        self.reduce, self.read = reduce, read

    def forward(self, x: Tensor, f: Tensor | None = None) -> Tensor:
        f = _G["F"] if self.read else f
        y = x * self.s + f.reshape(-1, x.shape[1])
        y = y.reshape(x.shape[0], x.shape[1], -1)
        return y.prod(-1) if self.reduce == "prod" else y.sum(-1)


class _Net(nn.Module):
    def __init__(self, reduce: str, read: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(5, D)
        self.mid = _Fold(reduce, read)
        self.head = nn.Linear(D, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        f = torch.zeros(1, x.shape[0], D, dtype=x.dtype)  # public: zeros, B in dimension 1
        if self.mid.read:
            _G["F"] = f
            return self.head(self.mid(h))
        return self.head(self.mid(h, f))


class _CutConstant(nn.Module):
    """No per-layer module: a B-shaped constant cut to a B-free element."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc = nn.Linear(5, D)
        self.head = nn.Linear(D, 3)
        self.how = how

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        big = torch.zeros(8, x.shape[0], dtype=x.dtype)
        big[:1].fill_(1.0)  # storage: B ones, then zeros
        if self.how == "as_strided":
            v = torch.as_strided(big[:1, :1], (1,), (1,), 7)
        else:
            v = big.flatten()[7:8]
        return self.head(h * (1.0 + 50.0 * v))


CASES = {
    "argument-prod": lambda: _Net("prod", read=False),
    "argument-sum": lambda: _Net("sum", read=False),
    "global-prod": lambda: _Net("prod", read=True),
    "as_strided-of-a-slice": lambda: _CutConstant("as_strided"),
    "flatten-then-slice": lambda: _CutConstant("flatten"),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine, lambda: GhostEngine(max_physical_batch=3)],
                         ids=["ghost", "auto", "ghost-chunks"])
def test_a_value_shaped_by_the_batch_size_never_reaches_a_gradient(name, engine):
    """Refused, or LOO <= C (87ade37: 3.09 / 1.29 / 3.09 / 2.81 / 2.81 C under ghost and auto)."""
    torch.manual_seed(0)
    model = CASES[name]().to(DT)
    x, y = data()
    try:
        got = loo_distance(engine(), model, ce, x, y)
    except UnsupportedModelError:
        return
    finally:
        _G.clear()
    assert got <= 1.0 + 1e-9, got


@pytest.mark.parametrize("name", list(CASES))
def test_ghost_refuses_and_auto_runs_vmap(name):
    """The refusal names the reason; auto runs vmap (one example at a time: sound)."""
    why = {"argument-prod": "its shape involves the batch size other than as its rows",
           "argument-sum": "its shape involves the batch size other than as its rows",
           "global-prod": "whose shape involves the batch size other than as its rows",
           "as_strided-of-a-slice": "is cut by slice.Tensor to a shape without it",
           "flatten-then-slice": "is cut by slice.Tensor to a shape without it"}[name]
    torch.manual_seed(0)
    model = CASES[name]().to(DT)
    x, y = data()
    try:
        with pytest.raises(UnsupportedModelError, match=why):
            clipped_sum(GhostEngine(), model, ce, x, y)
        _, info = clipped_sum(AutoEngine(), model, ce, x, y)
    finally:
        _G.clear()
    assert info["engine"] == "vmap"
