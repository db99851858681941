"""Forty-ninth hostile review (of 46b10b5; the proof's rules with model code that only computes):
a float64 model with one float32 (or bfloat16) parameter on the per-layer path. The parameter's
kept per-example gradients are float32, entries ~1e-24; their squares underflow to 0 in float32,
while the underflow floor added to the norms was float64's (only the first parameter's and the
calls' output-gradient dtypes were counted): the norm came out ~1e-153, the weight 1, and the
example was summed unclipped (LOO 1.2e6 C at C = 1e-30 under ghost and auto). Now every trainable
parameter's dtype, and each call's input and output-gradient dtypes, set the floor and the
rounding terms."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpclip.engine import AutoEngine, GhostEngine
from tests.engine.helpers import Head, loo_distance


class _Scale(nn.Module):
    """No ghost rule: the per-layer path."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(3, dtype=dtype))

    def forward(self, h):
        return h * self.s.double()


def _model(dtype: torch.dtype):
    class M(Head):  # (the float64 Linear registered first: its dtype was the one counted)
        def __init__(self) -> None:
            super().__init__()
            self.sc = _Scale(dtype)

        def forward(self, x):
            return self.sc(x[:, :3] * 1e-24) + 0.0 * self.fc(x)

    return M


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
def test_a_narrow_parameter_in_a_float64_model_is_clipped(engine, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (6,), generator=g)
    assert loo_distance(engine, _model(dtype), x, y, 1e-30, exact=True) <= 1.0 + 1e-9
