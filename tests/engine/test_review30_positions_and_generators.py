"""Thirtieth hostile review (of 938b9df):

1. A layer fed a public constant with one row per example whose rows DIFFER (built from
   ``torch.arange(B) % 2``) made each example's gradient a function of its position in the batch:
   a per-layer module ``c * s`` beside ``fc(x)`` (LOO 8.39 C at B 8 under ghost and auto; its
   output marked per-example), a ruled Embedding on ``arange(B) % 2`` (3.13 C), and the same
   through ``frac`` of the layer's output (value 0, gradient not: 5.98 C). Now such a constant is
   refused as a ruled layer's input or a per-layer call's argument (``auto``: vmap, sound).
2. A ``torch.Generator`` held by the model: under vmap one call's draw from it gave example i the
   i-th value of a public sequence (2.90-4.88 C under vmap and auto), and under naive a draw
   count that depends on one example moved the next examples' draws (6.40 C). Now a draw with
   ``generator=`` is refused under vmap and naive, and naive runs every example under default
   generators of its own.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dpclip.engine import AutoEngine, GhostEngine, NaiveEngine, ParamGroups, UnsupportedModelError
from dpclip.engine import VmapEngine
from tests.engine.helpers import DT, Head, ce, clip_weights, loo_distance

D = 4


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(D, dtype=DT) * 0.01)

    def forward(self, c: Tensor) -> Tensor:
        return c * self.s


class _Positions(Head):
    def __init__(self, how: str) -> None:
        super().__init__(D)
        self.how = how
        self.sc = _Scale()
        self.emb = nn.Embedding(2, 3).to(DT)
        with torch.no_grad():
            self.emb.weight.copy_(torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))

    def forward(self, x: Tensor) -> Tensor:
        b = x.shape[0]
        alt = torch.arange(b, device=x.device) % 2
        if self.how == "per-layer":
            c = ((torch.arange(b, dtype=x.dtype, device=x.device) % 2) * 2 - 1)[:, None] \
                .expand(b, D) * 100.0
            return self.fc(x) + self.sc(c)[:, :3]
        if self.how == "embedding":
            return self.fc(x) + self.emb(alt)
        if self.how == "embedding-frac":
            return self.fc(x) + torch.frac(self.emb(alt))
        # honest: the same constant row for every example
        return self.fc(x) + self.emb(torch.zeros(b, dtype=torch.long, device=x.device))


def _data(b: int = 8):
    g = torch.Generator().manual_seed(1)
    return torch.randn(b, D, generator=g, dtype=DT), torch.randint(0, 3, (b,), generator=g)


@pytest.mark.parametrize("how", ["per-layer", "embedding", "embedding-frac"])
def test_a_constant_whose_rows_differ_is_refused_by_ghost(how):
    """938b9df: accepted, LOO 8.39 / 3.13 / 5.98 C at B 8."""
    x, y = _data()
    model = _Positions(how)
    with pytest.raises(UnsupportedModelError, match="position"):
        GhostEngine().compute(model, ce, x, y, clip_weights(0.1), ParamGroups.flat(model))


@pytest.mark.parametrize("how", ["per-layer", "embedding", "embedding-frac"])
def test_auto_runs_it_on_vmap_within_c(how):
    x, y = _data()
    assert loo_distance(AutoEngine, lambda: _Positions(how), x, y, 0.1) <= 1 + 1e-9


def test_the_same_constant_for_every_example_still_runs_on_ghost():
    x, y = _data()
    model = _Positions("honest")
    res = GhostEngine().compute(model, ce, x, y, clip_weights(0.1), ParamGroups.flat(model))
    assert res.engine_info["engine"] == "ghost"
    assert loo_distance(GhostEngine, lambda: _Positions("honest"), x, y, 0.1) <= 1 + 1e-9


class _HeldGenerator(Head):
    def __init__(self, extra: bool) -> None:
        super().__init__(D)
        self.extra = extra
        self.g = torch.Generator().manual_seed(1234)

    def forward(self, x: Tensor) -> Tensor:
        r = torch.rand(x.shape[0], 1, dtype=x.dtype, generator=self.g)
        return self.fc(x * ((r < 0.5) * 2.0 - 1.0))


@pytest.mark.parametrize("engine", [VmapEngine, AutoEngine, NaiveEngine],
                         ids=["vmap", "auto", "naive"])
def test_a_draw_from_a_generator_the_model_holds_is_refused(engine):
    """938b9df: LOO 2.90 C (vmap, B 8), 4.88 C (auto, B 16), 6.40 C (naive, B 16)."""
    x, y = _data()
    model = _HeldGenerator(False)
    with pytest.raises(UnsupportedModelError, match="torch.Generator it holds"):
        engine().compute(model, ce, x, y, clip_weights(0.1), ParamGroups.flat(model))


class _DrawsMore(Head):
    """Under naive: an extra draw from the DEFAULT generator for a large example."""

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[0] == 1 and float(x.abs().max()) > 25:
            torch.rand(1)
        r = torch.rand(x.shape[0], 1, dtype=x.dtype)
        return self.fc(x * ((r < 0.5) * 2.0 - 1.0))


def test_under_naive_one_examples_draws_do_not_move_the_next_ones():
    """938b9df: example 0's extra draw shifted every later example's signs. Now each example has
    generators of its own: replacing example 0 changes only example 0's norm."""
    x, y = _data()
    x *= 3
    big = x.clone()
    big[0] *= 100
    model = _DrawsMore()
    runs = []
    for xs in (x, big):
        torch.manual_seed(7)  # (the chunk's seeds: a direct compute draws them from here)
        runs.append(NaiveEngine().compute(model, ce, xs, y, clip_weights(0.1),
                                          ParamGroups.flat(model)).norms)
    torch.testing.assert_close(runs[0][1:], runs[1][1:], rtol=0, atol=0)
