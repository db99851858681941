"""Hundred-and-forty-fourth hostile review (the bound-based strategies): (1) with per-layer noise
the event was ``num_layers`` Gaussians, a field set once (by ``bind`` or by the user) and never
compared with the blocks the certificate noises: ``num_layers=1`` on an 8-layer chain (or a tie
undone between steps) released 8 Gaussians against 1 recorded (2.83 times the recorded
sensitivity; epsilon 21.0 spent against 2.23 recorded over 10 steps); (2) ``nn.AvgPool2d`` with a
negative ``divisor_override`` is a non-positive map whose clamped Schur maxima certified Lipschitz
0: the layers before it released without noise (2.29 times the declared sensitivity); (3) a
``TemperedSigmoid`` whose constants were made negative after construction certified a negative
Lipschitz constant (5.24 times). Each is refused now."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpclip.lipschitz.bounds import UnsupportedLayerError
from dpclip.lipschitz.layers import LipGroupNorm
from dpclip.lipschitz.strategy import LipDpSgd
from dpclip.models.activations import TemperedSigmoid

DT = torch.float64


def _certify(model, shape, **kw):
    s = LipDpSgd(input_norm=5.0, **kw)
    return s.certify(model, s.loss(), shape, s.init_state())[1]


def _chain(n=8):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(2, 2) for _ in range(n)]).to(DT)


def test_per_layer_noise_refuses_a_block_count_other_than_planned():
    with pytest.raises(ValueError, match="num_layers=1 noise blocks but the model now certifies 8"):
        _certify(_chain(), (2,), noise="per-layer", num_layers=1)
    # the same through bind: planned from the model, then a tie undone between steps
    torch.manual_seed(0)
    tied = _chain(3)
    tied[1].weight = tied[0].weight
    tied[2].weight = tied[0].weight
    s = LipDpSgd(input_norm=5.0, noise="per-layer").bind(tied, (2,))
    assert s.num_layers == 1
    tied[1].weight = nn.Parameter(tied[0].weight.detach().clone(), requires_grad=False)
    tied[2].weight = nn.Parameter(tied[0].weight.detach().clone(), requires_grad=False)
    with pytest.raises(ValueError, match="certifies 3"):
        s.certify(tied, s.loss(), (2,), s.init_state())
    assert len(_certify(_chain(), (2,), noise="per-layer", num_layers=8).layer_sensitivities) == 8


def test_a_negative_pool_divisor_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.AvgPool2d(2, divisor_override=-4),
                          nn.Flatten(), nn.Linear(32, 2)).to(DT)
    with pytest.raises(UnsupportedLayerError, match="divisor_override must be a positive"):
        _certify(model, (1, 8, 8))
    model[1] = nn.AvgPool2d(2, divisor_override=4)
    assert _certify(model, (1, 8, 8)).layer_sensitivities  # (a positive divisor: certified)


@pytest.mark.parametrize("attr, value", [("scale", -2.0), ("inverse_temperature", -2.0),
                                         ("scale", float("nan")), ("offset", float("inf"))])
def test_tempered_sigmoid_constants_are_checked_at_every_certificate(attr, value):
    torch.manual_seed(0)
    act = TemperedSigmoid()
    model = nn.Sequential(nn.Linear(4, 6), act, nn.Linear(6, 2)).to(DT)
    _certify(model, (4,))
    setattr(act, attr, value)
    with pytest.raises(UnsupportedLayerError, match=f"{attr}="):
        _certify(model, (4,))


def test_norm_layers_constants_are_checked_at_every_certificate():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), LipGroupNorm(2, 1.0), nn.Linear(4, 2)).to(DT)
    _certify(model, (4,))
    model[1].lipschitz = -1.0
    with pytest.raises(UnsupportedLayerError, match="lipschitz=-1.0"):
        _certify(model, (4,))


# ---------------------------------------------------------------- review 151: input clipping

@pytest.mark.parametrize("dtype, x0, value", [
    (torch.float32, 0.503 * 2.0 ** -149, 2.0 ** -149),  # X_0 between two subnormals
    (torch.float16, 0.503 * 2.0 ** -24, 2.0 ** -24),
    (torch.bfloat16, 1.0 + 2.0 ** -8 + 1e-4, 3.0),      # the factor rounds up to 1 + 2^-7
])
def test_clipped_inputs_never_exceed_the_input_norm(dtype, x0, value):
    """Hundred-and-fifty-first hostile review: ``clip_inputs`` rounded the factor and the product
    in the inputs' dtype: a bfloat16 example came out at 1.0039 X_0, a subnormal one at 1.99 X_0
    (the certificate assumes ||x|| <= X_0): 1.99 times the certified sensitivity through
    make_private. Every clipped example's norm is at most X_0 now, as it is in its dtype."""
    from dpclip.lipschitz.strategy import clip_inputs

    x = torch.zeros(3, 4, dtype=dtype)
    x[0, 0] = value
    x[1] = torch.tensor([value, -value, value / 2, 0.0], dtype=torch.float64).to(dtype)
    x[2, 1] = float("nan")
    out = clip_inputs(x, x0)
    assert out.dtype == dtype
    assert float(out.double().norm(dim=1).max()) <= x0  # (before: 1.988 X_0, 1.0039 X_0)
