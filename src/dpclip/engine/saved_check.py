"""Whether the tensors the ghost engine keeps from the forward are unchanged when it reads them.

The engine keeps each ruled layer's input ``a`` from its call and reads it after the backward
(the per-example norms and the weighted sum). An in-place write to ``a`` after the call bumps its
version counter, which the engine checks; but a write with Python dispatch and torch functions
switched off (``torch._C._DisableTorchDispatch``, ``torch._C.DisableTorchFunction``: the trace
does not see it), followed by ``torch._C._autograd._unsafe_set_version_counter`` (the counter set
back), leaves no trace at all. The layer's output was computed from the original ``a`` and the
engine would read example ``i``'s gradient from a rewritten ``a`` that mixes the batch (third
hostile review: ``a + 5 a.mean(0)`` after the last layer, accepted with LOO 1.54 C).

Only the bytes cannot be fooled, so :func:`fingerprint` reads them: the tensor's bytes as 32-bit
(or narrower) integers, weighted by secret random 64-bit integers (one per row, one per column
of the last dimension; drawn from a generator seeded by the OS, never exposed) and summed with
wrap-around. Integer sums do not depend on the reduction order, so an unchanged tensor gives the
same value on every device and thread count; a change of any bytes gives a different value except
with probability about ``2**-32`` (for any change the writer can choose without knowing the
weights). Cost: one pass over each kept input (a few elementwise operations and two sums), only on
traced steps (a chain of known modules with a known loss runs no user code that could write).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

__all__ = ["fingerprint", "unchanged"]

_GEN = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
_INT = {1: torch.int8, 2: torch.int16}


def _weights(n: int, device: torch.device) -> Tensor:
    w = torch.randint(-(2 ** 62), 2 ** 62, (n,), generator=_GEN, dtype=torch.int64)
    return (w * 2 + 1).to(device)  # odd: a change in the lowest bit of one element is seen


def _ints(t: Tensor) -> Tensor:
    """``t``'s bytes as a flat int64 tensor of its 8-, 16- or 32-bit words."""
    u = t.detach().contiguous().reshape(-1) if t.ndim else t.detach().reshape(1)
    if u.is_complex():
        u = torch.view_as_real(u).reshape(-1)
    if u.dtype == torch.bool:
        u = u.view(torch.int8)
    return u.view(_INT.get(u.element_size(), torch.int32)).to(torch.int64)


def _value(v: Tensor, rw: Tensor, cw: Tensor) -> Tensor:
    pad = rw.shape[0] * cw.shape[0] - v.shape[0]
    if pad:
        v = torch.cat([v, v.new_zeros(pad)])
    return ((v.view(rw.shape[0], cw.shape[0]) * cw).sum(1) * rw).sum()


Print = tuple  # (value, row weights, column weights, shape, dtype)


def fingerprint(t: Tensor) -> Print | None:
    """``(value, row weights, column weights, shape, dtype)`` of ``t``'s bytes (module docstring),
    or None for a tensor whose bytes cannot be viewed (sparse, quantized, meta): it is then not
    checked. Runs with Python dispatch and torch functions off and without autograd (engine code:
    the trace must not see it)."""
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        return None
    with torch.no_grad(), torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        v = _ints(t)
        cols = min(64, max(1, v.shape[0]))
        rows = -(-v.shape[0] // cols)
        rw, cw = _weights(rows, t.device), _weights(cols, t.device)
        return _value(v, rw, cw), rw, cw, tuple(t.shape), t.dtype


def unchanged(t: Tensor, printed: Print | None) -> bool:
    """Whether ``t``'s bytes still give the fingerprint taken earlier (True when none was)."""
    if printed is None:
        return True
    value, rw, cw, shape, dtype = printed
    if tuple(t.shape) != shape or t.dtype != dtype:
        return False
    with torch.no_grad(), torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        return bool(_value(_ints(t), rw, cw) == value)
