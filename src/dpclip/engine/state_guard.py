"""A guard on the model state that private data could reach without noise: parameters' data,
buffers, and tensors kept in module attributes.

A forward pass can write private data into state that outlives the step: a
``nn.Parameter(requires_grad=False)`` updated in ``forward`` (it ends up in the released
``state_dict`` holding, say, the private batch mean), a buffer updated from the batch (running
statistics), a write through ``p.data``, a NumPy view or raw storage, a tensor stored in a Python
attribute (``self.prev = h``) and read by the next call (one example then moves every example of
the next batch), or a parameter, buffer, attribute or submodule added during the call. The guard
takes, before the block, the module tree's structure (every module's children, parameters,
buffers and tensor attributes, by identity) and a bitwise snapshot of every such tensor; after the
block it compares both, restores what changed (the original objects, the original bytes, the
original children; what was added is removed) and raises
:class:`~dpclip.engine.errors.PrivateBufferError` naming it.

Why values and not version counters: ``t._version`` is bumped by ATen in-place operations on ``t``
and on its ``detach()`` / view aliases, but NOT by writes through ``t.data`` (a separate counter),
``t.numpy()``, ``t.untyped_storage()``, DLPack or ``data_ptr`` aliases, and it can be reset
(``torch._C._autograd._unsafe_set_version_counter``); the tests in
``tests/core/test_state_guard.py`` write state in each of these ways. Only the bytes cannot be
fooled, so the guard compares bytes (``NaN`` equals itself, ``-0.0`` differs from ``0.0``).

Cost: one walk of the module tree before and after (no generators, no name strings unless
something changed: the walk records, per module, the keys and object ids of its tables), then the
bytes. On the CPU, when every state tensor is an exact Tensor/Parameter, contiguous, without
conjugate or negative bit (the usual model), the guard keeps per model a plan
(:class:`_Plan`: each tensor's address, shape, strides and dtype, and a copy buffer of the
state's size) and copies the bytes into that buffer with ``memmove`` before the block and
compares them with ``memcmp`` after it; the plan is reused only while a fresh probe of every
tensor, taken at entry and again at exit, equals it (anything that moved, was replaced or is
read differently makes it anew, or sends the comparison through the slow path below). Otherwise,
per (device, dtype) one concatenated byte copy of the state before; after the block, a small
state (up to :data:`_ONE_COPY_BYTES`) is concatenated again and compared in one call, a larger
one is compared tensor by tensor against the copy (no second copy). Tensors that cannot be
viewed as bytes (sparse, quantized) are cloned and compared one by one.

What it cannot see: tensors kept outside the model (a global, a closure of the loss function) or in
Python containers (a list attribute); the ghost engine's tracer refuses those when they are read in
a later call (data from an earlier call is MIXED) and refuses any write of batch data into a tensor
that existed before the forward.
"""

from __future__ import annotations

from dpclip.engine import _cm
import ctypes
import ctypes.util
import sys
import threading
import weakref
from typing import Iterator

import numpy as np
import torch
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors

from dpclip._ident import ident
from dpclip.engine.errors import PrivateBufferError
from dpclip.engine.hf_hooks import prime
from dpclip.engine.views import view_inner

__all__ = ["state_guard"]

_PARAM, _BUFFER, _ATTR, _CHILD = "parameter", "buffer", "attribute", "submodule"


def _has_tensor(d: dict) -> bool:
    """Whether any value of ``d`` may be a tensor (by the values' classes, compared by identity:
    a set of them would hash each class, running a metaclass's ``__hash__``)."""
    return any(issubclass(type(v), Tensor) for v in d.values())


def _tree(model: nn.Module, full: bool = True) -> tuple[list[tuple], list[tuple]]:
    """``(sig, recs)``, one walk of the module tree (each module once, in a fixed depth-first
    order). ``recs`` (empty unless ``full``): per module ``(name, module, params, buffers, attrs,
    children)``, each table a tuple of its ``(key, object)`` items (``attrs``: the tensor values of
    the module's ``__dict__``). ``sig``: per module its id and, per table, the keys and the
    objects' ids; two walks have equal ``sig`` exactly when the tree has the same modules holding
    the same objects under the same keys. (While ``recs`` lives it holds every object it lists, so
    no id it lists can be reused by a new object: an object replaced by a new one always changes
    ``sig``.)"""
    sig: list[tuple] = []
    recs: list[tuple] = []
    seen: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", model)]
    pop, push, add, append = stack.pop, stack.append, seen.add, sig.append
    while stack:
        name, mod = pop()
        m = ident(mod)
        if m in seen:
            continue
        add(m)
        d = mod.__dict__
        ps, bs, cs = d.get("_parameters"), d.get("_buffers"), d.get("_modules")
        a = tuple((k, v) for k, v in d.items() if issubclass(type(v), Tensor)) \
            if _has_tensor(d) else ()  # (by the type alone: no __class__ property of theirs)
        append((m, tuple(ps) if ps else (), tuple(map(ident, ps.values())) if ps else (),
                tuple(bs) if bs else (), tuple(map(ident, bs.values())) if bs else (),
                tuple((k, ident(v)) for k, v in a) if a else (),
                tuple(cs) if cs else (), tuple(map(ident, cs.values())) if cs else ()))
        if full:
            recs.append((name, mod, tuple(ps.items()) if ps else (),
                         tuple(bs.items()) if bs else (), a,
                         tuple(cs.items()) if cs else ()))
        if cs:
            for k, ch in cs.items():
                if ch is not None:
                    push((f"{name}.{k}" if name else k, ch))
        inner = view_inner(mod)
        if inner is not None:  # (a library view: the model it views, its own attributes too)
            push((name, inner))
    return sig, recs


def _entries(recs: list[tuple]) -> tuple[list[tuple], list[tuple]]:
    """``(sig, objs)`` of the walk ``recs`` (:func:`_tree`), one entry per object: ``sig`` lists
    ``(ident(module), kind, key, ident(object))`` for every parameter, buffer, tensor attribute and
    child module (``None`` parameters and buffers skipped), ``objs`` the matching ``(module name,
    module, object)``."""
    sig: list[tuple] = []
    objs: list[tuple] = []
    for name, mod, p, b, a, c in recs:
        m = ident(mod)
        for kind, items in ((_PARAM, p), (_BUFFER, b), (_ATTR, a), (_CHILD, c)):
            for k, v in items:
                if v is not None or kind == _CHILD:
                    sig.append((m, kind, k, ident(v)))
                    objs.append((name, mod, v))
    return sig, objs


def _walk(model: nn.Module) -> tuple[list[tuple], list[tuple]]:
    """:func:`_entries` of a fresh walk of ``model``."""
    return _entries(_tree(model)[1])


def _state_tensors(recs: list[tuple]) -> list[Tensor]:
    """The parameters, buffers and tensor attributes of the walk ``recs``, each object once."""
    uniq: dict[int, Tensor] = {}
    for _, _, p, b, a, _ in recs:
        for items in (p, b, a):
            for _, v in items:
                if v is not None:
                    uniq.setdefault(ident(v), v)
    return list(uniq.values())


class _Snapshot:
    """Bitwise copies of ``tensors``: per (device, dtype) one concatenation of their elements,
    compared as bytes; tensors that cannot be concatenated (sparse, quantized, ...) are cloned."""

    def __init__(self, tensors: list[Tensor]) -> None:
        self.tensors = tensors
        self.metas = [(t.shape, t.dtype, t.device) for t in tensors]
        groups: dict[tuple, list[int]] = {}
        self.clones: dict[int, Tensor] = {}
        for i, (t, (_, dtype, dev)) in enumerate(zip(tensors, self.metas)):
            if t.layout is torch.strided and not t.is_quantized:
                groups.setdefault((dev, dtype), []).append(i)
            else:
                self.clones[i] = t.detach().clone()
        self.groups: list[tuple[list[int], Tensor]] = [
            (idx, self._flat(idx).clone() if len(idx) == 1 else self._flat(idx))
            for idx in groups.values()]

    def _flat(self, idx: list[int]) -> Tensor:
        """The elements of the tensors ``idx`` (one device and dtype), flat, as integers of the same
        size (so that the comparison is bitwise: NaN equals itself)."""
        ts = self.tensors
        # (flatten_dense_tensors: the concatenation of the flattened tensors in one C++ call)
        flat = _flatten_dense_tensors([ts[i] for i in idx]) if len(idx) > 1 else \
            ts[idx[0]].detach().reshape(-1)
        return flat.view(_INT[min(flat.dtype.itemsize, 8)])

    def changed(self) -> list[int]:
        """Indices of the tensors whose shape, dtype, device or bytes differ from the snapshot."""
        bad = [i for i, (t, m) in enumerate(zip(self.tensors, self.metas))
               if (t.shape, t.dtype, t.device) != m]
        skip = set(bad)
        for i, c in self.clones.items():
            if i not in skip and not _same_values(self.tensors[i], c):
                bad.append(i)
        for idx, flat in self.groups:
            # one concatenated comparison, unless that second copy would be large (a 100M-parameter
            # model on a GPU): then tensor by tensor, each a view, no copy
            if flat.numel() * flat.itemsize <= _ONE_COPY_BYTES and \
                    not skip.intersection(idx) and _equal(self._flat(idx), flat):
                continue
            off = 0
            for i in idx:
                n = self.metas[i][0].numel() * self.metas[i][1].itemsize // flat.itemsize
                if i not in skip and not _equal(self._flat([i]), flat[off:off + n]):
                    bad.append(i)
                off += n
        return bad

    def restore(self, i: int) -> None:
        """Put tensor ``i``'s original shape, dtype and bytes back (the object stays the same)."""
        t = self.tensors[i]
        shape, dtype, dev = self.metas[i]
        if i in self.clones:
            orig = self.clones[i]
        else:
            for idx, flat in self.groups:
                if i in idx:
                    off = sum(self.metas[j][0].numel() for j in idx[:idx.index(i)])
                    per = dtype.itemsize // flat.itemsize  # words per element (complex128: 2)
                    orig = flat[off * per:(off + shape.numel()) * per].clone().view(
                        dtype).view(shape)
                    break
        with _cm.no_grad():
            if (t.shape, t.dtype, t.device) == (shape, dtype, dev):
                t.detach().copy_(orig)
            else:
                t.data = orig


#: above this many bytes per (device, dtype) group the state is compared tensor by tensor
_ONE_COPY_BYTES = 2 ** 20

#: integer dtypes by element size: the flat snapshots are compared as integers (bitwise)
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _equal(a: Tensor, b: Tensor) -> bool:
    """Bitwise equality of two flat integer tensors (NumPy on the CPU: torch.equal is an
    elementwise kernel there, about 10x slower than NumPy's comparison)."""
    if a.shape != b.shape:
        return False
    if a.device.type == "cpu":
        return bool(np.array_equal(a.numpy(), b.numpy()))
    return bool(torch.equal(a, b))


def _same_values(a: Tensor, b: Tensor) -> bool:
    try:
        return bool(torch.equal(a.detach(), b)) or bool(
            torch.equal(torch.isnan(a.detach()), torch.isnan(b)) and
            torch.equal(a.detach().nan_to_num(), b.nan_to_num()))
    except RuntimeError:
        return False


def _libc_memcmp():
    """libc's ``memcmp`` through ctypes (``None`` where it cannot be loaded: the CPU fast path
    is then off and every state is compared as :class:`_Snapshot` does)."""
    try:
        lib = ctypes.cdll.msvcrt if sys.platform == "win32" else \
            ctypes.CDLL(ctypes.util.find_library("c"))
        fn = lib.memcmp
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    fn.restype = ctypes.c_int
    return fn


_MEMCMP = _libc_memcmp()
_MEMMOVE = ctypes.memmove

#: the tensor types the CPU fast path reads by address (exact types: a subclass may override
#: ``data_ptr``, ``shape`` or ``stride`` through ``__torch_function__``)
_FAST_TYPES = (Tensor, nn.Parameter)

#: the largest state (bytes) whose copy buffer a model's plan keeps between steps; a larger state
#: gets a new buffer every step (the copy then costs far more than the allocation)
_KEEP_BUFFER_BYTES = 64 * 2 ** 20


def _probe(tensors: list[Tensor]) -> list[tuple] | None:
    """Per tensor ``(type, data_ptr, shape, stride, dtype, is_cpu, is_neg, is_conj)``: where the
    bytes of a contiguous CPU tensor lie and how they are read (``None`` when a tensor has no
    address: sparse, MKL-DNN, ...)."""
    try:
        return [(type(t), t.data_ptr(), t.shape, t.stride(), t.dtype, t.is_cpu, t.is_neg(),
                 t.is_conj()) for t in tensors]
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None


def _fast_ok(t: Tensor) -> bool:
    """Whether ``t``'s bytes are the ``numel * element_size`` bytes at ``t.data_ptr()``, read as
    plain values: an exact Tensor/Parameter, dense and contiguous on the CPU, no conjugate or
    negative bit, not quantized."""
    return (type(t) in _FAST_TYPES and t.is_cpu and t.layout is torch.strided
            and not t.is_quantized and not t.is_conj() and not t.is_neg() and t.is_contiguous())


class _Plan:
    """What the guard keeps per model between steps (:data:`_PLANS`) on the CPU fast path: the
    probe (:func:`_probe`) of the state tensors, their addresses and sizes, and a copy buffer.

    A plan is used only for tensors whose fresh probe equals ``probe``, position by position:
    the tensor now at position ``i`` is then an exact Tensor/Parameter, contiguous (the plan's
    strides are), on the CPU, without negative or conjugate bit, and its elements are exactly
    the ``sizes[i]`` bytes at ``ptrs[i]``, read as ``dtype``; those bytes are what is copied
    and compared, whatever object holds them (a tensor replaced between steps, ``p.data =
    ...``, ``set_``, a resize: another address, shape, stride, dtype or type, the probe differs
    and the plan is made anew; the same address and layout: the same bytes). The probe is taken
    fresh at the guard's entry and again at its exit. The plan holds no module, tensor or
    storage: it never keeps the model or its memory alive.
    ``lock``: one guard at a time uses the buffer (a nested or concurrent guard on the same
    model snapshots without the plan). ``ok`` is False for a state the fast path cannot read
    (the probe is kept so that the next step need not look again)."""

    __slots__ = ("probe", "ok", "ptrs", "sizes", "offs", "total", "buf", "bptrs", "lock")

    def __init__(self, tensors: list[Tensor], probe: list[tuple]) -> None:
        self.probe = probe
        self.ok = all(map(_fast_ok, tensors))
        self.lock = threading.Lock()
        self.ptrs = [p[1] for p in probe]
        self.sizes = [t.numel() * t.element_size() for t in tensors] if self.ok else []
        self.offs, off = [], 0
        for n in self.sizes:
            self.offs.append(off)
            off += n
        self.total = off
        self.buf = self._new_buffer() if self.ok and off <= _KEEP_BUFFER_BYTES else None
        self.bptrs = self._addresses(self.buf) if self.buf is not None else None

    def _new_buffer(self) -> Tensor:
        return torch.empty(max(self.total, 1), dtype=torch.uint8)

    def _addresses(self, buf: Tensor) -> list[int]:
        """Where each tensor's copy starts in ``buf``."""
        base = buf.data_ptr()
        return [base + o for o in self.offs]


#: per model (weakly: the entry goes with the model) its :class:`_Plan`
_PLANS: "weakref.WeakKeyDictionary[nn.Module, _Plan]" = weakref.WeakKeyDictionary()


def _plan_for(model: nn.Module, tensors: list[Tensor]) -> _Plan | None:
    """The model's plan, made anew unless the cached one's probe equals ``tensors``' probe, and
    locked for this guard; ``None`` (compare as :class:`_Snapshot`) without memcmp, for a state
    the fast path cannot read, an unhashable model or a plan in use."""
    if _MEMCMP is None:
        return None
    probe = _probe(tensors)
    if probe is None:
        return None
    try:
        plan = _PLANS.get(model)
    except TypeError:  # a module class that is not hashable or not weakly referenceable
        return None
    if plan is None or plan.probe != probe:
        plan = _Plan(tensors, probe)
        try:
            _PLANS[model] = plan
        except TypeError:
            pass
    if not plan.ok or not plan.lock.acquire(blocking=False):
        return None
    return plan


class _PlanSnapshot:
    """:class:`_Snapshot`'s interface on a :class:`_Plan`: the state's bytes copied with
    ``memmove`` into the plan's buffer, compared with ``memcmp`` (bitwise: NaN equals itself,
    ``-0.0`` differs from ``0.0``), after a fresh probe equal to the plan's (the tensors still at
    the same addresses, read the same way). Anything else (a probe that differs, bytes that
    differ) goes tensor by tensor through :meth:`changed`'s slow path, which compares values as
    they are now (whatever the tensor's layout) against the saved bytes."""

    def __init__(self, plan: _Plan, tensors: list[Tensor]) -> None:
        self.plan, self.tensors = plan, tensors
        if plan.buf is not None:
            self.buf, self.bptrs = plan.buf, plan.bptrs
        else:
            self.buf = plan._new_buffer()
            self.bptrs = plan._addresses(self.buf)
        for dst, src, n in zip(self.bptrs, plan.ptrs, plan.sizes):
            if n:
                _MEMMOVE(dst, src, n)

    def changed(self) -> list[int]:
        """Indices of the tensors whose type, shape, dtype, device or bytes differ from the
        snapshot."""
        plan = self.plan
        if _probe(self.tensors) == plan.probe and not any(
                n and _MEMCMP(a, b, n) for a, b, n in zip(plan.ptrs, self.bptrs, plan.sizes)):
            return []
        return [i for i, t in enumerate(self.tensors) if not self._same(i, t)]

    def _orig(self, i: int) -> Tensor:
        """Tensor ``i`` as it was (a new tensor, its original shape and dtype)."""
        o, n = self.plan.offs[i], self.plan.sizes[i]
        shape, dtype = self.plan.probe[i][2], self.plan.probe[i][4]
        return self.buf[o:o + n].clone().view(dtype).view(shape)

    def _same(self, i: int, t: Tensor) -> bool:
        shape, dtype = self.plan.probe[i][2], self.plan.probe[i][4]
        try:
            if (t.shape, t.dtype, t.device.type) != (shape, dtype, "cpu"):
                return False
            now = t.detach().resolve_neg().resolve_conj().reshape(-1).view(torch.uint8)
            o, n = self.plan.offs[i], self.plan.sizes[i]
            return bool(torch.equal(now, self.buf[o:o + n]))
        except (RuntimeError, NotImplementedError, TypeError):
            return False

    def restore(self, i: int) -> None:
        """Put tensor ``i``'s original shape, dtype and bytes back (the object stays the same)."""
        t, orig = self.tensors[i], self._orig(i)
        with _cm.no_grad():
            if (t.shape, t.dtype, t.device) == (orig.shape, orig.dtype, orig.device) and \
                    t.layout is torch.strided:
                t.detach().copy_(orig)
            else:
                t.data = orig


def _table(mod: nn.Module, kind: str) -> dict:
    if kind == _ATTR:
        return mod.__dict__
    return mod.__dict__[{_PARAM: "_parameters", _BUFFER: "_buffers", _CHILD: "_modules"}[kind]]


def _repair(before: tuple[list, list], after: tuple[list, list]) -> list[tuple[str, str]]:
    """Make the tree's structure that of ``before`` again: objects replaced or removed are put back
    in their table, entries added are removed. Returns the (kind, name) of what changed."""
    old = {s[:3]: (s, o) for s, o in zip(*before)}
    new = {s[:3]: (s, o) for s, o in zip(*after)}
    changed = []
    for k, (s, (name, mod, _)) in new.items():
        if k not in old:
            changed.append((s[1], f"{name}.{s[2]}" if name else s[2]))
            _table(mod, s[1]).pop(s[2], None)
    for k, (s, (name, mod, obj)) in old.items():
        got = new.get(k)
        if got is None or got[0][3] != s[3]:
            kind, attr = s[1], s[2]
            changed.append((kind, f"{name}.{attr}" if name else attr))
            for other in (_PARAM, _BUFFER, _ATTR, _CHILD):  # the key in another table: drop it
                if other != kind and attr in _table(mod, other) and \
                        (other != _ATTR or isinstance(_table(mod, other)[attr], Tensor)):
                    _table(mod, other).pop(attr)
            _table(mod, kind)[attr] = obj
    return changed


@_cm.contextmanager
def state_guard(model: nn.Module, where: str = "dp_step") -> Iterator[None]:
    """Refuse and undo any change of the model's state in the block: parameter data, buffers, module
    tensor attributes and the module tree itself (see the module docstring). Raises
    :class:`~dpclip.engine.errors.PrivateBufferError` (docs/errors.md, entry 79; buffers: the running
    statistics entry)."""
    prime(model)  # (transformers' output-capturing hooks: installed before the snapshot)
    with _cm.no_grad():
        sig, recs = _tree(model)
        tensors = _state_tensors(recs)
        plan = _plan_for(model, tensors)
        try:
            snap = _Snapshot(tensors) if plan is None else _PlanSnapshot(plan, tensors)
        except BaseException:
            if plan is not None:
                plan.lock.release()
            raise
    try:
        yield
    finally:
        try:
            changed = _check(model, sig, recs, tensors, snap)
        finally:
            if plan is not None:
                plan.lock.release()
    if changed:
        _refuse(changed, where)


def _check(model: nn.Module, sig: list[tuple], recs: list[tuple], tensors: list[Tensor],
           snap: "_Snapshot | _PlanSnapshot") -> list[tuple[str, str]]:
    """After the block: repair the tree's structure and restore the tensors that changed (see
    :func:`state_guard`); the (kind, name) of what changed."""
    with _cm.no_grad():
        changed: list[tuple[str, str]] = []
        before: tuple[list, list] | None = None
        if _tree(model, False)[0] != sig:
            before = _entries(recs)
            changed = _repair(before, _walk(model))
        bad = snap.changed()
        if bad:
            before = before or _entries(recs)
            names: dict[int, tuple[str, str]] = {}
            for s, (mname, _, o) in zip(*before):
                if s[1] != _CHILD:
                    names.setdefault(ident(o), (s[1], f"{mname}.{s[2]}" if mname else s[2]))
            for i in bad:
                snap.restore(i)
                changed.append(names[ident(tensors[i])])
    return changed


def _refuse(changed: list[tuple[str, str]], where: str) -> None:
    """Raise the guard's error naming what ``changed``."""
    if changed:
        seen: dict[str, str] = {}
        for kind, n in changed:
            seen.setdefault(n, kind)
        listed = ", ".join(repr(n) for n in seen)
        power = [n for n, k in seen.items() if k == _BUFFER
                 and (n.endswith(("._u", "._v", "_u", "_v")) and ("parametrizations" in n
                                                                 or n.endswith(("weight_u",
                                                                                "weight_v"))))]
        if power:
            raise PrivateBufferError(
                f"{where}: the model changed buffer(s) {listed} while computing private "
                "gradients: spectral normalisation updates its power-iteration vectors at every "
                "training-mode forward, and the engine runs the forward once per chunk, so their "
                "values would count the chunks (the private batch size) and leave the run "
                "without noise. Buffers were restored. Fix: put the spectral-normalised layers "
                "in eval mode for the private step (their vectors are then used as they are: "
                "`layer.eval()`), and refresh the vectors between steps from the weights alone "
                "(e.g. a training-mode forward of those layers on public data under "
                "torch.no_grad())")
        if any(k == _BUFFER for k in seen.values()):
            raise PrivateBufferError(
                f"{where}: the model changed buffer(s) {listed} while computing private "
                "gradients; a buffer updated from private data (running statistics of "
                "InstanceNorm/BatchNorm with track_running_stats=True, caches, counters) would "
                "leave the run without noise. Buffers were restored. Fix: build the layer with "
                "track_running_stats=False (InstanceNorm: instance statistics at evaluation "
                "too), use GroupNorm/LayerNorm, or batch clipping (--unit bc) for "
                "BatchNorm")
        raise PrivateBufferError(
            f"{where}: the model changed parameter data or tensor attribute(s) "
            f"{listed} while computing private gradients; "
            "state written from private data (a non-trainable parameter updated in forward, "
            "a write through p.data, a tensor kept in self.<attr> for the next call, a "
            "parameter or submodule added in forward) would leave "
            "the run without noise. They were restored. Fix: keep such statistics out of the "
            "forward, compute them from public data, or release them through a private "
            "mechanism")
