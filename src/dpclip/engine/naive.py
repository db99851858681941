"""The naive per-example engine: an explicit Python loop, one ordinary backward per example.

Slow, but obviously correct: it is the oracle of the engine tests (float64 parity, anchors P17) and
a debugging aid. :class:`NaiveEngine` fulfils the same contract as
:class:`~dpclip.engine.vmap.VmapEngine`.

Trust assumption (not checked): the model keeps no example's data between calls in Python state
outside the model (a module-level list, a closure): the loop calls the forward once per example,
in order, so such state carries one example's data into the next example's gradient (sixty-eighth
hostile review: a global list of the previous inputs, 1.73 C). The model's own attributes and
buffers are guarded (a write is refused), and each example's data is a copy of its own (a view of
the batch reached the other examples through ``as_strided``). ``vmap`` cannot carry a tensor out
of its call (functorch refuses an escaped wrapper) and ``ghost`` traces every operation; prefer
them where they run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from dpclip.engine._common import (
    ChunkGrads,
    MaterializingEngine,
    UserGenerators,
    check_batch,
    check_per_example_model,
    trainable_params,
)
from dpclip.engine.base import LossFn
from dpclip.engine.batch import call_model, first_tensor, owned_slice
from dpclip.engine.generators import OwnGenerators
from dpclip.engine.op_entry import no_compiled_autograd

__all__ = ["NaiveEngine", "naive_per_example_grads"]


def naive_per_example_grads(
    model: nn.Module, loss_fn: LossFn, inputs: Any, targets: Any
) -> dict[str, Tensor]:
    """``{name: (B, *param.shape)}``: example ``i``'s gradient of ``loss_fn(model(x_i[None]),
    y_i[None]).sum()`` for every trainable parameter, by a Python loop of ``torch.autograd.grad``.

    ``inputs``/``targets``: a tensor or a tuple/dict of tensors (:mod:`dpclip.engine.batch`).
    Raw gradients: NaN/Inf are returned as computed (the engines, not this oracle, zero them).
    A parameter the loss does not reach gets zeros. ``B = 0`` gives tensors of shape ``(0, *shape)``.
    Does not touch ``p.grad``. Refuses models that mix examples (BatchNorm using batch statistics).
    """
    grads, _ = _naive_loop(model, loss_fn, inputs, targets, "naive")
    return grads


def _naive_loop(
    model: nn.Module, loss_fn: LossFn, inputs: Any, targets: Any, engine: str
) -> tuple[dict[str, Tensor], Tensor]:
    batch = check_batch(inputs, targets, engine)
    check_per_example_model(model, engine)
    params = trainable_params(model)
    rows: dict[str, list[Tensor]] = {n: [] for n in params}
    losses: list[Tensor] = []
    watch = UserGenerators()
    with torch.enable_grad():
        for i in range(batch):
            # each example under default generators of its own (one seed drawn per example from
            # the chunk's: a draw count that depends on an example cannot move the next one's
            # draws; thirtieth hostile review) and no generator the model holds
            with OwnGenerators(), watch:
                # (own copies: a slice of the batch shares its storage, which as_strided or
                # a storage read from the example reaches beyond it: sixty-seventh review)
                loss = loss_fn(call_model(model, owned_slice(inputs, i, i + 1)),
                               owned_slice(targets, i, i + 1))
            watch.refuse(engine + " engine")
            if loss.ndim == 0 or loss.shape[0] != 1:
                raise ValueError(
                    "loss_fn must return per-example losses with a leading batch dimension "
                    f"(reduction 'none'); for one example it returned shape {tuple(loss.shape)}"
                )
            loss = loss.sum()
            losses.append(loss.detach())
            if not params:
                continue
            with no_compiled_autograd():
                gs = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
            for (name, p), g in zip(params.items(), gs):
                rows[name].append(torch.zeros_like(p) if g is None else g.detach())
    grads = {
        n: torch.stack(rows[n]) if batch else p.detach().new_zeros((0, *p.shape))
        for n, p in params.items()
    }
    loss_t = torch.stack(losses) if losses else first_tensor(inputs).new_zeros(
        0, dtype=torch.float64)
    return grads, loss_t


@dataclass(frozen=True)
class NaiveEngine(MaterializingEngine):
    """Same contract as :class:`~dpclip.engine.vmap.VmapEngine` (norms, non-finite handling, groups,
    weighted sum, empty batch, BatchNorm refusal), with per-example gradients from an explicit loop.

    ``max_physical_batch`` bounds how many per-example gradients are held at once (memory only).
    """

    name: ClassVar[str] = "naive"

    def _chunk_grads(self, model: nn.Module, loss_fn: LossFn,
                     params: dict[str, Tensor]) -> ChunkGrads:
        return lambda xs, ys, rows: _naive_loop(model, loss_fn, xs, ys, self.name)
