"""Twenty-seventh hostile review (of 58302c4): underflow in the ghost norm formulas.

A bias-free layer saw its input scaled by 1e-24 and its output by 1e19: example i's weight
gradient ``b_i a_i^T`` had entries of order 1e-5, but ``||a_i||^2`` (and the Gram matrices of
``a``, and the row norms of the rounding bound) underflowed to exactly 0 in float32, so the
engine's norm was 0, the weight 1, and the gradient was summed unclipped: LOO 410 C (2-D Linear),
136 C (Linear on a sequence), 107 C (Conv2d), 403 C (transformers Conv1D), about 1.2e3 C (a tied
weight, cross terms), and 379 C in float64 (scales 1e-170 and 1e150), under ghost and auto. The
rounding bounds are relative and assume no underflow. Now the entries of a matmul or embedding
layer's ``a`` and ``b`` below 2^-40 (float64: 2^-300) are flushed to zero for its norms and its
sums alike, and every norm gets an absolute underflow term (``ghost._flush_tiny``,
``ghost._underflow_floor``).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dpclip.engine import AutoEngine, GhostEngine, ParamGroups, VmapEngine
from dpclip.engine import naive_per_example_grads
from tests.engine.helpers import ce, clip_weights

ENGINES = pytest.mark.parametrize("engine", [GhostEngine, AutoEngine], ids=["ghost", "auto"])
MODES = pytest.mark.parametrize("mode", ["mixed", "ghost", "direct"])


class _Scaled(nn.Module):
    """``layer(x * down) * up``: tiny inputs, huge output gradients."""

    def __init__(self, kind: str, down: float, up: float, dtype=torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind, self.down, self.up = kind, down, up
        if kind == "conv":
            self.layer = nn.Conv2d(2, 3, 3, bias=False)
        elif kind == "tied":  # 300 x 300 > 2^16 entries: the cross-term path, not formed
            self.layer = nn.Linear(300, 300, bias=False)
        elif kind == "conv1d-hf":
            from transformers.pytorch_utils import Conv1D
            self.layer = Conv1D(3, 16)
        else:
            self.layer = nn.Linear(16, 3, bias=False)
        self.to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "conv":
            return (self.layer(x * self.down) * self.up).flatten(1)[:, :3]
        if self.kind == "tied":  # the same weight used twice
            return (self.layer(self.layer(x * self.down)) * self.up)[:, :3]
        h = self.layer(x * self.down) * self.up
        return h.mean(1) if self.kind == "seq" else h


def _data(kind: str, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    shape = {"conv": (4, 2, 5, 5), "seq": (4, 8, 16), "tied": (4, 300)}.get(kind, (4, 16))
    return torch.randn(*shape, generator=g, dtype=dtype), torch.tensor([0, 1, 2, 0])


def _loo(engine, make, x, y, c) -> float:
    def release(xs, ys):
        model = make()
        res = engine().compute(model, ce, xs, ys, clip_weights(c), ParamGroups.flat(model))
        return torch.cat([g.double().reshape(-1) for g in res.grads.values()])

    full = release(x, y)
    n = x.shape[0]
    return max(float((full - release(x[keep], y[keep])).norm()) / c
               for keep in ([i for i in range(n) if i != j] for j in range(n)))


@MODES
@pytest.mark.parametrize("kind", ["linear", "seq", "conv", "tied"])
@ENGINES
def test_an_underflowing_norm_no_longer_leaves_an_example_unclipped(engine, kind, mode):
    """58302c4: LOO 107-1200 C (float32, C = 1e-7)."""
    x, y = _data(kind)
    make = (lambda: GhostEngine(norm_mode=mode)) if engine is GhostEngine else engine
    assert _loo(make, lambda: _Scaled(kind, 1e-24, 1e19), x, y, 1e-7) <= 1 + 1e-6


@ENGINES
def test_transformers_conv1d_alike(engine):
    pytest.importorskip("transformers")
    x, y = _data("linear")
    assert _loo(engine, lambda: _Scaled("conv1d-hf", 1e-24, 1e19), x, y, 1e-7) <= 1 + 1e-6


@ENGINES
def test_float64_alike(engine):
    """58302c4: LOO 379 C (scales 1e-170 and 1e150, C = 1e-22)."""
    x, y = _data("linear", torch.float64)
    assert _loo(engine, lambda: _Scaled("linear", 1e-170, 1e150, torch.float64), x, y,
                1e-22) <= 1 + 1e-9


@pytest.mark.parametrize("kind", ["linear", "seq", "conv"])
@ENGINES
def test_values_just_above_the_flush_are_clipped_as_computed(engine, kind):
    """Inputs of order 2^-39 (kept) against output gradients of order 2^50: the norms, products
    of normal numbers, bound what is summed; each example is clipped to C."""
    x, y = _data(kind)
    assert _loo(engine, lambda: _Scaled(kind, 2.0 ** -39, 2.0 ** 50), x, y, 1e-3) <= 1 + 1e-6


def test_norms_of_an_ordinary_float32_model_still_bound_the_float64_loop_closely():
    """The flush and the absolute term change nothing measurable for ordinary values (the bound
    stays about 1e-4 above the exact norm: float32 rounding factors, as on 58302c4)."""
    x, y = _data("seq")
    model = _Scaled("seq", 1.0, 1.0)
    res = GhostEngine().compute(model, ce, x, y, clip_weights(1.0), ParamGroups.flat(model))
    exact = naive_per_example_grads(model.double(), ce, x.double(), y)["layer.weight"]
    true = exact.flatten(1).norm(dim=1)
    assert bool((res.norms.double() >= true).all())
    # (a rounding factor for the public chunk size, 4096 examples: about 2.6e-4 in float32)
    torch.testing.assert_close(res.norms.double(), true, rtol=5e-4, atol=0)


def test_vmap_was_and_stays_sound():
    x, y = _data("linear")
    assert _loo(VmapEngine, lambda: _Scaled("linear", 1e-24, 1e19), x, y, 1e-7) <= 1 + 1e-6


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine], ids=["ghost", "auto"])
def test_a_negative_padding_index_set_after_construction_equals_the_loop(engine):
    """Twenty-seventh review, correctness (privacy held): ``emb.padding_idx = -1`` set after
    construction; F.embedding reads it as row V - 1 and gives that row no gradient, the rule's
    mask compared the ids with -1 (norms off by 0.3-1 %, a non-zero padding row summed)."""
    from dpclip.engine.known_losses import cross_entropy_per_example as known_ce
    from tests.engine.helpers import DT, assert_equal_to_the_loop

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(7, 4), nn.Flatten(), nn.Linear(12, 3)).to(DT)
    model[0].padding_idx = -1
    g = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, 7, (6, 3), generator=g), torch.randint(0, 3, (6,), generator=g)
    x[:, 0] = 6  # the padding row in every example
    groups = ParamGroups.flat(model)
    res = engine().compute(model, known_ce, x, y, clip_weights(0.5), groups)
    assert_equal_to_the_loop(res, model, known_ce, x, y, groups)
