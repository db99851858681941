"""Whether a ``torch.nn`` module's call can run user code (issue 31, third hostile review).

The ghost engine runs some calls without tracing them, on the strength of what torch's own code
computes: a plain chain of known modules (``ghost_forward._known_chain``), a chain whose layouts
are cached (``ghost_forward._chain_key``), and it reads a ruled layer's per-example gradient from
its input and output assuming the class's own forward ran. Each of these is only as good as the
assumption that the call runs torch's code and nothing else. A module instance can run user code
in many ways that its class does not show (each was accepted by ghost before, LOO above C:
``tests/engine/test_hostile_review.py``, "third review"):

* an instance attribute that the class's forward looks up: ``forward``, ``_conv_forward``, a
  configuration value of a user type (an ``int`` subclass as ``Softmax.dim`` whose ``__mod__``
  lies to the engine's check, an object as ``BatchNorm.training`` whose ``__bool__`` changes its
  answer between the check and the forward), a tensor in ``__dict__`` shadowing a parameter;
* a parameter or buffer of a tensor subclass (``__torch_function__`` sees the input);
* a hook table replaced by a dict subclass whose ``__bool__`` hides its hooks from the check but
  not from ``Module.__call__``;
* user code active around the call: a torch function or dispatch mode, saved-tensor hooks.

:func:`plain_instance` accepts an instance only when its ``__dict__`` holds nothing but the
``Module`` machinery's own tables (of their exact types, the hook tables empty) and configuration
values of exact built-in types (numbers, strings, ``None``, tuples / lists / ``torch.Size`` of
them); its parameters exact ``nn.Parameter`` and its buffers exact ``torch.Tensor``.
:func:`global_hooks_clear` checks torch's global module hook tables the same way, and
:func:`ambient_user_code` the modes and saved-tensor hooks active at the call.
"""

from __future__ import annotations

import collections
import types
from typing import Any

import torch
from torch import Tensor, nn

from dpclip.engine.memory_watch import foreign_saved_tensor_hooks

__all__ = ["ambient_user_code", "global_hooks_clear", "instance_code", "plain_instance",
           "same_code"]

_module_mod = torch.nn.modules.module
_OD = collections.OrderedDict

#: hook tables that ``Module.__call__`` runs: exact type, and empty for a call without hooks
_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
#: the rest of the machinery's tables: exact type only (contents are not called by a forward)
_TABLES: dict[str, tuple[type, ...]] = {
    "_forward_hooks_with_kwargs": (_OD, dict), "_forward_hooks_always_called": (_OD, dict),
    "_forward_pre_hooks_with_kwargs": (_OD, dict), "_state_dict_hooks": (_OD, dict),
    "_state_dict_pre_hooks": (_OD, dict), "_load_state_dict_pre_hooks": (_OD, dict),
    "_load_state_dict_post_hooks": (_OD, dict), "_non_persistent_buffers_set": (set,),
    "_parameters": (dict,), "_buffers": (dict,), "_modules": (dict,),
}
for _k in _HOOK_TABLES:
    _TABLES[_k] = (_OD, dict)
_SCALARS = (int, float, bool, str, type(None))
_SEQUENCES = (tuple, list, torch.Size)

#: instance attributes that replace the code a layer's own class runs
_CODE_NAMES = frozenset({"forward", "_conv_forward", "__call__", "_call_impl", "_slow_forward",
                         "_wrapped_call_impl", "_compiled_call_impl"})


def _plain_value(v: Any, depth: int = 0) -> bool:
    t = type(v)
    if t in _SCALARS:
        return True
    return t in _SEQUENCES and depth < 4 and all(_plain_value(x, depth + 1) for x in v)


def plain_instance(mod: nn.Module, hooks: bool = False) -> bool:
    """Whether calling ``mod`` (of a class whose code is torch's own: the caller checks the class)
    runs no user code: module docstring. ``hooks``: the hook tables may be non-empty (the caller
    checks them itself)."""
    d = mod.__dict__
    if type(d) is not dict:
        return False
    for k, v in d.items():
        if type(k) is not str:
            return False
        allowed = _TABLES.get(k)
        if allowed is not None:
            if type(v) not in allowed or (not hooks and k in _HOOK_TABLES and len(v)):
                return False
        elif k == "_is_full_backward_hook":
            if v is not None and type(v) is not bool:
                return False
        elif not _plain_value(v):
            return False
    if any(p is not None and type(p) is not nn.Parameter for p in d["_parameters"].values()):
        return False
    return all(b is None or type(b) is Tensor for b in d["_buffers"].values())


def instance_code(mod: nn.Module) -> str | None:
    """The name of an instance attribute of ``mod`` that replaces code its class runs (an
    instance ``forward``, ``_conv_forward``, ...), of a parameter of a tensor subclass
    (``__torch_function__`` runs user code on every operation), of a ``training`` flag that is not
    a ``bool``, or (for a class of ``torch.nn`` itself) of a configuration value that is not plain
    data (an ``int`` subclass can answer the engine and the forward differently): None when there
    is none. Cheap enough for every call of a hooked layer."""
    d = mod.__dict__
    for k in _CODE_NAMES:
        if k in d:
            return k
    for k, p in d["_parameters"].items():
        if p is not None and type(p) is not nn.Parameter:
            return k
    if type(d.get("training")) is not bool:  # a user object's __bool__ can change its answer
        return "training"
    if type(mod) in _TORCH_CLASSES:  # torch's own class: its configuration is plain data
        for k, v in d.items():
            if k[:1] != "_" and not _plain_value(v):
                return k
    return None


#: the module classes ``torch.nn`` defines (their configuration attributes are plain data)
_TORCH_CLASSES = frozenset(c for c in vars(nn).values()
                           if isinstance(c, type) and issubclass(c, nn.Module))


def global_hooks_clear() -> bool:
    """Whether torch's global module hook tables are plain and empty (a dict subclass whose
    ``__bool__`` hides its hooks from a truth test is not empty)."""
    for name in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks"):
        t = getattr(_module_mod, name, None)
        if type(t) not in (_OD, dict) or len(t):
            return False
    return True


def python_callbacks() -> str | None:
    """Interpreter-level user code that would run INSIDE library code, or None: a trace or
    profile function (``sys.settrace`` / ``sys.setprofile``: a debugger, a profiler, coverage),
    a ``sys.monitoring`` tool (Python 3.12+). Each sees the frames of
    the code it interrupts (their locals: the layers' inputs and outputs), so a program of known
    modules is not "no user code" while one is set: the engine then traces it like user code
    (a trace function that rewrote ``nn.Linear``'s output in place with its batch mean inside an
    untraced known chain: LOO 2.00 C before). Garbage-collector callbacks and finalizers can
    reach frames too (``sys._getframe``), but they run whenever the collector does, are installed
    by ordinary libraries (hypothesis keeps one) and cannot all be listed (``__del__``): they stay
    outside the trust boundary (docs/engines.md)."""
    import sys

    if sys.gettrace() is not None:
        return "a trace function (sys.settrace) is set"
    if sys.getprofile() is not None:
        return "a profile function (sys.setprofile) is set"
    mon = getattr(sys, "monitoring", None)
    if mon is not None and any(mon.get_tool(i) is not None for i in range(6)):
        return "a sys.monitoring tool is registered"
    return None


def ambient_user_code() -> str | None:
    """User code active around the engine's call that runs on the forward's or backward's
    operations, or None: a torch function mode (other than ``torch.device(...)``'s own), a torch
    dispatch mode, saved-tensor hooks (they may rewrite what the backward reads)."""
    from torch.utils._device import DeviceContext

    for i in range(torch._C._len_torch_function_stack()):
        mode = torch._C._get_function_stack_at(i)
        if type(mode) is not DeviceContext:
            return f"a torch function mode ({type(mode).__name__}) is active"
    if torch._C._len_torch_dispatch_stack():
        return "a torch dispatch mode is active"
    if foreign_saved_tensor_hooks() is not None:  # (the engine's own watch is not user code)
        return ("saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks, save_on_cpu) are "
                "active")
    return None


#: class attributes that decide which code an instance's call runs (attribute lookup included)
_LOOKUP_NAMES = ("forward", "_conv_forward", "__getattribute__", "__getattr__", "__call__",
                 "_call_impl", "_wrapped_call_impl")


def _static(cls: type, name: str) -> Any:
    for c in cls.__mro__:
        if name in c.__dict__:
            return c.__dict__[name]
    return None


#: entries every class body makes (not configuration)
_CLASS_BOOKKEEPING = frozenset({
    "__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__",
    "__firstlineno__", "__static_attributes__", "__orig_bases__", "__parameters__",
    "__type_params__", "__classcell__", "__abstractmethods__", "_abc_impl"})


def class_data(cls: type, base: type) -> str | None:
    """The first entry other than a function that a class between ``cls`` and ``base`` (a torch
    layer class with a ghost rule) defines: class-level data (``padding_mode = "circular"``), a
    property or another descriptor. The rule reads the layer's configuration as ``base`` keeps it
    (on the instance); configuration held by a subclass can change while the instance does not
    (twentieth hostile review: a padding list set on the class for the layer's call only, LOO
    2.14 C). Such a subclass takes the per-layer path instead. None when there is none."""
    for c in cls.__mro__:
        if c is base:
            return None
        for k, v in vars(c).items():
            if k in _CLASS_BOOKKEEPING or isinstance(v, (types.FunctionType, staticmethod,
                                                         classmethod)):
                continue
            return f"{c.__name__}.{k}"
    return None


def same_code(cls: type, base: type) -> bool:
    """Whether instances of ``cls`` (a subclass of ``base``) run ``base``'s code when called: the
    same ``forward`` and the same attribute lookup and call machinery, read from the classes'
    own ``__dict__`` along the MRO (a ``__getattribute__`` override can hand the call another
    forward while ``cls.forward is base.forward``: third hostile review, LOO 2.00 C), and no
    metaclass (one can lie to ``cls.forward``)."""
    if type(cls) is not type and type(cls) is not type(base):
        return False
    return all(_static(cls, n) is _static(base, n) for n in _LOOKUP_NAMES)
