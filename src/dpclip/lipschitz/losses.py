"""Lipschitz losses: per-example losses with a proven bound on the gradient norm w.r.t. the logits.

Each loss is an ``nn.Module`` called as ``loss(logits, targets) -> per-example losses (B,)``
(reduction "none", the convention of :mod:`dpclip.engine`) and exposes ``lipschitz(num_classes)``:
a bound ``L`` with ``||d loss(z, y) / d z||_2 <= L`` for every logit vector ``z`` and label ``y``
(also for the sub-gradients autograd picks at kinks). ``L`` starts the backward bound propagation of
:func:`dpclip.lipschitz.lipschitz_bounds`; an under-stated ``L`` would void the DP guarantee, so
each constant is proven in its docstring and in ``docs/lipschitz.md``.

Targets are class indices (``LongTensor`` of shape ``(B,)``).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn
from torch.nn import functional as F

__all__ = ["CosineSimilarityLoss", "LipschitzLoss", "MulticlassHingeLoss", "TemperedCrossEntropy"]


def _positive(value: float, name: str, cls: str) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{cls}: {name} must be a positive finite number, got {value!r}")
    return float(value)


def _check_logits(logits: Tensor, targets: Tensor, cls: str) -> None:
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"{cls} expects logits (B, num_classes) and class-index targets (B,), got "
            f"{tuple(logits.shape)} and {tuple(targets.shape)}"
        )


class LipschitzLoss(nn.Module):
    """Base class: a per-example loss with a proven logit-gradient bound
    ``lipschitz(num_classes)``. Only the subclasses defined here are accepted by
    :func:`~dpclip.lipschitz.lipschitz_bounds` (a constant must be proven, not declared)."""

    def lipschitz(self, num_classes: int) -> float:  # pragma: no cover - abstract
        raise NotImplementedError


class TemperedCrossEntropy(LipschitzLoss):
    """Softmax cross-entropy of the logits divided by a temperature: ``CE(z / tau, y)``.

    Gradient ``(softmax(z/tau) - e_y) / tau``. With ``p = softmax(z/tau)``,
    ``||p - e_y||^2 = (1 - p_y)^2 + sum_{j != y} p_j^2 <= 2 (1 - p_y)^2 < 2`` (the off-label mass
    sums to ``1 - p_y``), so ``L = sqrt(2) / tau`` for every number of classes. ``tau = 1`` is the
    plain cross-entropy. A larger ``tau`` lowers the sensitivity (less noise) but flattens the loss.
    """

    def __init__(self, temperature: float = 1.0) -> None:
        super().__init__()
        self.temperature = _positive(temperature, "temperature", "TemperedCrossEntropy")

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        _check_logits(logits, targets, "TemperedCrossEntropy")
        return F.cross_entropy(logits / self.temperature, targets, reduction="none")

    def lipschitz(self, num_classes: int) -> float:
        return math.sqrt(2.0) / self.temperature

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}"


class CosineSimilarityLoss(LipschitzLoss):
    """``1 - <e_y, z / max(||z||, K)>`` (Bethune et al.'s ``KCosineSimilarity``).

    ``z -> z / max(||z||, K)`` is ``(1/K) P_K(z)`` with ``P_K`` the projection onto the ball of
    radius ``K`` (1-Lipschitz), and ``<e_y, .>`` is 1-Lipschitz: ``L = 1/K``. ``K > 0`` is
    required: the plain cosine similarity (``K = 0``) has gradient norm ``1/||z||``, unbounded
    near ``z = 0``.
    """

    def __init__(self, min_norm: float = 1.0) -> None:
        super().__init__()
        self.min_norm = _positive(min_norm, "min_norm (K)", "CosineSimilarityLoss")

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        _check_logits(logits, targets, "CosineSimilarityLoss")
        # max(||z||, K) = sqrt(max(||z||^2, K^2)): no NaN gradient at z = 0
        scale = logits.pow(2).sum(dim=1).clamp_min(self.min_norm**2).sqrt()
        return 1.0 - logits.gather(1, targets[:, None]).squeeze(1) / scale

    def lipschitz(self, num_classes: int) -> float:
        return 1.0 / self.min_norm

    def extra_repr(self) -> str:
        return f"min_norm={self.min_norm}"


class MulticlassHingeLoss(LipschitzLoss):
    """Multiclass hinge loss with margin ``m``.

    * ``aggregation="max"`` (Crammer-Singer): ``max_{j != y} (m - z_y + z_j)_+``. Its gradient is
      ``0`` or a convex combination of ``e_j - e_y`` (ties), so ``L = sqrt(2)``.
    * ``aggregation="sum"`` (Weston-Watkins, ``nn.MultiMarginLoss`` without the ``1/C``):
      ``sum_{j != y} (m - z_y + z_j)_+``. Its gradient is ``sum_{j in A} e_j - |A| e_y`` for the
      set ``A`` of active classes, of norm ``sqrt(|A| + |A|^2) <= sqrt(C (C - 1))``:
      ``L = sqrt(C(C-1))``.
    """

    def __init__(self, margin: float = 1.0, aggregation: Literal["max", "sum"] = "max") -> None:
        super().__init__()
        self.margin = _positive(margin, "margin", "MulticlassHingeLoss")
        if aggregation not in ("max", "sum"):
            raise ValueError(
                f"MulticlassHingeLoss: aggregation must be 'max' (Crammer-Singer) or 'sum' "
                f"(Weston-Watkins), got {aggregation!r}"
            )
        self.aggregation = aggregation

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        _check_logits(logits, targets, "MulticlassHingeLoss")
        true = logits.gather(1, targets[:, None])
        margins = F.relu(self.margin - true + logits)
        # the j = y term equals m; mask it out (an arange comparison works under vmap, one_hot not)
        is_true = torch.arange(logits.shape[1], device=logits.device)[None, :] == targets[:, None]
        margins = margins.masked_fill(is_true, 0.0)
        if self.aggregation == "max":
            return margins.amax(dim=1)
        return margins.sum(dim=1)

    def lipschitz(self, num_classes: int) -> float:
        if self.aggregation == "max":
            return math.sqrt(2.0)
        return math.sqrt(num_classes * (num_classes - 1))

    def extra_repr(self) -> str:
        return f"margin={self.margin}, aggregation={self.aggregation!r}"
