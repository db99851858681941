"""Threshold schedules (yu-linear, lin-decay, du-dynamic): trajectories, composition, parsing."""

import dataclasses
import json
import math
from typing import ClassVar

import pytest
import torch

from dpclip.accounting import epsilon as ledger_epsilon
from dpclip.clipping import STRATEGIES, FixedClip, StepContext, make_strategy
from dpclip.clipping.capabilities import Capabilities
from dpclip.clipping.normalize import PSAC, AutoS, AutoV
from dpclip.clipping.schedules import (
    DuDynamic,
    LinDecay,
    YuLinear,
    du_decay,
    yu_linear_scale,
    yu_reciprocal_scale,
)
from dpclip.events import GaussianEvent, PoissonSampledEvent
from dpclip.training.trainer import TrainConfig, train
from tests.clipping.contract import FakeRelease, check_weight_bound

F64 = torch.float64
INNERS = [FixedClip(0.7), AutoS(0.7, gamma=0.05), AutoV(0.7), PSAC(0.7, r=0.1)]
WRAPPERS = [
    lambda inner: YuLinear(inner, variant="reciprocal"),
    lambda inner: YuLinear(inner, variant="linear", granularity="step"),
    lambda inner: LinDecay(inner, a=0.5),
    lambda inner: DuDynamic(inner, granularity="step"),
    lambda inner: DuDynamic(inner),
]


def ctx(step, spe=10, total=100, base=1.0):
    return StepContext(step=step, epoch=step // spe, steps_per_epoch=spe, total_steps=total,
                       expected_batch_size=16.0, base_noise_multiplier=base)


def at(strategy, step, **kw):
    return strategy.begin_step(strategy.init_state(), ctx(step, **kw))


# --- Yu -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("u, rec, lin", [(0, 1.0, 1.0), (0.5, 1 / 1.5, 0.75), (1, 0.5, 0.5),
                                         (2, 0.5, 0.5)])
def test_yu_scales(u, rec, lin):
    assert yu_reciprocal_scale(u) == pytest.approx(rec, rel=1e-15)
    assert yu_linear_scale(u) == pytest.approx(lin, rel=1e-15)


@pytest.mark.parametrize("granularity", ["epoch", "step"])
@pytest.mark.parametrize("variant, expected", [("reciprocal", [2.0, 2 / 1.5, 1.0, 1.0]),
                                               ("linear", [2.0, 1.5, 1.0, 1.0])])
def test_yu_thresholds_at_progress_0_half_1_2(variant, expected, granularity):
    s = YuLinear(FixedClip(2.0), variant=variant, granularity=granularity)
    # spe=10, total=100 (10 epochs): steps 0, 50, 100, 200 are u = 0, 0.5, 1, 2 either way
    got = [s.sensitivity(at(s, t)) for t in (0, 50, 100, 200)]
    assert got == pytest.approx(expected, rel=1e-15)
    assert [at(s, t)["progress"] for t in (0, 50, 100, 200)] == [0, 0.5, 1, 2]


def test_yu_epoch_granularity_is_constant_inside_an_epoch():
    s = YuLinear(FixedClip(1.0))
    inside = {s.sensitivity(at(s, t)) for t in range(30, 40)}
    assert len(inside) == 1
    assert s.sensitivity(at(s, 40)) < s.sensitivity(at(s, 39))
    step = YuLinear(FixedClip(1.0), granularity="step")
    assert len({step.sensitivity(at(step, t)) for t in range(30, 40)}) == 10
    # last epoch of a 10-epoch plan: u = 9/10
    assert s.sensitivity(at(s, 95)) == pytest.approx(1 / 1.9, rel=1e-15)


# --- Lin ------------------------------------------------------------------------------------------

def test_t12_lin_decay():
    s = LinDecay(FixedClip(1.0), a=0.5)
    got = {t: s.sensitivity(at(s, 10 * (t - 1))) for t in (1, 4, 9)}  # epoch index t from 1
    assert got[1] == 1.0 and got[4] == pytest.approx(0.5, rel=1e-15)
    assert got[9] == pytest.approx(1 / 3, rel=1e-15) and round(got[9], 3) == 0.333
    assert at(s, 85)["epoch"] == 9
    assert s.init_state()["epoch"] == 1 and s.sensitivity(s.init_state()) == 1.0
    assert LinDecay(FixedClip(2.0), a=1.0).sensitivity(at(s, 30)) == pytest.approx(0.5)


# --- Du -------------------------------------------------------------------------------------------

def test_du_trajectory_at_start_and_end():
    s = DuDynamic(FixedClip(1.5), clip_final_over_initial=0.5, noise_final_over_initial=0.7,
                  granularity="step")
    base = 3.1643  # T10: sigma_0
    st0 = at(s, 0, base=base)
    assert s.sensitivity(st0) == 1.5 and s.noise_multiplier(st0, base) == base
    stT = at(s, 100, base=base)  # t = T
    assert s.sensitivity(stT) == pytest.approx(0.75, rel=1e-14)
    assert s.noise_multiplier(stT, base) == pytest.approx(2.2150, abs=5e-5)  # T10: sigma_T
    assert s.noise_multiplier(stT, base) / base == pytest.approx(0.7, rel=1e-14)
    mid = at(s, 50, base=base)
    assert s.sensitivity(mid) == pytest.approx(1.5 * 0.5**0.5, rel=1e-14)
    assert s.noise_multiplier(mid, base) == pytest.approx(base * 0.7**0.5, rel=1e-14)


def test_du_epoch_granularity_holds_values_inside_an_epoch():
    s = DuDynamic(FixedClip(1.0))  # epoch granularity (default)
    states = [at(s, t, base=2.0) for t in range(20, 30)]
    assert len({(s.sensitivity(x), s.noise_multiplier(x, 2.0)) for x in states}) == 1
    assert states[0]["position"] == 20  # the global step at the start of the epoch
    assert s.noise_multiplier(states[0], 2.0) == 2.0 * 0.7 ** 0.2
    nxt = at(s, 30, base=2.0)
    assert s.noise_multiplier(nxt, 2.0) < s.noise_multiplier(states[-1], 2.0)
    assert s.sensitivity(nxt) < s.sensitivity(states[-1])
    step = DuDynamic(FixedClip(1.0), granularity="step")
    assert len({step.noise_multiplier(at(step, t), 1.0) for t in range(20, 30)}) == 10


@pytest.mark.parametrize("granularity", ["epoch", "step"])
def test_du_planned_event_equals_emitted_exactly(granularity):
    s = DuDynamic(AutoS(1.0), granularity=granularity)
    base, state = 1.2345678901234567, s.init_state()
    for t in range(0, 37):
        c = ctx(t, spe=7, total=37, base=base)
        state = s.begin_step(state, c)
        z = s.noise_multiplier(state, base)
        state, events = s.update(state, torch.ones(3, dtype=F64), c, FakeRelease())
        assert events == ()
        assert s.planned_event(base, c) == GaussianEvent(z)  # exact float equality
        assert z == base * du_decay(0.7, s.position(c), 37)
        state = json.loads(json.dumps(state))  # checkpoints round-trip exactly


def test_du_rejects_increasing_ratios_with_the_convention_hint():
    with pytest.raises(ValueError, match=r"noise_final_over_initial .*\(0, 1\].*1/rho"):
        DuDynamic(noise_final_over_initial=1.4)
    with pytest.raises(ValueError, match="clip_final_over_initial"):
        DuDynamic(clip_final_over_initial=2.0)
    with pytest.raises(ValueError, match="clip_final_over_initial"):
        DuDynamic(clip_final_over_initial=0)
    with pytest.raises(ValueError, match="granularity"):
        DuDynamic(granularity="batch")


# --- composition with every inner -----------------------------------------------------------------

@pytest.mark.parametrize("wrap", WRAPPERS, ids=["yu", "yu-lin-step", "lin", "du-step", "du"])
@pytest.mark.parametrize("inner", INNERS, ids=lambda s: s.name)
def test_wrappers_compose_with_every_inner(wrap, inner):
    s = wrap(inner)
    assert s.norm_kind == inner.norm_kind and s.initial_clip_norm == 0.7
    n = torch.tensor([0.0, 1e-6, 0.05, 0.3, 0.7, 2.0, 1e6, math.inf], dtype=F64)
    thresholds = []
    for t in (0, 35, 99, 150):
        state = at(s, t)
        c = state["clip_norm"]
        thresholds.append(c)
        ref = dataclasses.replace(inner, clip_norm=c)
        assert torch.equal(s.weights(n, state), ref.weights(n, {}))
        assert s.sensitivity(state) == ref.sensitivity({}) == c
        w = s.weights(n, state)
        assert torch.isfinite(w).all() and w[-1] == 0
        assert (torch.where(w == 0, 0.0, w * n) <= c * (1 + 1e-12)).all()
        bound_check = dataclasses.replace(s, inner=ref)  # contract bound at this threshold
        check_weight_bound(bound_check)
    assert thresholds[0] == 0.7 and thresholds[-1] < thresholds[0]
    assert thresholds == sorted(thresholds, reverse=True)


@dataclasses.dataclass(frozen=True)
class _StateDriven(FixedClip):
    """A strategy whose live threshold is in its state: clip_norm is only the initial value."""

    def init_state(self):
        return {"c": self.clip_norm}

    def weights(self, norms, state):
        return torch.clamp(state["c"] / (norms + 1e-6), max=1.0)

    def sensitivity(self, state):
        return state["c"]


def test_wrappers_refuse_inners_without_a_threshold():
    with pytest.raises(ValueError, match="no clip_norm field.*wrap one of: .*auto-s.*fixed"):
        YuLinear(inner=LinDecay())
    with pytest.raises(TypeError, match="clipping-strategy instance"):
        DuDynamic(inner=FixedClip)  # the class, not an instance
    with pytest.raises(ValueError, match="does not follow its clip_norm field"):
        LinDecay(inner=_StateDriven(1.0))

    @dataclasses.dataclass(frozen=True)
    class _PerExampleTransform(FixedClip):  # P-GRAD hooks are not forwarded by a schedule
        capabilities: ClassVar[Capabilities] = Capabilities(per_example_grads=True)

    with pytest.raises(ValueError, match="transformed per-example gradients"):
        YuLinear(inner=_PerExampleTransform(1.0))


@pytest.mark.parametrize("name", ["yu-linear", "lin-decay", "du-dynamic"])
def test_schedules_change_per_sample_scaling_vs_fixed(name):
    # anchors P13: later in the run the wrapper clips where fixed clipping at C0 does not
    s = make_strategy(name, {"clip_norm": 1.0})
    n = torch.tensor([0.2, 0.9, 4.0], dtype=F64)
    fixed = FixedClip(1.0).weights(n, {})
    late = s.weights(n, at(s, 90))
    assert torch.equal(s.weights(n, s.init_state()), fixed)
    assert late[1] < 0.9 * fixed[1] and late[2] < 0.9 * fixed[2]
    assert s.sensitivity(at(s, 90)) < 0.8


# --- parsing --------------------------------------------------------------------------------------

def test_make_strategy_parses_cli_strings():
    s = make_strategy("yu-linear", {"base": "auto-s", "clip_norm": "1.0", "base.gamma": "0.05",
                                    "variant": "linear"})
    assert s == YuLinear(AutoS(1.0, 0.05), variant="linear", granularity="epoch")
    d = make_strategy("du-dynamic", {"base": "psac", "base.r": "0.01", "clip_norm": "1.5",
                                     "noise_final_over_initial": "0.8", "granularity": "step"})
    assert d == DuDynamic(PSAC(1.5, 0.01), 0.5, 0.8, "step")
    assert make_strategy("lin-decay", {"a": 0.25}) == LinDecay(FixedClip(1.0), 0.25)
    assert make_strategy("yu-linear", {}) == YuLinear(FixedClip(1.0))


@pytest.mark.parametrize("name", ["yu-linear", "lin-decay", "du-dynamic"])
def test_describe_names_the_inner_and_round_trips(name):
    s = make_strategy(name, {"base": "auto-s", "clip_norm": "0.3", "base.gamma": "0.2"})
    d = s.describe()
    assert d["base"] == "auto-s" and d["clip_norm"] == 0.3 and d["base.gamma"] == 0.2
    assert json.loads(json.dumps(d)) == d
    assert make_strategy(name, d) == s


@pytest.mark.parametrize(
    "params, match",
    [({"base": "nope"}, r"base='nope' cannot be wrapped; valid bases .*auto-s, auto-v, fixed"),
     ({"base": "lin-decay"}, "cannot be wrapped"),
     ({"gamma": "0.1"}, r"no parameter\(s\) \['gamma'\]; valid parameters: base, clip_norm, "
                        r"variant, granularity"),
     ({"base": "auto-s", "base.gama": "1"},
      r"\['base.gama'\]; valid parameters: base, clip_norm, base.gamma, variant"),
     ({"base.clip_norm": "1"}, "clip_norm=..., not base.clip_norm"),
     ({"variant": "cubic"}, "unknown variant 'cubic'; valid: 'reciprocal', 'linear'"),
     ({"clip_norm": "-1"}, "clip_norm must be"),
     ({"base": "auto-s", "base.gamma": "zero"}, "gamma")],
)
def test_make_strategy_errors(params, match):
    with pytest.raises(ValueError, match=match):
        make_strategy("yu-linear", params)


def test_lin_decay_parameter_errors():
    with pytest.raises(ValueError, match="LinDecay: a must"):
        LinDecay(a=1.5)
    with pytest.raises(ValueError, match="a must"):
        make_strategy("lin-decay", {"a": "0"})


def test_registered_as_norm_strategies():
    for name, cls in (("yu-linear", YuLinear), ("lin-decay", LinDecay), ("du-dynamic", DuDynamic)):
        e = STRATEGIES[name]
        assert e.cls is cls and e.kind == "norm" and e.paper and hasattr(cls, "from_params")


# --- end to end -----------------------------------------------------------------------------------

def test_du_dynamic_trains_to_the_target_epsilon_with_heterogeneous_noise():
    cfg = TrainConfig(dataset="synthetic", model="mlp", strategy="du-dynamic",
                      strategy_params={"clip_norm": "1.0"}, epsilon=2.0, delta=1e-5, epochs=2,
                      batch_size=64, lr=0.5, optimizer="momentum", seed=0)
    res = train(cfg, progress=False)
    s = res.summary
    assert s["epsilon"] <= 2.0 + 1e-9 and s["epsilon"] >= 2.0 - 1e-3
    assert s["steps"] == s["planned_steps"] == 16 and not s["stopped_by_budget"]
    assert s["params"]["base"] == "fixed"
    entries = res.ledger.entries
    assert len(entries) == 2 and [n for _, n in entries] == [8, 8]  # one event per epoch
    zs = [ev.event.noise_multiplier for ev, _ in entries]
    assert all(isinstance(ev, PoissonSampledEvent) for ev, _ in entries)
    z = s["noise_multiplier"]  # the calibrated base sigma_0
    assert zs == [z, z * 0.7 ** (8 / 16)]
    assert [h["clip_threshold"] for h in res.history] == pytest.approx([1.0, 0.5 ** (8 / 16)])
    assert ledger_epsilon(res.ledger, 1e-5, accountant="pld") == s["epsilon"]
