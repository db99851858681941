"""The summed engine: gradient of the summed loss, no norms; BatchNorm allowed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpclip.engine import ParamGroups, SummedEngine, get_engine, naive_per_example_grads
from tests.engine.helpers import CASES, DT, assert_grads_close, ce


@pytest.mark.parametrize("batch", [0, 1, 7])
@pytest.mark.parametrize("case", sorted(CASES))
def test_summed_equals_sum_of_naive_per_example_grads(case, batch):
    c = CASES[case]
    model, x, y = c.make(batch, seed=batch)
    per_ex = naive_per_example_grads(model, c.loss_fn, x, y)
    res = SummedEngine().compute(model, c.loss_fn, x, y, None, ParamGroups.flat(model))
    assert res.norms is None and res.weights is None
    assert_grads_close(res.grads, {n: g.sum(0) for n, g in per_ex.items()})
    with torch.no_grad():
        expected_loss = float(c.loss_fn(model(x), y).sum()) if batch else 0.0
    assert res.loss_sum == pytest.approx(expected_loss, rel=1e-12, abs=1e-12)
    if batch:
        assert any(g.abs().max() > 0 for g in res.grads.values())


def test_summed_chunks_give_the_same_sum():
    model, x, y = CASES["conv_groupnorm"].make(7)
    groups = ParamGroups.flat(model)
    one = SummedEngine().compute(model, ce, x, y, None, groups)
    for size in (1, 3):
        many = get_engine("summed", max_physical_batch=size).compute(model, ce, x, y, None, groups)
        assert_grads_close(many.grads, one.grads, rtol=1e-12)
        assert many.loss_sum == pytest.approx(one.loss_sum, rel=1e-12)


def test_summed_refuses_a_weight_fn():
    model, x, y = CASES["linear"].make(3)
    with pytest.raises(ValueError, match="no per-example norms") as info:
        SummedEngine().compute(model, ce, x, y, lambda n: n, ParamGroups.flat(model))
    assert "batch clipping" in str(info.value)


def test_summed_accepts_training_batchnorm():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Tanh(), nn.Flatten(),
                          nn.Linear(2 * 4 * 4, 3)).to(DT)
    x, y = torch.randn(6, 1, 6, 6, dtype=DT), torch.randint(0, 3, (6,))
    ref = copy_model(model)
    res = SummedEngine().compute(model, ce, x, y, None, ParamGroups.flat(model))
    loss = ce(ref(x), y).sum()
    expected = dict(zip([n for n, _ in ref.named_parameters()],
                        torch.autograd.grad(loss, list(ref.parameters()))))
    assert_grads_close(res.grads, expected, rtol=1e-12)
    # batch statistics couple the examples: the sum differs from the per-example (eval-free) loop
    assert not torch.allclose(res.grads["0.weight"], _per_example_bn_sum(model, x, y))


def copy_model(model):
    import copy

    return copy.deepcopy(model)


def _per_example_bn_sum(model, x, y):
    g = torch.zeros_like(model[0].weight)
    for i in range(0, x.shape[0], 2):  # pairs of examples: different batch statistics
        loss = ce(model(x[i : i + 2]), y[i : i + 2]).sum()
        g += torch.autograd.grad(loss, [model[0].weight])[0]
    return g
