"""Empirical neighbour-dataset sensitivity: for every registered strategy and every per-example
engine, the noiseless clipped sums of D and D' (D with one example removed / replaced) differ by at
most the declared sensitivity, on random and adversarial examples."""

import pytest
import torch
from torch import nn

from dpclip.clipping import STRATEGIES
from dpclip.engine import ENGINES, ParamGroups, get_engine
from tests.clipping.contract import contract_strategy

PER_EXAMPLE_ENGINES = sorted(n for n, cls in ENGINES.items() if getattr(cls, "per_example", False))


def ce(out, y):
    return nn.functional.cross_entropy(out, y, reduction="none")


def model_fn():
    torch.manual_seed(3)
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.Tanh(), nn.Flatten(),
                         nn.Linear(3 * 4 * 4, 5), nn.ReLU(), nn.Linear(5, 4)).double()


def flat_sum(engine, model, strategy, state, x, y, groups):
    res = engine.compute(model, ce, x, y, lambda n: strategy.weights(n, state), groups)
    return torch.cat([res.grads[n].flatten() for n, p in model.named_parameters()])


@pytest.mark.parametrize("engine_name", PER_EXAMPLE_ENGINES)
@pytest.mark.parametrize("name", sorted(n for n, e in STRATEGIES.items() if e.kind == "norm"))
def test_neighbour_sensitivity(name, engine_name):
    strategy = contract_strategy(name)
    engine = get_engine(engine_name)
    model = model_fn()
    groups = ParamGroups.flat(model) if strategy.norm_kind == "flat" else ParamGroups.per_layer(model)
    state = strategy.init_state()
    s = strategy.sensitivity(state)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, 1, 6, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (11,), generator=g)
    # adversarial candidates: huge inputs, a NaN input, a tiny-gradient example
    x[3] *= 1e4
    x[5] = float("nan")
    x[7] *= 1e-8
    full = flat_sum(engine, model, strategy, state, x, y, groups)
    worst = 0.0
    for i in range(11):
        keep = [j for j in range(11) if j != i]
        removed = flat_sum(engine, model, strategy, state, x[keep], y[keep], groups)
        assert torch.isfinite(removed).all()
        worst = max(worst, (full - removed).norm().item())
        # replace-one: the difference is at most 2 S
        x2 = x.clone()
        x2[i] = -x[(i + 1) % 11] * 3
        replaced = flat_sum(engine, model, strategy, state, x2, y, groups)
        assert (full - replaced).norm().item() <= 2 * s * (1 + 1e-9)
    assert worst <= s * (1 + 1e-9)
    assert worst > 0.5 * s  # the test exercises the bound (some example is clipped)
