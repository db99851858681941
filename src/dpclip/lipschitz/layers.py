"""Parameter-free layers with known Lipschitz constants, for bound-based private training.

* :class:`GroupSort` - sorts channels within groups (Anil, Lucas & Grosse, ICML 2019); a
  permutation of its input, hence norm preserving and 1-Lipschitz. ``GroupSort(2)`` is MaxMin.
* :class:`LipGroupNorm` - group normalisation without affine parameters whose scale is floored,
  ``y = (x - mean) / max(std, 1/L)`` per group: exactly ``L``-Lipschitz (a reconstruction of the
  modified GN of Barczewski & Ramon, algorithms.md M15, Eq. 2-3; ``L`` is a hyper-parameter).
* :class:`LipResidual` - ``y = x + block(x)``; Lipschitz ``<= 1 + Lip(block)`` (Gouk et al. 2021).

The constants are used by :func:`dpclip.lipschitz.lipschitz_bounds`; ``docs/lipschitz.md`` proves
them. The tempered sigmoid lives in :mod:`dpclip.models.activations` (``TemperedSigmoid``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["GroupSort", "LipGroupNorm", "LipResidual"]


class _MinMax(torch.autograd.Function):
    """``(min(a, b), max(a, b))`` elementwise, with the gradient routed by the same mask
    ``a > b`` (a permutation per pair; ties keep the order, as a stable sort). Differentiable
    backward (``torch.where``), so double backward and ``vmap`` work."""

    generate_vmap_rule = True

    @staticmethod
    def forward(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        swap = a > b
        return torch.where(swap, b, a), torch.where(swap, a, b), swap

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # type: ignore[override]
        ctx.mark_non_differentiable(output[2])
        ctx.save_for_backward(output[2])

    @staticmethod
    def backward(ctx, g_lo: Tensor, g_hi: Tensor, _: Tensor):  # type: ignore[override]
        (swap,) = ctx.saved_tensors
        return torch.where(swap, g_hi, g_lo), torch.where(swap, g_lo, g_hi)


class GroupSort(nn.Module):
    """Sort the entries of dimension ``dim`` (channels by default) in groups of ``group_size``.

    Per example the output is a permutation of the input: ``||GroupSort(x)|| = ||x||`` and the map
    is 1-Lipschitz (its autograd Jacobian is a permutation matrix). ``dim`` counts the batch
    dimension (``dim=1`` is the channel/feature axis of ``(B, C, ...)`` and ``(B, F)`` inputs); the
    size of ``dim`` must be a multiple of ``group_size``.
    """

    def __init__(self, group_size: int = 2, dim: int = 1) -> None:
        super().__init__()
        if not (isinstance(group_size, int) and group_size >= 1):
            raise ValueError(f"GroupSort: group_size must be an integer >= 1, got {group_size!r}")
        if not isinstance(dim, int) or dim == 0:
            raise ValueError(
                f"GroupSort: dim must be a non-batch dimension (an int != 0), got {dim!r}"
            )
        self.group_size = group_size
        self.dim = dim

    def forward(self, x: Tensor) -> Tensor:
        dim = self.dim % x.dim()
        size = x.shape[dim]
        if size % self.group_size:
            raise ValueError(
                f"GroupSort(group_size={self.group_size}): dimension {self.dim} has size {size}, "
                f"not a multiple of the group size; change group_size or the layer width"
            )
        grouped = x.unflatten(dim, (size // self.group_size, self.group_size))
        if self.group_size == 2:
            # MaxMin: the same values as the sort, and a permutation as its Jacobian (ties keep
            # the order), but about twice as fast on CPU (sort and min/max backward are slow)
            a, b = grouped.unbind(dim + 1)
            lo, hi, _ = _MinMax.apply(a, b)
            return torch.stack((lo, hi), dim + 1).flatten(dim, dim + 1)
        return grouped.sort(dim=dim + 1).values.flatten(dim, dim + 1)

    def extra_repr(self) -> str:
        return f"group_size={self.group_size}, dim={self.dim}"


class LipGroupNorm(nn.Module):
    """Parameter-free group normalisation with a floored scale: ``L``-Lipschitz per example.

    Input ``(B, C, *)``; channels are split into ``num_groups`` groups and, per example and group,
    ``y = (x - mean) / max(std, 1/L)`` with the biased std (as ``nn.GroupNorm``). Equivalently
    ``y = P_r(L (x - mean))`` with ``P_r`` the Euclidean projection onto the ball of radius
    ``r = sqrt(n_g)`` (``n_g`` the group size): centring and projection are 1-Lipschitz, so the map
    is ``L``-Lipschitz; its output norm is ``<= min(sqrt(n), L ||x||)``. No trainable parameters,
    no running statistics: it never mixes examples.

    ``lipschitz`` is the hyper-parameter ``L`` (Barczewski & Ramon tune the GN Lipschitz bound);
    a small ``L`` keeps activations and the certified sensitivity small.
    """

    def __init__(self, num_groups: int, lipschitz: float) -> None:
        super().__init__()
        if not (isinstance(num_groups, int) and num_groups >= 1):
            raise ValueError(
                f"LipGroupNorm: num_groups must be an integer >= 1, got {num_groups!r}"
            )
        if not (isinstance(lipschitz, (int, float)) and math.isfinite(lipschitz) and lipschitz > 0):
            raise ValueError(
                f"LipGroupNorm: lipschitz must be a positive finite number, got {lipschitz!r}"
            )
        self.num_groups = num_groups
        self.lipschitz = float(lipschitz)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() < 2 or x.shape[1] % self.num_groups:
            raise ValueError(
                f"LipGroupNorm(num_groups={self.num_groups}) needs input (B, C, ...) with C a "
                f"multiple of num_groups, got shape {tuple(x.shape)}"
            )
        g = x.reshape(x.shape[0], self.num_groups, -1)
        c = g - g.mean(dim=-1, keepdim=True)
        var = c.pow(2).mean(dim=-1, keepdim=True)
        # max(std, 1/L) = sqrt(max(var, 1/L^2)); the clamp keeps the gradient finite at var = 0
        scale = var.clamp_min(1.0 / self.lipschitz**2).sqrt()
        return (c / scale).reshape(x.shape)

    def extra_repr(self) -> str:
        return f"num_groups={self.num_groups}, lipschitz={self.lipschitz}"


class LipResidual(nn.Module):
    """Residual block ``y = x + block(x)``; ``block`` must map a shape to itself.

    Lipschitz constant ``<= 1 + Lip(block)`` and ``||y|| <= ||x|| + ||block(x)||``; the gradient
    reaching a layer inside ``block`` only flows through ``block``'s remaining layers (the skip
    connection does not depend on them). ``block`` is analysed recursively by
    :func:`~dpclip.lipschitz.lipschitz_bounds`, so it must itself be a supported layer or an
    ``nn.Sequential`` of them.
    """

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        if not isinstance(block, nn.Module):
            raise TypeError(f"LipResidual: block must be an nn.Module, got {type(block).__name__}")
        self.block = block

    def forward(self, x: Tensor) -> Tensor:
        return x + self.block(x)
