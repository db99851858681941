"""Weight norms are TRUE upper bounds: checked against exact operator norms of explicit matrices.

Under-estimating a norm silently breaks privacy (algorithms.md M15 pitfall 1), so every bound is
compared with the exact norm, including on matrices built to fool power iteration.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dpclip.lipschitz import (
    NormUnderestimateError,
    check_upper_bound,
    conv2d_fft_bound,
    conv2d_operator_norm_bound,
    conv2d_patch_multiplicity,
    conv2d_reshape_bounds,
    frobenius_norm,
    gram_iteration_bound,
    linear_operator_norm_bound,
    power_iteration,
    spectral_norm,
)
from tests.lipschitz.helpers import DT, explicit_matrix


def _exact(m: torch.Tensor) -> float:
    return float(torch.linalg.svdvals(m.detach().to(DT))[0])


def _slow_power_matrix(gen: torch.Generator, n: int = 12) -> torch.Tensor:
    """Top two singular values 1 and 0.999: power iteration converges very slowly."""
    u, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=DT))
    v, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=DT))
    s = torch.linspace(0.999, 0.1, n, dtype=DT)
    s[0] = 1.0
    return u @ torch.diag(s) @ v.T


@pytest.mark.parametrize("seed", range(4))
def test_dense_bounds_are_upper_bounds(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    mats = [
        torch.randn(7, 5, generator=gen, dtype=DT),
        torch.randn(3, 11, generator=gen, dtype=DT) * 10,
        torch.randn(6, 1, generator=gen, dtype=DT),
        _slow_power_matrix(gen),
        torch.randn(8, 8, generator=gen),  # float32 input
    ]
    for m in mats:
        exact = _exact(m)
        assert spectral_norm(m) >= exact
        assert spectral_norm(m) <= exact * (1 + 1e-5)
        assert gram_iteration_bound(m) >= exact
        assert gram_iteration_bound(m, n_iter=0) >= exact  # = Frobenius
        assert gram_iteration_bound(m, n_iter=10) <= exact * 1.01
        assert frobenius_norm(m) >= exact
        lin = nn.Linear(m.shape[1], m.shape[0]).to(DT)
        with torch.no_grad():
            lin.weight.copy_(m)
        for method in ("svd", "gram"):
            assert linear_operator_norm_bound(lin, method).value >= exact  # type: ignore[arg-type]


def test_zero_and_tiny_matrices() -> None:
    assert spectral_norm(torch.zeros(3, 4)) == 0.0
    assert gram_iteration_bound(torch.zeros(3, 4)) == 0.0
    tiny = torch.full((4, 4), 1e-200, dtype=DT)
    assert gram_iteration_bound(tiny) >= _exact(tiny)
    huge = torch.full((4, 4), 1e200, dtype=DT)
    for bound in (spectral_norm, gram_iteration_bound, frobenius_norm):
        assert bound(tiny) >= _exact(tiny) > 0  # no underflow to 0 (an under-estimate)
        assert math.isfinite(bound(huge)) and bound(huge) >= _exact(huge)
    w = torch.full((2, 2, 3, 3), 1e-200, dtype=DT)
    assert min(conv2d_reshape_bounds(w).values()) > 0 and conv2d_fft_bound(w, (4, 4)) > 0


def test_bad_matrices_are_refused() -> None:
    with pytest.raises(ValueError, match="non-finite"):
        spectral_norm(torch.tensor([[float("nan")]]))
    with pytest.raises(ValueError, match="2-D"):
        spectral_norm(torch.ones(3))
    with pytest.raises(ValueError, match="method"):
        linear_operator_norm_bound(nn.Linear(2, 2), "power")  # type: ignore[arg-type]


def test_power_iteration_underestimates_and_the_safety_check_catches_it() -> None:
    """Power iteration is a LOWER bound: with few iterations it under-estimates the norm, which
    would break privacy if used as the sensitivity; the safety check refuses such a claim."""
    gen = torch.Generator().manual_seed(0)
    m = _slow_power_matrix(gen)
    exact = _exact(m)
    few = power_iteration(lambda v: m @ v, (m.shape[1],), n_iter=1, generator=gen)
    many = power_iteration(lambda v: m @ v, (m.shape[1],), n_iter=300, init=few.vector)
    assert few.lower_bound < exact * (1 - 1e-4)  # under-estimates
    assert few.lower_bound <= many.lower_bound <= exact * (1 + 1e-12)
    check_upper_bound(spectral_norm(m), many.lower_bound, "dense")  # a proven bound passes
    with pytest.raises(NormUnderestimateError, match="below the certified lower bound"):
        check_upper_bound(few.lower_bound * 0.99, many.lower_bound, "estimate")
    with pytest.raises(NormUnderestimateError):
        check_upper_bound(float("nan"), 1.0, "nan")


CONV_CASES = [
    # (c_in, c_out, kernel, stride, padding, dilation, groups, (H, W))
    (2, 3, 3, 1, 1, 1, 1, (5, 5)),
    (2, 4, 3, 2, 1, 1, 1, (6, 5)),
    (2, 2, 2, 1, 0, 2, 1, (5, 6)),
    (4, 4, 3, 1, 1, 1, 2, (4, 4)),
    (1, 2, (3, 2), (2, 1), (1, 0), 1, 1, (6, 5)),
    (2, 2, 4, 1, "same", 1, 1, (5, 5)),
    (3, 2, 2, 2, 0, 1, 1, (6, 6)),  # stride = kernel: no overlap
    (1, 1, 3, 1, 2, 1, 1, (3, 3)),  # padding larger than needed
    (3, 6, 3, 3, 1, 2, 3, (7, 7)),  # groups + stride + dilation
]


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("case", CONV_CASES)
@pytest.mark.parametrize("seed", range(2))
def test_conv_bounds_dominate_the_exact_operator_norm(case: tuple, seed: int) -> None:
    c_in, c_out, k, s, p, d, g, hw = case
    torch.manual_seed(seed)
    conv = nn.Conv2d(c_in, c_out, k, s, p, d, groups=g, bias=False).to(DT)
    shape = (c_in, *hw)
    exact = _exact(explicit_matrix(lambda x: conv(x[None])[0], shape))
    reshape = conv2d_reshape_bounds(conv.weight, conv.stride, conv.dilation, conv.groups)
    for name, value in reshape.items():
        assert value >= exact, (name, value, exact)
    for method in ("reshape", "fft", "auto"):
        b = conv2d_operator_norm_bound(conv, hw, method)  # type: ignore[arg-type]
        assert b.value >= exact, (method, b, exact)
        assert b.value <= min(reshape.values())
    # a lower bound from power iteration never exceeds the bound (the safety check passes)
    lower = power_iteration(lambda x: conv(x[None])[0], shape, n_iter=30)
    check_upper_bound(conv2d_operator_norm_bound(conv, hw).value, lower.lower_bound, "conv")


def test_conv_fft_bound_is_exact_for_circular_convolution() -> None:
    """On a canvas that the kernel wraps around, the bound equals the circular operator norm."""
    torch.manual_seed(0)
    w = torch.randn(3, 2, 3, 3, dtype=DT)

    def circ(x: torch.Tensor) -> torch.Tensor:
        xp = F.pad(x[None], (0, 2, 0, 2), mode="circular")
        return F.conv2d(xp, w)[0]

    exact = _exact(explicit_matrix(circ, (2, 5, 4)))
    assert conv2d_fft_bound(w, (5, 4)) == pytest.approx(exact, rel=1e-5)
    assert conv2d_fft_bound(w, (5, 4)) >= exact


def test_conv_fft_bound_is_tighter_than_reshaping_on_a_typical_layer() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 8, 3, padding=1, bias=False).to(DT)
    shape = (4, 6, 6)
    exact = _exact(explicit_matrix(lambda x: conv(x[None])[0], shape))
    fft = conv2d_operator_norm_bound(conv, (6, 6), "fft")
    assert fft.method == "conv-fft"
    assert exact <= fft.value <= 1.3 * exact
    assert fft.value < conv2d_operator_norm_bound(conv, None, "reshape").value


@pytest.mark.parametrize(
    ("kernel", "stride", "dilation", "expected"),
    [
        (3, 1, 1, 9),
        (2, 1, 1, 4),
        (3, 2, 1, 4),
        (2, 2, 1, 1),
        (4, 3, 1, 4),
        (3, 2, 2, 9),
        ((3, 2), (2, 1), (1, 1), 4),
        (2, 2, 2, 4),
        (3, 4, 2, 4),
        (3, 4, 1, 1),
    ],
)
def test_patch_multiplicity_is_the_max_number_of_reads(
    kernel: int, stride: int, dilation: int, expected: int
) -> None:
    """``m`` is exactly the max over pixels of how often unfold reads a pixel (large input)."""
    m = conv2d_patch_multiplicity(kernel, stride, dilation)
    assert m == expected
    x = torch.ones(1, 1, 13, 13, dtype=DT, requires_grad=True)
    F.unfold(x, kernel, dilation=dilation, stride=stride).sum().backward()
    assert x.grad is not None and int(x.grad.max()) == m


def test_conv_refuses_non_zero_padding_modes_and_missing_shape() -> None:
    conv = nn.Conv2d(1, 1, 3, padding=1, padding_mode="circular")
    with pytest.raises(ValueError, match="padding_mode='zeros'"):
        conv2d_operator_norm_bound(conv, (4, 4))
    with pytest.raises(ValueError, match="input_hw"):
        conv2d_operator_norm_bound(nn.Conv2d(1, 1, 3), None, "fft")
    with pytest.raises(ValueError, match="canvas"):
        conv2d_fft_bound(torch.ones(1, 1, 3, 3), (2, 2))
