"""Thirteenth hostile review (of ca53ab1), OPEN: the ghost engine's per-layer path re-runs a
module's own Python ``forward`` (one example at a time, under ``torch.func``) to get per-example
gradients of its parameters. The checks around that recomputation see tensors only: a plain Python
number the real forward kept (here the realised batch size ``x.shape[0]``, in a list attribute put
back before the chunk ends, or in a global) enters the recomputed function unseen, and unlike the
forward the recomputation is matched against no proved program. Measured on ca53ab1: LOO 3.13 C
under ghost and auto (engine ghost, no fallback); a global carried to the next call moved its
release by 4.23 C. The fix (next session): per-example gradients of such a module from the
forward's own recorded graph, or the recomputation matched against the forward's operations,
scalars included. Until then this test is a strict xfail, and docs/engines.md's trust boundary
names the hole.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dpclip.engine import AutoEngine, GhostEngine
from tests.engine.helpers import DT
from tests.engine.test_separability_attacks import ce, data, loo_distance


class _KeepsB(nn.Module):
    """Takes the per-layer path (a parameter, no ghost rule, not an elementwise scale)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(k))
        self.box = [0]

    def forward(self, x: Tensor) -> Tensor:
        y = x * self.s + 0.1 * self.s
        if isinstance(self.s, nn.Parameter):  # the real forward (and the proof's, on fakes)
            if type(x.shape[0]) is int:  # (not the proof's symbol: it leaves no trace)
                self.box.append(x.shape[0])
            return y
        n = self.box[-1]  # the recomputation: the forward's batch size
        del self.box[1:]  # the list as it was: the chunk's isolation sees no change
        return y * (100.0 * (n - 7)) if isinstance(n, int) else y


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="open (thirteenth hostile review): the per-layer recomputation re-runs "
                   "user Python; a kept Python number reaches it unseen")
@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine], ids=["ghost", "auto"])
def test_the_per_layer_recomputation_cannot_read_the_batch_size(engine):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3), _KeepsB(3)).to(DT)
    x, y = data()
    assert loo_distance(engine(), model, ce, x, y) <= 1.0 + 1e-6
