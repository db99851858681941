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
of the engine is outside the trust boundary (docs/engines.md, "Third hostile review"). On the CPU
the print is the bytes themselves (a copy, compared with ``memcmp``: exact, and cheaper there than
the sum); on an accelerator the sum (no copy held across the backward, one synchronisation).

Cost: twice (taken, checked) an int64 copy of each kept tensor and one integer matrix-vector
product, the comparisons read with one synchronisation per check; only on traced steps (a chain
of known modules with a known loss runs no user code that could write). On the tests'
``transformer`` case (B 64, float64, one shared CPU thread) the ghost step's median went from
11-13 ms to 15-18 ms (p10 10-12 ms to 14-15 ms) with these checks, fingerprints of the layers'
state (since dropped: the proved-program match's memory watch covers that state) and the ruled
layers' pre-hooks; with the CPU byte prints and the per-operation caches of the match, 12.5-13.5
ms again (benchmarks/results/separability_overhead.md; a tiny model, where the per-tensor Python
cost dominates).
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref

import torch
from torch import Tensor

from dpclip.engine.memory_watch import _MEMCMP
from dpclip.engine import _cm

__all__ = ["all_still", "all_true", "fingerprint", "fingerprints", "same", "still", "unchanged"]

_GEN = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
_INT = {1: torch.int8, 2: torch.int16}
#: odd random weights by (device, role: 0 rows, 1 columns), grown on demand and sliced (drawing
#: them per tensor cost more than the fingerprint itself); rows and columns draw from separate
#: pools (shared weights would make the sum symmetric: a swap of v_ij and v_ji would be missed)
_POOLS: dict[tuple[str, int], Tensor] = {}


def _weights(n: int, device: torch.device, role: int) -> Tensor:
    key = (str(device), role)
    pool = _POOLS.get(key)
    if pool is None or pool.shape[0] < n:
        # grown by appending: the first weights never change, so a print taken before the pool
        # grew still matches its tensor (redrawn, every print of a smaller tensor taken before a
        # larger one was printed no longer matched: each CUDA step refused "rewritten" inputs)
        have = pool.shape[0] if pool is not None else 0
        size = max(n, 1024, 2 * have)
        w = torch.randint(-(2 ** 62), 2 ** 62, (size - have,), generator=_GEN, dtype=torch.int64)
        more = (w * 2 + 1).to(device)  # odd: one changed lowest bit is seen
        w.zero_()
        if pool is None:
            pool = _POOLS[key] = more
        else:
            grown = torch.cat([pool, more])
            # the weights are secret (a rewrite that keeps a weighted sum needs them): the blocks
            # about to be freed are cleared, so that no later torch.empty reads them back from
            # the caching allocator (thirty-sixth hostile review)
            pool.zero_()
            more.zero_()
            pool = _POOLS[key] = grown
    return pool[:n]


def _words(t: Tensor) -> Tensor:
    """``t``'s bytes as a 2-D ``(rows, last)`` int64 tensor of its 8-, 16- or 32-bit words
    (32-bit words: a 64-bit word's sign bit, flipped in two elements, would cancel under odd
    64-bit weights; a 32-bit word's cannot)."""
    u = t.detach()
    if u.is_complex():
        u = torch.view_as_real(u)
    elif u.dtype == torch.bool:
        u = u.view(torch.int8)
    if u.ndim == 0:
        u = u.reshape(1)
    if not u.is_contiguous():
        u = u.contiguous()
    w = u.view(_INT.get(u.element_size(), torch.int32))
    return w.reshape(-1, w.shape[-1]).long() if w.numel() else w.reshape(0, 1).long()


def _value(v: Tensor) -> Tensor:
    """``sum_ij r_i v_ij c_j`` with wrap-around (exact, any reduction order); a 0-dim tensor,
    not synchronised."""
    rw, cw = _weights(v.shape[0], v.device, 0), _weights(v.shape[1], v.device, 1)
    if v.device.type == "cpu":
        return (torch.mv(v, cw) * rw).sum()  # (no product temporary of the full size)
    return ((v * cw).sum(1) * rw).sum()


class _Arena(threading.local):
    """Per thread: the CPU buffers the byte prints are cut from. A fresh buffer's pages are
    faulted in at their first write (a copy into one cost ~6x a copy into mapped memory: 57.8
    against 9.2 ms for 64 MB on the 2-core CPU), so buffers are reused: ``buffers`` holds
    ``[buffer, bytes handed out, weak references to the prints cut from it]``, the one in use
    last; a full buffer is left for another whose prints are all gone (the engine drops a step's
    prints once it has checked them), else for a new one."""

    def __init__(self) -> None:
        self.buffers: list[list] = []


_ARENA = _Arena()
#: buffers kept per thread (beyond them, buffers whose prints are gone are let go)
_KEEP = 4


def _space(n: int) -> Tensor:
    """``n`` bytes of CPU memory (a uint8 tensor) that no live print uses."""
    bufs = _ARENA.buffers
    cur = bufs[-1] if bufs else None
    if cur is None or cur[1] + n > cur[0].numel():
        free = [b for b in bufs[:-1] if b[0].numel() >= n and all(r() is None for r in b[2])]
        if free:
            cur = free[0]
            del bufs[next(i for i, b in enumerate(bufs) if b is cur)]
            cur[1], cur[2] = 0, []
        else:
            size = max(n, 1 << 16, cur[0].numel() if cur is not None else 0)
            cur = [torch.empty(size, dtype=torch.uint8), 0, []]
        bufs.append(cur)
        while len(bufs) > _KEEP:
            gone = next((b for b in bufs[:-1] if all(r() is None for r in b[2])), None)
            if gone is None:
                break
            del bufs[next(i for i, b in enumerate(bufs) if b is gone)]
    buf, used, cut = cur
    view = buf[used:used + n]
    cur[1] = used + n
    cut.append(weakref.ref(view))
    return view


Print = tuple  # (value, shape, dtype, kind)
#: kinds of print: the weighted sum above (a 0-dim int64 tensor), or on the CPU the bytes
#: themselves (a uint8 copy, compared with ``memcmp``: exact, and cheaper there than the sum's
#: int64 copy and product; the copy lives as long as the print)
_SUM, _BYTES = "sum", "bytes"


def fingerprint(t: Tensor) -> Print | None:
    """``(value, shape, dtype, kind)`` of ``t``'s bytes (module docstring; on an accelerator the
    value is a 0-dim tensor on ``t``'s device, not synchronised; on the CPU a copy of the bytes),
    or None for a tensor whose bytes cannot be viewed (sparse, quantized, meta): it is then not
    checked. Runs with Python dispatch and torch functions off and without autograd (engine code:
    the trace must not see it)."""
    with _cm.no_grad(), torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        return _print(t)


def fingerprints(ts: list[Tensor]) -> list[Print | None]:
    """``[fingerprint(t) for t in ts]``, with the no-dispatch contexts entered once (for many
    small tensors the contexts cost more than the copies)."""
    with _cm.no_grad(), torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        return [_print(t) for t in ts]


def _print(t: Tensor) -> Print | None:
    """:func:`fingerprint`'s body (its contexts entered by the caller)."""
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        return None
    if t.device.type == "cpu" and _MEMCMP is not None:
        u = t.detach()
        if not u.is_contiguous():
            u = u.contiguous()
        n = u.numel() * u.element_size()
        copy = _space(n)
        if n:
            ctypes.memmove(copy.data_ptr(), u.data_ptr(), n)
        return copy, tuple(t.shape), t.dtype, _BYTES
    return _value(_words(t)), tuple(t.shape), t.dtype, _SUM


def same(now: Print | None, then: Print | None) -> Tensor | bool:
    """Whether two fingerprints of one tensor agree: a bool, or a 0-dim bool tensor (not
    synchronised; :func:`all_true` reads many at once)."""
    if then is None:
        return True
    if now is None or now[1:] != then[1:]:
        return False
    if then[3] == _BYTES:
        a, b = now[0], then[0]
        return a.numel() == b.numel() and (
            a.numel() == 0 or _MEMCMP(a.data_ptr(), b.data_ptr(), a.numel()) == 0)
    with _cm.no_grad(), torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        return now[0] == then[0]


def still(t: Tensor, then: Print | None) -> Tensor | bool:
    """``same(fingerprint(t), then)``; on the CPU one ``memcmp`` of ``t``'s memory against the
    copy when ``t`` is contiguous (no new copy)."""
    with _cm.no_grad(), torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        return _still(t, then)


def all_still(ts: list[Tensor], prints: list[Print | None]) -> bool:
    """Whether every tensor of ``ts`` still gives its print (``all_true`` of :func:`still` over
    the pairs), the no-dispatch contexts entered once."""
    if len(ts) != len(prints):
        raise ValueError(f"all_still: {len(ts)} tensors against {len(prints)} prints")
    with _cm.no_grad(), torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        return all_true([_still(t, p) for t, p in zip(ts, prints)])


def _still(t: Tensor, then: Print | None) -> Tensor | bool:
    """:func:`still`'s body (its contexts entered by the caller)."""
    if then is not None and then[3] == _BYTES and t.layout == torch.strided and \
            t.device.type == "cpu" and (tuple(t.shape), t.dtype) == then[1:3] and \
            t.is_contiguous():
        n = then[0].numel()
        return n == 0 or _MEMCMP(t.data_ptr(), then[0].data_ptr(), n) == 0
    return same(_print(t), then)


def all_true(flags: list) -> bool:
    """Whether every flag of :func:`same` is true, with one synchronisation per device."""
    tensors = [f for f in flags if isinstance(f, Tensor)]
    if not all(f for f in flags if not isinstance(f, Tensor)):
        return False
    if not tensors:
        return True
    with _cm.no_grad(), torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        return bool(torch.stack(tensors).all())


def unchanged(t: Tensor, printed: Print | None) -> bool:
    """Whether ``t``'s bytes still give the fingerprint taken earlier (True when none was)."""
    return all_true([still(t, printed)])
