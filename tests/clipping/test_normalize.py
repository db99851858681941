"""Normalisation strategies: Auto-S / NSGD, Auto-V, DP-PSAC (closed forms, T6, T7, edge cases)."""

import math

import pytest
import torch

from dpclip.clipping import STRATEGIES, FixedClip, make_strategy
from dpclip.clipping.normalize import AUTO_V_MIN_NORM, PSAC, AutoS, AutoV
from tests.clipping.contract import check_nonfinite, check_weight_bound

F64 = torch.float64
N = torch.tensor([0.0, 1e-3, 0.05, 0.2162, 0.5, 1.0, 3.0, 1e3], dtype=F64)


def test_registered_with_paper():
    for name, cls in (("auto-s", AutoS), ("auto-v", AutoV), ("psac", PSAC)):
        entry = STRATEGIES[name]
        assert entry.cls is cls and entry.kind == "norm" and entry.paper
    assert STRATEGIES["auto-s"].parameters() == {"clip_norm": 1.0, "gamma": 0.01}
    assert STRATEGIES["auto-v"].parameters() == {"clip_norm": 1.0}
    assert STRATEGIES["psac"].parameters() == {"clip_norm": 1.0, "r": 0.1}


def test_auto_s_closed_form_and_sensitivity():
    s = AutoS(clip_norm=0.5, gamma=0.1)
    w = s.weights(N, {})
    assert torch.allclose(w, 0.5 / (N + 0.1), rtol=0, atol=1e-15)
    assert s.sensitivity({}) == 0.5
    finite = N[N < 1e3]
    assert (s.weights(finite, {}) * finite < 0.5).all()  # strict: w(n) n < C


def test_auto_v_closed_form_and_zero_norm():
    s = AutoV(clip_norm=2.0)
    w = s.weights(N, {})
    assert w[0].item() == 2.0 / AUTO_V_MIN_NORM and math.isfinite(w[0].item())
    assert torch.allclose(w[1:], 2.0 / N[1:], rtol=0, atol=1e-15)
    assert torch.allclose(w[1:] * N[1:], torch.full_like(N[1:], 2.0), rtol=1e-15)
    tiny = torch.tensor([1e-15, 1e-13], dtype=F64)  # below the floor: contribution < C
    assert (s.weights(tiny, {}) * tiny < 2.0).all()
    assert s.sensitivity({}) == 2.0


def test_psac_closed_form_and_sensitivity():
    s = PSAC(clip_norm=0.5, r=0.1)
    w = s.weights(N, {})
    assert torch.allclose(w, 0.5 / (N + 0.1 / (N + 0.1)), rtol=0, atol=1e-15)
    assert w[0].item() == pytest.approx(0.5)  # w(0) = C
    finite = N[N < 1e3]
    assert (w[: len(finite)] * finite < 0.5).all()
    assert s.sensitivity({}) == 0.5


@pytest.mark.parametrize("r, n_star, w_max", [(0.1, 0.2162, 1.8781), (0.01, 0.09, 5.2632)])
def test_t6_psac_max_weight(r, n_star, w_max):
    n = torch.linspace(0.0, 2.0, 200_001, dtype=F64)
    w = PSAC(clip_norm=1.0, r=r).weights(n, {})
    i = int(torch.argmax(w))
    assert w[i].item() == pytest.approx(w_max, abs=5e-5)
    assert n[i].item() == pytest.approx(n_star, abs=5e-5)
    assert w[i].item() == pytest.approx(1 / (2 * math.sqrt(r) - r), rel=1e-9)


@pytest.mark.parametrize("gamma, w_max", [(0.1, 10.0), (0.01, 100.0)])
def test_t7_auto_s_max_weight(gamma, w_max):
    n = torch.linspace(0.0, 2.0, 20_001, dtype=F64)
    w = AutoS(clip_norm=1.0, gamma=gamma).weights(n, {})
    assert w.max().item() == pytest.approx(w_max, rel=1e-12)
    assert int(torch.argmax(w)) == 0  # decreasing: the maximum is at n = 0


@pytest.mark.parametrize("cls", [AutoS, AutoV, PSAC])
def test_nonfinite_norms_get_weight_zero(cls):
    w = cls().weights(torch.tensor([math.inf, math.nan, 0.3], dtype=torch.float32), {})
    assert w[0] == 0 and w[1] == 0 and w[2] > 0 and torch.isfinite(w).all()
    check_nonfinite(cls())


@pytest.mark.parametrize(
    "strategy", [AutoS(0.1, gamma=1e-4), AutoS(3.0, gamma=1.0), AutoV(0.1), PSAC(2.0, r=0.01),
                 PSAC(0.1, r=1.0)], ids=repr,
)
def test_weight_bound_with_non_default_parameters(strategy):
    check_weight_bound(strategy)


@pytest.mark.parametrize("name", ["auto-s", "auto-v", "psac"])
def test_changes_per_sample_scaling_vs_fixed(name):
    # anchors P13: on norms where fixed clipping at the same C leaves small gradients alone,
    # every normalisation strategy rescales them (and all of them rescale large ones)
    n = torch.tensor([0.05, 0.3, 5.0], dtype=F64)
    w_fixed = FixedClip(1.0).weights(n, {})
    w = make_strategy(name, {"clip_norm": 1.0}).weights(n, {})
    assert torch.equal(w_fixed[:2], torch.ones(2, dtype=F64))
    assert (w[:2] > 1.3).all()  # small gradients amplified, not left at weight 1
    assert (w[:2] - w_fixed[:2]).abs().min() > 0.3
    assert w[2].item() == pytest.approx(w_fixed[2].item(), rel=0.05)  # large: ~C/n for all


@pytest.mark.parametrize(
    "cls, kwargs, param",
    [(AutoS, {"gamma": 0}, "gamma"), (AutoS, {"gamma": -1}, "gamma"),
     (AutoS, {"gamma": math.inf}, "gamma"), (AutoS, {"clip_norm": 0}, "clip_norm"),
     (AutoV, {"clip_norm": math.nan}, "clip_norm"), (AutoV, {"clip_norm": "x"}, "clip_norm"),
     (PSAC, {"r": 0}, "r"), (PSAC, {"r": 1.5}, "r"), (PSAC, {"clip_norm": -2}, "clip_norm")],
)
def test_bad_parameters_are_named(cls, kwargs, param):
    with pytest.raises(ValueError, match=rf"{cls.__name__}: {param} must"):
        cls(**kwargs)


def test_make_strategy_parses_strings():
    s = make_strategy("auto-s", {"clip_norm": "0.5", "gamma": "0.05"})
    assert s == AutoS(0.5, 0.05)
    assert make_strategy("psac", {"r": "0.01"}) == PSAC(1.0, 0.01)
    with pytest.raises(ValueError, match="valid parameters: clip_norm, r"):
        make_strategy("psac", {"gamma": "0.1"})
