"""What one chunk of user code leaves for the next: nothing outside the model's guarded state
(issue 31, the hostile reviews of the chunk of one).

Consecutive chunks and steps share the process. Besides tensors (the tracer, the memory watch,
the proved-program match and the state guard see those), a forward or loss can keep an example
in process state that the next call reads, with torch functions and Python dispatch off so that
no trace sees the write. Found and closed here:

* torch's random generators: a seed taken from the example, or its value planted in the CPU
  generator's cached normal sample (:mod:`dpclip.engine.generators`);
* a plain Python attribute of a module (``self.k = float(x[0].sum())``, read by the next call as
  a constant): the proof cache keys on the model's plain attributes, so the next call got a fresh
  proof traced with the carried value, and matched it. On d997b70: a later call moved by 3.67 C
  (sound: 0), LOO 2.06 C at ``max_physical_batch=1``; through ``make_private`` the next step moved
  by 1.49 C;
* torch's global numeric settings: ``torch.set_flush_denormal`` chosen from the example changed the
  next call's arithmetic (a program that adds ``2`` or ``0`` depending on it), with every operation
  and argument the proof's. On d997b70: a later call moved by 2.33 C, LOO 2.38 C at
  ``max_physical_batch=1``, a ``make_private`` step 3.30 C.

:class:`Isolated` runs one chunk: it enters :class:`~dpclip.engine.generators.OwnGenerators` and
takes the model's plain Python attributes (every module's, as the proof cache reads them) and
torch's global settings (:func:`settings`: default dtype and device, deterministic algorithms,
float32 matmul precision, TF32 / reduced-precision flags, cuDNN and oneDNN switches, einsum
strategy, threads, autocast, grad mode, and whether denormals are flushed, read from the
interpreter's own float arithmetic since torch has no getter). On exit it puts the generators back, and when an attribute or a setting
changed it puts those back too and raises :class:`~dpclip.engine.errors.UnsupportedModelError`
naming it (never a vmap fallback: vmap would run the same code). Attributes and settings changed
between calls by the caller (a new epoch's flag) are the caller's: the next chunk starts from them.

Cost per chunk (CPU, bench MLP with a user loss): the generators' ~10 us, the settings ~10 us, the
attributes one walk of the modules (the proof cache walks them too).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpclip.engine.batch_symbol import _modules, _python_state
from dpclip.engine.errors import UnsupportedModelError
from dpclip.engine.generators import OwnGenerators

__all__ = ["Isolated", "settings"]

#: two floats whose product is a denormal, 0.0 when denormals are flushed (the flag
#: ``torch.set_flush_denormal`` sets, FTZ / DAZ, applies to the interpreter's float arithmetic too;
#: module globals, so that the product is not folded at compile time)
_TINY, _SMALL = 1e-300, 1e-10


def _flushed() -> bool:
    return _TINY * _SMALL == 0.0


def _get(read: Any) -> Any:
    try:
        return read()
    except (AttributeError, RuntimeError):  # (not in this build)
        return None


def _c(name: str, fallback: Any) -> Any:
    """torch's C getter ``name`` (about 0.1 us) when this build has it, else ``fallback``."""
    return getattr(torch._C, name, None) or fallback


_cublas = torch.backends.cuda.matmul
_cudnn = torch.backends.cudnn
_einsum = getattr(torch.backends.opt_einsum, "m", None)


def _device() -> Any:
    """The default device's context object (``torch.set_default_device`` replaces it)."""
    ctx = getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)
    return None if ctx is None else str(ctx.device)


def _einsum_flags() -> Any:
    if _einsum is not None:
        return (vars(_einsum).get("enabled"), vars(_einsum).get("strategy"))
    return (torch.backends.opt_einsum.enabled, torch.backends.opt_einsum.strategy)


def _set_einsum(v: Any) -> None:
    torch.backends.opt_einsum.enabled = v[0]
    if v[0] and v[1] is not None:
        torch.backends.opt_einsum.strategy = v[1]


#: ``(name, read, write)`` of every global setting watched (``write``: how to put it back)
_SETTINGS: tuple[tuple[str, Any, Any], ...] = (
    ("default dtype", torch.get_default_dtype, torch.set_default_dtype),
    ("default device", _device, torch.set_default_device),
    ("deterministic algorithms", lambda: (torch.are_deterministic_algorithms_enabled(),
                                          torch.is_deterministic_algorithms_warn_only_enabled()),
     lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1])),
    ("float32 matmul precision", torch.get_float32_matmul_precision,
     torch.set_float32_matmul_precision),
    ("cuda matmul allow_tf32", _c("_get_cublas_allow_tf32", lambda: _cublas.allow_tf32),
     lambda v: setattr(_cublas, "allow_tf32", v)),
    ("cuda matmul fp16 reduced precision",
     _c("_get_cublas_allow_fp16_reduced_precision_reduction",
        lambda: _cublas.allow_fp16_reduced_precision_reduction),
     lambda v: setattr(_cublas, "allow_fp16_reduced_precision_reduction", v)),
    ("cuda matmul bf16 reduced precision",
     _c("_get_cublas_allow_bf16_reduced_precision_reduction",
        lambda: _cublas.allow_bf16_reduced_precision_reduction),
     lambda v: setattr(_cublas, "allow_bf16_reduced_precision_reduction", v)),
    ("cudnn enabled", _c("_get_cudnn_enabled", lambda: _cudnn.enabled),
     lambda v: setattr(_cudnn, "enabled", v)),
    ("cudnn allow_tf32", _c("_get_cudnn_allow_tf32", lambda: _cudnn.allow_tf32),
     lambda v: setattr(_cudnn, "allow_tf32", v)),
    ("cudnn deterministic", _c("_get_cudnn_deterministic", lambda: _cudnn.deterministic),
     lambda v: setattr(_cudnn, "deterministic", v)),
    ("cudnn benchmark", _c("_get_cudnn_benchmark", lambda: _cudnn.benchmark),
     lambda v: setattr(_cudnn, "benchmark", v)),
    ("mkldnn enabled", _c("_get_mkldnn_enabled", lambda: torch.backends.mkldnn.enabled),
     lambda v: setattr(torch.backends.mkldnn, "enabled", v)),
    ("opt_einsum", _einsum_flags, _set_einsum),
    ("threads", torch.get_num_threads, torch.set_num_threads),
    ("autocast", lambda: (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                          torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")),
     lambda v: (torch.set_autocast_enabled("cpu", v[0]), torch.set_autocast_dtype("cpu", v[1]),
                torch.set_autocast_enabled("cuda", v[2]), torch.set_autocast_dtype("cuda", v[3]))),
    ("grad mode", torch.is_grad_enabled, torch.set_grad_enabled),
    ("flush denormal", _flushed, torch.set_flush_denormal),
)


def settings() -> tuple:
    """torch's global settings that change what a computation returns (module docstring)."""
    return tuple(_get(read) for _, read, _ in _SETTINGS)


def _attributes(model: nn.Module) -> tuple:
    return tuple((m, _python_state(m)) for m in _modules(model))


class Isolated:
    """Context manager around one chunk of user code (module docstring)."""

    __slots__ = ("model", "gens", "_settings", "_attrs")

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.gens = OwnGenerators()
        self._settings: tuple = ()
        self._attrs: tuple = ()

    def __enter__(self) -> "Isolated":
        self._settings = settings()
        self._attrs = _attributes(self.model)
        self.gens.__enter__()
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.gens.__exit__(exc_type, *exc)
        changed = self._put_back_settings() + self._put_back_attributes()
        if changed and exc_type is None:
            raise UnsupportedModelError(
                f"the forward or loss changed {', '.join(changed)} during a private step (they "
                "were put back). Whatever a call leaves there, the next call reads: it would "
                "carry this call's examples into the next one's computation (a value taken from "
                "the batch, kept with torch functions off, is seen by no trace). Set such "
                "attributes and settings outside the step, or keep state in registered buffers "
                "(guarded)")

    def _put_back_settings(self) -> list[str]:
        now = settings()
        if now == self._settings:
            return []
        changed = []
        for (name, _, write), was, got in zip(_SETTINGS, self._settings, now):
            if got != was and was is not None:
                write(was)
                changed.append(f"torch's global setting {name!r}")
        return changed

    def _put_back_attributes(self) -> list[str]:
        now = _attributes(self.model)
        if now == self._attrs:
            return []
        names = {id(m): n for n, m in self.model.named_modules(remove_duplicate=False)}
        before = {id(m): (m, dict(state)) for m, state in self._attrs}
        changed = []
        for m, state in now:
            old = before.get(id(m), (m, {}))[1]
            new = dict(state)
            for key in sorted(set(old) | set(new)):
                if key in old and key in new and (old[key] is new[key] or old[key] == new[key]):
                    continue
                if key in old:
                    setattr(m, key, old[key])
                else:
                    delattr(m, key)
                where = names.get(id(m), "")
                name = f"{where}.{key}" if where else key
                changed.append(f"the model's Python attribute {name!r}")
        return changed
