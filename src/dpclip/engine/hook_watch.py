"""Gradient hooks attached while a proved step's forward and loss run, whatever the torch function
state (issue 31, third hostile review's open hole).

The separability tracer refuses ``Tensor.register_hook`` and reading ``Tensor.grad_fn`` through its
torch function mode (:mod:`dpclip.engine.separable`). With torch functions switched off
(``with torch._C.DisableTorchFunction(): h.register_hook(lambda g: g + 5 * g.mean(0))``) that mode
sees nothing, and autograd offers no way to list the hooks of a node: a hook that mixes the
examples' gradients in the backward was accepted (LOO 2.07 C).

:class:`HookWatch` watches the doors themselves, for the length of the forward and the loss:

* the Python functions every hook registration passes through, looked up at each call, are
  wrapped: ``Tensor.register_hook``, ``Tensor.register_post_accumulate_grad_hook`` (and with them
  ``torch.autograd.graph.register_multi_grad_hook``), and ``_HookMixin._register_hook``, which
  autograd's C++ calls by name for every node-level ``grad_fn.register_hook`` /
  ``grad_fn.register_prehook`` (built-in and custom ``Function`` nodes alike). A call records a
  finding and then registers as asked; the step is refused when the loss returns;
* when the loss returns, the hook dictionaries of every tensor the call computed, of the
  parameters, buffers and inputs (read through torch's C descriptors, not through attributes a
  subclass or a patch could override) must be empty.

What this watch cannot see: a forward that calls torch's C primitives directly, setting a hook
dictionary through the ``torch._C.TensorBase._backward_hooks`` descriptor, attaching it with
``grad_fn._register_hook_dict(t)`` and clearing the descriptor again, leaves no trace that autograd
lets Python read. The ghost engine's backward runs no hook of the graph at all
(:mod:`dpclip.engine.hook_free`), so such a hook is never called; this watch still refuses the
hooks it sees, with a message that names them. As for the memory watch, patches of torch itself
are outside too. The wrapped functions are process-wide while a step runs: a registration by
another thread in that window refuses this step (never the reverse).
"""

from __future__ import annotations

import functools
from typing import Any, Iterable

import torch
from torch import Tensor
from torch.autograd.function import _HookMixin

__all__ = ["HookWatch"]

_BACKWARD_HOOKS = torch._C.TensorBase._backward_hooks
_POST_ACCUMULATE = getattr(torch._C.TensorBase, "_post_accumulate_grad_hooks", None)

#: (owner, attribute, what a call registers)
_DOORS = ((torch.Tensor, "register_hook", "a gradient hook (Tensor.register_hook)"),
          (torch.Tensor, "register_post_accumulate_grad_hook",
           "a gradient hook (Tensor.register_post_accumulate_grad_hook)"),
          (_HookMixin, "_register_hook",
           "a hook on an autograd node (grad_fn.register_hook / register_prehook)"))


class HookWatch:
    """Hooks registered while the step runs (module docstring). :attr:`found` names the first,
    or None. A context manager; nested and concurrent watches share one set of wrappers."""

    __slots__ = ("found",)

    def __init__(self) -> None:
        self.found: str | None = None

    def note(self, what: str) -> None:
        if self.found is None:
            self.found = what

    def __enter__(self) -> "HookWatch":
        if not _ACTIVE:
            _wrap_doors()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)
        if not _ACTIVE:
            _restore_doors()

    def check(self, tensors: Iterable[Tensor]) -> str | None:
        """:attr:`found`, after reading the hook dictionaries of ``tensors`` through torch's C
        descriptors: a tensor with a hook is a finding."""
        if self.found is None:
            with torch._C.DisableTorchFunction():  # (the getters are torch functions too)
                for t in tensors:
                    if not isinstance(t, Tensor):
                        continue
                    if _BACKWARD_HOOKS.__get__(t) or (_POST_ACCUMULATE is not None
                                                      and _POST_ACCUMULATE.__get__(t)):
                        self.found = "a gradient hook on a tensor of the call"
                        break
        return self.found


_ACTIVE: list[HookWatch] = []
#: (owner, attribute, the original raw attribute) while wrapped
_ORIGINALS: list[tuple[type, str, Any]] = []


def _spy(fn: Any, what: str) -> Any:
    @functools.wraps(fn)
    def spy(*args: Any, **kwargs: Any) -> Any:
        for w in _ACTIVE:
            w.note(what)
        return fn(*args, **kwargs)
    return spy


def _wrap_doors() -> None:
    for owner, name, what in _DOORS:
        raw = owner.__dict__.get(name)
        if raw is None:  # (an older torch without this door)
            continue
        if isinstance(raw, staticmethod):
            setattr(owner, name, staticmethod(_spy(raw.__func__, what)))
        else:
            setattr(owner, name, _spy(raw, what))
        _ORIGINALS.append((owner, name, raw))


def _restore_doors() -> None:
    while _ORIGINALS:
        owner, name, raw = _ORIGINALS.pop()
        setattr(owner, name, raw)
