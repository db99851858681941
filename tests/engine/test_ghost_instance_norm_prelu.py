"""``InstanceNorm1d/2d/3d`` and ``PReLU`` on ghost (the per-layer path for their parameters).

Before: both sent every model to whole-model vmap under ``auto`` ("the input of layer ... mixes
the examples"): ``_prelu_kernel`` had no separability rule, and ``F.instance_norm`` runs a
training-mode ``native_batch_norm`` on the examples folded into the channels (``(1, B C, ...)``),
which the batch-norm rule refused. Now ``_prelu_kernel`` and its backward are elementwise (with the
pointwise rule's check of constants that meet the batch dimension), and a batch norm on the
examples folded into the channels is per example (each channel's statistics come from one example)
when its weight, bias and running statistics are the same for every example, and running
statistics are not updated from the batch. Oracle: the float64 per-example loop.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dpclip.engine import AutoEngine, GhostEngine, ParamGroups, UnsupportedModelError
from dpclip.engine.separable import MIXED, SeparabilityTracer
from tests.engine.helpers import DT, assert_equal_to_the_loop, ce, clip_weights

B = 5


def _data(*shape: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, *shape, generator=g, dtype=DT),
            torch.randint(0, 3, (B,), generator=g))


def _check(model: nn.Module, x: Tensor, y: Tensor, per_layer: tuple[str, ...]) -> None:
    for groups in (ParamGroups.flat(model), ParamGroups.per_parameter(model)):
        for engine in (AutoEngine(), GhostEngine(), GhostEngine(max_physical_batch=2)):
            res = engine.compute(model, ce, x, y, clip_weights(0.3), groups)
            assert res.engine_info["engine"] == "ghost" and res.engine_info["fallback"] is None
            assert (res.engine_info.get("per_layer") or ()) == per_layer
            assert_equal_to_the_loop(res, model, ce, x, y, groups)


NORMS = [
    (nn.InstanceNorm1d, (2, 7), dict(affine=True)),
    (nn.InstanceNorm1d, (2, 7), dict()),
    (nn.InstanceNorm2d, (2, 5, 5), dict(affine=True)),
    (nn.InstanceNorm3d, (2, 3, 4, 4), dict(affine=True, eps=1e-3)),
]


@pytest.mark.parametrize("norm, shape, kw", NORMS, ids=[f"{n.__name__}-{k}" for n, _, k in NORMS])
def test_instance_norm_runs_on_ghost_equal_to_the_loop(norm, shape, kw):
    x, y = _data(*shape)
    torch.manual_seed(0)
    conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[len(shape) - 2](2, 3, 2).to(DT)
    with torch.no_grad():
        n = conv(x[:1]).numel()
    model = nn.Sequential(conv, norm(3, **kw), nn.Tanh(), nn.Flatten(), nn.Linear(n, 3)).to(DT)
    if kw.get("affine"):
        with torch.no_grad():  # not the identity
            model[1].weight.uniform_(0.5, 1.5)
            model[1].bias.uniform_(-0.5, 0.5)
    convs = ("0",) if len(shape) == 4 else ()  # (Conv3d has no ghost rule: per-layer too)
    _check(model, x, y, convs + (("1",) if kw.get("affine") else ()))


def test_instance_norm_with_running_statistics():
    """Eval mode reads the running statistics (constants): per example. Training mode writes the
    batch's statistics into them: refused by ghost (the module's buffers would carry the mean
    over the examples), and ``auto`` does not run it on ghost."""
    x, y = _data(2, 7)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 3, 2), nn.InstanceNorm1d(3, affine=True,
                                                                 track_running_stats=True),
                          nn.Flatten(), nn.Linear(18, 3)).to(DT)
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    model.eval()
    _check(model, x, y, ("1",))
    model.train()
    with pytest.raises(UnsupportedModelError):
        GhostEngine().compute(model, ce, x, y, clip_weights(0.3), ParamGroups.flat(model))


PRELUS = [
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.PReLU(), nn.Linear(4, 3)), (4,)),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.PReLU(4, init=0.1), nn.Linear(4, 3)), (4,)),
    (lambda: nn.Sequential(nn.Conv2d(2, 3, 2), nn.PReLU(3), nn.Flatten(), nn.Linear(27, 3)),
     (2, 4, 4)),
]


@pytest.mark.parametrize("build, shape", PRELUS)
def test_prelu_runs_on_ghost_equal_to_the_loop(build, shape):
    x, y = _data(*shape)
    torch.manual_seed(0)
    model = build().to(DT)
    with torch.no_grad():
        model[1].weight.uniform_(-0.5, 0.5)
    _check(model, x, y, ("1",))


def _layouts(fn, *marked):
    tr = SeparabilityTracer(B)
    for t, lay in marked:
        tr.mark(t, lay)
    with tr:
        out = fn()
    outs = out if isinstance(out, tuple) else (out,)
    return [tr.layout(o) for o in outs]


def test_prelu_rule_checks_the_weight_where_it_meets_the_batch():
    x = torch.randn(3, B, 4, dtype=DT)  # the examples in dim 1, the channels PReLU addresses
    same = torch.full((1, B, 1), 0.25, dtype=DT)
    differs = torch.linspace(0.1, 0.9, B, dtype=DT).view(1, B, 1)
    prelu = torch.ops.aten._prelu_kernel.default
    assert _layouts(lambda: prelu(x, same), (x, (1, 1))) == [(1, 1)]
    assert _layouts(lambda: prelu(x, differs), (x, (1, 1))) == [MIXED]
    x0 = torch.randn(B, 3, 4, dtype=DT)
    assert _layouts(lambda: prelu(x0, torch.rand(1, 3, 1, dtype=DT)), (x0, (0, 1))) == [(0, 1)]


def test_instance_norm_rule():
    """The examples folded into the channels: per example when the affine parameters and running
    statistics are the same for every example and not updated from the batch."""
    k = 2
    x = torch.randn(1, B * k, 6, dtype=DT)
    bn = torch.ops.aten.native_batch_norm.default
    w_same, b_same = torch.rand(k, dtype=DT).repeat(B), torch.rand(k, dtype=DT).repeat(B)
    w_diff = torch.rand(B * k, dtype=DT)
    rm, rv = torch.zeros(B * k, dtype=DT), torch.ones(B * k, dtype=DT)
    lay = (x, (1, k))
    assert _layouts(lambda: bn(x, w_same, b_same, None, None, True, 0.1, 1e-5), lay) == \
        [(1, k), (0, k), (0, k)]
    assert _layouts(lambda: bn(x, None, None, None, None, True, 0.1, 1e-5), lay)[0] == (1, k)
    assert _layouts(lambda: bn(x, w_diff, b_same, None, None, True, 0.1, 1e-5), lay)[0] is MIXED
    assert _layouts(lambda: bn(x, w_same, b_same, rm, rv, True, 0.1, 1e-5), lay)[0] is MIXED
    rm, rv = torch.zeros(B * k, dtype=DT), torch.ones(B * k, dtype=DT)  # (written just above)
    assert _layouts(lambda: bn(x, w_same, b_same, rm, rv, False, 0.1, 1e-5), lay) == \
        [(1, k), None, None]
    # the examples in N (a batch norm over the batch, training): mixing
    xb = torch.randn(B, k, 6, dtype=DT)
    assert _layouts(lambda: bn(xb, None, None, None, None, True, 0.1, 1e-5), (xb, (0, 1)))[0] \
        is MIXED
