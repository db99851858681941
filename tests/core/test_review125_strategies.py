"""Hundred-and-twenty-fifth hostile review: what strategies release besides the plain clipped sum.

* Lip-DP-SGD's certificate reused a cached operator-norm bound keyed on the weight's version
  counter: weights scaled through ``p.data.mul_`` between two steps (no version move) kept the old
  norm, and the noise was calibrated to a sensitivity 16.7 times too small. Cache entries now hold
  a copy of the weight, compared before use.
* AdaClip's per-example path (``transformed_sum``) ran the model outside the engines' fixed
  thread count: at more intra-op threads MKL splits a product of 33 rows otherwise than one of 32,
  so removing one example changed the others' gradients (7.9 times the sensitivity at 8 threads);
  and its sum was taken under the caller's autocast (bfloat16: 1.11 times).
* Auto-S / Auto-V / PSAC accepted constants whose largest weight overflows float32: a step then
  failed or not by whether the batch held a zero gradient (one bit about the data)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpclip
from dpclip.clipping.adaclip import AdaClip
from dpclip.clipping.base import StepContext
from dpclip.clipping.fixed import FixedClip
from dpclip.clipping.normalize import PSAC, AutoS, AutoV
from dpclip.engine import ParamGroups, get_engine
from dpclip.training.sampling import PoissonSampler
from dpclip.training.step import dp_step

# ---------------------------------------------------------------- AdaClip's thread count

SEEN: list[int] = []


class _Compare(nn.Module):
    """The eighty-ninth review's model: a batched product against the row-by-row one, turned
    into a sign by a LayerNorm of two values (so the rounding of the product's split decides)."""

    def __init__(self, out=16, k=512):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.register_buffer("W", torch.randn(out, k, generator=g))
        self.ln = nn.LayerNorm(2, eps=1e-30, elementwise_affine=False)
        self.head = nn.Linear(2 * out, 1)

    def forward(self, x):
        SEEN.append(torch.get_num_threads())
        h1 = nn.functional.linear(x, self.W)
        h2 = (x.unsqueeze(1) * self.W).sum(-1)
        return self.head(self.ln(torch.stack([h1, h2], -1)).flatten(1)).squeeze(-1)


def _sq(out, y):
    return (out - y) ** 2


def _release(model_fn, engine, strategy, x, y, loss, batch):
    torch.manual_seed(0)
    model = model_fn()
    ctx = StepContext.at(0, steps_per_epoch=10, total_steps=100, expected_batch_size=batch,
                         base_noise_multiplier=0.0)
    out = dp_step(model, x, y, loss_fn=loss, strategy=strategy, state=strategy.init_state(),
                  engine=get_engine(engine), groups=ParamGroups.flat(model),
                  sampler=PoissonSampler(10000, batch), base_noise_multiplier=0.0, ctx=ctx,
                  generator=torch.Generator().manual_seed(0))
    # step 0: AdaClip's m = 0 and b = 1, so grads * B is the whitened clipped sum (sensitivity 1)
    return torch.cat([g.reshape(-1).double() for g in out.grads.values()]) * batch


@pytest.mark.parametrize("engine", ["vmap", "auto"])
def test_adaclip_runs_the_model_at_the_engines_thread_count(engine):
    was = torch.get_num_threads()
    torch.set_num_threads(5)
    try:
        torch.manual_seed(0)
        x, y = torch.randn(33, 512), torch.randn(33)
        seen = {}
        for strategy in (AdaClip(initial_clip_norm=1.0), FixedClip(1.0)):
            SEEN.clear()
            full = _release(_Compare, engine, strategy, x, y, _sq, 33.0)
            rest = _release(_Compare, engine, strategy, x[:32], y[:32], _sq, 33.0)
            seen[type(strategy).__name__] = set(SEEN)
            d = float((full - rest).norm())
            assert d <= 1.0 + 1e-6, f"{type(strategy).__name__}: LOO {d:.3f} x sensitivity"
    finally:
        torch.set_num_threads(was)
    # (before: AdaClip's forward ran at 5 threads, FixedClip's at the engines' cap; LOO 7.5)
    assert seen["AdaClip"] == seen["FixedClip"] and max(seen["AdaClip"]) < 5


def test_adaclip_sums_in_exact_float32_under_autocast():
    def model_fn():
        return nn.Sequential(nn.Linear(40, 64), nn.Tanh(), nn.Linear(64, 10))

    def ce(o, y):
        return nn.functional.cross_entropy(o, y, reduction="none")

    torch.manual_seed(2)
    batch = 512
    x = torch.randn(1, 40) * 5 + 1e-3 * torch.randn(batch, 40)  # aligned examples
    y = torch.zeros(batch, dtype=torch.long)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = _release(model_fn, "vmap", AdaClip(initial_clip_norm=1.0), x, y, ce, float(batch))
        worst = 0.0
        for k in (0, 255):
            keep = [i for i in range(batch) if i != k]
            worst = max(worst, float((full - _release(
                model_fn, "vmap", AdaClip(initial_clip_norm=1.0), x[keep], y[keep], ce,
                float(batch))).norm()))
    assert worst <= 1.0 + 1e-4, f"LOO {worst:.4f} x sensitivity"  # (1.093 before)


# ---------------------------------------------------------------- Lip-DP's cached norms

def test_lipdp_recomputes_the_certificate_of_weights_written_through_data():
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).to(torch.float64)

    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the step leaves the weights
    g = torch.Generator().manual_seed(2)
    X = torch.randn(200, 6, generator=g, dtype=torch.float64)
    Y = torch.randint(0, 3, (200,), generator=g)
    dp = dpclip.make_private(model, opt, (X, Y), strategy="lip-dp-sgd",
                             strategy_params={"input_norm": 1.0, "weight_bound": 1.0},
                             noise_multiplier=1.0, steps=10, batch_size=20.0, input_shape=(6,),
                             engine="auto", verbose=False)
    dp.step(*dp.sample())
    first = dp.last_output.sensitivity
    for layer in (model[0], model[2]):  # a user's constraint written the common way: no version
        layer.weight.data.mul_(30.0)
    dp.backward(*dp.sample())
    used = dp.last_output.sensitivity
    fresh_model = build()
    fresh_model.load_state_dict(model.state_dict())  # new tensors: no cache entry
    fresh = dp.strategy.certify(fresh_model, dp.strategy.loss(), (6,),
                                dp.strategy.init_state())[1].sensitivity
    assert used == pytest.approx(fresh, rel=1e-9)  # (before: step 1's 2.3 against 49.1)
    assert used > 10 * first


# ---------------------------------------------------------------- normalisation constants

@pytest.mark.parametrize("make, match", [
    (lambda: AutoS(gamma=1e-40), "gamma must be at least"),
    (lambda: AutoS(clip_norm=1e30, gamma=1e-10), "overflows float32"),
    (lambda: AutoV(clip_norm=1e30), "overflows float32"),
    (lambda: PSAC(r=1e-45), "r must be at least"),
    (lambda: PSAC(clip_norm=1e38, r=1e-6), "overflows float32"),
])
def test_normalising_strategies_refuse_weights_that_overflow_float32(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_normalising_strategies_keep_their_usual_constants():
    assert AutoS(clip_norm=1.0, gamma=1e-6).gamma == 1e-6
    assert AutoV(clip_norm=100.0).clip_norm == 100.0
    assert PSAC(clip_norm=1.0, r=1e-4).r == 1e-4
