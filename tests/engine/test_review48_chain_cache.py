"""Forty-eighth hostile review (of ace9dd3, the proof's rules with model code that only
computes): no accepted model moved the clipped sum beyond C; one crash. A plain chain's traced
layouts are cached per ``ghost_forward._chain_key`` and handed to the layer calls in order; the key
did not say which layers were trainable, so after a step with a layer frozen, the same chain with
it unfrozen got another layer's layouts or none (``TypeError`` under ghost and auto)."""

from __future__ import annotations

import pytest
import torch

from dpclip.engine import AutoEngine, GhostEngine, VmapEngine
from tests.engine.helpers import ce, loo_distance


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
@pytest.mark.parametrize("frozen_first", [(0,), (2,)])
def test_a_layer_unfrozen_after_its_chain_was_cached_gets_its_own_layouts(engine, frozen_first):
    """A plain chain's traced layouts are cached and handed to the calls in order; the key did
    not say which layers were trainable, so a layer frozen when they were cached and trainable
    later got another layer's layouts or none (a TypeError under ghost and auto). Now the same
    LOO as without the earlier step, equal to vmap's."""
    from torch import nn

    from dpclip.engine import ghost_forward
    from tests.engine.helpers import clip_weights
    from dpclip.engine import ParamGroups

    def make(frozen=()):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 4), nn.Softshrink(0.0), nn.Linear(4, 3)).double()
        for i in frozen:
            m[i].requires_grad_(False)
        return m

    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (6,), generator=g)
    ghost_forward._CHAIN_LAYOUTS.clear()
    for n in (6, 5):
        m = make(frozen_first)
        engine().compute(m, ce, x[:n], y[:n], clip_weights(0.1), ParamGroups.flat(m))
    got = loo_distance(engine, make, x, y, 0.1)
    assert got <= 1.0 + 1e-9
    assert got == pytest.approx(loo_distance(VmapEngine, make, x, y, 0.1), rel=1e-9)
