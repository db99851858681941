"""torch's CPU convolution backend fixed for an engine call, whatever the batch size (seventy-eighth
and seventy-ninth hostile reviews; docs/engines.md, "Rounding that depends on the batch size").

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
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch

__all__ = ["conv_backends_moved", "fixed_conv_backends", "MOVED"]

#: ``(oneDNN enabled, NNPACK enabled)`` as the engine call fixed them; None outside a call
_FIXED: contextvars.ContextVar[tuple[bool, bool] | None] = contextvars.ContextVar(
    "dpclip_conv_backends", default=None)

#: the refusal's text (the tracer and vmap's watch say it)
MOVED = ("the forward switched a convolution backend (oneDNN or NNPACK) back on during the step: "
         "torch chooses those backends by the batch size, so an example's rounding would depend "
         "on the others' presence (docs/engines.md, \"Rounding that depends on the batch "
         "size\"); leave torch.backends.mkldnn and torch.backends.nnpack as the engine sets them")


def conv_backends_moved() -> bool:
    """Whether oneDNN or NNPACK is not as the current engine call fixed it (False outside one)."""
    want = _FIXED.get()
    return want is not None and \
        (torch._C._get_mkldnn_enabled(), torch._C._get_nnpack_enabled()) != want


@contextlib.contextmanager
def fixed_conv_backends() -> Iterator[None]:
    """The module docstring's fixed backends for the engine call; both flags restored after it."""
    nnpack = torch._C._get_nnpack_enabled()
    mkldnn = torch._C._get_mkldnn_enabled()
    off = mkldnn and torch.get_num_threads() == 1
    torch._C._set_nnpack_enabled(False)
    if off:
        torch._C._set_mkldnn_enabled(False)
    token = _FIXED.set((mkldnn and not off, False))
    try:
        yield
    finally:
        _FIXED.reset(token)
        torch._C._set_nnpack_enabled(nnpack)
        if off:
            torch._C._set_mkldnn_enabled(mkldnn)
