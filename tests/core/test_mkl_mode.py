"""The test process runs MKL in its reproducible ``COMPATIBLE`` mode (tests/conftest.py), so the
bit-for-bit invariance references hold on AMD and Intel CPUs alike: without it MKL takes a
vendor-specific path, and 32 of the invariance tests differed in the weights' last bits on an AMD
EPYC against references recorded on an Intel machine (ledgers equal)."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

#: ``mkl_serv_cbwr_get(MKL_CBWR_ALL)``'s value for ``MKL_CBWR=COMPATIBLE``
_MKL_CBWR_ALL, _COMPATIBLE = 1, 3


def _mkl() -> ctypes.CDLL | None:
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        dll = ctypes.CDLL(lib)
        dll.mkl_serv_cbwr_get  # noqa: B018 - present only in a wheel built with MKL
    except (OSError, AttributeError):
        return None
    return dll


def test_mkl_runs_in_compatible_mode():
    dll = _mkl()
    if dll is None or not torch.backends.mkl.is_available():
        pytest.skip("this torch is not built with MKL: no vendor-dependent path to pin")
    assert os.environ.get("MKL_CBWR") == "COMPATIBLE"
    assert dll.mkl_serv_cbwr_get(_MKL_CBWR_ALL) == _COMPATIBLE, (
        "MKL ignored MKL_CBWR=COMPATIBLE (set too late, after its first call?): the bit-for-bit "
        "invariance references would depend on the CPU maker")
