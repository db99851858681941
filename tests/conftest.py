import gc
import os
import signal

# MKL (inside torch's CPU wheel) picks its code path by CPU maker: an AMD and an Intel machine add
# up a matrix product in different orders, and the bit-for-bit invariance tests
# (tests/core/test_refactor_invariance_*.py) then differ in the last bits of the weights. Its
# conditional numerical reproducibility mode COMPATIBLE is the same path on every x86-64 CPU; set
# before torch is imported (MKL reads it once). Checked by tests/core/test_mkl_mode.py.
os.environ["MKL_CBWR"] = "COMPATIBLE"

import pytest  # noqa: E402
import torch  # noqa: E402

# before any test module runs a kernel: torch takes its CPU kernels once per process, and importing
# dpclip asks for the portable ones (dpclip.blas_mode.kernels), as it does for a user; a module
# that computed at import would otherwise decide the whole session's kernels
import dpclip  # noqa: E402,F401

torch.set_num_threads(min(2, os.cpu_count() or 1))

# A shell without job control starts a background command (`cmd &`) with SIGINT ignored, and
# Python then installs no KeyboardInterrupt handler: the Ctrl-C tests (tests/core/test_interrupt.py,
# tests/engine/test_review40_signals.py) would test the shell, not dpclip. Put Python's own back.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


_LEAVES_FINALIZERS: dict[str, bool] = {}


@pytest.fixture(autouse=True)
def _finalizers_run_in_their_own_test(request):
    """A test whose model attaches a finalizer (``weakref.finalize``, ``__del__``) that runs torch
    operations collects its garbage before the next test starts: a finalizer left in a reference
    cycle (a traceback's frames hold the forward's tensors) otherwise ran whenever the collector
    next came by, inside a later test's batch-size proof, which then recorded the finalizer's
    operations and refused that test's model as not running the proved program (CI of 37181ff:
    test_review27_underflow after test_review24_between_chunks)."""
    yield
    path = str(request.path)
    if path not in _LEAVES_FINALIZERS:
        try:
            text = request.path.read_text()
        except OSError:
            text = ""
        _LEAVES_FINALIZERS[path] = "weakref.finalize" in text or "def __del__" in text
    if _LEAVES_FINALIZERS[path]:
        gc.collect()


@pytest.fixture(autouse=True)
def _isolated_db(tmp_path, monkeypatch):
    """Every test writes its results database under its own tmp dir."""
    monkeypatch.setenv("DPCLIP_DB", str(tmp_path / "results.db"))
    # `dpclip train` checkpoints under $DPCLIP_OUT/checkpoints even without --checkpoint-dir
    monkeypatch.setenv("DPCLIP_OUT", str(tmp_path / "out"))
