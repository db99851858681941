"""The engine contract, run over every registered per-example engine: non-finite examples, empty
batches, BatchNorm refusal, argument errors, and no mutation of the model."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from dpclip.engine import (
    ENGINES,
    ParamGroups,
    UnsupportedModelError,
    get_engine,
    naive_per_example_grads,
    vmap_per_example_grads,
)
from tests.engine.helpers import (
    CASES,
    DT,
    assert_close,
    assert_grads_close,
    ce,
    clip_weights,
    oracle_norms,
    oracle_sum,
)

PER_EXAMPLE = sorted(n for n, cls in ENGINES.items() if cls.per_example)


def test_per_example_engines_registered():
    assert PER_EXAMPLE == ["auto", "compiled", "ghost", "naive", "vmap"]


# ------------------------------------------------------------------------- non-finite examples


class TwoBranch(nn.Module):
    """out = a(x[:, :3]) + b(x[:, 3:]); with a linear loss, a NaN in x[:, 3:] poisons only b's grad."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.b = nn.Linear(2, 2)

    def forward(self, x):
        return self.a(x[:, :3]) + self.b(x[:, 3:])


def linear_loss(out, y):
    return (out * y).sum(1)


@pytest.mark.parametrize("poison", [math.nan, math.inf])
@pytest.mark.parametrize("grouping", ["flat", "per_layer"])
@pytest.mark.parametrize("engine_name", PER_EXAMPLE)
def test_non_finite_example_is_zeroed_and_reported_inf(engine_name, grouping, poison):
    torch.manual_seed(0)
    model = TwoBranch().to(DT)
    x, y = torch.randn(7, 5, dtype=DT), torch.randn(7, 2, dtype=DT)
    bad = 3
    x[bad, 4] = poison  # only branch b's per-example gradient is non-finite
    groups = getattr(ParamGroups, grouping)(model)
    raw = naive_per_example_grads(model, linear_loss, x, y)
    assert torch.isfinite(raw["a.weight"][bad]).all()  # the fixture poisons one group only
    assert not torch.isfinite(raw["b.weight"][bad]).all()

    seen = []
    wfn = clip_weights(0.7)

    def weight_fn(n):
        seen.append(n.clone())
        return wfn(n)

    res = get_engine(engine_name).compute(model, linear_loss, x, y, weight_fn, groups)
    # +inf in every group of the bad example, and the weight function saw it
    assert torch.isinf(res.norms[bad]).all() and (res.norms[bad] > 0).all()
    assert torch.isinf(torch.cat(seen)[bad]).all()
    assert torch.isfinite(res.norms[torch.arange(7) != bad]).all()
    assert (res.weights[bad] == 0).all()
    for g in res.grads.values():
        assert torch.isfinite(g).all()
    # equals the same engine on the batch without the bad example (all params, incl. branch a)
    keep = torch.arange(7) != bad
    ref = get_engine(engine_name).compute(model, linear_loss, x[keep], y[keep], wfn, groups)
    assert_grads_close(res.grads, ref.grads)
    assert_close(res.norms[keep], ref.norms)
    # ... and the explicit oracle
    assert_close(res.norms, oracle_norms(raw, groups, 7))
    assert_grads_close(res.grads, oracle_sum(raw, wfn(oracle_norms(raw, groups, 7)), groups, 7))


@pytest.mark.parametrize("engine_name", PER_EXAMPLE)
def test_nan_input_example_in_cnn(engine_name):
    model, x, y = CASES["conv_groupnorm"].make(5)
    x[2, 0, 4, 4] = math.nan
    groups = ParamGroups.flat(model)
    res = get_engine(engine_name, max_physical_batch=2).compute(
        model, ce, x, y, clip_weights(1.0), groups)
    assert math.isinf(res.norms[2]) and res.weights[2] == 0
    keep = torch.tensor([0, 1, 3, 4])
    ref = get_engine(engine_name).compute(model, ce, x[keep], y[keep], clip_weights(1.0), groups)
    assert_grads_close(res.grads, ref.grads)


@pytest.mark.parametrize("engine_name", PER_EXAMPLE)
def test_weight_fn_errors(engine_name):
    model, x, y = CASES["linear"].make(4)
    engine = get_engine(engine_name)
    groups = ParamGroups.flat(model)
    with pytest.raises(ValueError, match="weight_fn is None"):
        engine.compute(model, ce, x, y, None, groups)
    with pytest.raises(ValueError, match=r"shape \(B,\), got a 2-d tensor"):
        engine.compute(model, ce, x, y, lambda n: n[:, None], groups)
    with pytest.raises(ValueError, match="non-finite weights"):
        engine.compute(model, ce, x, y, lambda n: 1.0 / (n - n), groups)
    with pytest.raises(ValueError, match=r"shape \(B, 2\) \(one column per group\), got a 1-d tensor"):
        engine.compute(model, ce, x, y, lambda n: n[:, 0], ParamGroups.per_layer(model))


# ------------------------------------------------------------------------------ empty batch


@pytest.mark.parametrize("grouping", ["flat", "per_layer"])
@pytest.mark.parametrize("engine_name", PER_EXAMPLE)
def test_empty_batch(engine_name, grouping):
    model, x, y = CASES["conv_groupnorm"].make(0)
    assert x.shape[0] == 0
    groups = getattr(ParamGroups, grouping)(model)
    calls = []

    def weight_fn(n):
        calls.append(tuple(n.shape))
        return torch.ones_like(n)

    res = get_engine(engine_name).compute(model, ce, x, y, weight_fn, groups)
    shape = (0,) if groups.is_flat else (0, len(groups))
    assert calls == [shape]
    assert res.norms.shape == shape and res.weights.shape == shape
    assert res.norms.dtype == DT
    assert res.loss_sum == 0.0
    for n, p in model.named_parameters():
        assert res.grads[n].shape == p.shape and res.grads[n].dtype == p.dtype
        assert not res.grads[n].any()


# ------------------------------------------------------------------------------ BatchNorm


class BNNet(nn.Module):
    def __init__(self, bn: nn.Module) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 2, 3), bn, nn.Tanh())
        self.head = nn.Linear(2 * 4 * 4, 3)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def _bn_data(batch=4):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, 1, 6, 6, generator=g, dtype=DT), torch.randint(0, 3, (batch,), generator=g)


@pytest.mark.parametrize("bn_cls", [nn.BatchNorm2d, nn.SyncBatchNorm])
@pytest.mark.parametrize("engine_name", PER_EXAMPLE)
def test_training_batchnorm_is_refused_naming_the_layer(engine_name, bn_cls):
    model = BNNet(bn_cls(2)).to(DT)
    x, y = _bn_data()
    with pytest.raises(UnsupportedModelError) as info:
        get_engine(engine_name).compute(model, ce, x, y, clip_weights(1.0), ParamGroups.flat(model))
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "'features.1'" in msg and bn_cls.__name__ in msg
    assert "GroupNorm" in msg and "LayerNorm" in msg and "unit=bc" in msg
    assert "incompatible with BatchNorm" in msg


def test_batchnorm_refused_by_per_example_grad_functions():
    model = nn.BatchNorm1d(3).to(DT)
    x, y = torch.randn(4, 3, dtype=DT), torch.randn(4, 3, dtype=DT)

    def loss(o, t):
        return ((o - t) ** 2).sum(1)

    for fn in (naive_per_example_grads, vmap_per_example_grads):
        with pytest.raises(UnsupportedModelError, match="'<root>'"):
            fn(model, loss, x, y)


@pytest.mark.parametrize("engine_name", PER_EXAMPLE)
def test_eval_batchnorm_without_running_stats_is_refused(engine_name):
    model = BNNet(nn.BatchNorm2d(2, track_running_stats=False)).to(DT).eval()
    x, y = _bn_data()
    with pytest.raises(UnsupportedModelError, match="track_running_stats=False"):
        get_engine(engine_name).compute(model, ce, x, y, clip_weights(1.0), ParamGroups.flat(model))


@pytest.mark.parametrize("engine_name", PER_EXAMPLE)
def test_eval_batchnorm_is_accepted_and_exact(engine_name):
    model = BNNet(nn.BatchNorm2d(2)).to(DT)
    bn = model.features[1]
    with torch.no_grad():
        bn.running_mean.copy_(torch.tensor([0.3, -0.2]))
        bn.running_var.copy_(torch.tensor([0.5, 2.0]))
        bn.weight.copy_(torch.tensor([1.5, 0.7]))
    model.eval()
    stats = (bn.running_mean.clone(), bn.running_var.clone())
    x, y = _bn_data(5)
    groups = ParamGroups.per_layer(model)
    per_ex = naive_per_example_grads(model, ce, x, y)
    res = get_engine(engine_name).compute(model, ce, x, y, clip_weights(0.2), groups)
    expected = oracle_norms(per_ex, groups, 5)
    assert_close(res.norms, expected)
    assert_grads_close(res.grads, oracle_sum(per_ex, clip_weights(0.2)(expected), groups, 5))
    assert torch.equal(bn.running_mean, stats[0]) and torch.equal(bn.running_var, stats[1])


# ------------------------------------------------------------------- groups and frozen params


@pytest.mark.parametrize("engine_name", sorted(ENGINES))
def test_groups_are_validated(engine_name):
    model, x, y = CASES["frozen"].make(3)
    engine = get_engine(engine_name)
    wfn = clip_weights(1.0) if engine.per_example else None
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert "2.weight" not in names  # the frozen one
    missing = ParamGroups(("all",), (tuple(names[1:]),))
    with pytest.raises(ValueError, match="not in any group"):
        engine.compute(model, ce, x, y, wfn, missing)
    with_frozen = ParamGroups(("all",), (tuple(names) + ("2.weight",),))
    with pytest.raises(ValueError, match="not trainable"):
        engine.compute(model, ce, x, y, wfn, with_frozen)
    res = engine.compute(model, ce, x, y, wfn, ParamGroups.flat(model))
    assert set(res.grads) == set(names)


# ------------------------------------------------------------------------ argument checks


@pytest.mark.parametrize("engine_name", sorted(ENGINES))
def test_argument_errors(engine_name):
    model, x, y = CASES["linear"].make(4)
    engine = get_engine(engine_name)
    wfn = clip_weights(1.0) if engine.per_example else None
    groups = ParamGroups.flat(model)
    with pytest.raises(ValueError, match="different batch sizes"):
        engine.compute(model, ce, x, y[:3], wfn, groups)

    def mean_loss(o, t):
        return nn.functional.cross_entropy(o, t)

    with pytest.raises(ValueError, match="reduction 'none'"):
        engine.compute(model, mean_loss, x, y, wfn, groups)
    with pytest.raises(ValueError, match="max_physical_batch"):
        get_engine(engine_name, max_physical_batch=0)


# -------------------------------------------------------------------------- no mutation


def _snapshot(model: nn.Module):
    return {
        "state": copy.deepcopy(model.state_dict()),
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "param_attrs": {n: sorted(vars(p)) for n, p in model.named_parameters()},
        "module_attrs": {n: sorted(vars(m)) for n, m in model.named_modules()},
        "training": {n: m.training for n, m in model.named_modules()},
        "hooks": {n: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
                  for n, m in model.named_modules()},
    }


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if k in ("state", "grads"):
            for n in a[k]:
                if a[k][n] is None:
                    assert b[k][n] is None, (k, n)
                else:
                    assert torch.equal(a[k][n], b[k][n]), (k, n)
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("engine_name", sorted(ENGINES))
def test_model_is_not_mutated(engine_name, mode):
    model, x, y = CASES["frozen"].make(5)
    model.train(mode == "train")
    model[4].bias.grad = torch.full_like(model[4].bias, 3.0)  # a pre-existing .grad stays as it is
    before = _snapshot(model)
    engine = get_engine(engine_name, max_physical_batch=2)
    wfn = clip_weights(0.5) if engine.per_example else None
    res = engine.compute(model, ce, x, y, wfn, ParamGroups.per_layer(model))
    _assert_same(before, _snapshot(model))
    assert model[0].weight.grad is None
    assert all(not g.requires_grad for g in res.grads.values())
    assert any(g.abs().max() > 0 for g in res.grads.values())


@pytest.mark.parametrize("engine_name", sorted(ENGINES))
def test_model_without_trainable_parameters(engine_name):
    model, x, y = CASES["linear"].make(5)
    model.requires_grad_(False)
    groups = ParamGroups.flat(model)
    assert groups.members == ((),)
    engine = get_engine(engine_name, max_physical_batch=2)
    res = engine.compute(model, ce, x, y, clip_weights(1.0) if engine.per_example else None, groups)
    assert res.grads == {}
    with torch.no_grad():
        assert res.loss_sum == pytest.approx(float(ce(model(x), y).sum()), rel=1e-12)
    if engine.per_example:
        assert res.norms.dtype == DT and res.norms.shape == (5,) and not res.norms.any()
        assert torch.equal(res.weights, torch.ones(5, dtype=DT))
