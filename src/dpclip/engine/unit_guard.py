"""What one clipping unit's forward may do with its examples: the guard of the unit path
(``dpclip.training.units.unit_sum``: batch clipping and general batch clipping).

A unit's examples may mix inside the unit (that is what a unit is: its gradient is clipped as
one vector), but nothing computed from them may reach another unit's computation, or a later call's:
the declared sensitivity (``2 C`` for a replaced example) and the subsampling argument (an example
affects only the steps that draw it) both rest on it. ``Isolated`` guards the model's own state; a
Python global outside the model is out of its sight (ninety-fourth hostile review: a forward
setting ``CARRY[0] = sign(float(x[:, 0].sum()))`` in a module-level list and scaling the next
unit's output by it moved a GBC release by **3.99 C** against the declared 2 C through
``make_private``, and a BC release at steps that did not draw the example by ~2 C).

:class:`UnitGuard` tags every tensor computed from a unit's examples with the unit (a
process-wide map of tensor identities, weak: it keeps nothing alive) and, while a unit runs:

* refuses every operation that reads tagged values into Python (``.item()``, ``bool(t)``,
  ``nonzero``, an operation returning a Python value), and every escape of a tagged tensor out of
  the dispatcher (``.numpy()``, ``.tolist()``, ``__array__``, raw storage, DLPack, ``.data``,
  printing), and gradient hooks registered in the forward: a Python value can be kept anywhere;
* refuses every operation reading a tensor tagged by another unit or an earlier call (a tensor
  kept in a global, a closure, an attribute outside the model, or written in place into any tensor
  by an earlier unit); a training-mode batch norm's running statistics are exempt as written-only
  arguments (their values never reach the output; they are restored after the call);
* hands the unit a copy of its slice of the batch (a view's ``_base`` is the whole batch: the
  other units' examples).

What it does not see, as everywhere in dpclip: the unit's SIZE read as a Python number
(``len(x)``, ``x.shape[0]``) and kept for a later call (for fixed-size mini-sets it is public; a
Poisson BC batch's size is private), code run on other threads, and C extensions that read
tensor memory without the dispatcher (docs/engines.md, "trust boundary").
"""

from __future__ import annotations

import weakref
from bisect import bisect_right
from itertools import count
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from dpclip._ident import ident
from dpclip.engine import _cm
from dpclip.engine.errors import UnsupportedModelError
from dpclip.engine.generators import _defaults
from dpclip.engine.op_entry import call_op
from dpclip.engine.separable import _IdMap, _K_ESCAPE, _K_HOOK, _func_kind, _meta, _name

__all__ = ["UnitGuard", "UnitDataRefused"]

_aten = torch.ops.aten

#: storage (or, for a tensor without one, tensor) identity -> the unit (a process-wide serial
#: number) whose examples it was computed from. Keyed by the STORAGE: every alias of a tagged
#: tensor (views, ``as_subclass``, ``_make_subclass``, a ``.data`` assignment) shares its storage
#: object (ninety-fifth review: aliases made outside the dispatcher came out untagged, 3.99 C)
_TAGS = _IdMap()
#: storage identity -> the unit during which the dispatcher made it from no unit's values (a
#: ``torch.zeros`` in the forward): the unit may write its values into it, and only into such
#: memory or its own (a hundred-and-first review: a tensor made outside the unit, whose memory
#: numpy, a bytearray or a raw pointer also held, carried one unit's value to the next, 4.0 C)
_BORN = _IdMap()
_SERIAL = count(1)
#: the tagged storages' address ranges, sorted by start: a tensor re-made over the same memory
#: without the dispatcher (DLPack, ``torch._C._to_dlpack`` then ``from_dlpack``) has a storage
#: object of its own but lies inside one of these (ninety-fifth review, 3.99 C)
_STARTS: list[int] = []
_RANGES: list[tuple[int, Any]] = []  # (end, weak reference to the storage), parallel to _STARTS

#: operations whose running-statistics arguments are only written in training mode (their old
#: values never reach the outputs): schema index of running_mean, running_var, training
_BN_WRITE_ONLY = {
    _aten.native_batch_norm: (3, 4, 5),
    _aten._native_batch_norm_legit: (3, 4, 5),
    _aten._batch_norm_with_update: (3, 4, None),
    _aten.cudnn_batch_norm: (3, 4, 5),
    _aten.miopen_batch_norm: (3, 4, 5),
}

#: size / stride queries (metadata, not values)
_METADATA = {"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size", "stride",
             "numel", "dim", "is_contiguous", "storage_offset"}

_PLAIN = (Tensor, torch.nn.Parameter)


def _plain_tensor(t: type) -> bool:
    """``t in _PLAIN`` by identity (a tuple's ``in`` calls ``==``, a metaclass's own)."""
    return t is Tensor or t is torch.nn.Parameter

#: operations that re-point a tensor at other memory or may grow it (uninitialised bytes)
_RESHAPED = {_aten.set_, _aten.resize_, _aten.resize_as_, _aten.resize_as_sparse_,
             _aten.sparse_resize_, _aten.sparse_resize_and_clear_, _aten._resize_output_,
             _aten.from_file}


class UnitDataRefused(UnsupportedModelError):
    """A unit's forward did something with its examples that could carry them to another unit or
    a later call (the error names it; per-example clipping, ``unit='ic'``, does not need
    this guard's assumptions)."""


def _storage(t: Tensor) -> Any:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # (sparse, nested: no one storage)
        return None


def tag_of(t: Tensor) -> int | None:
    """The unit whose examples ``t`` (or memory it lies in) was computed from, or None."""
    st = _storage(t)
    if st is None:
        return _TAGS.get(t)
    got = _TAGS.get(st)
    if got is not None or not _STARTS:
        return got
    ptr = st.data_ptr()
    i = bisect_right(_STARTS, ptr) - 1
    while i >= 0:
        end, ref = _RANGES[i]
        owner = ref()
        if owner is None:  # (a dead storage: its range is free memory now)
            del _STARTS[i], _RANGES[i]
            i -= 1
            continue
        return _TAGS.get(owner) if ptr < end else None
    return None


def born_in(t: Tensor) -> int | None:
    """The unit during which ``t``'s memory was made by the dispatcher, or None."""
    st = _storage(t)
    return _BORN.get(st if st is not None else t)


def _set_tag(t: Tensor, unit: int) -> None:
    st = _storage(t)
    if st is None:
        _TAGS[t] = unit
        return
    _TAGS[st] = unit
    ptr, n = st.data_ptr(), st.nbytes()
    if ptr and n:
        i = bisect_right(_STARTS, ptr)
        if i and _STARTS[i - 1] == ptr:
            _RANGES[i - 1] = (ptr + n, weakref.ref(st))
        else:
            _STARTS.insert(i, ptr)
            _RANGES.insert(i, (ptr + n, weakref.ref(st)))


def _bn_exempt(func: Any, args: tuple, kwargs: dict, own: frozenset) -> tuple[int, ...]:
    """The argument positions of a training-mode batch norm's running statistics (written, never
    read), when neither shares its memory with another argument (ninety-fifth review: the
    previous unit's carry given as running_mean AND as bias, read into the output, 3.99 C)."""
    got = _BN_WRITE_ONLY.get(func.overloadpacket)
    if got is None:
        return ()
    rm, rv, tr = got
    training = True if tr is None else (args[tr] if len(args) > tr else kwargs.get("training"))
    if training is not True or len(args) <= rv:
        return ()
    stats = [args[i] for i in (rm, rv)]
    if not all(isinstance(t, Tensor) for t in stats):
        return ()
    ptrs = {_storage(t).data_ptr() for t in stats if _storage(t) is not None}
    if not ptrs <= own:  # (only the model's own buffers, which the unit loop puts back; a
        # global given as running_mean kept the unit's batch mean: 4.0 C, hundred-and-third
        # review)
        return ()
    others = [t for j, t in enumerate(tree_leaves((args[:rm], args[rv + 1:], kwargs)))
              if isinstance(t, Tensor)]
    if len(ptrs) < 2 or any(_storage(t) is None or _storage(t).data_ptr() in ptrs
                            for t in others):
        return ()
    return (rm, rv)


#: (operator identity, argument shapes and values) -> the output shapes a meta run gives, or
#: None where the meta run fails (the shapes depend on the values)
_SHAPES: dict[Any, Any] = {}


def _key(a: Any) -> Any:
    if isinstance(a, Tensor):
        return ("T", tuple(a.shape), a.dtype, a.layout, a.device.type)
    try:
        hash(a)
    except TypeError:
        return ("?", type(a).__name__)
    return a


def _expected_shapes(func: Any, args: tuple, kwargs: dict) -> Any:
    """The output shapes the meta kernel of ``func`` gives from the arguments' shapes (taken
    before the operation runs: an in-place one changes them), or None where the meta run fails
    (the shapes depend on the values, or torch has no meta kernel for it); cached by operator
    and argument shapes and values."""
    flat, spec = tree_flatten((args, kwargs))
    key = (ident(func), spec, tuple(_key(a) for a in flat))
    want = _SHAPES.get(key, _MISSING)
    if want is _MISSING:
        try:
            margs, mkw = tree_unflatten(
                [a.to("meta") if isinstance(a, Tensor) else a for a in flat], spec)
            with _cm.no_grad():
                got = _meta(func).op(*margs, **mkw)
            want = tuple(tuple(o.shape) if isinstance(o, Tensor) else None
                         for o in tree_leaves(got))
        except Exception:  # noqa: BLE001 - no meta kernel, or a data-dependent one
            want = None
        if len(_SHAPES) > 100_000:
            _SHAPES.clear()
        _SHAPES[key] = want
    return want


def _check_shapes(g: "UnitGuard", func: Any, want: Any, out: Any) -> None:
    """Refuse an operation on the unit's values whose output shapes are not those its meta
    kernel gives from the inputs' shapes alone (:func:`_expected_shapes`): a shape that depends on
    the values can be read into Python without any dispatched operation (``.shape``;
    ``to_sparse()._values().shape[0]``, ``bincount(out=)``, ``pack_padded_sequence(...).data.
    shape[0]``: 4.0 C, hundred-and-third review); torch's own tags mark only some of these."""
    have = tuple(tuple(o.shape) if isinstance(o, Tensor) else None for o in tree_leaves(out))
    if func.overloadpacket in _STATIC_SHAPES:
        want = have  # (its output shapes follow from the input shapes; its meta kernel, where
        # there is one, sizes oneDNN's workspace otherwise than the CPU kernel)
    if want is None or want != have or any(
            o.layout != torch.strided for o in tree_leaves(out) if isinstance(o, Tensor)):
        g.refuse(f"the operation {_name(func)} on the unit's values gives outputs whose shape "
                 "or layout depends on the values (or that torch cannot size from the shapes "
                 "alone): the shape can be read into Python without any operation")


_MISSING = object()
_SEEDED = torch.Tag.nondeterministic_seeded
#: operators whose outputs' shapes follow from the inputs' shapes alone but not as their meta
#: kernels say (oneDNN's recurrent layer and its backward: an LSTM's time steps, its workspace)
_STATIC_SHAPES = {p for p in (getattr(_aten, n, None) for n in (
    "mkldnn_rnn_layer", "mkldnn_rnn_layer_backward")) if p is not None}


def _bn_copies(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, list[Tensor]]:
    """``args`` with a training-mode batch norm's running statistics replaced by copies, and the
    copies (empty for any other operation)."""
    got = _BN_WRITE_ONLY.get(func.overloadpacket)
    if got is None:
        return args, []
    rm, rv, tr = got
    training = True if tr is None else (args[tr] if len(args) > tr else kwargs.get("training"))
    if training is False:
        return args, []
    if any(k in kwargs for k in ("running_mean", "running_var")):
        raise UnitDataRefused(_message("a batch norm's running statistics given by keyword"))
    out = list(args)
    copies = []
    with _cm.no_grad():
        for i in (rm, rv):
            if i < len(out) and isinstance(out[i], Tensor):
                out[i] = out[i].clone()
                copies.append(out[i])
    return tuple(out), copies


_MIXED_IN = ("the operation {} reads a tensor computed from the examples of another clipping "
             "unit or an earlier call (kept in a global, a closure, an attribute outside the "
             "model, or written into a tensor in place): it would carry those examples into this "
             "unit's gradient")


class _TagDispatch(TorchDispatchMode):
    def __init__(self, guard: "UnitGuard") -> None:
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        g = self.guard
        unit = g.unit
        exempt = _bn_exempt(func, args, kwargs, g.buffers) if unit else ()
        mine = False
        packet = func.overloadpacket
        if unit and packet in _RESHAPED:
            g.refuse(f"the operation {_name(func)} re-points, grows or maps a tensor's memory "
                     "in a unit: the new bytes may hold what the previous unit freed, or be "
                     "shared with a file")
        leaves = [(i, t) for i, t in enumerate(args)] + [(-1, t) for t in kwargs.values()]
        for i, a in leaves:
            for t in (a,) if isinstance(a, Tensor) else tree_leaves(a):
                if not isinstance(t, Tensor):
                    if unit and isinstance(t, torch.Generator) and \
                            not any(t is d for d in _defaults()):
                        g.refuse(f"the operation {_name(func)} draws from a torch.Generator of "
                                 "the forward's own: its state can carry a unit's values (set "
                                 "through get_state / set_state, or a draw count that depends on "
                                 "them) to the next unit; draw from the default generator (each "
                                 "unit runs under its own seed)")
                    continue
                if not _plain_tensor(type(t)):
                    g.refuse(f"the operation {_name(func)} takes a tensor of the subclass "
                             f"{type(t).__name__}, whose own code runs outside this guard")
                tag = tag_of(t)
                if tag is None:
                    continue
                if tag == unit:
                    mine = True
                elif i not in exempt or i < 0:
                    g.refuse(_MIXED_IN.format(_name(func)))
        meta = _meta(func)
        stats: list[Tensor] = []
        if unit and mine:
            # a training-mode batch norm's running statistics (written, never read into the
            # outputs) are given as fresh copies: no unit writes into memory that existed before
            # it (the model's own buffer, shared with a NumPy view taken in __init__, was read in
            # Python within the unit: 4.0 C, hundred-and-seventh review; a global as
            # running_mean, 4.0 C, hundred-and-third). The unit loop puts the buffers back anyway.
            args, stats = _bn_copies(func, args, kwargs)
            for c in stats:  # (the unit's own memory: it may write there)
                _BORN[_storage(c)] = unit
        if unit and mine and meta.mutable:
            # (the unit's values written only into the unit's own memory: a tensor made before
            # the unit may be shared outside torch, with a NumPy array, a bytearray or a raw
            # pointer taken earlier, which no tag follows; a hundred-and-first review: 4.0 C)
            for i, name in meta.writes:
                if i in exempt:
                    continue
                w = args[i] if i < len(args) else kwargs.get(name)
                for t in tree_leaves(w):
                    if isinstance(t, Tensor) and tag_of(t) != unit and born_in(t) != unit:
                        g.refuse(f"the operation {_name(func)} writes values computed from the "
                                 "unit's examples into a tensor made outside the unit (a "
                                 "global, an attribute, a tensor over NumPy's or a buffer's "
                                 "memory): whatever else holds that memory would carry them to "
                                 "another unit or a later step; write into a tensor the forward "
                                 "makes (e.g. torch.zeros inside it)")
        want = _expected_shapes(func, args, kwargs) if unit and mine else None
        try:
            out = call_op(func, args, kwargs)
            if unit and meta.uninit and isinstance(out, Tensor):
                # (ninety-sixth review: torch.empty handed a unit the bytes the previous unit
                # freed, 3.99 C: a unit gets zeros instead)
                with _cm.no_grad():
                    out.zero_()
        except Exception:
            if mine:  # (whether an operation fails is a bit of the unit's data: 28th review's
                # rule of the tracer; ninety-fifth review: an index error caught, 3.99 C)
                g.note(f"the operation {_name(func)} failed on values computed from the unit's "
                       "examples: whether it fails is information the forward can keep")
            raise
        if not mine:
            if unit and meta.fresh:  # (memory the dispatcher made in this unit: no output of
                # the schema aliases an argument, and none lies in an input's storage)
                ins = {st.data_ptr() for a in leaves for t in
                       ((a[1],) if isinstance(a[1], Tensor) else tree_leaves(a[1]))
                       if isinstance(t, Tensor) and (st := _storage(t)) is not None}
                for o in tree_leaves(out):
                    if isinstance(o, Tensor):
                        st = _storage(o)
                        if st is None:
                            _BORN[o] = unit
                        elif st.data_ptr() not in ins or not st.data_ptr():
                            _BORN[st] = unit
            return out
        if _SEEDED in vars(func).get("_tags", ()):
            # (how far a random operation on the unit's values moves the generator can depend
            # on them: poisson(rate 0) draws nothing; the state, or a later draw read into
            # Python, then carried a bit to the next unit, 4.0 C, hundred-and-ninth review): the
            # unit's generators start again from a fresh derived seed
            if g.gens is None:
                g.refuse(f"the random operation {_name(func)} on the unit's values runs where "
                         "the unit's generators cannot be reseeded")
            g.gens.reseed()
        if not meta.fresh:  # (a view made from the unit's values over memory that is not the
            # unit's would make that memory look like the unit's own: slice_inverse(G, t),
            # hundred-and-third review)
            outs = {st.data_ptr() for o in tree_leaves(out) if isinstance(o, Tensor)
                    and (st := _storage(o)) is not None}
            for a in leaves:
                for t in (a[1],) if isinstance(a[1], Tensor) else tree_leaves(a[1]):
                    if isinstance(t, Tensor) and (st := _storage(t)) is not None and \
                            st.data_ptr() in outs and tag_of(t) != unit and born_in(t) != unit:
                        g.refuse(f"the operation {_name(func)} makes a view of a tensor made "
                                 "outside the unit from the unit's values")
        if meta.data_dep:
            g.refuse(f"the operation {_name(func)} reads values computed from the unit's "
                     "examples into Python (e.g. .item(), float(t), bool(t), nonzero): a Python "
                     "value can carry them into another unit's or a later step's computation")
        _check_shapes(g, func, want, out)
        for o in tree_leaves(out):
            if isinstance(o, Tensor):
                _set_tag(o, unit)
            elif o is not None and _name(func).split(".")[0] not in _METADATA:
                g.refuse(f"the operation {_name(func)} returns a Python value computed from the "
                         "unit's examples")
        for t in stats:  # (written by native_batch_norm with no schema annotation: the
            # unit's, so that a later unit's read of them is refused; hundred-and-fifth review:
            # the next unit read the model's own running_mean, 4.0 C)
            _set_tag(t, unit)
        if meta.mutable:  # (batch norm's statistics too: restored after the call, tagged)
            for i, name in meta.writes:
                w = args[i] if i < len(args) else kwargs.get(name)
                for t in tree_leaves(w):
                    if isinstance(t, Tensor):
                        _set_tag(t, unit)
        return out


class _TagFunction(TorchFunctionMode):
    def __init__(self, guard: "UnitGuard") -> None:
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        g = self.guard
        if g.unit:
            for t in tree_leaves((args, kwargs or {})):
                if issubclass(type(t), Tensor) and not _plain_tensor(type(t)):
                    g.refuse(f"{getattr(func, '__name__', func)} takes a tensor of the subclass "
                             f"{type(t).__name__}, whose own code runs outside this guard")
            kind = _func_kind(func)
            if kind == _K_HOOK:
                g.refuse(f"a gradient hook ({getattr(func, '__name__', func)}) is registered in "
                         "a unit's forward: its code runs in the backward pass, unguarded")
            elif kind == _K_ESCAPE and any(isinstance(t, Tensor) and (
                    tag_of(t) is not None or born_in(t) == g.unit)
                    for t in tree_leaves((args, kwargs or {}))):
                g.refuse(f"Tensor.{getattr(func, '__name__', func)} takes values computed from "
                         "the unit's examples out of the dispatcher (to NumPy, Python, raw memory "
                         "or the tensor's .data): they could reach another unit's computation")
        return func(*args, **(kwargs or {}))


def _clear(unit: int) -> None:
    """Zero the memory of every live tensor computed from ``unit``'s examples (the unit's result
    is a copy): code that runs after the unit, outside the guard's modes (a finalizer of the
    unit's copy of its examples, which dies when the unit ends), finds zeros where the unit's
    values were (hundred-and-third review: a ``weakref.finalize`` read a kept tensor's value with
    ``.numpy()`` between two units, 4.0 C)."""
    with _cm.no_grad(), torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
        for ref, tag in list(_TAGS.d.values()):
            if tag != unit:
                continue
            obj = ref()
            if isinstance(obj, torch.UntypedStorage):
                if obj.nbytes():
                    obj.fill_(0)
            elif isinstance(obj, Tensor):
                obj.zero_()


def _message(why: str) -> str:
    return (f"unit clipping: {why}. A unit's examples may mix inside the unit but must not reach "
            "another unit or step; remove it from the forward and loss, or clip per example "
            "(unit='ic')")


class UnitGuard:
    """``with UnitGuard() as guard:`` around the unit loop; ``guard.run(x, y, fn)`` runs one unit
    (``fn(x, y)``, its forward, loss and gradients) on copies of its examples, tagged; raises
    :class:`UnitDataRefused` naming the first refused operation. The model's buffers and
    parameters are untagged at the end (the caller restores what the units wrote)."""

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        self.model = model
        self.unit = 0
        self.violation: str | None = None
        #: the unit's own generators (dpclip.engine.generators.OwnGenerators), reseeded after a
        #: random operation on the unit's values
        self.gens: Any = None
        #: the memory of the model's buffers (batch norm's running statistics: written-only
        #: arguments a unit may write, put back by the unit loop)
        self.buffers = frozenset(st.data_ptr() for b in (model.buffers() if model is not None
                                                         else ()) if (st := _storage(b)) is not None)

    def note(self, why: str) -> None:
        if self.violation is None:
            self.violation = why

    def refuse(self, why: str) -> None:
        self.note(why)
        raise UnitDataRefused(_message(self.violation))

    def run(self, x: Tensor, y: Tensor, fn: Any) -> Any:
        self.unit = next(_SERIAL)
        x, y = x.clone(), y.clone()  # (a view's _base would be the whole batch)
        _set_tag(x, self.unit)
        _set_tag(y, self.unit)
        got: Any = None
        try:
            with _TagFunction(self), _TagDispatch(self):
                got = fn(x, y)
        except Exception as exc:
            if self.violation is not None and not isinstance(exc, UnitDataRefused):
                raise UnitDataRefused(_message(self.violation)) from exc
            raise
        finally:
            unit, self.unit = self.unit, 0
            # the result copied, then every tensor of the unit's zeroed (the result's originals
            # too: a loss vector the forward kept a reference to), before anything of the unit's
            # can die and run a finalizer outside the modes
            with _cm.no_grad(), torch._C._DisableTorchDispatch(), \
                    torch._C.DisableTorchFunction():
                got = tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, got)
            _clear(unit)
            del x, y
            self._untag_model()
        if self.violation is not None:  # (a refusal the user code caught)
            raise UnitDataRefused(_message(self.violation))
        return got

    def _untag_model(self) -> None:
        """The model's parameters and buffers untagged (the unit loop puts back what a unit
        wrote in them, after each unit)."""
        if self.model is None:
            return
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            st = _storage(t)
            _TAGS.pop(t)
            if st is not None:
                _TAGS.pop(st)

    def __enter__(self) -> "UnitGuard":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.model is not None:  # (restored by the caller: what the units wrote is gone)
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                st = _storage(t)
                _TAGS.pop(t)
                if st is not None:
                    _TAGS.pop(st)
        for table in (_TAGS, _BORN):  # (the maps are process-wide: the call's dead tensors
            # leave them)
            for k in [k for k, (ref, _) in table.d.items() if ref() is None]:
                del table.d[k]
        live = [(a, r) for a, r in zip(_STARTS, _RANGES) if r[1]() is not None]
        _STARTS[:] = [a for a, _ in live]
        _RANGES[:] = [r for _, r in live]
