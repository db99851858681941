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

Found by the third review (ab7cb53), each moving a later call by 3.4-4.5 C (sound: 0): a module's
class swapped (``self.__class__ = B``: the proof cache keys on the classes, so the next call got
B's proof), the FPU rounding mode (``fesetround``), an instance ``forward``, and under ``vmap``
(no proved-program match) a number kept in a list, a class attribute or a forward hook; a
``requires_grad_`` toggle or a replaced ``.data`` stayed after a refusal.

:class:`Isolated` runs one chunk: it enters :class:`~dpclip.engine.generators.OwnGenerators` and
takes the model's state as the next call could read it (every module's class; every attribute of
its ``__dict__``, plain values by value, anything else by identity, containers such as hook tables,
``_parameters``, lists and tuples by their content, containers inside them at every depth; its
parameters' ``requires_grad`` and storage;
the attributes of every class in the modules' MROs but torch's, transformers' and peft's) and
torch's global settings (:func:`settings`: default dtype and device, deterministic algorithms,
float32 matmul precision and every backend's float32 precision, TF32 / reduced-precision flags,
the attention kernels enabled, cuDNN, oneDNN and NNPACK switches, einsum
strategy, threads, autocast, grad mode, whether denormals are flushed or read as zero (from the
interpreter's own float arithmetic: torch has no getter), the C library's rounding mode, the
global module hooks and the Python signal handlers). On exit it puts the generators back, and when an attribute or a setting
changed it puts those back too and raises :class:`~dpclip.engine.errors.UnsupportedModelError`
naming it (never a vmap fallback: vmap would run the same code). Attributes and settings changed
between calls by the caller (a new epoch's flag) are the caller's: the next chunk starts from them.

Cost per chunk (benchmarks/results/isolation_cost_cpu.md, 2-core CPU, 1 thread, medians of 30
paired steps): the bench MLP with a user loss +0.17 ms at B 256 (x1.10) and +0.32 ms at B 1024
(x1.12); small Hugging Face BERT +1.15 ms (x1.03) and Llama +1.86 ms (x1.04). The context alone
measures ~70 us on the 6-module MLP (the state snapshot ~4 us a module, its comparison, the
settings and the generators). A closed program (no user code: the bench's MLP cell) pays none.
"""

from __future__ import annotations

import _random
import array as _array
import collections
from dpclip.engine import _cm
import contextvars
import functools
import gc
import operator
import re
import threading
import weakref
import ctypes
import ctypes.util
import _signal
import platform
import signal
import struct
import sys
import types
from typing import Any, Iterator

import numpy as _np
import torch
from torch import nn

from dpclip._ident import ident
from dpclip.engine.batch_symbol import _modules, plain_exact
from dpclip.engine import frames_guard, torch_names
from dpclip.engine.errors import UnsupportedModelError
from dpclip.engine.generators import OwnGenerators
from dpclip.engine.hf_hooks import prime
from dpclip.engine.proved_program import foreign_aten_kernels

__all__ = ["Isolated", "check_structure", "collector_paused", "engine_only", "origin", "settings",
           "signals_deferred"]

#: two floats whose product is a denormal, 0.0 when denormals are flushed (the flag
#: ``torch.set_flush_denormal`` sets, FTZ / DAZ, applies to the interpreter's float arithmetic too;
#: module globals, so that the product is not folded at compile time)
_TINY, _SMALL = 1e-300, 1e-10


#: a denormal: read as 0.0 when denormal operands are treated as zero (DAZ)
_DENORMAL = 1e-310


def _flushed() -> tuple[bool, bool]:
    return _TINY * _SMALL == 0.0, _DENORMAL * 1.0 == 0.0


def _set_flushed(v: tuple[bool, bool]) -> None:
    torch.set_flush_denormal(v[0])


try:  # the C library's rounding mode (fesetround changes it for the whole thread)
    _LIBM: Any = ctypes.CDLL(ctypes.util.find_library("m") or None)
    _LIBM.fegetround()
except (OSError, AttributeError):  # (no C math library to ask: the probe below decides)
    _LIBM = None

#: ``(1 + e) - 1``, ``(1 - e) - 1`` and ``(-1 - e) + 1`` tell the four rounding modes apart
_ONE, _E = 1.0, 1e-17


#: x86-64 with glibc: ``fenv_t`` holds the x87 control word (offset 0) and the SSE control and
#: status register MXCSR (offset 28). ``fegetround`` reads the x87 word only, but the CPU kernels
#: compute with SSE / AVX, ruled by MXCSR (rounding, flush-to-zero, denormals-are-zero): an
#: environment set with x87 at "nearest" and SSE "upward" read as "nearest" (fifth hostile review:
#: a later call moved by 3.24 C). Both control words are compared (MXCSR without its exception
#: flags, which any arithmetic sets), and the whole environment is put back.
_FENV = platform.machine().lower() in ("x86_64", "amd64") and platform.libc_ver()[0] == "glibc"
_FENV_BYTES = 64  # (glibc's fenv_t is 32 bytes on x86-64; room to spare)
#: MXCSR without the six exception flags and without flush-to-zero (bit 15) and
#: denormals-are-zero (bit 6), which the "flush denormal" setting watches and puts back
_MXCSR_CONTROL = 0xFFFF & ~(0x3F | 0x40 | 0x8000)


def _rounding() -> Any:
    if _LIBM is not None:
        if _FENV:
            env = ctypes.create_string_buffer(_FENV_BYTES)
            _LIBM.fegetenv(env)
            raw = env.raw
            return _Env(raw, struct.unpack_from("<H", raw, 0)[0],
                        struct.unpack_from("<I", raw, 28)[0] & _MXCSR_CONTROL)
        return _LIBM.fegetround()
    return ((_ONE + _E) - _ONE, (_ONE - _E) - _ONE, (-_ONE - _E) + _ONE)


class _Env:
    """The floating-point environment (x86-64 glibc): compared by its control words only, put
    back whole."""

    __slots__ = ("raw", "x87", "sse")

    def __init__(self, raw: bytes, x87: int, sse: int) -> None:
        self.raw, self.x87, self.sse = raw, x87, sse

    def __eq__(self, other: object) -> bool:
        return type(other) is _Env and (self.x87, self.sse) == (other.x87, other.sse)

    def __repr__(self) -> str:
        return f"x87 control {self.x87:#06x}, MXCSR control {self.sse:#06x}"


def _set_rounding(mode: Any) -> None:
    if _LIBM is not None:
        if type(mode) is _Env:
            _LIBM.fesetenv(ctypes.create_string_buffer(mode.raw, _FENV_BYTES))
        elif mode is not None:
            _LIBM.fesetround(mode)


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


def _fp32_precisions() -> list[tuple[str, Any, Any]]:
    read = getattr(torch._C, "_get_fp32_precision_getter", None)
    write = getattr(torch._C, "_set_fp32_precision_setter", None)
    if read is None or write is None:
        return []
    return [(f"{backend} {op} fp32_precision",
             lambda b=backend, o=op: read(b, o), lambda v, b=backend, o=op: write(b, o, v))
            for backend, ops in (("generic", ("all",)), ("mkldnn", ("all", "matmul", "conv", "rnn")),
                                 ("cuda", ("all", "matmul", "conv", "rnn")))
            for op in ops]


#: torch's C flags ``(_get_X, _set_X)`` that change what a kernel computes or which kernel runs
_C_FLAGS = (
    ("cpu fp16 reduced precision", "_get_cpu_allow_fp16_reduced_precision_reduction",
     "_set_cpu_allow_fp16_reduced_precision_reduction"),
    ("math sdp fp16/bf16 reduction", "_get_math_sdp_allow_fp16_bf16_reduction",
     "_set_math_sdp_allow_fp16_bf16_reduction"),
    ("mkldnn deterministic", "_get_mkldnn_deterministic", "_set_mkldnn_deterministic"),
    ("nnpack enabled", "_get_nnpack_enabled", "_set_nnpack_enabled"),
    ("cuda matmul fp16 accumulation", "_get_cublas_allow_fp16_accumulation",
     "_set_cublas_allow_fp16_accumulation"),
    ("flash sdp", "_get_flash_sdp_enabled", "_set_sdp_use_flash"),
    ("memory-efficient sdp", "_get_mem_efficient_sdp_enabled", "_set_sdp_use_mem_efficient"),
    ("math sdp", "_get_math_sdp_enabled", "_set_sdp_use_math"),
    ("cudnn sdp", "_get_cudnn_sdp_enabled", "_set_sdp_use_cudnn"),
    ("fa3 sdp", "_get_fa3_sdp_enabled", "_set_sdp_use_fa3"),
    ("overrideable sdp", "_get_overrideable_sdp_enabled", "_set_sdp_use_overrideable"),
    ("sdp priority order", "_get_sdp_priority_order", "_set_sdp_priority_order"),
    ("linalg backend", "_get_linalg_preferred_backend", "_set_linalg_preferred_backend"),
    ("blas backend", "_get_blas_preferred_backend", "_set_blas_preferred_backend"),
)


def _c_flags() -> list[tuple[str, Any, Any]]:
    return [(name, getattr(torch._C, get), getattr(torch._C, put))
            for name, get, put in _C_FLAGS
            if hasattr(torch._C, get) and hasattr(torch._C, put)]


def _interpreter_callbacks() -> tuple:
    """The trace and profile functions (and ``sys.monitoring`` tools' names): a profile function
    that the forward sets and leaves runs inside the engine's own code after it (thirty-eighth
    hostile review: one multiplied the clipping weights by 50 where ``apply_weight_fn`` returned
    them, one zeroed the noise): a change is refused, and put back before the engine goes on."""
    mon = getattr(sys, "monitoring", None)
    tools = tuple(mon.get_tool(i) for i in range(6)) if mon is not None else ()
    return sys.gettrace(), sys.getprofile(), tools


def _set_interpreter_callbacks(v: tuple) -> None:
    frames_guard.put_back_callbacks(v[0], v[1])


#: the signals whose handlers a Python program can set (read once)
_SIGNALS: tuple[int, ...] = tuple(sorted(
    int(s) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)))


def _signal_handlers() -> tuple:
    """Every signal's Python-level handler (``None`` where Python installed none; ``0`` / ``1``
    for the default action / ignored: ``_signal``'s raw values, 30x cheaper than
    ``signal.getsignal``'s enums)."""
    return tuple(map(_signal.getsignal, _SIGNALS))


def _set_signal_handlers(v: tuple) -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # (handlers are set, and run, in the main thread only)
    for sig, handler in zip(_SIGNALS, v):
        if handler is not None and _signal.getsignal(sig) is not handler:
            try:
                _signal.signal(sig, handler)
            except (ValueError, OSError, TypeError):
                pass


@_cm.contextmanager
def signals_deferred() -> Iterator[None]:
    """No Python signal handler runs inside: every handler is replaced by one that records the
    signal, and the recorded signals are handed to the handlers they were meant for (in order of
    arrival, once each, as the OS delivers a pending signal) once they are put back. The engines' reductions and the release run inside: a handler runs between
    any two bytecodes of the main thread, outside every check of the user code's chunks (fortieth
    hostile review: a ``SIGALRM`` handler the model installed switched autocast on inside the
    reduction and off again before its end, LOO 1.19 C; one that scaled the engine's captured
    activations after their check, 47-136 C, under ghost and auto). A handler the forward installs
    is refused by :class:`Isolated` (a watched setting). Cost: one read of the ~60 handlers (~3 us)
    and one ``signal.signal`` per Python handler installed (usually SIGINT's), twice. Outside the main thread (where no
    handler runs and none can be set) it does nothing: the main thread itself is then concurrent
    code, outside the trust boundary as any other thread (docs/engines.md)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def record(signum: int, frame: Any) -> None:
        if signum not in pending:  # (a signal pending twice is delivered once, as by the OS)
            pending.append(signum)

    saved = []
    for sig, handler in zip(_SIGNALS, _signal_handlers()):
        if callable(handler):
            try:
                _signal.signal(sig, record)
            except (ValueError, OSError):
                continue
            saved.append((sig, handler))
    try:
        yield
    finally:
        for sig, handler in saved:
            _signal.signal(sig, handler)
        handlers = dict(saved)
        for signum in pending:
            # (no frame: a handler given one reached the step's locals, forty-sixth review)
            handlers[signum](signum, None)


def _dispatch_sets() -> tuple:
    """The thread's local include / exclude dispatch key sets (the Python dispatcher is one of
    the included keys: it sends every ATen operation to the Python kernels registered on it)."""
    c = torch._C
    return (c._dispatch_tls_local_include_set(), c._dispatch_tls_local_exclude_set())


def _dispatch_repr() -> tuple[int, int]:
    return tuple(s.raw_repr() for s in _dispatch_sets())


def _set_dispatch_sets(v: tuple[int, int]) -> None:
    """Put the local dispatch key sets back, key by key (``v``: :func:`_dispatch_repr`)."""
    c = torch._C
    include, exclude = _dispatch_sets()
    was = [c.DispatchKeySet.from_raw_repr(r) for r in v]
    for k in c.DispatchKey.__members__.values():
        for now, old, setter in ((include, was[0], c._dispatch_tls_set_dispatch_key_included),
                                 (exclude, was[1], c._dispatch_tls_set_dispatch_key_excluded)):
            try:
                if now.has(k) != old.has(k):
                    setter(k, old.has(k))
            except (RuntimeError, TypeError, ValueError):  # (an alias key: not settable)
                pass


_EVAL_FRAME = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)

FRAME_CALLBACK = (
    "a frame-evaluation callback is set (PEP 523: torch._C._dynamo.eval_frame.set_eval_frame, or "
    "its bytecode debugger callback) outside torch.compile: it is handed every Python frame the "
    "engine and the release run, with their locals, and could rewrite the gradients or cancel "
    "the noise (hundred-and-nineteenth hostile review: 50 C under every engine); it was taken "
    "out and the step refused. Do not set it in the model's code")


def _frame_callbacks() -> Any:
    """The frame-evaluation callbacks torch's C entry points set (None where none is)."""
    if _EVAL_FRAME is None:
        return None
    got = (_EVAL_FRAME.get_eval_frame_callback(), _EVAL_FRAME.get_bytecode_debugger_callback())
    return None if got == (None, None) else got


def _clear_frame_callbacks() -> None:
    _EVAL_FRAME.set_eval_frame(None)
    _EVAL_FRAME.set_bytecode_debugger_callback(None)


@_cm.contextmanager
def engine_only() -> Iterator[None]:
    """The engines' own code runs with no user code reachable between its operations:
    :func:`signals_deferred`, the collector's callbacks taken out, no Python kernel registered
    over an ATen operation and no torch function / dispatch mode or saved-tensor hooks active
    (refused), and the Python dispatcher off (with it on, every ATen operation
    first calls the Python kernels registered on its backend keys; forty-first hostile review: a
    model that switched it on, in its constructor or left on by its forward, with kernels on
    ``mul`` / ``mm`` / ``sum`` scaled ghost's captured activations inside the reduction, LOO 47.2 C
    under ghost and auto, and the clipped sum inside ``dp_step``'s release before the noise,
    50 C). The user's state is put back after. Around every engine's ``compute`` and ``dp_step``;
    the proof's ``torch.export`` switches the dispatcher on for its own trace inside."""
    # (the guard, not the key alone: the dispatcher's state is the key AND the interpreter torch
    # keeps beside it, which every other guard's exit writes back, key included)
    from dpclip.engine.plain_module import ambient_user_code

    left = ambient_user_code()
    if left is not None:  # (ghost refused them at its chunks; vmap, naive, summed, the units and
        # the release ran them: a function mode entered by the constructor divided vmap's norms
        # by 1000 and zeroed the noise, forty-third hostile review: 190 C)
        raise UnsupportedModelError(
            f"{left} when the step starts: it would run on the forward's and the backward's "
            "operations and inside the engine's own arithmetic and the release, outside every "
            "check (every engine refuses it). Leave the context before the step "
            "(torch.device(...) is allowed)")
    if _frame_callbacks() is not None:
        _clear_frame_callbacks()
        raise UnsupportedModelError(FRAME_CALLBACK + " (found when the step starts)")
    over = foreign_aten_kernels()
    if over:
        raise UnsupportedModelError(
            f"a kernel registered from Python over ATen's ({', '.join(sorted(over)[:4])}; "
            "torch.library.Library('aten', 'IMPL').impl) would run inside the engine's own "
            "arithmetic and the release, outside every check (forty-second hostile review: "
            "1000 C); remove the registration (or run it in another process)")
    # the collector's callbacks taken out (one ran at any allocation: 1000 C in the release,
    # forty-second review); the collector itself stays on, so that the cycles a chunk of user
    # code leaves are finalized inside that chunk's checks (paused for the whole call, a
    # finalizer on a cyclic chunk slice ran after the engine returned: 93.5 C); it is paused in
    # the reductions (exact_float32) and the release (collector_paused)
    callbacks = gc.callbacks[:]
    del gc.callbacks[:]
    interpreter = (sys.gettrace(), sys.getprofile())
    changed = False
    try:
        # (innermost: frames and the collector's objects out of reach of every user code the
        # call runs, forty-sixth hostile review, dpclip.engine.frames_guard)
        # (torch's names that dpclip's arithmetic looks up: taken at the step's start, compared
        # where user code has run, eighty-sixth hostile review, dpclip.engine.torch_names)
        with torch._C._DisablePythonDispatcher(), signals_deferred(), frames_guard.guarded(), \
                torch_names.watching():
            yield
    finally:
        gc.callbacks[:] = callbacks + [c for c in gc.callbacks if c not in callbacks]
        # a trace or profile function set inside the call but outside every chunk's checks (a
        # finalizer freed by the engine after the last chunk: it scaled the result on the return
        # of compute, 50 C under ghost and auto, forty-fifth hostile review) is put back before
        # the call returns, and the call refused
        if sys.gettrace() is not interpreter[0] or sys.getprofile() is not interpreter[1]:
            frames_guard.put_back_callbacks(*interpreter)
            changed = True
        if _frame_callbacks() is not None:  # (set during the call: taken out, the call refused)
            _clear_frame_callbacks()
            raise UnsupportedModelError(FRAME_CALLBACK)
    if changed:
        raise UnsupportedModelError(
            "an interpreter callback (sys.settrace / sys.setprofile) was set during the private "
            "step outside the forward and loss (e.g. by a finalizer the engine's own code "
            "released): it would run on the engine's result before the release; put back. Do "
            "not set interpreter callbacks from code a step can run")


@_cm.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector paused (its finalizers and callbacks run at any allocation):
    around the release of a step (the noise drawn and added)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        torch_names.check("at the release")  # (last before the release: ninety-first review)
        yield
    finally:
        if collecting:
            gc.enable()


def _garbage_collector() -> tuple:
    return gc.isenabled(), gc.get_threshold(), tuple(gc.callbacks)


def _set_garbage_collector(v: tuple) -> None:
    (gc.enable if v[0] else gc.disable)()
    gc.set_threshold(*v[1])
    gc.callbacks[:] = list(v[2])


def _python_dispatcher() -> tuple[bool, bool]:
    """``(on, armed)``: whether the Python dispatcher's key is included, and whether its saved
    interpreter is set (then the exit of any dispatcher guard switches it back on, even with the
    key off now): read by putting a disabling guard on and off, the key restored after."""
    c, key = torch._C, torch._C.DispatchKey.PythonDispatcher
    on = c._dispatch_tls_is_dispatch_key_included(key)
    with c._DisablePythonDispatcher():
        pass
    armed = c._dispatch_tls_is_dispatch_key_included(key)
    if armed != on:
        c._dispatch_tls_set_dispatch_key_included(key, on)
    return on, armed


def _set_python_dispatcher(v: tuple[bool, bool]) -> None:
    # (the key only: the saved interpreter has no setter; a change is refused in any case, and
    # the engine's own code runs under engine_only's guard)
    torch._C._dispatch_tls_set_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher, v[0])


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
    # the per-backend float32 precisions ("ieee", "tf32", "bf16"; "none" inherits): oneDNN's
    # "bf16" convolution, set from an example, changed the next call's float32 arithmetic while
    # the float32 matmul precision above still read "highest" (fifth hostile review: 2.59 C);
    # each "all" before its operations, so that they are put back in that order
    *_fp32_precisions(),
    *_c_flags(),
    ("opt_einsum", _einsum_flags, _set_einsum),
    ("threads", torch.get_num_threads, torch.set_num_threads),
    ("autocast", lambda: (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                          torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")),
     lambda v: (torch.set_autocast_enabled("cpu", v[0]), torch.set_autocast_dtype("cpu", v[1]),
                torch.set_autocast_enabled("cuda", v[2]), torch.set_autocast_dtype("cuda", v[3]))),
    ("grad mode", torch.is_grad_enabled, torch.set_grad_enabled),
    ("flush denormal", _flushed, _set_flushed),
    ("floating-point rounding mode", _rounding, _set_rounding),
    ("interpreter callbacks (sys.settrace / sys.setprofile)", _interpreter_callbacks,
     _set_interpreter_callbacks),
    # a handler installed by the forward runs after the chunk, inside the engine's reduction
    # (fortieth hostile review: 1.19 C and 47-136 C; signals_deferred)
    ("signal handlers", _signal_handlers, _set_signal_handlers),
    # the Python dispatcher (and any other key) switched on and left by the forward: its Python
    # kernels would run inside the engine's arithmetic (forty-first review: 47-50 C; engine_only)
    ("Python dispatcher", _python_dispatcher, _set_python_dispatcher),
    # a Python kernel over an ATen operation registered by the forward, or a collector callback,
    # runs inside the engine's arithmetic or the release (forty-second review: 1000 C; the
    # kernel cannot be unregistered: refused)
    ("Python kernels over ATen (torch.library)", foreign_aten_kernels, lambda v: None),
    ("garbage collector (enabled, thresholds, callbacks)", _garbage_collector,
     _set_garbage_collector),
    ("dispatch key sets", _dispatch_repr, _set_dispatch_sets),
    # (a frame-evaluation callback set inside a chunk, hundred-and-nineteenth review; set and
    # taken out between two comparisons it is out of reach: docs/engines.md, trust boundary)
    ("frame-evaluation callback", lambda: _frame_callbacks(),
     lambda v: _clear_frame_callbacks() if v is None else None),
    ("global module hooks", lambda: tuple(tuple(d.items()) for d in _global_hooks()),
     lambda v: [(d.clear(), d.update(items)) for d, items in zip(_global_hooks(), v)]),
)


def _global_hooks() -> list[dict]:
    mod = torch.nn.modules.module
    return [getattr(mod, n) for n in ("_global_forward_hooks", "_global_forward_pre_hooks",
                                      "_global_backward_hooks", "_global_backward_pre_hooks",
                                      "_global_forward_hooks_always_called",
                                      "_global_forward_hooks_with_kwargs", "_global_buffer_registration_hooks",
                                      "_global_module_registration_hooks",
                                      "_global_parameter_registration_hooks") if hasattr(mod, n)]


def settings() -> tuple:
    """torch's global settings that change what a computation returns (module docstring)."""
    return tuple(_get(read) for _, read, _ in _SETTINGS)


def _same(a: Any, b: Any) -> bool:
    """``a`` and ``b`` (snapshots: tuples of items, contents) hold the same objects: item by item
    the same object, or builtin scalars of the same type and value bit for bit, tuples and
    contents recursively. Not ``==`` (seventh hostile review, each 0.94 C on a later call under
    vmap: ``0.0`` -> ``-0.0``, ``1.0`` -> ``1``, an aliased list replaced by an equal copy, a set
    of tuples or a dict key with ``-0.0``: equal, but the next call tells them apart)."""
    if a is b:
        return True
    t = type(a)
    if t is not type(b):
        return False
    if t is tuple:
        return len(a) == len(b) and (all(map(operator.is_, a, b)) or
                                     all(_same(x, y) for x, y in zip(a, b)))
    if t is float:
        return a.hex() == b.hex()
    if plain_exact(t):
        return a == b
    if t is _Nested:
        return _same(a.items, b.items) and _same(a.inner, b.inner)
    if t is _Pairs:
        return _same(a.keys, b.keys) and _same(a.values, b.values)
    if t is _Obj:
        return a.cls is b.cls and _same(a.state, b.state)
    if t is _Raw:
        return a == b
    if t is frozenset:
        return len(a) == len(b) and frozenset(map(_strict_key, a)) == frozenset(map(_strict_key, b))
    if t is dict:
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return False


def _deep_same(a: Any, b: Any, depth: int = 64) -> bool:
    """``a`` and ``b`` are equal containers all the way down: builtin scalars by type and bits,
    containers of the same type by their items (dict keys and set elements by
    :func:`_strict_key`), any other object by identity."""
    if a is b:
        return True
    t = type(a)
    if t is not type(b) or depth <= 0:
        return False
    if t is float:
        return a.hex() == b.hex()
    if plain_exact(t):
        return a == b
    # (exact builtin containers only, read through their own C methods: the deep copies this
    # is for are torch.export's; a subclass's methods would be the model's code)
    if t is list or t is tuple:
        xs, ys = tuple(_L_ITER(a) if t is list else _T_ITER(a)), \
            tuple(_L_ITER(b) if t is list else _T_ITER(b))
        return len(xs) == len(ys) and all(_deep_same(x, y, depth - 1) for x, y in zip(xs, ys))
    if t is dict:
        ka, kb = tuple(_D_KEYS(a)), tuple(_D_KEYS(b))
        if len(ka) != len(kb):
            return False
        # (no key of theirs hashed: the keys as strict keys, objects by identity)
        mb = dict(zip(map(_strict_key, kb), _D_VALUES(b)))
        return all(sk in mb and _deep_same(x, mb[sk], depth - 1)
                   for sk, x in zip(map(_strict_key, ka), _D_VALUES(a)))
    if t is set or t is frozenset:
        return frozenset(map(_strict_key, frozenset(a))) == \
            frozenset(map(_strict_key, frozenset(b)))
    return False


def _strict_key(x: Any) -> Any:
    """A set element as a key that tells ``0.0`` from ``-0.0`` and ``1`` from ``1.0``."""
    t = type(x)
    if t is float:
        return (t, x.hex())
    if plain_exact(t):
        return (t, x)
    if t is tuple:
        return (t, tuple(map(_strict_key, _T_ITER(x))))
    return (ident(t), ident(x))  # (a class's own __hash__ is never called)


def _eq(a: Any, b: Any) -> bool:
    """``a == b`` for snapshots (identical objects compare equal at C speed; a comparison that
    cannot decide, tensors of several elements, is a difference)."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - any failure to compare is a change
        return False


_CONTAINERS = (dict, list, set, frozenset, tuple)

# Every read below goes through the base classes' own C methods and descriptors, chosen by
# ``type(v)`` alone: ``isinstance`` reads ``v.__class__`` (a property of the model's class),
# ``len``, ``iter``, ``v.values()`` and ``==`` call a subclass's methods, and any of them would
# run the model's code inside the engine (hundred-and-sixteenth hostile review: a ``__class__``
# property ran in the walk at a chunk's end, installed a signal handler and scaled the chunk's
# clipped sum by 50: LOO 50 C under every engine, through make_private too).
_D_KEYS, _D_VALUES = dict.keys, dict.values
_OD_KEYS, _OD_VALUES = collections.OrderedDict.keys, collections.OrderedDict.values
_L_ITER, _T_ITER = list.__iter__, tuple.__iter__
_S_ITER, _FS_ITER = set.__iter__, frozenset.__iter__
_DQ_ITER = collections.deque.__iter__
_REF_CALL = weakref.ref.__call__
_F = types.FunctionType.__dict__
_F_PARTS = tuple((k, _F[k].__get__) for k in ("__code__", "__defaults__", "__kwdefaults__",
                                              "__closure__", "__dict__"))
_M = types.MethodType.__dict__
_M_SELF, _M_FUNC = _M["__self__"].__get__, _M["__func__"].__get__
_CELL = types.CellType.__dict__["cell_contents"].__get__
_RNG_STATE = _random.Random.getstate
_EMPTY_CELL = object()

#: C types whose instances hold no state a call could change (compared by identity)
_IMMUTABLE_C = frozenset({
    complex, bytes, range, slice, type(Ellipsis), type(NotImplemented),
    types.BuiltinFunctionType, types.BuiltinMethodType, types.WrapperDescriptorType,
    types.MethodWrapperType, types.MethodDescriptorType, types.ClassMethodDescriptorType,
    types.GetSetDescriptorType, types.MemberDescriptorType, types.CodeType,
    torch.dtype, torch.device, torch.layout, torch.memory_format, torch.finfo, torch.iinfo,
    torch.Generator, type(re.compile("")), _np.dtype, type(_np.dtype("f4")),
    type(torch.float32), type(torch.contiguous_format), type(torch.strided),
})
_IMMUTABLE_IDS = frozenset(map(ident, _IMMUTABLE_C))
_IMMUTABLE_BASES = (_np.generic, torch.Tensor, nn.Module, type, types.ModuleType)
#: C types whose state cannot be read without running code: an attribute holding one is refused
_OPAQUE = (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType,
           types.MappingProxyType, types.FrameType, types.TracebackType,
           type(functools.lru_cache()(lambda: None)))  # (an lru_cache's entries are its own)

#: ``Py_TPFLAGS_HEAPTYPE``: a class made by a class statement (not a type written in C)
_HEAPTYPE = 1 << 9
_CLASS_DICT = type.__dict__["__dict__"].__get__
#: a class's MRO and flags through type's own descriptors (a metaclass property never runs)
_MRO = type.__dict__["__mro__"].__get__
_FLAGS = type.__dict__["__flags__"].__get__
#: libraries whose classes' own dictionaries are not snapshot for the objects entered (their
#: class attributes are the library's globals: module docstring, "Trust boundary")
_LIB_PREFIXES = ("torch", "transformers", "peft", "dpclip", "numpy", "builtins", "collections",
                 "functools", "typing", "enum", "abc", "types")

#: per class: how its instances are read (:func:`_kind`)
_KINDS: dict[int, tuple[type, Any]] = {}
_MISSING = object()


def _kind(t: type) -> Any:
    """How the instances of class ``t`` are snapshot: ``None`` (by identity: plain values, code,
    tensors and modules walked elsewhere, immutable C types), a container kind (``"dict"``,
    ``"odict"``, ``"list"``, ``"tuple"``, ``"set"``, ``"deque"``, ``"raw"``), ``"func"``,
    ``"method"``, ``"ref"``, ``"rng"``, ``("obj", dict descriptor, slots, user classes)``, or
    ``"opaque"`` (state that cannot be read: refused). Decided from the class alone, cached."""
    # (keyed by the class's identity: a dict lookup hashes its key, and a metaclass with a
    # __hash__ of its own ran it inside the walk: hundred-and-twenty-second hostile review)
    got = _KINDS.get(ident(t))
    if got is not None and got[0] is t:
        return got[1]
    kind = _decide_kind(t)
    _KINDS[ident(t)] = (t, kind)  # (the class kept: its id is not reused)
    return kind


def _decide_kind(t: type) -> Any:
    if plain_exact(t) or ident(t) in _IMMUTABLE_IDS:
        return None
    if issubclass(t, collections.OrderedDict):
        return "odict"
    if issubclass(t, dict):
        return "dict"
    if issubclass(t, list):
        return "list"
    if issubclass(t, tuple):
        return "tuple"
    if issubclass(t, (set, frozenset)):
        return "set"
    if t is collections.deque:
        return "deque"
    if t is bytearray or t is _array.array or t is _np.ndarray:  # (identity: no class's ==)
        return "raw"
    if issubclass(t, (collections.deque, bytearray, _array.array, _np.ndarray)) or \
            issubclass(t, _OPAQUE):
        return "opaque"  # (a subclass: its items or bytes are not read through its own code)
    if t is types.FunctionType:
        return "func"
    if t is types.MethodType:
        return "method"
    if issubclass(t, _IMMUTABLE_BASES) or issubclass(t, BaseException):
        return None
    if issubclass(t, _random.Random):
        return "rng"
    if t is weakref.ref:
        return "ref"
    ddesc, slots, odd = None, [], False
    user = []
    for c in _MRO(t):
        cd = _CLASS_DICT(c)
        if ddesc is None and "__dict__" in cd:
            ddesc = cd["__dict__"]
            odd = type(ddesc) is not types.GetSetDescriptorType
        slots += [("@" + k, v.__get__) for k, v in cd.items()
                  if type(v) is types.MemberDescriptorType]
        mod = cd.get("__module__")
        if _FLAGS(c) & _HEAPTYPE and not (type(mod) is str and
                                            mod.split(".")[0] in _LIB_PREFIXES):
            user.append(c)
    if odd:
        return "opaque"  # (a class whose __dict__ is not the standard descriptor)
    if ddesc is None and not slots and not _FLAGS(t) & _HEAPTYPE:
        return "opaque"  # (a C type with no attributes to read: its state is its own)
    return ("obj", ddesc.__get__ if ddesc is not None else None, tuple(slots), tuple(user))


def _is_container(v: Any) -> bool:
    return _kind(type(v)) is not None


class _Raw:
    """The content of a mutable builtin that holds values, not objects (a ``bytearray``, an
    ``array.array``, a NumPy array, a ``random.Random``'s state): its type and bytes."""

    __slots__ = ("key",)

    def __init__(self, key: tuple) -> None:
        self.key = key

    def __eq__(self, other: object) -> bool:
        return type(other) is _Raw and self.key == other.key

    __hash__ = None  # type: ignore[assignment]


def _raw(v: Any) -> _Raw:
    t = type(v)
    if t is bytearray:
        return _Raw((t, bytes(v)))
    if t is _array.array:
        return _Raw((t, v.typecode, v.tobytes()))
    # (a NumPy array: dtype, shape, strides and the bytes; a view's base is its own attribute)
    return _Raw((t, v.dtype.str, v.shape, v.strides, v.tobytes()))


class _Obj:
    """An object's content: its class and the content of its attributes (and of its user
    classes' own dictionaries: a class attribute is state too)."""

    __slots__ = ("cls", "state")

    def __init__(self, cls: type, state: Any) -> None:
        self.cls, self.state = cls, state

    def __eq__(self, other: object) -> bool:
        return type(other) is _Obj and _same(self, other)

    __hash__ = None  # type: ignore[assignment]


def _object_state(v: Any, kind: Any) -> dict:
    """The attributes of an object (its ``__dict__``, its set slots as ``@name``, its user
    classes' own dictionaries as ``@@i``) or of a function / method / weak reference, read
    through C descriptors."""
    if kind == "func":
        out = {}
        for k, get in _F_PARTS:
            x = get(v)
            if k == "__closure__" and x is not None:
                cells = []
                for c in x:
                    try:
                        cells.append(_CELL(c))
                    except ValueError:  # (an empty cell)
                        cells.append(_EMPTY_CELL)
                x = tuple(cells)
            out[k] = x
        return out
    if kind == "method":
        return {"__self__": _M_SELF(v), "__func__": _M_FUNC(v)}
    if kind == "ref":
        return {"referent": _REF_CALL(v)}
    if kind == "rng":
        return {"state": _RNG_STATE(v)}
    _, dget, slots, user = kind
    out = dict(dget(v)) if dget is not None else {}
    for key, get in slots:
        try:
            out[key] = get(v)
        except AttributeError:  # (an unset slot)
            pass
    for i, c in enumerate(user):
        out[f"@@{i}"] = dict(_CLASS_DICT(c))
    return out


#: containers inside containers are snapshot at every depth (fifth hostile review:
#: ``self.box[0][0]`` written under vmap kept the inner list's identity and a shallow content missed
#: it, 3.45 C; sixth: a fixed depth of four missed the fifth level, 3.45 C); beyond this depth a
#: container attribute always compares as changed (refused: no model needs it)
_DEPTH = 64


class _TooDeep:
    """The content of a container nested deeper than :data:`_DEPTH`, or of an object whose state
    cannot be read (:func:`_kind`: ``"opaque"``): equal to nothing."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return False

    __hash__ = None  # type: ignore[assignment]


class _Nested:
    """A container's content when some of its items are containers too: its items (by identity)
    and ``(position, content)`` of each item that is a container (a dict's keys: ``("key", i)``)."""

    __slots__ = ("items", "inner")

    def __init__(self, items: tuple, inner: tuple) -> None:
        self.items, self.inner = items, inner

    def __eq__(self, other: object) -> bool:
        return type(other) is _Nested and _same(self, other)


def _content(v: Any, depth: int = _DEPTH, path: frozenset = frozenset()) -> Any:
    """The content of a container attribute (its items by identity, and those of the containers
    and objects among them, at every depth; one that holds itself is not entered again), else
    None (a value compared by identity)."""
    t = type(v)
    kind = _kind(t)
    if kind is None:
        return None
    if depth <= 0 or kind == "opaque":
        return _TooDeep()
    keys: tuple = ()
    if kind == "dict" or kind == "odict":
        ks = tuple((_OD_KEYS if kind == "odict" else _D_KEYS)(v))
        if not ks:  # (most: a module's hook tables)
            return ()
        items: Any = _Pairs(ks, tuple((_OD_VALUES if kind == "odict" else _D_VALUES)(v)))
        values, keys = items.values, ks
    elif kind == "list" or kind == "tuple":
        items = values = tuple((_L_ITER if kind == "list" else _T_ITER)(v))
        if not items:
            return ()
    elif kind == "set":
        # (a frozenset made from a set copies the stored hashes: no element's __hash__ runs)
        items = frozenset(v)
        values = tuple(_FS_ITER(items))
    elif kind == "deque":
        items = values = tuple(_DQ_ITER(v))
        if not items:
            return ()
    elif kind == "raw":
        return _raw(v)
    else:
        return _Obj(t, _content(_object_state(v, kind), depth - 1, path | {ident(v)}))
    if not any(map(_is_container, values)) and not any(map(_is_container, keys)):
        return items
    path = path | {ident(v)}
    inner = tuple((i, _content(x, depth - 1, path)) for i, x in enumerate(values)
                  if _is_container(x) and ident(x) not in path) + \
        tuple((("key", i), _content(x, depth - 1, path)) for i, x in enumerate(keys)
              if _is_container(x) and ident(x) not in path)
    if inner:
        return _Nested(items, inner)
    return items


class _Pairs:
    """A dict's items as its keys and its values (two tuples: compared by identity at C speed)."""

    __slots__ = ("keys", "values")

    def __init__(self, keys: tuple, values: tuple) -> None:
        self.keys, self.values = keys, values

    def __iter__(self) -> Any:
        return zip(self.keys, self.values)

    def __len__(self) -> int:
        return len(self.keys)

    def __eq__(self, other: object) -> bool:
        return type(other) is _Pairs and _same(self, other)


def _items(content: Any) -> Any:
    got = content.items if type(content) is _Nested else content
    return tuple(got) if type(got) is _Pairs else got


def _contents(d: dict) -> dict:
    """``{key: content}`` of the container and object attributes of a module's ``__dict__``."""
    return {k: _content(v) for k, v in d.items()
            if _is_container(v) and not (type(v) is tuple and not any(map(_is_container, v)))}
    # (a tuple of no containers is immutable: compared by identity as an attribute)


def _plain_hashable(x: Any, depth: int = 8) -> bool:
    """Whether hashing ``x`` runs only builtin code: a plain value, or an exact tuple or
    frozenset of such (a frozenset's hash reads its elements' stored hashes)."""
    t = type(x)
    if plain_exact(t) or t is frozenset:
        return True
    return t is tuple and depth > 0 and all(_plain_hashable(e, depth - 1)
                                            for e in _T_ITER(x))


def _refill(v: Any, content: Any) -> None:
    """Put a container's (or a plain object's) snapshot back (exact builtin types and objects'
    dictionaries only: what else changed is refused anyway)."""
    if type(content) in (_TooDeep, _Raw):
        t = type(v)
        if type(content) is _Raw:
            if t is bytearray:
                v[:] = content.key[1]
            elif t is _array.array:
                v[:] = _array.array(content.key[1], content.key[2])
            elif t is _np.ndarray and v.flags.writeable and v.shape == content.key[2]:
                v[...] = _np.frombuffer(content.key[4], dtype=content.key[1]).reshape(v.shape)
        return
    t = type(v)
    if type(content) is _Obj:  # (an object: its instance dictionary put back)
        kind = _kind(t)
        if type(kind) is tuple and kind[1] is not None and type(content.state) is not _TooDeep:
            d = kind[1](v)
            state = dict(_items(content.state) or ())
            d.clear()
            d.update({k: x for k, x in state.items() if not k.startswith("@")})
        return
    items = _items(content)
    kind = _kind(t)
    # (through the base classes' own C methods: a subclass's would be the model's code)
    # (keys and set elements are hashed again: only plain ones, whose hash is the builtin's; a
    # container with others is left as the model left it: the change is refused anyway)
    if kind == "dict" or kind == "odict":
        if not all(_plain_hashable(k) for k, _ in items):
            return
        dict.clear(v)
        for k, x in items:
            dict.__setitem__(v, k, x)
    elif kind == "list":
        list.__setitem__(v, slice(None), list(items))
    elif kind == "set" and issubclass(t, set):
        if not all(_plain_hashable(k) for k in items):
            return
        set.clear(v)
        set.update(v, items)
    elif kind == "deque":
        v.clear()
        v.extend(items)
    else:
        return
    if type(content) is _Nested:  # the inner containers: the objects the items hold again
        values = [x for _, x in items] if kind == "dict" or kind == "odict" else list(items)
        for i, sub in content.inner:
            if type(i) is int and type(sub) is not _TooDeep:
                _refill(values[i], sub)


_CLASS, _PARAMS = "<class>", "<parameters>"
#: a module's tables whose entries are named when they change
_TABLES = {"_parameters": "<parameter>", "_buffers": "<buffer>", "_modules": "<submodule>"}


def _same_value(a: Any, b: Any) -> bool:
    return a is b or (plain_exact(type(a)) and _same(a, b))


class _Module:
    """One module's state as the next call could read it: its class, every attribute of its
    ``__dict__`` (plain values by value, anything else by identity, containers by their content,
    containers in them at every depth: hook tables, ``_parameters``, lists) and its parameters'
    ``requires_grad`` and storage."""

    __slots__ = ("m", "cls", "items", "keys", "values", "contents", "params")

    def __init__(self, m: nn.Module) -> None:
        self.m, self.cls = m, type(m)
        d = m.__dict__
        self.items = tuple(d.items())
        self.keys, self.values = tuple(d), tuple(d.values())
        self.contents = _contents(d)
        self.params = tuple((p, p.requires_grad, p.data_ptr(), p.data)
                            for p in d.get("_parameters", {}).values() if p is not None)

    def changed(self) -> list[str]:
        m, out = self.m, []
        if type(m) is not self.cls:
            out.append(_CLASS)
        d = m.__dict__
        if not (_same(tuple(d), self.keys) and _same(tuple(d.values()), self.values) and
                _same(_contents(d), self.contents)):
            old = {k: (v, self.contents.get(k)) for k, v in self.items}
            for k in sorted(set(old) | set(d)):
                if k in _TABLES and k in old and k in d and old[k][0] is d[k]:
                    was, now = dict(_items(old[k][1]) or ()), d[k]  # name the entries that changed
                    out += [f"{_TABLES[k]} {e}" for e in sorted(set(was) | set(now))
                            if e not in was or e not in now or was[e] is not now[e]]
                elif k not in old or k not in d or not _same_value(old[k][0], d[k]) \
                        or (old[k][1] is not None and not _same(_content(d[k]), old[k][1])):
                    was, c = old.get(k, (None, None))
                    if k in old and k in d and _deep_same(d[k], was) and \
                            (c is None or _same(_content(was), c)):
                        # a value or container replaced by a deep copy, equal in types and bits
                        # (the proof's torch.export copies a Hugging Face model's plan dicts and
                        # a convolution's stride tuples): the original is put back, so that no
                        # identity carries a bit
                        d[k] = was
                        continue
                    out.append(k)
        for p, grad, ptr, _ in self.params:
            if p.requires_grad != grad or p.data_ptr() != ptr:
                out.append(_PARAMS)
                break
        return out

    def put_back(self) -> None:
        m = self.m
        if type(m) is not self.cls:
            m.__class__ = self.cls
        d = m.__dict__
        old = dict(self.items)
        for k in [k for k in d if k not in old]:
            del d[k]
        for k, v in self.items:
            d[k] = v
            c = self.contents.get(k)
            if c is not None and not _same(_content(v), c):
                _refill(v, c)
        for p, grad, ptr, data in self.params:
            if p.data_ptr() != ptr:
                p.data = data
            if p.requires_grad != grad:
                p.requires_grad_(grad)


#: the libraries whose classes are not snapshot: their dictionaries are large (thousands of
#: entries over the MROs of a Hugging Face model: ~2 ms a chunk for a small BERT) and a value
#: written into them is a global of the library (docs/engines.md, "Trust boundary": what no check
#: sees under vmap; under ghost the proved-program match compares what the program reads, and
#: dpclip.engine.library_code what a ruled layer's forward looks up)
_LIBRARIES = ("torch.", "transformers.", "peft.")


_ROOTS = tuple(p.rstrip(".") for p in _LIBRARIES)
#: a class's own namespace and MRO, read past any metaclass (which can define ``__dict__`` or
#: ``__mro__`` on its classes)
_NAMESPACE = type.__dict__["__dict__"].__get__
_QUALNAME = type.__dict__["__qualname__"].__get__
_MODULE = type.__dict__["__module__"].__get__
#: ident(class) -> (class, the top-level package that really defines it, "" for none): see
#: :func:`origin` (by identity: a metaclass's ``__hash__`` is user code)
_ORIGIN: dict[int, tuple[type, str]] = {}


def origin(c: type) -> str:
    """The top-level package (``"torch"``, ``"transformers"``, ...) whose module holds class ``c``
    under its qualified name, or ``""``. A class's ``__module__`` is only a name it gives itself
    (``class M(nn.Module): __module__ = "torch.nn"`` took a user class for torch's and left its
    attributes out of the snapshot: eighth hostile review); the module it names must hold that
    very class (read from the modules' and classes' own namespaces: no code runs). A class made
    inside a function (``<locals>`` in its name) is nobody's."""
    hit = _ORIGIN.get(ident(c))
    if hit is not None and hit[0] is c:
        return hit[1]
    got = ""
    name = _MODULE(c)
    qual = _QUALNAME(c)
    mod = sys.modules.get(name) if type(name) is str else None
    if mod is not None and "<" not in qual:
        obj: Any = vars(mod) if type(mod) is types.ModuleType else getattr(
            mod, "__dict__", {})
        found: Any = None
        for part in qual.split("."):
            found = obj.get(part) if isinstance(obj, dict) else \
                _NAMESPACE(obj).get(part) if isinstance(obj, type) else None
            obj = found
        if found is c:
            got = name.split(".")[0]
    _ORIGIN[ident(c)] = (c, got)
    return got


def _classes(mods: list[nn.Module]) -> list[type]:
    seen: dict[type, None] = {}
    for m in mods:
        for c in _MRO(type(m)):
            if c is not object and origin(c) not in _ROOTS:
                seen[c] = None
    return list(seen)


#: ``torch.nn.Module`` methods and attribute machinery that dpclip's engines (and ``dp_step``)
#: call on the model outside the chunks of user code: the structure (parameters, buffers,
#: modules) and attribute lookup. A user class that defines one runs its code where no chunk's
#: isolation and no proved-program match sees it (eighth hostile review: a ``named_parameters``
#: override wrote a value the previous call had carried out of the forward into a global tensor
#: the proof reads, before the step's memory watch took its copies: the next call moved by
#: 0.75 C, LOO 2.06 C at ``max_physical_batch=1``, on ghost, auto and vmap alike)
_STRUCTURE = frozenset((
    "named_parameters", "parameters", "named_buffers", "buffers", "named_modules", "modules",
    "named_children", "children", "_named_members", "state_dict", "load_state_dict",
    "get_submodule", "get_parameter", "get_buffer", "__getattr__", "__getattribute__",
    "__setattr__", "__delattr__", "__dir__", "__class__", "__dict__"))
#: libraries whose classes may define them (their own code, as in :data:`_LIBRARIES`; dpclip's)
_STRUCTURE_ROOTS = _ROOTS + ("dpclip",)


#: the model whose structure the running ``dp_step`` checked (its engine need not check again)
_CHECKED: contextvars.ContextVar[Any] = contextvars.ContextVar("dpclip_structure_checked",
                                                               default=None)


@_cm.contextmanager
def structure_checked(model: Any) -> Iterator[None]:
    """Within this context (``dp_step``, right after its own :func:`check_structure`), the
    engines skip the check for ``model``: only dpclip code runs between the two."""
    token = _CHECKED.set(model)
    try:
        yield
    finally:
        _CHECKED.reset(token)


def check_structure(model: Any, owner: str) -> None:
    """Refuse a model whose module classes (their MROs, but torch's, transformers', peft's and
    dpclip's classes) define one of :data:`_STRUCTURE`, whose tables (``_parameters``,
    ``_modules``, the hook tables, ...) are not plain dicts or sets, or whose parameters and
    buffers are of a tensor class of the model's own: the engine reads the model's parameters,
    buffers and modules outside the chunks, and user code there is outside every check. Each
    class is checked before its instance's own dictionary is read, and the check itself runs no
    code of the model's (classes and tables are compared by identity: a metaclass's ``__eq__`` or
    ``__hash__`` is never called). Runs on every step: 1-1.5 ms for a 12-layer BERT (231 modules,
    201 parameters) on the loaded 2-core CPU."""
    if not issubclass(type(model), nn.Module) or _CHECKED.get() is model:
        return
    why = _structure(model)
    if why is not None:
        raise UnsupportedModelError(f"{owner}: {why}")


def _own_classes(cls: type, cache: dict, roots: tuple) -> tuple:
    """The classes of ``cls``'s MRO that are no library's (:func:`origin`), cached by identity
    while the MRO stays the same tuple (assigning ``__bases__`` makes a new one)."""
    mro = _MRO(cls)
    got = cache.get(ident(cls))
    if got is None or got[0] is not cls or got[1] is not mro:
        got = (cls, mro, tuple(c for c in mro if c is not object and origin(c) not in roots))
        cache[ident(cls)] = got
    return got[2]


_MODULE_CLASSES: dict[int, tuple] = {}
_TENSOR_CLASSES: dict[int, tuple] = {}


def _structure(model: nn.Module) -> str | None:
    seen: set[int] = set()
    stack: list[tuple[Any, Any]] = [(model, None)]
    names: dict[int, tuple[Any, str]] = {}  # ident(module) -> (parent, key): names only on failure

    def where(m: Any) -> str:
        parts = []
        while ident(m) in names:
            m, k = names[ident(m)]
            parts.append(k)
        return ".".join(reversed(parts)) or "<root>"

    while stack:
        m, _ = stack.pop()
        if ident(m) in seen:
            continue
        seen.add(ident(m))
        for c in _own_classes(type(m), _MODULE_CLASSES, _STRUCTURE_ROOTS):
            ns = _NAMESPACE(c)
            bad = [k for k in _STRUCTURE_ORDER if k in ns and not (
                k == "__dict__" and type(ns[k]) is types.GetSetDescriptorType)]
            if bad:
                return (f"class {_QUALNAME(c)} of module {where(m)!r} defines {', '.join(bad)}: "
                        "the engine reads the model's parameters, buffers and modules (and looks "
                        "their attributes up) outside the calls it checks, so user code there "
                        "could carry one step's examples into the next unseen. Keep "
                        "torch.nn.Module's own versions (wrap the model instead of overriding "
                        "them)")
        own = vars(m)
        if not _TABLE_TYPE_IDS.issuperset(map(ident, map(type, map(own.get, _TABLE_ORDER)))):
            for k in _TABLE_ORDER:  # (which one: the message)
                t = type(own.get(k))
                if ident(t) not in _TABLE_TYPE_IDS:
                    return (f"the table {k} of module {where(m)!r} is a {_QUALNAME(t)}, not a "
                            "plain dict or set: the engine reads it outside the calls it "
                            "checks, so its methods could carry one step's examples into the "
                            "next unseen (ninth hostile review). Keep torch.nn.Module's own "
                            "tables")
        for kind, table in (("parameter", own.get("_parameters")),
                            ("buffer", own.get("_buffers"))):
            if table is None:
                continue
            for k, t in dict.items(table):
                if t is not None and _own_classes(type(t), _TENSOR_CLASSES, _STRUCTURE_ROOTS):
                    return (f"{kind} {k!r} of module {where(m)!r} is a {_QUALNAME(type(t))}, a "
                            "tensor class of the model's own: the engine reads its attributes "
                            "(requires_grad, data, ...) outside the calls it checks, where its "
                            "code could carry one step's examples into the next unseen (ninth "
                            "hostile review). Use torch.nn.Parameter and plain tensors")
        children = own.get("_modules")
        if children:
            for k, c in dict.items(children):
                if c is not None and ident(c) not in seen:
                    if ident(c) not in names:
                        names[ident(c)] = (m, k)
                    stack.append((c, None))
    return None


#: the tables torch keeps in a module's ``__dict__`` (parameters, buffers, modules, hooks, ...)
_TABLE_ORDER = tuple(k for k, v in vars(nn.Module()).items() if isinstance(v, (dict, set)))
_STRUCTURE_ORDER = tuple(sorted(_STRUCTURE))
#: the table types allowed, by identity (a metaclass's ``__eq__`` or ``__hash__`` is user code)
_TABLE_TYPE_IDS = frozenset(map(ident, (dict, collections.OrderedDict, set, type(None))))


class _State:
    """The model's modules and their classes' attributes (``type(self).k = ...`` is read by
    every instance's next call)."""

    __slots__ = ("mods", "classes")

    def __init__(self, model: nn.Module) -> None:
        mods = _modules(model)
        self.mods = [_Module(m) for m in mods]
        self.classes = [(c, tuple(vars(c).items())) for c in _classes(mods)]

    def changed(self, model: nn.Module) -> list[str]:
        names: dict[int, str] | None = None
        out = []
        for snap in self.mods:
            got = snap.changed()
            if got:
                if names is None:
                    names = {ident(m): n for n, m in model.named_modules(remove_duplicate=False)}
                where = names.get(ident(snap.m), "")
                for k in got:
                    if k == _CLASS:
                        out.append(f"the class of module {where or '<root>'!r}")
                    elif k == _PARAMS:
                        out.append(f"the requires_grad or data of a parameter of module "
                                   f"{where or '<root>'!r}")
                    elif k.startswith("<") and " " in k:  # a table's entry
                        kind, entry = k[1:].split("> ", 1)
                        name = f"{where}.{entry}" if where else entry
                        out.append(f"the model's {kind} {name!r}")
                    else:
                        name = f"{where}.{k}" if where else k
                        out.append(f"the model's Python attribute {name!r}")
        for c, items in self.classes:
            if not _same(tuple(vars(c).items()), items):
                now = dict(vars(c))
                old = dict(items)
                keys = sorted(k for k in set(now) | set(old)
                              if k not in now or k not in old or not _same_value(old[k], now[k]))
                out += [f"the class attribute {c.__name__ + '.' + k!r}" for k in keys]
        return out

    def put_back(self) -> None:
        for snap in self.mods:
            snap.put_back()
        for c, items in self.classes:
            if _same(tuple(vars(c).items()), items):
                continue
            old = dict(items)
            for k in [k for k in vars(c) if k not in old]:
                delattr(c, k)
            for k, v in items:
                if k not in vars(c) or vars(c)[k] is not v:
                    setattr(c, k, v)


class Isolated:
    """Context manager around one chunk of user code (module docstring)."""

    __slots__ = ("model", "gens", "_settings", "_state", "_threads")

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.gens = OwnGenerators()
        self._settings: tuple = ()
        self._state: _State | None = None
        self._threads: frozenset = frozenset()

    def __enter__(self) -> "Isolated":
        self._settings = settings()
        prime(self.model)  # (transformers' output-capturing hooks: installed before the snapshot)
        self._state = _State(self.model)
        self._threads = frozenset(map(ident, threading.enumerate()))
        self.gens.__enter__()
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.gens.__exit__(exc_type, *exc)
        changed = self._put_back_settings()
        # a thread (a threading.Timer) started in the chunk and still running writes after this
        # check (seventh hostile review: an attribute set 1.5 s later, 0.75 C on the next call)
        changed += [f"a thread started in the call and still running ({t.name})"
                    for t in threading.enumerate()
                    if ident(t) not in self._threads and t.is_alive()]
        assert self._state is not None
        got = self._state.changed(self.model)
        if got:
            self._state.put_back()
            changed += got
        if exc_type is None and not changed:
            torch_names.check("after a chunk")
        if changed and exc_type is None:
            raise UnsupportedModelError(
                f"the forward or loss changed {', '.join(changed)} during a private step (put "
                "back). Whatever a call leaves there, the next call reads: it would carry this "
                "call's examples into the next one's computation (a value taken from the batch, "
                "kept with torch functions off, is seen by no trace). Set such attributes and "
                "settings outside the step, or keep state in registered buffers (guarded)")

    def _put_back_settings(self) -> list[str]:
        now = settings()
        if _eq(now, self._settings):
            return []
        changed = []
        for (name, _, write), was, got in zip(_SETTINGS, self._settings, now):
            if not _eq(got, was) and was is not None:
                write(was)
                changed.append(f"torch's global setting {name!r}")
        return changed


# the engine's own code that puts interpreter callbacks back inside a step (dpclip.engine.frames_guard)
# (the engine sets interpreter callbacks through frames_guard.callbacks_off / put_back_callbacks
# only: those two are the audit hook's own code, and the put-back installs only the step's own)
