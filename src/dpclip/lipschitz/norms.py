"""Operator norms of weight layers that are TRUE upper bounds (never estimates).

Lip-DP-SGD (algorithms.md M15) certifies the per-example gradient norm from the weights: the
sensitivity is a product of layer operator norms. If one of them is under-estimated, the noise is
too small and the DP guarantee silently fails (M15 pitfall 1). Every function here that returns a
number used for privacy returns a *proven upper bound* of the operator norm, computed in float64 and
multiplied by ``1 + NUMERICAL_SLACK`` to cover floating-point rounding:

* :func:`spectral_norm` - exact largest singular value (``torch.linalg.svdvals``) of a matrix: the
  operator norm of ``nn.Linear``.
* :func:`gram_iteration_bound` - the Gram-iteration bound of Delattre, Barthelemy, Araujo &
  Allauzen (ICML 2023): ``||W||_2 <= ||G_t||_F^(1/2^t)`` with ``G_0 = W, G_{t+1} = G_t^T G_t``; an
  upper bound after any number of iterations, converging to ``||W||_2`` (factor
  ``rank^(1/2^(t+1))``).
* :func:`frobenius_norm` - ``||W||_2 <= ||W||_F``, the crudest bound.
* :func:`conv2d_reshape_bounds` - four reshaped-kernel bounds for ``nn.Conv2d`` (valid for every
  input size, padding, stride, dilation), proven in ``docs/lipschitz.md``.
* :func:`conv2d_fft_bound` - the exact operator norm of the *circular* convolution on the padded
  canvas (max over the canvas's Fourier frequencies of the singular values of the kernel's transfer
  matrix); the zero-padded convolution is a restriction of it, so it is an upper bound, usually
  much tighter than the reshaped-kernel bounds. Needs the input's spatial size.
* :func:`conv2d_operator_norm_bound` - the minimum of the above for a given ``nn.Conv2d``.

Power iteration (:func:`power_iteration`) converges to the norm *from below*: in exact arithmetic
``||A v||`` for a unit ``v`` is a LOWER bound. It is therefore never used for the sensitivity; it is
the safety check :func:`check_upper_bound`, which raises if a claimed upper bound is ever below a
power-iteration lower bound (that can only be a bug, and it would break privacy).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

__all__ = [
    "NUMERICAL_SLACK",
    "ConvNormMethod",
    "NormUnderestimateError",
    "OperatorNormBound",
    "PowerIterationResult",
    "check_upper_bound",
    "conv2d_fft_bound",
    "conv2d_operator_norm_bound",
    "conv2d_patch_multiplicity",
    "conv2d_reshape_bounds",
    "frobenius_norm",
    "gram_iteration_bound",
    "linear_operator_norm_bound",
    "power_iteration",
    "robust_norm",
    "spectral_norm",
]

#: relative slack added to every numerically computed upper bound (float64 SVD/FFT rounding is
#: ~1e-15 relative; 1e-6 also covers the float32 rounding of the forward pass that the bound guards)
NUMERICAL_SLACK: float = 1e-6

#: how to bound a convolution's operator norm: ``"auto"`` (min of the reshaped-kernel bounds and,
#: when the FFT tensor is small enough, the FFT bound), ``"reshape"`` (cheap, input-size free) or
#: ``"fft"`` (tight; needs the input size)
ConvNormMethod = Literal["auto", "reshape", "fft"]

#: largest number of complex entries of the transfer-matrix tensor that ``"auto"`` computes
_AUTO_FFT_MAX_ENTRIES = 1 << 24


class NormUnderestimateError(RuntimeError):
    """A claimed operator-norm upper bound is below a certified lower bound: using it would make
    the certified sensitivity too small and void the DP guarantee."""


@dataclass(frozen=True)
class OperatorNormBound:
    """A proven upper bound ``value >= ||A||_2`` and the method that produced it."""

    value: float
    method: str


@dataclass(frozen=True)
class PowerIterationResult:
    """``lower_bound = ||A v||`` for the final unit vector ``v`` (``<= ||A||_2`` in exact
    arithmetic) and ``v`` itself (pass it back as ``init`` to warm-start the next call)."""

    lower_bound: float
    vector: Tensor


def _slack(value: float) -> float:
    return float(value) * (1.0 + NUMERICAL_SLACK)


def _max_abs(t: Tensor) -> float:
    return float(t.abs().amax()) if t.numel() else 0.0


def robust_norm(t: Tensor) -> float:
    """l2 norm of all entries of ``t`` in float64, computed on ``t / max|t|`` so that squaring
    neither underflows (which would return 0, an under-estimate) nor overflows; no slack."""
    t = t.detach().to(torch.complex128 if t.is_complex() else torch.float64)
    scale = _max_abs(t)
    if scale == 0.0:
        return 0.0
    return scale * float(torch.linalg.vector_norm(t / scale))


def _as_matrix(matrix: Tensor, name: str) -> Tensor:
    if not isinstance(matrix, Tensor) or matrix.dim() != 2:
        shape = tuple(matrix.shape) if isinstance(matrix, Tensor) else type(matrix).__name__
        raise ValueError(f"{name} must be a 2-D tensor (a matrix), got {shape}")
    m = matrix.detach().to(torch.float64 if not matrix.is_complex() else torch.complex128)
    if not bool(torch.isfinite(m).all()):
        raise ValueError(f"{name} has non-finite entries; its operator norm is unbounded")
    return m


def spectral_norm(matrix: Tensor) -> float:
    """Largest singular value of ``matrix`` (float64 SVD), times ``1 + NUMERICAL_SLACK``.

    Privacy: an upper bound of ``||matrix||_2`` up to float64 rounding, which the slack covers.
    """
    m = _as_matrix(matrix, "matrix")
    scale = _max_abs(m)
    if scale == 0.0:
        return 0.0
    return _slack(scale * float(torch.linalg.svdvals(m / scale)[0]))


def frobenius_norm(matrix: Tensor) -> float:
    """``||matrix||_F >= ||matrix||_2`` (times ``1 + NUMERICAL_SLACK``); the crudest upper bound."""
    return _slack(robust_norm(_as_matrix(matrix, "matrix")))


def gram_iteration_bound(matrix: Tensor, n_iter: int = 8) -> float:
    """Upper bound of ``||matrix||_2`` by Gram iteration (Delattre et al., ICML 2023).

    ``G_0 = W``, ``G_{t+1} = G_t^H G_t`` gives ``||G_t||_2 = ||W||_2^(2^t) <= ||G_t||_F``, so
    ``||W||_2 <= ||G_t||_F^(1/2^t)`` after ANY number of iterations (an upper bound, unlike power
    iteration); the over-estimate factor is at most ``rank^(1/2^(t+1))`` (1.03 for rank 1000 and
    ``n_iter=8``). Each iterate is rescaled by its Frobenius norm (kept in log space) so nothing
    overflows. Cheaper than an SVD for large matrices (a few matrix products).
    """
    if not (isinstance(n_iter, int) and n_iter >= 0):
        raise ValueError(f"gram_iteration_bound: n_iter must be an integer >= 0, got {n_iter!r}")
    g = _as_matrix(matrix, "matrix")
    if g.shape[0] < g.shape[1]:
        g = g.mH  # same singular values, smaller Gram matrix
    log_scale = 0.0  # G_t = exp(log_scale) * g
    for _ in range(n_iter):
        f = robust_norm(g)
        if f == 0.0:
            return 0.0
        g = g / f
        log_scale = 2.0 * (log_scale + math.log(f))
        g = g.mH @ g
    f = robust_norm(g)
    if f == 0.0:
        return 0.0
    return _slack(math.exp((log_scale + math.log(f)) / 2.0**n_iter))


def linear_operator_norm_bound(
    layer: nn.Linear, method: Literal["svd", "gram"] = "svd"
) -> OperatorNormBound:
    """Upper bound of the input-Lipschitz constant ``||W||_2`` of an ``nn.Linear`` (the bias does
    not change it). ``"svd"`` is exact; ``"gram"`` is :func:`gram_iteration_bound` (cheaper for very
    large layers, slightly larger)."""
    if method == "svd":
        return OperatorNormBound(spectral_norm(layer.weight), "svd")
    if method == "gram":
        return OperatorNormBound(gram_iteration_bound(layer.weight), "gram")
    raise ValueError(f"linear_operator_norm_bound: method must be 'svd' or 'gram', got {method!r}")


# ------------------------------------------------------------------------------- convolutions


def _pair(value: int | Sequence[int], name: str) -> tuple[int, int]:
    if isinstance(value, int):
        return (value, value)
    out = tuple(int(v) for v in value)
    if len(out) != 2:
        raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}")
    return out  # type: ignore[return-value]


def _multiplicity(kernel: int, stride: int, dilation: int) -> int:
    """Max over input positions of the number of (output position, kernel tap) pairs that read it.

    Tap ``j`` of output ``o`` reads position ``o*stride + j*dilation``; for a fixed tap at most one
    output reads a given position, and tap ``j`` can read position ``p`` only if
    ``j*dilation = p (mod stride)``, which holds for ``j`` in one residue class modulo
    ``stride / gcd(stride, dilation)``: at most ``ceil(kernel * gcd / stride)`` taps (<= kernel).
    """
    period = stride // math.gcd(stride, dilation)
    return min(kernel, -(-kernel // period))


def conv2d_patch_multiplicity(
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int] = 1,
    dilation: int | Sequence[int] = 1,
) -> int:
    """``m = m_h * m_w``: no input pixel is read by more than ``m`` (output position, kernel tap)
    pairs, hence ``||unfold(x)||_F <= sqrt(m) ||x||``. ``m = k_h k_w`` for stride 1 and
    ``ceil(k_h/s_h) ceil(k_w/s_w)`` for dilation 1 (M15 pitfall 3). ``sqrt(m)`` is the factor
    ``lambda`` of the per-example weight-gradient bound
    ``||grad_W|| <= sqrt(m) ||x|| ||delta||``."""
    (kh, kw), (sh, sw), (dh, dw) = (
        _pair(kernel_size, "kernel_size"),
        _pair(stride, "stride"),
        _pair(dilation, "dilation"),
    )
    return _multiplicity(kh, sh, dh) * _multiplicity(kw, sw, dw)


def _grouped_kernel(weight: Tensor, groups: int) -> Tensor:
    """``(c_out, c_in/g, kh, kw)`` -> ``(g, c_out/g, c_in/g, kh, kw)`` in float64."""
    if weight.dim() != 4:
        raise ValueError(
            f"conv2d weight must be 4-D (c_out, c_in/groups, kh, kw), got {tuple(weight.shape)}"
        )
    c_out = weight.shape[0]
    if groups < 1 or c_out % groups:
        raise ValueError(f"groups={groups} must divide the {c_out} output channels")
    w = weight.detach().to(torch.float64)
    if not bool(torch.isfinite(w).all()):
        raise ValueError("conv2d weight has non-finite entries; its operator norm is unbounded")
    return w.reshape(groups, c_out // groups, *w.shape[1:])


def _max_svd(batch: Tensor) -> float:
    """Largest singular value over a batch of matrices ``(..., m, n)`` (pre-scaled by the largest
    entry so that tiny or huge kernels neither underflow nor overflow)."""
    scale = _max_abs(batch)
    if scale == 0.0:
        return 0.0
    return scale * float(torch.linalg.svdvals(batch / scale).amax())


def conv2d_reshape_bounds(
    weight: Tensor,
    stride: int | Sequence[int] = 1,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
) -> dict[str, float]:
    """Four reshaped-kernel upper bounds of a 2-D convolution's operator norm (any padding/input
    size), in the spirit of Singla & Feizi's "Fantastic Four" (ICLR 2021), tightened for strides.

    With ``W_ij = weight[:, :, i, j]`` (``c_out x c_in``), ``m_h, m_w`` the per-axis patch
    multiplicities (:func:`conv2d_patch_multiplicity`):

    * ``"out"``:  ``sqrt(m_h m_w) * ||[W_ij]_ij  as  c_out x (c_in kh kw)||_2`` (im2col),
    * ``"in"``:   ``sqrt(kh kw)   * ||[W_ij] stacked as (c_out kh kw) x c_in||_2``,
    * ``"row"``:  ``sqrt(kh m_w)  * ||(c_out kh) x (c_in kw)||_2``,
    * ``"col"``:  ``sqrt(m_h kw)  * ||(c_out kw) x (c_in kh)||_2``.

    Proofs (Cauchy-Schwarz over the taps that are not in the reshaped matrix, plus the multiplicity
    of the taps that are) are in ``docs/lipschitz.md``. Grouped convolutions are block diagonal: the
    max over groups. Each value includes ``1 + NUMERICAL_SLACK``.
    """
    (sh, sw), (dh, dw) = _pair(stride, "stride"), _pair(dilation, "dilation")
    w = _grouped_kernel(weight, groups)  # (g, o, i, kh, kw)
    g, o, i, kh, kw = w.shape
    mh, mw = _multiplicity(kh, sh, dh), _multiplicity(kw, sw, dw)
    r_out = w.reshape(g, o, i * kh * kw)
    r_in = w.permute(0, 3, 4, 1, 2).reshape(g, kh * kw * o, i)
    r_row = w.permute(0, 3, 1, 4, 2).reshape(g, kh * o, kw * i)
    r_col = w.permute(0, 4, 1, 3, 2).reshape(g, kw * o, kh * i)
    return {
        "out": _slack(math.sqrt(mh * mw) * _max_svd(r_out)),
        "in": _slack(math.sqrt(kh * kw) * _max_svd(r_in)),
        "row": _slack(math.sqrt(kh * mw) * _max_svd(r_row)),
        "col": _slack(math.sqrt(mh * kw) * _max_svd(r_col)),
    }


def _fft_entries(weight: Tensor, canvas: tuple[int, int], groups: int) -> int:
    c_out, c_in_g = weight.shape[:2]
    return c_out * c_in_g * canvas[0] * (canvas[1] // 2 + 1)


def conv2d_fft_bound(
    weight: Tensor,
    canvas: tuple[int, int],
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
) -> float:
    """Exact operator norm of the CIRCULAR convolution on a ``canvas = (N_h, N_w)`` grid, an upper
    bound of the zero-padded convolution whose padded input fits the canvas.

    ``canvas`` must be at least the padded input size ``(H + pad_top + pad_bottom, ...)``. On that
    canvas, the zero-padded (cross-)correlation at stride 1 equals the circular one on every output
    position it computes (no tap wraps around), so it is ``crop o circ o embed`` with ``crop`` and
    ``embed`` of norm <= 1; a stride > 1 only subsamples the outputs. The circular convolution is
    block-diagonalised by the 2-D DFT: its norm is ``max_w ||K_hat(w)||_2`` over the canvas's
    frequencies, ``K_hat(w) = sum_ij W_ij exp(-2 pi i (w_h i d_h / N_h + w_w j d_w / N_w))``
    (Sedghi, Gupta & Long, ICLR 2019). ``K_hat(-w) = conj(K_hat(w))``, so the half spectrum of
    ``rfft2`` suffices. Includes ``1 + NUMERICAL_SLACK``.
    """
    (dh, dw) = _pair(dilation, "dilation")
    nh, nw = _pair(canvas, "canvas")
    w = _grouped_kernel(weight, groups)
    g, o, i, kh, kw = w.shape
    if nh < (kh - 1) * dh + 1 or nw < (kw - 1) * dw + 1:
        raise ValueError(
            f"canvas {canvas} is smaller than the dilated kernel ({(kh - 1) * dh + 1}, "
            f"{(kw - 1) * dw + 1}); pass the padded input size"
        )
    grid = torch.zeros(g, o, i, nh, nw, dtype=torch.float64, device=w.device)
    grid[..., : (kh - 1) * dh + 1 : dh, : (kw - 1) * dw + 1 : dw] = w
    spec = torch.fft.rfft2(grid)  # (g, o, i, nh, nw//2+1)
    mats = spec.permute(0, 3, 4, 1, 2).reshape(-1, o, i)
    return _slack(_max_svd(mats))


def _conv_padding(
    conv: nn.Conv2d, kernel: tuple[int, int], dilation: tuple[int, int]
) -> tuple[int, int]:
    """Total zero padding per spatial axis (top + bottom, left + right)."""
    if isinstance(conv.padding, str):
        if conv.padding == "valid":
            return (0, 0)
        if conv.padding == "same":
            return ((kernel[0] - 1) * dilation[0], (kernel[1] - 1) * dilation[1])
        raise ValueError(f"{conv}: unknown padding {conv.padding!r}")
    ph, pw = _pair(conv.padding, "padding")
    return (2 * ph, 2 * pw)


def conv2d_operator_norm_bound(
    conv: nn.Conv2d,
    input_hw: tuple[int, int] | None = None,
    method: ConvNormMethod = "auto",
) -> OperatorNormBound:
    """Proven upper bound of the input-Lipschitz constant (operator norm) of ``conv``.

    ``"reshape"``: min of :func:`conv2d_reshape_bounds`. ``"fft"``: min of those and
    :func:`conv2d_fft_bound` on the padded canvas (needs ``input_hw``). ``"auto"``: ``"fft"`` when
    ``input_hw`` is given and the transfer-matrix tensor has at most 2^24 entries, else
    ``"reshape"`` (both are proven bounds; the chosen one is named in ``method``). Only
    ``padding_mode="zeros"`` is supported (circular/reflect padding copy pixels, which the proofs
    do not cover): anything else is refused.
    """
    if not isinstance(conv, nn.Conv2d):
        raise TypeError(f"conv2d_operator_norm_bound needs an nn.Conv2d, got {type(conv).__name__}")
    if conv.padding_mode != "zeros":
        raise ValueError(
            f"{conv}: padding_mode={conv.padding_mode!r} is not supported by the Lipschitz bounds "
            "(padding copies input pixels); use padding_mode='zeros'"
        )
    if method not in ("auto", "reshape", "fft"):
        raise ValueError(f"method must be 'auto', 'reshape' or 'fft', got {method!r}")
    kernel = _pair(conv.kernel_size, "kernel_size")
    dilation = _pair(conv.dilation, "dilation")
    bounds = conv2d_reshape_bounds(conv.weight, conv.stride, conv.dilation, conv.groups)
    best_name = min(bounds, key=bounds.__getitem__)
    best = OperatorNormBound(bounds[best_name], f"conv-reshape-{best_name}")
    if method == "fft" and input_hw is None:
        raise ValueError("conv2d_operator_norm_bound: method='fft' needs input_hw=(height, width)")
    if input_hw is None or method == "reshape":
        return best
    pad = _conv_padding(conv, kernel, dilation)
    canvas = (int(input_hw[0]) + pad[0], int(input_hw[1]) + pad[1])
    if method == "auto" and _fft_entries(conv.weight, canvas, conv.groups) > _AUTO_FFT_MAX_ENTRIES:
        return best
    fft = conv2d_fft_bound(conv.weight, canvas, conv.dilation, conv.groups)
    return OperatorNormBound(fft, "conv-fft") if fft < best.value else best


# ----------------------------------------------------------------------- power iteration (check)


def power_iteration(
    linear_map: Callable[[Tensor], Tensor],
    input_shape: Sequence[int],
    n_iter: int = 50,
    *,
    init: Tensor | None = None,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
) -> PowerIterationResult:
    """Power iteration on ``A^T A`` for a LINEAR map ``A`` given as a function (adjoint by
    autograd).

    Returns ``||A v||`` for the final unit vector ``v``: a LOWER bound of ``||A||_2`` (exact
    arithmetic), converging from below. Never use it as the norm in a sensitivity; use it to check
    a proven upper bound (:func:`check_upper_bound`) or to measure how tight that bound is.
    """
    if not (isinstance(n_iter, int) and n_iter >= 1):
        raise ValueError(f"power_iteration: n_iter must be an integer >= 1, got {n_iter!r}")
    shape = tuple(int(s) for s in input_shape)
    if init is not None:
        v = init.detach().to(dtype).reshape(shape).clone()
    else:
        v = torch.randn(shape, generator=generator, dtype=dtype)
    v = v / torch.linalg.vector_norm(v).clamp_min(1e-300)
    for _ in range(n_iter):
        x = v.clone().requires_grad_(True)
        y = linear_map(x)
        (w,) = torch.autograd.grad(y, x, grad_outputs=y.detach())  # A^T A v
        n = torch.linalg.vector_norm(w)
        if float(n) == 0.0:
            break
        v = (w / n).detach()
    with torch.no_grad():
        lower = float(torch.linalg.vector_norm(linear_map(v)))
    return PowerIterationResult(lower, v)


def check_upper_bound(upper: float, lower: float, what: str) -> None:
    """The safety check: raise :class:`NormUnderestimateError` if ``upper < lower``.

    ``lower`` is a certified lower bound (for example :func:`power_iteration`); a claimed upper
    bound below it is wrong and would under-state the sensitivity. A relative tolerance of
    ``1e-9`` absorbs float64 rounding of the lower bound.
    """
    if not (math.isfinite(upper) and upper >= lower * (1.0 - 1e-9)):
        raise NormUnderestimateError(
            f"{what}: claimed operator-norm upper bound {upper!r} is below the certified lower "
            f"bound {lower!r}; the sensitivity would be under-estimated and the DP guarantee void. "
            "Use a proven bound (spectral_norm, conv2d_operator_norm_bound), not an estimate"
        )
