"""Reading R1 of Lip-DP-SGD: weight gradients from per-example normalised layer inputs."""

import pytest
import torch
from torch import nn

from dpclip.clipping import make_strategy
from dpclip.engine import ParamGroups, get_engine


def model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(),
                         nn.Linear(3 * 3 * 3, 6), nn.Tanh(), nn.Linear(6, 4)).double()


def grads_under_r1(strategy, m, x, y):
    eng = get_engine("summed")
    with strategy.gradient_context(m):
        return eng.compute(m, strategy.loss(), x, y, None, ParamGroups.flat(m)).grads


def test_r1_weight_gradients_equal_plain_gradients_over_each_layer_input_norm():
    m = model()
    s = make_strategy("lip-dp-sgd", {"input_norm": 3.0, "scaling": "r1"}).bind(m, (1, 6, 6))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 1, 6, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (5,), generator=g)
    x = s.scale_inputs(x)
    for i in range(5):
        xi, yi = x[i:i + 1], y[i:i + 1]
        inputs = {}
        hooks = [mod.register_forward_hook(lambda mod, a, o, k=k: inputs.__setitem__(k, a[0]))
                 for k, mod in (("0", m[0]), ("4", m[4]), ("6", m[6]))]
        plain = torch.autograd.grad(s.loss()(m(xi), yi).sum(), list(m.parameters()))
        for h in hooks:
            h.remove()
        r1 = grads_under_r1(s, m, xi, yi)
        names = [n for n, _ in m.named_parameters()]
        for n, gp in zip(names, plain):
            layer = n.split(".")[0]
            if n.endswith("weight"):
                expect = gp / inputs[layer].norm()
            else:
                expect = gp  # biases unchanged (scaled later by 1 / X_{k-1})
            assert torch.allclose(r1[n], expect, rtol=1e-9, atol=1e-12), n
        # the forward value is unchanged
        with s.gradient_context(m):
            out = m(xi)
        assert torch.allclose(out, m(xi))


def test_r1_per_example_scaled_gradients_within_the_certificate():
    m = model()
    s = make_strategy("lip-dp-sgd", {"input_norm": 2.0, "scaling": "r1"}).bind(m, (1, 6, 6))
    _, cert = s.certify(m, s.loss(), (1, 6, 6), s.init_state())
    r2 = make_strategy("lip-dp-sgd", {"input_norm": 2.0}).bind(m, (1, 6, 6))
    _, cert2 = r2.certify(m, r2.loss(), (1, 6, 6), r2.init_state())
    assert cert.sensitivity == pytest.approx(cert2.sensitivity, rel=1e-12)  # same bound as R2
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 1, 6, 6, generator=g, dtype=torch.float64) * 5
    x[0] = 0.0
    x[1] *= 1e-6  # a tiny input: its normalised weight gradient is as large as any
    y = torch.randint(0, 4, (40,), generator=g)
    x = s.scale_inputs(x)
    worst = 0.0
    for i in range(40):
        gi = grads_under_r1(s, m, x[i:i + 1], y[i:i + 1])
        scaled = {n: t * cert.scales[n] for n, t in gi.items()}
        total = torch.sqrt(sum(t.pow(2).sum() for t in scaled.values())).item()
        assert total <= cert.sensitivity * (1 + 1e-9)
        for layer, bound in cert.layer_sensitivities.items():
            part = torch.sqrt(sum(t.pow(2).sum() for n, t in scaled.items()
                                  if n.split(".")[0] == layer)).item()
            assert part <= bound * (1 + 1e-9)
        worst = max(worst, total)
    assert worst > 0
    # the batched sum is the sum of the per-example ones (the normalisation is per example)
    full = grads_under_r1(s, m, x, y)
    parts = [grads_under_r1(s, m, x[i:i + 1], y[i:i + 1]) for i in range(40)]
    for n in full:
        assert torch.allclose(full[n], sum(p[n] for p in parts), rtol=1e-9, atol=1e-12)


def test_r1_refuses_per_example_engines():
    from dpclip.clipping import StepContext
    from dpclip.noise import make_generator
    from dpclip.training.sampling import PoissonSampler
    from dpclip.training.step import dp_step

    m = model()
    s = make_strategy("lip-dp-sgd", {"input_norm": 2.0, "scaling": "r1"}).bind(m, (1, 6, 6))
    ctx = StepContext.at(0, steps_per_epoch=1, total_steps=1,
                         expected_batch_size=4.0, base_noise_multiplier=1.0)
    with pytest.raises(ValueError, match="summed engine"):
        dp_step(m, torch.randn(4, 1, 6, 6, dtype=torch.float64), torch.zeros(4, dtype=torch.long),
                loss_fn=s.loss(), strategy=s, state=s.init_state(), engine=get_engine("vmap"),
                groups=ParamGroups.flat(m), sampler=PoissonSampler(100, 4.0),
                base_noise_multiplier=1.0, ctx=ctx, generator=make_generator(0))
