"""A chunk of one example: nothing to mix inside it, everything to carry between chunks (issue 31).

A forward over ONE example cannot mix examples, so the ghost engine does not trace its layouts (a
model that reduces over the batch, ``x - x.mean(0)``, is per-example at batch size one: the vmap
semantics of ``max_physical_batch=1``). But consecutive chunks (and steps) share Python state: a
model that kept the previous chunk's input in a global and added its mean to this chunk's
activations was accepted (``max_physical_batch=1``: LOO 2.70 C), and a step of one example left its
input to the next step's trace as an unmarked constant.

:class:`OneExampleWatch` runs the separability tracer over the chunk for what crosses calls only
(its layout verdict is not read):

* the example's tensors are marked, and what depends on them is retired when the chunk ends
  (``SeparabilityTracer.retire``): a later chunk or step that reads it is refused (a traced batch
  reads it as MIXED);
* reading a tensor an EARLIER call retired (``SeparabilityTracer.stale_read``) refuses this chunk;
* the tracer's violations hold as in a batch: values taken to Python or NumPy (``.item()``,
  ``.tolist()``, ``bool(t)``, ``.numpy()``), batch data written in place into a tensor from before
  the call, gradient hooks registered (also with torch functions off:
  :class:`~dpclip.engine.hook_watch.HookWatch`), saved-tensor hooks (the engine's own
  :class:`~dpclip.engine.memory_watch.SavedTensorWatch` holds autograd's slot, so an unpack hook
  registered on a saved tensor of the chunk raises), tensor subclasses.

Not covered here (stated; the batch path covers them with its proved-program match and memory
watch, which need the batch-size proof): a value computed from the example with torch functions
AND Python dispatch both switched off, kept, and read by a later chunk as a constant.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn

from dpclip.engine.batch import batch_leaves
from dpclip.engine.hook_watch import HookWatch
from dpclip.engine.memory_watch import SavedTensorWatch
from dpclip.engine.separable import SeparabilityTracer

__all__ = ["OneExampleWatch", "quiet_one"]

#: the watch of the chunk running now (the engine's own code inside it pauses its Python checks)
_NOW: list["OneExampleWatch"] = []


class OneExampleWatch:
    """Around the forward and the loss of a chunk of one example (module docstring); then
    :meth:`verdict`."""

    def __init__(self, model: nn.Module, xs: Any, ys: Any) -> None:
        self.tracer = SeparabilityTracer(1)
        self.hooks = HookWatch()
        self._model = model
        self._leaves = batch_leaves(xs, "inputs") + batch_leaves(ys, "targets")
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "OneExampleWatch":
        for t in self._leaves:
            self.tracer.mark(t, (0, 1))
        with contextlib.ExitStack() as stack:
            # the engine's own saved-tensor hooks: a saved tensor of the chunk then refuses the
            # user's (``grad_fn._raw_saved_result.register_hooks(pack, unpack)``: an unpack hook
            # that hands the backward another call's tensor)
            stack.enter_context(SavedTensorWatch(_ignore))
            stack.enter_context(self.hooks)
            stack.enter_context(self.tracer)
            self._stack = stack.pop_all()
        _NOW.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _NOW.remove(self)
        try:
            self._stack.__exit__(*exc)
        finally:
            self.tracer.retire()  # (also after a failure: what it kept is this example's data)

    def verdict(self) -> str | None:
        """Why the chunk may carry an example across calls, or None."""
        tr = self.tracer
        if tr.violation is not None:
            return tr.violation
        if tr.stale_read:
            return ("it reads a tensor that depended on the examples of an earlier call (a chunk "
                    "or a step: kept in a global, a closure or a module attribute), which carries "
                    "those examples into this one's computation")
        seen = [t for t, _ in tr._seen.items()]
        state = list(self._model.parameters()) + list(self._model.buffers())
        hook = self.hooks.check(seen + state + self._leaves)
        if hook is not None:
            return (f"{hook} was registered in the call: user code in the backward pass could "
                    "carry another example's data into this one's gradient")
        return None


def _ignore(t: object) -> None:
    """The chunk's saved-tensor sink (the watch is there to hold autograd's hook slot)."""


@contextlib.contextmanager
def quiet_one() -> Iterator[None]:
    """The engine's own code inside a chunk of one (it reads ``grad_fn`` for the gradient edge):
    the watch's Python checks pause, as the batch tracer's do (``ghost_forward._engine_code``)."""
    if not _NOW:
        yield
        return
    tr = _NOW[-1].tracer
    quiet, tr.quiet = tr.quiet, True
    try:
        yield
    finally:
        tr.quiet = quiet

