"""The operator-norm cache: a speed-up that must never under-estimate a norm."""

import math

import torch
from torch import nn

from dpclip.clipping import make_strategy
from dpclip.lipschitz import bounds as B
from dpclip.lipschitz.losses import TemperedCrossEntropy
from dpclip.lipschitz.norms import conv2d_operator_norm_bound, linear_operator_norm_bound


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 8), nn.ReLU(), nn.Linear(8, 3))


def bound(m, reuse=True):
    return B.lipschitz_bounds(m, TemperedCrossEntropy(1.0), input_shape=(1, 6, 6),
                              input_norm_bound=2.0, reuse_norms=reuse)


def test_cache_hit_equals_fresh_computation_and_tracks_in_place_changes(monkeypatch):
    m = model()
    first = bound(m)
    calls = []
    real = B.linear_operator_norm_bound
    monkeypatch.setattr(B, "linear_operator_norm_bound", lambda l: calls.append(l) or real(l))
    again = bound(m)
    assert calls == []  # unchanged weights: served from the cache
    assert again.grad_bound == first.grad_bound
    with torch.no_grad():  # an optimizer-like in-place update invalidates the entry
        m[3].weight.add_(0.5)
    changed = bound(m)
    assert len(calls) == 1
    assert changed.layers[1].operator_norm == linear_operator_norm_bound(m[3]).value
    bound(m, reuse=False)  # the default: always computed afresh
    assert len(calls) == 3  # both linear layers


def test_rescaled_bound_is_a_proven_upper_bound():
    m = model()
    for factor in (0.3, 0.999, 1.7):
        bound(m, reuse=False)  # fresh norms recorded; the rescale carries them over once
        B.rescale_weight_(m[3].weight, factor)
        B.rescale_weight_(m[0].weight, factor)
        cached = bound(m)
        fresh_lin = linear_operator_norm_bound(m[3]).value
        fresh_conv = conv2d_operator_norm_bound(m[0], (6, 6)).value
        assert cached.layers[1].operator_norm >= fresh_lin
        assert cached.layers[1].operator_norm <= fresh_lin * (1 + 2e-4)
        # the conv bound is a proven bound (not the exact norm): the carried value stays within
        # the slack of a fresh computation of the same proven bound
        assert math.isclose(cached.layers[0].operator_norm, fresh_conv, rel_tol=2e-4)
        # and never below the true spectral norm of the linear layer
        assert cached.layers[1].operator_norm >= torch.linalg.matrix_norm(
            m[3].weight.detach().double(), ord=2).item()


def test_freed_weights_do_not_lend_their_entries():
    for _ in range(3):
        m = model()
        with torch.no_grad():
            m[3].weight.mul_(torch.rand(()).item() + 0.5)
        got = bound(m).layers[1].operator_norm
        assert got == linear_operator_norm_bound(m[3]).value


def test_lip_step_certificate_after_weight_clipping_is_sound():
    m = model()
    s = make_strategy("fix-lip-dp-sgd", {"input_norm": 2.0, "weight_bound": 0.5}).bind(m, (1, 6, 6))
    st = s.init_state()
    s.post_step(m, st, input_shape=(1, 6, 6))  # rescales every weight to the bound
    _, cert = s.certify(m, s.loss(), (1, 6, 6), st)
    for layer in cert.bound.layers:
        assert layer.operator_norm >= 0.5 and layer.operator_norm <= 0.5 * (1 + 2e-4)
    assert m[3].weight.detach().double().norm(p=2).item() >= 0  # weights still finite
    assert linear_operator_norm_bound(m[3]).value <= 0.5 * (1 + 2e-4)
