"""Float64 parity of the vmap engine (and the naive engine) with the naive per-example loop."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dpclip.engine import NaiveEngine, ParamGroups, VmapEngine, naive_per_example_grads
from dpclip.engine import vmap_per_example_grads
from tests.engine.helpers import (
    CASES,
    DT,
    GROUPINGS,
    assert_close,
    assert_grads_close,
    auto_s_weights,
    ce,
    clip_weights,
    oracle_norms,
    oracle_sum,
)

BATCHES = [0, 1, 7]


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_per_example_grads_match_naive(case, batch):
    model, x, y = CASES[case].make(batch)
    expected = naive_per_example_grads(model, CASES[case].loss_fn, x, y)
    got = vmap_per_example_grads(model, CASES[case].loss_fn, x, y, max_physical_batch=3)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(expected) == trainable
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert expected[n].shape == (batch, *p.shape)
    assert_grads_close(got, expected)


def test_naive_grads_are_per_example():
    """The oracle itself: example i's gradient equals a fresh backward on example i alone."""
    model, x, y = CASES["conv_groupnorm"].make(3)
    per_ex = naive_per_example_grads(model, ce, x, y)
    for i in range(3):
        model.zero_grad()
        ce(model(x[i : i + 1]), y[i : i + 1]).sum().backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(per_ex[n][i], p.grad, rtol=0, atol=0)
    # ... and the per-example grads sum to the batch gradient of the summed loss
    model.zero_grad()
    ce(model(x), y).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(per_ex[n].sum(0), p.grad, rtol=1e-12, atol=1e-14)


def _weight_fns(groups: ParamGroups, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    c = 0.05 + torch.rand(len(groups), generator=g, dtype=DT)
    c = c[0] if groups.is_flat else c  # per-group thresholds broadcast over (B, G)
    return {"clip": clip_weights(c), "auto_s": auto_s_weights(c)}


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("grouping", sorted(GROUPINGS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_vmap_norms_and_weighted_sum_match_oracle(case, grouping, batch):
    _check_engine_against_oracle(VmapEngine(max_physical_batch=4), case, grouping, batch)


@pytest.mark.parametrize("case", sorted(CASES))
def test_naive_engine_matches_oracle(case):
    _check_engine_against_oracle(NaiveEngine(max_physical_batch=4), case, "custom", 7)


def _check_engine_against_oracle(engine, case, grouping, batch):
    c = CASES[case]
    model, x, y = c.make(batch, seed=batch)
    groups = GROUPINGS[grouping](model)
    per_ex = naive_per_example_grads(model, c.loss_fn, x, y)
    expected_norms = oracle_norms(per_ex, groups, batch)
    with torch.no_grad():
        expected_loss = float(c.loss_fn(model(x), y).sum()) if batch else 0.0
    for wname, wfn in _weight_fns(groups, seed=len(grouping)).items():
        seen = []

        def weight_fn(norms, wfn=wfn):
            seen.append(norms.clone())
            return wfn(norms)

        res = engine.compute(model, c.loss_fn, x, y, weight_fn, groups)
        shape = (batch,) if groups.is_flat else (batch, len(groups))
        assert res.norms.shape == shape and res.weights.shape == shape, wname
        assert_close(res.norms, expected_norms)
        assert torch.cat(seen).shape == shape
        assert_close(res.weights, wfn(expected_norms))
        assert_grads_close(res.grads, oracle_sum(per_ex, wfn(expected_norms), groups, batch))
        assert res.loss_sum == pytest.approx(expected_loss, rel=1e-10, abs=1e-12)
        if batch:
            assert any(float(v.abs().max()) > 0 for v in res.grads.values())


def test_groups_weights_apply_to_their_own_params():
    """Weight 1 on group 0 and 0 on group 1 keeps exactly group 0's plain sum."""
    model, x, y = CASES["linear"].make(5)
    groups = ParamGroups.per_layer(model)
    per_ex = naive_per_example_grads(model, ce, x, y)

    def weight_fn(n):
        w = torch.zeros_like(n)
        w[:, 0] = 1.0
        return w

    res = VmapEngine().compute(model, ce, x, y, weight_fn, groups)
    for n in groups.members[0]:
        assert_close(res.grads[n], per_ex[n].sum(0))
    for n in groups.members[1]:
        assert torch.equal(res.grads[n], torch.zeros_like(res.grads[n]))


@pytest.mark.parametrize("grouping", ["flat", "per_layer"])
def test_chunking_gives_the_same_result(grouping):
    model, x, y = CASES["conv_groupnorm"].make(7)
    groups = GROUPINGS[grouping](model)
    wfn = clip_weights(0.3)
    one = VmapEngine(max_physical_batch=256).compute(model, ce, x, y, wfn, groups)
    for size in (1, 2, 6, 7):
        many = VmapEngine(max_physical_batch=size).compute(model, ce, x, y, wfn, groups)
        assert_grads_close(many.grads, one.grads, rtol=1e-12)
        assert_close(many.norms, one.norms, rtol=1e-12)
        assert_close(many.weights, one.weights, rtol=1e-12)
        assert many.loss_sum == pytest.approx(one.loss_sum, rel=1e-12)


def test_eval_mode_dropout_model_matches_oracle():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 3)).to(DT).eval()
    x, y = torch.randn(6, 5, dtype=DT), torch.randint(0, 3, (6,))
    groups = ParamGroups.flat(model)
    per_ex = naive_per_example_grads(model, ce, x, y)
    res = VmapEngine().compute(model, ce, x, y, clip_weights(0.5), groups)
    expected = oracle_norms(per_ex, groups, 6)
    assert_close(res.norms, expected)
    assert_grads_close(res.grads, oracle_sum(per_ex, clip_weights(0.5)(expected), groups, 6))


def test_training_mode_dropout_draws_per_example_masks():
    """Dropout in training mode runs under vmap with an independent mask per example."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 64), nn.Dropout(0.5), nn.Linear(64, 1)).to(DT)
    x = torch.ones(2, 4, dtype=DT).expand(2, 4).contiguous()  # identical examples
    y = torch.zeros(2, 1, dtype=DT)
    per_ex = vmap_per_example_grads(model, lambda o, t: ((o - t) ** 2).sum(1), x, y)
    assert torch.isfinite(per_ex["2.weight"]).all()
    assert not torch.equal(per_ex["2.weight"][0], per_ex["2.weight"][1])


# ---------------------------------------------------------------- hypothesis: layer shape variety


@st.composite
def conv_configs(draw):
    groups = draw(st.sampled_from([1, 2, 3]))
    in_ch = groups * draw(st.integers(1, 2))
    out_ch = groups * draw(st.integers(1, 2))
    kernel = draw(st.integers(1, 3))
    stride = draw(st.integers(1, 2))
    padding = draw(st.integers(0, 2))
    dilation = draw(st.integers(1, 2))
    size = draw(st.integers(dilation * (kernel - 1) + 1, 7))
    batch = draw(st.integers(0, 5))
    bias = draw(st.booleans())
    return groups, in_ch, out_ch, kernel, stride, padding, dilation, size, batch, bias


@settings(max_examples=12, deadline=None)
@given(conv_configs(), st.integers(0, 2**16))
def test_conv2d_variety_matches_oracle(cfg, seed):
    groups, in_ch, out_ch, kernel, stride, padding, dilation, size, batch, bias = cfg
    torch.manual_seed(seed)
    conv = nn.Conv2d(in_ch, out_ch, kernel, stride=stride, padding=padding, dilation=dilation,
                     groups=groups, bias=bias)
    out_size = (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(out_ch * out_size**2, 3)).to(DT)
    x = torch.randn(batch, in_ch, size, size, dtype=DT)
    y = torch.randint(0, 3, (batch,))
    _check_against_oracle(model, x, y, ParamGroups.per_parameter(model), seed)


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 5), st.integers(1, 4), st.integers(1, 4), st.integers(0, 5),
       st.integers(0, 2**16))
def test_linear_sequence_variety_matches_oracle(seq_len, d_in, d_out, batch, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(d_in, d_out), nn.Tanh(), nn.Flatten(),
                          nn.Linear(seq_len * d_out, 3)).to(DT)
    x = torch.randn(batch, seq_len, d_in, dtype=DT)
    y = torch.randint(0, 3, (batch,))
    _check_against_oracle(model, x, y, ParamGroups.per_layer(model), seed)


def _check_against_oracle(model, x, y, groups, seed):
    batch = x.shape[0]
    per_ex = naive_per_example_grads(model, ce, x, y)
    expected = oracle_norms(per_ex, groups, batch)
    c = 0.1 + torch.rand(len(groups), generator=torch.Generator().manual_seed(seed), dtype=DT)
    wfn = clip_weights(c)
    res = VmapEngine(max_physical_batch=2).compute(model, ce, x, y, wfn, groups)
    assert_close(res.norms, expected)
    assert_grads_close(res.grads, oracle_sum(per_ex, wfn(expected), groups, batch))


def test_layer_under_two_names_is_left_intact_and_correct():
    """A module that appears twice in the model (``Sequential(shared, ..., Sequential(shared))``)
    plus weights tied across two modules: per-example gradients equal the naive loop, and the model
    still holds its own ``Parameter`` objects afterwards (``torch.func.functional_call`` in torch
    2.13 leaves such a shared layer holding plain tensors)."""
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    head = nn.Linear(4, 4, bias=False)
    tail = nn.Linear(4, 4, bias=False)
    tail.weight = head.weight  # tied across two modules
    model = nn.Sequential(shared, nn.Tanh(), nn.Sequential(shared, head), nn.Tanh(), tail).to(DT)
    before = {n: p for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 4, generator=g, dtype=DT), torch.randint(0, 4, (5,), generator=g)
    expected = naive_per_example_grads(model, ce, x, y)
    assert_grads_close(vmap_per_example_grads(model, ce, x, y, max_physical_batch=2), expected)
    res = VmapEngine().compute(model, ce, x, y, clip_weights(0.5), ParamGroups.flat(model))
    batch = x.shape[0]
    groups = ParamGroups.flat(model)
    norms = oracle_norms(expected, groups, batch)
    assert_close(res.norms, norms)
    assert_grads_close(res.grads, oracle_sum(expected, clip_weights(0.5)(norms), groups, batch))
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is p for n, p in before.items())
    assert all(isinstance(p, nn.Parameter) for p in (shared.weight, shared.bias, head.weight))
    assert tail.weight is head.weight
    with pytest.raises(RuntimeError, match="boom"):  # restored on error too
        vmap_per_example_grads(model, lambda o, t: (_ for _ in ()).throw(RuntimeError("boom")), x, y)
    assert all(dict(model.named_parameters())[n] is p for n, p in before.items())
