"""dp_step: noise = z * S on the SUM, one division by the public expected batch size; events."""

import math

import pytest
import torch
from torch import nn

from dpclip.clipping import FixedClip, StepContext
from dpclip.engine import ParamGroups, get_engine
from dpclip.engine.base import EngineResult
from dpclip.events import GaussianEvent, PoissonSampledEvent, SampledWithoutReplacementEvent
from dpclip.noise import make_generator
from dpclip.training.sampling import FixedSizeSampler, PoissonSampler
from dpclip.training.step import dp_step


def ce(out, y):
    return nn.functional.cross_entropy(out, y, reduction="none")


class ZeroEngine:
    """Returns a zero sum so the step's output is pure noise / expected batch size."""

    name, per_example = "zero", True

    def compute(self, model, loss_fn, inputs, targets, weight_fn, groups):
        from dpclip.engine._common import out_dtype, wide_requested

        b = inputs.shape[0]
        norms = torch.zeros(b)
        wide = wide_requested()  # (inside dp_step: float64 sums, cast after the noise)
        return EngineResult({n: torch.zeros_like(p, dtype=out_dtype(p.dtype, wide))
                             for n, p in model.named_parameters()},
                            norms, weight_fn(norms), 0.0)


def _ctx(b):
    return StepContext.at(0, steps_per_epoch=10, total_steps=10,
                          expected_batch_size=float(b), base_noise_multiplier=1.3)


@pytest.mark.parametrize("sampler,factor", [(PoissonSampler(10_000, 50.0), 1),
                                            (FixedSizeSampler(10_000, 50), 2)])
def test_noise_std_is_z_times_sensitivity_over_expected_batch(sampler, factor):
    model = nn.Linear(200, 100)
    out = dp_step(model, torch.randn(7, 200), torch.randint(0, 100, (7,)), loss_fn=ce,
                  strategy=FixedClip(0.7), state={}, engine=ZeroEngine(),
                  groups=ParamGroups.flat(model), sampler=sampler, base_noise_multiplier=1.3,
                  ctx=_ctx(50), generator=make_generator(0))
    noise = torch.cat([g.flatten() for g in out.grads.values()])
    expected = 1.3 * 0.7 * factor / 50.0  # divided by the EXPECTED size 50, not the realised 7
    assert abs(noise.std().item() / expected - 1) < 0.02
    assert abs(noise.mean().item()) < 4 * expected / math.sqrt(noise.numel())
    assert out.sensitivity == pytest.approx(0.7 * factor)
    assert out.event == sampler.step_event(GaussianEvent(1.3))


def test_empty_batch_is_noise_only_and_recorded():
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    sampler = PoissonSampler(1000, 2.0)
    out = dp_step(model, torch.randn(0, 5), torch.zeros(0, dtype=torch.long), loss_fn=ce,
                  strategy=FixedClip(1.0), state={}, engine=get_engine("vmap"),
                  groups=ParamGroups.flat(model), sampler=sampler, base_noise_multiplier=1.0,
                  ctx=_ctx(2), generator=make_generator(0))
    assert out.batch_size == 0
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in out.grads.values())
    assert out.event == PoissonSampledEvent(0.002, GaussianEvent(1.0))


def test_zero_noise_step_equals_clipped_mean_over_expected_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(9, 6, dtype=torch.float64), torch.randint(0, 3, (9,))
    sampler = PoissonSampler(100, 10.0)
    out = dp_step(model, x, y, loss_fn=ce, strategy=FixedClip(0.3), state={},
                  engine=get_engine("vmap"), groups=ParamGroups.flat(model), sampler=sampler,
                  base_noise_multiplier=0.0, ctx=_ctx(10), generator=make_generator(0))
    # oracle: naive loop in float64
    expected = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for i in range(9):
        model.zero_grad()
        ce(model(x[i:i + 1]), y[i:i + 1]).sum().backward()
        norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))
        w = min(1.0, 0.3 / (norm.item() + 1e-6))
        for n, p in model.named_parameters():
            expected[n] += w * p.grad
    for n in expected:
        assert torch.allclose(out.grads[n], expected[n] / 10.0, rtol=1e-10, atol=1e-14)


def test_fixed_size_event_and_doubling():
    model = nn.Linear(3, 2)
    s = FixedSizeSampler(100, 4)
    out = dp_step(model, torch.randn(4, 3), torch.randint(0, 2, (4,)), loss_fn=ce,
                  strategy=FixedClip(1.0), state={}, engine=get_engine("vmap"),
                  groups=ParamGroups.flat(model), sampler=s, base_noise_multiplier=1.0,
                  ctx=_ctx(4), generator=make_generator(0))
    assert out.event == SampledWithoutReplacementEvent(100, 4, GaussianEvent(1.0))
    assert out.sensitivity == 2.0
