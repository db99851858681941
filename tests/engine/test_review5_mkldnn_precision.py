"""Fifth hostile review: oneDNN's float32 convolution precision is a channel from one call to the
next.

``dpclip.engine.isolation.settings`` watches ``torch.get_float32_matmul_precision()`` and
``torch.backends.mkldnn.enabled``, not the per-backend precisions of torch's newer API.
``torch.backends.mkldnn.conv.fp32_precision = "bf16"`` (also ``.rnn``) makes every float32
convolution on a CPU with bf16 support (AVX512-BF16 / AMX, as this machine has) compute in bf16,
while ``get_float32_matmul_precision()`` still answers "highest": the isolation sees no change and
puts nothing back. A forward that sets it when it sees a marked example changes the next call's
arithmetic; every operation and argument is the proof's. On 524171e the next call moved by
2.59 C under ghost, auto and vmap (sound: 0). Now every backend's float32 precision (and torch's
other C flags that pick or change a kernel) is in the isolation's settings.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from dpclip.engine import AutoEngine, GhostEngine, VmapEngine
from dpclip.engine.errors import UnsupportedModelError
from dpclip.training.step import PrivateBufferError
from tests.engine.test_separability_attacks import C, ce

from dpclip.engine import ParamGroups
from tests.engine.helpers import clip_weights

_MK = torch.backends.mkldnn


def _bf16_capable() -> bool:
    x, w = torch.randn(2, 3, 16, 16), torch.randn(4, 3, 3, 3)
    ref = nn.functional.conv2d(x, w)
    try:
        _MK.conv.fp32_precision = "bf16"
        return not torch.equal(ref, nn.functional.conv2d(x, w))
    finally:
        _MK.conv.fp32_precision = "none"


pytestmark = pytest.mark.skipif(not _bf16_capable(), reason="no bf16 convolutions on this CPU")

_K = torch.randn(2, 2, 8, 8, generator=torch.Generator().manual_seed(3))
_W = torch.randn(6, 2, 3, 3, generator=torch.Generator().manual_seed(4))


def _first(x: Tensor) -> float:
    while torch._C._functorch.is_functorch_wrapped_tensor(x):
        x = torch._C._functorch.get_unwrapped(x)
    return float(x.reshape(x.shape[0], -1)[0].sum())


class _ConvPrecision(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 6, 3)
        self.head = nn.Linear(6, 3)
        self.register_buffer("k", _K.clone())
        self.register_buffer("w", _W.clone())

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv(x)  # (B, 6, 6, 6)
        # a public constant: float32 rounding (~1e-6), or ~0.05 with bf16 convolutions (a batch
        # of 2: oneDNN runs batches of one on another path); -3, or 3 with bf16 convolutions
        err = nn.functional.conv2d(self.k, self.w) - nn.functional.conv2d(
            self.k.double(), self.w.double()).float()
        h = h * (6 * (err.abs().amax() > 1e-3).to(h.dtype) - 3)
        out = self.head(torch.tanh(h).mean((2, 3)))
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            if not is_fake(x) and _first(x) > 1000:  # a marked example
                _MK.conv.fp32_precision = "bf16"
        return out


def _sum(engine, model, x, y) -> Tensor:
    res = engine.compute(model, ce, x, y, clip_weights(C), ParamGroups.flat(model))
    return torch.cat([g.reshape(-1) for g in res.grads.values()])


def _moved(engine, kw) -> float:
    torch.manual_seed(0)
    model = _ConvPrecision()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 2, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
    got = []
    try:
        for mark in (False, True):
            x1 = x[:2].clone()
            if mark:
                x1[0] = 30.0
            try:
                _sum(engine(**kw), model, x1, y[:2])
            except (UnsupportedModelError, PrivateBufferError):
                pass
            got.append(_sum(engine(**kw), model, x[2:], y[2:]))
    finally:
        _MK.conv.fp32_precision = "none"
    return float((got[0] - got[1]).norm()) / C


@pytest.mark.parametrize("kw", [{}, {"max_physical_batch": 1}], ids=["batch", "chunks-of-one"])
@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine, VmapEngine],
                         ids=["ghost", "auto", "vmap"])
def test_a_call_cannot_leave_the_convolution_precision_for_the_next(engine, kw):
    moved = _moved(engine, kw)
    print(f"moved {moved:.3f} C")
    assert moved <= 1e-12, moved
