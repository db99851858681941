"""A module on the per-layer path whose call contains normalisation layers (a model with a parameter
of its own at the root: its call is the whole forward, as a learned position table added in the
root's ``forward`` makes it).

Its replay runs the normalisations' backwards under vmap, where autograd also forms the gradients
of the children's weights (summed over the rows); ``native_layer_norm_backward`` and its group and
batch norm siblings had no separability rule, so the replay was "not proved" and ``auto`` stopped
the run (the benchmark's ``nn.TransformerEncoder`` classifier with a learned position table).
``auto`` runs such a model on vmap, for its cost (``GhostEngine._root_cost``). Oracle: the float64
per-example loop.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dpclip.engine import AutoEngine, GhostEngine, ParamGroups
from dpclip.engine.separable import MIXED, SeparabilityTracer
from tests.engine.helpers import DT, assert_equal_to_the_loop, ce, clip_weights

B = 5


class RootParam(nn.Module):
    """A parameter used in the root's own forward, around a normalised body."""

    def __init__(self, body: nn.Module, shape: tuple[int, ...]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pos = nn.Parameter(torch.randn(*shape) * 0.1)
        self.body = body
        self.to(DT)

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x + self.pos)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.fc = nn.Linear(8, 3)

    def forward(self, h: Tensor) -> Tensor:
        return self.fc(self.enc(h).mean(1))


def _bn_eval() -> nn.Module:
    m = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.Tanh(), nn.Flatten(),
                      nn.Linear(4 * 4 * 4, 3))
    with torch.no_grad():
        m[1].running_mean.uniform_(-0.5, 0.5)
        m[1].running_var.uniform_(0.5, 2.0)
    return m.eval()


CASES = {
    "layer-norm": (lambda: nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(),
                                         nn.Linear(6, 3)), (4,), (4,)),
    "group-norm": (lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.Tanh(),
                                         nn.Flatten(), nn.Linear(4 * 4 * 4, 3)),
                   (2, 6, 6), (1, 6, 6)),
    "eval-batch-norm": (_bn_eval, (2, 6, 6), (1, 6, 6)),
    "transformer-encoder": (Encoder, (6, 8), (1, 6, 8)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_root_parameter_around_normalisations_runs_on_ghost(name):
    build, shape, pshape = CASES[name]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(B, *shape, generator=g, dtype=DT), torch.randint(0, 3, (B,), generator=g)
    model = RootParam(build(), pshape)
    for groups in (ParamGroups.flat(model), ParamGroups.per_parameter(model)):
        for engine in (GhostEngine(), GhostEngine(max_physical_batch=2)):
            res = engine.compute(model, ce, x, y, clip_weights(0.3), groups)
            assert res.engine_info["engine"] == "ghost", res.engine_info
            assert res.engine_info["per_layer"][0] == "<root>"
            assert_equal_to_the_loop(res, model, ce, x, y, groups)
        # auto: the root's replay is the whole forward per example, vmap's work and more
        res = AutoEngine().compute(model, ce, x, y, clip_weights(0.3), groups)
        assert res.engine_info["engine"] == "vmap"
        assert res.engine_info["fallback"].startswith("cost: the root module")
        assert_equal_to_the_loop(res, model, ce, x, y, groups, engine="vmap")


def _grad_input_layout(fn, marked) -> object:
    tr = SeparabilityTracer(B)
    for t, lay in marked:
        tr.mark(t, lay)
    with tr:
        out = fn()
    return tr.layout(out[0]), [tr.layout(o) if o is not None else None for o in out[1:]]


def test_the_backward_rules_read_the_rows_only_where_the_forward_does():
    aten = torch.ops.aten
    x = torch.randn(B, 3, 4, dtype=DT)
    w, b = torch.randn(4, dtype=DT), torch.randn(4, dtype=DT)
    _, mean, rstd = aten.native_layer_norm(x, [4], w, b, 1e-5)
    go = torch.randn_like(x)
    lays = [(go, (0, 1)), (x, (0, 1)), (mean, (0, 1)), (rstd, (0, 1))]
    got = _grad_input_layout(
        lambda: aten.native_layer_norm_backward(go, x, [4], mean, rstd, w, b, [True] * 3), lays)
    assert got == ((0, 1), [MIXED, MIXED])  # the weight's and bias's gradients sum the rows
    # the examples inside the normalised dimensions: a row's statistics read several examples
    xt = x.transpose(0, 2).contiguous()  # (4, 3, B)
    _, m2, r2 = aten.native_layer_norm(xt, [3, B], None, None, 1e-5)
    got = _grad_input_layout(
        lambda: aten.native_layer_norm_backward(torch.randn_like(xt), xt, [3, B], m2, r2, None,
                                                None, [True, False, False]),
        [(xt, (2, 1))])
    assert got[0] is MIXED
    # a weight computed from the examples, a training batch norm: mixing
    wd = torch.randn(4, dtype=DT)
    got = _grad_input_layout(
        lambda: aten.native_layer_norm_backward(go, x, [4], mean, rstd, wd, b, [True] * 3),
        lays + [(wd, (0, 1))])
    assert got[0] is MIXED
    xc = torch.randn(B, 4, 3, dtype=DT)
    rm, rv = torch.zeros(4, dtype=DT), torch.ones(4, dtype=DT)
    sm, sv = torch.zeros(4, dtype=DT), torch.ones(4, dtype=DT)
    gc = torch.randn_like(xc)
    for train, want in ((False, (0, 1)), (True, MIXED)):
        got = _grad_input_layout(
            lambda: aten.native_batch_norm_backward(gc, xc, None, rm, rv, sm, sv, train, 1e-5,
                                                    [True, False, False]),
            [(xc, (0, 1)), (gc, (0, 1))])
        assert got[0] == want
    # a constant output gradient that differs from one example's rows to the next (fifty-eighth
    # review: the constants among the data arguments were not checked)
    got = _grad_input_layout(
        lambda: aten.native_batch_norm_backward(gc, xc, None, rm, rv, sm, sv, False, 1e-5,
                                                [True, False, False]), [(xc, (0, 1))])
    assert got[0] is MIXED
    got = _grad_input_layout(
        lambda: aten.native_layer_norm_backward(go, x, [4], mean, rstd, w, b, [True] * 3),
        lays[1:])
    assert got[0] is MIXED


def test_batch_norm_backward_on_the_examples_folded_into_the_channels():
    """vmap's batching of a batch norm (and an instance norm) folds the examples into the
    channels: per example when the per-channel tensors are the same for every example."""
    aten = torch.ops.aten
    k = 2
    x = torch.randn(1, B * k, 3, dtype=DT)
    same = torch.rand(k, dtype=DT).repeat(B)
    differs = torch.rand(B * k, dtype=DT)
    empty = torch.empty(0, dtype=DT)
    gx = torch.randn_like(x)
    for w, want in ((same, (1, k)), (differs, MIXED)):
        got = _grad_input_layout(
            lambda: aten.native_batch_norm_backward(gx, x, w, same, same + 1, empty, empty,
                                                    False, 1e-5, [True, False, False]),
            [(x, (1, k)), (gx, (1, k))])
        assert got[0] == want


def test_unsqueeze_in_place_keeps_the_rows():
    x = torch.randn(B, 3, dtype=DT)
    tr = SeparabilityTracer(B)
    tr.mark(x, (0, 1))
    with tr:
        y = x.clone()
        y.unsqueeze_(0)
        z = x.clone()
        z.unsqueeze_(-1)
    assert tr.layout(y) == (1, 1) and tr.layout(z) == (0, 1)
