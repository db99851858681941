"""torch's names that dpclip's own arithmetic looks up, unchanged through a private step
(eighty-sixth hostile review).

The engines' reductions, the clipping strategies' weights and the release call torch by name when
they run (``torch.mm(bw.t(), a)``, ``w @ b``, ``norms.clamp_(max=1.0)``, ``torch.cat``). A forward
that rebound one of those names for one call (a wrapper that multiplies the result by 50 and puts
the original back on its first call, so that nothing is changed when the step ends) ran its code
inside the engine: ``torch.mm`` LOO 3161 C under ghost (30 C on later steps), 3198 C under
compiled; ``torch.Tensor.__matmul__`` 1205 C, 30 C under vmap; ``torch.Tensor.clamp_``, which
``FixedClip.weights`` calls, 50 C under ghost and vmap.

:func:`watching` (entered by :func:`dpclip.engine.isolation.engine_only`, the outermost call of a
step) takes, once per step, the objects under every ``torch...`` attribute that the code of
dpclip's loaded modules looks up (``torch.mm``, ``torch.linalg.vecdot``, ``F.pad``: found in their
bytecode, module globals that are torch modules followed by attribute loads, through torch's
modules and classes), then, two calls deep, the global names holding callables that torch's own
Python functions so reached look up (eighty-seventh hostile review: ``torch.autograd.grad`` looks
up ``_engine_run_backward``, rebound from the forward: 8.89 C), and the whole class dictionaries
of ``torch.Tensor`` (where ``x @ y``, ``x.clamp_`` and operators are found before torch's C base
class, which cannot be changed), ``nn.Module`` and ``autograd.Function``. Not watched: what torch
looks up deeper, in C++, or in other classes. :func:`check` compares them by identity where
user code has just run and engine code follows: after each chunk's forward and loss, at the
entry of every reduction (``exact_float32``) and of the release, and when the step ends. A
change is put back and the step refused. Names bound at import (``_vecdot =
torch.linalg.vecdot``) need no watch. Replacing torch's names before the step (a library patching
torch at import) is allowed: only changes made inside the step are refused."""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import dis
import gc
import inspect
import itertools
import operator
import sys
import threading
import types
from typing import Any, Iterator

import torch

from dpclip.engine.errors import UnsupportedModelError

__all__ = ["check", "watching"]


def _codes(obj: Any, seen: set[int]) -> Iterator[types.CodeType]:
    """The code objects of a module's functions, classes' methods and properties, nested ones
    included."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        for f in (obj.fget, obj.fset, obj.fdel):
            if f is not None:
                yield from _codes(f, seen)
        return
    inner = getattr(obj, "__wrapped__", None)
    if isinstance(inner, types.FunctionType):
        # (a decorated function, a context manager's generator: its own code, which the
        # wrapper's does not show; ninety-first review)
        yield from _codes(inner, seen)
    code = getattr(obj, "__code__", None)
    if isinstance(code, types.CodeType):
        stack = [code]
        while stack:
            co = stack.pop()
            if id(co) in seen:
                continue
            seen.add(id(co))
            yield co
            stack.extend(c for c in co.co_consts if isinstance(c, types.CodeType))
    elif isinstance(obj, type) and id(obj) not in seen:
        seen.add(id(obj))
        for v in list(vars(obj).values()):
            yield from _codes(v, seen)


def _is_torch(obj: Any) -> bool:
    return isinstance(obj, types.ModuleType) and (obj.__name__ == "torch"
                                                   or obj.__name__.startswith("torch."))


def _torch_owner(obj: Any) -> bool:
    """A torch module, or a class defined in torch's Python code (whose attributes a chain may
    look up: ``Variable._execution_engine``)."""
    if isinstance(obj, types.ModuleType):
        return obj.__name__ == "torch" or obj.__name__.startswith("torch.")
    return isinstance(obj, type) and isinstance(getattr(obj, "__dict__", None),
                                                types.MappingProxyType) \
        and str(getattr(obj, "__module__", "")).startswith("torch")


def _foreign_module(obj: Any) -> bool:
    """A module that is not dpclip's (the standard library's ``math``, ``itertools``,
    ``operator``, ``sys``, ``gc``; numpy; torch): its attributes that dpclip's code looks up at
    run time are watched (eighty-ninth hostile review). dpclip's own modules are not: patching
    dpclip stays outside the trust boundary."""
    return isinstance(obj, types.ModuleType) and obj.__name__ != "dpclip" \
        and not obj.__name__.startswith("dpclip.")


def _mutable_foreign_class(cls: type) -> bool:
    """A class of another library's (torch's, numpy's, the standard library's) whose dictionary
    code can change: its methods (``torch.no_grad.__enter__``, ``torch.autocast.__exit__``) run
    when dpclip's code uses the class, so a replacement would run inside the engine (ninety-first
    hostile review: ``contextlib.ExitStack.__enter__`` set from the forward, 50 C)."""
    return cls is not object and not (cls.__flags__ & _IMMUTABLE) and \
        not str(getattr(cls, "__module__", "")).startswith("dpclip")


#: Py_TPFLAGS_IMMUTABLETYPE: a type whose attributes cannot be set (builtins, static C types)
_IMMUTABLE = 1 << 8


def _torch_function(obj: Any) -> types.FunctionType | None:
    """The Python function of torch's behind ``obj`` (a function, a method), or None."""
    fn = getattr(obj, "__func__", obj)
    if isinstance(fn, types.FunctionType) and str(fn.__module__ or "").startswith("torch"):
        return fn
    return None


def _scan_code(codes: Iterator[types.CodeType], glb: dict, owner: Any,
               out: set[tuple[int, str]], follow: list[types.FunctionType]) -> None:
    """Record the lookups of ``codes`` (globals ``glb`` of module ``owner``): each chain ``G.a.b``
    through torch modules and classes, and, when ``owner`` is torch's, every global name that
    holds a callable (a function it calls by name: ``_engine_run_backward`` in
    ``torch.autograd.grad``). torch's Python functions met go to ``follow``."""
    own = owner is not None and _torch_owner(owner)

    def link(o: Any) -> bool:  # (a chain goes on through torch's modules and classes, and
        # through other libraries' modules in dpclip's own code)
        if _WINDOW[0] and isinstance(o, type) and _mutable_foreign_class(o):
            _FOUND_CLASSES.add(o)  # (its whole dictionary and its bases' are watched)
        return _torch_owner(o) or (owner is None and _foreign_module(o))

    for co in codes:
        cur: Any = None
        for ins in dis.get_instructions(co):
            if ins.opname == "LOAD_GLOBAL":
                got = glb.get(ins.argval, _MISSING)
                if own and got is not _MISSING and callable(got):
                    _MODULES[id(owner)] = owner
                    out.add((id(owner), ins.argval))
                    fn = _torch_function(got)
                    if fn is not None:
                        follow.append(fn)
                cur = got if link(got) else None
            elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and cur is not None:
                _MODULES[id(cur)] = cur
                out.add((id(cur), ins.argval))
                try:
                    nxt = inspect.getattr_static(cur, ins.argval)
                except AttributeError:
                    nxt = None
                fn = _torch_function(nxt)
                if fn is not None:
                    follow.append(fn)
                cur = nxt if link(nxt) else None
            else:
                cur = None


def _lookups(module: types.ModuleType) -> set[tuple[int, str]]:
    """``(id(owner), attribute)`` for every lookup dpclip's module makes in torch (module
    docstring): chains ``G.a.b`` whose global ``G`` is a torch module (each link that is a torch
    module or class, followed), then, :data:`_DEPTH` calls deep, the global names and chains
    torch's own Python functions reached so look up."""
    glb = vars(module)
    out: set[tuple[int, str]] = set()
    seen: set[int] = set()
    follow: list[types.FunctionType] = []
    _WINDOW[0] = module.__name__.startswith(_WINDOW_MODULES)
    for v in list(glb.values()):
        if isinstance(v, (types.FunctionType, type)) and getattr(v, "__module__", None) \
                == module.__name__:
            _scan_code(_codes(v, seen), glb, None, out, follow)
    for _ in range(_DEPTH):
        todo, follow = follow, []
        for fn in todo:
            key = (id(fn.__code__), _WINDOW[0])
            if key in _FOLLOWED:
                continue
            _FOLLOWED.add(key)
            owner = sys.modules.get(fn.__module__)
            if owner is None:
                continue
            _scan_code(_codes(fn, set()), fn.__globals__, owner, out, follow)
    return out


#: how many calls deep into torch's Python functions the scan follows
_DEPTH = 2
#: torch's functions already followed (by code object, and whether from a window module)
_FOLLOWED: set[tuple[int, bool]] = set()
#: dpclip's modules whose code runs inside a step's windows (the reductions, the release): the
#: classes of other libraries they use are watched whole (:data:`_FOUND_CLASSES`); whether the
#: module being scanned is one
_WINDOW_MODULES = ("dpclip.engine", "dpclip.clipping", "dpclip.lipschitz", "dpclip.noise",
                   "dpclip.training.step", "dpclip.training.release", "dpclip.training.units",
                   "dpclip.training.noise_shard", "dpclip.blas_mode", "dpclip._ident")
_WINDOW = [False]
#: torch's Python classes whose whole dictionaries are watched (where a method the engine calls
#: on a model, a tensor or an autograd node is found before torch's C code)
_CLASSES = (torch.Tensor, torch.nn.Module, torch.autograd.Function, torch._ops.OpOverload,
            torch._ops.OpOverloadPacket, torch._ops.OperatorBase)
#: the dictionaries watched whole: those classes', torch._tensor's (the globals its Python
#: methods look up: ``Tensor.__rdiv__``'s wrapper calls ``has_torch_function`` and
#: ``handle_torch_function`` from there, 50 C under vmap for a strategy's ``C / n``,
#: ninety-second hostile review), contextlib's, and the builtins module's (``min``, ``len``,
#: ``range``, ``sum``: every bare name dpclip's or torch's Python code calls that its module does
#: not define; a forward that rebound ``builtins.min`` made the book-keeping blocks overlap, each
#: example from row 64 on summed up to four times with its weight computed once: 3.72 C under
#: ghost, auto and compiled, eighty-ninth hostile review)
_WHOLE = (*_CLASSES, builtins, contextlib, torch._tensor)
#: other libraries' classes met in the lookups (:func:`_mutable_foreign_class`); watched whole,
#: with their bases
_FOUND_CLASSES: set[type] = set()
#: id -> torch module met in a lookup chain
_MODULES: dict[int, types.ModuleType] = {}
#: dpclip modules scanned, and what their code looks up
_SCANNED: set[str] = set()
_NAMES: set[tuple[int, str]] = set()
_LOCK = threading.Lock()
_MISSING = object()


_REPEAT = itertools.repeat(_MISSING)


def _values(dicts: list[dict], keys: list[str]) -> list[Any]:
    """``[d.get(k, _MISSING)]`` in one pass of C code (no Python call per name)."""
    return list(map(dict.get, dicts, keys, itertools.repeat(_MISSING)))


def _names() -> tuple[list[tuple[Any, str]], list[dict], list[str], list[tuple[Any, str]],
                      tuple[list[Any], tuple], list[types.CellType]]:
    """Every watched ``(torch module, attribute)``, with the modules' dictionaries and the
    attributes as two lists (for one pass of ``map``), and the watched ``(torch class,
    attribute)``: dpclip's modules loaded so far, each scanned once (a strategy's module imported
    later is scanned at the next step; the scan runs when the number of loaded modules
    changed)."""
    if len(sys.modules) != _SEEN[0] or not _WATCHED:
        new = [m for n, m in list(sys.modules.items())
               if (n == "dpclip" or n.startswith("dpclip.")) and n not in _SCANNED
               and isinstance(m, types.ModuleType)]
        with _LOCK:
            for m in new:
                if m.__name__ not in _SCANNED:
                    _NAMES.update(_lookups(m))
                    _SCANNED.add(m.__name__)
            pairs = [(_MODULES[i], a) for i, a in sorted(_NAMES)]
            mods = [(o, a) for o, a in pairs if isinstance(o, types.ModuleType)]
            whole: list[Any] = list(_WHOLE)
            # (the context managers among them: their __enter__ / __exit__ run, unnamed by any
            # lookup, where dpclip's code enters them; other classes' attributes are watched by
            # name as they are looked up)
            for c in sorted((c for c in _FOUND_CLASSES
                             if hasattr(c, "__enter__") or hasattr(c, "__exit__")), key=_label):
                for b in c.__mro__:
                    if isinstance(b, type) and _mutable_foreign_class(b) and b not in whole:
                        whole.append(b)
            # (a module of a class of its own, torch._VF's VFModule: its class's __getattr__
            # or properties answer names its dictionary lacks; watched whole, ninety-ninth
            # hostile review)
            for m in dict.fromkeys(o for o, _ in mods):
                for b in type(m).__mro__:
                    if isinstance(b, type) and _mutable_foreign_class(b) and b not in whole:
                        whole.append(b)
            # (a class's own attributes are looked up through its metaclass: FunctionMeta,
            # ABCMeta; watched whole where code can change them)
            for c in [o for o, _ in pairs if isinstance(o, type)] + \
                    [o for o in whole if isinstance(o, type)]:
                for b in type(c).__mro__:
                    if isinstance(b, type) and _mutable_foreign_class(b) and b not in whole:
                        whole.append(b)
            # (a module's __getattr__ answers every name its dictionary lacks, PEP 562: watched
            # as a name of each watched module, present or not, ninety-ninth review)
            mods += [(m, "__getattr__") for m in dict.fromkeys(o for o, _ in mods)
                     if (m, "__getattr__") not in mods]
            classes = [(o, a) for o, a in pairs if not isinstance(o, types.ModuleType)
                       and o not in whole]
            # (a warning whose frame is a watched module's code adds "__warningregistry__" to its
            # globals: made beforehand, so that the registry fills in place; an LSTM's step was
            # refused for it, ninety-third review)
            for o in whole:
                if isinstance(o, types.ModuleType) and o is not builtins:
                    vars(o).setdefault("__warningregistry__", {})
            # (live views of the whole dictionaries: one pass of C code over all their entries)
            views = ([vars(o).keys() for o in whole], [vars(o).values() for o in whole])
            values = [vars(o).get(a) for o, a in mods + classes] + \
                [v for o in whole for v in list(vars(o).values())]
            # (what looks a name up besides the dictionaries: each watched module's class and
            # each watched class's bases and metaclass, ninety-ninth hostile review)
            modules = list(dict.fromkeys([m for m, _ in mods] +
                                         [o for o in whole if isinstance(o, types.ModuleType)]))
            kinds = list(dict.fromkeys([c for c, _ in classes] +
                                       [o for o in whole if isinstance(o, type)]))
            cells = _closure_cells(values)
            # (every entry of the watched modules' dictionaries, and of the modules whose
            # globals the watched functions and the functions their closures hold read: an
            # operator of torch.Tensor's looks torch.floor_divide up, a closure of torch.unique's
            # torch.functional._unique_impl, names no scan of dpclip's code lists: 648 C under
            # ghost, hundredth hostile review)
            mwhole = [m for m in modules if m is not builtins and m not in whole]
            for v in values + [c.cell_contents for c in cells if _filled(c)]:
                fn = getattr(v, "__func__", v)
                if isinstance(v, property):
                    fn = v.fget
                if not isinstance(fn, types.FunctionType):
                    continue
                owner = sys.modules.get(str(getattr(fn, "__module__", "") or ""))
                if owner is not None and _foreign_module(owner) and owner is not builtins and \
                        vars(owner) is fn.__globals__ and owner not in whole and \
                        owner not in mwhole:
                    mwhole.append(owner)
            for o in mwhole:
                vars(o).setdefault("__warningregistry__", {})
            _WATCHED[:] = [(mods, [vars(m) for m, _ in mods], [a for _, a in mods], classes,
                            (whole, views), cells, (modules + kinds, kinds), mwhole)]
            _SEEN[0] = len(sys.modules)
    return _WATCHED[0]


#: the number of modules loaded at the last scan; the watched names, their dicts and keys
_SEEN = [-1]
_WATCHED: list[Any] = []


_MRO = type.__dict__["__mro__"].__get__
_BASES = type.__dict__["__bases__"].__get__
_SET_BASES = type.__dict__["__bases__"].__set__


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _submodule(owner: types.ModuleType, key: str, value: Any) -> bool:
    """Whether ``owner.key = value`` is the import system's: ``value`` is the module
    ``sys.modules`` holds under ``owner``'s name dot ``key`` (a submodule imported inside the
    step, torch's lazy ``torch._dynamo`` on a proof's first trace); or an operator namespace's
    (``torch.ops.aten``) packet of the operator ``key``, which it makes at the first lookup."""
    if type(owner) is _OP_NAMESPACE:  # (torch.ops.aten caches each operator's packet at its
        # first lookup: a packet of that very operator, calling torch's compiled function)
        ns = vars(owner).get("name")
        op = vars(value).get("_op") if type(value) is _OP_PACKET else None
        return type(ns) is str and op is not None and \
            vars(value).get("_qualified_op_name") == f"{ns}::{key}" and \
            type(op) is types.BuiltinFunctionType and op.__name__ == key
    return isinstance(value, types.ModuleType) and \
        sys.modules.get(f"{owner.__name__}.{key}") is value and value.__name__ == \
        f"{owner.__name__}.{key}"


def _flags(old: Any, new: Any) -> bool:
    """Whether a module global went from one plain value to another (a bool, a number, a
    string, None: torch's own state flags, ``torch.compiler._is_exporting_flag`` set by an export
    inside the step): no code of the forward's can run through them."""
    return type(old) in _PLAIN_DATA and type(new) in _PLAIN_DATA


_PLAIN_DATA = frozenset({bool, int, float, complex, str, type(None)})
_OP_NAMESPACE = torch._ops._OpNamespace
_OP_PACKET = torch._ops.OpOverloadPacket


def _odd_keys(dicts: list[Any]) -> list[Any]:
    """The dicts of ``dicts`` holding a key that is not exactly a ``str`` (types read, no key's
    code run)."""
    return [d for d in dicts if not all(type(k) is str for k in d)]  # (no class hashed)


def _odd_message(odd: list[Any]) -> str:
    names = [next((v for k, v in d.items() if type(k) is str and k == "__name__"
                   and type(v) is str), "a class") for d in odd[:3]]
    return ("a key that is not a string was put in the dictionary of a module or class whose "
            f"names dpclip's arithmetic looks up ({', '.join(names)}): looking a name up there "
            "would run that key's __eq__ inside the engine (ninety-ninth hostile review); the "
            "step is refused. Remove it (module and class attributes are named by strings)")


def _closure_cells(values: list[Any]) -> list[types.CellType]:
    """The closure cells of the Python functions among ``values`` (and of the functions those
    cells hold, two deep): a cell's contents can be set in place (``cell.cell_contents = f``, no
    audit event) while the function holding it stays the same object; torch's
    ``Tensor.__rdiv__`` is a wrapper whose cell holds the function it calls (a forward that set
    it: 50 C under ghost, vmap and auto). A function's code and defaults are guarded by the
    frames guard's audit hook instead (``object.__setattr__``)."""
    out: list[types.CellType] = []
    seen: set[int] = set()
    todo = [(v, 0) for v in values]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, (staticmethod, classmethod)):
            v = v.__func__
        elif isinstance(v, property):
            todo.extend((f, depth) for f in (v.fget, v.fset, v.fdel) if f is not None)
            continue
        if not isinstance(v, types.FunctionType) or id(v) in seen:
            continue
        seen.add(id(v))
        for cell in v.__closure__ or ():
            try:
                inner = cell.cell_contents
            except ValueError:  # (an empty cell)
                continue
            out.append(cell)
            if depth < 2:
                todo.append((inner, depth + 1))
    return out


_CELL = operator.attrgetter("cell_contents")
_VALUE = operator.attrgetter("value")


def _tag_offset() -> int | None:
    """The offset of a dict's version tag (``ma_version_tag``, PEP 509) in its object, or None
    where it cannot be used: CPython 3.11 to 3.13 give every dict a 64-bit tag that changes at
    every change of an entry (a key added, removed, or bound to another object; never two dicts,
    or one dict at two times, with one tag). A tag that is the same means the same entries, so
    :meth:`_Snapshot._same` compares the watched dictionaries' tags (one number per dictionary)
    and compares entry by entry only where one moved. Python 3.14 no longer changes the field
    (and other builds may lay the object out otherwise): the layout is checked here, on dicts of
    several sizes and every kind of change, and anything unexpected means no tags (every check
    compares the entries, as before)."""
    if sys.implementation.name != "cpython" or not (3, 11) <= sys.version_info[:2] <= (3, 13):
        return None
    head = object.__basicsize__  # (ob_refcnt, ob_type; then ma_used, then the tag)
    off = head + ctypes.sizeof(ctypes.c_ssize_t)
    try:
        def used(d: dict) -> int:
            return ctypes.c_ssize_t.from_address(id(d) + head).value

        def tag(d: dict) -> int:
            return ctypes.c_uint64.from_address(id(d) + off).value

        seen: set[int] = set()
        d: dict = {}
        for i in range(40):  # (ma_used where it is expected: the layout is this one)
            if used(d) != len(d):
                return None
            d[i] = object()

        def moved(change: Any, target: dict) -> bool:
            before = tag(target)
            change()
            after = tag(target)
            if after == before or after in seen:
                return False
            seen.add(after)
            return True

        class _Probe:
            x = 1

        mod = types.ModuleType("_dpclip_tag_probe")
        cls_dict = gc.get_referents(_Probe.__dict__)
        if len(cls_dict) != 1 or type(cls_dict[0]) is not dict:
            return None
        # (a class's dictionary is found behind its mappingproxy by the proxy's one field, as
        # the collector finds it: gc.get_referents is refused inside a step, frames_guard)
        for c in (_Probe, *_CLASSES, contextlib.ExitStack):
            if _proxied(vars(c)) is not gc.get_referents(vars(c))[0]:
                return None
        changes = [
            (lambda: d.__setitem__(0, object()), d), (lambda: d.__setitem__("new", 1), d),
            (lambda: d.__delitem__("new"), d), (lambda: d.pop(1), d),
            (lambda: d.setdefault("s", 1), d), (lambda: d.update({2: object()}), d),
            (lambda: d.popitem(), d), (lambda: d.__ior__({3: object()}), d), (d.clear, d),
            (lambda: setattr(_Probe, "x", object()), cls_dict[0]),
            (lambda: delattr(_Probe, "x"), cls_dict[0]),
            (lambda: setattr(mod, "y", object()), vars(mod)),
            (lambda: exec("z = 1", vars(mod)), vars(mod)),
        ]
        if not all(moved(fn, target) for fn, target in changes):
            return None
        before = tag(d)
        d.get("absent")
        _ = len(d)
        if tag(d) != before:  # (reading does not move it)
            return None
    except Exception:  # noqa: BLE001 - an unexpected layout: no tags
        return None
    return off


def _proxied(proxy: types.MappingProxyType) -> Any:
    """The mapping a ``mappingproxy`` wraps (its one field, after the object header)."""
    if type(proxy) is not types.MappingProxyType:
        raise TypeError(f"not a mappingproxy: {type(proxy).__name__}")
    at = ctypes.c_void_p.from_address(id(proxy) + object.__basicsize__).value
    return ctypes.cast(at, ctypes.py_object).value


#: where a dict's version tag is (:func:`_tag_offset`), or None: entries compared one by one
_TAG_OFFSET = _tag_offset()


def _dict_of(o: Any) -> Any:
    """A module's or a class's own dictionary object (a class's, behind its mappingproxy; used
    only where :func:`_tag_offset` checked that layout)."""
    if isinstance(o, types.ModuleType):
        return vars(o)
    if _TAG_OFFSET is None:
        return None
    return _proxied(vars(o))


def _tag_readers(dicts: list[dict]) -> tuple[list[dict], list[ctypes.c_uint64]] | None:
    """The distinct dicts of ``dicts`` (kept, so that their memory stays theirs) and a reader of
    each one's version tag; None without tags."""
    if _TAG_OFFSET is None:
        return None
    out: list[dict] = []
    seen: set[int] = set()
    for d in dicts:
        if type(d) is not dict:
            return None
        if id(d) not in seen:
            seen.add(id(d))
            out.append(d)
    return out, [ctypes.c_uint64.from_address(id(d) + _TAG_OFFSET) for d in out]


def _class_values(classes: list[tuple[Any, str]]) -> list[Any]:
    return [vars(c).get(a, _MISSING) for c, a in classes]


def _cell_label(v: Any) -> str:
    return str(getattr(v, "__qualname__", None) or type(v).__name__)


def _label(o: Any) -> str:
    """A module's or a class's dotted name, for the refusal."""
    if isinstance(o, types.ModuleType):
        return o.__name__
    return f"{o.__module__}.{o.__qualname__}"


class _Snapshot:
    __slots__ = ("names", "dicts", "keys", "values", "classes", "class_values", "owners",
                 "kviews", "vviews", "lens", "flat_keys", "flat_values", "cells", "cell_values",
                 "watched", "tagged", "readers", "tags", "typed", "types", "kinds", "mros",
                 "bases", "mwhole", "mcopy", "mpos")

    def __init__(self, watched: Any = None) -> None:
        self.watched = watched if watched is not None else _names()
        self.names, self.dicts, self.keys, self.classes, (self.owners, views), self.cells, \
            (self.typed, self.kinds), self.mwhole = self.watched
        self.types = tuple(map(type, self.typed))
        self.mros = tuple(map(_MRO, self.kinds))
        self.bases = tuple(map(_BASES, self.kinds))
        # the version tags of every dictionary watched (:func:`_tag_offset`), read first: a
        # change made after them moves a tag, so the values below are never newer than them
        tagged = _tag_readers([*self.dicts, *(vars(m) for m in self.mwhole),
                               *(_dict_of(o) for o in self.owners),
                               *(_dict_of(c) for c, _ in self.classes)])
        self.tagged, self.readers = tagged if tagged is not None else ([], None)
        self.tags = tuple(map(_VALUE, self.readers)) if self.readers is not None else None
        # the modules watched whole: each dictionary's keys and values, in order, and its place
        # among the tagged dictionaries
        self.mcopy = [(tuple(vars(m)), tuple(vars(m).values())) for m in self.mwhole]
        at = {id(d): i for i, d in enumerate(self.tagged)}
        self.mpos = [at.get(id(vars(m)), -1) for m in self.mwhole]
        # (every key a string before any lookup: a key of another type with a string's hash
        # runs its __eq__ inside the compare's lookups, ninety-ninth hostile review)
        odd = _odd_keys(self._all_dicts())
        if odd:
            raise UnsupportedModelError(_odd_message(odd))
        self.cell_values = tuple(map(_CELL, self.cells))
        self.values = _values(self.dicts, self.keys)
        self.class_values = _class_values(self.classes)
        # the watched classes' (and the builtins module's) whole dictionaries: their sizes, and
        # their keys and values flat, in order
        self.kviews, self.vviews = views
        self.lens = tuple(map(len, self.vviews))
        self.flat_keys = tuple(itertools.chain.from_iterable(self.kviews))
        self.flat_values = tuple(itertools.chain.from_iterable(self.vviews))

    @property
    def whole(self) -> list[tuple[Any, tuple, tuple]]:
        """``(owner, keys, values)`` of every dictionary watched whole, as taken."""
        out, at = [], 0
        for o, n in zip(self.owners, self.lens):
            out.append((o, self.flat_keys[at:at + n], self.flat_values[at:at + n]))
            at += n
        return out

    def _all_dicts(self) -> list[Any]:
        """Every dictionary watched (the modules', the classes' behind their proxies), once."""
        if self.readers is not None:
            return self.tagged
        seen: set[int] = set()
        out = []
        for d in [*self.dicts, *(vars(o) for o in self.owners),
                  *(vars(c) for c, _ in self.classes)]:
            if id(d) not in seen:
                seen.add(id(d))
                out.append(d)
        return out

    def _lookups_same(self) -> bool:
        """Each watched module's class, each watched class's MRO and metaclass the same objects
        (by identity; no code of theirs runs)."""
        return all(map(operator.is_, map(type, self.typed), self.types)) and \
            all(map(operator.is_, map(_MRO, self.kinds), self.mros))

    def _same(self) -> bool:
        try:
            cells_same = all(map(operator.is_, map(_CELL, self.cells), self.cell_values))
        except ValueError:  # (a cell emptied)
            return False
        if not cells_same or not self._lookups_same():
            return False
        if self.readers is None:
            return not _odd_keys(self._all_dicts()) and self._same_entries() and \
                all(map(self._module_same, range(len(self.mwhole))))
        tags = tuple(map(_VALUE, self.readers))
        if tags == self.tags:
            return True  # (no watched dictionary changed since its entries were last compared)
        # (a dictionary whose tag moved: its keys all strings before it is looked into)
        if _odd_keys([d for d, t, w in zip(self.tagged, tags, self.tags) if t != w]):
            return False
        if not self._same_entries():
            return False
        moved = {i for i, (t, w) in enumerate(zip(tags, self.tags)) if t != w}
        if not all(self._module_same(j) for j, i in enumerate(self.mpos)
                   if i in moved or i < 0):
            return False
        # (a dictionary changed back and forth, or an entry not watched changed: the entries
        # compared equal after the tags were read, so those tags stand for the values taken)
        self.tags = tags
        return True

    def _module_same(self, j: int) -> bool:
        """Whether module ``j`` watched whole holds the entries it held (by identity, in order),
        but for submodules the import system added (:func:`_submodule`; then taken as the new
        entries)."""
        m = self.mwhole[j]
        d = vars(m)
        keys, vals = self.mcopy[j]
        if len(d) == len(keys) and all(map(operator.is_, d.values(), vals)) and \
                all(map(operator.is_, d.keys(), keys)):
            return True
        if _odd_keys([d]):
            return False
        old = dict(zip(keys, vals))
        if any(k not in d for k in keys):
            return False
        for k, v in list(d.items()):
            w = old.get(k, _MISSING)
            if w is _MISSING:
                if not _submodule(m, k, v):
                    return False
            elif w is not v and not _flags(w, v):
                return False
        self.mcopy[j] = (tuple(d), tuple(d.values()))
        return True

    def _module_changes(self) -> list[str]:
        out = []
        for j, m in enumerate(self.mwhole):
            if self._module_same(j):
                continue
            d = vars(m)
            old = dict(zip(*self.mcopy[j]))
            out += [f"{m.__name__}.{k}" for k in sorted(set(d) | set(old))
                    if d.get(k, _MISSING) is not old.get(k, _MISSING)
                    and not (k not in old and _submodule(m, k, d[k]))
                    and not (k in old and k in d and _flags(old[k], d[k]))]
        return out

    def reusable(self, watched: Any) -> bool:
        """Whether this snapshot, taken at an earlier step, still holds every watched value now
        (the same watched names, no watched dictionary changed since, the same closure cells):
        the next step's snapshot then is this one."""
        return watched is self.watched and self.readers is not None and self._same()

    def _same_entries(self) -> bool:
        if not all(map(operator.is_, map(dict.get, self.dicts, self.keys, _REPEAT),
                       self.values)):
            return False
        # (a key renamed, added or removed moves the keys or the sizes)
        if tuple(map(len, self.vviews)) != self.lens or \
                not all(map(operator.is_, itertools.chain.from_iterable(self.vviews),
                            self.flat_values)) or \
                not all(map(operator.is_, itertools.chain.from_iterable(self.kviews),
                            self.flat_keys)):
            return False
        # (the closure cells: compared by the caller, :meth:`_same`)
        return all(map(operator.is_, _class_values(self.classes), self.class_values))

    def _cells_now(self) -> list[Any]:
        out = []
        for c in self.cells:
            try:
                out.append(c.cell_contents)
            except ValueError:
                out.append(_MISSING)
        return out

    def changed(self) -> list[str]:
        if self._same():
            return []  # (the usual case: C code, ~10 us)
        odd = _odd_keys(self._all_dicts())
        if odd:  # (nothing is looked up in them, nor put back: the step is refused)
            raise UnsupportedModelError(_odd_message(odd))
        out = [f"the class of {_label(o)}" for o, t in zip(self.typed, self.types)
               if type(o) is not t]
        out += [f"the bases of {_label(c)}" for c, mro in zip(self.kinds, self.mros)
                if _MRO(c) is not mro]
        out += self._module_changes()
        now = _values(self.dicts, self.keys)
        out += [f"{m.__name__}.{a}" for (m, a), v, w in zip(self.names, now, self.values)
               if v is not w]
        out += [f"{_label(c)}.{a}" for (c, a), v, w in
                zip(self.classes, _class_values(self.classes), self.class_values) if v is not w]
        for c, keys, vals in self.whole:
            d = vars(c)
            was = dict(zip(keys, vals))
            out += [f"{_label(c)}.{k}" for k in sorted(set(d) | set(was))
                    if d.get(k, _MISSING) is not was.get(k, _MISSING)]
        out += [f"a closure cell of a watched function (holding {_cell_label(w)})"
                for v, w in zip(self._cells_now(), self.cell_values) if v is not w]
        return out

    def put_back(self) -> None:
        if _odd_keys(self._all_dicts()):  # (no lookup in them: the step is refused)
            return
        for o, t in zip(self.typed, self.types):
            if type(o) is not t:
                with contextlib.suppress(Exception):
                    object.__setattr__(o, "__class__", t)
        for j, m in enumerate(self.mwhole):  # (the modules watched whole, entry by entry)
            d = vars(m)
            old = dict(zip(*self.mcopy[j]))
            for k in [k for k in d if k not in old and not _submodule(m, k, d[k])]:
                del d[k]
            for k, v in old.items():
                now = d.get(k, _MISSING)
                if now is not v and not (now is not _MISSING and _flags(v, now)):
                    d[k] = v
        for c, b in zip(self.kinds, self.bases):  # (a watched class's own bases; a base of its
            # that is not watched and was changed stays changed: the step is refused anyway)
            if _BASES(c) is not b:
                with contextlib.suppress(Exception):
                    _SET_BASES(c, b)
        for c, v, w in zip(self.cells, self._cells_now(), self.cell_values):
            if v is not w:
                c.cell_contents = w
        for (o, a), v in list(zip(self.names, self.values)) + \
                list(zip(self.classes, self.class_values)):
            if vars(o).get(a, _MISSING) is not v:
                if v is _MISSING:
                    delattr(o, a)
                else:
                    setattr(o, a, v)
        for c, keys, vals in self.whole:
            d = vars(c)
            was = dict(zip(keys, vals))
            for k in set(d) | set(was):
                if d.get(k, _MISSING) is not was.get(k, _MISSING):
                    if k in was:
                        setattr(c, k, was[k])
                    else:
                        delattr(c, k)


class _State(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        self.snap: _Snapshot | None = None
        self.last: _Snapshot | None = None  # (the previous step's, if it ended unchanged)


_STATE = _State()


class watching:
    """Around a private step (the outermost call): the snapshot of torch's watched names; on
    leaving, :func:`check` once more (a change refused, put back)."""

    def __enter__(self) -> None:
        st = _STATE
        if st.depth == 0:
            watched = _names()
            last, st.last = st.last, None
            st.snap = last if last is not None and last.reusable(watched) else \
                _Snapshot(watched)
        st.depth += 1

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        st = _STATE
        st.depth -= 1
        if st.depth == 0:
            snap, st.snap = st.snap, None
            if snap is not None and exc_type is None:
                _refuse_changes(snap, "when the step ended")
                st.last = snap
            elif snap is not None:
                snap.put_back()


def check(where: str) -> None:
    """Refuse the step (after putting torch's names back) if a name dpclip looks up, or an entry
    of ``torch.Tensor``, is not the object it was when the step began. ``where``: the point of
    the step, for the message. Outside a step: nothing."""
    snap = _STATE.snap
    if snap is not None:
        _refuse_changes(snap, where)


def _refuse_changes(snap: _Snapshot, where: str) -> None:
    got = snap.changed()
    if got:
        snap.put_back()
        raise UnsupportedModelError(
            f"{', '.join(got[:4])} {'was' if len(got) == 1 else 'were'} replaced during "
            f"the private step (found {where}): the engine's own arithmetic looks such names up "
            "when it runs, so the replacement would run inside the reduction or the release, "
            "outside every check (eighty-sixth and eighty-ninth hostile reviews); put back. "
            "Replace torch's, numpy's or Python's functions before the step (at import), not "
            "from the forward or the loss")
