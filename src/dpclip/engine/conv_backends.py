"""torch's CPU convolution backends and intra-op thread count fixed for an engine call, whatever the
batch size (seventy-eighth, seventy-ninth and eighty-ninth hostile reviews; docs/engines.md, "Rounding
that depends on the batch size").

torch runs a 1x1 convolution on one thread on its own kernel below 16 examples and on oneDNN from 16
on (NNPACK, when it applies, from 16 on too), and a convolution of ONE small example off oneDNN
where two run on it. Removing one example then changed the other examples' rounding, which a
LayerNorm over a constant image's positions amplified to 6.97 C (16.09 C with equal examples) on
ghost, auto, compiled and vmap; a 1x1 kernel built in the forward from a 2-D weight did the same
(13.79 C), so no look at the model's tensors can tell which calls are 1x1.

:func:`fixed_conv_backends` switches NNPACK off for the call, and oneDNN too when the process runs
one thread; at two threads and more torch takes oneDNN for every convolution of two examples or
more (the engines never run a batch of one: ghost and vmap run every chunk on a multiple of 32
rows, ``dpclip.engine.batch.padded_rows``). Both flags
are restored after the call. A forward that switches a backend back on around its own convolution
and off again before it returns is seen where the engine watches each operation
(:func:`conv_backends_moved`: the separability tracer's dispatch mode, vmap's function mode).
Cost: a convolutional network's private step on one thread runs torch's own kernels (the Papernot
CNN at batch 256: 1.51x -> 1.99x its non-private step;
``benchmarks/results/cpu_engines_session14_t1.md``).

**Threads** (eighty-ninth hostile review). MKL and torch divide a product's or a reduction's work
among the intra-op threads by its shape, and beyond two threads they split it otherwise for 64 rows
than for 32 (the reduction dimension shared between threads: a different summation order for every
row). A model built to cancel turned that into 7.99 C at 3 threads, 8.56 C at 4, 5.04 C at 6 and
7.86 C at 8 on ghost, auto and compiled (vmap too at 8), where one and two threads moved nothing
(``benchmarks/kernel_invariance.py``, ``benchmarks/rounding_loo.py``). torch's default is one
thread per core, so an ordinary 8-core machine was exposed. :func:`fixed_conv_backends` therefore
runs the engine call at ``min(threads, 2)`` intra-op threads (:func:`engine_threads`:
``DPCLIP_ENGINE_THREADS``, ``2`` by default, ``1``, or ``all`` to keep the process's count for a
model whose author you trust) and restores the count after it; a forward that raises it around its
own operations is refused where the engine watches each operation, as for the backends.
"""

from __future__ import annotations

from dpclip.engine import _cm
import contextvars
import ctypes
import functools
import os
import warnings
from typing import Any, Iterator

import torch

__all__ = ["ENGINE_THREADS_ENV", "conv_backends_moved", "engine_thread_count", "engine_threads",
           "fixed_conv_backends",
           "MOVED", "THREADS_MOVED", "threads_moved", "warn_if_capped"]

#: ``(oneDNN enabled, NNPACK enabled, intra-op threads, MKL's threads)`` as the engine call fixed
#: them; None outside a call
_FIXED: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
    "dpclip_conv_backends", default=None)

#: the environment variable of :func:`engine_threads`
ENGINE_THREADS_ENV = "DPCLIP_ENGINE_THREADS"
#: the thread counts at which no batch-size dependent rounding was found (module docstring)
_PROVEN_THREADS = 2
_CAP_WARNED: list[bool] = []

#: the refusal's text (the tracer and vmap's watch say it)
MOVED = ("the forward switched a convolution backend (oneDNN or NNPACK) back on during the step: "
         "torch chooses those backends by the batch size, so an example's rounding would depend "
         "on the others' presence (docs/engines.md, \"Rounding that depends on the batch "
         "size\"); leave torch.backends.mkldnn and torch.backends.nnpack as the engine sets them")


#: the refusal's text when the forward raised the thread count the engine fixed
THREADS_MOVED = ("the forward changed torch's intra-op thread count (or MKL's own, through its "
                 "thread-local or domain settings) during the step: beyond two "
                 "threads MKL and torch split a product's work by its size, so an example's "
                 "rounding would depend on the others' presence (docs/engines.md, \"Rounding "
                 "that depends on the batch size\"); leave torch.set_num_threads as the engine "
                 "sets it (DPCLIP_ENGINE_THREADS=all keeps the process's count)")


def _torch_cpu_library() -> ctypes.CDLL | None:
    """torch's CPU library when torch runs MKL (whose thread functions it exports), else None."""
    try:
        if not torch.backends.mkl.is_available():
            return None
        path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
        return ctypes.CDLL(path) if os.path.exists(path) else None
    except OSError:
        return None


def _thread_fns() -> tuple | None:
    """MKL's thread getters and its thread-local setter in torch's CPU library (C interfaces), or
    None (another BLAS)."""
    if _THREAD_FNS:
        return _THREAD_FNS[0]
    lib = _torch_cpu_library()
    fns = None
    if lib is not None:
        try:
            get_max, get_domain = lib.MKL_Get_Max_Threads, lib.mkl_serv_domain_get_max_threads
            set_local = lib.MKL_Set_Num_Threads_Local
            get_max.restype, get_max.argtypes = ctypes.c_int, []
            get_domain.restype, get_domain.argtypes = ctypes.c_int, [ctypes.c_int]
            set_local.restype, set_local.argtypes = ctypes.c_int, [ctypes.c_int]
            fns = (get_max, get_domain, set_local)
        except AttributeError:
            fns = None
    _THREAD_FNS.append(fns)
    return fns


_THREAD_FNS: list = []
#: MKL_DOMAIN_BLAS (mkl_service.h)
_DOMAIN_BLAS = 1


def mkl_threads() -> tuple[int, int] | None:
    """The threads MKL's products would run at in this thread: ``(its maximum, the BLAS
    domain's)``, which a thread-local or domain setting can raise above torch's count
    (``torch.get_num_threads`` reads OpenMP's; ninetieth hostile review), or None without MKL."""
    fns = _thread_fns()
    if fns is None:
        return None
    return fns[0](), fns[1](_DOMAIN_BLAS)


def set_mkl_local_threads(n: int) -> int | None:
    """Set MKL's thread-local thread count (over its global and domain settings; 0: none); the
    previous one (None without MKL)."""
    fns = _thread_fns()
    return None if fns is None else fns[2](n)


def engine_threads() -> int | None:
    """The most intra-op threads an engine call runs at: ``DPCLIP_ENGINE_THREADS`` (``2`` when
    unset, ``1``, or ``all``: None, the process's own count), checked."""
    raw = os.environ.get(ENGINE_THREADS_ENV, "").strip().lower() or str(_PROVEN_THREADS)
    if raw == "all":
        return None
    if raw in ("1", "2"):
        return int(raw)
    raise ValueError(
        f"{ENGINE_THREADS_ENV}={os.environ[ENGINE_THREADS_ENV]!r}: use '2' (the default: the "
        "private step runs torch at no more than two threads, where no rounding that depends on "
        "the batch size was found), '1', or 'all' (the process's thread count: faster on many "
        "cores, for a model whose author you trust; docs/engines.md, \"Rounding that depends on "
        "the batch size\")")


def engine_thread_count() -> int:
    """The intra-op threads an engine call started now would run torch at."""
    cap, have = engine_threads(), torch.get_num_threads()
    return have if cap is None else min(cap, have)


def warn_if_capped() -> None:
    """Warn once per process when the engines will run at fewer threads than torch has
    (:func:`engine_threads`), naming the switch."""
    if _CAP_WARNED:
        return
    cap, have = engine_threads(), torch.get_num_threads()
    if cap is None or have <= cap:
        return
    _CAP_WARNED.append(True)
    warnings.warn(
        f"the private step runs torch at {cap} intra-op threads (this process has {have}): with "
        "more, MKL and torch split a product's work by its size, so a model built to cancel "
        "could let one example move the others' clipped gradients by several times the "
        "clipping norm (docs/engines.md, \"Rounding that depends on the batch size\"). Set "
        f"{ENGINE_THREADS_ENV}=all to keep {have} threads for a model whose author you trust",
        RuntimeWarning, stacklevel=3)


def _getters() -> tuple:
    """torch's C getters of every process-wide setting that chooses how a kernel rounds (the
    backends, the float32 matmul precision per backend, TF32, reduced-precision reductions,
    deterministic kernels, the attention backends); those this torch has."""
    C = torch._C
    names = ("_get_mkldnn_enabled", "_get_nnpack_enabled", "_get_float32_matmul_precision",
             "_get_cublas_allow_tf32", "_get_cudnn_allow_tf32", "_get_onednn_allow_tf32",
             "_get_cpu_allow_fp16_reduced_precision_reduction",
             "_get_cublas_allow_fp16_reduced_precision_reduction",
             "_get_cublas_allow_bf16_reduced_precision_reduction",
             "_get_deterministic_algorithms", "_get_mkldnn_deterministic",
             "_get_cudnn_deterministic", "_get_cudnn_enabled", "_get_flash_sdp_enabled",
             "_get_mem_efficient_sdp_enabled", "_get_math_sdp_enabled", "_get_cudnn_sdp_enabled",
             "_get_fa3_sdp_enabled", "_get_overrideable_sdp_enabled")
    got: list[Any] = [getattr(C, n) for n in names if callable(getattr(C, n, None))]
    fp32 = getattr(C, "_get_fp32_precision_getter", None)
    if callable(fp32):
        for key in (("mkldnn", "matmul"), ("mkldnn", "conv"), ("mkldnn", "rnn"),
                    ("mkldnn", "all"), ("cuda", "matmul"), ("cuda", "conv"), ("cuda", "rnn"),
                    ("cuda", "all"), ("generic", "all")):
            try:
                fp32(*key)
            except (RuntimeError, TypeError, ValueError):
                continue
            got.append(functools.partial(fp32, *key))
    return tuple(got)


_GETTERS = _getters()


def numerics() -> tuple:
    """The values of :func:`_getters`' settings now (a getter that raises, as the legacy matmul
    precision does once its two APIs are mixed, counts as the value ``"unreadable"``)."""
    try:
        return tuple(g() for g in _GETTERS)
    except RuntimeError:
        return tuple(_read(g) for g in _GETTERS)


def _read(getter: Any) -> Any:
    try:
        return getter()
    except RuntimeError:
        return "unreadable"


#: the refusal's text when the forward switched a numerical setting for some operations
NUMERICS_MOVED = ("the forward changed one of torch's numerical settings during the step (oneDNN "
                  "or NNPACK on or off, a float32 matmul precision, TF32, reduced-precision "
                  "reductions, deterministic kernels, an attention backend) and may have put "
                  "it back: an operation then rounds otherwise than the proof's, chosen by "
                  "data the proof does not see (a oneDNN bf16 product switched on for one "
                  "operation carried the batch size into a sign: 60.9 C, hundred-and-forty-"
                  "second hostile review); set them before the step and leave them")


def numerics_moved() -> bool:
    """Whether any of those settings differs from its value when the current engine call fixed
    the backends (False outside one)."""
    want = _FIXED.get()
    return want is not None and numerics() != want[4]


def conv_backends_moved() -> bool:
    """Whether oneDNN or NNPACK is not as the current engine call fixed it (False outside one)."""
    want = _FIXED.get()
    return want is not None and \
        (torch._C._get_mkldnn_enabled(), torch._C._get_nnpack_enabled()) != want[:2]


def threads_moved() -> bool:
    """Whether torch's intra-op thread count is not the one the current engine call fixed (False
    outside one)."""
    want = _FIXED.get()
    return want is not None and want[2] is not None and (
        torch.get_num_threads() != want[2]
        or (want[3] is not None and mkl_threads() != want[3]))


@_cm.contextmanager
def fixed_conv_backends() -> Iterator[None]:
    """The module docstring's fixed backends and thread count for the engine call; all restored
    after it."""
    nnpack = torch._C._get_nnpack_enabled()
    mkldnn = torch._C._get_mkldnn_enabled()
    threads = torch.get_num_threads()
    cap = engine_threads()
    capped = cap is not None and threads > cap
    if capped:
        torch.set_num_threads(cap)
    run = torch.get_num_threads()
    # MKL's own count can exceed torch's (a thread-local or BLAS-domain setting: set through
    # ctypes from a forward, 8.47 C, ninetieth review; MKL_DOMAIN_NUM_THREADS): held at torch's
    mkl = mkl_threads() if cap is not None else None
    local = None
    if mkl is not None and max(mkl) > run:
        local = set_mkl_local_threads(run)
        mkl = mkl_threads()
    off = mkldnn and run == 1
    torch._C._set_nnpack_enabled(False)
    if off:
        torch._C._set_mkldnn_enabled(False)
    # (DPCLIP_ENGINE_THREADS=all: the model is trusted with the thread count, nothing watched)
    token = _FIXED.set((mkldnn and not off, False, run if cap is not None else None, mkl,
                        numerics()))
    try:
        yield
    finally:
        _FIXED.reset(token)
        torch._C._set_nnpack_enabled(nnpack)
        if off:
            torch._C._set_mkldnn_enabled(mkldnn)
        if local is not None:
            set_mkl_local_threads(local)
        if capped:
            torch.set_num_threads(threads)
