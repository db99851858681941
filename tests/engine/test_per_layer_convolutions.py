"""Convolutions without a ghost rule (``Conv3d``, ``ConvTranspose1d/2d/3d``) on the per-layer path.

``torch.func.vmap`` batches a convolution's weight gradient by folding the examples into the
channels (``groups = B g``) and passing ``convolution_backward`` a weight made by
``new_empty([]).expand(...)``, which it reads for its shape alone when no input gradient is asked
for. The recomputation's trace took that for a read of uninitialised memory, then the folded
result for a mix of the examples, and refused every such module: ``auto`` stopped the run (the
summary of the eighth session lists it as a false refusal). The trace now knows both, and nothing
more: the weight argument is shape-only only when ``output_mask[0]`` is False, and the folded
gradient is per-example only when the input and the output gradient carry the examples as aligned
channel blocks and the groups split them. Oracle: the float64 per-example loop.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from dpclip.engine import AutoEngine, GhostEngine, ParamGroups, UnsupportedModelError
from dpclip.engine.batch import pad_rows, padded_rows
from dpclip.engine.separable import MIXED, SeparabilityTracer
from tests.engine.helpers import DT, assert_equal_to_the_loop, ce, clip_weights

B = 5


def _y(seed: int = 1) -> Tensor:
    return torch.randint(0, 3, (B,), generator=torch.Generator().manual_seed(seed))


def _x(*shape: int, seed: int = 0) -> Tensor:
    return torch.randn(B, *shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _head(layer: nn.Module, x: Tensor) -> nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        n = layer.to(DT)(x[:1]).numel()
    return nn.Sequential(layer, nn.Tanh(), nn.Flatten(), nn.Linear(n, 3)).to(DT)


CASES = [
    ("conv3d", lambda: nn.Conv3d(2, 3, 2), (2, 3, 3, 3)),
    ("conv3d-groups-stride", lambda: nn.Conv3d(4, 6, (1, 2, 2), stride=2, groups=2,
                                                padding=1, bias=False), (4, 3, 4, 4)),
    ("convT1d", lambda: nn.ConvTranspose1d(2, 3, 2), (2, 3)),
    ("convT1d-groups", lambda: nn.ConvTranspose1d(4, 6, 3, stride=2, groups=2, padding=1,
                                                  output_padding=1, dilation=1), (4, 5)),
    ("convT2d", lambda: nn.ConvTranspose2d(2, 3, 2), (2, 3, 3)),
    ("convT2d-dilated", lambda: nn.ConvTranspose2d(3, 2, 3, stride=2, dilation=2,
                                                   bias=False), (3, 4, 4)),
    ("convT3d", lambda: nn.ConvTranspose3d(2, 2, 2, stride=(1, 2, 1)), (2, 2, 3, 2)),
]


@pytest.mark.parametrize("name, build, shape", CASES, ids=[c[0] for c in CASES])
def test_convolutions_without_a_rule_run_on_ghost_equal_to_the_loop(name, build, shape):
    x, y = _x(*shape), _y()
    model = _head(build(), x)
    for groups in (ParamGroups.flat(model), ParamGroups.per_parameter(model)):
        for engine in (AutoEngine(), GhostEngine(), GhostEngine(max_physical_batch=2)):
            res = engine.compute(model, ce, x, y, clip_weights(0.3), groups)
            assert res.engine_info["engine"] == "ghost", res.engine_info
            assert res.engine_info["fallback"] is None
            assert res.engine_info["per_layer"] == ("0",)
            assert_equal_to_the_loop(res, model, ce, x, y, groups)


class _Frames(nn.Module):
    """Each example is a sequence of 3 frames; the transposed convolution runs on the (B 3)
    frames at once: several rows per example in the module's call."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ConvTranspose1d(2, 3, 2, stride=2)
        self.fc = nn.Linear(3 * 3 * 8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.up(x.flatten(0, 1))  # (B 3, 2, 4) -> (B 3, 3, 8)
        return self.fc(torch.tanh(h).reshape(x.shape[0], -1))


class _TwoConvs(nn.Module):
    """Two convolutions in one module without a rule: the first one's weight gradient passes
    through the second's INPUT gradient, which vmap batches with the examples in ``N`` and a
    shape-only input (fifty-third hostile review: refused, and ``auto`` stopped the run)."""

    def __init__(self, transposed: bool) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(2, 2, 2, 2, 2, dtype=DT) * 0.5)
        self.w2 = nn.Parameter(torch.randn(2, 2, 2, 2, 2, dtype=DT) * 0.5)
        self.transposed = transposed

    def forward(self, x: Tensor) -> Tensor:
        conv = F.conv_transpose3d if self.transposed else F.conv3d
        return conv(torch.tanh(conv(x, self.w1, padding=1)), self.w2)


@pytest.mark.parametrize("transposed", [False, True])
def test_two_convolutions_in_one_module(transposed):
    x, y = _x(2, 3, 3, 3), _y()
    model = _head(_TwoConvs(transposed), x)
    groups = ParamGroups.per_parameter(model)
    for engine in (AutoEngine(), GhostEngine(max_physical_batch=2)):
        res = engine.compute(model, ce, x, y, clip_weights(0.3), groups)
        assert res.engine_info["engine"] == "ghost" and res.engine_info["per_layer"] == ("0",)
        assert_equal_to_the_loop(res, model, ce, x, y, groups)


def test_a_transposed_convolution_over_several_rows_per_example():
    torch.manual_seed(0)
    model = _Frames().to(DT)
    x, y = _x(3, 2, 4), _y()
    groups = ParamGroups.per_parameter(model)
    res = AutoEngine().compute(model, ce, x, y, clip_weights(0.3), groups)
    assert res.engine_info["engine"] == "ghost" and res.engine_info["per_layer"] == ("up",)
    assert_equal_to_the_loop(res, model, ce, x, y, groups)


class _Rolled(nn.Module):
    """A transposed convolution over the batch rolled by one: example i reads example i-1."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ConvTranspose1d(2, 3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.up(x.roll(1, 0))


class _Folded(nn.Module):
    """The batch folded into the channels by the model, one group: every output channel sums
    every example's channels."""

    def __init__(self) -> None:
        super().__init__()
        # (2 channels for each of the rows the engine runs: the batch padded to the row block)
        self.weight = nn.Parameter(torch.randn(2 * padded_rows(B), 3, 2, dtype=DT))

    def forward(self, x: Tensor) -> Tensor:
        return F.conv_transpose1d(x.reshape(1, -1, x.shape[-1]), self.weight
                                  ).expand(x.shape[0], -1, -1)


@pytest.mark.parametrize("inner", [_Rolled, _Folded])
def test_convolutions_that_mix_the_examples_stay_refused(inner):
    torch.manual_seed(0)
    x, y = _x(2, 3), _y()
    mod = inner().to(DT)
    with torch.no_grad():
        n = mod(pad_rows(x, padded_rows(x.shape[0])))[:1].numel()
    model = nn.Sequential(mod, nn.Flatten(), nn.Linear(n, 3)).to(DT)
    for engine in (GhostEngine(), AutoEngine()):
        try:
            res = engine.compute(model, ce, x, y, clip_weights(0.3), ParamGroups.flat(model))
        except UnsupportedModelError:
            continue
        assert res.engine_info["engine"] == "vmap"  # auto: whole-model per-example, sound


def _backward(tr_batch, gy, x, w, groups, transposed, mask, lay_gy=None, lay_x=None):
    """Run ``convolution_backward`` under a tracer with the given layouts; the weight gradient's
    layout (or the violation)."""
    tr = SeparabilityTracer(tr_batch)
    if lay_gy is not None:
        tr.mark(gy, lay_gy)
    if lay_x is not None:
        tr.mark(x, lay_x)
    with tr:
        out = torch.ops.aten.convolution_backward(
            gy, x, w, None, [1], [0], [1], transposed, [0], groups, mask)
    return (tr.layout(out[1]) if out[1] is not None else None), tr.violation


def test_the_folded_weight_gradient_rule_accepts_vmaps_form_only():
    b = 3
    x = torch.randn(1, b * 2, 5, dtype=DT)  # 2 input channels per example
    gy = torch.randn(1, b * 4, 4, dtype=DT)  # 4 output channels per example
    w = torch.empty((), dtype=DT).expand(b * 4, 2, 2)  # vmap's dummy weight: shape only
    ok = dict(lay_gy=(1, 4), lay_x=(1, 2))
    assert _backward(b, gy, x, w, b, False, [False, True, False], **ok) == ((0, 4), None)
    # two groups per example: still one example per group
    w2 = torch.empty((), dtype=DT).expand(b * 4, 1, 2)
    assert _backward(b, gy, x, w2, 2 * b, False, [False, True, False], **ok) == ((0, 4), None)
    # transposed: the weight's rows are the input channels
    wt = torch.empty((), dtype=DT).expand(b * 2, 4, 2)
    gyt = torch.randn(1, b * 4, 6, dtype=DT)
    assert _backward(b, gyt, x, wt, b, True, [False, True, False], **ok) == ((0, 2), None)
    # one group (every output channel reads every example), groups not a multiple of the batch,
    # the batch in N (the weight's gradient sums it), a side without the examples: mixing
    wide = torch.randn(b * 4, b * 2, 2, dtype=DT)
    assert _backward(b, gy, x, wide, 1, False, [False, True, False], **ok)[0] is MIXED
    w4 = torch.randn(b * 4, 3, 2, dtype=DT)
    assert _backward(b, gy, x, w4, 2, False, [False, True, False], **ok)[0] is MIXED
    xn, gn = torch.randn(b, 2, 5, dtype=DT), torch.randn(b, 4, 4, dtype=DT)
    assert _backward(b, gn, xn, torch.randn(4, 2, 2, dtype=DT), 1, False, [False, True, False],
                     lay_gy=(0, 1), lay_x=(0, 1))[0] is MIXED
    assert _backward(b, gy, x, w, b, False, [False, True, False], lay_gy=(1, 4))[0] is MIXED


def test_the_input_gradient_rule():
    b = 3
    gy = torch.randn(b * 2, 4, 4, dtype=DT)  # the examples in N, 2 rows each
    x = torch.empty((), dtype=DT).expand(b * 2, 2, 5)  # vmap's dummy input: shape only
    w = torch.randn(4, 2, 2, dtype=DT)
    mask = [True, False, False]
    tr = SeparabilityTracer(b)
    tr.mark(gy, (0, 2))
    with tr:
        out = torch.ops.aten.convolution_backward(gy, x, w, None, [1], [0], [1], False, [0], 1,
                                                  mask)
    assert tr.layout(out[0]) == (0, 2) and tr.violation is None
    # the weight from the examples, or the examples not in N: mixing
    assert _backward(b, gy, x, w, 1, False, mask, lay_gy=(1, 2))[0] is None  # (no weight grad)
    tr = SeparabilityTracer(b)
    tr.mark(gy, (0, 2))
    tr.mark(w, (0, 1))
    with tr:
        out = torch.ops.aten.convolution_backward(gy, x, w.expand(4, 2, 2), None, [1], [0], [1],
                                                  False, [0], 1, mask)
    assert tr.layout(out[0]) is MIXED
    # an uninitialised input is read when the weight's gradient is asked for too
    tr = SeparabilityTracer(b)
    tr.mark(gy, (0, 2))
    with tr:
        xe = torch.empty(b * 2, 2, 5, dtype=DT)
        torch.ops.aten.convolution_backward(gy, xe, w, None, [1], [0], [1], False, [0], 1,
                                            [True, True, False])
    assert tr.violation is not None and "torch.empty" in tr.violation


def test_the_weight_is_shape_only_only_when_no_input_gradient_is_asked():
    b = 3
    x = torch.randn(1, b * 2, 5, dtype=DT)
    gy = torch.randn(1, b * 4, 4, dtype=DT)
    tr = SeparabilityTracer(b)
    tr.mark(gy, (1, 4))
    tr.mark(x, (1, 2))
    with tr:
        w = torch.empty(b * 4, 2, 2, dtype=DT)  # uninitialised memory
        torch.ops.aten.convolution_backward(gy, x, w, None, [1], [0], [1], False, [0], b,
                                            [True, True, False])
    assert tr.violation is not None and "torch.empty" in tr.violation
    tr = SeparabilityTracer(b)
    tr.mark(gy, (1, 4))
    tr.mark(x, (1, 2))
    with tr:
        w = torch.empty(b * 4, 2, 2, dtype=DT)
        torch.ops.aten.convolution_backward(gy, x, w, None, [1], [0], [1], False, [0], b,
                                            [False, True, False])
    assert tr.violation is None
