"""MKL's conditional numerical reproducibility (CNR) on the CPU, switched on when dpclip is imported.

Without it, the matrix products of torch's CPU wheel (Intel MKL) pick their code path per call by
the operands' memory alignment, and a row of a batched product rounds by where it lies in memory:
when one example leaves the batch, the rows after it move, and the other examples' computed
gradients change by rounding. A model whose gradient is mostly cancellation amplifies that into
whole multiples of C: a Linear on a constant sequence into a LayerNorm over the positions moved the
other examples' clipped contributions by 2.99 C at batch 16 and 5.85 C at batch 64 in float32 on
every engine that batches (seventy-sixth hostile review; ``benchmarks/results/rounding_loo_cpu.md``).
MKL's CNR mode ``AUTO`` (the fastest code path of the CPU, chosen once, alignment-independent)
brought the same runs to 1.0000 C at 1 and 2 threads.

MKL reads its mode once, at its first call, so :func:`ensure` runs at ``import dpclip`` (before the
model or data are built): it asks MKL's service function for the branch the user's ``MKL_CBWR``
names (any CNR branch is alignment-independent), else ``AUTO``, which it also puts in the
environment (child processes: data workers, ``torchrun``). A process that ran an MKL product before
importing dpclip cannot switch any more (a variable set after that does nothing): :func:`mode`
then says ``"off"`` and the first private step warns
(``dpclip.training.step``). What it does not cover (docs/engines.md, "Rounding that depends on the
batch size"): GPU kernels and BLAS libraries other than MKL.

**torch's elementwise kernels** (:func:`kernels`). torch's CPU kernels for ``gelu``, ``silu``,
``sigmoid``, ``softplus``, ``mish``, ``elu`` and other activations and transcendental functions run
the body of a tensor through vector code and its last ``numel % (2 x vector width)`` elements (of
each thread's share) through scalar code that rounds differently by an ulp; which examples fall
there depends on the batch size. A model built to cancel amplified that into 2.6 C (``sin(1e16 t)``,
eighth review) and 2.955 C with ordinary layers (GELU between a Linear and a LayerNorm over
positions, seventy-ninth review). torch's portable kernels (``ATEN_CPU_CAPABILITY=default``)
compute the vector body lane by lane with the same scalar function, so every element rounds the
same wherever it lies (``tests/engine/test_cpu_kernels.py`` sweeps every unary and binary
pointwise operator). torch reads the variable once, at its first kernel, so :func:`ensure` sets it
at ``import dpclip``, unless ``DPCLIP_CPU_KERNELS=native`` (torch's vector kernels: faster, for a
model whose author you trust; ``docs/privacy.md``) or the user set ``ATEN_CPU_CAPABILITY``. A
process that ran a kernel before importing dpclip keeps the vector kernels: :func:`kernels` then
says ``"native"`` and the first private step warns, unless the user chose native.
"""

from __future__ import annotations

import ctypes
import os
import warnings

__all__ = ["ensure", "kernels", "mode", "warn_if_off"]

#: ``DPCLIP_CPU_KERNELS``: torch's portable kernels (``exact``, the default) or its vector kernels
KERNEL_MODES = ("exact", "native")

#: MKL's ``MKL_CBWR_*`` branch codes (mkl_service.h) and their environment spellings
_AUTO = 2
_STRICT = 0x10000
_NAMES = {1: "off", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1", 8: "SSE4_2",
          9: "AVX", 10: "AVX2", 11: "AVX512_MIC", 12: "AVX512", 13: "AVX512_MIC_E1",
          14: "AVX512_E1"}
_MODE_CHANGE_FAILURE = -8
_LIB: list = []
_WARNED: list[bool] = []
_KERNELS_WARNED: list[bool] = []


def _service() -> ctypes.CDLL | None:
    """torch's CPU library when it exports MKL's CNR service functions, else None (another BLAS,
    another platform)."""
    if _LIB:
        return _LIB[0]
    lib = None
    try:
        import torch

        if torch.backends.mkl.is_available():
            path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
            cand = ctypes.CDLL(path) if os.path.exists(path) else None
            if cand is not None and hasattr(cand, "mkl_serv_cbwr_set") and \
                    hasattr(cand, "mkl_serv_cbwr_get"):
                cand.mkl_serv_cbwr_set.restype = ctypes.c_int
                cand.mkl_serv_cbwr_set.argtypes = [ctypes.c_int]
                cand.mkl_serv_cbwr_get.restype = ctypes.c_int
                cand.mkl_serv_cbwr_get.argtypes = [ctypes.c_int]
                lib = cand
    except (OSError, AttributeError, ImportError):
        lib = None
    _LIB.append(lib)
    return lib


def _wanted() -> int:
    """The CNR branch to ask MKL for: the user's ``MKL_CBWR`` (its branch name, with
    ``,STRICT``), else ``AUTO``."""
    spec = os.environ.get("MKL_CBWR", "").strip().upper()
    if not spec:
        return _AUTO
    name, _, rest = spec.partition(",")
    code = {v: k for k, v in _NAMES.items() if k != 1}.get(name.strip(), _AUTO)
    return code | (_STRICT if rest.strip() == "STRICT" else 0)


def _kernel_choice() -> str:
    """``DPCLIP_CPU_KERNELS`` (``exact`` when unset), checked."""
    got = os.environ.get("DPCLIP_CPU_KERNELS", "").strip().lower() or "exact"
    if got not in KERNEL_MODES:
        raise ValueError(f"DPCLIP_CPU_KERNELS={os.environ['DPCLIP_CPU_KERNELS']!r}: use 'exact' "
                         "(torch's portable CPU kernels: every element rounds the same wherever "
                         "it lies in the batch; the default) or 'native' (torch's vector kernels: "
                         "faster, for a model whose author you trust; docs/privacy.md)")
    return got


def ensure_kernels() -> str:
    """Ask torch for its portable CPU kernels (module docstring) before its first kernel runs,
    unless ``DPCLIP_CPU_KERNELS=native`` or the user set ``ATEN_CPU_CAPABILITY``; the kernels now
    in force (:func:`kernels`)."""
    if _kernel_choice() == "exact":
        os.environ.setdefault("ATEN_CPU_CAPABILITY", "default")  # (children inherit it too)
    return kernels()


def kernels() -> str:
    """torch's CPU kernels in force for the process: ``"exact"`` (its portable kernels: the same
    rounding for every element) or ``"native"`` (its vector kernels, e.g. AVX512: the last
    elements of a tensor round otherwise). Reading it fixes torch's choice (torch reads
    ``ATEN_CPU_CAPABILITY`` once, when its first kernel runs or when asked)."""
    import torch

    return "exact" if torch.backends.cpu.get_cpu_capability() == "DEFAULT" else "native"


def ensure() -> str:
    """Switch MKL to CNR (the user's ``MKL_CBWR`` branch, else ``AUTO``) unless it already runs
    (module docstring), and ask for torch's portable CPU kernels (:func:`ensure_kernels`); the MKL
    mode now in force (:func:`mode`)."""
    ensure_kernels()
    lib = _service()
    if lib is None:
        return mode()
    if lib.mkl_serv_cbwr_get(1) == 1 and lib.mkl_serv_cbwr_set(_wanted()) == 0:
        os.environ.setdefault("MKL_CBWR", "AUTO")  # (for child processes, which start afresh)
    return mode()


def mode() -> str:
    """MKL's CNR branch in force: ``"AUTO"``, ``"COMPATIBLE"``, an instruction set, ``"off"``
    (MKL ran without CNR: rows round by their alignment) or ``"no MKL"``. A branch that reads off
    is switched on when MKL has not started yet (so it is never reported as pending: a variable
    set after MKL started does nothing, seventy-ninth hostile review)."""
    lib = _service()
    if lib is None:
        return "no MKL"
    got = lib.mkl_serv_cbwr_get(1)  # (MKL_CBWR_BRANCH)
    if got == 1:
        if lib.mkl_serv_cbwr_set(_wanted()) != 0:  # (MKL_CBWR_ERR_MODE_CHANGE_FAILURE: it ran)
            return "off"
        got = lib.mkl_serv_cbwr_get(1)
    return _NAMES.get(got, f"branch {got}")


def warn_if_off() -> None:
    """Warn once per process when MKL runs without CNR (it ran before dpclip was imported), and
    once when torch runs its vector kernels although nobody chose them (:func:`kernels`: a kernel
    ran before dpclip was imported, or ``ATEN_CPU_CAPABILITY`` names a vector set while
    ``DPCLIP_CPU_KERNELS`` is not ``native``); nothing to do once settled (torch and MKL keep
    their choice for the process)."""
    if not _KERNELS_WARNED:
        _KERNELS_WARNED.append(True)
        if kernels() == "native" and _kernel_choice() != "native":
            warnings.warn(
                "torch runs its vector CPU kernels in this process (a kernel ran before dpclip "
                "was imported, or ATEN_CPU_CAPABILITY names a vector instruction set): their last "
                "elements round otherwise than the rest, and a model built to cancel can let one "
                "example move the others' clipped gradients by several times the clipping norm "
                "(docs/engines.md, \"Rounding that depends on the batch size\"). Import dpclip "
                "before any computation, or set DPCLIP_CPU_KERNELS=native to accept this for a "
                "model whose author you trust", RuntimeWarning, stacklevel=3)
    if _WARNED:
        return
    now = mode()
    if now != "off":
        _WARNED.append(False)  # (settled: MKL keeps its branch for the process)
        return
    _WARNED.append(True)
    warnings.warn(
        "MKL ran a matrix product before dpclip was imported, without its conditional numerical "
        "reproducibility mode: a row of a batched product then rounds by its memory alignment, "
        "and a model whose gradients cancel can let one example move the others' clipped "
        "gradients by several times the clipping norm (docs/engines.md, \"Rounding that "
        "depends on the batch size\"). Import dpclip before any computation, or set "
        "MKL_CBWR=AUTO in the environment before Python starts", RuntimeWarning, stacklevel=3)
