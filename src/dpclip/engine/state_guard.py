"""A guard on the model state that private data could reach without noise: parameters' data and
tensors kept in module attributes (buffers have their own guard, ``dpclip.training.step``).

A forward pass can write private data into state that outlives the step: a
``nn.Parameter(requires_grad=False)`` updated in ``forward`` (it ends up in the released
``state_dict`` holding, say, the private batch mean), a write through ``p.data`` or a NumPy view
(no version counter sees those), or a tensor stored in a Python attribute (``self.prev = h``) and
read by the next call (one example then moves every example of the next batch). The guard
snapshots every parameter and every tensor attribute of every module before the block, compares
them by value after it, restores what changed (the original objects, the original values) and
raises :class:`~dpclip.engine.errors.PrivateBufferError` naming them.

What it cannot see: tensors kept outside the model (a global, a closure of the loss function); the
ghost engine's tracer refuses those when they are read in a later call (data from an earlier call
is MIXED) and refuses any write of batch data into a tensor that existed before the forward.
Cost: one copy of the parameters and attribute tensors per step, and one comparison.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from dpclip.engine.errors import PrivateBufferError

__all__ = ["state_guard"]


def _attr_tensors(model: nn.Module) -> list[tuple[str, nn.Module, str, Tensor]]:
    """Tensors kept in plain attributes of modules (not parameters or buffers), with their place."""
    got = []
    for mname, mod in model.named_modules():
        for k, v in vars(mod).items():
            if isinstance(v, Tensor) and not isinstance(v, nn.Parameter):
                got.append((f"{mname}.{k}" if mname else k, mod, k, v))
    return got


@contextlib.contextmanager
def state_guard(model: nn.Module, where: str = "dp_step") -> Iterator[None]:
    """Refuse and undo any change of parameter data or module tensor attributes in the block
    (see the module docstring). Raises :class:`~dpclip.engine.errors.PrivateBufferError`
    (docs/errors.md, entry 81)."""
    with torch.no_grad():
        params = [(n, p, p.detach().clone()) for n, p in model.named_parameters(
            remove_duplicate=True)]
        attrs = [(n, mod, k, v, v.detach().clone()) for n, mod, k, v in _attr_tensors(model)]
        names = {id(mod) for _, mod in model.named_modules()}
    try:
        yield
    finally:
        changed: list[str] = []
        with torch.no_grad():
            for n, p, copy in params:
                if p.shape != copy.shape or p.dtype != copy.dtype or \
                        not torch.equal(p.detach(), copy):
                    changed.append(n)
                    if p.shape != copy.shape or p.dtype != copy.dtype:
                        p.data = copy
                    else:
                        p.detach().copy_(copy)
            for n, mod, k, v, copy in attrs:
                now = vars(mod).get(k)
                if now is not v or not torch.equal(v.detach(), copy):
                    changed.append(n)
                    if v.shape == copy.shape:
                        v.detach().copy_(copy)
                    setattr(mod, k, v)
            current = dict(model.named_parameters(remove_duplicate=True))
            for n, p, _ in params:  # a parameter replaced by another object
                if current.get(n) is not p:
                    changed.append(n)
                    mname, _, k = n.rpartition(".")
                    setattr(model.get_submodule(mname) if mname else model, k, p)
            before = {n for n, *_ in attrs}
            for n, mod, k, v in _attr_tensors(model):  # tensors stored in new attributes
                if n not in before and id(mod) in names:
                    changed.append(n)
                    delattr(mod, k)
    if changed:
        raise PrivateBufferError(
            f"{where}: the model changed parameter data or tensor attribute(s) "
            f"{', '.join(repr(c) for c in changed)} while computing private gradients; "
            "state written from private data (a non-trainable parameter updated in forward, "
            "a write through p.data, a tensor kept in self.<attr> for the next call) would leave "
            "the run without noise. They were restored. Fix: keep such statistics out of the "
            "forward, compute them from public data, or release them through a private "
            "mechanism")
