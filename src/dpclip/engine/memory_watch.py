"""The memory of what a proved step reads from before the call: byte copies, compared before every
use and when the call ends (issue 31, second hostile review's open hole).

The proved-program match (:mod:`dpclip.engine.proved_program`) names the tensors the forward and
the loss read: a parameter or buffer by its name, an input leaf by its position, a tensor from
outside the call by identity. A name stands for values only while nothing writes them unseen.
Writes made through torch move version counters (``_Versioned``), and the tracer refuses every
NEW escape of a tensor's memory in the call (``.numpy()``, ``data_ptr``, DLPack, storage). What
neither sees is memory that another owner shares from BEFORE the call: a buffer or parameter made
with ``torch.from_numpy(array)``, a ``.numpy()`` view kept in an attribute at construction, a
dataset tensor that shares a NumPy array. A forward that writes ``len(x) - 7`` into that array
(no torch call at all) ran the proved program on other values: accepted, LOO 3.16 C (second
hostile review, strict xfail until this module).

:class:`MemoryWatch` watches by value instead: when the match starts it copies the bytes of every
storage the step may read from before the call (parameters, buffers, input leaves, the outside
tensors of the proof; in one copy per device), and

* before each operation of user code, every tensor argument on a watched storage must still hold
  those bytes (a write then a restore before the next use would otherwise pass);
* an operation the match accepted that writes a watched storage (a buffer counter, ``add_`` on a
  view) refreshes its copy: the write is part of the proved program;
* when the loss function returns, every watched storage must still hold its bytes: a value read
  by the backward (a weight saved for the gradient of its input) written after its last use in the
  forward would otherwise pass;
* a literal made in the call (``torch.tensor``, matched by value) is watched from its first use.

On the CPU a comparison is one ``memcmp``; on an accelerator a queued ``ne().any()`` per check, all
read with one synchronisation at the end (the step's result is used only after that). The copies
cost one extra copy of the watched state in memory for the length of the call.

Trust boundary (not seen, as for the rest of the proof): writes from another thread while the step
runs, garbage-collector finalizers, patches of torch itself, and ``ctypes`` writes to memory that is
restored before the next use and before the loss returns (nothing reads it in between).
"""

from __future__ import annotations

import ctypes
from typing import Any, Iterable

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["MemoryWatch"]


def _memcmp() -> Any:
    try:
        fn = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError):  # no C library by that name (not Linux/macOS)
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return fn


_MEMCMP = _memcmp()


def _bytes(storage: Any) -> Tensor:
    """A uint8 tensor over the whole storage's bytes (a view, no copy)."""
    n = storage.nbytes()
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (n,), (1,))


class _Slot:
    """One watched storage: the storage itself (kept alive for the call, so its address is not
    reused), its byte view, the copy, and what it is (for the message)."""

    __slots__ = ("storage", "view", "copy", "what")

    def __init__(self, storage: Any, view: Tensor, copy: Tensor, what: str) -> None:
        self.storage, self.view, self.copy, self.what = storage, view, copy, what


class MemoryWatch:
    """Byte copies of the storages a step reads from before the call (module docstring).
    :attr:`changed` names the first storage found written unseen, or None."""

    __slots__ = ("_slots", "_flags", "changed")

    def __init__(self) -> None:
        self._slots: dict[int, _Slot] = {}
        #: accelerator checks queued: (flag tensor, what)
        self._flags: list[tuple[Tensor, str]] = []
        self.changed: str | None = None

    def __len__(self) -> int:
        return len(self._slots)

    def add(self, tensors: Iterable[tuple[Tensor, str]]) -> None:
        """Watch the storages of ``tensors`` (``(tensor, what)``) not watched yet: their bytes now
        are the reference. One copy per device for all new storages."""
        with torch._C.DisableTorchFunction(), _disable_current_modes():
            self._add(tensors)

    def _add(self, tensors: Iterable[tuple[Tensor, str]]) -> None:
        new: dict[int, tuple[Any, Tensor, str]] = {}
        for t, what in tensors:
            if not isinstance(t, Tensor) or t.is_meta or t.layout != torch.strided:
                continue
            try:
                st = t.untyped_storage()
                key = st.data_ptr()
            except Exception:  # noqa: BLE001 - no storage (fake, sparse, functional)
                continue
            if key == 0 or key in self._slots or key in new or st.nbytes() == 0:
                continue
            new[key] = (st, _bytes(st), what)
        by_device: dict[Any, list[tuple[int, Any, Tensor, str]]] = {}
        for key, (st, view, what) in new.items():
            by_device.setdefault(view.device, []).append((key, st, view, what))
        for dev, items in by_device.items():
            flat = torch.cat([v for _, _, v, _ in items]) if len(items) > 1 else \
                items[0][2].clone()
            at = 0
            for key, st, view, what in items:
                n = view.numel()
                self._slots[key] = _Slot(st, view, flat[at:at + n], what)
                at += n

    def _check(self, t: Tensor) -> None:
        """``t``'s storage, if watched, must still hold its bytes."""
        try:
            slot = self._slots.get(t.untyped_storage().data_ptr())
        except Exception:  # noqa: BLE001 - no storage: nothing watched
            return
        if slot is not None:
            self._compare(slot)

    def check_args(self, args: tuple, kwargs: dict) -> None:
        """Every tensor argument (also in lists and tuples) of a call."""
        with torch._C.DisableTorchFunction():
            self._check_args(args, kwargs)

    def _check_args(self, args: tuple, kwargs: dict) -> None:
        for a in args:
            if isinstance(a, Tensor):
                self._check(a)
            elif isinstance(a, (list, tuple)):
                for x in a:
                    if isinstance(x, Tensor):
                        self._check(x)
        for a in kwargs.values():
            if isinstance(a, Tensor):
                self._check(a)

    def _compare(self, slot: _Slot) -> None:
        view, copy = slot.view, slot.copy
        if view.device.type == "cpu":
            if _MEMCMP is not None:
                same = _MEMCMP(view.data_ptr(), copy.data_ptr(), view.numel()) == 0
            else:
                same = bool(torch.equal(view, copy))
            if not same and self.changed is None:
                self.changed = slot.what
        else:  # queued: read once in finish() (no synchronisation per operation)
            self._flags.append((torch.ne(view, copy).any(), slot.what))

    def refresh(self, keys: Iterable[int]) -> None:
        """Storages (data pointers) that an accepted operation wrote: their bytes now are the
        reference."""
        with torch._C.DisableTorchFunction(), _disable_current_modes():
            for key in keys:
                slot = self._slots.get(key)
                if slot is not None:
                    slot.copy.copy_(slot.view)

    def finish(self) -> str | None:
        """Compare every watched storage once more and read the queued checks: the first storage
        found written, or None. Drops the copies."""
        with torch._C.DisableTorchFunction(), _disable_current_modes():
            return self._finish()

    def _finish(self) -> str | None:
        for slot in self._slots.values():
            self._compare(slot)
        if self._flags and self.changed is None:
            hits = torch.stack([f for f, _ in self._flags]).cpu()
            for hit, (_, what) in zip(hits.tolist(), self._flags):
                if hit:
                    self.changed = what
                    break
        self._flags.clear()
        self._slots.clear()
        return self.changed
