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

from dpclip.engine._common import (
    batch_chunks,
    check_batch,
    check_chunk_size,
    exact_float32,
    out_dtype,
    trainable_params,
    wide_requested,
)
from dpclip.engine.batch import call_model, map_batch
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
    #: the sum over the examples formed in float64: the model runs on float64 copies of its
    #: floating parameters, buffers and inputs (``torch.func.functional_call``; the model itself
    #: untouched), the gradients are summed over the chunks in float64 and cast once. Set by
    #: :func:`dpclip.training.step.bound_step`, and implied inside ``_common.wide_sums`` (every
    #: ``dp_step``, whatever engine wraps this one): a bound-based strategy's sensitivity holds for the
    #: exact sum, and a float32 backward sums the examples one after another in MKL, which a
    #: designed batch steered to 31.7 times the certified sensitivity at B = 65,536 (7646 times
    #: at 2^20; hundred-and-forty-sixth hostile review). Batch clipping clips each unit's sum,
    #: whatever its rounding, and keeps the model's dtype.
    float64: bool = False

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
        release_wide = wide_requested()  # (dp_step's: the float64 sums go to the release uncast)
        batch = check_batch(inputs, targets, self.name)
        groups.validate(model)
        params = trainable_params(model)
        grads = zeros_like_params(model)
        # (inside dp_step / bound_step, wide_sums, whatever wraps this engine: a distributed
        # run's summed engine inside DistributedEngine kept the float32 backward, 31.7 times the
        # certified sensitivity at B = 65,536; hundred-and-fifty-fourth hostile review)
        wide = (self.float64 or release_wide) and any(
            p.dtype in (torch.float32, torch.float16, torch.bfloat16) for p in params.values())
        if wide:  # (see the field: float64 copies, the model untouched)
            copies = {n: t.detach().double().requires_grad_(t.requires_grad)
                      if t.is_floating_point() and t.dtype != torch.float64 else t
                      for n, t in [*model.named_parameters(), *model.named_buffers()]}
            params = {n: copies[n] for n in params}
            grads = {n: torch.zeros_like(g, dtype=torch.float64) for n, g in grads.items()}
        loss_sum = 0.0
        with torch.enable_grad():
            for rows, xs, ys in batch_chunks(inputs, targets, batch, self.max_physical_batch):
                if wide:
                    xs = map_batch(lambda t: t.double() if t.is_floating_point() else t, xs)
                # nothing a chunk leaves in process state reaches the next (dpclip.engine.isolation)
                with Isolated(model):
                    losses = loss_fn(_call64(model, copies, xs) if wide
                                     else call_model(model, xs), ys)
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
        if wide or release_wide:  # (cast once, to the parameters' sum dtype, with gradual
            # underflow; under wide_sums, bound_step's, after the noise: _common.wide_sums)
            own = trainable_params(model)
            with exact_float32():
                grads = {n: g.to(out_dtype(own[n].dtype, release_wide))
                         for n, g in grads.items()}
        return EngineResult(grads=grads, norms=None, weights=None, loss_sum=loss_sum)


def _call64(model: nn.Module, copies: dict[str, Any], inputs: Any) -> Any:
    """``call_model`` on the float64 ``copies`` of the model's parameters and buffers."""
    if isinstance(inputs, dict):
        return torch.func.functional_call(model, copies, (), inputs, tie_weights=True)
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    return torch.func.functional_call(model, copies, args, tie_weights=True)
