"""Is the torch code that the ghost engine trusts without tracing still torch's own?

The engine proves some of a model by the semantics of torch's modules, without tracing them: a
plain chain of known modules (``ghost_forward._run_known_chain``), a chain whose layouts are
cached (``ghost_forward._chain_key``), and every ruled layer (``nn.Linear``, ``nn.Conv2d``, ...),
whose output the trace marks as the layer's own per-example result whatever ran inside it. Each
of these checks that the module's class and its ``forward`` are torch's own. But ``forward`` runs
more of torch's Python code, looked up by name when it runs: ``F.linear`` in
``nn.Linear.forward``, ``torch.tanh`` in ``nn.Tanh.forward``, ``self._conv_forward`` and then
``F.conv2d`` and ``F.pad`` in ``nn.Conv2d.forward``, ``input.dim`` on the tensor class. A library
that replaces one of those names (a fake-quantization ``F.linear`` that scales activations by the
batch's maximum, a fused kernel patched into ``torch.nn.functional``) runs its code inside the
proved layer, untraced: a replaced ``F.linear`` that adds the batch mean to every row was
accepted with a leave-one-out distance of 2.25 C (tests/engine/test_library_code.py).

:func:`library_changed` answers, for a set of module classes, whether every name that their
``forward`` (and the torch functions it reaches, :data:`_DEPTH` calls deep, and
``nn.Module.__call__``) looks up still resolves to the object it resolved to when first seen, and
whether that object was torch's own then (a Python function in torch's files, a builtin of torch's
C modules under the name it is looked up by, a module of torch, a class, a Python builtin): a
replacement made before dpclip first looked (the replaced object is not torch's own, or a torch
builtin under another name) and one made after (another object) both answer "changed". The
lookups of a class are found once, from the bytecode (``dis``): a global name, an attribute of
what a global name gave (``F.linear``, ``torch._C._nn.linear``), an attribute of ``self`` that the
class defines (``self._conv_forward``: a class-level patch), an attribute of a local that the
tensor class defines (``input.dim``, ``input.flatten``: ``torch.Tensor.flatten = ...``) and the
class's ``__getattr__`` (``self.weight``), and a closure cell; then checked on every call
(identity only: about 0.1 us a name).

What it does not cover: names looked up by torch's C++ code (none that a Python assignment can
change), code more than :data:`_DEPTH` Python calls below a forward (torch's internals, which
nothing but torch calls), and dpclip's own code (a user that patches dpclip's or torch's internals
deliberately can do anything; this check is for libraries that patch torch's public functions)."""

from __future__ import annotations

import builtins
import dis
import os
import sys
import types
from typing import Any, Iterable

import torch
from torch import nn

from dpclip._ident import ident
from dpclip.registry import KNOWN_PROGRAMS

__all__ = ["library_changed"]

_TORCH_DIR = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep
#: how many Python calls below a forward the lookups are followed
_DEPTH = 3
#: what the refusals tell the user to do
_FIX = ("; the ghost engine proves this layer by torch's own code, untraced: restore the "
        "original, or use engine 'vmap'")
_LOAD_GLOBAL = {"LOAD_GLOBAL", "LOAD_NAME"}
_LOAD_ATTR = {"LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"}
_MISSING = object()
_BUILTIN_TYPES = (types.BuiltinFunctionType, types.BuiltinMethodType, types.WrapperDescriptorType,
                  types.MethodDescriptorType, types.MethodWrapperType,
                  types.ClassMethodDescriptorType, types.GetSetDescriptorType,
                  types.MemberDescriptorType)


def _file_of(obj: Any) -> str | None:
    code = getattr(obj, "__code__", None)
    return os.path.realpath(code.co_filename) if code is not None else None


#: the folders whose Python code counts as the library's own: torch's, and the package of a
#: ruled layer whose forward is not torch's (transformers' Conv1D)
_TRUSTED_DIRS = [_TORCH_DIR]


def _torch_file(obj: Any) -> bool:
    f = _file_of(obj)
    return f is not None and f.startswith(tuple(_TRUSTED_DIRS))


#: (file, qualified name, first line) -> whether a function's code there is the file's own
_GENUINE: dict[tuple[str, str, int], types.CodeType | None] = {}


def _compiled_at(path: str, qualname: str, line: int) -> types.CodeType | None:
    """The code object ``path``'s source compiles to for ``qualname`` at ``line``, or None."""
    key = (path, qualname, line)
    if key not in _GENUINE:
        try:
            with open(path, encoding="utf-8") as fh:
                top = compile(fh.read(), path, "exec", dont_inherit=True)
        except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
            top = None
        stack, found = [top] if top is not None else [], None
        while stack:
            code = stack.pop()
            if code.co_qualname == qualname and code.co_firstlineno == line:
                found = code
                break
            stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        _GENUINE[key] = found
    return _GENUINE[key]


def hf_conv1d() -> type | None:
    """``transformers.pytorch_utils.Conv1D`` when it is transformers' own, untouched: the class
    defined in that module, its ``forward`` the function that module's source file defines
    (its code equal to what the file compiles to, its globals the module's, no closure), the
    module loaded from the ``transformers`` package's folder. None otherwise (also when
    ``transformers`` is not imported).

    The Conv1D rule runs this forward untraced, as library code. Before, the class was read from
    the module attribute and its forward trusted by its file name, any package in a folder
    named ``site-packages`` counting as a library: a Conv1D whose forward a package there
    replaced (``h + 10 h.sum(0)`` before the product), or a function whose ``co_filename`` was
    rewritten into torch's folder, ran as proved: LOO 13.47 C under ghost, auto and
    ``make_private`` (hundred-and-thirty-eighth hostile review)."""
    pu = sys.modules.get("transformers.pytorch_utils")
    top = sys.modules.get("transformers")
    cls = getattr(pu, "Conv1D", None) if pu is not None else None
    fwd = vars(cls).get("forward") if isinstance(cls, type) else None
    # (the verdict of the last look, while every object it depends on is the same one)
    seen = (pu, top, cls, fwd, getattr(fwd, "__code__", None), getattr(fwd, "__globals__", None),
            getattr(fwd, "__closure__", None), getattr(cls, "__module__", None))
    if _CONV1D_SEEN and len(_CONV1D_SEEN[0]) == len(seen) and \
            all(a is b for a, b in zip(_CONV1D_SEEN[0], seen)):
        return _CONV1D_SEEN[1]
    got = _hf_conv1d(pu, top, cls)
    _CONV1D_SEEN[:] = [seen, got]
    return got


#: [the objects hf_conv1d's last verdict depended on, that verdict]
_CONV1D_SEEN: list[Any] = []


def _hf_conv1d(pu: Any, top: Any, cls: Any) -> type | None:
    home = getattr(top, "__path__", None)
    file = getattr(pu, "__file__", None)
    if not isinstance(cls, type) or not home or not isinstance(file, str) or \
            cls.__module__ != "transformers.pytorch_utils":
        return None
    file = os.path.realpath(file)
    if not file.startswith(os.path.realpath(list(home)[0]) + os.sep):
        return None
    fwd = cls.__dict__.get("forward")
    if not isinstance(fwd, types.FunctionType) or fwd.__closure__ is not None or \
            fwd.__globals__ is not vars(pu) or os.path.realpath(fwd.__code__.co_filename) != file:
        return None
    code = fwd.__code__
    ref = _compiled_at(file, code.co_qualname, code.co_firstlineno)
    return cls if ref is not None and code.co_qualname == "Conv1D.forward" and code == ref \
        else None


def _package_dir(fn: types.FunctionType) -> str | None:
    """The folder of the top-level package that defines ``fn`` (None for a lone module)."""
    top = sys.modules.get((fn.__module__ or "").split(".")[0])
    path = getattr(top, "__path__", None)
    return os.path.realpath(list(path)[0]) + os.sep if path else None


_HEAPTYPE = 1 << 9  # (Py_TPFLAGS_HEAPTYPE: a class made by a class statement, not C)
#: the builtins that are not C objects of the builtins module, as they were when dpclip loaded
_NOT_C = frozenset({"__loader__", "__spec__", "ExceptionGroup", "open", "quit", "exit",
                    "copyright", "credits", "license", "help"})
_AT_IMPORT = {n: getattr(builtins, n) for n in _NOT_C if hasattr(builtins, n)}


def _python_builtin(name: str, obj: Any) -> bool:
    """Whether ``obj``, found in the builtins module under ``name``, is the interpreter's own:
    a C function of the builtins module, a C type, or a constant. torch's code that dpclip's
    separability rules take as a whole (the recurrent layers' time steps, ``recurrent._lstm``)
    calls builtins such as ``zip``; a forward that replaced ``builtins.zip`` in an eager call
    before the first step (a ``zip`` subclass that rewrote the final states of an LSTM as their
    batch sum) had every step's snapshot hold the fake, and the time-step rule then gave each
    example the other examples' gradients: 7.99 C through make_private (hundred-and-thirty-sixth
    hostile review)."""
    if obj is _MISSING or obj is None or obj is Ellipsis or obj is NotImplemented or \
            isinstance(obj, (bool, int, float, str)):
        return True
    if name in _NOT_C and obj is _AT_IMPORT.get(name, _MISSING):
        return True  # (builtins that are not C objects: io.open, site's exit, ...)
    if isinstance(obj, type):
        return not (obj.__flags__ & _HEAPTYPE) and obj.__module__ == "builtins"
    if isinstance(obj, types.BuiltinFunctionType):
        return getattr(obj, "__self__", None) is builtins and obj.__name__ == name
    return False


def _own(name: str, obj: Any) -> bool:
    """Whether ``obj``, found under ``name``, is torch's own (or Python's): see the module
    docstring."""
    if obj is _MISSING or obj is None or isinstance(obj, (bool, int, float, str, bytes, tuple,
                                                           frozenset, dict, torch.dtype)):
        return True
    if isinstance(obj, type):
        return True  # a class: what its methods do is looked up by name again
    if isinstance(obj, types.ModuleType):
        return _root_ok(obj.__name__)
    if getattr(builtins, name, _MISSING) is obj:
        return True
    if isinstance(obj, (types.FunctionType, types.MethodType)):
        fn = obj.__func__ if isinstance(obj, types.MethodType) else obj
        if not _named_as(name, fn):
            return False
        # (a function wrapped by a standard decorator, contextlib.contextmanager: the wrapped one)
        while not _torch_file(fn) and _stdlib_file(fn) and \
                isinstance(getattr(fn, "__wrapped__", None), types.FunctionType):
            fn = fn.__wrapped__
        return _torch_file(fn) or _stdlib_file(fn)  # (the standard library's: not followed)
    if isinstance(obj, (staticmethod, classmethod)):
        return _own(name, obj.__func__)
    if isinstance(obj, property):
        return all(f is None or _own(name, f) for f in (obj.fget, obj.fset))
    if isinstance(obj, _BUILTIN_TYPES):
        # a builtin of torch's C modules under its own name (another torch builtin put under this
        # name, F.linear = torch.add, is a replacement), or a method of a Python builtin type
        owner = getattr(obj, "__self__", None)
        mod = getattr(obj, "__module__", None) or getattr(
            getattr(obj, "__objclass__", None), "__module__", None) or (
            getattr(owner, "__name__", None) if isinstance(owner, types.ModuleType) else
            type(owner).__module__ if owner is not None else None)
        if not isinstance(mod, str):
            return False
        if mod.split(".")[0] != "torch":
            return _root_ok(mod)
        own_name = getattr(obj, "__name__", None)
        # (an operator method of torch's tensor class may be another method under its own name:
        # __itruediv__ is TensorBase.__idiv__)
        return own_name is None or _plain_name(own_name) == _plain_name(name) or (
            name.startswith("__") and name.endswith("__"))  # (__pos__ is TensorBase.positive)
    wrapped = getattr(obj, "__wrapped__", None)  # functools.lru_cache, ...
    if wrapped is not None and _root_ok(type(obj).__module__) and \
            type(obj).__module__.split(".")[0] != "torch":
        return _own(name, wrapped)
    if type(obj).__module__.split(".")[0] == "torch":  # an object of a torch class
        return True
    # data of the standard library (a typing.ParamSpec); a callable one (functools.partial of a
    # replacement) is not torch's own
    return not callable(obj) and _root_ok(type(obj).__module__)


_STDLIB_DIR = os.path.dirname(os.path.realpath(os.__file__)) + os.sep


def _stdlib_file(obj: Any) -> bool:
    f = _file_of(obj)
    return f is not None and f.startswith(_STDLIB_DIR) and "site-packages" not in f


def _root_ok(module_name: str) -> bool:
    """A module of torch's or of Python's standard library (by name)."""
    root = module_name.split(".")[0]
    return root == "torch" or root in sys.stdlib_module_names


#: torch's Python functions bound under a name other than their own (found by an honest scan of
#: every ruled and known layer class): (name, module, qualified name)
_ALIASES = frozenset({("forward", "torch.nn.modules.module", "_forward_unimplemented")})


def _named_as(name: str, fn: types.FunctionType) -> bool:
    """Whether torch's Python function ``fn`` may be found under ``name``: its own name (as a plain
    name), a dunder or a closure cell's contents, or one of torch's own aliases. Another of torch's
    functions put there before dpclip first looked passed as torch's own by its file alone:
    ``torch.tanh = F.log_softmax`` made nn.Tanh normalise over the batch (the implicit dimension
    of a 3-D input is 0), 3.72 C in a known chain under ghost, auto and compiled (two-hundred-and-
    fifth hostile review)."""
    if name == "cell_contents" or (name.startswith("__") and name.endswith("__")):
        return True
    while isinstance(getattr(fn, "__wrapped__", None), types.FunctionType) and \
            _plain_name(fn.__name__) != _plain_name(name):
        fn = fn.__wrapped__
    return _plain_name(getattr(fn, "__name__", "")) == _plain_name(name) or \
        (name, fn.__module__, fn.__qualname__) in _ALIASES


def _plain_name(name: str) -> str:
    """``name`` without underscores, lower case: torch's aliases of its builtins
    (``F.logsigmoid`` is ``torch._C._nn.log_sigmoid``, ``has_torch_function_unary`` is
    ``torch._C._has_torch_function_unary``) have the same plain name."""
    return name.replace("_", "").lower()


def _code_objects(code: types.CodeType) -> Iterable[types.CodeType]:
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _code_objects(c)


def _function(obj: Any) -> types.FunctionType | None:
    """The Python function behind ``obj`` (a function, a method, a static or class method, a
    property's getter), when it is torch's own code; else None (not followed)."""
    if isinstance(obj, (staticmethod, classmethod, types.MethodType)):
        obj = obj.__func__
    elif isinstance(obj, property):
        obj = obj.fget
    return obj if isinstance(obj, types.FunctionType) and (
        _torch_file(obj) or _model_file(obj)) else None


def _model_file(obj: Any) -> bool:
    """Whether ``obj`` is the forward of one of dpclip's own model classes that the ghost engine
    proves by its code (:data:`dpclip.registry.KNOWN_PROGRAMS`, by identity): followed like
    torch's code (what it looks up must be torch's own)."""
    return any(obj is f for f in KNOWN_PROGRAMS.values())


class _Lookups:
    """The ``(container, name, object)`` lookups of a set of functions (module docstring)."""

    def __init__(self) -> None:
        self.items: list[tuple[Any, str, Any, bool]] = []  # (container, name, object, is_dict)
        self.seen: set[tuple[int, str]] = set()
        #: code -> the shallowest depth it was followed at (followed again when met shallower:
        #: _call_impl met first at depth 3 through _wrapped_call_impl had its callees never
        #: followed when asked for at depth 2, two-hundred-and-third hostile review's side note)
        self.done: dict[types.CodeType, int] = {}
        self.bad: str | None = None
        #: ident -> (module, its class) of every module met (a container or a value)
        self.modules: dict[int, tuple[types.ModuleType, type]] = {}

    def add(self, container: Any, name: str, obj: Any, is_dict: bool, where: str,
            trusted: bool = False) -> None:
        """Record a lookup; ``trusted``: the object need not be torch's own (a known tree's
        forward, dpclip's model code: still compared by identity on every check)."""
        for m in (container, obj):
            if isinstance(m, types.ModuleType):
                self._module(m, where)
        key = (ident(container), name)
        if key in self.seen or key in _WATCHED:
            return
        self.seen.add(key)
        if isinstance(container, type):  # a class: the object its MRO holds (a classmethod,
            obj = _static(container, name)  # not the bound method made anew on each lookup)
        self.items.append((container, name, obj, is_dict))
        if self.bad is None and not trusted and not _own(name, obj):
            self.bad = (f"{where}: {name!r} is {_describe(obj)}, not torch's own (a library "
                        f"replaced it{_FIX})")
        for fn in _functions_of(obj):
            self._parts(fn, where)

    def _module(self, m: types.ModuleType, where: str) -> None:
        """Record the class of module ``m``: Python's module type, or a class of torch's own
        (torch._VF's VFModule: its methods are compared as a descriptor's, _functions_of). A
        module's ``__class__`` can be assigned a ModuleType subclass whose ``__getattribute__``
        answers each lookup as it likes: torch.nn.functional made one that handed the forward's
        lookups of ``linear`` a function adding the batch mean and dpclip's own reads the real
        one, 11.4 C in a known chain under ghost, auto and compiled (two-hundred-and-first
        hostile review)."""
        k = ident(m)
        if k in self.modules:
            return
        cls = type(m)
        self.modules[k] = (m, cls)
        if self.bad is None and cls is not types.ModuleType and \
                not str(getattr(cls, "__module__", "") or "").startswith("torch"):
            self.bad = (f"{where}: the module {getattr(m, '__name__', '?')!r} is of class "
                        f"{cls.__qualname__}, not Python's module type (its attribute lookups "
                        f"are code of its own{_FIX})")
        for fn in _functions_of(m):
            self._parts(fn, where)
        if cls is not types.ModuleType:
            # (a module of torch's own class answers lookups with code that reads its instance
            # dictionary: torch._VF's VFModule.__getattr__ returns getattr(self.vf, name), and
            # an object put in ``vf`` answered nn.Dropout's lookup of ``dropout`` with a function
            # adding the batch mean and dpclip's with the real one: 8.1 C in a known chain under
            # ghost, auto and compiled, two-hundred-and-third hostile review. Every entry of its
            # dictionary is a lookup, compared by identity, and must be torch's own)
            d = vars(m)
            for k in list(d):
                if isinstance(k, str) and not (k.startswith("__") and k.endswith("__")):
                    self.add(d, k, d[k], True, where)

    def _parts(self, fn: types.FunctionType, where: str) -> None:
        """What ``fn`` runs besides its name, compared at every check; a function of torch's
        files must run the code its source file compiles to. For every Python function recorded,
        followed or not (the function object stays torch's while what it runs is replaced:
        nn.Linear.forward.__code__ or F.relu.__code__ swapped for code adding the batch mean ran
        untraced in a known chain, 11.4 C and 5.8 C under ghost, auto and compiled, hundred-and-
        ninety-seventh hostile review; nn.Module.__getattr__'s code, recorded but never
        followed, 11.4 C, hundred-and-ninety-ninth; a code object swapped in before dpclip
        first looked had its file name, qualified name and first line copied from torch's)."""
        if (ident(fn), "__code__") in self.seen:
            return
        for part in _FUNCTION_PARTS:
            self.add(fn, part, getattr(fn, part, _MISSING), False, where)
        code = fn.__code__
        if self.bad is None and _torch_file(fn) and _compiled_at(
                os.path.realpath(code.co_filename), code.co_qualname,
                code.co_firstlineno) != code:
            self.bad = (f"{where}: {fn.__qualname__}'s code is not what torch's source file "
                        f"compiles to (a library replaced it{_FIX})")

    def follow(self, fn: types.FunctionType, cls: type | None, depth: int) -> None:
        was = self.done.get(fn.__code__)
        if was is not None and was <= depth:
            return
        self.done[fn.__code__] = depth
        glb = fn.__globals__
        where = f"{fn.__module__}.{fn.__qualname__}"
        self._parts(fn, where)
        cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
        callees: list[tuple[Any, type | None]] = []
        for code in _code_objects(fn.__code__):
            cur: Any = _MISSING
            local_self = False
            for ins in dis.get_instructions(code):
                op, arg = ins.opname, ins.argval
                if op in _LOAD_GLOBAL and isinstance(arg, str):
                    if arg in glb:
                        cur = glb[arg]
                        self.add(glb, arg, cur, True, where)
                    else:  # a builtin: absent from the globals, and Python's own in builtins
                        cur = getattr(builtins, arg, _MISSING)
                        self.add(glb, arg, _MISSING, True, where)
                        self.add(builtins, arg, cur, False, where)
                        if self.bad is None and not _python_builtin(arg, cur):
                            self.bad = (f"{where}: the builtin {arg!r} is {_describe(cur)}, not "
                                        f"Python's own (replaced in the builtins module{_FIX})")
                    callees.append((cur, None))
                    local_self = False
                elif op == "LOAD_DEREF" and arg in cells:
                    try:
                        cur = cells[arg].cell_contents
                    except ValueError:
                        cur = _MISSING
                    self.add(cells[arg], "cell_contents", cur, False, where)
                    callees.append((cur, None))
                    local_self = False
                elif op in _LOAD_ATTR and isinstance(arg, str):
                    if cur is not _MISSING:
                        nxt = getattr(cur, arg, _MISSING)
                        if not isinstance(cur, (type, types.ModuleType)) and \
                                getattr(cur, arg, _MISSING) is not nxt:
                            # an instance's attribute made anew on each lookup (a bound method):
                            # its class's
                            nxt = getattr(type(cur), arg, _MISSING)
                            self.add(type(cur), arg, nxt, False, where)
                            callees.append((nxt, type(cur)))
                            cur = _MISSING
                            local_self = False
                            continue
                        self.add(cur, arg, nxt, False, where)
                        callees.append((nxt, cur if isinstance(cur, type) else None))
                        cur = nxt
                    else:  # an attribute of a local: the module itself, or a tensor
                        if local_self and cls is not None:
                            got = getattr(cls, arg, _MISSING)
                            if got is not _MISSING:
                                self.add(cls, arg, got, False, where)
                                callees.append((got, cls))
                            else:  # an instance attribute, or Module.__getattr__ (parameters)
                                self.add(cls, "__getattr__", getattr(cls, "__getattr__",
                                                                     _MISSING), False, where)
                                # (and that the class has no such attribute: a property added
                                # to the class later outranks the instance's dictionary and
                                # __getattr__ alike; nn.Linear.weight made a property after the
                                # first step handed F.linear a tensor subclass whose
                                # __torch_function__ ran untraced, 11.4 C under ghost, auto and
                                # compiled, hundred-and-ninety-fifth hostile review)
                                self.add(cls, arg, _MISSING, False, where)
                        # (``self.norm`` of a module is no tensor: only a tensor's attribute
                        # is the tensor class's)
                        module_self = local_self and cls is not None and \
                            issubclass(cls, nn.Module)
                        t = getattr(torch.Tensor, arg, _MISSING)
                        if t is not _MISSING and not module_self:
                            self.add(torch.Tensor, arg, t, False, where)
                            callees.append((t, None))
                    local_self = False
                else:
                    for dunder in _operator_methods(ins):  # x / y on tensors: the tensor
                        got = _static(torch.Tensor, dunder)  # class's operator methods
                        if got is not _MISSING:
                            self.add(torch.Tensor, dunder, got, False, where)
                        if dunder == "__iter__":
                            if got is not _MISSING:  # (followed: Tensor.__iter__ calls
                                callees.append((got, torch.Tensor))  # self.unbind; 31st review)
                            for box in _ITERATED:
                                it = _static(box, dunder)
                                self.add(box, dunder, it, False, where)
                                callees.append((it, box))
                    # (``self`` in a cell when a nested function captures it: nn.Module.
                    # _call_impl reads every hook table through LOAD_DEREF self, which was
                    # never taken for ``self``, hundred-and-ninety-fifth hostile review)
                    local_self = op in ("LOAD_FAST", "LOAD_DEREF") and arg == "self"
                    cur = _MISSING
        if depth >= _DEPTH:
            return
        for obj, owner in callees:
            f = _function(obj)
            if f is not None:
                self.follow(f, owner if owner is not None else cls, depth + 1)

    def changed(self) -> str | None:
        if self.bad is not None:
            return self.bad
        for m, cls in self.modules.values():  # (first: the lookups below go through them)
            if type(m) is not cls:
                return (f"the class of module {getattr(m, '__name__', '?')!r} was replaced after "
                        f"dpclip first looked{_FIX}")
        for container, name, obj, is_dict in self.items:
            now = container.get(name, _MISSING) if is_dict else _static(container, name) \
                if isinstance(container, type) else getattr(container, name, _MISSING)
            if now is not obj:
                return (f"{_describe(container)}.{name} was replaced after dpclip first "
                        f"looked (now {_describe(now)}{_FIX})")
        return None


def _static(cls: type, name: str) -> Any:
    """``name`` as the class ``cls`` holds it (``inspect.getattr_static`` for a class attribute:
    the first class of the MRO whose ``__dict__`` has it; the metaclass is not consulted)."""
    for c in cls.__mro__:
        d = c.__dict__
        if name in d:
            return d[name]
    return _MISSING


def _watched() -> set[tuple[int, str]]:
    """The hook registration doors that dpclip's own :class:`~dpclip.engine.hook_watch.HookWatch`
    wraps while a traced step runs (``Tensor.register_hook``, ...): not compared here (the watch
    refuses any registration through them, and outside a watch no user code runs in a proved
    chain)."""
    from dpclip.engine.hook_watch import _DOORS
    return {(ident(owner), name) for owner, name, _ in _DOORS}


_WATCHED = _watched()


def _describe(obj: Any) -> str:
    if isinstance(obj, dict) and "__name__" in obj:
        return f"module {obj['__name__']}"
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    if isinstance(obj, type):
        return f"{obj.__module__}.{obj.__qualname__}"
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    mod = getattr(obj, "__module__", None)
    return f"{mod}.{name}" if name and mod else type(obj).__name__


_BINARY = {"+": "add", "-": "sub", "*": "mul", "/": "truediv", "//": "floordiv", "%": "mod",
           "**": "pow", "@": "matmul", "&": "and", "|": "or", "^": "xor", "<<": "lshift",
           ">>": "rshift"}
_COMPARE = {"<": ("__lt__", "__gt__"), "<=": ("__le__", "__ge__"), ">": ("__gt__", "__lt__"),
            ">=": ("__ge__", "__le__"), "==": ("__eq__",), "!=": ("__ne__",)}
_UNARY = {"UNARY_NEGATIVE": ("__neg__",), "UNARY_POSITIVE": ("__pos__",),
          "UNARY_INVERT": ("__invert__",), "UNARY_NOT": ("__bool__", "__len__"),
          "BINARY_SUBSCR": ("__getitem__",), "STORE_SUBSCR": ("__setitem__",),
          "BINARY_SLICE": ("__getitem__",), "STORE_SLICE": ("__setitem__",),
          "CONTAINS_OP": ("__contains__",), "POP_JUMP_FORWARD_IF_TRUE": ("__bool__",),
          "POP_JUMP_FORWARD_IF_FALSE": ("__bool__",), "POP_JUMP_IF_TRUE": ("__bool__",),
          "POP_JUMP_IF_FALSE": ("__bool__",),
          # iteration: ``q, k, v = t`` and ``for layer in self.layers`` (twenty-ninth hostile
          # review: a replaced Tensor.__iter__ / ModuleList.__iter__ ran inside a known tree)
          "GET_ITER": ("__iter__",), "UNPACK_SEQUENCE": ("__iter__",),
          "UNPACK_EX": ("__iter__",)}
#: the containers whose iteration a forward may run (``for layer in self.layers``)
_ITERATED = (nn.ModuleList, nn.Sequential, nn.ModuleDict, nn.ParameterList)


def _operator_methods(ins: dis.Instruction) -> tuple[str, ...]:
    """The operator methods an instruction may call on a tensor operand (``x / y``: the tensor
    class's ``__truediv__``, ``__rtruediv__``; ``x /= y``: ``__itruediv__`` too)."""
    op = ins.opname
    if op == "BINARY_OP":
        sym = str(ins.argrepr).rstrip("=") if ins.argrepr not in ("==", "<=", ">=", "!=") \
            else ins.argrepr
        base = _BINARY.get(sym)
        return (f"__{base}__", f"__r{base}__", f"__i{base}__") if base else ()
    if op == "COMPARE_OP":
        return _COMPARE.get(str(ins.argval), ())
    return _UNARY.get(op, ())


#: the class attributes every module call goes through before ``forward``; the attribute lookups
#: too: ``__getattribute__`` finds ``forward`` (and every attribute the forward reads), and
#: ``__getattr__`` its parameters and submodules (eighty-third hostile review: ``nn.Linear`` or
#: ``nn.Module.__getattribute__`` replaced by one that wrapped ``forward`` in code adding row 0 to
#: every row ran untraced in a known chain, and unseen between a ruled layer's computation and
#: its record on the traced path: LOO 2.55-2.81 C under ghost and auto)
_CALL_PATH = ("__call__", "_call_impl", "_wrapped_call_impl", "forward", "__getattribute__",
              "__getattr__", "_compiled_call_impl")

#: what a Python function runs besides its name: compared by identity at every check
_FUNCTION_PARTS = ("__code__", "__defaults__", "__kwdefaults__", "__closure__", "__globals__")


def _functions_of(obj: Any) -> list[types.FunctionType]:
    """The Python functions a recorded object runs when it is called or looked up through: a
    function or method, a static or class method's function, a property's accessors, and for
    an object of a class of torch's own (a descriptor like torch.backends' ContextProp, a module
    of a class of its own like torch._VF's VFModule) that class's ``__get__``, ``__set__``,
    ``__getattr__`` and ``__getattribute__`` when they are Python functions (hundred-and-
    ninety-ninth hostile review: code reached through them was never compared)."""
    if isinstance(obj, types.MethodType):
        obj = obj.__func__
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, types.FunctionType):
        return [obj]
    if isinstance(obj, property):
        return [f for f in (obj.fget, obj.fset, obj.fdel) if isinstance(f, types.FunctionType)]
    if obj is _MISSING or isinstance(obj, type):
        return []
    cls = type(obj)
    if not (cls.__module__ or "").startswith("torch"):
        return []
    out = []
    for name in ("__get__", "__set__", "__getattr__", "__getattribute__"):
        f = _static(cls, name)
        if isinstance(f, types.FunctionType):
            out.append(f)
    return out

#: per module class, its lookups (found the first time the class is asked about)
_BY_CLASS: dict[type, _Lookups] = {}
#: nn.Module.__call__'s own lookups (every module call runs them)
_CALL: _Lookups | None = None


def _lookups_of(cls: type) -> _Lookups:
    got = _BY_CLASS.get(cls)
    if got is None or got.bad is not None:  # (looked at again: a replacement may be undone)
        got = _Lookups()
        fwd = getattr(cls, "forward", None)
        raw = fwd.__func__ if isinstance(fwd, types.MethodType) else fwd
        if isinstance(raw, types.FunctionType) and not _torch_file(raw) and \
                not _stdlib_file(raw) and cls is hf_conv1d():
            # a ruled layer of another library: transformers' own Conv1D only (hf_conv1d)
            pkg = _package_dir(raw)
            if pkg is not None and pkg not in _TRUSTED_DIRS:
                _TRUSTED_DIRS.append(pkg)
        f = _function(fwd)
        if f is None:
            got.bad = f"{cls.__qualname__}.forward is not torch's own code"
        else:
            # how a call reaches forward: nn.Module.__call__ / _call_impl, unless the class (or a
            # patch on it: nn.Tanh.__call__ = ...) defines its own
            where = f"{cls.__module__}.{cls.__qualname__}"
            if _static(cls, "_compiled_call_impl") is not None:
                # (nn.Module._wrapped_call_impl calls self._compiled_call_impl when it is not
                # None, before _call_impl and forward: a class attribute nn.Linear.
                # _compiled_call_impl = f ran f untraced inside a known chain and around every
                # ruled layer's call, 11.4 C under ghost, auto and compiled; hundred-and-ninety-
                # fourth hostile review. torch.compile sets it on an instance, never a class)
                got.bad = (f"{where}._compiled_call_impl is set on the class (torch.compile's "
                           "entry, which nn.Module.__call__ runs instead of forward): the "
                           f"layer's call would run code no check sees{_FIX}")
            for name in _CALL_PATH:
                obj = _static(cls, name)
                got.add(cls, name, obj, False, where,
                        trusted=name == "forward" and obj is f and _model_file(f))
            # what nn.Module's call path reads through ``self`` (the hook tables, training,
            # ...), looked up on THIS class: a property there outranks the instance's
            # dictionary (class-level _forward_hooks properties handed _call_impl a hook that
            # added the batch mean while dpclip's checks read empty tables: 11.4 C (nn.Linear)
            # and 8.6 C (nn.Tanh) in a known chain under ghost, auto and compiled, hundred-and-
            # ninety-fifth hostile review); recorded against nn.Module alone, a subclass's MRO
            # was never looked at
            for call in (nn.Module._wrapped_call_impl, nn.Module._call_impl):
                fn = _function(call)
                if fn is not None:
                    got.follow(fn, cls, _DEPTH - 1)
            got.follow(f, cls, 0)
        _BY_CLASS[cls] = got
    return got


def library_changed(classes: Iterable[type]) -> str | None:
    """None when every name that the ``forward`` of each class of ``classes`` (torch's
    ``torch.nn`` classes: the caller checks that the forward is torch's own) and
    ``nn.Module.__call__`` look up is still torch's own object (module docstring); else a
    sentence naming the first replaced one."""
    global _CALL
    if _CALL is None or _CALL.bad is not None:
        call = _Lookups()
        for f in (nn.Module._call_impl, nn.Module._wrapped_call_impl):
            fn = _function(f)
            if fn is not None:
                call.follow(fn, nn.Module, _DEPTH - 1)
        _CALL = call
    why = _CALL.changed()
    if why is not None:
        return why
    for cls in classes:
        why = _lookups_of(cls).changed()
        if why is not None:
            return why
    return None
