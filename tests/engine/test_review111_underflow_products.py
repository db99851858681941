"""Hundred-and-eleventh hostile review: weighted products that underflow. A weight that is a
normal float32 (6e-37) times a flushed output gradient (2^-30) gave ``w b`` of order 2^-149,
rounded by an ABSOLUTE amount (0.51 -> 1, 0.49 -> 0 in units of 2^-149), which the book-keeping
product then multiplied by inputs of 2^40: two positions meant to cancel did not, and the summed
vector was 50 times the weighted gradient (LOO 50 C at C = 2.5e-34 under ghost, auto and compiled,
through make_private too). Under vmap and naive the products ``w g`` of a formed gradient rounded
0.571 * 2^-149 up to 2^-149 (1.75 C at a subnormal C). The engines' underflow term was added to
the norm, then multiplied by the weight: it covered nothing for tiny weights. Now a weight below
``tiny / flush`` is 0 in the ghost engine (``w b`` is then normal), and a weight below ``eps`` is
lowered by ``absolute / norm`` (``_common.underflow_margin``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpclip.engine import GhostEngine, ParamGroups, get_engine

D, K, BETA = 64, 2.0 ** 40, 2.0 ** -30
COEF = torch.tensor([0.51, -0.49]) * BETA
#: the weight makes w * 0.51 BETA = 0.51 * 2^-149; C = w |G|, |G| = 0.02 BETA K sqrt(D)
C_SEQ = (2.0 ** -149 / BETA) * K * BETA * 0.02 * D ** 0.5


def _seq_loss(out, y):  # out (B, 2, 1): the two positions' output gradients cancel 51:49
    return (out[..., 0] * COEF).sum(1)


def _loo(eng, make, loss, x, y, c) -> float:
    def weights(n):
        return torch.where(n > 0, torch.clamp(c / n, max=1.0), torch.ones_like(n))

    def release(xs, ys):
        m = make()
        res = eng.compute(m, loss, xs, ys, weights, ParamGroups.flat(m))
        return torch.cat([g.double().reshape(-1) for g in res.grads.values()])

    full = release(x, y)
    worst = 0.0
    for j in range(x.shape[0]):
        keep = [i for i in range(x.shape[0]) if i != j]
        d = full - release(x[keep], y[keep])
        top = float(d.abs().max())
        worst = max(worst, (top * float((d / top).norm()) if top > 0 else 0.0) / c)
    return worst


def _linear_seq():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 1, bias=False))


def _conv_seq():
    torch.manual_seed(0)
    return _ConvSeq()


class _ConvSeq(nn.Module):
    """The same on a Conv1d: (B, D, 2) in, (B, 2, 1) out."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(D, 1, 1, bias=False)

    def forward(self, x):
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


@pytest.mark.parametrize("engine", ["ghost", "auto", "compiled", "ghost-ghost", "ghost-direct",
                                    "vmap", "naive"])
@pytest.mark.parametrize("make", [_linear_seq, _conv_seq], ids=["linear", "conv1d"])
def test_book_keeping_products_that_underflow_stay_inside_the_bound(engine, make):
    assert C_SEQ >= torch.finfo(torch.float32).tiny  # a normal float32 clip norm
    eng = GhostEngine(norm_mode=engine.split("-")[1]) if "-" in engine else get_engine(engine)
    x, y = torch.full((3, 2, D), K), torch.zeros(3)
    assert _loo(eng, make, _seq_loss, x, y, C_SEQ) <= 1.0 + 1e-6  # (50.0 C before)


@pytest.mark.parametrize("engine", ["ghost", "auto", "compiled", "vmap", "naive"])
def test_weighted_products_that_underflow_stay_inside_the_bound(engine):
    c = 4 * 2.0 ** -149  # a float32 subnormal clip norm; the weights c / N ~ 8e-37 are normal

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(1, 49, bias=False))

    def loss(out, y):
        return (out * 1e-9).sum(1)

    assert _loo(get_engine(engine), make, loss, torch.ones(3, 1), torch.zeros(3), c) \
        <= 1.0 + 1e-6  # (1.75 C before)


def test_the_margin_leaves_ordinary_weights_alone_and_lowers_tiny_ones_below_the_bound():
    from dpclip.engine._common import underflow_margin

    w = torch.tensor([1.0, 0.25, 1e-30, 1e-40, 0.0])
    n = torch.tensor([1.0, 4.0, 1e30, 1e-3, 1.0])
    got = underflow_margin(w, n, absolute=1e-31, covered=2.0 ** -23, zero_below=2.0 ** -86)
    assert got[:2].tolist() == w[:2].tolist()  # at eps and above: the same values
    # below: w' n + absolute <= w n (in float64), never negative; below zero_below: 0
    assert float(got[2]) * 1e30 + 1e-31 <= float(w[2]) * 1e30
    assert got[3] == 0 and got[4] == 0
    assert underflow_margin(w[:2], n[:2], 1.0, 2.0 ** -23) is w[:2] or \
        torch.equal(underflow_margin(w[:2], n[:2], 1.0, 2.0 ** -23), w[:2])
