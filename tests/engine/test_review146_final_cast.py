"""Hundred-and-forty-sixth hostile review, its second finding: the engines accumulate the clipped
sum in float64 and cast it to the parameters' float32 once, BEFORE the noise. The cast rounds the
sum on the grid ``q = ulp(S)`` of the whole batch's sum: a designed batch whose full sum is an
exact tie rounding up and whose neighbour's (one example less, an odd multiple of ``q``) is a tie
rounding down moved the sum by ``x_0 + q``: 1.0068 C at B = 2^16 and 1.11 C at 2^20, every weight
exactly 1. ``dp_step`` now takes the engines' float64 sums uncast (``_common.wide_sums``) and the
release adds the noise before the cast (post-processing). These tests read what the release is
given, through ``make_private``: the sums the noise is added to."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpclip
from dpclip.training import step as step_module

K = 14  # B = 2^K: the sum lies in [2^K, 2^(K+1)), whose float32 grid is q = 2^(K - 23)
B = 2 ** K
Q = 2.0 ** (K - 23)
V = 1 + Q  # every example's gradient (an odd multiple of q), the last V - q/2: S a tie on q
C = V * (1 + 2.0 ** -11)  # above every engine's rounding bound of V (every weight exactly 1)


def _loss(o, y):
    return (o * y).sum(1)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.full((B, 1), V)
    x[-1] = V - Q / 2
    return x, torch.ones(B, 1)


def _released_sum(monkeypatch, xs, ys, engine: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum ``dp_step`` hands to the release (as given, float64 here) and the released
    gradient, for ``make_private`` on one full-batch step of a ``Linear(1, 1)``."""
    seen: dict[str, torch.Tensor] = {}
    real = step_module.release

    def spy(sums, **kw):
        seen["sum"] = sums["weight"].detach().clone()
        seen["norms"] = kw["norms"].detach().clone()
        return real(sums, **kw)

    monkeypatch.setattr(step_module, "release", spy)
    torch.manual_seed(0)
    model = nn.Linear(1, 1, bias=False)
    n = float(xs.shape[0])
    dp = dpclip.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.0), (xs, ys), noise_multiplier=1.0,
        steps=2, batch_size=n, engine=engine, strategy="fixed",
        strategy_params={"clip_norm": C}, loss_fn=_loss, reproducible_noise=True, seed=7,
        verbose=False)
    xb, yb = dp.sample()
    assert torch.equal(xb, xs)
    dp.backward(xb, yb)
    assert bool((seen["norms"] <= C).all())  # (nothing clipped: every weight exactly 1)
    assert model.weight.grad.dtype == torch.float32  # (the noisy value cast: post-processing)
    return seen["sum"], model.weight.grad


@pytest.mark.parametrize("engine", ["ghost", "auto", "vmap", "naive"])
def test_the_sum_reaches_the_noise_uncast(monkeypatch, engine):
    """Before: the release got float32 sums, full minus neighbour = V + q = 1.00098 C."""
    x, y = _batch()
    full, _ = _released_sum(monkeypatch, x, y, engine)
    less, _ = _released_sum(monkeypatch, x[1:], y[1:], engine)
    loo = float((full.double() - less.double()).abs().max())
    assert loo <= C
    assert loo == V  # exact: the float64 sums of these values are exact
    assert full.dtype == torch.float64


def test_a_bound_based_strategy_hands_its_float64_sum_to_the_noise(monkeypatch):
    """Lip-DP-SGD's summed engine ran on float64 copies (review 146's first finding) and cast
    the sum before the noise; the release now gets it in float64, scaled there."""
    seen: dict[str, torch.Tensor] = {}
    real = step_module.release

    def spy(sums, **kw):
        seen.update({n: v.detach().clone() for n, v in sums.items()})
        return real(sums, **kw)

    monkeypatch.setattr(step_module, "release", spy)
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x = torch.randn(64, 3)
    y = torch.randint(0, 2, (64,))
    dp = dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.0), (x, y),
                             noise_multiplier=1.0, steps=2, batch_size=64.0, engine="auto",
                             strategy="lip-dp-sgd", strategy_params={"input_norm": 1.0},
                             input_shape=(3,), reproducible_noise=True, seed=7, verbose=False)
    xb, yb = dp.sample()
    dp.backward(xb, yb)
    assert set(seen) == {"weight", "bias"}
    assert all(v.dtype == torch.float64 for v in seen.values())
    assert model.weight.grad.dtype == torch.float32 and model.bias.grad.dtype == torch.float32


def test_outside_dp_step_the_engines_return_the_parameters_dtype():
    """Only ``dp_step`` (``wide_sums``) takes the float64 sums: a direct engine call returns
    ``EngineResult.grads`` in the parameters' (sum) dtype, as documented."""
    from dpclip.engine import ParamGroups, get_engine
    from dpclip.engine._common import wide_sums

    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    x, y = torch.randn(8, 2), torch.ones(8, 1)
    for name in ("ghost", "vmap", "naive"):
        eng = get_engine(name)
        plain = eng.compute(model, _loss, x, y, lambda n: torch.clamp(1.0 / n, max=1.0),
                            ParamGroups.flat(model))
        assert {g.dtype for g in plain.grads.values()} == {torch.float32}
        with wide_sums():
            wide = eng.compute(model, _loss, x, y, lambda n: torch.clamp(1.0 / n, max=1.0),
                               ParamGroups.flat(model))
        assert {g.dtype for g in wide.grads.values()} == {torch.float64}
        for n, g in plain.grads.items():  # (the same sum, cast)
            assert torch.equal(wide.grads[n].float(), g)


# ------------------------------------------------- review 154: the setting and the summed engine

class _SwitchesWideOff(nn.Module):
    """Hundred-and-fifty-fourth hostile review: the forward sets dpclip's wide-sum setting off;
    under ``auto`` the public probe runs it inside the step, before the ghost pass reads it, and
    the sum was cast before the noise again (1.0073 C at B = 2^16)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(1, 1, bias=False)

    def forward(self, x):
        from dpclip.engine import _common

        _common._WIDE.set(False)
        return self.fc(x)


def test_a_forward_that_switches_the_wide_sums_off_is_refused():
    from dpclip.engine.errors import UnsupportedModelError

    x, y = _batch()
    model = _SwitchesWideOff()
    dp = dpclip.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.0), (x, y), noise_multiplier=1.0,
        steps=2, batch_size=float(B), engine="auto", strategy="fixed",
        strategy_params={"clip_norm": C}, loss_fn=_loss, reproducible_noise=True, seed=7,
        verbose=False)
    xb, yb = dp.sample()
    with pytest.raises(UnsupportedModelError, match="rounded before the noise"):
        dp.backward(xb, yb)


def test_the_summed_engine_sums_in_float64_inside_any_step(tmp_path):
    """Review 154: a distributed run wraps the summed engine (``ShardNoiseEngine``), which
    ``bound_step``'s float64 switch did not see: Lip-DP-SGD's sum was one float32 backward again
    (2.45 times the certified sensitivity at B = 16,384). Inside ``wide_sums`` (every step) the
    summed engine sums in float64 whatever wraps it; shown on a one-process gloo group."""
    import torch.distributed as dist

    from tests.engine.test_review140_chunk_sums import steered_lip_batch

    x, y = steered_lip_batch()
    seen: dict[str, torch.Tensor] = {}
    real = step_module.release

    def released(xs, ys):
        def spy(sums, **kw):
            seen["sum"] = sums["weight"].detach().clone()
            return real(sums, **kw)

        model = nn.Linear(1, 2, bias=False)
        with torch.no_grad():
            model.weight.zero_()
        step_module.release = spy
        try:
            dp = dpclip.make_private(
                model, torch.optim.SGD(model.parameters(), lr=0.0), (xs, ys),
                noise_multiplier=1.0, steps=2, batch_size=float(xs.shape[0]), engine="auto",
                strategy="lip-dp-sgd", strategy_params={"input_norm": 1.0}, input_shape=(1,),
                reproducible_noise=True, seed=7, verbose=False, distributed=True)
            assert "ShardNoiseEngine" in repr(dp._step_engine)
            xb, yb = dp.sample()
            dp.backward(xb, yb)
        finally:
            step_module.release = real
        return seen["sum"].double(), float(dp.strategy.sensitivity(dp.state))

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        full, delta = released(x, y)
        less, _ = released(x[1:], y[1:])
    finally:
        dist.destroy_process_group()
    # example 0's own gradient: 0.49 Delta; before: 2.45 Delta
    assert float((full - less).norm()) / delta <= 1.0


@pytest.mark.parametrize("name", ["vmap", "naive"])
def test_a_complex_trainable_parameter_is_refused_by_name(name):
    """Hundred-and-sixtieth hostile review: under vmap and naive a complex parameter's sum was
    kept in complex64 (rounded against the running total) and only torch's ``vector_norm``
    happened to fail (a bare RuntimeError); it is refused by name now."""
    from dpclip.engine import ParamGroups, get_engine
    from dpclip.engine.errors import UnsupportedModelError

    class Complex(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3, dtype=torch.complex64))

        def forward(self, x):
            return (x.to(torch.complex64) * self.w).abs()

    model = Complex()
    x, y = torch.randn(4, 3), torch.zeros(4, 3)
    with pytest.raises(UnsupportedModelError, match="'w' is torch.complex64"):
        get_engine(name).compute(model, lambda o, t: ((o - t) ** 2).sum(1), x, y,
                                 lambda n: torch.clamp(1.0 / n, max=1.0), ParamGroups.flat(model))
