"""Orthogonal (Bjorck-projected) dense and convolution layers for bound-based private training.

Bethune et al. ("DP-SGD without clipping: the Lipschitz neural network way", 2023, lip-dp on
deel-lip) keep every layer orthogonal: the weight is trained as a plain weight and, after every
optimizer step, projected back onto the orthogonal matrices (Bjorck & Bowie 1971). A projection
of released weights is post-processing (no privacy cost), and the gradient the step differentiates
is the ordinary gradient w.r.t. the weight actually used in the forward pass, so the existing
per-example bounds of ``nn.Linear`` / ``nn.Conv2d`` apply unchanged.

* :class:`OrthLinear` - an ``nn.Linear`` whose :meth:`~OrthLinear.project_` replaces ``W`` by its
  orthogonal polar factor ``U V^T`` (``W = U S V^T``): orthonormal rows (wide) or columns (tall),
  all singular values 1. A tall or square ``OrthLinear`` is an isometry; a wide or square one
  has an isometric ``W^T``, so it back-propagates gradients without loss (with GroupSort, a chain
  of square ones is gradient-norm preserving: tested).
* :class:`OrthConv2d` - an ``nn.Conv2d`` whose :meth:`~OrthConv2d.project_` orthonormalises the
  reshaped kernel ``(c_out, c_in k_h k_w)`` (deel-lip's ``SpectralConv2d`` / Bjorck on the
  reshaped kernel). The convolution's operator norm is then at most ``sqrt(k_h k_w)`` and usually
  more than 1; the strategies' weight clipping (``post_step``) rescales it with the PROVEN
  convolution bound (FFT / reshapes) so the certified constant is ``<= weight_bound``. With
  ``c_out >= c_in k_h k_w`` (e.g. the first layer on grey images) the result is close to an
  isometry away from the borders.

The projection never enters the certificate: :func:`dpclip.lipschitz.lipschitz_bounds` computes
the operator norm of whatever weight the layer holds (exact float64 SVD for dense layers, the
proven convolution bounds for convolutions), so an imperfect projection (finitely many Bjorck
iterations, float rounding) can only loosen the bound, never break it. ``method="polar"`` (the
default) computes the limit of the Bjorck iteration exactly by an SVD; ``method="bjorck"`` runs
``iterations`` steps of ``W <- 1.5 W - 0.5 W W^T W`` from ``W / ||W||_F`` (converges because
``||W / ||W||_F||_2 <= 1 < sqrt(3)``).

Both classes keep ``nn.Linear`` / ``nn.Conv2d``'s ``forward`` unchanged (tested), which is what
lets the analysis reuse their rules although it matches layers by exact type.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["OrthConv2d", "OrthLinear", "orthogonalize"]

PROJECTION_METHODS = ("polar", "bjorck")


def orthogonalize(matrix: Tensor, method: str = "polar", iterations: int = 25) -> Tensor:
    """The orthogonal factor of ``matrix`` (2-D): orthonormal rows if wide, columns if tall.

    ``"polar"``: ``U V^T`` from a float64 SVD (the exact nearest orthogonal matrix in Frobenius
    norm, the fixed point of the Bjorck iteration). ``"bjorck"``: ``iterations`` Bjorck steps
    (order 1, ``beta = 1/2``) from ``matrix / ||matrix||_F``. A zero matrix is returned unchanged
    (it has no orthogonal factor). Returns a new tensor of ``matrix``'s dtype.
    """
    if matrix.dim() != 2:
        raise ValueError(f"orthogonalize: matrix must be 2-D, got shape {tuple(matrix.shape)}")
    if method not in PROJECTION_METHODS:
        raise ValueError(
            f"orthogonalize: method must be one of {PROJECTION_METHODS}, got {method!r}"
        )
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"orthogonalize: iterations must be an integer >= 1, got {iterations!r}")
    w = matrix.detach().double()
    if not torch.isfinite(w).all():
        raise ValueError("orthogonalize: matrix has non-finite entries")
    fro = torch.linalg.matrix_norm(w)
    if fro == 0:
        return matrix.detach().clone()
    if method == "polar":
        u, _, vh = torch.linalg.svd(w, full_matrices=False)
        q = u @ vh
    else:
        tall = w.shape[0] >= w.shape[1]
        q = w / fro if tall else (w / fro).T  # iterate on the tall orientation (smaller Gram)
        for _ in range(iterations):
            q = 1.5 * q - 0.5 * q @ (q.T @ q)
        if not tall:
            q = q.T
    return q.to(matrix.dtype)


def _check_projection(owner: str, method: str, iterations: int) -> None:
    if method not in PROJECTION_METHODS:
        raise ValueError(f"{owner}: method must be one of {PROJECTION_METHODS}, got {method!r}")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"{owner}: iterations must be an integer >= 1, got {iterations!r}")


class OrthLinear(nn.Linear):
    """``nn.Linear`` kept orthogonal by :meth:`project_` (called after every step by the
    bound-based strategies' ``post_step``, and once at construction). ``forward`` is
    ``nn.Linear.forward``. ``method`` / ``iterations``: see :func:`orthogonalize`."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        method: str = "polar",
        iterations: int = 25,
        device=None,
        dtype=None,
    ) -> None:
        _check_projection("OrthLinear", method, iterations)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.method = method
        self.iterations = iterations
        self.project_()

    @torch.no_grad()
    def project_(self) -> None:
        """Replace the weight by its orthogonal factor, in place (bumps its version, so cached
        operator norms are recomputed)."""
        self.weight.copy_(orthogonalize(self.weight, self.method, self.iterations))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, method={self.method}"


class OrthConv2d(nn.Conv2d):
    """``nn.Conv2d`` whose reshaped kernel ``(c_out / groups, c_in / groups * k_h * k_w)`` is kept
    orthogonal per group by :meth:`project_`; ``forward`` is ``nn.Conv2d.forward``. The certified
    operator norm is the proven convolution bound of the projected kernel (at most
    ``sqrt(k_h k_w)``); the strategies' weight clipping then scales it to ``weight_bound``."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding=0,
        dilation=1,
        groups: int = 1,
        bias: bool = True,
        *,
        method: str = "polar",
        iterations: int = 25,
        device=None,
        dtype=None,
    ) -> None:
        _check_projection("OrthConv2d", method, iterations)
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                         dilation=dilation, groups=groups, bias=bias, padding_mode="zeros",
                         device=device, dtype=dtype)
        self.method = method
        self.iterations = iterations
        self.project_()

    @torch.no_grad()
    def project_(self) -> None:
        """Orthonormalise each group's reshaped kernel, in place."""
        w = self.weight
        per_group = w.shape[0] // self.groups
        for g in range(self.groups):
            block = w[g * per_group:(g + 1) * per_group]
            q = orthogonalize(block.reshape(per_group, -1), self.method, self.iterations)
            block.copy_(q.reshape(block.shape))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, method={self.method}"


def project_orthogonal_layers_(model: nn.Module) -> list[str]:
    """Call :meth:`project_` on every :class:`OrthLinear` / :class:`OrthConv2d` of ``model`` whose
    weight is trainable (a frozen one never changes); returns their names. Used by the
    bound-based strategies' ``post_step``."""
    names = []
    for name, module in model.named_modules():
        if type(module) in (OrthLinear, OrthConv2d) and module.weight.requires_grad:
            module.project_()
            names.append(name)
    return names
