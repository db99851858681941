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
bytecode, module globals that are torch modules followed by attribute loads), and the whole
``torch.Tensor`` class dictionary (where ``x @ y``, ``x.clamp_`` and operators are found before
torch's C base class, which cannot be changed). :func:`check` compares them by identity where
user code has just run and engine code follows: after each chunk's forward and loss, at the
entry of every reduction (``exact_float32``) and of the release, and when the step ends. A
change is put back and the step refused. Names bound at import (``_vecdot =
torch.linalg.vecdot``) need no watch. Replacing torch's names before the step (a library patching
torch at import) is allowed: only changes made inside the step are refused."""

from __future__ import annotations

import dis
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


def _lookups(module: types.ModuleType) -> set[tuple[int, str]]:
    """``(id(torch module), attribute)`` for every ``G.a.b`` chain in the module's code whose
    global ``G`` is a torch module (each link that is a torch module, followed)."""
    glb = vars(module)
    out: set[tuple[int, str]] = set()
    seen: set[int] = set()
    for v in list(glb.values()):
        if isinstance(v, (types.FunctionType, type)) and getattr(v, "__module__", None) \
                == module.__name__:
            for co in _codes(v, seen):
                cur: Any = None
                for ins in dis.get_instructions(co):
                    if ins.opname == "LOAD_GLOBAL":
                        got = glb.get(ins.argval)
                        cur = got if _is_torch(got) else None
                    elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and cur is not None:
                        _MODULES[id(cur)] = cur
                        out.add((id(cur), ins.argval))
                        nxt = getattr(cur, ins.argval, None)
                        cur = nxt if _is_torch(nxt) else None
                    else:
                        cur = None
    return out


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


def _names() -> tuple[list[tuple[types.ModuleType, str]], list[dict], list[str]]:
    """Every watched ``(torch module, attribute)``, with the modules' dictionaries and the
    attributes as two lists (for one pass of ``map``): dpclip's modules loaded so far, each
    scanned once (a strategy's module imported later is scanned at the next step; the scan runs
    when the number of loaded modules changed)."""
    if len(sys.modules) != _SEEN[0]:
        new = [m for n, m in list(sys.modules.items())
               if (n == "dpclip" or n.startswith("dpclip.")) and n not in _SCANNED
               and isinstance(m, types.ModuleType)]
        with _LOCK:
            for m in new:
                if m.__name__ not in _SCANNED:
                    _NAMES.update(_lookups(m))
                    _SCANNED.add(m.__name__)
            pairs = [(_MODULES[i], a) for i, a in sorted(_NAMES)]
            _WATCHED[:] = [(pairs, [vars(m) for m, _ in pairs], [a for _, a in pairs])]
            _SEEN[0] = len(sys.modules)
    return _WATCHED[0]


#: the number of modules loaded at the last scan; the watched names, their dicts and keys
_SEEN = [-1]
_WATCHED: list[tuple[list[tuple[types.ModuleType, str]], list[dict], list[str]]] = []


class _Snapshot:
    __slots__ = ("names", "dicts", "keys", "values", "tensor_keys", "tensor_values")

    def __init__(self) -> None:
        self.names, self.dicts, self.keys = _names()
        self.values = _values(self.dicts, self.keys)
        d = vars(torch.Tensor)
        self.tensor_keys = tuple(d)
        self.tensor_values = tuple(d.values())

    def changed(self) -> list[str]:
        d = vars(torch.Tensor)
        if all(map(operator.is_, map(dict.get, self.dicts, self.keys, _REPEAT), self.values)) \
                and len(d) == len(self.tensor_values) \
                and all(map(operator.is_, d.values(), self.tensor_values)):
            return []  # (the usual case: C code, ~10 us; a key renamed moves a value too)
        now = _values(self.dicts, self.keys)
        out = [f"{m.__name__}.{a}" for (m, a), v, w in zip(self.names, now, self.values)
               if v is not w]
        if len(d) != len(self.tensor_keys) or not all(map(operator.is_, d, self.tensor_keys)) \
                or not all(map(operator.is_, d.values(), self.tensor_values)):
            was = dict(zip(self.tensor_keys, self.tensor_values))
            out += [f"torch.Tensor.{k}" for k in sorted(set(d) | set(was))
                    if d.get(k, _MISSING) is not was.get(k, _MISSING)]
        return out

    def put_back(self) -> None:
        for (m, a), v in zip(self.names, self.values):
            if vars(m).get(a, _MISSING) is not v:
                if v is _MISSING:
                    delattr(m, a)
                else:
                    setattr(m, a, v)
        d = vars(torch.Tensor)
        was = dict(zip(self.tensor_keys, self.tensor_values))
        for k in set(d) | set(was):
            if d.get(k, _MISSING) is not was.get(k, _MISSING):
                if k in was:
                    setattr(torch.Tensor, k, was[k])
                else:
                    delattr(torch.Tensor, k)


class _State(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        self.snap: _Snapshot | None = None


_STATE = _State()


class watching:
    """Around a private step (the outermost call): the snapshot of torch's watched names; on
    leaving, :func:`check` once more (a change refused, put back)."""

    def __enter__(self) -> None:
        st = _STATE
        if st.depth == 0:
            st.snap = _Snapshot()
        st.depth += 1

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        st = _STATE
        st.depth -= 1
        if st.depth == 0:
            snap, st.snap = st.snap, None
            if snap is not None and exc_type is None:
                _refuse_changes(snap, "when the step ended")
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
            f"torch's {', '.join(got[:4])} {'was' if len(got) == 1 else 'were'} replaced during "
            f"the private step (found {where}): the engine's own arithmetic looks such names up "
            "when it runs, so the replacement would run inside the reduction or the release, "
            "outside every check (eighty-sixth hostile review); put back. Replace torch's "
            "functions before the step (at import), not from the forward or the loss")
