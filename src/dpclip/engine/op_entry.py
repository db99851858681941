"""Which operator an ATen overload object is, and running it (hundred-and-second to
hundred-and-sixth hostile reviews).

The engines' dispatch modes receive ``torch.ops`` overload objects and must run, and reason about,
the operator torch registered under that name: not what the object's own attributes say
(``_op``, ``_schema``, ``_tags``, ``_overloadpacket``: a forward set relu's ``_op`` to a batch
mixer, 7.98-10.93 C, and relu's ``_schema`` to ``flipud``'s, 5.8 C), and not a Python kernel the
Python dispatcher would find in the object's ``py_kernels`` (12.4 C). :func:`verified` checks an
overload against torch's registry at its first sight and keeps torch's compiled entry for the
operator its schema names; later lookups compare the object's attributes by identity.
:func:`call_op` runs that entry with the Python dispatcher off."""

from __future__ import annotations

import contextlib
import operator
import threading
import types
from typing import Any, Iterator

import torch

from dpclip._ident import ident
from dpclip.engine.errors import UnsupportedModelError

__all__ = ["PY_DISPATCHER", "call_op", "python_dispatcher_on", "verified"]

_GET_OP = torch._C._get_operation_overload
_GET_SCHEMA = torch._C._get_schema
_OP_OVERLOAD = torch._ops.OpOverload
_OP_PACKET = torch._ops.OpOverloadPacket


class _State(threading.local):
    exporting = 0


_STATE = _State()


@contextlib.contextmanager
def proof_export() -> Iterator[None]:
    """Around the batch-size proof's own ``torch.export`` (which runs on fake tensors with the
    Python dispatcher on, for its decompositions): the dispatcher is left as the export sets it.
    What runs for real is matched against the proof op by op with the dispatcher off."""
    _STATE.exporting += 1
    try:
        yield
    finally:
        _STATE.exporting -= 1


def call_op(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` for an ATen overload inside a dispatch mode, through torch's
    compiled entry for the operator its schema names (:attr:`_Meta.op`), made once with
    the rest of the operator's analysis: what the engines prove an operation is, and what they run,
    are the same operator. The Python dispatcher is off while it runs: a forward that switched it
    on around one operation had the C++ dispatcher hand that operation to a Python kernel kept in
    the overload's own ``py_kernels``, below every mode (hundred-and-sixth hostile review: every
    row given example 0's, 12.4 C under ghost, auto and vmap)."""
    if _STATE.exporting:
        return verified(func)[1](*args, **kwargs)
    with _NO_PY_DISPATCHER():
        return verified(func)[1](*args, **kwargs)


_NO_PY_DISPATCHER = torch._C._DisablePythonDispatcher
_PY_DISPATCHER_KEY = torch._C.DispatchKey.PythonDispatcher


def python_dispatcher_on() -> bool:
    """Whether torch's Python dispatcher is on in this thread (a forward switched it on: every
    operation may then run a Python kernel of the overload object's, below the engines' modes)."""
    return not _STATE.exporting and \
        bool(torch._C._dispatch_tls_is_dispatch_key_included(_PY_DISPATCHER_KEY))


#: refusal of :func:`python_dispatcher_on` during the forward and loss
PY_DISPATCHER = ("the forward or loss switched torch's Python dispatcher on "
                 "(torch._C._EnablePythonDispatcher / enable_python_dispatcher): every operation "
                 "may then run a Python kernel held by the operator object, below the engine's "
                 "checks (hundred-and-sixth hostile review: 12.4 C); leave it off")


#: the attributes of an ATen overload object that torch's and dpclip's code read to know what it
#: is (hundred-and-fourth hostile review): compared by identity at every analysis lookup
_WATCHED_ATTRS = ("_schema", "_overloadpacket", "_tags", "_overloadname", "_name")
_IS = operator.is_


def _refuse_forged(func: Any, why: str) -> None:
    raise UnsupportedModelError(
        f"an ATen operator object ({type(func).__name__}) is not what torch registered: {why} "
        "(its schema, packet, tags or names; hundred-and-fourth hostile review: relu's schema "
        "set to flipud's ran a batch flip proved pointwise, 5.8 C). Do not change torch.ops' "
        "objects")


def _verified(func: Any) -> Any:
    """The schema of ``func``, an ATen overload, after checking at its first sight that the
    object is torch's: of the class itself, its schema, tags and names those torch's registry
    holds for the operator, its packet the one ``torch.ops`` holds for it. Everything dpclip
    knows about an operation (its rule, what it writes, what runs) comes from that schema's name;
    a forward that set ``relu.default._schema`` to ``flipud``'s before relu's first sight had
    relu run as a batch flip with relu's pointwise rule (5.8 C under ghost, auto and compiled),
    and ``flip``'s tags and packet set to relu's had a batch flip proved pointwise (3.46 C)."""
    if type(func) is not _OP_OVERLOAD:
        _refuse_forged(func, f"an object of class {type(func).__name__}")
    d = vars(func)
    schema = d.get("_schema")
    if type(schema) is not torch.FunctionSchema:
        _refuse_forged(func, "its schema is not a schema")
    name, overload = schema.name, schema.overload_name
    try:
        real = _GET_SCHEMA(name, overload)
        got = _GET_OP(name, overload)
    except RuntimeError:
        got = None
    if got is None:
        _refuse_forged(func, f"torch has no operator {name}.{overload or 'default'}")
    ns, _, short = name.partition("::")
    packet = d.get("_overloadpacket")
    space = vars(torch.ops).get(ns)
    if str(real) != str(schema) or type(got[0]) is not types.BuiltinFunctionType or \
            type(packet) is not _OP_PACKET or space is None or \
            vars(space).get(short) is not packet or \
            vars(packet).get("_qualified_op_name") != name or \
            list(d.get("_tags") or ()) != list(got[2]) or \
            d.get("_overloadname") != (overload or "default") or \
            d.get("_name") != (name if not overload else f"{name}.{overload}"):
        _refuse_forged(func, f"its schema, packet, tags or names are not those of {name}")
    return schema


#: ident(overload) -> (overload, (schema, torch's compiled entry), its watched attributes)
_ENTRIES: dict[int, tuple[Any, tuple[Any, Any], tuple]] = {}


def verified(func: Any) -> tuple[Any, Any]:
    """``(schema, entry)`` of the ATen overload ``func``: checked against torch's registry at its
    first sight (:func:`_verified`), its attributes compared by identity afterwards; the entry is
    torch's compiled function for the operator the schema names, made anew from that name."""
    e = _ENTRIES.get(ident(func))
    d = vars(func)
    if e is not None and e[0] is func:
        if all(map(_IS, map(d.get, _WATCHED_ATTRS), e[2])):
            return e[1]
        _refuse_forged(func, "its attributes were changed after torch made it")
    schema = _verified(func)
    got = (schema, _GET_OP(schema.name, schema.overload_name)[0])
    _ENTRIES[ident(func)] = (func, got, tuple(map(d.get, _WATCHED_ATTRS)))
    return got


#: torch's switch of compiled autograd (a process-wide C setting), bound at import; None where
#: this torch has none
_SET_AUTOGRAD_COMPILER = getattr(getattr(getattr(getattr(torch._C, "_dynamo", None),
                                                 "compiled_autograd", None), "__dict__", {}),
                                 "get", lambda _k: None)("set_autograd_compiler")

COMPILED_AUTOGRAD = (
    "compiled autograd is switched on (torch._dynamo.compiled_autograd, or torch._C._dynamo."
    "compiled_autograd.set_autograd_compiler, set before or during the step): it hands the "
    "engine's backward pass to a compiler whose code returns the gradients, which could rewrite "
    "one example's gradient with another's (hundred-and-eighteenth hostile review: a forward "
    "that set it from a finalizer for the next step: 14.8 C). Switch it off for private training")


class no_compiled_autograd:
    """Around an engine's backward pass: compiled autograd off, and refused where it was on.
    torch has no getter: the switch is set to off, which returns the previous setting; a
    compiler found there (set before the backward, or by code that ran during it) is refused,
    and the switch stays off."""

    __slots__ = ()

    def __enter__(self) -> None:
        if _SET_AUTOGRAD_COMPILER is None:
            return
        prev = _SET_AUTOGRAD_COMPILER(None, False)
        if prev[0] is not None:
            raise UnsupportedModelError(COMPILED_AUTOGRAD)

    def __exit__(self, *exc: Any) -> bool:
        if _SET_AUTOGRAD_COMPILER is not None and \
                _SET_AUTOGRAD_COMPILER(None, False)[0] is not None and exc[0] is None:
            raise UnsupportedModelError(COMPILED_AUTOGRAD)
        return False
