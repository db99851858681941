"""The contract every clipping strategy must satisfy (run over the whole registry).

Later strategies get these checks for free by being registered; a strategy whose default
construction needs arguments declares ``contract_params`` (a dict) on its registry entry class.
"""

from __future__ import annotations

import json
import math

import torch

from dpclip.clipping import StepContext, make_strategy
from dpclip.events import GaussianEvent

#: per-example norms that stress the weight function (0, tiny, typical, huge)
STRESS_NORMS = torch.tensor(
    [0.0, 1e-12, 1e-6, 1e-3, 0.05, 0.1, 0.2162, 0.5, 0.99, 1.0, 1.01, 3.0, 1e3, 1e12],
    dtype=torch.float64,
)
GROUPS = 3


def contract_strategy(name: str):
    from dpclip.clipping import STRATEGIES

    entry = STRATEGIES[name]
    params = getattr(entry.cls, "contract_params", {})
    return make_strategy(name, params)


def ctx(step: int = 0, total: int = 100) -> StepContext:
    return StepContext(step=step, epoch=step // 10, steps_per_epoch=10, total_steps=total,
                       expected_batch_size=16.0, base_noise_multiplier=1.0)


def norms_for(strategy, norms: torch.Tensor) -> torch.Tensor:
    if strategy.norm_kind == "group":
        return norms[:, None].repeat(1, GROUPS) * torch.linspace(0.5, 2.0, GROUPS,
                                                                 dtype=norms.dtype)
    return norms


def contribution_norms(strategy, norms: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """||w_i g_i|| for gradients with the given (group) norms; inf norm with weight 0 -> 0."""
    prod = torch.where(w == 0, torch.zeros_like(w), w * norms)
    if strategy.norm_kind == "group":
        return prod.pow(2).sum(dim=1).sqrt()
    return prod


class FakeRelease:
    def __init__(self):
        self.calls = []

    def __call__(self, value, sensitivity, noise_multiplier):
        self.calls.append((value, sensitivity, noise_multiplier))
        return value, GaussianEvent(noise_multiplier)


def check_weight_bound(strategy) -> None:
    state = strategy.init_state()
    gen = torch.Generator().manual_seed(0)
    rnd = torch.exp(torch.randn(500, generator=gen, dtype=torch.float64) * 3)
    for base in (STRESS_NORMS, rnd):
        n = norms_for(strategy, base)
        w = strategy.weights(n, state)
        assert w.shape == n.shape
        assert torch.isfinite(w).all() and (w >= 0).all()
        c = contribution_norms(strategy, n, w)
        s = strategy.sensitivity(state)
        assert math.isfinite(s) and s > 0
        assert (c <= s * (1 + 1e-9)).all(), f"max contribution {c.max()} > sensitivity {s}"


def check_purity(strategy) -> None:
    state = strategy.init_state()
    before = json.dumps(state, sort_keys=True)
    n = norms_for(strategy, STRESS_NORMS.clone())
    n_copy = n.clone()
    w1 = strategy.weights(n, state)
    w2 = strategy.weights(n, state)
    assert torch.equal(w1, w2)
    assert torch.equal(n, n_copy), "weights() mutated its input"
    assert json.dumps(state, sort_keys=True) == before, "weights() mutated the state"
    s1, s2 = strategy.sensitivity(state), strategy.sensitivity(state)
    assert s1 == s2


def check_nonfinite(strategy) -> None:
    state = strategy.init_state()
    base = torch.tensor([math.inf, math.nan, 1.0], dtype=torch.float64)
    n = norms_for(strategy, base)
    w = strategy.weights(n, state)
    assert torch.isfinite(w).all()
    assert (w[:2] == 0).all(), "non-finite norms must get weight 0"


def check_state_round_trip(strategy) -> None:
    state = strategy.init_state()
    assert json.loads(json.dumps(state)) == dict(state)
    release = FakeRelease()
    n = norms_for(strategy, STRESS_NORMS)
    for t in range(3):
        state = strategy.begin_step(state, ctx(t))
        state, events = strategy.update(state, n, ctx(t), release)
        assert isinstance(events, tuple)
        assert json.loads(json.dumps(state)) == dict(state)
    # planned events equal emitted ones (the trainer enforces this at run time too)
    state = strategy.init_state()
    state = strategy.begin_step(state, ctx(0))
    z = strategy.noise_multiplier(state, 1.0)
    _, events = strategy.update(state, n, ctx(0), FakeRelease())
    planned = strategy.planned_event(1.0, ctx(0))
    emitted = GaussianEvent(z) if not events else None
    if emitted is not None:
        assert planned == emitted


ALL_CHECKS = (check_weight_bound, check_purity, check_nonfinite, check_state_round_trip)
