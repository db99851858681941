"""Hundred-and-tenth hostile review: the ghost engine runs a batch-less call without a leading 1
(an Embedding on a 1-D ``arange(T)``, output ``(T, H)``) on a stand-in expanded to ``(B, T, H)``,
and ``BroadcastGuard`` watches every use of it. It looked at the top-level arguments only: the
stand-in passed inside a list (``torch.cat([pe], -1)``) gave an unguarded tensor of the engine's
shape where the user's program (and the batch-size proof) had ``(T, H)``; its element count
(``ones_like(pe2).sum()``: the padded batch times T H) then scaled every example's output, and the
release moved with the batch size: LOO 11.3 C under ghost and auto (11.05 C through
make_private). Now a guarded tensor inside a list or tuple is refused."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dpclip.engine import get_engine
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import loo_distance

T, H, C = 3, 4, 0.01


class _Net(nn.Module):
    def __init__(self, wrap) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pos = nn.Embedding(T, H).double()
        self.fc = nn.Linear(H, 3).double()
        self.register_buffer("ids", torch.arange(T))
        self.wrap = wrap

    def forward(self, x):  # x (B, T, H)
        pe = self.pos(self.ids)
        out = self.fc((x + pe).mean(1))
        if self.wrap is not None:
            n = torch.ones_like(self.wrap(pe)).sum()  # proof: T H; ghost's stand-in: B T H
            out = out * torch.cos(n * (math.pi / (32 * T * H)))
        return out


def _loss(o, y):
    return nn.functional.cross_entropy(o, y, reduction="none")


WRAPS = {
    "cat-list": lambda pe: torch.cat([pe], -1),
    "stack-tuple": lambda pe: torch.stack((pe,)),
    "cat-nested": lambda pe: torch.cat([torch.stack([pe]).squeeze(0)], -1),
}


@pytest.mark.parametrize("engine", ["ghost", "auto"])
@pytest.mark.parametrize("wrap", list(WRAPS))
def test_a_batchless_output_inside_a_list_is_refused_or_bounded(engine, wrap):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(33, T, H, generator=g, dtype=torch.float64)  # 33 -> 32: padded 64 -> 32
    y = torch.randint(0, 3, (33,), generator=g)
    try:
        d = loo_distance(lambda: get_engine(engine), lambda: _Net(WRAPS[wrap]), x, y, C,
                         loss=_loss, exact=True)
    except UnsupportedModelError as exc:
        assert engine == "ghost" and "inside a list or tuple" in str(exc), exc
        return
    assert d <= 1.0 + 1e-6, d  # (11.3 C under ghost and auto before)


def test_the_plain_broadcast_still_runs_on_ghost():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, T, H, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (9,), generator=g)
    d = loo_distance(lambda: get_engine("ghost"), lambda: _Net(None), x, y, C, loss=_loss,
                     exact=True)
    assert d <= 1.0 + 1e-6


class _Holder:
    """Hundred-and-fourteenth hostile review: an object with a __torch_function__ of its own,
    holding the stand-in: torch runs it after the engine's mode, with the mode popped, so it used
    the stand-in unwatched (``torch.cos(_Holder(pe))``: 11.3 C under ghost and auto)."""

    def __init__(self, t) -> None:
        self.t = t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return torch.ones_like(args[0].t).sum()


class _HolderNet(_Net):
    def __init__(self) -> None:
        super().__init__(None)

    def forward(self, x):
        pe = self.pos(self.ids)
        out = self.fc((x + pe).mean(1))
        n = torch.cos(_Holder(pe))  # the holder's code: proof T H; ghost's stand-in: B T H
        return out * torch.cos(n * (math.pi / (32 * T * H)))


@pytest.mark.parametrize("engine", ["ghost", "auto"])
def test_a_batchless_output_held_by_an_object_with_torch_function_is_refused_or_bounded(engine):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(33, T, H, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (33,), generator=g)
    try:
        d = loo_distance(lambda: get_engine(engine), _HolderNet, x, y, C, loss=_loss,
                         exact=True)
    except UnsupportedModelError as exc:
        assert engine == "ghost" and "__torch_function__ of its own" in str(exc), exc
        return
    assert d <= 1.0 + 1e-6, d  # (11.3 C under ghost and auto before)
