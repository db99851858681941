"""The loop rules of ``make_private``, enforced: :class:`LoopGuard`.

``dpclip.make_private`` leaves the training loop to the user, so the loop can break the privacy
argument in ways the step itself cannot see. The accountant assumes that

1. every batch drawn from ``dp.loader`` / ``dp.sample()`` is released exactly once by
   ``dp.backward`` (a loop that skips a batch, ``if len(x) == 0: continue``, makes the loader
   draw again: rejection sampling, whose inclusion rate per released step is larger than the
   accounted sample rate);
2. the batch is released as drawn (an in-place edit, ``x.sub_(x.mean(0))``, keeps the tensor's
   identity but mixes the examples);
3. the optimizer applies the released gradient and nothing else (a leftover
   ``loss_fn(model(x), y).backward()`` after ``dp.backward`` adds a raw, unclipped, un-noised
   gradient to ``p.grad``; the Opacus habit ``loss.backward(); optimizer.step()`` over
   ``dp.loader`` without ``dp.backward`` trains with raw gradients and spends no epsilon).

:class:`LoopGuard` checks each rule where it can be seen, and raises :class:`LoopRuleError`
(a ``RuntimeError``) naming the rule and the fix:

* ``on_draw`` (``dp.sample()``, so every ``dp.loader`` iteration): refuses to draw while the last
  drawn batch is unreleased (rule 1; also what stops the Opacus habit on its second batch), and
  records the version counter (``Tensor._version``) of every tensor of the new batch;
* ``check_batch`` (``dp.backward``): refuses a batch whose tensors changed in place since the
  draw (rule 2);
* ``on_release`` (end of a successful ``dp.backward``): records each released ``p.grad`` tensor
  and its version counter;
* an optimizer step pre-hook (``torch.optim.Optimizer.register_step_pre_hook``): refuses a step
  with no release since the last step, and a step whose ``p.grad`` is not the released tensor or
  was changed in place after the release (rule 3). Autograd accumulates a second backward into
  ``p.grad`` either in place (the version counter moves) or by replacing the tensor (identity),
  so both are checked.

A failed ``dp.backward`` (an exception inside the step) leaves the batch unreleased: the next draw
is refused, because catching the error and drawing again is rejection sampling too.

Edge cases: several ``PrivateTraining`` objects may share one optimizer (a resumed run built
beside the first); the hook checks for the most recent one only. The guard keeps no state on
parameters or modules; the optimizer gets one step pre-hook, removed by :meth:`LoopGuard.detach`.
Version counters are an implementation detail of PyTorch that every in-place operation bumps;
an in-place change made outside PyTorch (numpy on a shared buffer) is not seen.
"""

from __future__ import annotations

import weakref
from typing import Any, Mapping

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from dpclip._ident import ident

__all__ = ["LoopGuard", "LoopRuleError"]


class LoopRuleError(RuntimeError):
    """A ``make_private`` training loop broke a rule the privacy accounting relies on."""


#: optimizer -> the guard of the most recent PrivateTraining built on it
_ACTIVE: "weakref.WeakKeyDictionary[torch.optim.Optimizer, LoopGuard]" = \
    weakref.WeakKeyDictionary()
#: optimizers that carry the (one) step pre-hook
_HOOKED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


def _step_pre_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    guard = _ACTIVE.get(optimizer)
    if guard is not None:
        # (torch passes step's own positional arguments with the optimizer first)
        if any(a is not None for a in args[1:]) or kwargs.get("closure") is not None:
            # (torch's optimizers call the closure inside step, after this check: its backward
            # replaced the released gradient with a raw one, 928 C; eighty-eighth review)
            raise LoopRuleError(
                "optimizer.step(closure): a closure is called inside step, after the check that "
                "the gradient applied is the one dp.backward released, and its backward would "
                "replace it with a raw, unclipped, un-noised gradient. Call dp.backward(x, y), "
                "then optimizer.step() without a closure (optimizers that need one, LBFGS, "
                "cannot train privately this way)")
        guard.check_optimizer_step(optimizer)


def _leaves(batch: Any) -> list[Tensor]:
    return [t for t in pytree.tree_leaves(batch) if isinstance(t, Tensor)]


class LoopGuard:
    """The state of one ``PrivateTraining`` loop: the batch drawn and not yet released, and the
    gradients released and not yet applied (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        self._drawn_versions: list[tuple[Tensor, int]] | None = None  # unreleased batch
        self._released: dict[int, tuple[str, Tensor, int]] | None = None  # ident(param) -> grad
        self._optimizer: Any = None
        if optimizer is not None:
            self.attach(optimizer)

    # ------------------------------------------------------------------------------ optimizer

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Check every ``optimizer.step()`` against the last release (one pre-hook per optimizer;
        the most recent guard attached to an optimizer is the one that checks)."""
        _ACTIVE[optimizer] = self
        self._optimizer = weakref.ref(optimizer)
        if optimizer not in _HOOKED:
            optimizer.register_step_pre_hook(_step_pre_hook)
            _HOOKED.add(optimizer)

    def detach(self) -> None:
        """Stop checking the optimizer's steps (for an optimizer used on after private training,
        e.g. public fine-tuning)."""
        opt = self._optimizer() if self._optimizer is not None else None
        if opt is not None and _ACTIVE.get(opt) is self:
            del _ACTIVE[opt]

    # -------------------------------------------------------------------------------- batches

    def on_draw(self) -> None:
        """Before a new batch is handed out: the previous one must have been released."""
        if self._drawn_versions is not None:
            raise LoopRuleError(
                "dp.loader / dp.sample(): the batch drawn before was never released by "
                "dp.backward (or its backward failed). Every drawn batch must be released once, "
                "an empty or unwanted batch too: skipping one and drawing again is rejection "
                "sampling, which the accountant does not cover, and a loop that calls "
                "loss.backward() instead of dp.backward trains without privacy. Call "
                "dp.backward(x, y) (or dp.step(x, y)) for every batch, before optimizer.step()")

    def record_draw(self, batch: tuple[Any, Any]) -> None:
        """Remember the version counter of every tensor of the batch just drawn."""
        self._drawn_versions = [(t, t._version) for t in _leaves(batch)]

    def check_batch(self) -> None:
        """In ``dp.backward``: the drawn batch must be unchanged (no in-place edit)."""
        for t, version in self._drawn_versions or ():
            if t._version != version:
                raise LoopRuleError(
                    "dp.backward: the batch drawn from dp.loader was changed in place after the "
                    "draw (e.g. x.sub_(x.mean(0)) or x /= 255): an edit computed from the batch "
                    "mixes the examples, and the privacy accounting assumes each example's "
                    "gradient depends on that example only. Scale inputs with declared public "
                    "constants inside the model (or in the data given to make_private), and pass "
                    "the batch to dp.backward as drawn")

    def let_go_of_batch(self) -> None:
        """In ``dp.backward``, once :meth:`check_batch` passed: the drawn tensors are not held
        any longer (the batch stays unreleased until :meth:`on_release`). Held through the step,
        they were reachable from this module's registry of guards (:data:`_ACTIVE`) by the
        forward while the batch-size proof ran it, which read example 0's value there and made it
        a literal of the proved program: 3.76 C at B = 8, 10.8 C at 16 under make_private with
        compiled, ghost and auto (hundred-and-seventy-third hostile review)."""
        if self._drawn_versions is not None:
            self._drawn_versions = []

    def on_release(self, grads: Mapping[str, tuple[Tensor, Tensor]]) -> None:
        """After a successful release: ``grads`` maps a parameter's name to ``(param, grad)``."""
        self._drawn_versions = None
        self._released = {ident(p): (name, g, g._version) for name, (p, g) in grads.items()}

    def check_checkpoint(self) -> None:
        """``dp.state_dict()``: refused while a drawn batch is unreleased (the checkpoint would
        carry the sampler past that draw without the refusal of a second one: loaded into a new
        ``PrivateTraining``, the loop could draw again, rejection sampling; a target example was
        in 0 of 200 released batches at q = 0.5, eighty-eighth hostile review)."""
        if self._drawn_versions is not None:
            raise LoopRuleError(
                "dp.state_dict(): the batch drawn last was never released by dp.backward (or its "
                "backward failed). A checkpoint taken now, loaded and drawn from again, would "
                "skip that batch: rejection sampling, which the accountant does not cover. "
                "Release the batch (dp.backward(x, y), an unwanted one too), then save")

    def on_failed_release(self) -> None:
        """Keep the batch marked unreleased (the next draw is refused)."""
        if self._drawn_versions is None:
            self._drawn_versions = []

    # ------------------------------------------------------------------------------- steps

    def check_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer pre-step check: a release since the last step, applied unchanged."""
        if self._released is None:
            raise LoopRuleError(
                "optimizer.step(): no private gradient was released since the last step. Call "
                "dp.backward(x, y) on the batch drawn from dp.loader before optimizer.step() "
                "(not loss.backward(): a plain backward gives raw, unclipped, un-noised "
                "gradients), or use dp.step(x, y); each release may be applied once")
        released = self._released
        for group in optimizer.param_groups:
            for p in group["params"]:
                grad = p.grad
                entry = released.get(ident(p))
                if entry is None:
                    # (whatever its requires_grad: torch's optimizers update every parameter
                    # with a gradient; one unfrozen, given a raw backward and frozen again was
                    # applied unclipped, 11.4 C, eighty-eighth review)
                    if grad is not None:
                        raise LoopRuleError(
                            "optimizer.step(): a parameter of the optimizer has a gradient that "
                            "dp.backward did not release (a loss.backward() outside dp.backward, "
                            "or on a parameter frozen since?); only released gradients may be "
                            "applied: remove the extra backward (or set that parameter's .grad to "
                            "None)")
                    continue
                name, g, version = entry
                if grad is not g or g._version != version:
                    raise LoopRuleError(
                        f"optimizer.step(): p.grad of parameter {name!r} is not the gradient "
                        "dp.backward released, unchanged: a loss.backward() after dp.backward "
                        "adds a raw, non-private gradient (and an in-place edit of p.grad, e.g. "
                        "clip_grad_norm_, is refused too: the released gradient is already "
                        "clipped and noised). Remove the extra backward / edit and call "
                        "optimizer.step() right after dp.backward")
        self._released = None
