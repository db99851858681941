"""Twenty-ninth hostile review (of 938b9df), beside its known-tree attacks (test_known_trees.py):

1. float16 models: the squared norms and the norms were held in float16, so a finite per-example
   gradient of norm above 256 got norm ``inf``, weight 0, and was dropped (a norm of 264 reported
   as inf); and a weight below 6e-5 is a float16 subnormal, rounded by up to half its value when
   cast for the weighted sum (1.81 C under ghost and auto at C = 1.3e-7, 1.79 C under vmap at C =
   5e-7). Now float16 norms, weights and weighted products are float32 (both engines); and the
   sum, rounded to float16 BEFORE the noise was added (1.42 C at C = 1.26e-7; a strict xfail
   until the sums became float32: tests/engine/test_half_precision.py)
2. Open (strict xfail): under vmap an error caught with torch functions switched off
   (``torch._C.DisableTorchFunction``) is not seen by the engine's caught-error check (LOO 5.54 C,
   docs/engines.md, "Errors caught on example data"); under ghost it is (the dispatch-level check).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dpclip.engine import AutoEngine, GhostEngine, ParamGroups, VmapEngine, naive_per_example_grads
from tests.engine.helpers import DT, TwoLayers, clip_weights, loo_distance


def _half():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2)).half()


def _half_data():
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0)).half()
    return x, torch.tensor([[1.0, -1.0], [0.0, 0.0]])


def _scaled(s: float):
    return lambda out, y: (out.float() * y).sum(-1) * s


@pytest.mark.parametrize("engine", [GhostEngine, VmapEngine], ids=["ghost", "vmap"])
def test_a_float16_norm_above_256_is_not_dropped(engine):
    """938b9df (ghost): norm 263.8 reported as inf, weight 0."""
    x, y = _half_data()
    model = _half()
    res = engine().compute(model, _scaled(62.0), x, y, clip_weights(1e-3),
                           ParamGroups.flat(model))
    per_ex = naive_per_example_grads(model.double(), lambda o, t: _scaled(62.0)(o, t).double(),
                                     x.double(), y.double())
    exact = torch.cat([g.reshape(2, -1) for g in per_ex.values()], 1).norm(dim=1)
    assert bool(torch.isfinite(res.norms).all()), res.norms
    assert float(res.norms[0]) >= float(exact[0]) * (1 - 1e-2)
    assert float(res.weights[0]) > 0


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine, VmapEngine],
                         ids=["ghost", "auto", "vmap"])
def test_float16_weights_in_the_normal_range_bound_the_contribution(engine):
    """C = 2e-6 (weights well below float16's normal range before): <= C up to rounding."""
    x, y = _half_data()
    for s in (10.0, 70.0):
        assert loo_distance(engine, _half, x, y, 2e-6, loss=_scaled(s)) <= 1.05


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine, VmapEngine],
                         ids=["ghost", "auto", "vmap"])
def test_float16_sums_of_a_clip_norm_in_the_subnormal_range_stay_below_c(engine):
    """Open before (strict xfail): the sum was rounded to float16 before the noise (1.42 C at
    C = 1.26e-7); the engines now return float16 / bfloat16 parameters' sums in float32."""
    x, y = _half_data()
    assert loo_distance(engine, _half, x, y, 1.26e-7, loss=_scaled(20.0)) <= 1.01


def _any_negative_unseen(v: Tensor) -> int:
    try:
        with torch._C.DisableTorchFunction():
            torch.zeros(1, dtype=v.dtype).index_select(0, (v[:, 0] < 0).long().amax().reshape(1))
        return 0
    except (RuntimeError, IndexError):
        return 1


class _Flips(TwoLayers):
    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc1(x))
        return self.fc2(h) * (-1.0 if _any_negative_unseen(x.detach()) else 1.0)


@pytest.mark.xfail(strict=True, reason="open: vmap's caught-error check is a torch function mode")
def test_an_error_caught_with_torch_functions_off_under_vmap_is_refused():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 5, generator=g, dtype=DT).abs(), torch.randint(0, 3, (8,), generator=g)
    x[3, 0] = -1.0
    try:
        assert loo_distance(VmapEngine, _Flips, x, y, 0.5) <= 1 + 1e-9
    except Exception as exc:  # noqa: BLE001 - a refusal passes
        assert "caught" in str(exc)
