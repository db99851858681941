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
batch size"): the vectorised elementwise kernels' scalar tails (the eighth review's
``sin(1e16 * t)``), GPU kernels, and BLAS libraries other than MKL.
"""

from __future__ import annotations

import ctypes
import os
import warnings

__all__ = ["ensure", "mode", "warn_if_off"]

#: MKL's ``MKL_CBWR_*`` branch codes (mkl_service.h) and their environment spellings
_AUTO = 2
_STRICT = 0x10000
_NAMES = {1: "off", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1", 8: "SSE4_2",
          9: "AVX", 10: "AVX2", 11: "AVX512_MIC", 12: "AVX512", 13: "AVX512_MIC_E1",
          14: "AVX512_E1"}
_MODE_CHANGE_FAILURE = -8
_LIB: list = []
_WARNED: list[bool] = []


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


def ensure() -> str:
    """Switch MKL to CNR (the user's ``MKL_CBWR`` branch, else ``AUTO``) unless it already runs
    (module docstring); the mode now in force (:func:`mode`)."""
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
    """Warn once per process when MKL runs without CNR (it ran before dpclip was imported);
    nothing to do once a CNR branch is in force (MKL keeps it for the process)."""
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
