"""Per-example losses proved separable by their semantics, so that the ghost engine need not trace
them on every step.

The ghost engine proves a forward pass per-example separable by tracing it
(:mod:`dpclip.engine.separable`), except for plain chains of known ``torch.nn`` modules
(``ghost_forward._KNOWN_MODULES``), which are proved from the modules' documented semantics. The
loss function is user code and was traced on every call, which costs more than the loss itself on
small models (about 0.1 ms per step on the benchmark MLP, docs/engines.md "Fixed cost per call").
The losses below are proved like the known modules, by what they compute:

* :func:`cross_entropy_per_example` (dpclip's own helper: the default loss of ``make_private``,
  ``dpclip train`` and ``dpclip bench``) and an instance of exactly ``torch.nn.CrossEntropyLoss``
  with ``reduction='none'``, no class weights, the default ``ignore_index`` and no label
  smoothing, applied to ``(B, C)`` logits and ``(B,)`` integer class indices: loss row ``i`` is
  ``-log_softmax(h_i)[y_i]``, a function of row ``i`` of each argument alone;
* an instance of exactly ``torch.nn.MSELoss`` with ``reduction='none'`` applied to an output and a
  target of the SAME shape (no broadcast: ``(B, 1)`` against ``(B,)`` broadcasts to ``(B, B)`` and
  mixes the targets): ``(h_i - y_i)^2`` elementwise.

Run-time conditions, checked on every call (:func:`known_loss`): the exact class (a subclass may
override any method), the class's own ``forward`` (not replaced on the class or the instance), no
module hooks (instance or global), plain ``torch.Tensor`` arguments (a subclass can run user code
through ``__torch_function__``), no active torch function or dispatch mode (user code on every
operation), and the shapes above. Anything else is traced as before: the fast path only ever skips
the trace of a loss whose per-example separability does not depend on anything the trace sees.
Tests: tests/engine/test_known_losses.py (each condition has an attack that must still be traced
and refused).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dpclip.engine.memory_watch import foreign_saved_tensor_hooks
from dpclip.engine.plain_module import global_hooks_clear, plain_instance

__all__ = ["cross_entropy_per_example", "known_loss", "known_loss_fn"]

#: bound at import: a later reassignment of ``torch.nn.functional.cross_entropy`` is not called
_CROSS_ENTROPY = nn.functional.cross_entropy
_CE_FORWARD = nn.CrossEntropyLoss.forward
_MSE_FORWARD = nn.MSELoss.forward


def cross_entropy_per_example(outputs: Tensor, targets: Tensor) -> Tensor:
    """Per-example cross-entropy, ``F.cross_entropy(outputs, targets, reduction="none")``: one
    loss per example, shape ``(B,)`` for ``(B, C)`` logits.

    Privacy: row ``i`` depends on row ``i`` of the logits and the targets only; the ghost engine
    proves this from the function's identity instead of tracing it (module docstring)."""
    return _CROSS_ENTROPY(outputs, targets, reduction="none")


def _plain_module(loss: nn.Module, forward: Any) -> bool:
    # plain_instance: configuration of exact built-in types (a str subclass as ``reduction``
    # answered the check "none" and ran user code inside the loss: third hostile review, LOO
    # 1.04 C), no hooks, exact parameters and buffers
    return (type(loss).forward is forward and plain_instance(loss)
            and not (loss._forward_hooks or loss._forward_pre_hooks or loss._backward_hooks
                     or loss._backward_pre_hooks)
            and global_hooks_clear())


def _class_indices(h: Tensor, ys: Tensor, batch: int) -> bool:
    return (h.ndim == 2 and ys.ndim == 1 and h.shape[0] == batch and ys.shape[0] == batch
            and ys.dtype == torch.int64)


def known_loss_fn(loss_fn: Any) -> bool:
    """The conditions of :func:`known_loss` that do not depend on the arguments: ``loss_fn`` is one
    of the module docstring's losses (class, configuration, forward, hooks) and no torch function
    or dispatch mode is active. A cheap test before the forward runs."""
    if torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack():
        return False
    if foreign_saved_tensor_hooks() is not None:
        return False  # user code that can rewrite what the backward reads
    if loss_fn is cross_entropy_per_example:
        return True
    cls = type(loss_fn)
    if cls is nn.CrossEntropyLoss:
        return (_plain_module(loss_fn, _CE_FORWARD) and loss_fn.reduction == "none"
                and loss_fn.weight is None and loss_fn.ignore_index == -100
                and loss_fn.label_smoothing == 0.0)
    if cls is nn.MSELoss:
        return _plain_module(loss_fn, _MSE_FORWARD) and loss_fn.reduction == "none"
    return False


def known_loss(loss_fn: Any, h: Any, ys: Any, batch: int) -> bool:
    """Whether ``loss_fn(h, ys)`` is one of the module docstring's losses under its run-time
    conditions: per-example separable by its semantics, so its trace can be skipped. ``False``
    means "trace it", never "refuse it"."""
    if type(h) is not Tensor or type(ys) is not Tensor or not known_loss_fn(loss_fn):
        return False
    if type(loss_fn) is nn.MSELoss:
        return h.ndim >= 1 and h.shape == ys.shape and h.shape[0] == batch \
            and h.dtype == ys.dtype
    return _class_indices(h, ys, batch)
