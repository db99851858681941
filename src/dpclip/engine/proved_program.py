"""The step runs the program that was proved: the real forward and loss are matched, operation by
operation, against the operations recorded while the batch-size proof traced them (issue 31).

The batch-size proof (:mod:`dpclip.engine.batch_symbol`) runs the forward and the loss once per
signature on fake tensors with a symbolic batch size; the real-batch trace
(:mod:`dpclip.engine.separable`) runs on every step on the real tensors. Both are needed: the real
trace cannot tell ``o / len(y)`` (the private batch size as a Python number) from ``o / 16`` (a
public constant), the proof can. But the two runs are two executions of user Python, and user
Python can tell them apart (``type(x) is torch.Tensor``, ``isinstance(x.shape[0], int)``,
``torch.compiler.is_exporting()``, a call counter): a program that behaves in the proof and uses the
batch size in the real run was accepted (hostile review: LOO 2.57-3.16 C). Checking the real run
against the proof closes that gap:

* :class:`ProgramRecorder` (a dispatch mode entered inside the proof's traced function) records
  the ATen operations the proof executed, post-autograd, exactly as a dispatch mode sees them in an
  eager run: each operation with its arguments, where a tensor argument is named by where it came
  from (an input leaf, a parameter or buffer by name, the output of an earlier recorded operation,
  a tensor that existed outside the call by identity, the value of a literal ``torch.tensor``) and
  a size is a symbolic expression of the batch size;
* :class:`ProgramMatch` (driven by the real-batch tracer on every step) requires the real run's
  operations to be the same operations, in the same order, on the same tensors (by that naming),
  with every number equal to the proof's expression evaluated at the realised batch size, and the
  losses to be the proof's output. Any difference (another operation, another constant, a number
  computed from ``len(y)`` where the proof had a literal, a missing or extra operation) makes the
  step "not proven".

Soundness argument: the proof establishes a property of the recorded computation at every batch
size; a real run that matches it computes that recorded computation at its batch size (the ops are
deterministic functions of their arguments, and every argument is tied to the same source), so
the property holds for the step that runs. A name must still stand for its values: a tensor
written since it was named by no matched operation (Python dispatch switched off) loses its name
(version counters, :class:`_Versioned`), and a tensor from outside the call is compared by value
with its copy at the start of the call (second hostile review: LOO 3.16 C before). What the match
does not see is what the proof and the real trace do not see either (public state that changed
outside the call; a parameter or buffer sharing memory with a NumPy array written in forward);
engine code (its hooks) is skipped on both sides and its outputs are named by the tensors they
stand for.

Cost: one comparison per operation and argument (numbers are evaluated once per batch size);
about as much as the real-batch trace's own bookkeeping.
"""

from __future__ import annotations

from dpclip.engine import _cm
import struct
import weakref
from typing import Any, Iterator

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from dpclip._ident import ident
from dpclip.engine.hook_watch import HookWatch
from dpclip.engine.memory_watch import MemoryWatch, SavedTensorWatch, saved_watch_on_top, unpacks
from dpclip.engine.op_entry import call_op

__all__ = ["CallWindow", "ProgramRecorder", "ProgramMatch", "ProvedProgram", "storage_key"]

_aten = torch.ops.aten
#: operations that read a tensor's metadata only; fake tensors with symbolic sizes dispatch some
#: of them where an eager run reads the sizes directly: skipped on both sides
_METADATA = frozenset({"sym_size", "sym_numel", "sym_stride", "sym_storage_offset",
                       "is_same_size", "is_contiguous", "is_non_overlapping_and_dense", "dim",
                       "size", "stride", "numel", "storage_offset"})
#: ``torch.tensor(...)`` in a forward: a fresh tensor lifted into the computation (its copying
#: variant under the proof's fake mode); named by its value
_LIFT_FRESH, _LIFT_FRESH_COPY = _aten.lift_fresh.default, _aten.lift_fresh_copy.default
_UNSAFE_VIEW = _aten._unsafe_view.default
#: operations that return their input's values unchanged (another autograd identity): the fake
#: mode of the proof adds some that an eager run does not (before ``bernoulli``); transparent on
#: both sides, their output named as their input. The separability and gradients of the real run
#: are judged on the real run itself (dpclip.engine.separable), values only are matched here
_DETACH, _ALIAS = _aten.detach.default, _aten.alias.default
#: per-operation caches below are keyed by ``ident(op)`` and hold the operation itself (an
#: OpOverload's ``__hash__`` is Python code: a dict lookup keyed by the operation cost more than
#: the rest of the per-operation bookkeeping)
_PURE: dict[int, tuple[Any, bool]] = {}


def _pure(func: Any) -> bool:
    """Whether the operation has no effect but its outputs: it writes no argument and draws no
    random numbers. Symbolic tracing and eager kernels differ in such operations whose outputs are
    never used (an allocation when a real tensor meets a fake one, a view made to read a size):
    unused ones are dropped from the recording, and the real run may run extra ones. An extra one
    whose output IS used is caught where it is used: its output has no name in the proof."""
    e = _PURE.get(ident(func))
    if e is not None and e[0] is func:
        return e[1]
    got = not func._schema.is_mutable and torch.Tag.nondeterministic_seeded not in func.tags
    _PURE[ident(func)] = (func, got)
    return got

# argument specs: ("t", ref) a tensor by name; ("x", weakref) a tensor from outside the call by
# identity; ("c", tensor) a lifted literal by value; ("s", expr) a symbolic number; ("l", type,
# specs) a list or tuple; ("v", value) any other value by equality; ("?", why) not matchable


def _identity(func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
    """Whether the call returns its first argument's values unchanged (``detach``, ``alias``, a
    full slice ``x[:]``, which an eager run skips where a symbolic trace records it)."""
    if not (isinstance(out, Tensor) and args and isinstance(args[0], Tensor)):
        return False
    if func is _DETACH or func is _ALIAS:
        return True
    if func is _aten.slice.Tensor and not kwargs:
        t = args[0]
        dim = args[1] if len(args) > 1 else 0
        start = args[2] if len(args) > 2 else None
        end = args[3] if len(args) > 3 else None
        step = args[4] if len(args) > 4 else 1
        if type(dim) is not int or type(step) is not int or step != 1 or \
                type(start) not in (int, type(None)) or start not in (None, 0):
            return False
        size = t.shape[dim]
        if type(end) is int:
            return end >= 2 ** 62 or (type(size) is int and end >= size)
        # the proof: a symbolic end that is the symbolic size itself (compared as expressions,
        # without a guard)
        return isinstance(end, torch.SymInt) and isinstance(size, torch.SymInt) and \
            end.node.expr == size.node.expr
    return False


_SKIP: dict[int, tuple[Any, bool]] = {}
#: (torch.library's ledger, its version, its entries over ATen operations on a key an eager run
#: can use[, their operation names, the entries they were taken from])
_OVERRIDES: list[Any] = [None, -1, frozenset()]
#: operation -> whether it is overridden, valid while the ledger keeps the version in _OVERRIDES
_OVERRIDDEN: dict[int, tuple[Any, bool]] = {}
#: the dispatch keys whose kernels an eager run executes (not Meta, nor functorch's batching
#: rules, which torch registers from Python itself); "" is torch.library's default
_EAGER_KEYS = frozenset({
    "", "CPU", "CUDA", "XPU", "MPS", "PrivateUse1", "CompositeImplicitAutograd",
    "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional", "Autograd",
    "AutogradCPU", "AutogradCUDA", "AutogradXPU", "AutogradMPS", "AutogradPrivateUse1",
    "ADInplaceOrView", "BackendSelect"})


class _Ledger(set):
    """torch.library's ledger of Python kernels (``torch.library._impls``, a set of
    ``"ns/op/key"``) with a version bumped by every change (a size alone missed a registration
    that replaced a destroyed one) and a count per entry: torch removes an entry when ANY library
    that registered it is destroyed, while another library's kernel registered over it
    (``allow_override``) stays active; here the entry stays while one is left. Installed over
    torch's set at import; torch adds with ``add`` and removes with ``-=`` (``_destroy``)."""

    version = 0

    def __init__(self, items: Any = ()) -> None:
        super().__init__(items)
        self.counts: dict[str, int] = dict.fromkeys(self, 1)

    @property
    def replaced(self) -> frozenset:
        """Entries registered again over themselves (a kernel replaced under a known name)."""
        return frozenset(k for k, n in self.counts.items() if n > 1)

    def add(self, x: Any) -> None:
        self.version += 1
        self.counts[x] = self.counts.get(x, 0) + 1
        super().add(x)

    def _drop(self, items: Any) -> set:
        self.version += 1
        gone = set()
        for x in set(items):
            n = self.counts.get(x, 0) - 1
            if n > 0:
                self.counts[x] = n
            else:
                self.counts.pop(x, None)
                gone.add(x)
        return gone

    def discard(self, x: Any) -> None:
        if x in self._drop([x]):
            super().discard(x)

    def remove(self, x: Any) -> None:
        if x not in self:
            raise KeyError(x)
        self.discard(x)

    def difference_update(self, *others: Any) -> None:
        for o in others:
            super().difference_update(self._drop(o))

    def __isub__(self, other: Any) -> "_Ledger":  # (a library's _destroy: its entries)
        super().difference_update(self._drop(other))
        return self

    def _refuse(self, *args: Any) -> Any:
        raise TypeError("dpclip: torch.library's ledger is only added to and subtracted from")

    pop = clear = update = intersection_update = symmetric_difference_update = _refuse
    __ior__ = __iand__ = __ixor__ = _refuse


def _ledger() -> _Ledger:
    impls = getattr(torch.library, "_impls", None)
    if type(impls) is not _Ledger:  # (at import, or replaced since: wrapped again)
        impls = torch.library._impls = _Ledger(impls or ())
    return impls


_ledger()
try:  # torch's own vmap decompositions, registered on the first vmap otherwise: now, so that an
    # entry under one of their names later is a user's (registered again: ``_Ledger.replaced``)
    from torch._functorch.vmap import lazy_load_decompositions

    lazy_load_decompositions()
except Exception:  # noqa: BLE001 - (another torch: registered on its first vmap, as before)
    pass

#: the ATen kernels torch registers from Python itself on keys other than Meta (torch 2.11-2.13:
#: two at import, eight vmap decompositions on the first vmap)
TORCH_OWN_KERNELS = frozenset({
    "aten/_foreach_mm/CUDA", "aten/linalg_lu_solve.out/MPS", "aten/addr/FuncTorchBatched",
    "aten/huber_loss_backward/FuncTorchBatched", "aten/mse_loss_backward/FuncTorchBatched",
    "aten/nll_loss2d_backward/FuncTorchBatched", "aten/nll_loss2d_forward/FuncTorchBatched",
    "aten/nll_loss_backward/FuncTorchBatched", "aten/nll_loss_forward/FuncTorchBatched",
    "aten/smooth_l1_loss_backward/FuncTorchBatched"})
_FOREIGN: list[Any] = [None, -1, frozenset()]


def foreign_aten_kernels() -> frozenset:
    """The ledger's entries of Python kernels over ATen operations that are not torch's own
    (:data:`TORCH_OWN_KERNELS`), on any key but Meta (vmap's ``FuncTorchBatched`` included: a
    kernel there received the whole batch inside vmap and mixed it, 4.81 C under vmap and auto,
    forty-fourth hostile review), and any entry registered again over itself; the same object
    while the ledger does not change."""
    impls = _ledger()
    if _FOREIGN[0] is not impls or _FOREIGN[1] != impls.version:
        _FOREIGN[:] = [impls, impls.version, frozenset(
            k for k in list(impls) if k.startswith("aten/") and not k.endswith("/Meta")
            and k not in TORCH_OWN_KERNELS) | frozenset(
            k for k in impls.replaced if k.startswith("aten/"))]
    return _FOREIGN[2]


def aten_python_kernels() -> frozenset:
    """The ledger's entries (``"aten/<op>/<key>"``) of Python kernels over ATen operations on a
    key an eager run executes (``torch.library.Library('aten', 'IMPL').impl``; torch registers
    Meta kernels there itself); recomputed when the ledger changes, the same object otherwise.
    Not seen: a kernel registered through the private ``torch._C._dispatch_library`` directly, a
    Python fallback of a whole dispatch key."""
    impls = _ledger()
    if _OVERRIDES[0] is not impls or _OVERRIDES[1] != impls.version:
        _OVERRIDDEN.clear()
        _OVERRIDES[:] = [impls, impls.version, frozenset(
            k for k in list(impls) if k.startswith("aten/") and k.rpartition("/")[2] in _EAGER_KEYS)]
    return _OVERRIDES[2]


def _overridden(func: Any) -> bool:
    """Whether a Python kernel registered with ``torch.library`` (``Library('aten', 'IMPL')``)
    replaces an eager kernel of the ATen operation ``func``: the proof ran its fake (meta) kernel,
    the real run would run that Python, which can read any state (second hostile review: LOO
    3.16 C). From :func:`aten_python_kernels`."""
    kernels = aten_python_kernels()
    e = _OVERRIDDEN.get(ident(func))
    if e is not None and e[0] is func:
        return e[1]
    names = _OVERRIDES[3] if len(_OVERRIDES) > 3 and _OVERRIDES[4] is kernels else None
    if names is None:
        names = frozenset(k.split("/")[1].split(".")[0] for k in kernels)
        del _OVERRIDES[3:]
        _OVERRIDES.extend([names, kernels])
    got = bool(names) and func._schema.name.split("::", 1)[-1] in names
    _OVERRIDDEN[ident(func)] = (func, got)
    return got

_SEEDED: dict[int, tuple[Any, bool]] = {}


def _seeded(func: Any) -> bool:
    """Whether the operation draws random numbers from a generator."""
    e = _SEEDED.get(ident(func))
    if e is not None and e[0] is func:
        return e[1]
    got = torch.Tag.nondeterministic_seeded in func.tags
    _SEEDED[ident(func)] = (func, got)
    return got


def _skip(func: Any) -> bool:
    e = _SKIP.get(ident(func))
    if e is not None and e[0] is func:
        return e[1]
    got = getattr(func, "namespace", "") == "prim" or \
        func._schema.name.split("::", 1)[-1] in _METADATA
    _SKIP[ident(func)] = (func, got)
    return got


def _is_symbolic(v: Any) -> bool:
    return isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool))


class ProvedProgram:
    """The operations of one proof run: ``entries`` (``(op, args spec, kwargs spec, index)``;
    outputs are named by the index in the recording), ``split``
    (index of the first operation of the loss), ``model_out`` (name of the model's output, when it
    is one tensor) and ``loss_out`` (name of the loss function's output)."""

    __slots__ = ("entries", "split", "model_out", "loss_out", "unmatchable", "grad_off",
                 "_at_batch", "_outside", "_generators", "_lifted", "shapes", "exported",
                 "meta", "grad_off_index", "sigs")

    def __init__(self) -> None:
        self.entries: list[tuple[Any, tuple, dict, int]] = []
        #: recording index -> the shape of each tensor output as the proof saw it (a size: an int,
        #: or ``(sympy expression, int)`` for a symbolic one), None for a non-tensor output
        self.shapes: dict[int, list[tuple[Any, ...] | None]] = {}
        #: recording index -> :func:`_meta` of the operation's tensor arguments and outputs
        self.meta: dict[int, tuple] = {}
        #: key -> the autograd node signature (_node_facts) of what each operation made
        self.sigs: dict[Any, tuple] = {}
        self.split = 0
        self.model_out: Any = None
        self.loss_out: Any = None
        #: why the recorded run cannot be matched (a fake tensor from outside the call), or None
        self.unmatchable: str | None = None
        #: positions (in ``entries``) of the operations the proof ran with grad mode off: the real
        #: run must run each with the same grad mode (thirty-fifth hostile review: grad mode
        #: flipped for one operation from example data read unseen, LOO 3.24 C)
        self.grad_off: set[int] = set()
        #: the same operations by their recording index (the name their outputs carry)
        self.grad_off_index: set[int] = set()
        self._at_batch: dict[int, list[tuple[Any, tuple, dict]]] = {}
        self._outside: list[Any] | None = None
        self._generators: list[Any] | None = None
        self._lifted: frozenset[int] | None = None
        #: ``(exported program, names of its uniform constants, whether it had grad-mode or
        #: autocast regions)`` of a proof that passed (dpclip.engine.compiled), else None
        self.exported: Any = None

    def generators(self) -> list[Any]:
        """The explicit ``generator=`` arguments of the recorded draws (read once: the entries
        do not change after the recording, and the specs hold the generators themselves)."""
        if self._generators is None:
            found: dict[int, Any] = {}
            for _, a, kw, _ in self.entries:
                for spec in list(a) + list(kw.values()):
                    if spec[0] == "v" and isinstance(spec[1], torch.Generator):
                        found[ident(spec[1])] = spec[1]
            self._generators = list(found.values())
        return self._generators

    def lifted(self) -> frozenset[int]:
        """Positions (in :attr:`entries`) of the operations with a literal (``"c"``) argument
        (read once, as :meth:`generators`)."""
        if self._lifted is None:
            self._lifted = frozenset(k for k, (_, a, kw, _) in enumerate(self.entries)
                                     if any(s[0] == "c" for s in list(a) + list(kw.values())))
        return self._lifted

    def outside(self) -> list[Any]:
        """Weak references to the tensors from outside the call that the recording uses."""
        if self._outside is None:
            found: dict[int, Any] = {}

            def walk(spec: tuple) -> None:
                if spec[0] == "x":
                    found[ident(spec[1])] = spec[1]
                elif spec[0] == "l":
                    for x in spec[2]:
                        walk(x)

            for _, a, kw, _ in self.entries:
                for spec in list(a) + list(kw.values()):
                    walk(spec)
            self._outside = list(found.values())
        return self._outside

    def shape(self, name: Any, batch: int) -> tuple[int, ...] | None:
        """The shape the proof's tensor ``name`` (an operation's output) has at ``batch``, or None
        (not an operation's output, or a size that has no value there)."""
        if name[0] != "op":
            return None
        outs = self.shapes.get(name[1])
        if outs is None or name[2] >= len(outs) or outs[name[2]] is None:
            return None
        got = []
        for d in outs[name[2]]:
            if isinstance(d, int):
                got.append(d)
                continue
            try:
                got.append(int(d[0].xreplace({s: batch for s in d[0].free_symbols})))
            except (TypeError, ValueError):
                return None
        return tuple(got)

    def leading_symbolic(self, name: Any) -> bool:
        """Whether the proof's tensor ``name`` (an operation's output) has a first size that
        involves the batch size (its rows are the examples')."""
        outs = self.shapes.get(name[1]) if name[0] == "op" else None
        if outs is None or name[2] >= len(outs) or outs[name[2]] is None or not outs[name[2]]:
            return False
        return not isinstance(outs[name[2]][0], int)

    def symbolic_at(self, name: Any, dim: int) -> bool:
        """Whether the proof's tensor ``name`` (an operation's output) has a size in dimension
        ``dim`` that involves the batch size (:meth:`leading_symbolic` for ``dim`` 0; a recurrent
        layer's final states hold the examples in dimension 1)."""
        outs = self.shapes.get(name[1]) if name[0] == "op" else None
        if outs is None or name[2] >= len(outs) or outs[name[2]] is None or \
                len(outs[name[2]]) <= dim:
            return False
        return not isinstance(outs[name[2]][dim], int)

    def symbolic(self, name: Any) -> bool:
        """Whether the shape of the proof's tensor ``name`` involves the batch size."""
        outs = self.shapes.get(name[1]) if name[0] == "op" else None
        if outs is None or name[2] >= len(outs) or outs[name[2]] is None:
            return False
        return any(not isinstance(d, int) for d in outs[name[2]])

    def at(self, batch: int) -> list[tuple[Any, tuple, dict, int]]:
        """The entries with every symbolic number evaluated at ``batch`` (cached per batch)."""
        got = self._at_batch.get(batch)
        if got is None:
            got = [(f, tuple(_concrete(s, batch) for s in a),
                    {k: _concrete(s, batch) for k, s in kw.items()}, i)
                   for f, a, kw, i in self.entries]
            if len(self._at_batch) >= 32:
                self._at_batch.clear()
            self._at_batch[batch] = got
        return got


def _shape_spec(t: Tensor) -> tuple[Any, ...]:
    """A tensor's shape in the proof: ints, and ``(expression, int)`` for symbolic sizes."""
    got: list[Any] = []
    for d in t.shape:
        if isinstance(d, torch.SymInt):
            expr = d.node.expr
            got.append((expr, int) if expr.free_symbols else int(expr))
        else:
            got.append(int(d))
    return tuple(got)


def _concrete(spec: tuple, batch: int) -> tuple:
    kind = spec[0]
    if kind == "s":
        expr = spec[1]
        value = expr.xreplace({s: batch for s in expr.free_symbols})
        py = spec[2]
        try:
            return ("v", py(value))
        except (TypeError, ValueError):  # not a number at this batch size: never equal
            return ("?", "a symbolic number of the proof has no value here")
    if kind == "l":
        return ("l", spec[1], tuple(_concrete(s, batch) for s in spec[2]))
    return spec


class _Names:
    """Tensor identity -> name, without keeping tensors alive (weak references checked on read,
    as :class:`dpclip.engine.separable._IdMap`)."""

    __slots__ = ("d",)

    def __init__(self) -> None:
        self.d: dict[int, tuple[Any, Any]] = {}

    def get(self, t: Tensor) -> Any:
        e = self.d.get(ident(t))
        return e[1] if e is not None and e[0]() is t else None

    def set(self, t: Tensor, name: Any) -> None:
        self.d[ident(t)] = (weakref.ref(t), name)


#: the name of a tensor written since it was named by no matched operation (see _Versioned)
_STALE_NAME = ("stale",)


class _Versioned(_Names):
    """Names of the real run, each with the tensor's version counter when it was named: a tensor
    written since by no matched operation (an in-place call with Python dispatch or torch functions
    switched off, which neither the trace nor the match sees) no longer stands for its name (it is
    ``_STALE_NAME``). A matched write moves the expected version of every tensor on the written
    storage (:meth:`written`): autograd bumps the counter once per written argument, after the
    dispatch mode has seen the call. Second hostile review: ``h2.mul_(len(x) - 7)`` under
    ``torch._C._DisableTorchDispatch()`` kept ``h2``'s name: LOO 3.16 C."""

    __slots__ = ("_pending", "_by_storage")

    def __init__(self) -> None:
        super().__init__()
        #: keys named since the last write (their storages not indexed yet)
        self._pending: list[int] = []
        #: storage data pointer -> keys of the names on it (indexed when a write needs them)
        self._by_storage: dict[int, set[int]] = {}

    def get(self, t: Tensor) -> Any:
        e = self.d.get(ident(t))
        if e is None or e[0]() is not t:
            return None
        return e[1] if e[2] == t._version else _STALE_NAME

    def set(self, t: Tensor, name: Any, version: int | None = None) -> None:
        """``version``: the counter ``t`` will have (a view made by the call being matched gets
        its base's counter only when the call returns, after the dispatch mode)."""
        key = ident(t)
        self.d[key] = (weakref.ref(t), name, t._version if version is None else version)
        self._pending.append(key)

    def written(self, bumps: dict[int, int]) -> None:
        """A matched operation writes storages (data pointer -> number of written arguments on
        it): the tensors on them that are in step with their counters expect that many more.
        The names are indexed by storage once (a tensor's storage does not move without a write,
        and a write by no matched operation has already made it stale)."""
        by = self._by_storage
        for key in self._pending:
            e = self.d.get(key)
            t = e[0]() if e is not None else None
            if t is not None:
                by.setdefault(_storage(t), set()).add(key)
        self._pending.clear()
        for skey, n in bumps.items():
            for key in list(by.get(skey, ())):
                e = self.d.get(key)
                t = e[0]() if e is not None else None
                if t is None or _storage(t) != skey:  # freed, or the id now names another
                    by[skey].discard(key)
                elif t._version == e[2]:
                    self.d[key] = (e[0], e[1], e[2] + n)


def storage_key(t: Tensor) -> int:
    """The key of ``t``'s storage in :attr:`CallWindow.written` (its data pointer)."""
    return _storage(t)


def _unversioned_alias(func: Any, args: tuple, kwargs: dict, out: Any) -> Tensor | None:
    """The input tensor whose memory an output of ``func`` shares although the operation's schema
    declares no alias (``_unsafe_view``, ``unsafe_split``, ``unsafe_chunk``: the output gets a
    version counter of its own), or None. ``detach`` and ``lift_fresh`` share their input's
    counter."""
    if func is _DETACH or func is _LIFT_FRESH or func is _LIFT_FRESH_COPY or \
            any(r is not None for r in _ret_alias(func)):
        # (an output its schema says aliases an input: a view, which autograd makes share
        # the input's version counter above this mode, or the written tensor itself)
        return None
    outs = [o for o in _outputs(out) if isinstance(o, Tensor) and not o._is_view()]
    if not outs:
        return None
    ins = [t for a in (*args, *kwargs.values())
           for t in (a if isinstance(a, (list, tuple)) else (a,)) if isinstance(t, Tensor)]
    for o in outs:
        if any(o is t for t in ins) or not o.numel():
            continue
        so = _storage(o)
        if so in (-1, 0):
            continue
        for t in ins:
            if t.numel() and _storage(t) == so:
                return t
    return None


def _storage(t: Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - no storage (a fake or sparse tensor): never matched
        return -1


#: operation -> for each return, the (position, name, keyword-only) of the argument it aliases,
#: or None (read from the schema once per operation)
_RET_ALIAS: dict[int, tuple[Any, tuple[Any, ...]]] = {}
#: operation -> the (position, name, keyword-only) of the arguments its schema writes
_WRITES: dict[int, tuple[Any, tuple[tuple[int, str, bool], ...]]] = {}


def _arg(spec: tuple[int, str, bool], args: tuple, kwargs: dict) -> Any:
    i, name, kw_only = spec
    return kwargs.get(name) if kw_only or i >= len(args) else args[i]


def _ret_alias(func: Any) -> tuple[Any, ...]:
    e = _RET_ALIAS.get(ident(func))
    if e is not None and e[0] is func:
        return e[1]
    schema, found = func._schema, []
    for ret in schema.returns:
        info, hit = ret.alias_info, None
        if info is not None:
            for i, arg in enumerate(schema.arguments):
                a_info = arg.alias_info
                if a_info is not None and a_info.before_set & info.before_set:
                    hit = (i, arg.name, arg.kwarg_only)
                    break
            if hit is None and not info.before_set and str(ret.type) == "List[Tensor]":
                # ``Tensor(a -> *) self -> Tensor(a)[]`` (split, chunk, unbind): every tensor of
                # the list is a view of ``self``; the list's own annotation names no set
                views = [(i, arg.name, arg.kwarg_only) for i, arg in enumerate(schema.arguments)
                         if arg.alias_info is not None and "*" in arg.alias_info.after_set]
                hit = views[0] if len(views) == 1 else None
        found.append(hit)
    got = tuple(found)
    _RET_ALIAS[ident(func)] = (func, got)
    return got


def _out_versions(func: Any, args: tuple, kwargs: dict, outs: list) -> list[int | None]:
    """The version counter each output of the call will have once it returns: a view's is its
    base argument's (shared), else the output's own."""
    got: list[int | None] = []
    alias = _ret_alias(func)
    try:
        for j, o in enumerate(outs):
            v = None
            if o is not None:
                v = o._version
                # (one list return: every output is one of its tensors)
                hit = alias[j] if j < len(alias) else alias[0] if len(alias) == 1 else None
                if hit is not None:
                    a = _arg(hit, args, kwargs)
                    if isinstance(a, Tensor):
                        v = a._version
            got.append(v)
    except RuntimeError as exc:  # "Inference tensors do not track version counter"
        raise _NoVersion(str(exc)) from exc
    return got


class _NoVersion(Exception):
    """A tensor of the call has no version counter (an inference tensor)."""


def _write_specs(func: Any) -> tuple:
    """The arguments of ``func``'s schema that it writes (cached per operation)."""
    e = _WRITES.get(ident(func))
    if e is not None and e[0] is func:
        return e[1]
    specs = tuple((i, arg.name, arg.kwarg_only) for i, arg in enumerate(func._schema.arguments)
                  if arg.alias_info is not None and arg.alias_info.is_write)
    _WRITES[ident(func)] = (func, specs)
    return specs


def _written(func: Any, args: tuple, kwargs: dict) -> dict[int, int]:
    """Storage data pointer -> number of arguments of the call that its schema writes."""
    bumps: dict[int, int] = {}
    for spec in _write_specs(func):
        v = _arg(spec, args, kwargs)
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(t, Tensor):
                k = _storage(t)
                bumps[k] = bumps.get(k, 0) + 1
    return bumps


def _written_tensors(func: Any, args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensor arguments the schema of ``func`` writes (cached as :func:`_written`)."""
    out: list[Tensor] = []
    for spec in _write_specs(func):
        v = _arg(spec, args, kwargs)
        out.extend(t for t in (v if isinstance(v, (list, tuple)) else (v,))
                   if isinstance(t, Tensor))
    return out


def _state_names(model: Any, names: _Names, only_new: bool = False) -> None:
    """Name the parameters and buffers of ``model`` (first name of a tied tensor); with
    ``only_new``, keep the names tensors already have (an in-place write renames a parameter to
    the write's output, in the proof as in the run)."""
    if not isinstance(model, nn.Module):
        return
    seen: set[int] = set()
    for prefix, what in (("p", model.named_parameters(remove_duplicate=False)),
                         ("b", model.named_buffers(remove_duplicate=False))):
        for name, t in what:
            if t is not None and ident(t) not in seen:
                seen.add(ident(t))
                if not (only_new and names.get(t) is not None):
                    names.set(t, (prefix, name))


def _input_names(xs: Any, ys: Any, names: _Names) -> None:
    """Name each input leaf by the set of leaf positions its object occupies (a language model's
    targets are often its input ids, one object; a chunk of them is two): a real input matches a
    proof's input when the positions meet."""
    where: dict[int, tuple[Tensor, list[int]]] = {}
    for i, t in enumerate(pytree.tree_leaves((xs, ys))):
        if isinstance(t, Tensor):
            where.setdefault(ident(t), (t, []))[1].append(i)
    for t, idx in where.values():
        names.set(t, ("in", frozenset(idx)))


#: the calling thread's next autograd sequence number
_SEQUENCE_NR = torch._C._autograd._get_sequence_nr
#: the autograd nodes of ATen's view operations (C++ classes; a Python Function's node is
#: ``<name>Backward`` without the number): the links a view's history may have between the view
#: and its base (the view's own nodes, or the ``AsStridedBackward0`` autograd regenerates after
#: its base was written)
_VIEW_NODES = frozenset(f"{n}Backward{i}" for n in (
    "AsStrided", "View", "Slice", "Select", "Transpose", "T", "Permute", "Expand", "Unsqueeze",
    "Squeeze", "Unbind", "Split", "SplitWithSizes", "Diagonal", "Unfold", "Alias", "ViewAsReal",
    "ViewAsComplex", "ReshapeAlias", "Real", "Imag", "NegView", "Conj", "Narrow", "TensorSplit",
    "Indices", "Values") for i in range(4))
_PY_NODE = torch._C._FunctionBase  # (every Python Function's node, whatever its class says)
#: the longest chain of view nodes walked from a view to its base
_VIEW_DEPTH = 64


def _view_node(g: Any) -> bool:
    """``g`` is the autograd node of an ATen view (a C++ class of :data:`_VIEW_NODES`)."""
    return (type(g).__name__ in _VIEW_NODES and type(g).__module__ == "builtins"
            and not isinstance(g, _PY_NODE))


def _edges_of(args: tuple, kwargs: dict) -> tuple[tuple, tuple]:
    """``(edges, leaves)``: the gradient edges an operation on these arguments links its own
    node to: each tensor argument's ``(grad_fn, output_nr)``, and the leaves whose accumulators
    it may link to. Read when the operation reaches this mode: below autograd, so a tensor it
    writes still carries its node from before the write. (Not the nodes below an argument's
    view nodes: an edge straight to a view's base skipped the view's transpose and handed every
    example another example's feature, 4.98 C; hundred-and-sixty-first hostile review.)"""
    edges: list[tuple[Any, int]] = []
    leaves: list[Tensor] = []
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if not isinstance(t, Tensor) or not t.requires_grad:
                continue
            g = t.grad_fn
            if g is None:
                leaves.append(t)
            else:
                edges.append((g, t.output_nr))
    return tuple(edges), tuple(leaves)


def _linked(g: Any, allowed: tuple[tuple, tuple]) -> bool:
    """Every edge of ``g`` leads to one of ``allowed``'s edges (node and input number) or to the
    accumulator of one of its leaves (:func:`_edges_of` of the operation that made it)."""
    edges, leaves = allowed
    for nf, nr in g.next_functions:
        if nf is None or any(nf is n and nr == r for n, r in edges):
            continue
        if type(nf).__name__ == "AccumulateGrad" and any(nf.variable is t for t in leaves):
            continue
        return False
    return True


#: a value the proof saw symbolic (a size with the batch in it): any number matches it
_SYM = ("sym",)
#: node class -> the names of its saved attributes (``_saved_*``)
_SAVED_ATTRS: dict[type, tuple[str, ...]] = {}


def _fact(v: Any, tensors: tuple, real: bool) -> Any:
    """A saved attribute as compared between the proof and the real run: a plain value as it is,
    a symbolic one as :data:`_SYM`, a tensor by the position of the operation's argument or
    output it is (the real run: an alias with the same geometry; what autograd made itself, such
    as an in-place operation's copy of its input, has no position)."""
    if v is None or type(v) in (bool, int, float, str):
        return v
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return _SYM
    if isinstance(v, Tensor):
        args, outs = tensors[0], tensors[1]
        where: list[Any] = ["t", None, None]
        for slot, group in ((1, args), (2, outs)):
            for i, t in enumerate(group):
                if v is t or (real and torch._C._is_alias_of(v, t) and v.shape == t.shape and
                              v.stride() == t.stride() and
                              v.storage_offset() == t.storage_offset() and v.dtype == t.dtype):
                    where[slot] = i
                    break
        return tuple(where)
    if isinstance(v, (tuple, list)):
        items = tuple(_fact(x, tensors, real) for x in v)
        return _SYM if not real and any(x is _SYM for x in items) else items
    return ("?", type(v).__name__)


def _node_facts(g: Any, tensors: tuple, real: bool) -> tuple:
    """What an operation's autograd node is, compared between the proof's node and the real
    run's: its class and module and every saved attribute (``alpha``, dims, which argument or
    output each saved tensor is). A history rewritten unseen into a node of another class
    (``detach_`` then ``addmm_`` onto the matched operation's argument: 14.3 C, hundred-and-
    fifty-sixth hostile review), of the same class with another scalar (``add_(z, alpha=K)``:
    13.3 C) or saving another tensor (``mul_`` on a detached copy holding other values: 13.3 C,
    hundred-and-fifty-eighth) differs from the proof's; where its edges lead is checked on the
    real run's own tensors (:func:`_linked`)."""
    cls = type(g)
    names = _SAVED_ATTRS.get(cls)
    if names is None:
        names = _SAVED_ATTRS[cls] = tuple(sorted(
            a for a in dir(g) if a.startswith("_saved_")))
    facts: list[Any] = []
    for a in names:
        before = unpacks()
        try:
            v = getattr(g, a)
        except Exception:  # noqa: BLE001 - a saved tensor freed or written since: no value
            facts.append((a, ("error",)))
            continue
        ours = unpacks() - before == _count_tensors(v)
        if real and not ours and not (
                isinstance(v, Tensor) and v.dim() == 0 and _scalar_arg(v, tensors[2])):
            # (read back through saved-tensor hooks other than the step's watch: the forward
            # pushed its own around a hidden operation, and its unpack gave this check the
            # operation's own arguments and the backward other values: 13.3 C, hundred-and-
            # fifty-ninth hostile review; a Python number the operation took is saved as a
            # wrapped 0-dim tensor without any hooks: its value is the argument's)
            facts.append((a, ("foreign",)))
            continue
        fact = _fact(v, tensors, real)
        if real and ours and fact == ("t", None, None) and len(tensors) > 3 and tensors[3] and \
                not any(_same_bytes(v, w) for w in tensors[3]):
            # (a copy autograd made of what an in-place operation overwrote, holding other
            # values: the forward rebuilt the node after writing other values into the detached
            # tensor, 13.3 C; hundred-and-fifty-ninth hostile review, the gap it measured)
            fact = ("t", "other values")
        facts.append((a, fact))
    # (which edges are cut: a rewrite onto a detached tensor drops the edge to the operation's
    # input, a gradient cut the proof does not make)
    cut = tuple(nf is None for nf, _ in g.next_functions)
    # (the class OBJECT, not its name: a Python Function's node class named TanhBackward0 in
    # module "builtins", with a _saved_result property of its own, passed a name comparison:
    # 4.23 C, hundred-and-sixty-second hostile review)
    return (cls, cut, tuple(facts))


def _scalar_arg(v: Tensor, scalars: tuple) -> bool:
    """``v`` (a 0-dim tensor) holds one of the Python numbers the operation took."""
    with torch._C.DisableTorchFunction(), _disable_current_modes():
        x = v.item()
    return any(type(c) is type(x) and c == x or (type(c) is int and type(x) is float and
                                                 float(c) == x) for c in scalars)


def _same_bytes(a: Tensor, b: Tensor) -> bool:
    """``a`` and ``b`` hold the same bytes (shape and dtype too; NaNs compare as bits)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    with torch._C.DisableTorchFunction(), _disable_current_modes(), _cm.no_grad():
        x, y = a.detach().contiguous(), b.detach().contiguous()
        if x.is_complex():
            x, y = torch.view_as_real(x), torch.view_as_real(y)
        if x.dtype.is_floating_point and x.element_size() in (2, 4, 8):
            int_of = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
            x, y = x.view(int_of), y.view(int_of)
        return bool(torch.equal(x, y))


def _count_tensors(v: Any) -> int:
    if isinstance(v, Tensor):
        return 1
    if isinstance(v, (tuple, list)):
        return sum(_count_tensors(x) for x in v)
    return 0


def _facts_match(want: Any, got: Any) -> bool:
    """``got`` (the real run's :func:`_node_facts`) is ``want`` (the proof's), a symbolic value
    of the proof matching any number or tuple of numbers."""
    if want is _SYM or want == _SYM:
        return got is None or type(got) in (int, float, bool) or (
            isinstance(got, tuple) and all(type(x) in (int, float, bool) for x in got))
    if want is None and isinstance(got, tuple) and len(got) == 3 and got[0] == "t" and \
            got[2] is not None:
        return True  # (the proof's run reads a saved OUTPUT back as None)
    if isinstance(want, tuple) and isinstance(got, tuple):
        return len(want) == len(got) and all(_facts_match(w, x) for w, x in zip(want, got))
    if isinstance(want, type) or isinstance(got, type):
        return want is got  # (a node class: by identity, never by a metaclass's __eq__)
    return want == got and type(want) is type(got)


def _op_tensors(args: tuple, kwargs: dict, outs: Any) -> tuple[tuple, tuple, tuple]:
    """The tensors of an operation's arguments (lists one level deep), its outputs, and the
    Python numbers among its arguments."""
    got: list[Tensor] = []
    scalars: list[Any] = []
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, Tensor):
                got.append(t)
            elif type(t) in (int, float, bool):
                scalars.append(t)
    return tuple(got), tuple(o for o in outs if isinstance(o, Tensor)), tuple(scalars)


def _pending_of(func: Any, index: int, args: tuple, kwargs: dict, outs: Any) -> list:
    """``[(tensor, key, allowed, tensors)]``: the tensors whose autograd node an operation
    (recording index ``index``) made, to be checked at the next operation: its outputs that are
    not views (``("op", index, j)``), and the root of each tensor it writes that is not one of
    them (``("w", index, i)``: an in-place write through a view rebases its base onto
    CopySlices); with the nodes their node may link to (:func:`_edges_of`) and the operation's
    tensors (:func:`_node_facts`)."""
    allowed = _edges_of(args, kwargs)
    tensors = _op_tensors(args, kwargs, outs)
    got = [(o, ("op", index, j), allowed, tensors) for j, o in enumerate(outs)
           if isinstance(o, Tensor) and not o._is_view()]
    seen = {ident(o) for o, *_ in got}
    for i, w in enumerate(_written_tensors(func, args, kwargs)):
        root = w._base if w._is_view() else w
        if root is not None and ident(root) not in seen:
            seen.add(ident(root))
            prior = root.grad_fn  # (its node before the write: CopySlices links to it)
            got.append((root, ("w", index, i), allowed if prior is None else (
                (*allowed[0], (prior, root.output_nr)), allowed[1]), tensors))
    return got


def _meta(args: tuple, kwargs: dict, out: Any) -> tuple:
    """What decides how an operation reads its tensors and what it makes, beyond their names and
    memory: the dtype and the negative and conjugate bits of every tensor argument (lists one
    level deep) and whether it requires grad, and the default dtype. ``torch._C._set_neg`` flips
    how a tensor reads with no
    operation, no version bump and the same bytes; a default dtype switched around one factory
    call makes its output another dtype with the same arguments (hundred-and-thirty-seventh
    hostile review: each carried the padded batch size into a sign: 60.6 C under ghost, auto and
    compiled). (Not the outputs' dtypes: some fake kernels give other dtypes than the real ones,
    ``native_layer_norm``'s statistics of a bfloat16 input; they follow from the arguments and
    the default dtype.) Whether an argument requires grad tells where the real run cut the
    gradient: a ``detach`` (matched as an identity) or a recomputation under ``no_grad`` (named
    as the proof's operation) added in the real run only, from the padded batch size, cut every
    example's gradient through a layer: 18.5 C, 36.5 C (hundred-and-forty-fifth hostile review)."""
    got: list[Any] = [torch.get_default_dtype()]

    def add(t: Tensor) -> None:
        got.append((t.dtype, t.is_neg(), t.is_conj(), t.requires_grad))

    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            add(a)
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, Tensor):
                    add(b)
    return tuple(got)


def _outputs(out: Any) -> list[Tensor | None]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [o if isinstance(o, Tensor) else None for o in out]
    return []


class ProgramRecorder(TorchDispatchMode):
    """Records the proof's operations (entered inside the proof's traced function, around the
    model and the loss). ``model``: the module whose parameters and buffers are named."""

    def __init__(self, model: Any, xs: Any, ys: Any) -> None:
        super().__init__()
        self.program = ProvedProgram()
        self._names = _Names()
        self._keep: list[Any] = []  # the proof's tensors stay alive while it records
        self.paused = False
        self._count = 0
        self._split = 0
        #: what the last operation made, its node signed at the next one (_node_facts)
        self._pending: list[tuple[Any, ...]] = []
        _state_names(model, self._names)
        _input_names(xs, ys, self._names)

    def _sign_pending(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        with torch._C.DisableTorchFunction(), _disable_current_modes():
            for t, key, _, tensors in pending:
                g = t.grad_fn if t.requires_grad else None
                if g is not None:
                    self.program.sigs[key] = _node_facts(g, tensors, real=False)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = call_op(func, args, kwargs)
        if self.paused or _skip(func):
            return out
        self._sign_pending()
        outs = [o for o in _outputs(out) if o is not None]
        if outs and not any(is_fake(o) for o in outs):
            # ran outside the proof's fake world (the tracer's own copy of a torch.tensor
            # literal): not the program; a later use of its output would be a tensor from outside
            # the call by identity, which no real run has
            return out
        if _identity(func, args, kwargs, out):
            name = self._names.get(args[0])
            if name is not None:
                self._names.set(out, name)
                self._keep.append(out)
                return out
        k = self._count
        self._count += 1
        lift = "lift" if func is _LIFT_FRESH or func is _LIFT_FRESH_COPY else None
        if lift is not None:
            func = _LIFT_FRESH
        spec_args = tuple(self._spec(a, lift) for a in args)
        spec_kwargs = {key: self._spec(v, lift) for key, v in kwargs.items()}
        if not torch.is_grad_enabled():
            self.program.grad_off.add(len(self.program.entries))
            self.program.grad_off_index.add(k)
        self.program.entries.append((func, spec_args, spec_kwargs, k))
        self.program.shapes[k] = [None if o is None else _shape_spec(o) for o in _outputs(out)]
        self.program.meta[k] = _meta(args, kwargs, out)
        for j, o in enumerate(_outputs(out)):
            if o is not None:
                self._names.set(o, ("op", k, j))
                self._keep.append(o)
        if torch.is_grad_enabled():
            self._pending = _pending_of(func, k, args, kwargs, _outputs(out))
        return out

    def _spec(self, a: Any, lift: str | None) -> tuple:
        if isinstance(a, Tensor):
            name = self._names.get(a)
            if name is not None:
                return ("t", name)
            if is_fake(a):
                why = ("a fake tensor from outside the call (state written during an earlier "
                       "proof)")
                if self.program.unmatchable is None:
                    self.program.unmatchable = why
                return ("?", why)
            if lift is not None:  # a real tensor: copied outside the proof's fake mode
                with _disable_current_modes():
                    return ("c", a.detach().clone())
            self._keep.append(a)
            return ("x", weakref.ref(a))
        if _is_symbolic(a):
            py = int if isinstance(a, torch.SymInt) else float if isinstance(a, torch.SymFloat) \
                else bool
            return ("s", a.node.expr, py)
        if isinstance(a, (list, tuple)):
            return ("l", type(a), tuple(self._spec(x, lift) for x in a))
        return ("v", a)

    @_cm.contextmanager
    def engine(self) -> Iterator[None]:
        """The engine's own code in the proof (the batch-less expansion): not recorded."""
        paused, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = paused

    def alias(self, new: Tensor, old: Tensor) -> None:
        """``new`` (made by engine code) stands for ``old`` in the user's program."""
        name = self._names.get(old)
        if name is not None:
            self._names.set(new, name)
            self._keep.append(new)

    def model_output(self, out: Any) -> None:
        self._split = self._count
        if isinstance(out, Tensor):
            self.program.model_out = self._names.get(out)

    def loss_output(self, out: Any) -> None:
        self.program.loss_out = self._names.get(out) if isinstance(out, Tensor) else None
        self._sign_pending()  # (the real run checks the last operation's at the loss)

    def finish(self) -> ProvedProgram:
        """The recording without its dead code: pure operations (:func:`_pure`) none of whose
        outputs reaches the model's output, the losses or an operation that is kept."""
        self._keep.clear()
        self._pending = []
        prog = self.program
        used: set[int] = set()  # indices of the operations whose outputs are used
        _names_in(("l", tuple, tuple(("t", n) for n in (prog.model_out, prog.loss_out)
                                     if n is not None)), used)
        kept = []
        for e in reversed(prog.entries):
            func, a, kw, index = e
            if _pure(func) and index not in used:
                continue
            kept.append(e)
            for spec in list(a) + list(kw.values()):
                _names_in(spec, used)
        prog.entries = kept[::-1]
        prog.split = sum(1 for e in prog.entries if e[3] < self._split)
        return prog


def _names_in(spec: tuple, used: set[int]) -> None:
    """Add the indices of the recorded operations whose outputs ``spec`` names to ``used``."""
    if spec[0] == "t":
        if spec[1][0] == "op":
            used.add(spec[1][1])
    elif spec[0] == "l":
        for s in spec[2]:
            _names_in(s, used)


_OUTSIDE_FUNCTIONS = (
    "operation {k} ({op}) was called outside torch's own functions (with torch functions "
    "switched off, or by user code that a torch function ran: an argument's "
    "__torch_function__, __index__ or __len__, a callback, a trace or profile function): its "
    "output's autograd history could be rewritten before any check sees it; call torch's "
    "functions as usual, on tensors and Python numbers")


def _first_tensors(v: Any) -> list[Tensor]:
    """The tensors of ``v``: a tensor, or a list or tuple of them (one level)."""
    if isinstance(v, Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for t in v if isinstance(t, Tensor)]
    return []


#: function -> whether it may write its first argument in place (by its name: ``add_``,
#: ``__setitem__``, ``__iadd__``; a Python function with an ``inplace`` parameter, F.relu; an
#: ATen operation (``torch.ops.aten.add_.Tensor``) by its schema; a function's ``out=`` argument
#: is taken as written too). Not :data:`_WRITES` (the schemas' written arguments): one name for
#: both made either cache answer the other's question (a bool where the specs were read, a
#: crash, or no snapshot of the written node; hundred-and-eighty-sixth hostile review)
_WRITES_FIRST: dict[int, tuple[Any, bool]] = {}


def _writes_first(func: Any) -> bool:
    e = _WRITES_FIRST.get(ident(func))
    if e is not None and e[0] is func:
        return e[1]
    name = getattr(func, "__name__", "") or ""
    code = getattr(getattr(func, "__func__", func), "__code__", None)
    schema = getattr(func, "_schema", None) if isinstance(func, torch._ops.OpOverload) else None
    got = (schema is not None and any(a.alias_info is not None and a.alias_info.is_write
                                      for a in schema.arguments[:1])) or \
        (code is not None and "inplace" in code.co_varnames[:code.co_argcount +
                                                               code.co_kwonlyargcount]) or \
        (name.endswith("_") and not name.endswith("__")) or name in ("__setitem__", "__set__") or \
        (name.startswith("__i") and name.endswith("__") and name not in ("__init__",
                                                                         "__index__",
                                                                         "__int__",
                                                                         "__invert__",
                                                                         "__iter__"))
    _WRITES_FIRST[ident(func)] = (func, got)
    return got


def _product_node_classes() -> frozenset:
    """The autograd node classes of ``mm``, ``addmm``, ``bmm`` and ``baddbmm`` (torch's own C++
    classes, taken from real calls at import: a custom Function named like them is another
    class): they save their inputs, never their result."""
    with torch.enable_grad():
        a = torch.zeros(1, 1, requires_grad=True)
        b = torch.zeros(1, 1, 1, requires_grad=True)
        return frozenset({type(torch.mm(a, a).grad_fn), type(torch.addmm(a, a, a).grad_fn),
                          type(torch.bmm(b, b).grad_fn), type(torch.baddbmm(b, b, b).grad_fn)})


#: see :func:`_product_node_classes`
_PRODUCTS_SAVING_INPUTS = _product_node_classes()


class ProgramMatch:
    """Matches a real run's operations against a :class:`ProvedProgram` at batch size ``batch``.
    Fed by :class:`dpclip.engine.separable.SeparabilityTracer` (every non-engine operation);
    :attr:`mismatch` holds the first difference, or None."""

    __slots__ = ("armed", "_pending", "hooks", "program", "entries", "k", "names", "mismatch", "done", "_model", "extra",
                 "first_extra", "window", "_state_done", "outside", "_rng", "watch", "_lifted",
                 "_leaves", "calls", "_fresh", "_history", "_saved_watch", "_snap",
                 "_dropped", "fn_depth", "_stamps", "_calls", "_call_seq", "_made_in",
                 "_kernels", "_uses", "_unsafe_of", "_rewritten", "_born_in", "_saved_at")

    def __init__(self, program: ProvedProgram, batch: int, model: Any, xs: Any, ys: Any) -> None:
        self.program = program
        self.entries = program.at(batch)
        self.k = 0
        self.names = _Versioned()
        self.mismatch: str | None = program.unmatchable
        self.done = False
        self._model = model
        self._state_done = False  # parameters and buffers: named below, before the run
        #: operations of the real run without effects that matched nothing (see _pure)
        self.extra = 0
        self.first_extra: str | None = None
        #: position after the last write (or draw) matched: pure operations matched since then
        #: may be recomputed (see _recomputed)
        self.window = 0
        #: the outputs of the last matched operation (and the tensors a matched write rebased)
        #: with the thread's autograd counter when this mode saw it: their node must be older
        #: (checked at the next operation: see _check_history)
        self._fresh: list[tuple[Any, ...]] = []
        #: ident -> (weak ref, grad_fn) of every output checked so: its autograd history as the
        #: matched operation made it, compared at each later use
        self._history: dict[int, tuple[Any, Any]] = {}
        #: the step's saved-tensor watch while the forward and loss run (see watching)
        self._saved_watch: SavedTensorWatch | None = None
        #: storage data pointer -> the tensors autograd saved there (see saved; held, so that
        #: the storage cannot be freed and its address reused): no accepted write may reach
        #: that storage before the loss returns
        self._saved_at: dict[int, list[Tensor]] = {}
        #: (operation, copies of what it writes, taken before it ran): see before
        self._snap: tuple[Any, tuple] | None = None
        #: ident -> weak ref of each view whose record a matched write dropped (_view_holds)
        self._dropped: dict[int, Any] = {}
        #: how many of torch's own functions are running (the tracer's torch-function mode:
        #: :meth:`fn_enter`); an operation matched at depth 0 was called with torch functions off
        self.fn_depth = 0
        #: ident -> (weak ref, grad_fn) of each tensor one of torch's own functions returned (or
        #: wrote in place), taken when that function returned, before any user code ran
        self._stamps: dict[int, tuple[Any, Any]] = {}
        #: the numbers of the calls of torch's functions running now, innermost last (each call
        #: gets the next number of ``_call_seq``): an operation's output is made in the
        #: innermost one
        self._calls: list[int] = []
        self._call_seq = 0
        #: ident -> (weak ref, the call it was made in) of each checked output (_history_holds)
        self._made_in: dict[int, tuple[Any, Any]] = {}
        #: ident -> how many operations took the tensor as an argument (_history_holds)
        self._uses: dict[int, int] = {}
        #: ident of an ``_unsafe_view``'s output -> (weak ref to it, weak ref to its input): the
        #: output shares the input's storage without being a view (matmul's decomposition:
        #: ``mm(x.view(-1, n), w)._unsafe_view(B, T, m)``), see :meth:`_step`
        self._unsafe_of: dict[int, tuple[Any, Any]] = {}
        #: ident -> weak ref of a tensor whose storage a matched write through its
        #: ``_unsafe_view`` rewrote: any later use fails (_history_holds)
        self._rewritten: dict[int, Any] = {}
        #: ident -> (weak ref, the innermost call of torch's functions it was made in) of every
        #: operation's output made inside one (the input of an ``_unsafe_view``: :meth:`_step`)
        self._born_in: dict[int, tuple[Any, Any]] = {}
        #: torch.library's ledger of Python kernels and its version as the call starts (fn_enter)
        led = _ledger()
        self._kernels: tuple[Any, int] = (led, led.version)
        _input_names(xs, ys, self.names)
        # (an input that requires grad, the engine's copy of one: its node as the call starts,
        # compared at each use as a matched output's; _history_holds)
        with torch._C.DisableTorchFunction():
            for t in pytree.tree_leaves((xs, ys)):
                if isinstance(t, Tensor) and t.requires_grad:
                    self._history[ident(t)] = (weakref.ref(t), t.grad_fn)
        # named before any user code runs: a write that no operation shows, made before the
        # first use, must not be named with the written version (see _Versioned)
        self._state_done = True
        _state_names(model, self.names, only_new=True)
        #: the tensors from outside the call that the proof used, with their version counters and
        #: values now (their identity names them; their values must still be these at each use:
        #: a write through memory shared with NumPy from before the call shows no operation)
        self.outside: dict[int, tuple[Any, int, Tensor]] = {}
        #: generator -> its state when the call started or after the last matched draw (see
        #: before)
        self._rng: dict[Any, Tensor] = {}
        self._generators({})
        for g in program.generators():
            self._rng[g] = g.get_state()
        with _disable_current_modes():
            for ref in program.outside():
                t = ref()
                if t is not None:
                    value = t.detach().clone()
                    self.outside[ident(t)] = (ref, t._version, value)
                    last = _LAST.get(t)
                    if last is not None and self.mismatch is None and not _equal(value, last):
                        self.mismatch = _CHANGED_BETWEEN
        #: positions of the proved operations with a literal argument (watched from first use)
        self._lifted = program.lifted()
        self._leaves = [t for t in pytree.tree_leaves((xs, ys)) if isinstance(t, Tensor)]
        #: byte copies of what the step reads from before the call (memory shared with NumPy
        #: or another owner is written by no operation: dpclip.engine.memory_watch); taken by
        #: :meth:`arm` right before user code runs, or by :meth:`start_at_loss`
        self.watch: MemoryWatch | None = None
        #: tensors autograd saved before the watch was taken (a chain of known modules runs
        #: before :meth:`start_at_loss`): watched from then on
        self._pending: list[Tensor] = []
        #: hooks registered while the step runs (:meth:`watching`)
        self.hooks: HookWatch | None = None
        #: called once the watch has its copies (the engine releases the previous chunk's
        #: tensors there: finalizers they run are then watched writes)
        self.armed: Any = None
        #: the per-layer calls in progress (:meth:`open_call`): what their operations read
        self.calls: list[CallWindow] = []

    def open_call(self, leaves: list[Tensor], own: dict[str, Tensor]) -> "CallWindow":
        """A per-layer module's call starts (its forward pre-hook): the proved operations matched
        from here to :meth:`close_call` are the call's (:class:`CallWindow`). ``leaves``: the
        tensors of its arguments; ``own``: its trainable parameters by attribute."""
        w = CallWindow(self.program, self.k)
        w.arg_names = [_plain(self._name(t)) for t in leaves]
        w.own_names = {}
        for role, p in own.items():
            name = _plain(self._name(p))
            if name is not None:
                w.own_names[name] = role
        if self.mismatch is not None or self.done:
            w.why = "the call was not matched against the proved program"
        self.calls.append(w)
        return w

    def close_call(self, w: "CallWindow", outs: list[Tensor]) -> None:
        """The call returned ``outs`` (its forward hook): the window ends here."""
        if w in self.calls:
            self.calls.remove(w)
        w.end = self.k
        w.out_names = [_plain(self._name(t)) for t in outs]
        if self.mismatch is not None and w.why is None:
            w.why = "the call was not matched against the proved program"

    def _record(self, s_args: tuple, s_kwargs: dict, args: tuple, kwargs: dict) -> None:
        """A matched operation inside the open per-layer calls: its grad mode, and the real tensor
        behind each name it reads (first use)."""
        grad = torch.is_grad_enabled()
        pairs = list(enumerate(zip(s_args, args))) + \
            [(n, (s_kwargs[n], v)) for n, v in kwargs.items()]
        cut: set[Any] = set()  # the arguments the real run read detached
        for key, (s, a) in pairs:
            if isinstance(a, Tensor):
                if _detached(self._name(a)):
                    cut.add(key)
            elif isinstance(a, (list, tuple)):
                cut.update((key, j) for j, x in enumerate(a)
                           if isinstance(x, Tensor) and _detached(self._name(x)))
        for w in self.calls:
            w.grad.append(grad)
            w.cuts.append(frozenset(cut) if cut else None)
            for _, (s, a) in pairs:
                _read(s, a, w.reads, w.first)

    @_cm.contextmanager
    def watching(self) -> Any:
        """Around the forward and the loss: every tensor autograd saves is watched
        (:class:`~dpclip.engine.memory_watch.SavedTensorWatch`) and every hook registration is
        seen (:class:`~dpclip.engine.hook_watch.HookWatch`), whatever the torch function state."""
        self.hooks = HookWatch()
        w = SavedTensorWatch(self.saved)
        with w, self.hooks:
            self._saved_watch = w
            try:
                yield
            finally:
                self._saved_watch = None

    def saved(self, t: Tensor) -> None:
        """Sink of the step's :class:`~dpclip.engine.memory_watch.SavedTensorWatch`: ``t``, a tensor
        autograd saved for the backward, is watched from now until the loss returns (the backward
        reads it after the forward's last use: a write with dispatch off and the version counter
        set back changed only the backward, third hostile review, LOO 1.003 C)."""
        if self.done or self.mismatch is not None:
            return
        self._saved_at.setdefault(_storage(t), []).append(t)
        if self.watch is None:
            self._pending.append(t)
        else:
            self.watch.add(((t, "a tensor autograd saved for the backward"),))

    def arm(self) -> None:
        """Take the memory watch's copies: called right before the forward's user code runs (a
        path that runs a chain of known modules first arms in :meth:`start_at_loss` instead). A
        match that was never armed refuses the step."""
        if self.watch is None:
            self.watch = self._watch()
            self._armed()

    def _armed(self) -> None:
        if self.armed is not None:
            done, self.armed = self.armed, None
            done()

    def _watch(self) -> MemoryWatch:
        """A :class:`MemoryWatch` of the parameters, buffers, input leaves and the proof's outside
        tensors, their bytes now the reference."""
        watch = MemoryWatch()
        model = self._model
        state: list[tuple[Tensor, str]] = []
        if isinstance(model, nn.Module):
            state += [(t, f"parameter '{n}'")
                      for n, t in model.named_parameters(remove_duplicate=False)]
            state += [(t, f"buffer '{n}'") for n, t in model.named_buffers(remove_duplicate=False)
                      if t is not None]
        state += [(t, "an input of the batch") for t in self._leaves]
        state += [(e[0](), "a tensor from outside the call") for e in self.outside.values()]
        state += [(t, "a tensor autograd saved for the backward") for t in self._pending]
        self._pending = []
        watch.add(state)
        return watch

    def before(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Called by the tracer BEFORE each operation of user code runs (with the tracer quiet).
        Every tensor argument on a watched storage must hold the bytes it had when the call
        started or after the last accepted write (:class:`MemoryWatch`). A random draw must find
        every generator it may use as the call found it or as the last matched draw left it. The
        proof matches the draw, not the generator's state: ``torch.manual_seed(len(x))`` (or a
        state set from it) in the real run only made the masks a function of the private batch
        size (second hostile review: dropout masks, LOO 3.83 C with the seed fixed outside)."""
        self._snap = None
        if self.mismatch is not None or self.done:
            return
        watch = self.watch
        if watch is None:
            self._fail(_UNARMED)
            return
        if _write_specs(func) and torch.is_grad_enabled():
            # (what an in-place operation overwrites, as it was: autograd saves a copy of it for
            # the backward, which the proof cannot name; the copy a checked node saves must be
            # this one: see _node_facts)
            with _disable_current_modes(), torch._C.DisableTorchFunction(), _cm.no_grad():
                self._snap = (func, tuple(w.detach().clone()
                                          for w in _written_tensors(func, args, kwargs)))
        watch.check_args(args, kwargs, func)
        if watch.changed is not None:
            self._fail(_unseen_write(watch.changed, f"before {_short(func)}"))
            return
        if getattr(func, "namespace", "") == "aten" and _overridden(func):
            self._fail(f"operation {_short(func)} runs a kernel registered from Python over "
                       "ATen's: the proof ran its fake kernel, not the code that runs here")
            return
        if not _seeded(func):
            return
        for g in self._generators(kwargs, args):
            want = self._rng.get(g)
            if want is not None and not torch.equal(g.get_state(), want):
                self._fail(f"a random generator's state was set in the call before "
                           f"{_short(func)} (a seed or state the proof does not see)")
                return

    def _generators(self, kwargs: dict, args: tuple = ()) -> list[Any]:
        gens = [torch.default_generator]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            gens += list(torch.cuda.default_generators)
        # every generator argument, keyword or POSITIONAL: aten::poisson, _standard_gamma,
        # _fused_dropout and rrelu_with_noise take theirs positionally, and one reseeded from the
        # padded batch size right before the draw was never compared (60.6 C under ghost and
        # auto; hundred-and-forty-eighth hostile review)
        for g in (*args, *kwargs.values()):
            if isinstance(g, torch.Generator) and g not in gens:
                gens.append(g)
        for g in gens:
            if g not in self._rng:  # the proof's explicit generators are taken at the start
                # of the call; another one is no argument of the proof (its draw does not match)
                self._rng[g] = g.get_state()
        return gens

    def _name(self, t: Tensor) -> Any:
        """The name of ``t`` in this run; the model's parameters and buffers are named at the
        first miss (most steps of a chain of known modules never need them)."""
        got = self.names.get(t)
        if got is None and not self._state_done:
            self._state_done = True
            _state_names(self._model, self.names, only_new=True)
            got = self.names.get(t)
        return got

    def start_at_loss(self, model_out: Tensor) -> None:
        """The forward ran outside the match (a chain of known ``torch.nn`` modules, library code):
        match the loss only, ``model_out`` standing for the proof's model output."""
        if self.program.model_out is None:
            self._fail("the proof's model output is not one tensor")
            return
        self.k = self.program.split
        self.names.set(model_out, self.program.model_out)
        with torch._C.DisableTorchFunction():  # (the engine's reads: no escape to the tracer)
            if model_out.requires_grad:  # (its node as the chain left it: compared at each use)
                self._history[ident(model_out)] = (weakref.ref(model_out), model_out.grad_fn)
        # a chain of known modules ran no user code: the watch starts here; after code that was
        # watched, nothing may have changed in between (no copy taken anew)
        if self.watch is None:
            self.watch = self._watch()
            self._armed()
        elif self.watch.check_all() is not None:
            self._fail(_unseen_write(self.watch.changed, "before the loss function"))
        # the chain's output, computed where no match watched it, is what the loss reads
        self.watch.add(((model_out, "the model's output"),))

    def alias(self, new: Tensor, old: Tensor) -> None:
        """``new`` (the engine's expansion of a batch-less output) stands for ``old``."""
        name = self._name(old)
        if name is not None:
            self.names.set(new, name)
        with torch._C.DisableTorchFunction():  # (the engine's reads: no escape to the tracer)
            if new.requires_grad and not new._is_view():  # (the engine's: its node as made)
                self._history[ident(new)] = (weakref.ref(new), new.grad_fn)

    def _fail(self, why: str) -> None:
        if self.mismatch is None:
            if self.first_extra is not None:
                why = f"{why}; first difference: {self.first_extra}"
            self.mismatch = why

    def step(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if self.done or self.mismatch is not None or _skip(func):
            return
        try:
            self._step(func, args, kwargs, out)
        except _NoVersion:
            # (sixth hostile review: a literal made under torch.inference_mode crashed the step)
            self._fail(f"operation {self.k} ({_short(func)}) made or read an inference tensor "
                       "(torch.inference_mode in the forward or loss): it has no version counter, "
                       "so a write to it cannot be seen; run the forward without inference mode")

    def _check_history(self, args: tuple, kwargs: dict) -> bool:
        """Whether the autograd history of the tensors in play is the one the matched operations
        made (else the run fails). An in-place operation with Python dispatch and torch
        functions off, its version counter set back after, leaves a tensor's bytes, name and
        version as they were but rebases its history: ``h.mul_(1 + K (m - m.detach()))`` with
        ``m`` the batch mean multiplied ``h`` by exactly 1 and gave its gradient a path through
        every example (6.13 C under ghost, auto, compiled and make_private; hundred-and-fifty-
        second hostile review). The node a matched pure operation makes is created just before
        the operation reaches this mode, so its sequence number is the thread's counter minus
        one there; its outputs must still carry that node when the next operation runs, and the
        same node at every later use."""
        with torch._C.DisableTorchFunction():  # (read below the tracer's mode: not user code)
            return self._history_holds(args, kwargs)

    def _history_holds(self, args: tuple, kwargs: dict) -> bool:
        fresh, self._fresh = self._fresh, []
        for ref, seqs, key, allowed, tensors, call in fresh:
            o = ref()
            if o is None or not o.requires_grad:
                continue
            g = o.grad_fn
            n = g._sequence_nr() if g is not None else None
            # (made while the operation ran: before the counter this mode read; or, for a
            # view's base written in place, the CopySlices node made right after it)
            if n is None or n > seqs or (n == seqs and type(g).__name__ != "CopySlices"):
                return self._history_fail()
            # (and the node the proof's operation made: its class and where each edge leads. A
            # node's sequence number can be set from Python (Node._set_sequence_nr) and another
            # thread's counter starts at 0, so a rewrite made in a joined thread passed the test
            # above: 1.60 C, hundred-and-fifty-fifth hostile review; a node of another class
            # linked to the matched operation's argument: 14.3 C, hundred-and-fifty-sixth)
            # (the node the function that returned it carried then: taken before any user
            # code ran, so a node rebuilt since, however like the proof's, is refused; session
            # 24: review 159's rewrite with the step's watch's own unpack called by the
            # forward's hooks passed the saved-tensor facts below, 13.3 C)
            st = self._stamps.get(ident(o))
            if st is not None and st[0]() is o and st[1] is not g:
                return self._history_fail()
            # (an output with no stamp, made inside a call of torch's functions, may be one it
            # does not return, native_group_norm's mean: refused where it is USED after that
            # call returned, below)
            want = self.program.sigs.get(key)
            if want is None or not _linked(g, allowed) or \
                    not _facts_match(want, _node_facts(g, tensors, real=True)):
                return self._history_fail()
            self._history[ident(o)] = (ref, g)
            self._made_in[ident(o)] = (ref, call)
        for a in (*args, *kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, Tensor):
                    r = self._rewritten.get(ident(t))
                    if r is not None and r() is t:
                        # (its bytes rewritten through its _unsafe_view, its node not: _step)
                        return self._history_fail()
                    self._uses[ident(t)] = self._uses.get(ident(t), 0) + 1
                    e = self._history.get(ident(t))
                    m = self._made_in.get(ident(t))
                    if m is not None and m[0]() is t and m[1] not in self._calls:
                        st = self._stamps.get(ident(t))
                        if st is None or st[0]() is not t:
                            # (made inside a call of torch's functions that has returned
                            # without returning it: only user code that ran inside that call
                            # can have kept it, and rebuilt its node there; hundred-and-sixty-
                            # seventh hostile review: F.softmax ran a tensor's own attribute,
                            # 13.6 C)
                            return self._history_fail()
                    if e is not None and e[0]() is t:
                        # (a recorded node, a view's included, changes only by a matched write
                        # to its storage, which drops the record: a view's node swapped for
                        # another view chain (t_ with the version set back, geometry put back
                        # through .data) transposed every example's gradient: 5.1 C; hundred-
                        # and-sixty-third hostile review)
                        if t.grad_fn is not e[1]:
                            return self._history_fail()
                        continue
                    if t._is_view():
                        if t.requires_grad and not self._view_holds(t):
                            return self._history_fail()
                    elif t.requires_grad:
                        # (no record: the node one of torch's functions stamped when it returned
                        # it, where it did; a tensor made a leaf by requires_grad_ after an
                        # operation whose output did not require grad, then given a node with
                        # dispatch off (detach_, a write, the version set back), reached the
                        # operation with a node nothing compared: 13.6 C under ghost, auto's
                        # traced pass and make_private, hundred-and-seventy-second review)
                        st = self._stamps.get(ident(t))
                        if st is not None and st[0]() is t and st[1] is not t.grad_fn:
                            return self._history_fail()
        return True

    def _through_unsafe_view(self, t: Tensor, args: tuple, kwargs: dict) -> bool:
        """Whether a write of this operation reached ``t``'s storage only through an
        ``_unsafe_view`` of ``t`` (one of the operation's tensor arguments is that view's output)
        and ``t`` had no use but that view: nothing saved ``t`` for the backward (autograd's
        version counter is not shared with an ``_unsafe_view``: a node that had saved ``t`` would
        read the written values unseen), and every later use of ``t`` fails (its node, kept,
        no longer describes its bytes). Falcon's ``mlp_output += attention_output``, with
        ``mlp_output = x @ W.T`` decomposed by torch into ``mm`` and ``_unsafe_view``."""
        if self._uses.get(ident(t), 0) > 1:
            return False
        if t.grad_fn is not None and type(t.grad_fn) not in _PRODUCTS_SAVING_INPUTS:
            # (its own node may save it: exp, tanh, sigmoid save their result, which the write
            # then rewrote unseen; ExpBackward0 read example 0's rows in every example's
            # gradient: 3.21 C at B = 16, 5.74 C at 32 under ghost, auto's traced pass and
            # make_private, hundred-and-eighty-first hostile review)
            return False
        for a in (*args, *kwargs.values()):
            for w in (a if isinstance(a, (list, tuple)) else (a,)):
                u = self._unsafe_of.get(ident(w)) if isinstance(w, Tensor) else None
                if u is not None and u[0]() is w and u[1]() is t:
                    return True
        return False

    def _view_holds(self, t: Tensor) -> bool:
        """A view's history, when it is not the node recorded at its birth: view nodes only (its
        own, or the one autograd regenerates after a write to its base) down to its base's
        current node, which must be the one the match checked. A hidden in-place write THROUGH
        the view (dispatch off, version counter set back) rebases the base onto a CopySlices
        node no matched operation made, and the view onto a regenerated node above it: its
        gradient then takes that path, though the view alone is used afterwards."""
        if t.grad_fn is None:
            return True  # (a view made a leaf, e.g. under no_grad then requires_grad_: its own
            # gradient only; an in-place detach of a view is an error in torch)
        base = t._base
        if base is None:
            return False
        end = base.grad_fn
        e = self._history.get(ident(base))
        if e is not None and e[0]() is base and e[1] is not end:
            return False  # (the base's own history rewritten)
        node = t.grad_fn
        d = self._dropped.get(ident(t))
        if end is not None and d is not None and d() is t:
            # (a view whose record a matched write to its storage dropped: autograd regenerates
            # its node as ONE AsStridedBackward0 of the view's own geometry on the base's node;
            # another view chain there (t_ with the version set back) transposed every
            # example's gradient: hundred-and-sixty-third hostile review)
            return (type(node).__name__ == "AsStridedBackward0" and _view_node(node) and
                    len(node.next_functions) == 1 and node.next_functions[0][0] is end and
                    tuple(node._saved_size) == tuple(t.shape) and
                    tuple(node._saved_stride) == tuple(t.stride()) and
                    node._saved_storage_offset == t.storage_offset())
        for _ in range(_VIEW_DEPTH):  # (view nodes down to the base's checked node)
            if node is None:
                return False
            if end is None:  # (a leaf base: its gradient accumulator)
                if type(node).__name__ == "AccumulateGrad" and node.variable is base:
                    return True
            elif node is end:
                return True
            if not _view_node(node) or not node.next_functions:
                return False
            node = node.next_functions[0][0]
        return False

    def fn_enter(self, func: Any, args: tuple, kwargs: dict | None = None) -> Any:
        """One of torch's own functions starts (the tracer's torch-function mode, which pops
        itself while the function runs: no user code runs inside it, the collector paused):
        the nodes of the tensors it may write in place, as they are now (:meth:`fn_exit`)."""
        self.fn_depth += 1
        self._call_seq += 1
        self._calls.append(self._call_seq)
        w = self._saved_watch
        if w is not None and not self.done and self.mismatch is None and \
                not saved_watch_on_top(w):
            # (a pair pushed before the call would pack what its operations save: a pack hook
            # that popped itself inside autograd, before the tracer's step, left the watch on
            # top for every later check while its unpack gave the backward +-1000 by example
            # 0's sign: 13.25 C at B = 8, 56.6 C at 32 under ghost, auto's traced pass and
            # make_private, hundred-and-seventy-seventh hostile review)
            self._fail("the engine's saved-tensor hooks were not on top of autograd's stack when "
                       "one of torch's functions was called (hooks pushed in the forward): what "
                       "its operations save for the backward would not be watched")
        led = _ledger()
        if (led is not self._kernels[0] or led.version != self._kernels[1]) and \
                not self.done and self.mismatch is None:
            # (a kernel the forward registered (and destroyed before returning) on a key between
            # Autograd and Python, Conjugate, ran inside torch.exp on a conjugate-bit tensor, after
            # the tracer's step, and pushed a self-popping saved-tensor pair there: 13.9 C at
            # B = 8, 28.7 C at 16 under ghost, auto's traced pass and make_private; hundred-and-
            # seventy-eighth hostile review)
            self._fail("Python kernels over ATen operations were registered or removed "
                       "(torch.library) inside the forward: such a kernel would run inside "
                       "torch's functions, below the checks")
        written = _first_tensors(args[0]) if args and _writes_first(func) else []
        if kwargs and kwargs.get("out") is not None:
            written += _first_tensors(kwargs["out"])
        if not written:
            return None
        with torch._C.DisableTorchFunction():
            return [(t, t.grad_fn, r, r.grad_fn) for t in written
                    for r in ((t._base if t._is_view() else t),) if r is not None]

    def fn_exit(self, out: Any, before: Any) -> None:
        """The function returned ``out``: each tensor it returned, and each it wrote in place
        whose node the write replaced, is stamped with its node now, before any user code runs
        (:meth:`_history_holds` compares the node a matched operation made with it). The
        step's saved-tensor watch must still be on top: hooks pushed inside the function would
        have packed what its operations saved."""
        self.fn_depth -= 1
        if self._calls:
            self._calls.pop()
        if self.done or self.mismatch is not None:
            return
        w = self._saved_watch
        if w is not None and not saved_watch_on_top(w):
            self._fail("the engine's saved-tensor hooks were not on top of autograd's stack when "
                       "one of torch's functions returned (pushed or popped inside it): what its "
                       "operations saved for the backward would not be watched")
            return
        stamps = self._stamps
        # (the entries replaced here are dropped after the last stamp: a dead tensor's entry
        # holds the last reference to its node, whose metadata can hold an object with a
        # finalizer, run between two outputs' stamps otherwise; hundred-and-seventy-second review)
        replaced: list[Any] = []
        with torch._C.DisableTorchFunction():
            for t in _first_tensors(out):
                if t.requires_grad:
                    # (a tensor it returned as it was given, x.contiguous(), keeps its stamp:
                    # the node it carries now could be one rebuilt since)
                    e = stamps.get(ident(t))
                    if e is None or e[0]() is not t:
                        replaced.append(e)
                        stamps[ident(t)] = (weakref.ref(t), t.grad_fn)
            for t, g, r, rg in before or ():
                e = stamps.get(ident(t))
                # (made by the function: the write's own node; or a tensor it made require grad,
                # `t.requires_grad = True` included, stamped with its node (none) now: a leaf
                # given a node unseen later is refused, hundred-and-seventy-second review)
                if t.grad_fn is not g or (t.requires_grad and (e is None or e[0]() is not t)):
                    replaced.append(e)
                    stamps[ident(t)] = (weakref.ref(t), t.grad_fn)
                if r is not t and r.grad_fn is not rg:
                    replaced.append(stamps.get(ident(r)))
                    stamps[ident(r)] = (weakref.ref(r), r.grad_fn)
            e = None
        del replaced

    def _views_born(self, outs: Any) -> None:
        """Record the node of each view a matched operation made (before any user code runs)."""
        with torch._C.DisableTorchFunction():
            for o in outs:
                if isinstance(o, Tensor) and o._is_view() and o.requires_grad:
                    self._history[ident(o)] = (weakref.ref(o), o.grad_fn)

    def _history_fail(self) -> bool:
        self._fail("a tensor's autograd history was rewritten by no operation the match saw "
                   "(an in-place operation with Python dispatch off, its version counter set "
                   "back): its gradient would take a path the proof does not cover")
        return False

    def _step(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        w = self._saved_watch
        if w is not None and not saved_watch_on_top(w):
            # (the engine's saved-tensor hooks popped around one operation and pushed back: what
            # it saved had no hooks, and an unpack hook registered on it then handed the
            # backward example 0's activation for every row: 3.38 C at B = 8, 8.17 C at 32
            # under ghost, auto, compiled and make_private; hundred-and-fifty-fifth review)
            self._fail(f"operation {self.k} ({_short(func)}) ran without the engine's "
                       "saved-tensor hooks on top of autograd's stack (popped, or others pushed "
                       "above them): what it saves for the backward would not be watched")
            return
        if not self._check_history(args, kwargs):
            return
        src = _unversioned_alias(func, args, kwargs, out)
        if src is not None:
            # (an output that shares an input's memory without being a view or the input
            # itself: _unsafe_view, unsafe_split, unsafe_chunk give it a version counter of its
            # own, so a write through one changes what autograd saved of the other unseen;
            # torch's own functions make one only of a temporary they made and never return,
            # matmul's product. An _unsafe_view of a tensor user code can reach, saved by a
            # product, rewritten with example 0's rows by a write through the other: 4.21 C at
            # B = 16 under ghost and auto's traced pass, hundred-and-eighty-second hostile
            # review; the same with unsafe_split, hundred-and-eighty-third)
            born = self._born_in.get(ident(src))
            if not self._calls or born is None or born[0]() is not src or \
                    born[1] != self._calls[-1]:
                self._fail(f"operation {self.k} ({_short(func)}) shares the memory of a tensor "
                           "that the function calling it did not make, without its version "
                           "counter (a write through one would change what autograd saved of "
                           "the other, unseen)")
                return
            if func is _UNSAFE_VIEW and isinstance(out, Tensor):
                self._unsafe_of[ident(out)] = (weakref.ref(out), weakref.ref(src))
        if self._calls:
            for o in _outputs(out):
                if isinstance(o, Tensor):
                    self._born_in[ident(o)] = (weakref.ref(o), self._calls[-1])
        if _identity(func, args, kwargs, out):
            name = self._name(args[0])
            if name is not None:
                if func is _DETACH and name[0] != "detached":
                    # matched as its input (the proof's fake mode adds detaches an eager run
                    # does not make), but a replay of the proved operations must cut the
                    # gradient where the real run did (CallWindow)
                    name = ("detached", name)
                self.names.set(out, name, args[0]._version)  # a view: its base's counter
                return
        if getattr(func, "namespace", "aten") != "aten":
            # a custom operation (torch.library): the proof ran its fake (meta) kernel, the real
            # run its real kernel, Python that can read any state (second hostile review: a
            # kernel scaling a constant by a global set from len(x): LOO 3.16 C)
            self._fail(f"operation {self.k} ({func.namespace}::{_short(func)}) is not an ATen "
                       "operation: the proof ran its fake kernel, not the code that runs here")
            return
        if func is _LIFT_FRESH_COPY:
            func = _LIFT_FRESH
        k = self.k
        if k >= len(self.entries):
            self._fail(f"operation {k} ({_short(func)}) runs after the end of the proved program")
            return
        want, s_args, s_kwargs, index = self.entries[k]
        why = None
        if want is not func:
            why = f"operation {k} is {_short(func)}, the proof ran {_short(want)} there"
        elif (k in self.program.grad_off) is torch.is_grad_enabled():
            why = (f"operation {k} ({_short(func)}) ran with grad mode "
                   f"{'on' if torch.is_grad_enabled() else 'off'}, the proof's with it "
                   f"{'off' if torch.is_grad_enabled() else 'on'}")
        elif len(args) != len(s_args) or set(kwargs) != set(s_kwargs):
            why = f"operation {k} ({_short(func)}) has other arguments than in the proof"
        else:
            for i, (s, a) in enumerate(zip(s_args, args)):
                if not self._eq(s, a):
                    why = (f"argument {i} of operation {k} ({_short(func)}) differs from the "
                           "proof's")
                    break
            else:
                for key, v in kwargs.items():
                    if not self._eq(s_kwargs[key], v):
                        why = (f"argument {key!r} of operation {k} ({_short(func)}) differs "
                               "from the proof's")
                        break
        pure = _pure(func)
        if why is not None:
            if pure:
                # the same pure operation on the same named tensors as one already matched (a
                # layer called twice, once on a constant the proof's dead code dropped): the same
                # values, named as that one
                seen = self._recomputed(func, args, kwargs)
                if seen is not None and (self.program.meta.get(seen) != _meta(args, kwargs, out)
                                         or (seen in self.program.grad_off_index)
                                         is torch.is_grad_enabled()):
                    self._fail(f"operation {k} ({_short(func)}) repeats operation {seen} on "
                               "tensors of other dtypes, negative / conjugate bits or gradient "
                               "requirements, or under another default dtype or grad mode, than "
                               "the proof's")
                    return
                if seen is not None:
                    outs = _outputs(out)
                    for j, (o, v) in enumerate(zip(outs, _out_versions(func, args, kwargs,
                                                                        outs))):
                        if o is not None:
                            self.names.set(o, ("op", seen, j), v)
                    # (its outputs' autograd history and memory checked as a matched
                    # operation's: a recomputation's output, rebased unseen, moved every
                    # example's gradient, 1.60 C; hundred-and-fifty-third hostile review)
                    if torch.is_grad_enabled():
                        seq = _SEQUENCE_NR()
                        with torch._C.DisableTorchFunction():
                            call = self._calls[-1] if self._calls else None
                            self._fresh = [(weakref.ref(t), seq, *rest, call) for t, *rest in
                                           _pending_of(func, seen, args, kwargs, outs)]
                        if self._fresh and not self.fn_depth:
                            self._fail(_OUTSIDE_FUNCTIONS.format(k=k, op=_short(func)))
                            return
                        self._views_born(outs)
                    self.watch.add((o, "a tensor the call computed") for o in outs
                                   if isinstance(o, Tensor))
                    return
                # an extra operation without effects (see _pure): its outputs get no name, so a
                # use of them matches nothing; remembered for the message if the run then fails
                self.extra += 1
                if self.first_extra is None:
                    self.first_extra = why
                return
            self._fail(why)
            return
        if self.program.meta.get(index) != _meta(args, kwargs, out):
            # (the same names, values and memory read otherwise: a negative bit set with no
            # operation, a default dtype switched around one factory call; see _meta)
            self._fail(f"operation {k} ({_short(func)}) has a tensor argument of another "
                       "dtype, negative / conjugate bit or gradient requirement (a detach or a "
                       "no_grad recomputation the proof did not make), or runs under another "
                       "default dtype, than in the proof (set with no operation: "
                       "torch._C._set_neg, a default dtype switched around one call)")
            return
        if not pure:
            # a write (or a draw) may change what a view of the written tensor reads: the same
            # call on the same names no longer means the same values
            self.window = k + 1
        outs = _outputs(out)
        for j, (o, v) in enumerate(zip(outs, _out_versions(func, args, kwargs, outs))):
            if o is not None:
                self.names.set(o, ("op", index, j), v)
        if torch.is_grad_enabled():  # (its node: created just before this mode saw it; a
            # write's output may also carry a view base's CopySlices, made right after)
            seq = _SEQUENCE_NR()
            # (not a view's: its node is regenerated when its base is written, legitimately;
            # a view's node as it is now, and its base's at each later use: _view_holds; the
            # root of a tensor it writes: its new node, _pending_of)
            snap, self._snap = self._snap, None
            snaps = snap[1] if snap is not None and snap[0] is func else ()
            with torch._C.DisableTorchFunction():
                call = self._calls[-1] if self._calls else None
                self._fresh = [(weakref.ref(t), seq, key, allowed, (*tensors, snaps), call)
                               for t, key, allowed, tensors in
                               _pending_of(func, index, args, kwargs, outs)]
            if self._fresh and not self.fn_depth:
                self._fail(_OUTSIDE_FUNCTIONS.format(k=k, op=_short(func)))
                return
            self._views_born(outs)
        # every tensor the call computes is watched from its birth: a write with dispatch off
        # and the version counter set back, before a later use in the forward or after the last
        # one (the backward reads it), ran the proof's operations on other values (LOO 1.63 C
        # before the next use, 1.003 C after the last)
        self.watch.add((o, "a tensor the call computed") for o in outs if isinstance(o, Tensor))
        if k in self._lifted:  # a literal: its memory is watched from its first use on
            self.watch.add((a, "a tensor literal of the call")
                           for s, a in list(zip(s_args, args)) +
                           [(s_kwargs[n], v) for n, v in kwargs.items()] if s[0] == "c")
        if self.calls:
            self._record(s_args, s_kwargs, args, kwargs)
        if not pure and _seeded(func):  # a matched draw: the generators as it left them
            for g in self._rng:
                self._rng[g] = g.get_state()
        if not pure:
            bumps = _written(func, args, kwargs)
            for w in self.calls:  # (what the call wrote: CallWindow.written)
                w.written.update(bumps)
            if bumps and self._saved_at:
                # (a storage written while a tensor autograd saved lives in it: the backward
                # reads what the write left there. Through the tensor or a view of it, autograd
                # refuses that backward anyway (the shared version counter moved); through an
                # alias with a counter of its own (aten.set_ under no_grad of a saved tensor
                # without history: 3.20 C under ghost, auto and make_private, hundred-and-
                # eighty-eighth hostile review) nothing moved, and the memory watch took the new
                # bytes as the program's. Refused whatever the counters say: a counter moved
                # around the write with torch._C._autograd._unsafe_set_version_counter passed a
                # check of the saved tensor's version, 3.24 C, hundred-and-eighty-ninth review)
                for key in bumps:
                    if self._saved_at.get(key):
                        self._fail(f"operation {k} ({_short(func)}) wrote the memory of a "
                                   "tensor autograd saved for the backward (through the tensor, "
                                   "a view of it, or an alias with a version counter of its "
                                   "own: Tensor.set_, an untyped storage): the backward would "
                                   "read the rewritten bytes")
                        return
            if bumps:  # the counters of the written storages move once per written argument
                self.names.written(bumps)
                self.watch.refresh(bumps)  # an accepted write: the new bytes are the program's
                for key, (ref, version, value) in list(self.outside.items()):
                    t = ref()
                    if t is not None and t._version == version and bumps.get(_storage(t)):
                        # a matched write: later uses read the written values (its output's
                        # name), the outside tensor itself is no longer the proof's
                        del self.outside[key]
                if self._history and torch.is_grad_enabled():
                    # (a matched in-place write rebases the written tensors' histories: the
                    # written roots are checked at the next operation (_pending_of), the views of
                    # them at each use (_view_holds); another tensor on a written storage, not a
                    # view of it, has no history the proof describes)
                    with torch._C.DisableTorchFunction():
                        queued = {ident(ref()) for ref, *_ in self._fresh
                                  if ref() is not None}
                        for key, (ref, g) in list(self._history.items()):
                            t = ref()
                            if t is None or bumps.get(_storage(t)):
                                del self._history[key]
                                if t is not None and t._is_view():
                                    self._dropped[key] = ref
                                if t is not None and not t._is_view() and key not in queued \
                                        and not self._through_unsafe_view(t, args, kwargs):
                                    self._fail(f"operation {k} ({_short(func)}) wrote the "
                                               "storage of a tensor that is neither what it "
                                               "writes nor a view of it (Tensor.set_): its "
                                               "autograd history, rewritten there, cannot be "
                                               "checked")
                                    return
                                if t is not None and not t._is_view() and key not in queued:
                                    self._rewritten[key] = ref
                elif self._history:
                    # (with gradients off no history is rebased, but the bytes of a tensor with
                    # one are rewritten all the same: by the tensor itself or a view of it, its
                    # version counter moves and the saved-tensor watch sees it; by another
                    # tensor on its storage (Tensor.set_ under no_grad: a version counter of its
                    # own), nothing moved, and the backward read the rewritten bytes: 4.21 C
                    # under ghost, auto and make_private, present at 087e01d; hundred-and-
                    # eighty-sixth hostile review)
                    with torch._C.DisableTorchFunction():
                        roots = set()
                        for spec in _write_specs(func):
                            for w in _first_tensors(_arg(spec, args, kwargs)):
                                roots.add(ident(w))
                                if w._base is not None:
                                    roots.add(ident(w._base))
                        for key, (ref, g) in list(self._history.items()):
                            t = ref()
                            if t is not None and bumps.get(_storage(t)) and \
                                    not t._is_view() and ident(t) not in roots:
                                self._fail(f"operation {k} ({_short(func)}) wrote, with "
                                           "gradients off, the storage of a tensor with an "
                                           "autograd history that is neither what it writes "
                                           "nor the base of a view it writes (Tensor.set_): "
                                           "the backward would read the rewritten bytes "
                                           "unseen")
                                return
        self.k = k + 1

    def _recomputed(self, func: Any, args: tuple, kwargs: dict) -> int | None:
        """The recording index of an operation matched since the last write (or draw) that is
        the same call on the same named tensors and values as this one, or None."""
        for e in reversed(self.entries[self.window:self.k]):
            want, s_args, s_kwargs, index = e
            if want is func and len(args) == len(s_args) and set(kwargs) == set(s_kwargs) and \
                    all(self._eq(x, a) for x, a in zip(s_args, args)) and \
                    all(self._eq(s_kwargs[n], v) for n, v in kwargs.items()):
                return index
        return None

    def _eq(self, s: tuple, a: Any) -> bool:
        kind = s[0]
        if kind == "t":
            if not isinstance(a, Tensor):
                return False
            got = self._name(a)
            if got is not None and got[0] == "detached":
                got = got[1]
            if got == s[1]:
                return True
            return got is not None and got[0] == "in" and s[1][0] == "in" and \
                bool(got[1] & s[1][1])
        if kind == "v":
            v = s[1]
            if type(a) is not type(v):  # 1 and 1.0 and True promote differently
                return False
            if type(v) is float:  # by bits: -0.0 is not 0.0, nor -nan nan (copysign tells
                # them apart: a forward passed the padded batch size in a zero's sign, 11.7 C;
                # hundred-and-thirty-first hostile review)
                return _bits(a) == _bits(v)
            if type(v) is complex:
                return _bits(a.real) == _bits(v.real) and _bits(a.imag) == _bits(v.imag)
            try:
                return a is v or bool(a == v)
            except Exception:  # noqa: BLE001 - an object without equality: identity only
                return False
        if kind == "l":
            return isinstance(a, s[1]) and len(a) == len(s[2]) and \
                all(self._eq(x, y) for x, y in zip(s[2], a))
        if kind == "x":
            if not (isinstance(a, Tensor) and s[1]() is a and self._name(a) is None):
                return False
            # still the version and the values it had when the call started (see _Versioned)
            e = self.outside.get(ident(a))
            return e is not None and e[0]() is a and e[1] == a._version and _equal(a, e[2])
        if kind == "c":  # (a literal: by bits, as the arguments above, and by its memory:
            # its strides, offset and whole storage; a literal showing the proof's values over a
            # storage holding others, read through as_strided with an absolute offset, carried
            # the padded batch size: 12.4 C, hundred-and-thirty-second hostile review)
            c = s[1]
            return isinstance(a, Tensor) and not is_fake(a) and self._name(a) is None and \
                _equal(a, c) and _same_memory(a, c)
        return False  # "?": not matchable

    def finish(self, losses: Any) -> None:
        """The loss function returned ``losses``: every proved operation ran and the losses are
        the proof's output."""
        if self.done:
            return
        self.done = True
        self._saved_at.clear()  # (no write of the forward is left to check; autograd holds them)
        if self.mismatch is None:  # (the last operation's outputs and the losses: see above)
            self._check_history((losses,) if isinstance(losses, Tensor) else (), {})
        # (autograd nodes: they hold the step's graph)
        self._history, self._fresh, self._dropped, self._stamps = {}, [], {}, {}
        self._made_in, self._uses, self._unsafe_of, self._rewritten = {}, {}, {}, {}
        self._born_in = {}
        # the batch is not read again: released with the step, not with the match (which the
        # tracer's escape mode and the call's hooks keep in a reference cycle until the collector
        # runs; seventy-fourth hostile review: a finalizer on a chunk's slice then ran in a later
        # step's graph chunk, after every check of its own step, 4.76 C)
        self._leaves = []
        hook = None
        if self.hooks is not None and self.watch is not None:
            hook = self.hooks.check(self.watch.tensors())
        changed = self.watch.finish() if self.watch is not None else _UNARMED  # (drops the copies)
        if self.mismatch is not None:
            return
        if hook is not None:
            self._fail(f"{hook} was registered in the call where the trace does not see it "
                       "(torch functions switched off): user code in the backward pass could mix "
                       "the examples' gradients")
            return
        if changed is _UNARMED:
            self._fail(_UNARMED)
        elif changed is not None:
            self._fail(_unseen_write(changed, "before the loss function returned"))
        elif self.k != len(self.entries):
            self._fail(f"the real run ended after {self.k} of the proof's "
                       f"{len(self.entries)} operations")
        elif not isinstance(losses, Tensor) or self.program.loss_out is None or \
                _plain(self._name(losses)) != self.program.loss_out:
            self._fail("the loss function returned another tensor than in the proof")
        else:  # matched: the values the next call must find (see _LAST)
            with _disable_current_modes():
                for ref in self.program.outside():
                    t = ref()
                    if t is not None:
                        e = self.outside.get(ident(t))
                        _LAST[t] = e[2] if e is not None and e[0]() is t and \
                            e[1] == t._version else t.detach().clone()


#: tensor from outside the call -> its value when the last matched call that read it finished.
#: The proof names such a tensor by identity and the match compares it with its value when the
#: call started; a value written between calls, where no operation of a step shows (user code
#: that runs before the step's watch is taken, or the caller's loop), could carry an earlier
#: call's examples into this one (eighth hostile review: 0.75 C on the next call, LOO 2.06 C).
#: A changed value is refused.
_LAST: WeakIdKeyDictionary = WeakIdKeyDictionary()

_CHANGED_BETWEEN = (
    "a tensor from outside the call that the proof reads (a global, a closure variable or a plain "
    "tensor attribute) holds other values than when the previous step that read it ended, written "
    "where no step's operations show it: its values could carry an earlier step's examples. "
    "Register it as a buffer (the state guard covers buffers), or keep it constant")


def _plain(name: Any) -> Any:
    """A name without its detached mark (ProgramMatch._step: a detach is matched as its input)."""
    return name[1] if name is not None and name[0] == "detached" else name


def _detached(name: Any) -> bool:
    return name is not None and name[0] == "detached"


def _read(spec: tuple, a: Any, reads: dict[Any, Tensor], first: int) -> None:
    """Remember the real tensor behind a name from before the call (one the call's operations
    made, recorded at or after ``first``, is not kept: the replay makes it again)."""
    if spec[0] == "t":
        name = spec[1]
        if isinstance(a, Tensor) and name not in reads and \
                not (name[0] == "op" and name[1] >= first):
            reads[name] = a
    elif spec[0] == "l" and isinstance(a, (list, tuple)):
        for s, x in zip(spec[2], a):
            _read(s, x, reads, first)


class CallWindow:
    """The proved operations of one call of a per-layer module (:mod:`dpclip.engine.per_layer`):
    positions ``start`` to ``end`` of the proved program, matched while the call ran. The per-layer
    path replays them (the program's own operations, its numbers evaluated for one example) to get
    the module's per-example gradients, instead of running the module's Python again (thirteenth
    hostile review: a Python number the forward kept, the realised batch size, reached the
    re-run unseen: LOO 3.13 C).

    ``arg_names`` / ``own_names``: the names of the call's argument tensors and trainable
    parameters when it started; ``reads``: name -> the real tensor each name stood for at its
    first use in the call; ``grad``: the grad mode of each matched operation; ``cuts``: for each,
    the arguments (position, keyword, or ``(position, index)`` in a list) the real run read
    detached (``.detach()`` is matched as its input; the replay detaches them), or None;
    ``out_names``: the names of the outputs when it returned; ``why``: why the window cannot be
    replayed, or None."""

    __slots__ = ("program", "start", "first", "end", "arg_names", "own_names", "reads", "grad",
                 "cuts", "out_names", "why", "fixed", "written")

    def __init__(self, program: ProvedProgram, start: int) -> None:
        self.program = program
        self.start = start
        #: the recording index of the call's first operation (names of its outputs and later)
        self.first = program.entries[start][3] if start < len(program.entries) else 1 << 62
        self.end: int | None = None
        self.arg_names: list[Any] = []
        self.own_names: dict[Any, str] = {}
        self.reads: dict[Any, Tensor] = {}
        self.grad: list[bool] = []
        self.cuts: list[frozenset[Any] | None] = []
        self.out_names: list[Any] = []
        self.why: str | None = None
        #: name -> (tensor, version): what the replay reads from outside the call that is neither
        #: an argument nor an own parameter (set by ``per_layer.settle_call``)
        self.fixed: dict[Any, tuple[Tensor, int]] = {}
        #: the storages (data pointers) the call's matched operations wrote
        self.written: set[int] = set()


def _same_memory(a: Tensor, b: Tensor) -> bool:
    """``a`` and ``b`` have the same strides and storage offset, and storages of the same bytes."""
    if a.stride() != b.stride() or a.storage_offset() != b.storage_offset():
        return False
    with _cm.no_grad(), torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        sa, sb = a.untyped_storage(), b.untyped_storage()
        if sa.nbytes() != sb.nbytes() or sa.device != sb.device:
            return False
        if sa.data_ptr() == sb.data_ptr():
            return True
        return bool(torch.equal(_storage_bytes(sa), _storage_bytes(sb)))


def _storage_bytes(storage: Any) -> Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (storage.nbytes(),), (1,))


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _equal(a: Tensor, b: Tensor) -> bool:
    """``a`` and ``b`` hold the same bits (dtype, shape and device too): ``torch.equal`` takes
    -0.0 for 0.0 and any NaN for any NaN, which ``copysign`` / ``signbit`` tell apart
    (hundred-and-thirty-first hostile review: the padded batch size passed in a zero's sign)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    with _cm.no_grad(), torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        if not (a.is_floating_point() or a.is_complex()):
            return bool(torch.equal(a, b))
        return bool(torch.equal(a.detach().reshape(-1).contiguous().view(torch.uint8),
                                b.detach().reshape(-1).contiguous().view(torch.uint8)))


#: a match whose memory watch was never taken (an engine path that forgot :meth:`ProgramMatch.arm`)
_UNARMED = "internal: the memory watch of the match was not started before user code ran"


def _unseen_write(what: str, when: str) -> str:
    return (f"the memory of {what} was written or replaced in the call {when} by no operation "
            "the trace sees (a write with Python dispatch off and its version counter set back; "
            "a tensor restrided in place with no operation, as_strided_ or swap_tensor_impl; "
            "memory shared from before the call with a NumPy array or another owner: "
            "torch.from_numpy, a .numpy() view kept at construction; or an assignment to "
            ".data); the proof holds for the values it names, not for these")


def _short(func: Any) -> str:
    return func._schema.name.split("::", 1)[-1]


def describe(why: str) -> str:
    """The user-facing reason of a mismatch."""
    if why == _CHANGED_BETWEEN:
        return why
    return ("the step does not run the program that the batch-size proof traced (" + why + "): "
            "the forward or the loss behaves differently on the proof's symbolic tensors than "
            "on real ones (e.g. it checks the tensor type, whether the size is an int, "
            "torch.compiler.is_exporting(), or counts calls), so the proof does not cover it")

