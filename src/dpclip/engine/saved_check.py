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
(or narrower) integers, weighted by random odd 64-bit integers (one per row, one per column of
the last dimension; drawn from a generator seeded by the OS) and summed with wrap-around. Integer
sums do not depend on the reduction order, so an unchanged tensor gives the same value on every
device and thread count; a change of any bytes gives a different value except with probability
about ``2**-32``, for any change chosen without knowing the weights (32-bit words: a sign bit
flipped in two 64-bit words would cancel under odd weights). Code that reads the generator
(``dpclip.engine.saved_check._GEN``) can solve for a change the fingerprint misses: introspection
of the engine is outside the trust boundary (docs/engines.md, "Third hostile review").

Cost: twice (taken, checked) an int64 copy of each kept input and one integer matrix-vector
product (about 0.4-0.6 ms each for a 256 x 784 float32 input on one shared CPU core, against
about 2 ms for the layer's matmul there; not a benchmark), only on traced steps (a chain of known
modules with a known loss runs no user code that could write).
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


def _words(t: Tensor) -> Tensor:
    """``t``'s bytes as a 2-D ``(rows, last)`` int64 tensor of its 8-, 16- or 32-bit words
    (32-bit words: a 64-bit word's sign bit, flipped in two elements, would cancel under odd
    64-bit weights; a 32-bit word's cannot)."""
    u = t.detach()
    if u.is_complex():
        u = torch.view_as_real(u)
    if u.dtype == torch.bool:
        u = u.view(torch.int8)
    if u.ndim == 0:
        u = u.reshape(1)
    if not u.is_contiguous():
        u = u.contiguous()
    w = u.view(_INT.get(u.element_size(), torch.int32))
    return w.reshape(-1, w.shape[-1]).long() if w.numel() else w.reshape(0, 1).long()


def _value(v: Tensor, rw: Tensor, cw: Tensor) -> Tensor:
    """``sum_ij rw_i v_ij cw_j`` with wrap-around (exact, any reduction order)."""
    if v.device.type == "cpu":
        return (torch.mv(v, cw) * rw).sum()  # (no product temporary of the full size)
    return ((v * cw).sum(1) * rw).sum()


Print = tuple  # (value, row weights, column weights, shape, dtype)


def fingerprint(t: Tensor) -> Print | None:
    """``(value, row weights, column weights, shape, dtype)`` of ``t``'s bytes (module docstring),
    or None for a tensor whose bytes cannot be viewed (sparse, quantized, meta): it is then not
    checked. Runs with Python dispatch and torch functions off and without autograd (engine code:
    the trace must not see it)."""
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        return None
    with torch.no_grad(), torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        v = _words(t)
        rw, cw = _weights(v.shape[0], t.device), _weights(v.shape[1], t.device)
        return _value(v, rw, cw), rw, cw, tuple(t.shape), t.dtype


def unchanged(t: Tensor, printed: Print | None) -> bool:
    """Whether ``t``'s bytes still give the fingerprint taken earlier (True when none was)."""
    if printed is None:
        return True
    value, rw, cw, shape, dtype = printed
    if tuple(t.shape) != shape or t.dtype != dtype:
        return False
    with torch.no_grad(), torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        return bool(_value(_words(t), rw, cw) == value)
