"""Clipping units (IC / BC / GBC), per-layer noise, adaptive layerwise clipping in training,
BatchNorm handling (algorithms.md M11, M12)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dpclip.clipping import StepContext, make_strategy
from dpclip.engine import ParamGroups, get_engine
from dpclip.events import GaussianEvent, PoissonSampledEvent, SampledWithoutReplacementEvent
from dpclip.models import build_model
from dpclip.noise import make_generator
from dpclip.training.sampling import FixedSizeSampler, PoissonSampler
from dpclip.training.step import dp_step
from dpclip.training.trainer import TrainConfig, train
from dpclip.training.units import (
    MiniSetSampler,
    UnitConfig,
    frozen_bn_buffers,
    public_unit_norms,
    recompute_bn_stats,
    unit_sum,
)


def ce(out, y):
    return nn.functional.cross_entropy(out, y, reduction="none")


def bn_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.Tanh(), nn.Flatten(),
        nn.Linear(3 * 4 * 4, 5), nn.ReLU(), nn.Linear(5, 4),
    ).double()


def flat(grads, model):
    return torch.cat([grads[n].flatten() for n, _ in model.named_parameters()])


def data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 1, 6, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 4, (n,), generator=g))


# -- mini-set sampler -----------------------------------------------------------------------------

def test_miniset_sampler_partition_and_event():
    s = MiniSetSampler(103, 10, 3, partition_seed=7)
    part = s.partition
    assert part.shape == (10, 10)  # N // s mini-sets of exactly s; 3 left-over examples unused
    assert len(set(part.flatten().tolist())) == 100
    assert torch.equal(part, MiniSetSampler(103, 10, 3, partition_seed=7).partition)
    assert not torch.equal(part, MiniSetSampler(103, 10, 3, partition_seed=8).partition)
    idx = s.sample(make_generator(0))
    assert idx.shape == (3, 10)
    rows = {tuple(r.tolist()) for r in part}
    assert all(tuple(r.tolist()) in rows for r in idx)  # whole mini-sets are drawn
    assert s.sample_rate == pytest.approx(0.3) and s.expected_units == 3.0
    assert s.expected_batch_size == 30.0 and s.steps_per_epoch == 3
    ev = s.step_event(GaussianEvent(1.0))
    assert ev == SampledWithoutReplacementEvent(10, 3, GaussianEvent(1.0))
    with pytest.raises(ValueError, match="fewer than"):
        MiniSetSampler(20, 10, 3)


def test_unit_config_validation():
    assert UnitConfig.pop_from({"unit": "gbc", "miniset_size": "8", "clip_norm": 1})[0] == \
        UnitConfig("gbc", 8)
    with pytest.raises(ValueError, match="miniset_size"):
        UnitConfig("gbc")
    with pytest.raises(ValueError, match="unit=gbc"):
        UnitConfig("bc", 4)
    with pytest.raises(ValueError, match="clipping unit"):
        UnitConfig("xc")
    with pytest.raises(ValueError, match="bn_stats"):
        UnitConfig(bn_stats="running")


# -- the unit sum against a naive oracle ------------------------------------------------------------

@pytest.mark.parametrize("grouped", [False, True])
def test_unit_sum_matches_naive_mean_gradients(grouped):
    model = bn_model()
    x, y = data(12)
    xu, yu = x.view(3, 4, 1, 6, 6), y.view(3, 4)
    groups = ParamGroups.per_layer(model) if grouped else ParamGroups.flat(model)
    strat = make_strategy("per-layer" if grouped else "fixed",
                          {"clip_norm": 0.05} if not grouped else {"clip_norm": 0.05})
    if grouped:
        strat = strat.bind_groups(groups.names)
    state = strat.init_state()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res = unit_sum(model, ce, xu, yu, lambda n: strat.weights(n, state), groups)
    for k, v in model.state_dict().items():  # BatchNorm buffers restored
        assert torch.equal(v, before[k]), k
    # oracle: one mean-loss gradient per unit, norms per group, weighted sum
    params = dict(model.named_parameters())
    expect = {n: torch.zeros_like(p) for n, p in params.items()}
    for j in range(3):
        with frozen_bn_buffers(model):
            loss = ce(model(xu[j]), yu[j]).mean()
            gs = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
        norms = torch.stack([
            torch.sqrt(sum(gs[n].pow(2).sum() for n in mem)) for mem in groups.members])
        assert torch.allclose(res.norms[j], norms if grouped else norms[0], rtol=1e-10)
        w = strat.weights(norms[None] if grouped else norms, state)
        for gi, mem in enumerate(groups.members):
            for n in mem:
                expect[n] += (w[0, gi] if grouped else w[0]) * gs[n]
    for n in params:
        assert torch.allclose(res.grads[n], expect[n], rtol=1e-10, atol=1e-14), n


# -- neighbour sensitivity of BC / GBC (flat and per group) -----------------------------------------

def _unit_sum_flat(model, strat, state, xu, yu, groups):
    return unit_sum(model, ce, xu, yu, lambda n: strat.weights(n, state), groups).grads


@pytest.mark.parametrize("name", ["fixed", "auto-s", "psac", "per-layer", "alc", "alc-zhang"])
@pytest.mark.parametrize("k,s", [(1, 7), (3, 4)])  # BC (one unit of 7), GBC (3 mini-sets of 4)
def test_unit_neighbour_sensitivity(name, k, s):
    model = bn_model()
    strat = make_strategy(name, {})
    groups = ParamGroups.flat(model)
    if strat.norm_kind == "group":
        groups = ParamGroups.per_layer(model)
        strat = strat.bind_groups(groups.names)
    state = strat.init_state()
    if name.startswith("alc"):  # give the adaptive strategies unequal public ratios
        state = strat.public_refresh(state, torch.tensor([[0.01, 0.002, 0.03, 0.005]]))
    sens = strat.sensitivity(state)
    x, y = data(k * s, seed=1)
    x[2] *= 1e4  # adversarial: a huge example
    xu, yu = x.view(k, s, 1, 6, 6), y.view(k, s)
    full = _unit_sum_flat(model, strat, state, xu, yu, groups)
    worst = 0.0
    for i in range(k * s):
        x2 = x.clone()
        x2[i] = -x[(i + 1) % (k * s)] * 5
        rep = _unit_sum_flat(model, strat, state, x2.view(k, s, 1, 6, 6), yu, groups)
        diff = flat(full, model) - flat(rep, model)
        worst = max(worst, diff.norm().item())
        assert diff.norm().item() <= 2 * sens * (1 + 1e-9)
        if strat.norm_kind == "group":  # per block: at most 2 C_h
            for c, mem in zip(strat.thresholds(state), groups.members):
                d = torch.cat([(full[n] - rep[n]).flatten() for n in mem]).norm().item()
                assert d <= 2 * c * (1 + 1e-9)
    assert worst > 0.5 * sens  # the bound is exercised


def test_poisson_bc_add_remove_sensitivity():
    model = bn_model()
    strat = make_strategy("fixed", {"clip_norm": 0.3})
    groups, state = ParamGroups.flat(model), {}
    x, y = data(9, seed=2)
    full = _unit_sum_flat(model, strat, state, x[None], y[None], groups)
    for i in range(9):
        keep = [j for j in range(9) if j != i]
        rem = _unit_sum_flat(model, strat, state, x[keep][None], y[keep][None], groups)
        assert (flat(full, model) - flat(rem, model)).norm().item() <= 2 * 0.3 * (1 + 1e-9)
    # an empty unit contributes zero
    empty = _unit_sum_flat(model, strat, state, x[:0][None], y[:0][None], groups)
    assert flat(empty, model).abs().max().item() == 0.0


# -- the step: divisor, sensitivity factor, per-layer noise ----------------------------------------

def _ctx(z=1.0, units=1.0):
    return StepContext(step=0, epoch=0, steps_per_epoch=10, total_steps=10,
                       expected_batch_size=units, base_noise_multiplier=z)


def test_bc_step_noise_is_2c_sigma_and_not_divided():
    model = bn_model()
    strat = make_strategy("fixed", {"clip_norm": 0.5})
    sampler = FixedSizeSampler(100, 8)
    x, y = data(8)
    zero_noise = dp_step(model, x[None], y[None], loss_fn=ce, strategy=strat, state={},
                         engine=get_engine("vmap"), groups=ParamGroups.flat(model),
                         sampler=sampler, base_noise_multiplier=0.0, ctx=_ctx(0.0),
                         generator=make_generator(0), unit=UnitConfig("bc"))
    clipped = unit_sum(model, ce, x[None], y[None], lambda n: strat.weights(n, {}),
                       ParamGroups.flat(model))
    assert torch.allclose(flat(zero_noise.grads, model), flat(clipped.grads, model))  # / 1 unit
    out = dp_step(model, x[None], y[None], loss_fn=ce, strategy=strat, state={},
                  engine=get_engine("vmap"), groups=ParamGroups.flat(model), sampler=sampler,
                  base_noise_multiplier=3.0, ctx=_ctx(3.0), generator=make_generator(0),
                  unit=UnitConfig("bc"))
    assert out.sensitivity == 1.0  # 2 C
    assert out.event == SampledWithoutReplacementEvent(100, 8, GaussianEvent(3.0))
    noise = flat(out.grads, model) - flat(clipped.grads, model)
    assert noise.std().item() == pytest.approx(3.0 * 1.0, rel=0.2)  # z * 2C, 143 coordinates


def test_per_layer_noise_std_per_block_and_event():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 50), nn.Tanh(), nn.Linear(50, 60), nn.Tanh(),
                          nn.Linear(60, 30))
    groups = ParamGroups.per_layer(model)
    strat = make_strategy("per-layer", {"clip_norm": 1.0, "noise": "per-layer",
                                        "ratios": "1,2,4"}).bind_groups(groups.names)
    state = strat.init_state()
    assert strat.thresholds(state) == [1.0, 2.0, 4.0]
    sampler = PoissonSampler(1000, 10)
    empty_x, empty_y = torch.zeros(0, 40), torch.zeros(0, dtype=torch.long)
    out = dp_step(model, empty_x, empty_y, loss_fn=ce, strategy=strat, state=state,
                  engine=get_engine("vmap"), groups=groups, sampler=sampler,
                  base_noise_multiplier=1.5, ctx=_ctx(1.5, 10.0), generator=make_generator(1))
    # Nguyen LC: block h gets sigma * C_h; the step is accounted as Gaussian(sigma / sqrt(L))
    assert out.event == PoissonSampledEvent(0.01, GaussianEvent(1.5 / math.sqrt(3)))
    for c, mem in zip([1.0, 2.0, 4.0], groups.members):
        block = torch.cat([out.grads[n].flatten() for n in mem]) * 10.0  # undo the divisor
        assert block.std().item() == pytest.approx(1.5 * c, rel=0.1)
    # flat noise: every coordinate gets z * S with S = sqrt(sum C_h^2)
    flat_strat = make_strategy("per-layer", {"clip_norm": 1.0, "ratios": "1,2,4"}).bind_groups(
        groups.names)
    out = dp_step(model, empty_x, empty_y, loss_fn=ce, strategy=flat_strat,
                  state=flat_strat.init_state(), engine=get_engine("vmap"), groups=groups,
                  sampler=sampler, base_noise_multiplier=1.5, ctx=_ctx(1.5, 10.0),
                  generator=make_generator(1))
    assert out.event == PoissonSampledEvent(0.01, GaussianEvent(1.5))
    assert (flat(out.grads, model) * 10).std().item() == pytest.approx(1.5 * math.sqrt(21),
                                                                       rel=0.1)


def test_per_layer_default_split_and_ratio_validation():
    s = make_strategy("per-layer", {"clip_norm": 2.0}).bind_groups(["a", "b", "c", "d"])
    assert s.thresholds(s.init_state()) == pytest.approx([1.0] * 4)  # C / sqrt(L)
    assert s.sensitivity(s.init_state()) == pytest.approx(2.0)
    p = make_strategy("per-layer", {"clip_norm": 2.0, "noise": "per-layer"}).bind_groups("abcd")
    assert p.thresholds(p.init_state()) == [2.0] * 4 and p.noise_multiplier({}, 2.0) == 1.0
    with pytest.raises(ValueError, match="one ratio per group"):
        make_strategy("per-layer", {"ratios": "1,2"}).bind_groups("abc")
    with pytest.raises(ValueError, match=r"shape \(B, 3\)"):
        s3 = make_strategy("per-layer", {}).bind_groups("abc")
        s3.weights(torch.ones(4, 2), s3.init_state())
    with pytest.raises(ValueError, match="noise"):
        make_strategy("per-layer", {"noise": "layer"})


def test_alc_refresh_from_public_norms_matches_naive_oracle():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    groups = ParamGroups.per_layer(model)
    x = torch.randn(20, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (20,))
    norms = public_unit_norms(model, ce, x, y, groups, UnitConfig("ic"), 1)
    params = dict(model.named_parameters())
    e = torch.zeros(2, dtype=torch.float64)
    for i in range(20):
        gs = dict(zip(params, torch.autograd.grad(ce(model(x[i:i + 1]), y[i:i + 1]).sum(),
                                                  list(params.values()))))
        for gi, mem in enumerate(groups.members):
            e[gi] += torch.sqrt(sum(gs[n].pow(2).sum() for n in mem)) / 20
    alc = make_strategy("alc", {"clip_norm": 0.3}).bind_groups(groups.names)
    st = alc.public_refresh(alc.init_state(), norms)
    assert st["public_means"] == pytest.approx(e.tolist(), rel=1e-9)
    expect = [0.3 * float(v / e.max()) for v in e]
    assert alc.thresholds(st) == pytest.approx(expect, rel=1e-9)
    assert max(alc.thresholds(st)) == pytest.approx(0.3)  # the largest block gets C
    zhang = make_strategy("alc-zhang", {}).bind_groups(groups.names)
    assert zhang.thresholds(zhang.public_refresh(zhang.init_state(), norms)) == pytest.approx(
        e.tolist(), rel=1e-9)
    # BC units: norms of public mini-set mean gradients (4 units of 5)
    bc = public_unit_norms(model, ce, x, y, groups, UnitConfig("bc"), 5)
    assert bc.shape == (4, 2)
    g0 = torch.autograd.grad(ce(model(x[:5]), y[:5]).mean(), list(params.values()))
    assert bc[0, 1] == pytest.approx(torch.sqrt(sum(g.pow(2).sum() for g in g0[2:])).item())


def test_exp_decay_over_alc():
    s = make_strategy("exp-decay", {"base": "alc", "clip_norm": 1.0, "rate": 0.5})
    s = s.bind_groups(["a", "b"])
    st = s.init_state()
    for epoch, c in [(0, 1.0), (1, 0.5), (3, 0.125)]:
        ctx = StepContext(step=epoch * 10, epoch=epoch, steps_per_epoch=10, total_steps=100,
                          expected_batch_size=8.0, base_noise_multiplier=1.0)
        st = s.begin_step(st, ctx)
        assert st["clip_norm"] == c
        assert s.sensitivity(st) == pytest.approx(c * math.sqrt(2))
    assert s.group_noise(st) == pytest.approx((0.125 * math.sqrt(2),) * 2)
    assert s.noise_multiplier(st, 2.0) == pytest.approx(2.0 / math.sqrt(2))


def test_param_groups_from_spec():
    model = build_model("bn-lenet5", (1, 28, 28), 10)
    g = ParamGroups.from_spec(model, "conv1,bn1,conv2,bn2;conv3,bn3;fc1,fc2")
    assert len(g) == 3 and g.members[2] == ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
    assert len(ParamGroups.from_spec(model, "layer")) == 8
    assert len(ParamGroups.from_spec(model, "parameter")) == 16
    with pytest.raises(ValueError, match="matches no group"):
        ParamGroups.from_spec(model, "conv1;fc1")


# -- BatchNorm -------------------------------------------------------------------------------------

def test_bn_running_stats_recomputed_on_public_data_only():
    model = bn_model()
    x, _ = data(50)
    recompute_bn_stats(model, x, chunk=50)
    bn = model[1]
    with torch.no_grad():
        h = model[0](x)
    assert torch.allclose(bn.running_mean, h.mean(dim=(0, 2, 3)), atol=1e-12)
    assert bn.momentum == 0.1 and model.training


BASE = dict(dataset="synthetic", dataset_options={"image_shape": (1, 28, 28), "n_train": 320,
                                                  "n_test": 64},
            model="bn-lenet5", epochs=2, batch_size=32, lr=0.05, noise_multiplier=0.8,
            sampling="fixed-size", accountant="rdp")


def test_batchnorm_refused_under_individual_clipping():
    with pytest.raises(ValueError) as exc:
        train(TrainConfig(**BASE, strategy="fixed"), progress=False)
    msg = str(exc.value)
    assert "'bn1'" in msg and "GroupNorm" in msg and "unit=bc" in msg


def test_gbc_needs_fixed_size_and_a_multiple_batch():
    with pytest.raises(ValueError, match="fixed-size"):
        train(TrainConfig(**{**BASE, "sampling": "poisson", "accountant": "pld"},
                          strategy="fixed", strategy_params={"unit": "gbc", "miniset_size": 8}),
              progress=False)
    with pytest.raises(ValueError, match="multiple of miniset_size"):
        train(TrainConfig(**BASE, strategy="fixed",
                          strategy_params={"unit": "gbc", "miniset_size": 5}), progress=False)


def test_bc_training_never_writes_private_statistics_into_batchnorm():
    res = train(TrainConfig(**BASE, strategy="fixed",
                            strategy_params={"unit": "bc", "bn_stats": "batch"}), progress=False)
    for name, buf in res.model.state_dict().items():
        if name.endswith("running_mean"):
            assert torch.equal(buf, torch.zeros_like(buf)), name
        if name.endswith("running_var"):
            assert torch.equal(buf, torch.ones_like(buf)), name
    s = res.summary
    assert s["unit"] == {"unit": "bc"} and s["sensitivity_factor"] == 2
    assert s["bn_stats"] == "batch" and s["public_examples"] == 0
    assert s["engine"] == "unit"


def test_alc_bc_run_resumes_with_identical_ledger(tmp_path):
    cfg = TrainConfig(**BASE, strategy="alc", strategy_params={"unit": "bc", "clip_norm": 0.5},
                      reproducible_noise=True)  # the uninterrupted run replays the same noise
    full = train(cfg, progress=False)
    # (each example public or private on its own since review 206: about a tenth public)
    pub, priv = full.summary["public_examples"], full.summary["private_examples"]
    assert pub + priv == 320 and 16 <= pub <= 48
    assert full.summary["clip_groups"] == 8 and full.summary["bn_stats"] == "public"
    # event: fixed-size over the private examples, multiplier sigma / sqrt(8)
    ev = full.ledger.to_dict()
    assert str(priv) in str(ev) and str(0.8 / math.sqrt(8))[:10] in str(ev)
    part = train(cfg, progress=False, checkpoint_dir=tmp_path, stop_after_steps=13)
    assert part.summary.get("interrupted")
    resumed = train(cfg, progress=False, checkpoint_dir=tmp_path)
    assert resumed.summary["epsilon"] == full.summary["epsilon"]
    assert resumed.ledger.to_dict() == full.ledger.to_dict()
    for (n, a), (_, b) in zip(full.model.state_dict().items(),
                              resumed.model.state_dict().items()):
        assert torch.allclose(a.float(), b.float()), n


def test_per_layer_calibrates_to_target_epsilon():
    cfg = TrainConfig(**{**BASE, "model": "lenet5", "noise_multiplier": None, "epsilon": 4.0},
                      strategy="per-layer", strategy_params={"noise": "per-layer"})
    res = train(cfg, progress=False)
    assert res.summary["epsilon"] <= 4.0 + 1e-6
    assert res.summary["epsilon"] == pytest.approx(4.0, rel=0.02)
    # the event multiplier is the calibrated sigma / sqrt(L), L = 5 for LeNet-5
    z = res.summary["noise_multiplier"]
    assert str(round(z / math.sqrt(5), 6))[:7] in str(res.ledger.to_dict())


def test_alc_on_a_one_group_model_reads_the_engines_flat_norms():
    """With one clipping group the engines give flat ``(B,)`` norms (ParamGroups' convention);
    ALC (L = 1) used to refuse them under batch clipping ("expected ... (B, 1), got (1,)"). The
    flat path gives the same weights and refresh as the ``(B, 1)`` one."""
    s = make_strategy("alc", {"clip_norm": 0.5}).bind_groups(("fc",))
    state = s.init_state()
    norms = torch.tensor([0.1, 0.5, 2.0, float("inf")], dtype=torch.float64)
    torch.testing.assert_close(s.weights(norms, state), s.weights(norms[:, None], state)[:, 0])
    assert s.weights(norms, state).shape == (4,)
    assert s.public_refresh(state, norms[:3]) == s.public_refresh(state, norms[:3, None])
    cfg = TrainConfig(dataset="digits", model="logreg", strategy="alc", unit="bc",
                      noise_multiplier=1.0, epochs=1, batch_size=64, lr=0.1, delta=1e-5)
    res = train(cfg, progress=False)
    assert res.summary["steps"] > 0
