"""Eighteenth hostile review (of fef86b2), each test failing there: decisions of the per-layer path
taken on a tensor's real first size, so that they changed at the one private batch size equal to
a size of the model (a side channel: ghost refused, and ``auto`` stopped the run, at B == T only).

1. A per-layer module (no ghost rule) reads a public, batch-free ``(T, d)`` table made earlier in
   the same forward and kept in a global (not an argument, not model state).
   ``per_layer.settle_call`` took a non-state read whose real first size equalled the rows for
   example data: refused at B == T, accepted (and right) at every other B. Now the proof's shape
   decides: accepted at every B, equal to the float64 per-example loop at B == T too.
2. A per-layer module returns a public ``(T, d)`` output besides its batched one: refused at every
   B, but by a different check (and message) at B == T, where the output's real first size made it
   look batch-first. Now the proof's shape decides which outputs are batch-first: one message.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dpclip.engine import AutoEngine, GhostEngine, ParamGroups, UnsupportedModelError
from tests.engine.helpers import DT, assert_equal_to_the_loop, ce, clip_weights

C = 0.5
T, D = 4, 3
_TABLES: dict[str, Tensor] = {}


class _ReadsTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, D, dtype=DT))

    def forward(self, h: Tensor) -> Tensor:
        return torch.tanh(h * self.s + _TABLES["tab"])


class _GlobalTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(D, D).to(DT)
        self.m = _ReadsTable()
        self.head = nn.Linear(D, 3).to(DT)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, T, D)
        _TABLES["tab"] = torch.sin(torch.arange(T * D, dtype=DT).view(T, D))
        return self.head(self.m(self.fc(x)).mean(1))


def _data(b: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(b)
    return torch.randn(b, T, D, generator=g, dtype=DT), torch.randint(0, 3, (b,), generator=g)


@pytest.mark.parametrize("b", [3, T, 5])
@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine], ids=["ghost", "auto"])
def test_a_public_table_read_by_a_per_layer_module_is_accepted_at_every_batch_size(b, engine):
    """fef86b2: refused at B == T only (ghost; auto stopped the run there)."""
    x, y = _data(b)
    model = _GlobalTable()
    groups = ParamGroups.flat(model)
    res = engine().compute(model, ce, x, y, clip_weights(C), groups)
    assert_equal_to_the_loop(res, model, ce, x, y, groups)


class _ReturnsTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, D, dtype=DT))
        self.tab = nn.Parameter(torch.randn(T, D, dtype=DT))

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor]:
        return torch.tanh(h * self.s), self.tab * 2.0


class _TableOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(D, D).to(DT)
        self.m = _ReturnsTable()
        self.head = nn.Linear(D, 3).to(DT)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, D)
        h, tab = self.m(self.fc(x))
        return self.head(h) + tab.mean()


class _TableUnused(_TableOut):
    def forward(self, x: Tensor) -> Tensor:  # x: (B, D)
        h, _ = self.m(self.fc(x))
        return self.head(h)


def test_an_unused_public_output_of_a_per_layer_module_is_dropped_alike_at_every_batch_size():
    """The table output reaches no loss: the proof has no name for it (dead code), so the call's
    live outputs are its others (``ghost_rules._dead_outputs``); the same at every B, B == T
    included, and equal to the loop (it was refused at every B before, with another check's
    message at B == T: fef86b2)."""
    for b in (3, T, 5):
        g = torch.Generator().manual_seed(b)
        x, y = torch.randn(b, D, generator=g, dtype=DT), torch.randint(0, 3, (b,), generator=g)
        model = _TableUnused()
        groups = ParamGroups.flat(model)
        res = GhostEngine().compute(model, ce, x, y, clip_weights(C), groups)
        assert res.engine_info["per_layer"] == ("m",)
        assert_equal_to_the_loop(res, model, ce, x, y, groups)


def test_a_public_output_of_a_per_layer_module_is_refused_alike_at_every_batch_size():
    """fef86b2: refused at every B, with another check's message at B == T."""
    messages = set()
    for b in (3, T, 5):
        g = torch.Generator().manual_seed(b)
        x, y = torch.randn(b, D, generator=g, dtype=DT), torch.randint(0, 3, (b,), generator=g)
        model = _TableOut()
        with pytest.raises(UnsupportedModelError) as err:
            GhostEngine().compute(model, ce, x, y, clip_weights(C), ParamGroups.flat(model))
        messages.add(str(err.value))
    assert len(messages) == 1, messages
    assert "first dimension is not the batch" in messages.pop()
