"""The summed engine: one ordinary batched backward of the SUM of the per-example losses.

For strategies that need no per-example quantity (algorithms.md 1.5, class NONE): bound-based
strategies (Lip-DP-SGD, whose sensitivity is certified from the weights) and batch clipping, which
clips the gradient of a whole mini-set unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from dpclip.engine._common import batch_chunks, check_batch, check_chunk_size, trainable_params
from dpclip.engine.batch import call_model
from dpclip.engine.base import EngineResult, LossFn, ParamGroups, WeightFn, zeros_like_params
from dpclip.engine.isolation import Isolated, check_structure
from dpclip.engine.op_entry import no_compiled_autograd

__all__ = ["SummedEngine"]


@dataclass(frozen=True)
class SummedEngine:
    """``grads = d/dtheta sum_i loss_i`` with a plain batched forward and ``torch.autograd.grad``.

    Returns ``norms=None, weights=None``: it computes no per-example norms, so ``weight_fn`` must be
    ``None``. Privacy: this engine bounds nothing by itself; the strategy using it must certify the
    sensitivity another way (weight bounds, or clipping the batch-unit gradient). BatchNorm is
    allowed (the batch is treated as one unit). ``B = 0`` gives zero gradients.

    ``max_physical_batch`` (optional) splits the batch into chunks whose gradients are added (memory
    only; the sum is the same up to float rounding, except with batch-statistics layers such as a
    training-mode BatchNorm, whose statistics are then per chunk). ``None``: one chunk.
    The model is never mutated (``torch.autograd.grad``, no ``p.grad``).
    """

    name: ClassVar[str] = "summed"
    per_example: ClassVar[bool] = False

    max_physical_batch: int | None = None

    def __post_init__(self) -> None:
        if self.max_physical_batch is not None:
            check_chunk_size(self.max_physical_batch, "SummedEngine")

    def compute(self, model: nn.Module, loss_fn: LossFn, inputs: Any, targets: Any,
                weight_fn: WeightFn | None, groups: ParamGroups) -> EngineResult:
        if weight_fn is not None:
            raise ValueError(
                "summed engine: weight_fn must be None. The summed engine computes no per-example "
                "norms, so it cannot apply per-example weights; it is for bound-based strategies "
                "(e.g. Lip-DP-SGD) and batch clipping. Use the 'vmap' engine for norm-based "
                "strategies."
            )
        check_structure(model, f"{self.name} engine")  # (before any of the model's methods runs)
        batch = check_batch(inputs, targets, self.name)
        groups.validate(model)
        params = trainable_params(model)
        grads = zeros_like_params(model)
        loss_sum = 0.0
        with torch.enable_grad():
            for rows, xs, ys in batch_chunks(inputs, targets, batch, self.max_physical_batch):
                # nothing a chunk leaves in process state reaches the next (dpclip.engine.isolation)
                with Isolated(model):
                    losses = loss_fn(call_model(model, xs), ys)
                    if losses.ndim == 0 or losses.shape[0] != rows:
                        from dpclip.engine.errors import loss_shape_error

                        raise loss_shape_error(losses.ndim, "summed engine: ")
                    total = losses.sum()
                    loss_sum += float(total.detach())
                    if not params or not total.requires_grad:
                        del xs, ys, losses, total  # (inside the isolation: batch_chunks)
                        continue
                    with no_compiled_autograd():
                        gs = torch.autograd.grad(total, list(params.values()),
                                                 allow_unused=True)
                    del xs, ys, losses, total  # (the engine's copies: batch_chunks)
                for name, g in zip(params, gs):
                    if g is not None:
                        grads[name] += g
        return EngineResult(grads=grads, norms=None, weights=None, loss_sum=loss_sum)
