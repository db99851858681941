"""Per-example separability of a forward pass, proved op by op (used by the ghost engine).

The ghost engine runs the model ONCE on the whole batch and reads example ``i``'s gradient from row
``i`` of every layer's input ``a`` and output gradient ``b``. That is the per-example gradient, and
the per-example clipping bound bounds the sensitivity, only if the batched computation is *row
separable*: every row of every tensor that reaches the per-example losses or a layer rule depends on
its own example and on constants only. A layer that mixes examples (``x - x.mean(0)``, a softmax or
a ``roll`` over the batch dimension, BatchNorm with batch statistics) or a layer that receives the
batch in another dimension (a sequence-first ``(T, B, d)`` layout, even when ``T == B``) breaks it,
and nothing in the shapes shows it.

:class:`SeparabilityTracer` is a :class:`~torch.utils._python_dispatch.TorchDispatchMode` that sees
every ATen operation of the forward pass and the loss (with or without autograd, in-place ops
included) and tracks, for every tensor, an abstract *layout*:

* ``None`` (constant): does not depend on the batch data (parameters, buffers, ``arange``, random
  draws such as dropout masks);
* ``(d, k)`` (row separable): dimension ``d`` has size ``B * k`` and its slice ``[i k, (i + 1) k)``
  depends on example ``i`` and on constants only; the inputs and targets start as ``(0, 1)``;
* ``Folded(d, k, o)``: dimension ``d`` has size ``o B k``, the batch folded inside an outer factor
  (a ``(T, B, E)`` tensor flattened to ``(T B, E)``, as ``F.linear`` does inside
  ``nn.MultiheadAttention``); read only by the rules written for it, ``MIXED`` for all others;
* ``MIXED``: anything else (unknown operation, a reduction over the batch dimension, ...).

Every operation has a rule that is sound by construction (pointwise ops with broadcasting,
reductions and softmax-like ops over other dimensions, views and reshapes that keep the batch
blocks, matrix products and convolutions with constant weights, layer/group/eval-batch norms,
pooling and padding of trailing dimensions, embeddings, per-example losses with
``reduction='none'``); an operation without a rule makes its outputs ``MIXED`` unless all its inputs
are constant. In-place writes that change a tensor's layout taint the tensor's storage, so that other
views of it read as ``MIXED``. Reading batch data into Python (``.item()``, ``nonzero``, a ``bool``
of a tensor: ops tagged ``data_dependent_output`` / ``dynamic_output_shape``) from a non-constant
tensor is a violation (the value could steer anything). The engine then requires the per-example
losses and every hooked layer's input and output to have layout ``(0, 1)``, or, for a layer with
a ghost rule, ``(0, k)`` (example ``i`` in rows ``[i k, (i + 1) k)``: its rule sums them;
:func:`dpclip.engine.ghost_rules._fold_rows`).

Position: a constant operand that spans the batch dimension of example data pairs row ``i`` with
example ``i``'s POSITION (``x + pe[:x.size(0)]``, ``h * arange(B)``); it is accepted only when it is
the same in every block (checked on its public values) or a fresh i.i.d. random draw (a dropout
mask), and ``arange(B)`` indexes the batch only as the verified identity (issue 31).

Python: a :class:`~torch.overrides.TorchFunctionMode` beside the dispatch mode sees what never
reaches ATen: ``.numpy()``, ``.tolist()``, ``.data``, raw storage of batch data, gradient hooks and
``grad_fn`` reads are violations. In-place writes of batch data into storage that existed before
the call (parameters, buffers, attributes, globals) are violations; tensors that depended on the
batch in an earlier traced call read as MIXED (:meth:`SeparabilityTracer.retire`).

Soundness: the rules only ever claim ``(d, k)`` when each output block is a function of the same
example's input blocks and of constants, so a ``(0, 1)`` loss row is a function of its own example
(no false "separable"); unknown operations are refused, never guessed. The batch size as a Python
number (``o / len(y)``) is invisible here: :mod:`dpclip.engine.batch_symbol` proves it is used only
as a size, with a symbolic batch, and :mod:`dpclip.engine.proved_program` checks, op by op, that
the real run is the program that proof traced (:attr:`SeparabilityTracer.match`);
:func:`prove_separable` runs all three. What the tracer cannot see:
tensors reached outside the call's arguments that never held batch data in a traced call (a
global copy of the dataset). Custom ``autograd.Function`` backward code is refused by the engine
(its graph walk). A batch of one example is trivially separable and is not traced.
"""

from __future__ import annotations

import gc
import math
import sys as _sys
from typing import Any, Callable

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _disable_current_modes as _no_dispatch_modes

from dpclip._ident import ident
from dpclip.engine.conv_backends import (
    MOVED,
    NUMERICS_MOVED,
    THREADS_MOVED,
    conv_backends_moved,
    numerics_moved,
    threads_moved,
)
from dpclip.engine.memory_watch import foreign_saved_tensor_hooks
from dpclip.engine.op_entry import PY_DISPATCHER, call_op, python_dispatcher_on, verified
from dpclip.engine import _cm
from dpclip.engine import frames_guard
from dpclip.engine.past_batches import _STALE, _IdMap

__all__ = ["MIXED", "SeparabilityTracer", "prove_separable"]

#: the layout of a tensor that may mix examples
MIXED = "mixed"

Layout = Any  # None | tuple[int, int] | Folded | MIXED


class Folded:
    """The layout of a tensor whose dimension ``d`` (size ``o B k``) holds the batch INSIDE an
    outer factor of ``o``: index ``a B k + i k + j`` (``a < o``, ``j < k``) depends on example
    ``i`` and constants only. A sequence-first ``(T, B, E)`` tensor flattened to ``(T B, E)``
    (what ``F.linear`` does to a ``(T, B, E)`` input, and ``nn.MultiheadAttention`` to its
    projections) is ``Folded(0, 1, T)``: row ``t B + i`` is example ``i``'s position ``t``; the
    view back to ``(T, B, E)`` is ``(1, 1)`` again.

    It is not a tuple and cannot be indexed or unpacked, and :meth:`SeparabilityTracer.layout`
    reads it as ``MIXED``: only the rules that are written for it (``_reshape``, ``_matmul``'s
    ``mm`` / ``addmm``, ``_copy_of``, ``_broadcast_join`` for elementwise operations) see it
    through :meth:`SeparabilityTracer.raw_layout`; every other rule, and everything outside this
    module, sees a mix of the examples (fail closed)."""

    __slots__ = ("d", "k", "o")

    def __init__(self, d: int, k: int, o: int) -> None:
        self.d, self.k, self.o = d, k, o

    def __eq__(self, other: object) -> bool:
        return type(other) is Folded and (self.d, self.k, self.o) == (other.d, other.k, other.o)

    def __hash__(self) -> int:
        return hash((Folded, self.d, self.k, self.o))

    def __repr__(self) -> str:
        return f"Folded(d={self.d}, k={self.k}, outer={self.o})"


def _parts(lay: Layout) -> tuple[int, int, int]:
    """``(d, k, o)`` of a batch layout (``o = 1`` for a plain ``(d, k)``)."""
    if type(lay) is Folded:
        return lay.d, lay.k, lay.o
    d, k = lay
    return d, k, 1


def _of(d: int, k: int, o: int) -> Layout:
    """The layout ``(d, k)`` when ``o == 1``, else ``Folded(d, k, o)``."""
    return (d, k) if o == 1 else Folded(d, k, o)

_aten = torch.ops.aten
_POINTWISE = torch.Tag.pointwise
_REDUCTION = torch.Tag.reduction
_DATA_DEP = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)


_is_wrapper = torch._C._functorch.is_functorch_wrapped_tensor


def _name(func: Any) -> str:
    return func._schema.name.split("::", 1)[-1]


class _Meta:
    """What the tracer needs to know about one ATen overload, read from its schema once."""

    __slots__ = ("mutable", "data_dep", "rule", "args", "writes", "random", "keeps_iid",
                 "uninit", "full_write", "fresh", "op")

    def __init__(self, func: Any) -> None:
        schema, self.op = verified(func)
        #: torch's compiled entry for the operator the schema names (:func:`call_op`): made anew
        #: from the name this analysis read, not the overload object's ``_op`` or its
        #: class's ``__call__``, which a forward can replace (hundred-and-second hostile review:
        #: ``torch.ops.aten.relu.default._op`` set to a wrapper that mixed the batch from its
        #: fifth call, 7.98 C under ghost, 8.68 C under auto and compiled; ``OpOverload.__call__``
        #: 10.93 C)
        tags = vars(func)["_tags"]  # (the registry's: checked by _verified)
        self.mutable = schema.is_mutable
        # ops whose rule judges their data-dependence itself (integer indexing is not)
        self.data_dep = any(t in tags for t in _DATA_DEP) and \
            func.overloadpacket not in _SELF_JUDGED
        rule = _RULES.get(func.overloadpacket)
        if rule is None:
            rule = _pointwise if _POINTWISE in tags else _reduction if _REDUCTION in tags else None
        self.rule = rule
        #: draws i.i.d. random elements (scalar parameters only: see _IID_RANDOM)
        self.random = str(func) in _IID_RANDOM
        #: elementwise with scalars, or a view / copy: keeps a tensor's elements i.i.d.
        self.keeps_iid = (_POINTWISE in tags) or func.overloadpacket in _IID_KEEPERS
        #: returns uninitialised memory / overwrites every element of its first argument
        self.uninit = func.overloadpacket in _UNINIT
        self.full_write = func.overloadpacket in _FULL_WRITE
        #: returns new storage: no output aliases an input (a view of a parameter is not a new
        #: storage; writing batch data through it writes the parameter). ``lift_fresh`` lifts a
        #: tensor that ``torch.tensor(...)`` has just made
        self.fresh = func.overloadpacket is _aten.lift_fresh or \
            all(r.alias_info is None for r in schema.returns)
        self.args: dict[str, tuple[int, bool, Any]] = {}
        self.writes: list[tuple[int, str]] = []
        for i, a in enumerate(schema.arguments):
            has = a.has_default_value()
            self.args[a.name] = (i, has, a.default_value if has else None)
            if a.alias_info is not None and a.alias_info.is_write:
                self.writes.append((i, a.name))


#: keyed by ``ident(op)``, holding the op (an OpOverload's ``__hash__`` is Python code)
_METAS: dict[int, tuple[Any, _Meta]] = {}
def _meta(func: Any) -> _Meta:
    e = _METAS.get(ident(func))
    if e is not None and e[0] is func:
        verified(func)  # (its attributes still those torch registered: else refused)
        return e[1]
    m = _Meta(func)
    _METAS[ident(func)] = (func, m)
    return m




def _arg(func: Any, args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
    """The value of the schema argument ``name`` (positional or keyword) or ``default``."""
    got = _meta(func).args.get(name)
    if got is None:
        return default
    i, has, dflt = got
    if i < len(args):
        return args[i]
    if name in kwargs:
        return kwargs[name]
    return dflt if has else default


_MISSING = object()

_DISPATCH_LEN = torch._C._len_torch_dispatch_stack
_DISPATCH_AT = torch._C._get_dispatch_stack_at
_INFRA_MODE = torch._C._get_dispatch_mode
_INFRA_KEYS = tuple(torch._C._TorchDispatchModeKey.__members__.values())


def _tracer_alone(tr: Any) -> bool:
    """Whether the tracer is the only dispatch mode: the only one on the stack, and none of
    torch's infrastructure modes (fake, proxy, functional) set."""
    return _DISPATCH_LEN() == 1 and _DISPATCH_AT(0) is tr and \
        all(_INFRA_MODE(k) is None for k in _INFRA_KEYS)


#: ops that return a tensor's metadata (device, dtype, sizes) to Python, never its values
_METADATA = {"device", "layout", "dtype", "sym_size", "sym_numel", "sym_stride",
             "sym_storage_offset", "is_same_size", "is_floating_point", "is_complex", "dim",
             "size", "stride", "numel", "storage_offset", "is_contiguous", "is_non_overlapping_and_dense"}

#: the convolutions whose CPU backend torch chooses by the batch size (dpclip.engine.conv_backends)
_CONVOLUTIONS = frozenset(getattr(torch.ops.aten, n) for n in (
    "convolution", "_convolution", "convolution_overrideable", "mkldnn_convolution",
    "_nnpack_spatial_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d") if hasattr(torch.ops.aten, n))

_T = torch.Tensor
#: the ``__torch_dispatch__`` of plain tensors and parameters
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__
#: Tensor methods that take values (or raw memory) of a tensor out of the trace into Python or
#: NumPy: on batch data, whatever is computed from the result is invisible to the layout rules
_ESCAPES = {_T.numpy, _T.tolist, _T.__array__, _T.data_ptr, _T.untyped_storage, _T.storage,
            _T.__reduce_ex__, _T.__deepcopy__, _T.__dlpack__, _T.__repr__, _T.__format__,
            _T.__str__ if "__str__" in vars(_T) else _T.__repr__}
#: the escapes that also give WRITABLE access to a tensor's memory outside the dispatcher (a
#: NumPy view, a raw pointer, the storage, a DLPack capsule, ``.data``, whose writes bump another
#: version counter): a write through them changes what the tensor's name stands for in the
#: proved-program match without any operation; refused on EVERY tensor, constant or not (second
#: hostile review: ``g.numpy()[:] = len(x) - 7`` on a constant, then ``h * g``: LOO 3.16 C)
_WRITABLE = {_T.numpy, _T.__array__, _T.data_ptr, _T.untyped_storage, _T.storage, _T.__dlpack__}
#: Tensor methods that attach user code to the backward pass (the trace sees only the forward)
_HOOKS = {_T.register_hook, _T.register_post_accumulate_grad_hook}


#: builtins of torch's tensor class that call a Python callable they are given
_CALLBACK_METHODS = frozenset({"apply_", "map_", "map2_"})
#: function -> whether it is one of torch's own functions that runs no user code (see _library)
_LIBRARY: dict[int, tuple[Any, bool]] = {}


def _library(func: Any) -> bool:
    """Whether ``func``, reaching the tracer's torch-function mode, is one of torch's own
    functions that runs no user code: a builtin of torch's C modules or tensor class (not one
    that calls a callable it is given: ``apply_``), an ATen operation object, or a Python
    function of torch's files whose code is what its file compiles to, whose globals are its
    module's and whose closure holds only such functions or data. A user function that
    dispatches itself through ``handle_torch_function``, a custom ``autograd.Function``'s
    ``apply`` (its forward is user code) and anything else are not: the operations they run
    are not inside one of torch's functions (:meth:`ProgramMatch.fn_enter`)."""
    e = _LIBRARY.get(ident(func))
    if e is not None and e[0] is func:
        return e[1]
    got = _library_now(func, ())
    _LIBRARY[ident(func)] = (func, got)
    return got


def _library_now(func: Any, above: tuple) -> bool:
    import os
    import sys
    import types as _types

    from dpclip.engine.library_code import _BUILTIN_TYPES, _compiled_at, _file_of, _torch_file

    if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return type(func) in (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
    if isinstance(func, _BUILTIN_TYPES):
        if getattr(func, "__name__", "") in _CALLBACK_METHODS:
            return False
        owner = getattr(func, "__self__", None)
        if type(func) is _types.MethodWrapperType:  # (a property's getter, Tensor.T.__get__:
            # the class of the getset or slot it wraps, else its object's class)
            cls = getattr(owner, "__objclass__", None) or type(owner)
        else:
            cls = getattr(func, "__objclass__", None)
            if cls is None and owner is not None and not isinstance(owner, _types.ModuleType):
                cls = type(owner)
        mod = getattr(func, "__module__", None) if type(func) is _types.BuiltinFunctionType \
            else None
        if mod is None and isinstance(owner, _types.ModuleType):
            mod = owner.__name__
        if mod is None and isinstance(cls, type):
            mod = cls.__module__
        return isinstance(mod, str) and (mod == "torch" or mod.startswith("torch."))
    if isinstance(func, _types.MethodType):
        # (bound to a class or object that is not torch's: its code can call the owner's, as a
        # custom autograd.Function's apply calls its forward)
        owner = func.__self__
        cls = owner if isinstance(owner, type) else type(owner)
        if cls is not Tensor and not (cls.__module__ or "").startswith("torch."):
            return False
    fn = func.__func__ if isinstance(func, _types.MethodType) else func
    if type(fn) is not _types.FunctionType or not _torch_file(fn):
        return False
    code = fn.__code__
    if _compiled_at(_file_of(fn), code.co_qualname, code.co_firstlineno) != code:
        return False
    # (its globals: the dict of the module loaded from the file its code is in; a decorator's
    # inner function takes the decorated one's __module__, torch's boolean_dispatch)
    g = fn.__globals__
    module = sys.modules.get(g.get("__name__") or "")
    where = getattr(module, "__file__", None)
    if module is None or g is not vars(module) or where is None or \
            os.path.realpath(where) != _file_of(fn):
        return False
    for cell in fn.__closure__ or ():
        try:
            v = cell.cell_contents
        except ValueError:  # (an empty cell)
            continue
        if v is fn or any(v is a for a in above) or not callable(v) or isinstance(v, type):
            continue  # (itself: a wrapper that dispatches as itself)
        if len(above) >= 2 or not _library_now(v, (*above, fn)):
            return False
    return True


#: the exact types of arguments whose use inside torch's functions runs no Python code: plain
#: tensors, Python's own scalars and containers (walked), torch's C-level value types, NumPy's
#: scalars. Anything else (a subclass of int with ``__index__``, an object with
#: ``__torch_function__``, ``__len__``, ``__iter__``, ``__float__``, a callable) can run user code
#: inside the function (hundred-and-sixty-sixth hostile review: an object's
#: ``__torch_function__`` given to torch.add rebuilt a matched operation's node there, 13.3 C)
_PLAIN_ARGS = frozenset({Tensor, torch.nn.Parameter, int, float, bool, complex, str, bytes,
                         type(None), type(Ellipsis), torch.dtype, torch.device, torch.layout,
                         torch.memory_format, torch.Generator, torch.qscheme})
_CONTAINERS = frozenset({list, tuple, torch.Size, dict, slice})
try:
    import numpy as _np

    _PLAIN_ARGS = _PLAIN_ARGS | frozenset(t for t in set(_np.sctypeDict.values())
                                          if issubclass(t, _np.generic))
except ImportError:  # pragma: no cover - numpy is a dependency of torch's tests, not of torch
    pass


def _user_callback(args: tuple, kwargs: dict | None) -> bool:
    """Whether running a function on these arguments could run user code inside it: an
    argument (or an element of a list, tuple, dict or slice among them) of a type not in
    :data:`_PLAIN_ARGS`; or a ``sys.monitoring`` tool, which runs on Python calls inside torch's
    Python functions and sees their frames (trace and profile functions are switched off inside
    them instead: ``_EscapeMode.__torch_function__``)."""
    stack = [*args, *(kwargs or {}).values()]
    while stack:
        a = stack.pop()
        t = type(a)
        if t in _PLAIN_ARGS:
            if (t is Tensor or t is torch.nn.Parameter) and a.__dict__ and \
                    not _TENSOR_NAMES.isdisjoint(a.__dict__):
                return True  # (its own attribute hides a Tensor method torch's code calls:
                # t.softmax = f, then F.softmax(t) ran f; hundred-and-sixty-seventh review)
            continue
        if t not in _CONTAINERS:
            return True
        if t is dict:
            stack.extend(a.values())
            stack.extend(a.keys())
        elif t is slice:
            stack.extend((a.start, a.stop, a.step))
        else:
            stack.extend(a)
    return _monitoring_tools() or not _warnings_own()


#: every name of torch's tensor class (an instance attribute of that name hides it)
_TENSOR_NAMES = frozenset(dir(Tensor))
#: the warnings module's functions that run when torch's code warns, as Python defines them
_WARN_FNS = ("showwarning", "_showwarnmsg", "formatwarning", "_formatwarnmsg")
_WARN_ORIG = {n: getattr(__import__("warnings"), n, None) for n in _WARN_FNS}


def _warnings_own() -> bool:
    """Whether a warning raised inside torch's Python code would run only Python's own code:
    the warnings module's display functions are its own (a replaced ``warnings.showwarning``
    ran inside ``F.softmax``'s implicit-dimension warning: hundred-and-sixty-seventh hostile
    review, 13.6 C), and every filter's category is a class of the plain ``type`` metaclass (a
    metaclass's ``__subclasscheck__`` would run when the filters are matched)."""
    import warnings

    for n in _WARN_FNS:
        if getattr(warnings, n, None) is not _WARN_ORIG[n]:
            return False
    return all(type(f[2]) is type for f in warnings.filters if len(f) > 2)


def _monitoring_tools() -> bool:
    """A ``sys.monitoring`` tool is registered (Python 3.12+): its callbacks would run inside
    torch's Python functions, and it cannot be switched off and put back here."""
    if not _MONITORING:
        return False
    import sys

    mon = sys.monitoring
    return any(mon.get_tool(i) is not None for i in range(6))


_MONITORING = hasattr(__import__("sys"), "monitoring")


class _EscapeMode(TorchFunctionMode):
    """The Python-level half of the tracer: ``.numpy()``, ``.tolist()``, raw storage reads of a
    tensor that depends on the batch, gradient hooks on any tensor, and reading ``grad_fn`` (the
    door to ``grad_fn.register_hook``) make the proof "not proven". These calls never reach the
    ATen dispatcher, so the dispatch mode alone cannot see them."""

    def __init__(self, tracer: "SeparabilityTracer") -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        tr = self.tracer
        if not tr.quiet:
            why = None
            kind = _func_kind(func)
            if kind == _K_HOOK:
                why = (f"a gradient hook ({getattr(func, '__name__', func)}) is registered in the "
                       "forward pass: user code in the backward pass is not traced and could mix "
                       "the examples' gradients")
            elif kind == _K_ESCAPE:
                t = args[0] if args else None
                if isinstance(t, Tensor) and (tr.layout(t) is not None or
                                              _is_get(func, "grad_fn") or
                                              func in _WRITABLE or _is_get(func, "data") or
                                              _is_get(func, "data", "__set__")):
                    what = ("Tensor.grad_fn" if _is_get(func, "grad_fn") else "Tensor.data"
                            if _is_get(func, "data") else "an assignment to Tensor.data"
                            if _is_get(func, "data", "__set__") else
                            f"Tensor.{getattr(func, '__name__', func)}()")
                    why = (f"{what} takes the values of a tensor that "
                           "depends on the batch out of the trace (to NumPy, Python or raw "
                           "memory), gives write access to a tensor's memory outside the "
                           "traced operations (any tensor, constant or not), or reaches its "
                           "autograd node: what is computed from them cannot be checked")
            if why is not None and tr.violation is None:
                tr.violation = why
        m = tr.match
        if m is None or tr.quiet or m.done or m.mismatch is not None:
            return self._outside(tr, func, args, kwargs)
        # one of torch's own functions, inside the match: what it returns (and writes) is
        # stamped with its autograd node when it returns, before any user code runs. From
        # before the checks of the function and its arguments to after the stamp, the collector
        # is paused (no finalizer of a cycle runs there) and a trace or profile function set
        # from Python, or cProfile's profiler, whose timer can be a Python function, is switched
        # off (it would run on every call inside torch's Python functions and see their frames;
        # put back after the stamp: the profile function set before the step that ran on the
        # gc.enable() between the function's return and its stamp rewrote the node the write
        # made and had the forged node stamped: 13.25 C under ghost, auto and make_private,
        # hundred-and-seventy-first hostile review); a callback an extension set from C,
        # torch.profiler's, runs that extension's code and stays on (frames_guard)
        collecting = gc.isenabled()
        if collecting:
            gc.disable()
        callbacks = None
        if _sys.gettrace() is not None or _sys.getprofile() is not None:
            callbacks = frames_guard.callbacks_off()
        own = False
        try:
            own = _library(func) and all(t is Tensor or t is torch.nn.Parameter
                                         for t in types) and not _user_callback(args, kwargs)
            if own and tr.violation is None and not _tracer_alone(tr):
                # (a dispatch mode the forward entered above the tracer runs between autograd,
                # which has packed the operation's saved tensors, and the tracer's step: it
                # popped a forged saved-tensor hook pair there, so every check saw the step's
                # watch on top and read the true values while the backward read +-1000 by
                # example 0's sign: 13.25 C at B = 8, 56.6 C at 32 under ghost, auto's traced
                # pass and make_private, hundred-and-seventy-sixth hostile review)
                tr.violation = (
                    "a dispatch mode (TorchDispatchMode, or one of torch's own: fake, proxy, "
                    "functional) is active above or beside the engine's tracer inside the "
                    "forward: its code runs between autograd and the checks of every operation")
            if own:
                before = m.fn_enter(func, args, kwargs)
                try:
                    if func is _ONE_HOT:
                        out = _one_hot(tr, args, kwargs or {})
                    elif func in _FUSED_RNN:
                        out = _fused_rnn(tr, func, args, kwargs or {})
                    else:
                        out = self._run(tr, func, args, kwargs)
                finally:
                    m.fn_exit(out if "out" in locals() else None, before)
        finally:
            if callbacks is not None:
                found, left = callbacks
                if _sys.gettrace() is not left[0] or _sys.getprofile() is not left[1]:
                    tr.violation = tr.violation or (
                        "an interpreter callback (sys.settrace / sys.setprofile) was set "
                        "inside one of torch's functions")
                if found[0] is not left[0] or found[1] is not left[1]:
                    frames_guard.put_back_callbacks(*found)
            if collecting:
                gc.enable()
        if not own:
            # (not one of torch's own functions: the operations it runs are matched at depth 0,
            # see ProgramMatch.fn_enter)
            return self._outside(tr, func, args, kwargs)
        return out

    def _outside(self, tr: "SeparabilityTracer", func: Any, args: tuple,
                 kwargs: dict | None) -> Any:
        """A function run outside the proved-program match, or not one of torch's own."""
        if not tr.quiet:
            if func is _ONE_HOT:
                return _one_hot(tr, args, kwargs or {})
            if func in _FUSED_RNN:
                return _fused_rnn(tr, func, args, kwargs or {})
        return self._run(tr, func, args, kwargs)

    def _run(self, tr: "SeparabilityTracer", func: Any, args: tuple,
             kwargs: dict | None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not tr.quiet and tr.violation is None and isinstance(out, Tensor) \
                and not (tr._kernel_depth and isinstance(func, torch._ops.OpOverload)) \
                and out not in tr._seen and not any(out is a for a in args):
            # a new tensor that no ATen operation under the dispatch mode produced, from batch
            # data: computed with Python dispatch switched off (torch._C._DisableTorchDispatch)
            if any(isinstance(a, Tensor) and tr.layout(a) is not None for a in args) or \
                    any(isinstance(v, Tensor) and tr.layout(v) is not None
                        for v in (kwargs or {}).values()):
                tr.violation = (f"{getattr(func, '__name__', func)} returned a tensor computed "
                                "from batch data outside the dispatch trace (Python dispatch "
                                "switched off?): it cannot be checked")
        return out


_ONE_HOT = torch._C._nn.one_hot


def _one_hot(tr: "SeparabilityTracer", args: tuple, kwargs: dict) -> Any:
    """``F.one_hot(y, k)`` on real tensors checks its labels in Python (``min().item()``,
    ``max().item()``) and scatters; on the proof's fake tensors it computes
    ``eq(y.unsqueeze(-1), arange(k)).to(long)``, so the two programs differed and every loss built
    on it was refused. Here it computes the proof's form, which the tracer checks like any other
    code, and checks the labels with the tracer quiet, as ``one_hot`` does: a label outside
    ``[0, k)`` raises, and the proof is void (code that catches the error holds a bit of example
    data, as for a kernel that fails on a value). Without ``num_classes`` the number of classes is
    the largest label plus one, a value of the batch read into Python: not proven. The check runs
    with the dispatch modes popped (it writes nothing): its own ``.item()`` is dpclip's, not the
    model's."""
    y = args[0] if args else kwargs.get("input", kwargs.get("tensor"))
    k = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
    if type(k) is not int and type(k).__module__ == "numpy" and hasattr(k, "dtype") and \
            k.dtype.kind in "iu" and k.ndim == 0:
        k = int(k)  # a NumPy integer (``np.int64(10)``): torch's parser takes it as an int
        args, kwargs = (args[:1] + (k,), kwargs) if len(args) > 1 else \
            (args, {**kwargs, "num_classes": k})
    if type(y) is not Tensor or y.dtype != torch.int64 or type(k) is not int or \
            len(args) + len(kwargs) > 2:
        return _ONE_HOT(*args, **kwargs)
    if k < 0:
        if tr.violation is None and tr.layout(y) is not None:
            tr.violation = ("F.one_hot without num_classes takes the number of classes from the "
                            "largest label, a value of the batch read into Python; pass "
                            "num_classes")
        return _ONE_HOT(*args, **kwargs)
    if y.numel():
        got = tr._written_mask(y) if tr._uninit_live else None
        if got is not None and not bool(got.all()) and tr.violation is None:
            # the check below runs outside the trace: labels in memory from torch.empty that
            # was never written would reach Python unseen (fifty-third hostile review)
            tr.violation = ("F.one_hot reads a tensor made by torch.empty (or empty_like, "
                            "new_empty) before it was written in full: uninitialised memory can "
                            "hold other examples' data")
        with _no_dispatch_modes(), _cm.no_grad():  # read-only, below the trace
            ok = bool(((y >= 0) & (y < k)).all())
        if not ok:
            # whatever the labels are (example data, a constant, uninitialised memory): code
            # that catches the error holds a bit the proof never saw (the fake tensors of the
            # proof never raise)
            if tr.violation is None:
                tr.violation = ("F.one_hot raised on a label outside [0, num_classes): whether it "
                                "fails can depend on values the trace does not show, and code "
                                "that catches the error carries them into Python; let such "
                                "errors propagate")
            raise RuntimeError("one_hot: class values must be in [0, num_classes)")
    index = torch.ops.aten.arange.default(k, dtype=y.dtype, layout=y.layout,
                                          device=y.device)  # as one_hot runs it
    return torch.eq(y.unsqueeze(-1), index).to(torch.int64)


#: torch's recurrent layers as ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` call them (``torch._VF``)
_FUSED_RNN = {torch.lstm: "LSTM", torch.gru: "GRU", torch.rnn_tanh: "RNN (tanh)",
              torch.rnn_relu: "RNN (relu)"}
_PLAIN_TYPES = (Tensor, torch.nn.Parameter)


def _fused_rnn(tr: "SeparabilityTracer", func: Any, args: tuple, kwargs: dict) -> Any:
    """``torch.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` (the ``input`` overload, as
    ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` call them), judged as ONE operation.

    On the CPU these reach the dispatcher decomposed: the input projection of every time step is
    one matrix product over the sequence and the batch flattened together (``(T, B, E) -> (T B,
    E)``), example ``i`` in rows ``t B + i``, which no ``(d, k)`` layout describes, so every
    recurrent layer read as MIXED. The operation itself is per example along its batch
    dimension: ``output[.., n, ..]``, ``h_n[:, n]`` and ``c_n[:, n]`` are functions of
    ``input[.., n, ..]``, ``h_0[:, n]``, ``c_0[:, n]`` and the weights alone (the recurrence runs
    along the time dimension; every product contracts the feature dimension; inter-layer dropout
    draws each element independently). So, with the input of layout ``(d, k)`` where ``d`` is the
    batch dimension the call names (0 for ``batch_first``, else 1), every initial state either of
    layout ``(1, k)`` or a constant that is the same for every example (zeros; checked on its
    values, :func:`_uniform_along`) and every weight constant, the outputs get ``(d, k)`` (the
    output sequence) and ``(1, k)`` (the final states). Anything else (the batch in the time
    dimension, so that the recurrence crosses the examples; an initial state taken from other
    examples, or a constant that differs by position; the packed ``data`` overload; a tensor
    subclass) is MIXED, and the reason is the first entry of :attr:`SeparabilityTracer.mixers`.

    The operation runs as usual under the dispatch mode (the proved-program match, the checks of
    uninitialised memory and of values read into Python all see its ATen operations); only the
    layouts of its intermediates, and the mixing they report, are replaced by this rule's verdict
    on its outputs."""
    from dpclip.engine.recurrent import RNN_OPS, as_cells, drops, recording

    name = _FUSED_RNN[func]
    n0 = len(tr.mixers)
    projections = None
    if _input_form(name, args, kwargs) and not drops(args):
        # torch's time-step cells, as the batch-size proof ran them (dpclip.engine.recurrent),
        # their projections recorded for the time-step rule (no operation of its own)
        with recording() as projections:
            out = as_cells(RNN_OPS[func], args)
    else:  # (a torch function under the function mode: torch._VF's, watched by torch_names)
        out = func(*args, **kwargs)
    ts = _tensors(args, kwargs)
    if all(tr.layout(t) is None for t in ts):
        return out  # constants in: the dispatch trace judged it (constant out)
    del tr.mixers[n0:]  # (the decomposition's flattened products: replaced by the verdict below)
    why = _fused_rnn_why(tr, name, args, kwargs, out)
    if why is not None and "engine 'naive'" not in why:
        from dpclip.engine.recurrent import FIX

        why = f"{why}; {FIX}"
    outs = list(out) if isinstance(out, tuple) else [out]
    if why is not None:
        for o in outs:
            if isinstance(o, Tensor):
                tr._layouts[o] = MIXED
        if len(tr.mixers) < 3:
            tr.mixers.insert(n0, why)
            del tr.mixers[3:]
        return out
    d, k = tr.layout(args[0])
    tr._layouts[outs[0]] = (d, k)
    for o in outs[1:]:
        tr._layouts[o] = (1, k)
    if projections is not None:
        tr.recurrent.append((outs[0], projections))
    return out


def _input_form(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a recurrent call is the ``input`` overload with its nine positional arguments
    (as nn.LSTM / nn.GRU / nn.RNN make it; not the packed ``data`` overload)."""
    return not kwargs and len(args) == 9 and isinstance(args[2], (list, tuple)) and \
        (name != "LSTM" or isinstance(args[1], (list, tuple))) and type(args[8]) is bool


def _fused_rnn_why(tr: "SeparabilityTracer", name: str, args: tuple, kwargs: dict,
                   out: Any) -> str | None:
    """Why a recurrent operation's outputs are not per example (:func:`_fused_rnn`), or None."""
    lstm = name == "LSTM"
    if not _input_form(name, args, kwargs):
        return (f"{name}: a call other than the (input, hx, params, ..., batch_first) form "
                "nn.LSTM / nn.GRU / nn.RNN make (a PackedSequence is not supported)")
    from dpclip.engine.recurrent import DROPOUT_REFUSED, drops, library_changed

    if drops(args):
        return f"{name}: {DROPOUT_REFUSED}"
    changed = library_changed()
    if changed is not None:  # the code that computed it is not the decomposition trusted here
        return f"{name}: {changed}"
    x, hx, params = args[0], args[1], args[2]
    hxs = list(hx) if lstm else [hx]
    outs = list(out) if isinstance(out, tuple) else [out]
    every = [x] + hxs + list(params) + outs
    if any(type(t) not in _PLAIN_TYPES for t in every) or len(outs) != len(hxs) + 1:
        return f"{name}: an argument or result that is not a plain tensor"
    d = 0 if args[8] else 1
    lay = tr.layout(x)
    if lay is None or lay is MIXED or x.ndim != 3 or lay[0] != d or \
            x.shape[d] != tr.batch * lay[1]:
        where = "dimension 0" if d == 0 else "dimension 1 (batch_first=False)"
        return (f"{name} on an input whose batch layout is {lay!r} where the layer reads its "
                f"batch from {where}: the recurrence would run across the examples, or the "
                "input already mixes them")
    k = lay[1]
    for h in hxs:
        lh = tr.layout(h)
        if h.ndim != 3 or h.shape[1] != tr.batch * k:
            return f"{name}: an initial state without the batch in dimension 1"
        if lh is None:
            if not _uniform_along(tr, h, 1, k, tr.batch):
                return (f"{name}: a constant initial state that differs from one example's "
                        "position in the batch to the next (give every example the same "
                        "state, e.g. zeros)")
        elif lh != (1, k):
            return (f"{name}: an initial state of batch layout {lh!r}, not (1, {k}) (a state "
                    "taken from other examples, or one that mixes them)")
    if any(tr.layout(p) is not None for p in params):
        return f"{name}: a weight computed from the batch"
    for o, dd in zip(outs, [d] + [1] * len(hxs)):
        if o.ndim != 3 or o.shape[dd] != tr.batch * k:
            return f"{name}: a result without the batch where the layer puts it"
    return None


_K_PLAIN, _K_HOOK, _K_ESCAPE = 0, 1, 2
#: the kind of each function seen by the escape mode (functions and property getters are
#: hashable; computed once per function: the checks below read several attributes)
_KINDS: dict[Any, int] = {}


def _func_kind(func: Any) -> int:
    try:
        kind = _KINDS.get(func)
    except TypeError:  # an unhashable callable: classify it every time
        kind = None
    if kind is None:
        kind = _K_HOOK if func in _HOOKS or getattr(func, "__wrapped__", None) in _HOOKS else _K_ESCAPE if (
            func in _ESCAPES or _is_get(func, "grad_fn") or _is_get(func, "data") or
            _is_get(func, "data", "__set__")) else _K_PLAIN
        try:
            if len(_KINDS) >= 4096:  # functions made per call (a class defined in forward)
                _KINDS.clear()
            _KINDS[func] = kind
        except TypeError:
            pass
    return kind


def _is_get(func: Any, attr: str, how: str = "__get__") -> bool:
    """Whether ``func`` is the getter (``how="__set__"``: the setter) of the Tensor property
    ``attr`` (``t.grad_fn``, ``t.data``; ``t.data = x`` swaps the tensor's memory without a
    version bump: refused like the getter)."""
    return getattr(func, "__name__", "") == how and \
        getattr(getattr(func, "__self__", None), "__name__", "") == attr


class SeparabilityTracer(TorchDispatchMode):
    """Tracks the layout of every tensor of a forward pass over a batch of ``batch`` examples.

    Use as a context manager around the forward and the loss; :meth:`mark` the inputs and targets
    first (layout ``(0, 1)``), then read :meth:`layout` of the tensors that must be separable and
    :attr:`violation` (a reason, or None)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # the tracer never runs under torch.compile: no torch._disable_dynamo wrapper around
        # __torch_dispatch__ (its per-operation cost was about a fifth of the trace's)
        return False

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch = batch
        self._layouts: _IdMap = _IdMap()
        self._taint: dict[int, int] = {}  # storage data_ptr -> id of the tensor allowed to read it
        #: storage data_ptr -> ids of the views made, AFTER the write that tainted it, from a
        #: tensor allowed to read it: their layouts were derived from its current one
        self._readers: dict[int, set[int]] = {}
        self._mixed_in_place: set[int] = set()  # storages an in-place write made MIXED
        self.violation: str | None = None
        #: whether a tensor an earlier traced call retired was read (a batch reads it as MIXED)
        self.stale_read = False
        #: the operations that first turned row-separable inputs into a MIXED result (for the
        #: error message), in order, at most a few
        self.mixers: list[str] = []
        #: True while the engine's own code runs inside the traced block (its hooks): the Python
        #: escape checks are paused there
        self.quiet = False
        self._escape = _EscapeMode(self)
        self._random: _IdMap = _IdMap()
        self._seen: _IdMap = _IdMap()  # outputs of traced ops
        #: > 0 while this mode's own handler runs an operation's kernel: an ATen operation that
        #: reaches the torch-function mode from there (vmap's ``_remove_batch_dim`` moving the
        #: examples' dimension of a result: a permute issued from C++ below the dispatch mode)
        #: returns to this handler, which records and judges its output itself
        self._kernel_depth = 0
        self._uninit: _IdMap = _IdMap()  # tensor -> id of its base
        #: base id -> (mask of the elements of its storage written so far, element size)
        self._uninit_live: dict[int, tuple[Tensor | None, int]] = {}
        #: storages allocated during the trace (data pointers): batch data written in place into
        #: any other storage (a parameter, buffer, attribute, global) would outlive the step
        self._born: set[int] = set()
        #: the program the batch-size proof ran, matched op by op against this run
        #: (:class:`dpclip.engine.proved_program.ProgramMatch`), or None
        self.match: Any = None
        #: ``[(output sequence, projections)]`` of the accepted recurrent operations
        #: (:func:`_fused_rnn`, :func:`dpclip.engine.recurrent.recording`), taken by the module
        #: call that made each (``ghost_rules._init_module_call``): the time-step rule
        self.recurrent: list[tuple[Tensor, list]] = []
        #: the compiled engine's analysis of a fixed graph (dpclip.engine.compiled), which runs
        #: once for every later step: no verdict may read a value (the values of later steps
        #: differ). ``None`` on a traced step; else ``(uniform, identity)``: ids of the constants
        #: the graph proves the same for every example, and id -> the dimension along which a
        #: constant is ``arange(B)`` by the graph's construction
        self.structural: tuple[set[int], dict[int, int]] | None = None
        self._structural_keep: list[Tensor] = []  # (what the structural set names, alive)

    def __enter__(self) -> "SeparabilityTracer":
        super().__enter__()
        self._escape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._escape.__exit__(*exc)
        super().__exit__(*exc)

    # ------------------------------------------------------------------------------ layouts

    def mark(self, t: Tensor, layout: Layout) -> None:
        self._layouts[t] = layout
        self._born_storage(t)

    def _born_storage(self, t: Tensor) -> None:
        try:
            ptr = t.untyped_storage().data_ptr()
        except Exception:  # noqa: BLE001 - no storage: nothing can be written into it
            return
        if ptr:
            self._born.add(ptr)
            self._mixed_in_place.discard(ptr)  # (a new storage at a freed one's address)

    def retire(self) -> None:
        """End of the traced call: every tensor that depends on the batch and is still alive is
        remembered (weakly) as data of a past batch, MIXED in every later trace."""
        _STALE.items()  # drop the entries of tensors that died since
        self.recurrent = []
        for t, lay in self._layouts.items():
            if lay is not None:
                _STALE[t] = True

    def layout(self, t: Tensor) -> Layout:
        """The layout of ``t`` (``None``: constant). A tensor that depended on the batch in an
        EARLIER traced call (kept in a closure, a global or a module attribute) reads as MIXED: it
        carries other examples into this batch. A :class:`Folded` layout reads as MIXED here:
        only the rules written for it read it (:meth:`raw_layout`)."""
        lay = self.raw_layout(t)
        return MIXED if type(lay) is Folded else lay

    def raw_layout(self, t: Tensor) -> Layout:
        """:meth:`layout`, with a :class:`Folded` layout as it is (for the rules written for it)."""
        lay = self._layouts.get(t)
        if lay is None and t in _STALE:
            self.stale_read = True
            return MIXED
        if self._taint:
            try:
                ptr = t.untyped_storage().data_ptr()
            except Exception:  # noqa: BLE001 - tensors without storage: be conservative
                # but for torch.func's wrappers (vmap's batched, vjp's grad-tracking tensors,
                # seen by the Python-level checks only): the dispatch level sees the tensors they
                # wrap, storages and taint included, and tracks the layouts there; a wrapper has
                # none of its own (a taint left by a replay's in-place write made every wrapper
                # read as MIXED, so every view of one looked computed outside the trace)
                return lay if _is_wrapper(t) else MIXED
            owner = self._taint.get(ptr)
            if owner is not None and owner != ident(t) and \
                    ident(t) not in self._readers.get(ptr, ()):
                return MIXED
        return lay

    def _fit(self, lay: Layout, t: Any) -> Layout:
        """``lay`` if it is a valid layout for tensor ``t``, else MIXED."""
        if lay is None or lay is MIXED:
            return lay
        d, k, o = _parts(lay)
        if not isinstance(t, Tensor) or t.ndim <= d or t.shape[d] != o * self.batch * k:
            return MIXED
        return lay

    # ------------------------------------------------------------------------------ dispatch

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.quiet and self.violation is None:
            if func.overloadpacket in _CONVOLUTIONS and conv_backends_moved():
                self.violation = MOVED  # (a backend the engine fixed switched on by the forward)
            elif threads_moved():  # (the thread count the engine fixed, raised by the forward)
                self.violation = THREADS_MOVED
            elif numerics_moved():  # (a setting that chooses how a kernel rounds, for this op)
                self.violation = NUMERICS_MOVED
            elif python_dispatcher_on():
                self.violation = PY_DISPATCHER
        if types and not self.quiet and self.violation is None:
            # ``types`` lists argument types that take part in Python dispatch; one with its own
            # __torch_dispatch__ runs Python below this mode, out of the trace's sight (and can
            # tell fakes from real tensors), so nothing the call computes is proven
            own = sorted(t.__name__ for t in types
                         if getattr(t, "__torch_dispatch__", None) is not _PLAIN_DISPATCH)
            if own:
                self.violation = (f"a tensor subclass with its own __torch_dispatch__ "
                                  f"({', '.join(own)}) is an argument of {_name(func)}: its "
                                  "code runs below the trace and cannot be checked")
        if not self.quiet and self.match is not None:  # before: memory, generators, kernels
            self.quiet = True
            try:
                self.match.before(func, args, kwargs)
            finally:
                self.quiet = False
        before = self._constant_self(func, args, kwargs)
        self._kernel_depth += 1
        try:
            out = call_op(func, args, kwargs)
        except Exception as exc:
            # whether a kernel fails can depend on values (an index out of range,
            # aten._assert_async): code that catches the error has a bit of example data in
            # Python, which no layout shows (twenty-eighth hostile review: carried to the next
            # step, 2.39 C)
            if not self.quiet and self.violation is None and any(
                    self.layout(t) is not None for t in _tensors(args, kwargs)):
                self.violation = (f"the operation {_name(func)} raised {type(exc).__name__} on a "
                                  "tensor that depends on the batch: whether it fails can depend "
                                  "on one example's values, and code that catches the error "
                                  "carries them into Python; let such errors propagate")
            raise
        finally:
            self._kernel_depth -= 1
        quiet, self.quiet = self.quiet, True
        try:
            if not quiet and self.match is not None:  # user code: the proved program's next op
                self.match.step(func, args, kwargs, out)
            return self._dispatch(func, args, kwargs, out, before)
        finally:
            self.quiet = quiet

    def _structural_uniform(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """The compiled engine's analysis (:attr:`structural`): a constant that an elementwise
        operation (or a copy keeping every element in place, an expand, an unsqueeze) makes
        from constants that are each uniform (the same along every dimension that involves the
        batch: in the structural set, or stride 0 there) or free of the batch (no dimension whose
        size is a multiple of it: at the analysis's prime batch sizes only the batch symbol makes
        such a size) is uniform too: each of its elements reads the same elements of its operands
        for every example. Such an operation inside a kernel's decomposition (SDPA's boolean mask
        turned into an additive one) keeps the graph's uniform mask uniform. Kept alive with the
        tracer (the set holds ids)."""
        if not isinstance(out, Tensor) or not (
                torch.Tag.pointwise in func.tags or func.overloadpacket in _UNIFORM_KEEPERS):
            return
        uni = self.structural[0]  # type: ignore[index]
        b = self.batch
        some = False
        for t in _tensors(args, kwargs):
            if ident(t) in uni:
                some = True
                continue
            spans = [d for d, n in enumerate(t.shape) if n and n % b == 0]
            if not spans:
                continue
            if any(t.stride(d) != 0 for d in spans):
                return
            some = True  # (an expand along every batch dimension: one row seen B times)
        if some:
            uni.add(ident(out))
            self._structural_keep.append(out)

    def _constant_self(self, func: Any, args: tuple, kwargs: dict) -> Tensor | None:
        """A copy of ``args[0]`` as it is BEFORE an in-place elementwise operation writes it, when
        it is a constant and another argument is batch data (``zeros.masked_fill_(pad, -inf)``:
        ``nn.MultiheadAttention``'s key padding mask). The rule reads the copy in its place: it
        judges the values the operation combined with the examples (the same for every example,
        or not), not the result, which the write has already made depend on them (and the rule,
        reading that, took every such write for a position dependence). Not for operations that
        overwrite every element (their rules do not read the old values) nor for a fresh i.i.d.
        draw (its rule checks the draw itself). Made with the trace paused, no gradient."""
        if not args or not isinstance(args[0], Tensor):
            return None
        meta = _meta(func)
        if not meta.mutable or meta.full_write or meta.rule is not _pointwise or \
                not meta.writes or meta.writes[0][0] != 0 or len(meta.writes) != 1:
            return None
        t = args[0]
        if self.layout(t) is not None or self.iid_random(t) or \
                not any(self.layout(a) is not None for a in _tensors(args[1:], kwargs)):
            return None
        quiet, self.quiet = self.quiet, True
        try:
            with _no_dispatch_modes(), _cm.no_grad():
                return t.clone()
        finally:
            self.quiet = quiet

    def _dispatch(self, func: Any, args: tuple, kwargs: dict, out: Any,
                  before: Tensor | None = None) -> Any:
        layouts = self._layouts
        any_data = False
        for a in args:
            if isinstance(a, Tensor):
                if a in layouts or self._taint or a in _STALE:
                    if self.layout(a) is not None:
                        any_data = True
                        break
            elif isinstance(a, (list, tuple)):
                for x in a:
                    if isinstance(x, Tensor) and self.layout(x) is not None:
                        any_data = True
                        break
                if any_data:
                    break
        if not any_data:
            for v in kwargs.values():
                if isinstance(v, Tensor) and self.layout(v) is not None:
                    any_data = True
                    break
        meta = _meta(func)
        mutable = meta.mutable
        if self._uninit_live or meta.uninit:
            self._check_uninit(func, meta, args, kwargs, out)
        if any_data and foreign_saved_tensor_hooks() is not None and self.violation is None:
            self.violation = ("saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks, "
                              "non-reentrant checkpointing) are active: the tensors that the "
                              "backward pass reads are rewritten by user code the trace cannot "
                              "see")
        seen = self._seen
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(o, Tensor):
                seen[o] = True
                if meta.fresh and not mutable:  # an in-place op or a view: not a new storage
                    self._born_storage(o)
        if not any_data:
            self._note_random(func, meta, args, kwargs, out)
            if self.structural is not None and not mutable:
                self._structural_uniform(func, args, kwargs, out)
            if not mutable:
                return out  # constants in, constants out
        if any_data and meta.data_dep:
            if self.violation is None:
                self.violation = (f"the operation {_name(func)} reads values of a tensor that "
                                  "depends on the batch into Python (e.g. .item(), bool(t), "
                                  "nonzero): such a value can carry one example into every "
                                  "other's computation")
        if any_data:
            rule = meta.rule
            try:
                # (an in-place write of a constant: its old values, _constant_self)
                got = args if before is None else (before,) + tuple(args[1:])
                lay = rule(self, func, got, kwargs, out) if rule is not None else MIXED
            except Exception:  # noqa: BLE001 - a rule that cannot read the call: conservative
                lay = MIXED
        else:
            lay = None
        if (lay is MIXED or (isinstance(lay, _PerOutput) and MIXED in lay)) and \
                len(self.mixers) < 3 and out is not None:  # (an assertion returns nothing)
            ins = [self.raw_layout(t) for t in _tensors(args, kwargs)]
            if not any(x is MIXED for x in ins):
                # ranks, not shapes: a shape would show the realised batch size (private)
                self.mixers.append(f"{_name(func)} on inputs of ranks "
                                   f"{[t.ndim for t in _tensors(args, kwargs)]} with "
                                   f"batch layouts {ins}")
        outs = out if isinstance(out, (tuple, list)) else (out,)
        per_out = isinstance(lay, _PerOutput)
        if per_out and (mutable or len(lay) != len(outs)):
            lay = MIXED
            per_out = False
        if mutable:
            self._mutated(func, args, kwargs, lay)
        elif self._taint and not meta.fresh and args and isinstance(args[0], Tensor):
            self._new_views(args[0], outs)
        for j, o in enumerate(outs):
            if isinstance(o, Tensor):
                new = self._fit(lay[j] if per_out else lay, o)
                if mutable and any(o is w for w in self._written(func, args, kwargs)):
                    continue  # handled by _mutated
                if new is None:
                    if o in layouts:
                        del layouts[o]
                else:
                    layouts[o] = new
            elif any_data and o is not None and not isinstance(o, (tuple, list)) \
                    and _name(func) not in _METADATA:
                if self.violation is None:
                    self.violation = (f"the operation {_name(func)} returns a Python value "
                                      "computed from batch data")
        return out

    def _new_views(self, base: Tensor, outs: tuple) -> None:
        """Views of ``base`` made after an in-place write tainted its storage (so that the views
        made BEFORE the write, whose layouts are stale, read as MIXED): when ``base`` itself may
        read the storage, the new views' layouts were derived by their rules from its current
        layout, and they may read it too (``zeros.masked_fill_(pad, -inf).view(B, 1, 1, S)``)."""
        try:
            ptr = base.untyped_storage().data_ptr()
        except Exception:  # noqa: BLE001 - no storage: nothing to allow
            return
        owner = self._taint.get(ptr)
        if owner is None or (owner != ident(base) and
                             ident(base) not in self._readers.get(ptr, ())):
            return
        for o in outs:
            if isinstance(o, Tensor):
                try:
                    same = o.untyped_storage().data_ptr() == ptr
                except Exception:  # noqa: BLE001
                    same = False
                if same:
                    self._readers.setdefault(ptr, set()).add(ident(o))

    def _note_random(self, func: Any, meta: "_Meta", args: tuple, kwargs: dict,
                     out: Any) -> None:
        """Record fresh i.i.d. random draws (a dropout mask: ``empty_like(x).bernoulli_(p)``,
        ``rand``, ``randn``) and elementwise functions of them with scalars: every element is drawn
        independently with the same distribution, whatever its position, so pairing row ``i`` of
        such a tensor with example ``i`` is not a position dependence (each example gets its own
        independent draw, as under vmap). Anything else made from them is an ordinary constant."""
        if meta.random:
            targets = self._written(func, args, kwargs) if meta.mutable else []
            if not targets:
                targets = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                           if isinstance(o, Tensor)]
            for t in targets:
                self._random[t] = True
        elif meta.keeps_iid:
            ts = _tensors(args, kwargs)
            if ts and all(t in self._random for t in ts):
                if meta.mutable:
                    return  # in place, e.g. mask.div_(1 - p): still the same i.i.d. tensor
                for o in (out if isinstance(out, (tuple, list)) else (out,)):
                    if isinstance(o, Tensor):
                        self._random[o] = True
            elif meta.mutable:
                for t in self._written(func, args, kwargs):
                    self._random.pop(t, None)
        elif meta.mutable:
            for t in self._written(func, args, kwargs):
                self._random.pop(t, None)

    def _check_uninit(self, func: Any, meta: "_Meta", args: tuple, kwargs: dict,
                      out: Any) -> None:
        """``torch.empty`` and friends return memory that was not written: it may hold freed
        activations of other examples. Every element of such a tensor must be written (by
        ``fill_``, ``copy_``, ``bernoulli_`` ... of it or of views of it, piece by piece as
        circular padding does) before it is read; the written elements are tracked exactly (a mask
        over the base), and reading an element not yet written is a violation."""
        uninit = self._uninit
        live = self._uninit_live
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(o, Tensor)]
        if meta.uninit:
            for o in outs:
                if o.numel():
                    uninit[o] = ident(o)
                    live[ident(o)] = (None, o.element_size())  # mask made when first needed
            return
        if func in _SHAPE_ONLY:  # reads its input's shape and dtype, never its values
            return
        ins = _tensors(args, kwargs)
        if func is _aten.convolution_backward.default:
            # only the weight's gradient (and the bias's) asked for: the weight argument gives its
            # shape alone; only the input's: the input argument gives its shape alone (vmap's
            # batching rules pass ``new_empty([]).expand(...)`` there)
            shape_only = _conv_shape_only(args, kwargs)
            if shape_only is not None:
                ins = [t for t in ins if t is not shape_only]
        pending = [t for t in ins if uninit.get(t) in live]
        if not pending:
            return
        if func.overloadpacket in _VIEWS:
            base = uninit[pending[0]]
            for o in outs:
                uninit[o] = base
            return
        written = self._written(func, args, kwargs) if meta.mutable else []
        if func.overloadpacket is _aten.copy_ and len(args) > 1 and isinstance(args[1], Tensor):
            self._copy_uninit(args[0], args[1])  # element by element: unwritten stays unwritten
            return
        for t in pending:
            base = uninit[t]
            if base not in live:  # completed by an earlier argument of this op
                continue
            mask, size = live[base]
            if meta.full_write and mask is None and any(t is w for w in written) and \
                    t.element_size() == size and t.storage_offset() == 0 and \
                    t.is_contiguous() and t.numel() * size == t.untyped_storage().nbytes():
                del live[base]  # the first write covers the whole storage (a dropout mask)
                continue
            mask = self._live_mask(base, t)
            idx = _elements(t, mask.numel(), size)
            if meta.full_write and any(t is w for w in written):
                if idx is not None:
                    mask[idx] = True
                    if bool(mask.all()):
                        del live[base]
                continue
            if (idx is None or not bool(mask[idx].all())) and self.violation is None:
                self.violation = (f"{_name(func)} reads a tensor made by torch.empty (or "
                                  "empty_like, new_empty) before it was written in full: "
                                  "uninitialised memory can hold other examples' data")

    def _live_mask(self, base: int, t: Tensor) -> Tensor:
        """The written-elements mask of uninitialised base ``base`` (made on first use: all False,
        one entry per element of the base's storage, which ``t``, a view of it, shares)."""
        mask, size = self._uninit_live[base]
        if mask is None:
            mask = torch.zeros(t.untyped_storage().nbytes() // size, dtype=torch.bool)
            self._uninit_live[base] = (mask, size)
        return mask

    def _written_mask(self, t: Tensor) -> Tensor | None:
        """Per element of ``t`` (its shape): written yet? None when ``t`` is fully written."""
        base = self._uninit.get(t)
        if base not in self._uninit_live:
            return None
        size = self._uninit_live[base][1]
        mask = self._live_mask(base, t)
        idx = _elements(t, mask.numel(), size)
        if idx is None:
            return torch.zeros(t.shape, dtype=torch.bool)
        return mask[idx].view(t.shape)

    def _copy_uninit(self, dst: Tensor, src: Tensor) -> None:
        """``dst.copy_(src)``: dst's elements become written where the (broadcast) source element
        was written (circular padding copies from the padded tensor into itself)."""
        got = self._written_mask(src)
        src_ok = torch.ones(dst.shape, dtype=torch.bool) if got is None else \
            got.expand(dst.shape)
        base = self._uninit.get(dst)
        if base not in self._uninit_live:
            if got is not None and not bool(src_ok.all()) and self.violation is None:
                self.violation = ("copy_ reads a tensor made by torch.empty (or empty_like, "
                                  "new_empty) before it was written in full: uninitialised "
                                  "memory can hold other examples' data")
            return
        size = self._uninit_live[base][1]
        mask = self._live_mask(base, dst)
        idx = _elements(dst, mask.numel(), size)
        if idx is None:
            return
        mask[idx] = src_ok.reshape(-1)
        if bool(mask.all()):
            del self._uninit_live[base]

    def iid_random(self, t: Tensor) -> bool:
        """Whether ``t`` is a fresh i.i.d. random draw (see :meth:`_note_random`)."""
        return t in self._random

    def _written(self, func: Any, args: tuple, kwargs: dict) -> list[Tensor]:
        got = []
        for i, name in _meta(func).writes:
            if True:
                v = args[i] if i < len(args) else kwargs.get(name)
                if isinstance(v, Tensor):
                    got.append(v)
                elif isinstance(v, (list, tuple)):
                    got.extend(x for x in v if isinstance(x, Tensor))
        return got

    def _mutated(self, func: Any, args: tuple, kwargs: dict, lay: Layout) -> None:
        """An in-place / out= write: the written tensor takes the result's layout; if that changes
        its layout, every other view of its storage reads as MIXED from now on."""
        for t in self._written(func, args, kwargs):
            old = self.raw_layout(t)
            new = self._fit(lay, t)
            if new is not None and new is not MIXED and _overlapping(t):
                # (a write into memory its own elements share, e.g. a constant expanded to the
                # batch (stride 0): every example's value lands in one row, the last or an OR of
                # them: hundred-and-thirteenth hostile review, masked_fill_ of an expanded zeros,
                # LOO 3.46 C under ghost, auto and compiled)
                new = MIXED
            if new is not None and self.violation is None:
                try:
                    ptr = t.untyped_storage().data_ptr()
                except Exception:  # noqa: BLE001
                    ptr = -1
                if ptr and ptr not in self._born:
                    self.violation = (
                        f"the in-place operation {_name(func)} writes batch data into a tensor "
                        "that existed before the forward pass (a parameter, buffer, module "
                        "attribute or global): it would carry private data out of the step, or "
                        "into the next one")
            if new == old and new is not MIXED:
                continue
            # (a MIXED result written through a view that already read MIXED, e.g. f[H:] of a
            # flat view of a (B, H) tensor, changes the rows of the storage's other views all the
            # same: the storage is tainted below; skipped before, the base kept its layout (0, 1)
            # while each row held others' data: hundred-and-seventeenth hostile review, 2.05 to
            # 4.72 C under ghost and auto)
            if new is MIXED:  # (read by the ghost engine: rewritten_to_mix)
                try:
                    self._mixed_in_place.add(t.untyped_storage().data_ptr())
                except Exception:  # noqa: BLE001
                    pass
            if new is None:
                self._layouts.pop(t, None)
            else:
                self._layouts[t] = new
            try:
                ptr = t.untyped_storage().data_ptr()
                self._taint[ptr] = ident(t)
                self._readers.pop(ptr, None)  # views made before this write: stale layouts
            except Exception:  # noqa: BLE001
                if self.violation is None:
                    self.violation = f"in-place {_name(func)} on a tensor without storage"


    def rewritten_to_mix(self, t: Any) -> bool:
        """Whether an in-place write this trace saw turned a tensor of ``t``'s storage from
        separable (or constant) to MIXED: what the ghost engine checks on a ruled layer's output
        before marking it ``(0, 1)`` for what the layer's own forward computes (a trace function
        at the forward's return rewriting it with its batch mean: LOO 2.00 C before)."""
        if not isinstance(t, Tensor) or not self._mixed_in_place:
            return False
        try:
            return t.untyped_storage().data_ptr() in self._mixed_in_place
        except Exception:  # noqa: BLE001
            return False


def _overlapping(t: Any) -> bool:
    """Whether some elements of ``t`` may share memory: torch's internal-overlap test, and where
    it cannot tell (a strided view such as ``h[:, :3]``), the dimensions by increasing stride,
    each stride beyond the last offset the smaller ones reach (else overlapping). A symbolic
    size or stride is not compared (a comparison would guard the proof's batch symbol): such a
    tensor overlaps only where a dimension of more than one element has stride 0 (an expand)."""
    if not isinstance(t, Tensor):
        return False
    try:
        got = _HAS_INTERNAL_OVERLAP(t)
    except Exception:  # noqa: BLE001
        got = 2
    if got != 2:
        return got == 1
    try:
        dims = [(st, sz) for sz, st in zip(t.shape, t.stride())]
    except Exception:  # noqa: BLE001
        return True
    if not all(type(st) is int and type(sz) is int for st, sz in dims):
        return any(type(st) is int and st == 0 and not (type(sz) is int and sz <= 1)
                   for st, sz in dims)
    reach = 0
    for st, sz in sorted(d for d in dims if d[1] > 1):
        if st <= reach:
            return True
        reach += (sz - 1) * st
    return False


#: torch's C test, bound at import (0: no overlap, 1: overlap, 2: too hard to tell)
_HAS_INTERNAL_OVERLAP = torch._debug_has_internal_overlap


# ----------------------------------------------------------------------------------- rules

Rule = Callable[[SeparabilityTracer, Any, tuple, dict, Any], Layout]


def _tensors(args: tuple, kwargs: dict) -> list[Tensor]:
    ts = []
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, Tensor):
            ts.append(a)
        elif isinstance(a, (list, tuple)):
            ts.extend(x for x in a if isinstance(x, Tensor))
    return ts


def _first_out(out: Any) -> Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _broadcast_join(tr: SeparabilityTracer, tensors: list[Tensor], shape: tuple[int, ...]) -> Layout:
    """Layout of a broadcasting elementwise result of ``shape`` from ``tensors``.

    A constant operand that spans the batch dimension of the result (size ``B k`` there, not 1)
    pairs row ``i`` of the examples with its own row ``i``: that is a function of the example's
    POSITION in the batch (``x + pe[:x.size(0)]``, ``h * arange(B)``), and positions shift when one
    example is added or removed. It is accepted only when its values are the same in every block
    along that dimension (an ``expand`` of one row, ``ones``): checked on the values, which are
    public (they do not depend on the examples)."""
    res: Layout = None
    nd = len(shape)
    consts = []
    for t in tensors:
        lay = tr.raw_layout(t)  # elementwise: a Folded batch dimension stays as it is
        if lay is None:
            consts.append(t)
            continue
        if lay is MIXED:
            return MIXED
        d, k, o = _parts(lay)
        dd = d + nd - t.ndim
        if dd < 0 or t.shape[d] != shape[dd] or shape[dd] != o * tr.batch * k:
            return MIXED
        if res is None:
            res = _of(dd, k, o)
        elif res != _of(dd, k, o):
            return MIXED
    if res is not None:
        rd, rk, ro = _parts(res)
        for t in consts:
            if not _uniform_along(tr, t, rd + t.ndim - nd, rk, tr.batch, ro):
                if len(tr.mixers) < 3:
                    tr.mixers.append(f"a constant of rank {t.ndim} that differs from one "
                                     "example's position in the batch to the next, combined "
                                     "with the examples row by row")
                return MIXED
    return res


def _uniform_along(tr: "SeparabilityTracer", t: Tensor, d: int, k: int, batch: int,
                   o: int = 1) -> bool:
    """Whether constant ``t``, broadcast so that its dimension ``d`` meets a batch dimension of
    ``batch`` blocks of ``k`` (``o`` times over: a :class:`Folded` dimension), is the same in every
    example's block (``d < 0`` or size 1: broadcast, yes), or a fresh i.i.d. random draw (a
    dropout mask: every example gets its own independent draw). With ``o > 1`` it may differ from
    one outer slab to the next (a position ``t`` of ``(T B, E)``), not from one example to the
    next within a slab."""
    if d < 0 or t.shape[d] == 1:
        return True
    if tr.iid_random(t):
        return True
    if t.shape[d] != o * batch * k:
        return False
    if t.stride(d) == 0:  # an expand: one row seen B times
        return True
    if tr.structural is not None:  # (a fixed graph's analysis: by construction, never by value)
        return ident(t) in tr.structural[0]
    blocks = t.unflatten(d, (o, batch, k))
    e = d + 1  # the examples' dimension
    if not torch.equal(blocks, blocks.narrow(e, 0, 1).expand_as(blocks)):
        return False
    if blocks.is_floating_point():
        # and the signs: -0.0 == 0.0 for torch.equal, but not for atan2, copysign or signbit
        # (thirty-first hostile review: rows differing in the sign of zero, 7.87 C)
        signs = torch.signbit(blocks)
        return bool(torch.equal(signs, signs.narrow(e, 0, 1).expand_as(signs)))
    return True


#: (for the engine's checks of constants that reach a layer)
uniform_along = _uniform_along


def _pointwise(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    o = _first_out(out)
    return _broadcast_join(tr, _tensors(args, kwargs), tuple(o.shape))


def _copy_of(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    """Copies and casts that keep every element where it is (``clone``, ``contiguous``,
    ``_to_copy``, ``detach``, ``alias``, ``native_dropout``: elementwise with an i.i.d. mask): the
    input's layout, a :class:`Folded` one included; every other tensor argument constant."""
    lay = tr.raw_layout(args[0])
    for t in _tensors(args[1:], kwargs):
        if tr.layout(t) is not None:
            return MIXED
    return lay


def _same(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    """Unary ops whose output has the input's shape element for element (copies, casts, dropout)."""
    lay = tr.layout(args[0])
    for t in _tensors(args[1:], kwargs):
        if tr.layout(t) is not None:
            return MIXED
    return lay


def _dims(dim: Any, ndim: int) -> list[int] | None:
    if dim is None:
        return None
    if isinstance(dim, int):
        dim = [dim]
    return [x % ndim if ndim else 0 for x in dim]


def _reduction(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    x = args[0]
    lay = _same(tr, None, args, kwargs, None)  # the first argument; the others constant
    if lay is None or lay is MIXED:
        return lay
    d, k = lay
    dims = _dims(_arg(func, args, kwargs, "dim"), x.ndim)
    if not dims:  # None or []: every dimension
        return MIXED
    if d in dims:
        return MIXED
    if _arg(func, args, kwargs, "keepdim", False):
        return lay
    return (d - sum(1 for x_ in set(dims) if x_ < d), k)


def _along_dim(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    """Ops that work along one dimension and keep the others (softmax, cumsum, sort, flip, roll)."""
    x = args[0]
    lay = _same(tr, None, args, kwargs, None)  # the first argument; the others constant
    if lay is None or lay is MIXED:
        return lay
    dims = None
    for name in ("dim", "dims"):
        v = _arg(func, args, kwargs, name, "absent")
        if v != "absent":
            dims = _dims(v, x.ndim)
            break
    if not dims or lay[0] in dims:
        return MIXED
    return lay


def _softmax_backward(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict,
                      out: Any) -> Layout:
    """``_softmax_backward_data(grad, output, dim, dtype)`` (and the log-softmax one): elementwise
    in its two tensors but for a sum along ``dim`` (``output (grad - sum(grad output, dim))``):
    per example when both carry the batch in the same layout, or one is a constant that is the same
    for every example, and ``dim`` is not the batch dimension."""
    o = _first_out(out)
    lay = _broadcast_join(tr, [args[0], args[1]], tuple(o.shape))
    if lay is None or lay is MIXED:
        return lay
    if type(lay) is Folded or args[2] % o.ndim == lay[0]:
        return MIXED
    return lay


def _reshape(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    """A view or reshape (row-major element order, whatever the strides). In row-major order the
    input's elements are ``outer x B x block``: ``outer = prod(shape[:d]) o`` slabs, each holding
    the ``B`` examples' blocks of ``block = k prod(shape[d + 1:])`` consecutive elements, in order
    (layout ``(d, k)``, or ``Folded(d, k, o)``). The output keeps them as ``(e, k')`` when its
    dimension ``e`` starts a slab (``prod(new[:e]) == outer``) and splits into ``B`` blocks of
    ``k' prod(new[e + 1:]) == block`` elements; as ``Folded(e, k', o')`` when ``e`` holds ``o'``
    slabs of ``B`` such blocks (``prod(new[:e]) o' == outer``: flattening ``(T, B, E)`` to
    ``(T B, E)``). Index ``a B k' + i k' + j`` of ``e``, at any other indices, is then flat
    element ``(p o' + a) B block + i block + (j rest + r)``: example ``i``'s, and nothing else."""
    x = args[0]
    lay = tr.raw_layout(x)
    if lay is None or lay is MIXED:
        return lay
    d, k, o = _parts(lay)
    old = list(x.shape)
    new = list(_first_out(out).shape)
    outer = math.prod(old[:d]) * o
    block = k * math.prod(old[d + 1:])  # contiguous (row-major) elements of one example block
    acc = 1
    for e, size in enumerate(new):
        if acc == outer and size % tr.batch == 0:
            kk = size // tr.batch
            if kk * math.prod(new[e + 1:]) == block:
                return (e, kk)
        elif acc and outer and block and outer % acc == 0 and \
                size % (outer // acc * tr.batch) == 0:
            oo = outer // acc
            kk = size // (oo * tr.batch)
            if kk * math.prod(new[e + 1:]) == block:
                return Folded(e, kk, oo)
        acc *= size
        if acc > outer:
            break
    return MIXED


def _expand(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    x = args[0]
    lay = tr.layout(x)
    if lay is None or lay is MIXED:
        return lay
    d, k = lay
    o = _first_out(out)
    dd = d + o.ndim - x.ndim
    return (dd, k) if o.shape[dd] == x.shape[d] else MIXED


def _permute(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    x = args[0]
    lay = tr.layout(x)
    if lay is None or lay is MIXED:
        return lay
    dims = [p % x.ndim for p in args[1]]
    return (dims.index(lay[0]), lay[1])


def _transpose(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    x = args[0]
    lay = tr.layout(x)
    if lay is None or lay is MIXED:
        return lay
    if _name(func) in ("t", "t_"):
        d0, d1 = (0, 1) if x.ndim == 2 else (0, 0)
    else:
        d0, d1 = args[1] % x.ndim, args[2] % x.ndim
    d = lay[0]
    d = d1 if d == d0 else d0 if d == d1 else d
    return (d, lay[1])


def _unsqueeze(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    x = args[0]
    lay = tr.layout(x)
    if lay is None or lay is MIXED:
        return lay
    dim = args[1] % (x.ndim + 1)
    return (lay[0] + (1 if dim <= lay[0] else 0), lay[1])


def _unsqueeze_inplace(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict,
                       out: Any) -> Layout:
    """``x.unsqueeze_(dim)``: judged after the call, so ``x`` already has its new rank (vmap's
    batching of a group norm's backward)."""
    x = args[0]
    lay = tr.layout(x)
    if lay is None or lay is MIXED:
        return lay
    dim = args[1] % x.ndim
    return (lay[0] + (1 if dim <= lay[0] else 0), lay[1])


def _squeeze(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    x = args[0]
    lay = tr.layout(x)
    if lay is None or lay is MIXED:
        return lay
    dims = _dims(args[1], x.ndim) if len(args) > 1 else list(range(x.ndim))
    removed = [i for i in dims if x.shape[i] == 1]
    d = lay[0]
    return (d - sum(1 for i in removed if i < d), lay[1])


def _select(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    x = args[0]
    lay = tr.layout(x)
    if lay is None or lay is MIXED:
        return lay
    dim = args[1] % x.ndim
    if dim == lay[0]:
        return MIXED
    return (lay[0] - (1 if dim < lay[0] else 0), lay[1])


def _slice(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    x = args[0]
    lay = tr.layout(x)
    if lay is None or lay is MIXED:
        return lay
    dim = _arg(func, args, kwargs, "dim", 0) % x.ndim
    if dim == lay[0]:  # only the whole batch dimension keeps the blocks
        return lay if _first_out(out).shape[dim] == x.shape[dim] and \
            (_arg(func, args, kwargs, "step", 1) or 1) == 1 else MIXED
    return lay


def _slice_backward(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict,
                    out: Any) -> Layout:
    """``slice_backward(grad, input_sizes, dim, start, end, step)``: ``grad`` written into zeros of
    the sliced input's shape (the per-layer recomputation's backward under vmap). Along the batch
    dimension only a whole slice keeps the blocks."""
    g = args[0]
    lay = tr.layout(g)
    if lay is None or lay is MIXED:
        return lay
    o = _first_out(out)
    dim = args[2] % o.ndim
    if dim == lay[0] and (o.shape[dim] != g.shape[dim] or args[5] != 1):
        return MIXED
    return lay


def _select_backward(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict,
                     out: Any) -> Layout:
    """``select_backward(grad, input_sizes, dim, index)``: ``grad`` written into zeros with the
    selected dimension put back: the batch dimension moves past it."""
    g = args[0]
    lay = tr.layout(g)
    if lay is None or lay is MIXED:
        return lay
    dim = args[2] % _first_out(out).ndim
    return (lay[0] + (1 if dim <= lay[0] else 0), lay[1])


def _split(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    x = args[0]
    lay = tr.layout(x)
    if lay is None or lay is MIXED:
        return lay
    dim = _arg(func, args, kwargs, "dim", 0) % x.ndim
    if dim == lay[0]:
        return MIXED
    if _name(func) == "unbind":
        return (lay[0] - (1 if dim < lay[0] else 0), lay[1])
    return lay


def _cat(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    # legacy: cat skips 1-D empty tensors (a KV cache that starts empty, shape (0,))
    tensors = [t for t in args[0] if isinstance(t, Tensor) and not (t.ndim == 1 and
                                                                      t.numel() == 0)]
    o = _first_out(out)
    dim = _arg(func, args, kwargs, "dim", 0) % o.ndim
    res: Layout = None
    for t in tensors:
        lay = tr.layout(t)
        if lay is None:
            continue
        if lay is MIXED or t.ndim != o.ndim or lay[0] == dim:
            return MIXED
        if res is None:
            res = lay
        elif res != lay:
            return MIXED
    if res is not None:  # constant pieces are read row by row: they must not vary with the position
        for t in tensors:
            if tr.layout(t) is None and not _uniform_along(tr, t, res[0], res[1], tr.batch):
                return MIXED
    return res


def _stack(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    """``stack(tensors, dim)``: every data piece with the same layout, a new dimension inserted
    at ``dim``; constant pieces must be the same for every example."""
    tensors = [t for t in args[0] if isinstance(t, Tensor)]
    o = _first_out(out)
    dim = _arg(func, args, kwargs, "dim", 0) % o.ndim
    res: Layout = None
    for t in tensors:
        lay = tr.layout(t)
        if lay is None:
            continue
        if lay is MIXED or (res is not None and lay != res):
            return MIXED
        res = lay
    if res is None:
        return None
    for t in tensors:
        if tr.layout(t) is None and not _uniform_along(tr, t, res[0], res[1], tr.batch):
            return MIXED
    return (res[0] + (1 if dim <= res[0] else 0), res[1])


def _matmul(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    """mm / addmm / bmm / baddbmm / mv: the batch along a free (not contracted) dimension of one
    factor, the other constant (or, for bmm, both batched along the shared dimension 0)."""
    name = _name(func)
    if name in ("addmm", "baddbmm", "addmv", "_addmm_activation"):
        extra, a, b = args[0], args[1], args[2]
    else:
        extra, a, b = None, args[0], args[1]
    # a Folded factor only for mm / addmm: row r of a @ W is row r of a times a constant
    raw = name in ("mm", "addmm", "_addmm_activation")
    la, lb = (tr.raw_layout(a), tr.raw_layout(b)) if raw else (tr.layout(a), tr.layout(b))
    if la is MIXED or lb is MIXED:
        return MIXED
    if name in ("bmm", "baddbmm"):
        if la is not None and lb is not None:
            res = la if (la == lb and la[0] == 0) else MIXED
        elif la is not None:
            res = la if la[0] in (0, 1) else MIXED
            if la[0] == 0 and not _uniform_along(tr, b, 0, la[1], tr.batch):
                res = MIXED  # matrix i of the constant meets example i: position-dependent
        elif lb is not None:
            res = lb if lb[0] in (0, 2) else MIXED
            if lb[0] == 0 and not _uniform_along(tr, a, 0, lb[1], tr.batch):
                res = MIXED
        else:
            res = None
    elif name in ("mv", "addmv"):
        res = la if (lb is None and la is not None and la[0] == 0) else (None if la is lb is None
                                                                            else MIXED)
    else:  # mm, addmm (the batch in a's rows or b's columns, the other factor constant)
        if la is not None and lb is not None:
            res = MIXED
        elif la is not None:
            res = la if _parts(la)[0] == 0 else MIXED
        elif lb is not None:
            res = lb if _parts(lb)[0] == 1 else MIXED
        else:
            res = None
    if res is MIXED or extra is None:
        return res
    o = _first_out(out)
    le = _broadcast_join(tr, [extra], tuple(o.shape))
    if le is MIXED or (res is not None and le is not None and res != le):
        return MIXED
    # the added term and the product meet row by row: a constant one that spans the batch
    # dimension must be the same for every example (a (B H, T, S) attention mask added by
    # baddbmm with rows that differ by the example's position: accepted before)
    if le is None and res is not None:
        rd, rk, ro = _parts(res)
        if not _uniform_along(tr, extra, rd + extra.ndim - o.ndim, rk, tr.batch, ro):
            return MIXED
    if res is None and le is not None and not _product_uniform(tr, name, a, b, le):
        return MIXED
    return le if le is not None else res


def _product_uniform(tr: SeparabilityTracer, name: str, a: Tensor, b: Tensor,
                     lay: Layout) -> bool:
    """Whether the product of constants ``a`` and ``b`` (``mm``, ``bmm``, ``mv`` and their
    ``add`` forms) is the same for every example along the output's batch dimension of ``lay``:
    each factor that spans that dimension is."""
    d, k, o = _parts(lay)
    if name in ("bmm", "baddbmm"):
        spans = {0: [(a, 0), (b, 0)], 1: [(a, 1)], 2: [(b, 2)]}
    elif name in ("mv", "addmv"):
        spans = {0: [(a, 0)]}
    else:
        spans = {0: [(a, 0)], 1: [(b, 1)]}
    if d not in spans:
        return False
    return all(_uniform_along(tr, t, e, k, tr.batch, o) for t, e in spans[d])


def _conv(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    lay = _same(tr, None, args, kwargs, None)  # the first argument; the others constant
    if lay is None or lay is MIXED:
        return lay
    return lay if lay[0] == 0 else MIXED


def _conv_weight_grad(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict,
                      out: Any) -> Layout:
    """``convolution_backward`` asked for the input's gradient alone (``output_mask`` ``[True,
    False, False]``, the output gradient with the examples in ``N``, the weight a constant: the
    output gradient's layout), or for the weight's gradient alone (``output_mask`` ``[False,
    True, False]``), as ``torch.func.vmap`` batches a convolution's weight gradient: the examples
    folded into the channels (input ``(N, B c_in, ...)``, output gradient ``(N, B c_out, ...)``,
    each with layout ``(1, c)``) and ``groups = B g``, so that group ``j`` reads the channels of
    example ``j // g`` alone. Row ``r`` of the weight's gradient is output channel ``r`` (input
    channel ``r`` for a transposed convolution), which belongs to one group and so to one example:
    layout ``(0, c_out)`` (``(0, c_in)`` transposed). Anything else (the batch in ``N``, whose
    gradient sums the examples; channels not aligned with the groups) is mixing."""
    b = tr.batch
    if len(args) < 11:
        return MIXED
    gy, x, w = args[0], args[1], args[2]
    transposed, groups, mask = args[7], args[9], args[10]
    if list(mask) == [True, False, False]:
        # the input's gradient alone (vmap batches it with the examples folded into N): row n of
        # it is computed from row n of the output gradient and the weight, a constant (the input
        # gives its shape alone): the output gradient's layout
        ly = tr.layout(gy)
        if ly is None or ly is MIXED or tr.layout(w) is not None or ly[0] != 0 or \
                gy.ndim != x.ndim or gy.shape[0] != x.shape[0]:
            return MIXED
        return ly
    if list(mask) != [False, True, False] or not isinstance(groups, int) or groups % b:
        return MIXED
    ly, lx = tr.layout(gy), tr.layout(x)
    if ly is MIXED or lx is MIXED or ly is None or lx is None or ly[0] != 1 or lx[0] != 1:
        return MIXED
    if gy.ndim != x.ndim or gy.shape[0] != x.shape[0] or gy.shape[1] != b * ly[1] or \
            x.shape[1] != b * lx[1] or w.ndim != x.ndim:
        return MIXED
    c_in, c_out = x.shape[1], gy.shape[1]
    rows = c_in if transposed else c_out
    if c_in % groups or c_out % groups or w.shape[0] != rows:
        return MIXED
    return (0, rows // b)


def _along_dim_all(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict,
                   out: Any) -> Layout:
    """Ops along one dimension whose other tensor arguments are indexed like the first
    (``_softmax_backward_data(grad, out, dim)``, ``glu_backward(grad, x, dim)``): the pointwise
    join of the arguments (a constant meeting the batch must be the same for every example), then
    the batch not in that dimension."""
    lay = _broadcast_join(tr, _tensors(args, kwargs), tuple(_first_out(out).shape))
    if lay is None or lay is MIXED:
        return lay
    dims = _dims(_arg(func, args, kwargs, "dim", None), _first_out(out).ndim)
    if not dims or lay[0] in dims:
        return MIXED
    return lay


def _log_sigmoid_forward(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict,
                         out: Any) -> Layout:
    """``log_sigmoid_forward(x) -> (out, buffer)``: both elementwise in ``x``; the buffer is empty
    on CUDA (it then carries nothing)."""
    lay = _pointwise(tr, func, args, kwargs, out)
    return _PerOutput(None if isinstance(o, Tensor) and o.numel() == 0 else lay for o in out)


def _cdist(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    """``_cdist_forward(x1, x2, p, mode)``: ``out[..., i, j] = ||x1[..., i, :] - x2[..., j, :]||``
    with the leading dimensions broadcast (right-aligned). Per example when the examples are in a
    leading dimension of every argument that carries them (the ``_sdpa`` rule), or in the POINT
    dimension of one argument while the other is a constant: then output row ``i`` (column ``j``)
    is example ``i``'s (``j``'s) distances to public points. The examples in the point dimension of
    both (the distances between examples) are mixing."""
    x1, x2 = args[0], args[1]
    l1, l2 = tr.layout(x1), tr.layout(x2)
    o = _first_out(out)
    nd = o.ndim
    for lx, t, lo in ((l1, x1, l2), (l2, x2, l1)):
        if isinstance(lx, tuple) and lx[0] == t.ndim - 2:  # the examples as the points
            if lo is not None or not isinstance(o, Tensor):
                return MIXED
            d = nd - 2 if t is x1 else nd - 1
            other = x2 if t is x1 else x1
            # the constant's leading dimensions broadcast against nothing of the examples'
            if other.ndim > 2 and any(s != 1 for s in other.shape[:-2]) and t.ndim > 2 and \
                    any(s != 1 for s in t.shape[:-2]):
                return MIXED
            return (d, lx[1]) if o.shape[d] == tr.batch * lx[1] else MIXED
    # the examples in a leading dimension: right-aligned against the output
    res: Layout = None
    for t, lt in ((x1, l1), (x2, l2)):
        if lt is None:
            continue
        if lt is MIXED:
            return MIXED
        got = (lt[0] + nd - t.ndim, lt[1])
        if got[0] < 0 or got[0] >= nd - 2 or (res is not None and got != res):
            return MIXED
        res = got
    if res is None:
        return None
    for t, lt in ((x1, l1), (x2, l2)):
        if lt is None and not _uniform_along(tr, t, res[0] + t.ndim - nd, res[1], tr.batch):
            return MIXED
    return res


def _per_row(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    """Ops that compute row ``n`` of their output (dimension 0) from row ``n`` of every tensor
    argument (``grid_sampler_2d(input, grid)``: each image sampled at its own grid;
    ``max_unpool2d(x, indices)``: each plane scattered by its own indices): the examples in
    dimension 0 of every argument that carries them, with the same rows per example; a constant
    argument must be the same for every example (``_uniform_along``)."""
    res: Layout = None
    ts = _tensors(args, kwargs)
    for t in ts:
        lt = tr.layout(t)
        if lt is None:
            continue
        if lt is MIXED or lt[0] != 0 or (res is not None and lt != res):
            return MIXED
        res = lt
    if res is None:
        return None
    o = _first_out(out)
    if not isinstance(o, Tensor) or o.ndim == 0 or o.shape[0] != tr.batch * res[1]:
        return MIXED
    for t in ts:
        if tr.layout(t) is None and not (t.ndim == 0 or t.shape[0] == 1 or (
                t.shape[0] == tr.batch * res[1] and _uniform_along(tr, t, 0, res[1], tr.batch))):
            return MIXED
    return res


def _norm_backward(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict,
                   out: Any) -> Layout:
    """The backwards of the normalisations (met in per-layer replays, where autograd also forms the
    gradients of a child's weight and bias): the input's gradient row by row like the forward
    (``native_layer_norm_backward``: the examples in a dimension before the normalised ones;
    ``native_group_norm_backward``: in ``N``; ``native_batch_norm_backward`` in eval mode: not in
    the channels), every tensor argument that carries the examples with the same layout, the
    weight a constant; the weight's and bias's gradients sum over the rows: MIXED."""
    name = _name(func)
    x = args[1]
    if name == "native_layer_norm_backward":
        data, consts = [args[0], args[1], args[3], args[4]], [args[5], args[6]]
        limit = x.ndim - len(args[2])
    elif name == "native_group_norm_backward":
        data, consts = [args[0], args[1], args[2], args[3]], [args[4]]
        limit = 1
    else:  # native_batch_norm_backward
        return _batch_norm_backward(tr, func, args, kwargs, out)
    if any(isinstance(t, Tensor) and tr.layout(t) is not None for t in consts):
        return MIXED
    res: Layout = None
    for t in data:
        lt = tr.layout(t) if isinstance(t, Tensor) else None
        if lt is None:
            continue
        if lt is MIXED or (res is not None and lt != res):
            return MIXED
        res = lt
    if res is None:
        return None
    if res[0] >= limit:
        return MIXED
    for t in data:  # a constant among them: the same for every example (fifty-eighth review)
        if isinstance(t, Tensor) and tr.layout(t) is None and \
                not _uniform_along(tr, t, res[0] + t.ndim - x.ndim, res[1], tr.batch):
            return MIXED
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return _PerOutput([res] + [MIXED] * (len(outs) - 1))


def _batch_norm_backward(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict,
                         out: Any) -> Layout:
    """``native_batch_norm_backward(grad_out, input, weight, running_mean, running_var,
    save_mean, save_invstd, train, eps, mask)``. The examples in ``N`` (dimension 0): per row in
    eval mode (per-channel constants), mixing in training (the batch's statistics). The examples
    folded into the channels (layout ``(1, k)``: an instance norm, or vmap's batching of a batch
    norm): channel ``c`` reads example ``c // k`` alone in either mode, when each per-channel
    tensor is a constant the same for every example or the example's own statistics (layout
    ``(0, k)``); the weight's and bias's gradients are then per channel too (``(0, k)``)."""
    go, x = args[0], args[1]
    lx, lg = tr.layout(x), tr.layout(go)
    res = lx if lx is not None else lg
    if res is None:
        return None
    if res is MIXED or (lx is not None and lg is not None and lx != lg):
        return MIXED
    train = bool(_arg(func, args, kwargs, "train", True))
    per_channel = [t for t in args[2:7] if isinstance(t, Tensor) and t.numel()]  # (eval: the
    # saved statistics are empty)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if res[0] == 1:
        k = res[1]
        for t in (go, x):  # a constant one of the two: the same for every example
            if tr.layout(t) is None and not _uniform_along(tr, t, 1, k, tr.batch):
                return MIXED
        for t in per_channel:
            lt = tr.layout(t)
            if t.ndim != 1 or t.shape[0] != x.shape[1]:
                return MIXED
            if lt is None:
                if not _uniform_along(tr, t, 0, k, tr.batch):
                    return MIXED
            elif lt != (0, k):
                return MIXED
        return _PerOutput([res] + [(0, k)] * (len(outs) - 1))
    if train or any(tr.layout(t) is not None for t in per_channel):
        return MIXED
    for t in (go, x):
        if tr.layout(t) is None and not _uniform_along(tr, t, res[0], res[1], tr.batch):
            return MIXED
    return _PerOutput([res] + [MIXED] * (len(outs) - 1))


def _leading(spatial: Callable[[tuple, dict, Tensor], int]) -> Rule:
    """Ops on the trailing ``spatial(args)`` dimensions, independent over the leading ones, with
    every other tensor argument constant."""

    def rule(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
        x = args[0]
        lay = _same(tr, None, args, kwargs, None)  # the first argument; the others constant
        if lay is None or lay is MIXED:
            return lay
        return lay if lay[0] < x.ndim - spatial(args, kwargs, x) else MIXED

    return rule


def _n(k: int) -> Callable[[tuple, dict, Tensor], int]:
    return lambda args, kwargs, x: k


def _layer_norm_dims(args: tuple, kwargs: dict, x: Tensor) -> int:
    return len(args[1])


def _pad_dims(args: tuple, kwargs: dict, x: Tensor) -> int:
    return len(args[1]) // 2


def _group_norm(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    return _conv(tr, func, args, kwargs, out)  # per sample over dim 0, constant affine


class _PerOutput(tuple):
    """A rule's result with one layout per output of the operation (the outputs differ in rank:
    a normalisation's output and its saved statistics)."""


def _instance_norm(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any,
                   k: int) -> Layout:
    """``native_batch_norm`` on the examples folded into the channels, ``(N, B k, ...)`` with
    layout ``(1, k)``: what ``F.instance_norm`` runs (``InstanceNorm1d/2d/3d``; the input viewed as
    ``(1, B C, ...)``, the affine parameters repeated ``B`` times). A channel's statistics are
    taken over the other dimensions, which hold no other example: channel ``c`` is normalised by
    example ``c // k``'s own values. The weight, bias and running statistics must be constants
    that are the same for every example (``weight.repeat(B)``: checked on the values); with the
    batch's statistics in training mode, running statistics are refused (instance_norm writes their
    mean over the examples into the module's buffers, which the schema does not show). The
    output keeps the input's layout, the saved statistics ``(B k,)`` get ``(0, k)``."""
    b = tr.batch
    x = args[0]
    training = _arg(func, args, kwargs, "training", True) if _name(func) in (
        "native_batch_norm", "_native_batch_norm_legit", "cudnn_batch_norm",
        "miopen_batch_norm") else False
    params = [_arg(func, args, kwargs, n) for n in ("weight", "bias")]
    stats = [_arg(func, args, kwargs, n) for n in ("running_mean", "running_var")]
    if training and any(isinstance(t, Tensor) for t in stats):
        return MIXED
    for t in params + stats:
        if t is None:
            continue
        if not isinstance(t, Tensor) or tr.layout(t) is not None or t.ndim != 1 or \
                t.shape[0] != x.shape[1] or not _uniform_along(tr, t, 0, k, b):
            return MIXED
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return _PerOutput((1, k) if j == 0 else
                      None if isinstance(o, Tensor) and o.numel() == 0 else  # (eval: no data)
                      (0, k) if isinstance(o, Tensor) and o.ndim == 1 and
                      o.shape[0] == x.shape[1] else MIXED
                      for j, o in enumerate(outs))


def _batch_norm(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    name = _name(func)
    lay_x = tr.layout(args[0]) if args and isinstance(args[0], Tensor) else None
    if isinstance(lay_x, tuple) and lay_x[0] == 1 and name in (
            "native_batch_norm", "_native_batch_norm_legit",
            "_native_batch_norm_legit_no_training", "cudnn_batch_norm", "miopen_batch_norm"):
        return _instance_norm(tr, func, args, kwargs, out, lay_x[1])
    if name in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm") and \
            _arg(func, args, kwargs, "training", True):
        return MIXED
    if name in ("_native_batch_norm_legit", "_batch_norm_with_update"):
        return MIXED
    lay = _same(tr, None, args, kwargs, None)  # the first argument; the others constant
    if lay is None or lay is MIXED:
        return lay
    return lay if lay[0] != 1 else MIXED  # per channel (dim 1) with fixed statistics


def _embedding(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    w, idx = args[0], args[1]
    if tr.layout(w) is not None:
        return MIXED
    return tr.layout(idx)


def _embedding_dense_backward(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict,
                              out: Any) -> Layout:
    """``embedding_dense_backward(grad, indices, V, ...)``: ``out[v, c]`` sums ``grad[p, c]`` over
    the positions ``p`` whose index is ``v``; each column ``c`` from column ``c`` alone. With
    constant indices and the examples in the gradient's LAST dimension (vmap's batching of an
    embedding's gradient at indices without the batch: the examples folded into the features),
    the output has them in its last dimension the same way. Anything else: MIXED (indices that
    depend on the batch are the per-layer tracer's, ``RecomputeTracer._embedding_blocks``)."""
    grad, idx = args[0], args[1]
    lg, li = tr.layout(grad), tr.layout(idx)
    if li is not None or not isinstance(lg, tuple) or not isinstance(out, Tensor) or \
            lg[0] != grad.ndim - 1 or out.ndim != 2 or out.shape[1] != grad.shape[-1]:
        return MIXED if lg is not None or li is not None else None
    return (1, lg[1])


def _index_select(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict,
                  out: Any) -> Layout:
    x, dim, idx = args[0], args[1] % max(args[0].ndim, 1), args[2]
    lx, li = tr.layout(x), tr.layout(idx)
    if lx is MIXED or li is MIXED:
        return MIXED
    if lx is not None and li is None:
        return lx if lx[0] != dim else MIXED
    if lx is None and li is not None:
        return (dim, li[1])
    return None if lx is li is None else MIXED


def _gather(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    x, dim, idx = args[0], args[1] % max(args[0].ndim, 1), args[2]
    lx, li = tr.layout(x), tr.layout(idx)
    if lx is MIXED or li is MIXED:
        return MIXED
    lay = lx if lx is not None else li
    if lay is None:
        return None
    if (lx is not None and li is not None and lx != li) or lay[0] == dim:
        return MIXED
    if lx is not None and x.shape[lay[0]] != idx.shape[lay[0]]:
        return MIXED
    # a constant operand is read at row i for example i: it must not vary with the position
    const = x if lx is None else idx if li is None else None
    if const is not None and not _uniform_along(tr, const, lay[0], lay[1], tr.batch):
        return MIXED
    return lay


def _loss(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    """Losses with a ``reduction`` argument: only ``none`` (0) is per example."""
    if _arg(func, args, kwargs, "reduction", 1) != 0:
        return MIXED
    name = _name(func)
    if name in ("nll_loss_forward", "nll_loss2d_forward"):
        x, target = args[0], args[1]
        lx, lt = tr.layout(x), tr.layout(target)
        if tr.layout(args[2]) is not None if isinstance(args[2], Tensor) else False:
            return MIXED
        if lx is MIXED or lt is MIXED:
            return MIXED
        if lx is not None and lx[0] != 0:
            return MIXED
        if lt is not None and lt[0] != 0:
            return MIXED
        if lx is not None and lt is not None and lx != lt:
            return MIXED
        return lx if lx is not None else lt
    return _pointwise(tr, func, args, kwargs, out)


def _sdpa(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    """Scaled dot-product attention on ``(..., T, d)`` (every ATen form: math, flash, efficient,
    cuDNN): independent over the leading dims. Query, key and value must carry the batch in the
    same leading dimension; a mask or bias (``(B, 1, T, T)``, ``(B, 1, 1, T)``: example data, or a
    broadcast ``(1, 1, T, T)`` constant) must meet that dimension in its own right-aligned position
    (a ``(B, T, T)`` mask broadcasts B against the heads: refused). A constant operand spanning the
    batch dimension must be the same for every example (``_uniform_along``). Attention across the
    batch (the batch moved into the sequence dimension) has the batch in dimension ``ndim - 2``:
    refused."""
    q = args[0]
    nd = q.ndim
    res: Layout = None
    ts = _tensors(args, kwargs)
    for t in ts:
        lt = tr.layout(t)
        if lt is None:
            continue
        if lt is MIXED:
            return MIXED
        got = (lt[0] + nd - t.ndim, lt[1])
        if res is None:
            res = got
        elif got != res:
            return MIXED
    if res is None:
        return None
    if res[0] < 0 or res[0] >= nd - 2:
        return MIXED
    for t in ts:
        if tr.layout(t) is None and not _uniform_along(tr, t, res[0] + t.ndim - nd, res[1], tr.batch):
            return MIXED
    return res


def _is_identity(t: Tensor, e: int, batch: int) -> bool:
    """Whether integer constant ``t`` (right-aligned in a broadcast of rank ``e``'s frame) holds
    ``i`` at position ``i`` of its dimension ``e`` and the same along every other dimension."""
    if e < 0 or e >= t.ndim or t.shape[e] != batch or t.dtype.is_floating_point \
            or t.dtype == torch.bool:
        return False
    shape = [1] * t.ndim
    shape[e] = batch
    iota = torch.arange(batch, device=t.device).view(shape).expand_as(t)
    return bool(torch.equal(t.to(torch.long), iota))


#: operations that keep every element of a uniform constant where it is, or repeat it along new
#: or size-1 dimensions (``_structural_uniform``); elementwise ones are found by their tag
_UNIFORM_KEEPERS = frozenset({_aten._to_copy, _aten.clone, _aten.contiguous, _aten.alias,
                              _aten.detach, _aten.lift_fresh_copy, _aten.expand,
                              _aten.unsqueeze})


def _built_identity(tr: SeparabilityTracer, t: Tensor, e: int) -> bool:
    """:func:`_is_identity` in a fixed graph's analysis (:attr:`SeparabilityTracer.structural`):
    ``t`` is ``arange(B)`` along its dimension ``e`` by the graph's construction."""
    return e >= 0 and e < t.ndim and t.shape[e] == tr.batch and \
        tr.structural[1].get(ident(t)) == e  # type: ignore[index]


def _index(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    """``x[i0, i1, ...]`` with integer index tensors (``aten.index.Tensor``).

    Per example when (a) the batch dimension of ``x`` is not indexed and every index tensor is a
    constant; or (b) it is indexed by ``arange(B)`` (checked on the values: the identity, not a
    permutation, ``arange(B).flip(0)`` is refused) and every other index is example data with the
    batch at the same broadcast position, or a constant that is the same for every example
    (``o.log_softmax(1)[arange(B), y]``, the mask lookup ``mask[batch_idx, kv_idx]`` of
    ``transformers``); or (c) ``x`` is a constant table read at example data (an embedding).
    Boolean masks are refused when data is involved (the output's shape would depend on it)."""
    x, idx = args[0], list(args[1])
    lx = tr.layout(x)
    if lx is MIXED:
        return MIXED
    pos = [i for i, t in enumerate(idx) if t is not None]
    its = [idx[i] for i in pos]
    if any(t.dtype in (torch.bool, torch.uint8) for t in its):
        if lx is not None or any(tr.layout(t) is not None for t in its):
            if tr.violation is None:
                tr.violation = ("a boolean mask index on batch data: the shape of the result "
                                "depends on the values")
            return MIXED
        return None
    bshape = torch.broadcast_shapes(*[t.shape for t in its])
    nb = len(bshape)
    contiguous = pos == list(range(pos[0], pos[-1] + 1))
    base = pos[0] if contiguous else 0
    lays = [tr.layout(t) for t in its]
    if any(lt is MIXED for lt in lays):
        return MIXED
    # the broadcast position of each data index, right-aligned in the broadcast shape
    data = [(lt[0] + nb - t.ndim, lt[1]) for t, lt in zip(its, lays) if lt is not None]
    if lx is not None and lx[0] not in pos:  # (a) the batch dimension is not indexed
        if data:
            return MIXED
        d = lx[0]
        if contiguous:
            dd = d if d < pos[0] else d - len(pos) + nb
        else:
            dd = nb + sum(1 for j in range(d) if j not in pos)
        return (dd, lx[1])
    if lx is not None:  # (b) the batch dimension is indexed: by arange(B), paired
        if lx[1] != 1:
            return MIXED
        ib = its[pos.index(lx[0])]
        if tr.layout(ib) is not None:
            return MIXED
        cands = [e for e in range(nb) if (
            _is_identity(ib, e - (nb - ib.ndim), tr.batch) if tr.structural is None else
            _built_identity(tr, ib, e - (nb - ib.ndim)))]
        if data:
            cands = [e for e in cands if all(dl == (e, 1) for dl in data)]
        if len(cands) != 1:
            return MIXED
        e = cands[0]
        for t, lt in zip(its, lays):
            if lt is None and t is not ib and not _uniform_along(tr, t, e - (nb - t.ndim), 1,
                                                                 tr.batch):
                return MIXED
        return (base + e, 1)
    # (c) a constant table read at example data
    if not data:
        return None
    if any(dl != data[0] for dl in data):
        return MIXED
    e, k = data[0]
    for t, lt in zip(its, lays):
        if lt is None and not _uniform_along(tr, t, e - (nb - t.ndim), k, tr.batch):
            return MIXED
    return (base + e, k)


#: random factories whose elements are i.i.d. given scalar parameters (by overload: the tensor-p
#: forms of bernoulli are not here, their elements may differ in distribution)
_IID_RANDOM = {"aten.bernoulli_.float", "aten.bernoulli.p", "aten.rand.default",
               "aten.randn.default", "aten.rand_like.default", "aten.randn_like.default",
               "aten.uniform_.default", "aten.normal_.default", "aten.randint.default",
               "aten.randint.low", "aten.randint_like.default", "aten.randint_like.low_dtype",
               "aten.exponential_.default"}
_IID_KEEPERS = {_aten.view, _aten._unsafe_view, _aten.reshape, _aten.expand, _aten.clone,
                _aten._to_copy, _aten.detach, _aten.alias, _aten.t, _aten.transpose,
                _aten.permute, _aten.unsqueeze, _aten.squeeze, _aten.contiguous}

_UNINIT = {_aten.empty, _aten.empty_like, _aten.new_empty, _aten.empty_strided,
           _aten.new_empty_strided, _aten.empty_permuted}
#: in-place ops that overwrite every element of the tensor they write (random fills, fills,
#: copies that broadcast a source over the whole destination)
_FULL_WRITE = {_aten.fill_, _aten.zero_, _aten.copy_, _aten.bernoulli_, _aten.uniform_,
               _aten.normal_, _aten.random_, _aten.exponential_, _aten.geometric_,
               _aten.log_normal_, _aten.cauchy_}


#: operations that read only the shape and dtype of their tensor input (``torch.func.vmap``'s
#: per-example dropout draws ``bernoulli(empty(...).expand(...), p)``)
_SHAPE_ONLY = {_aten.bernoulli.p}


def _conv_shape_only(args: tuple, kwargs: dict) -> Tensor | None:
    """The argument of a ``convolution_backward`` call read for its shape alone, or None: the
    weight (``args[2]``) when no input gradient is asked for (``output_mask[0]`` False: the
    weight's gradient is computed from the input and the output gradient, the bias's from the
    output gradient); the input (``args[1]``) when only the input gradient is asked for
    (``output_mask`` ``[True, False, False]``: it is computed from the output gradient and the
    weight). Not when the same tensor is also another argument."""
    mask = args[10] if len(args) > 10 else kwargs.get("output_mask")
    if len(args) < 3 or not isinstance(mask, (list, tuple)) or len(mask) != 3:
        return None
    if mask[0] is False:
        k = 2
    elif list(mask) == [True, False, False]:
        k = 1
    else:
        return None
    t = args[k]
    if not isinstance(t, Tensor) or any(t is a for j, a in enumerate(args[:3]) if j != k):
        return None
    return t

_VIEWS = {_aten.view, _aten._unsafe_view, _aten.reshape, _aten.as_strided, _aten.unfold,
          _aten.slice, _aten.select, _aten.narrow, _aten.expand, _aten.permute, _aten.transpose,
          _aten.t, _aten.unsqueeze, _aten.squeeze, _aten.alias, _aten.diagonal, _aten.unflatten,
          _aten.flatten, _aten.split, _aten.split_with_sizes, _aten.chunk, _aten.unbind,
          _aten.detach, _aten.view_as_real, _aten.view_as_complex, _aten._reshape_alias}


def _elements(t: Tensor, n: int, size: int) -> Tensor | None:
    """The storage elements (indices into a storage of ``n`` elements of ``size`` bytes) that
    view ``t`` addresses, or None when they cannot be computed (then nothing is assumed)."""
    if t.element_size() != size:
        return None
    try:
        return torch.arange(n).as_strided(t.shape, t.stride(), t.storage_offset()).reshape(-1)
    except Exception:  # noqa: BLE001 - out of range or an exotic layout: conservative
        return None




_P = _aten
_RULES: dict[Any, Rule] = {}
_SELF_JUDGED = {_aten.index, _aten._unsafe_index}


def _add(rule: Rule, *names: str) -> None:
    for n in names:
        packet = getattr(_P, n, None)
        if packet is not None:
            _RULES[packet] = rule


def _const(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    """Factories that read only the shape, dtype and device of their tensor argument."""
    return None


def _copy(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    """``self.copy_(src)``: ``self`` is overwritten by ``src`` broadcast to its shape."""
    return _broadcast_join(tr, [args[1]], tuple(args[0].shape))


def _repeat(tr: SeparabilityTracer, func: Any, args: tuple, kwargs: dict, out: Any) -> Layout:
    x, reps = args[0], list(args[1])
    lay = tr.layout(x)
    if lay is None or lay is MIXED:
        return lay
    d = lay[0] + len(reps) - x.ndim
    return (d, lay[1]) if reps[d] == 1 else MIXED


_add(_pointwise, "masked_fill", "masked_fill_", "where")  # elementwise with broadcasting
_add(_copy, "copy_", "copy")
_add(_repeat, "repeat")
_add(_const, "new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided", "empty_like",
     "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like")
_add(_same, "lift_fresh", "lift_fresh_copy", "bernoulli", "positive", "view_as_real", "_conj",
     "resolve_conj", "resolve_neg")
_add(_copy_of, "detach", "alias", "clone", "_to_copy", "native_dropout", "contiguous")
_add(_reshape, "view", "_unsafe_view", "reshape", "_reshape_alias", "view_copy", "flatten",
     "unflatten")
_add(_expand, "expand", "expand_copy")
_add(_permute, "permute", "permute_copy")
_add(_transpose, "transpose", "transpose_", "t", "t_", "swapaxes", "swapdims")
_add(_unsqueeze, "unsqueeze", "unsqueeze_copy")
_add(_unsqueeze_inplace, "unsqueeze_")
_add(_squeeze, "squeeze", "squeeze_copy")
_add(_select, "select", "select_copy")
_add(_slice, "slice", "slice_copy", "narrow")
_add(_slice_backward, "slice_backward")
_add(_select_backward, "select_backward")
_add(_split, "split", "split_with_sizes", "chunk", "unbind", "tensor_split", "unsafe_split")
_add(_cat, "cat")
_add(_stack, "stack")
_add(_matmul, "mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "_addmm_activation")
_add(_conv, "convolution", "_convolution", "conv1d", "conv2d", "conv3d",
     "mkldnn_convolution", "_slow_conv2d_forward", "thnn_conv2d")
_add(_conv_weight_grad, "convolution_backward")
_add(_norm_backward, "native_layer_norm_backward", "native_group_norm_backward",
     "native_batch_norm_backward")
_add(_pointwise, "_prelu_kernel", "_prelu_kernel_backward")
# elementwise activations (and their backwards) that ATen does not tag pointwise
_add(_pointwise, "hardswish", "hardswish_", "hardswish_backward", "elu_backward",
     "hardshrink_backward", "hardsigmoid_backward", "hardtanh_backward", "leaky_relu_backward",
     "mish_backward", "softplus_backward", "softshrink_backward", "log_sigmoid_backward")
_add(_log_sigmoid_forward, "log_sigmoid_forward")
_add(_along_dim_all, "_softmax_backward_data", "_log_softmax_backward_data", "glu_backward")
_add(_conv, "channel_shuffle", "native_channel_shuffle", "im2col", "col2im")
_add(_per_row, "grid_sampler_2d", "grid_sampler_3d", "cudnn_grid_sampler", "max_unpool2d",
     "max_unpool3d", "affine_grid_generator")
_add(_cdist, "_cdist_forward")
_add(_sdpa, "_cdist_backward", "_euclidean_dist")
_add(_group_norm, "native_group_norm")
_add(_batch_norm, "native_batch_norm", "_native_batch_norm_legit_no_training",
     "_native_batch_norm_legit", "_batch_norm_with_update", "_batch_norm_no_update",
     "cudnn_batch_norm", "miopen_batch_norm")
_add(_leading(_layer_norm_dims), "native_layer_norm", "_fused_rms_norm")
_add(_leading(_n(1)), "max_pool1d_with_indices", "avg_pool1d", "adaptive_avg_pool1d",
     "adaptive_max_pool1d", "reflection_pad1d", "replication_pad1d", "max_pool1d",
     "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_linear1d")
_add(_leading(_n(2)), "max_pool2d_with_indices", "avg_pool2d", "adaptive_avg_pool2d",
     "_adaptive_avg_pool2d", "adaptive_max_pool2d", "reflection_pad2d", "replication_pad2d",
     "max_pool2d", "upsample_nearest2d", "upsample_bilinear2d", "_upsample_nearest_exact2d",
     "upsample_bicubic2d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa")
_add(_leading(_n(3)), "max_pool3d_with_indices", "avg_pool3d", "adaptive_avg_pool3d",
     "_adaptive_avg_pool3d", "reflection_pad3d", "replication_pad3d", "upsample_nearest3d",
     "_upsample_nearest_exact3d", "upsample_trilinear3d", "pixel_shuffle", "pixel_unshuffle")
_add(_leading(_pad_dims), "constant_pad_nd")
_add(_along_dim, "_softmax", "_log_softmax", "softmax", "log_softmax", "_safe_softmax", "glu",
     "cumsum", "cumprod",
     "logcumsumexp", "sort", "argsort", "topk", "flip", "roll", "cummax", "cummin")
_add(_softmax_backward, "_softmax_backward_data", "_log_softmax_backward_data")
_add(_reduction, "max", "min", "median", "nanmedian", "kthvalue", "mode", "var_mean",
     "std_mean", "aminmax", "logsumexp", "norm", "linalg_vector_norm", "count_nonzero")
_add(_embedding, "embedding")
_add(_embedding_dense_backward, "embedding_dense_backward")
_add(_index_select, "index_select")
_add(_index, "index", "_unsafe_index")
_add(_gather, "gather")
_add(_loss, "nll_loss_forward", "nll_loss2d_forward", "mse_loss", "l1_loss", "smooth_l1_loss",
     "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
     "soft_margin_loss", "kl_div")
_add(_sdpa, "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math",
     "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
     "_scaled_dot_product_cudnn_attention", "scaled_dot_product_attention")


def prove_separable(model: Callable[..., Any], loss_fn: Callable[..., Tensor], inputs: Any,
                    targets: Any) -> str | None:
    """The verdict of the whole proof on ``loss_fn(model(inputs), targets)``: ``None`` when it is
    proved per-example separable (each loss row a function of its own example and public
    constants), else the reason. The same two checks as the ghost engine, without its layer rules:
    the batch size used only as a size (:func:`dpclip.engine.batch_symbol.batch_size_uses`, with a
    symbolic batch) and the op-by-op trace of the real forward (this module), run under
    :func:`~dpclip.engine.batch_symbol.data_independent_paths` as the engine runs it.

    Privacy: reads no values of the data except through the traced operations themselves.
    Edge cases: a batch of one example is trivially separable; inputs and targets are tensors or
    tuples / lists / dicts of tensors with the batch first."""
    from dpclip.engine.batch import batch_leaves, call_model
    from dpclip.engine.batch_symbol import data_independent_paths, proof_of
    from dpclip.engine.proved_program import ProgramMatch, describe

    leaves = batch_leaves(inputs, "inputs") + batch_leaves(targets, "targets")
    batch = leaves[0].shape[0]
    if batch <= 1:
        return None
    why, program = proof_of(model, loss_fn, inputs, targets)
    if why is not None:
        return why
    tracer = SeparabilityTracer(batch)
    # the real run must be the program the proof ran (dpclip.engine.proved_program)
    tracer.match = ProgramMatch(program, batch, model, inputs, targets)
    for t in leaves:
        tracer.mark(t, (0, 1))
    tracer.match.arm()
    with data_independent_paths(), torch.enable_grad(), tracer.match.watching(), tracer:
        losses = loss_fn(call_model(model, inputs), targets)
        tracer.match.finish(losses)
    tracer.retire()
    if tracer.match.mismatch is not None:
        return describe(tracer.match.mismatch)
    if tracer.violation is not None:
        return tracer.violation
    lay = tracer.layout(losses)
    if lay is not None and lay != (0, 1):
        first = f" (first mixing operation: {tracer.mixers[0]})" if tracer.mixers else ""
        return f"the per-example losses have layout {lay!r}, not (0, 1){first}"
    return None
