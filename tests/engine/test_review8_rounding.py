"""Eighth hostile review: rounding that depends on the batch size, amplified by the model.

torch's CPU elementwise kernels compute most elements with vector instructions and the last
``numel % (2 * vector width)`` with scalar code; for ``mish``, ``silu``, ``gelu``, ``softplus`` and
``sigmoid`` the two paths differ by one ulp. Which rows fall in that tail depends on the batch
size, so example i's activation depends on how many examples share the call. A model that turns
the last bit into a sign (``sin(1e16 * t)``) moves the OTHER examples' clipped gradients when one
example is removed: measured on a5fd978 (AVX-512 CPU, float64, B 16): ghost, auto and vmap
2.615 C; naive 1.000 C. Every engine that batches examples through one kernel call (and every
peer that does: Opacus, fastDP) has it; the trust boundary in docs/engines.md says so. What the
test holds: the naive engine, which computes each example in a call of its own, stays within C
on this model.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dpclip.engine import NaiveEngine
from tests.engine.helpers import DT
from tests.engine.test_separability_attacks import ce, data, loo_distance


class _Amplifies(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 1), nn.Linear(1, 3)

    def forward(self, x: Tensor) -> Tensor:
        t = nn.functional.mish(self.fc1(x))  # (B, 1): which rows are the scalar tail depends on B
        return self.fc2(torch.sin(1e16 * t))  # the last bit decides the sign


def test_the_naive_engine_is_not_moved_by_batch_dependent_rounding():
    torch.manual_seed(0)
    model = _Amplifies().to(DT)
    x, y = data(b=16)
    assert loo_distance(NaiveEngine(), model, ce, x, y) <= 1.0 + 1e-9
