"""The own-model API (dpclip.make_private): equality with dp_step, budget, resume, refusals."""

import copy

import pytest
import torch
from torch import nn

from dpclip.training import private as P
from dpclip.accounting import epsilon as ledger_epsilon
from dpclip.clipping import make_strategy
from dpclip.engine import ParamGroups, get_engine
from dpclip.randomness import PrivateRandomness
from dpclip.training.sampling import PoissonSampler
from dpclip.training.step import dp_step


def _data(n=256, d=6, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = (x @ torch.randn(d, k, generator=g)).argmax(1)
    return x, y


def _model(d=6, k=3):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, 16), nn.Tanh(), nn.Linear(16, k))


def test_backward_equals_dp_step_in_float64():
    x, y = _data()
    x = x.double()
    model = _model().double()
    ref = copy.deepcopy(model)
    dp = P.make_private(model, None, (x, y), strategy="fixed",
                        strategy_params={"clip_norm": 0.5}, noise_multiplier=1.0, epochs=1,
                        batch_size=32, delta=1e-5, engine="ghost", reproducible_noise=True,
                        seed=3)
    xb, yb = dp.sample()
    dp.backward(xb, yb)
    # the same step by hand: same batch, noise generator in the same state
    rng = PrivateRandomness.reproducible(3)
    PoissonSampler(256, 32.0).sample(rng.sampling)
    strat = make_strategy("fixed", {"clip_norm": 0.5})
    out = dp_step(ref, xb, yb, loss_fn=lambda o, t: nn.functional.cross_entropy(
        o, t, reduction="none"), strategy=strat, state=strat.init_state(),
        engine=get_engine("naive"), groups=ParamGroups.flat(ref),
        sampler=PoissonSampler(256, 32.0), base_noise_multiplier=1.0,
        ctx=dp._plan.ctx(0, 1.0), generator=rng.noise)
    for (n, p) in model.named_parameters():
        torch.testing.assert_close(p.grad, out.grads[n], rtol=1e-10, atol=1e-12)
    assert dp.ledger.steps == 1 and dp.ledger.entries[0][0] == out.event


def test_own_loop_learns_and_meets_the_target_epsilon():
    x, y = _data(512)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    dp = P.make_private(model, opt, (x, y), strategy="quantile", epsilon=3.0, epochs=4,
                        batch_size=64, delta=1e-5)
    for _ in range(dp.epochs):
        for xb, yb in dp.loader:
            opt.zero_grad()
            dp.backward(xb, yb)
            opt.step()
    assert dp.steps == dp.total_steps == 4 * 8
    assert dp.epsilon() <= 3.0 + 1e-9 and dp.epsilon() > 2.9
    assert (model(x).argmax(1) == y).float().mean() > 0.6
    s = dp.describe()
    assert s["engine"] == "ghost" and s["engine_requested"] == "auto"
    assert s["randomness"] == "secure"


def test_batches_not_drawn_by_the_loader_are_refused():
    x, y = _data()
    dp = P.make_private(_model(), None, (x, y), noise_multiplier=1.0, epochs=1, batch_size=32,
                        delta=1e-5)
    with pytest.raises(ValueError, match="just drawn from dp.loader"):
        dp.backward(x[:8], y[:8])
    xb, yb = dp.sample()
    dp.backward(xb, yb)
    with pytest.raises(ValueError, match="used once"):
        dp.backward(xb, yb)


def test_the_budget_stops_the_loader_and_backward():
    x, y = _data()
    dp = P.make_private(_model(), None, (x, y), noise_multiplier=1.5, epsilon=2.0, epochs=20,
                        batch_size=32, delta=1e-5)
    assert 0 < dp.max_steps < dp.total_steps
    n = 0
    for _ in range(dp.epochs):
        for xb, yb in dp.loader:
            dp.backward(xb, yb)
            n += 1
    assert n == dp.max_steps and dp.stopped_by_budget and dp.epsilon() <= 2.0
    with pytest.raises(P.BudgetExhausted, match="budget exhausted"):
        dp.sample()
    led = dp.ledger
    led.record(led.entries[-1][0])
    assert ledger_epsilon(led, 1e-5, accountant="pld") > 2.0
    with pytest.raises(ValueError, match="allows 0 of the"):
        P.make_private(_model(), None, (x, y), noise_multiplier=1.0, epsilon=0.5, epochs=1,
                       batch_size=32, delta=1e-5)


def test_state_dict_resumes_the_same_stream():
    x, y = _data()

    def fresh():
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return P.make_private(model, opt, (x, y), noise_multiplier=1.0, epochs=2,
                              batch_size=32, delta=1e-5)

    a = fresh()
    for _ in range(3):
        a.step(*a.sample())
    ck = copy.deepcopy(a.state_dict())
    b, c = fresh(), fresh()
    b.load_state_dict(ck)
    c.load_state_dict(copy.deepcopy(ck))
    for dp in (b, c):
        for _ in range(dp.epochs):
            for xb, yb in dp.loader:
                dp.step(xb, yb)
    for p, q in zip(b.model.parameters(), c.model.parameters()):
        assert torch.equal(p, q)
    assert b.ledger == c.ledger and b.steps == b.total_steps


def test_datasets_and_dataloaders_are_accepted():
    from torch.utils.data import DataLoader, Dataset, TensorDataset

    x, y = _data()

    class Pairs(Dataset):
        def __len__(self):
            return 256

        def __getitem__(self, i):
            return x[i], y[i]

    for data in (TensorDataset(x, y), DataLoader(TensorDataset(x, y), batch_size=7), Pairs()):
        dp = P.make_private(_model(), None, data, noise_multiplier=1.0, epochs=1, batch_size=32,
                            delta=1e-5, reproducible_noise=True)
        xb, yb = dp.sample()
        assert xb.shape[1:] == (6,) and yb.shape == xb.shape[:1]
        dp.backward(xb, yb)


def test_bad_arguments_name_the_fix(capsys):
    x, y = _data()
    with pytest.raises(ValueError, match="epsilon="):
        P.make_private(_model(), None, (x, y), epochs=1)
    with pytest.raises(ValueError, match="exactly one of epochs= and steps="):
        P.make_private(_model(), None, (x, y), noise_multiplier=1.0)
    with pytest.raises(ValueError, match="did you mean 'ghost'"):
        P.make_private(_model(), None, (x, y), noise_multiplier=1.0, epochs=1, engine="ghots")
    with pytest.raises(ValueError, match="delta < 1/N"):
        P.make_private(_model(), None, (x, y), noise_multiplier=1.0, epochs=1, delta=0.01)
    with pytest.raises(ValueError, match="GroupNorm"):
        P.make_private(nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4)), None, (x, y),
                       noise_multiplier=1.0, epochs=1)
    dp = P.make_private(_model(), None, (x, y), noise_multiplier=1.0, epochs=1, batch_size=32)
    assert dp.delta == 1e-5 and "delta = 1e-05" in capsys.readouterr().err


def test_the_api_ledger_equals_dpclip_train_for_the_same_settings():
    """One path: `dpclip train` drives PrivateTraining, so the same settings give the same plan,
    noise multiplier and ledger from the CLI's trainer and from a user's own loop."""
    from dpclip.data import load_dataset
    from dpclip.models import build_model
    from dpclip.training.trainer import TrainConfig, train

    cfg = TrainConfig(dataset="synthetic", model="mlp", strategy="quantile", epsilon=2.0,
                      delta=1e-5, epochs=2, batch_size=64, lr=0.5)
    res = train(cfg, progress=False)
    bundle = load_dataset("synthetic", None, seed=0)
    torch.manual_seed(0)
    model = build_model("mlp", bundle.input_shape, bundle.num_classes)
    dp = P.make_private(model, torch.optim.SGD(model.parameters(), lr=0.5),
                        (bundle.train.inputs, bundle.train.targets), strategy="quantile",
                        epsilon=2.0, delta=1e-5, epochs=2, batch_size=64)
    for _ in range(dp.epochs):
        for xb, yb in dp.loader:
            dp.step(xb, yb)
    assert dp.noise_multiplier == res.summary["noise_multiplier"]
    assert dp.ledger == res.ledger and dp.epsilon() == res.summary["epsilon"]


@pytest.mark.parametrize("rel", [1e-10, -1e-10])
def test_resume_accepts_calibration_round_off_and_keeps_the_cap(rel):
    """A checkpoint written where the calibration's last digits differ (a GPU image: 1e-10
    relative) resumes with the checkpoint's noise multiplier for every step, and the run's epsilon
    stays within the cap either way round; a real change of the privacy settings is refused."""
    x, y = _data()

    def fresh():
        model = _model()
        return P.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y),
                              epsilon=2.0, epochs=2, batch_size=32, delta=1e-5,
                              accountant="rdp")

    a = fresh()
    for _ in range(3):
        a.step(*a.sample())
    ck = copy.deepcopy(a.state_dict())
    z = a.noise_multiplier * (1 + rel)
    ck["noise_multiplier"] = z
    b = fresh()
    b.load_state_dict(ck)
    assert b.noise_multiplier == z and b.steps == 3
    while not b.exhausted:
        b.step(*b.sample())
    assert b.steps == b.max_steps and b.max_steps >= b.total_steps - 1
    assert ledger_epsilon(b.ledger, 1e-5, accountant="rdp") <= 2.0
    far = dict(ck, noise_multiplier=a.noise_multiplier * (1 + 1e-6))
    with pytest.raises(ValueError, match="privacy settings changed"):
        fresh().load_state_dict(far)
