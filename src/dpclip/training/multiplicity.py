"""Augmentation multiplicity (De et al. 2022, Section 3.1): K augmented copies of each sampled
example, their gradients AVERAGED before clipping.

Each example drawn by the secret sampler is augmented ``K`` times, every copy with its own
parameters drawn from the secret sampling generator (:mod:`dpclip.data.augment`). The per-example
gradient that is clipped is the mean of the ``K`` copies' gradients,

    g_i = (1/K) sum_k grad loss(model(A_k(x_i)), y_i),      released: sum_i [g_i]_C + noise,

which is the gradient of the per-example loss ``(1/K) sum_k loss(model(A_k(x_i)), y_i)``. That is
how it is computed here: the batch is ``(B, K, *example)``; :class:`KCopyModel` runs the user's
model on the ``B K`` copies (``(B K, *example)``, the model never sees the copy dimension) and
reshapes its output to ``(B, K, ...)``; :func:`k_copy_loss` averages the user's per-example loss
over the copies. To the engines each example is then ONE input of shape ``(K, *example)`` with ONE
loss: the per-example engines (``vmap``, the ``naive`` oracle, AdaClip's materialised gradients)
compute exactly ``g_i`` above and clip it, with no change to any engine. The ``ghost`` engine (and
so ``auto``) runs the model once on the ``B K`` rows: every layer with a ghost rule sees example
``i`` in rows ``[i K, (i + 1) K)`` (layout ``(0, K)`` of :mod:`dpclip.engine.separable`, proved by
its separability trace like any layout), and its rule reads the example's gradient from those rows
as from ``K`` times the positions (a Linear on ``(B K, d)`` as one on ``(B, K, d)``, a convolution
with the copies' output positions joined; :func:`dpclip.engine.ghost_rules._fold_rows`): the norm
is the exact norm of the summed vector, the copies' cross terms included, with the engine's
rounding bound. Modules without a rule (the ghost engine's per-layer path) are re-evaluated on
each example's ``K`` rows. What the ghost engine refuses (a batch-less position embedding beside
the copies, a model that mixes the copies of different examples) ``auto`` runs on ``vmap``
(recorded).

Privacy: sensitivity unchanged. One example's contribution is ``[g_i]_C`` whatever its ``K``
augmented copies are, a vector of norm ``<= C``; adding or removing the example adds or removes that
one vector (the copies of one example are never split over two clipped vectors and never mixed
with another example's). The augmentation parameters are i.i.d. per copy and secret, so the
argument of :mod:`dpclip.data.augment` (the mixture over the augmentation randomness, joint
convexity) applies unchanged: the step is the same subsampled Gaussian event as with ``K = 1``.
The expected batch size (the divisor) counts examples, not copies.

Where it does not hold or is not built, it is refused (``check_multiplicity``):

* batch clipping units (``unit=bc``/``gbc``): the unit is already a mean over several examples;
  K copies would be folded into that mean, which is a different algorithm (De et al. define the
  trick for per-example clipping), so it is refused rather than silently redefined;
* bound-based strategies (Lip-DP-SGD): the certificate bounds one input's gradient from the input
  norm bound and the weights, and the ``summed`` engine runs one plain batched backward; the
  K-copy mean would need the certificate re-derived for a mean loss (it holds, being a convex
  combination, but dpclip does not certify it yet);
* the ``summed`` engine: it does not clip per example;
* distributed runs (not built: the shared augmentation draws would have to be sharded by copy).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

from dpclip.engine.batch import first_tensor, map_batch
from dpclip.engine.ghost import register_view

__all__ = ["KCopyModel", "check_multiplicity", "expand_copies", "k_copy_loss",
           "parse_multiplicity"]


def parse_multiplicity(value: Any, where: str = "augment_multiplicity") -> int:
    """``K`` as an int >= 1 (bool and non-integers refused with the fix)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: the augmentation multiplicity K must be an integer >= 1 (1: "
                         f"one augmented copy per example), got {value!r}")
    return value


def check_multiplicity(k: int, *, augment: Any, unit_is_individual: bool, bound_based: bool,
                       engine: str, distributed: bool, where: str = "augment_multiplicity"
                       ) -> None:
    """Refuse the settings in which K > 1 is not built or not sound (module docstring)."""
    if k == 1:
        return
    if augment is None:
        raise ValueError(
            f"{where}={k} averages the gradients of {k} AUGMENTED copies of each example, but no "
            "augmentation is set (K identical copies give the same gradient as one); set an "
            "augmentation, e.g. augment 'crop:4,flip', or use K = 1")
    if not unit_is_individual:
        raise ValueError(
            f"{where}={k} is defined for per-example clipping (unit=ic): under batch clipping the "
            "unit is already a mean over several examples and the copies would be folded into it, "
            "a different algorithm; use unit=ic, or K = 1")
    if bound_based:
        raise ValueError(
            f"{where}={k}: bound-based strategies (Lip-DP-SGD) certify the sensitivity of ONE "
            "input's gradient; dpclip does not certify the K-copy mean yet; use K = 1 or a "
            "norm-based strategy")
    if engine == "summed":
        raise ValueError(f"{where}={k}: the summed engine does not clip per example; use engine "
                         "'auto', 'ghost' or 'vmap'")
    if distributed:
        raise ValueError(f"{where}={k} is not built for distributed runs; train in one process or "
                         "use K = 1")


def expand_copies(x: Tensor, k: int) -> Tensor:
    """``(B, *example) -> (B, K, *example)``: ``K`` copies of every example (a fresh tensor)."""
    return x.unsqueeze(1).expand(x.shape[0], k, *x.shape[1:]).contiguous()


class KCopyModel(nn.Module):
    """A view of ``model`` that takes ``(B, K, *example)`` and returns ``(B, K, *output)``.

    The view holds the SAME parameter, buffer and submodule dictionaries as ``model`` (not copies,
    not a wrapper module): its parameter names are the model's, the engines' parameter
    replacement and hooks reach the model's tensors, and nothing is added to ``model``. The model
    runs on the ``B K`` copies flattened into its batch dimension. Built for one step, dropped
    after it.
    """

    def __init__(self, model: nn.Module, k: int) -> None:
        super().__init__()
        object.__setattr__(self, "_parameters", model._parameters)
        object.__setattr__(self, "_buffers", model._buffers)
        object.__setattr__(self, "_modules", model._modules)
        object.__setattr__(self, "_inner", model)
        object.__setattr__(self, "k", int(k))
        self.training = model.training

    def forward(self, x: Tensor) -> Any:  # noqa: D401 - see the class docstring
        if not isinstance(x, Tensor) or x.ndim < 2 or x.shape[1] != self.k:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"augmentation multiplicity: inputs must be (B, {self.k}, ...) (K "
                             f"copies per example, as dp.sample() draws them), got {shape}")
        b = x.shape[0]
        out = self._inner(x.reshape(b * self.k, *x.shape[2:]))
        return map_batch(lambda t: t.reshape(b, self.k, *t.shape[1:]), out)


# a fresh view is built every step: auto's engine verdict belongs to the model it views
register_view(KCopyModel, "_inner")


def k_copy_loss(loss_fn: Callable[[Any, Any], Tensor], k: int) -> Callable[[Any, Tensor], Tensor]:
    """The per-example loss averaged over the ``K`` copies: ``(B, K, ...)`` outputs and ``(B, ...)``
    targets -> ``(B,)``, ``mean_k loss_fn(out[:, k], y)`` (computed on the flattened copies)."""

    def loss(out: Any, targets: Any) -> Tensor:
        # the batch size as a size only, never a Python int (the ghost engine's batch-size proof
        # traces this with a symbolic batch: dpclip.engine.batch_symbol)
        b = first_tensor(out).shape[0]
        flat_out = map_batch(lambda t: t.reshape(b * k, *t.shape[2:]), out)
        flat_y = map_batch(lambda t: t.repeat_interleave(k, dim=0), targets)
        per_copy = loss_fn(flat_out, flat_y)
        if per_copy.ndim != 1 or per_copy.shape[0] != b * k:
            raise ValueError(
                "loss_fn must return one loss per example (reduction 'none'), shape (B,); with "
                f"augmentation multiplicity {k} it got B x {k} copies and returned a "
                f"{per_copy.ndim}-d tensor of another length (sizes left out: B is the private "
                "realised batch size)")
        return per_copy.reshape(b, k).mean(1)

    return loss
