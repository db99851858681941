"""The private centre (dataset option centre="private", issue 36): its release, its neighbours, its
place in the ledger and in the calibration, resume, and the refusals."""

import math

import pytest
import torch
from dp_accounting import dp_event as dpa
from dp_accounting.pld import PLDAccountant
from torch import nn

from dpclip.accounting import epsilon as ledger_epsilon
from dpclip.data import load_dataset
from dpclip.data.private_centre import PrivateCentre
from dpclip.training.release import Releaser
from dpclip.events import GaussianEvent, PoissonSampledEvent
from dpclip.randomness import PrivateRandomness
from dpclip.training import private as P

TARGET, DELTA = 1.672, 1e-5


def _data(n=300, d=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = 0.8 * torch.rand(n, d, generator=g, dtype=torch.float64) - 0.1  # inside the box
    x[:7] *= 3.0  # a few records outside [-1, 1]: clipped before the sum
    y = (x[:, 0] > 0.3).long()
    return x, y


def _dp(x, y, *, centre=PrivateCentre(8.0), **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(x.shape[1], 2)).double()
    opts = dict(strategy="fixed", strategy_params={"clip_norm": 1.0}, epsilon=TARGET, epochs=2,
                batch_size=32, delta=DELTA, engine="vmap", verbose=False, preprocess=centre)
    opts.update(kw)
    return P.PrivateTraining(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), **opts)


def _pld_epsilon(events):
    acc = PLDAccountant(value_discretization_interval=1e-3)
    acc.compose(dpa.ComposedDpEvent(events))
    return acc.get_epsilon(DELTA)


def test_the_ledger_has_the_centre_event_and_the_total_epsilon_is_the_target():
    x, y = _data()
    dp = _dp(x, y)
    while not dp.exhausted:
        dp.step(*dp.sample())
    z, q, steps = dp.noise_multiplier, dp.sampler.sample_rate, dp.steps
    assert dp.ledger.entries == (
        (GaussianEvent(8.0), 1), (PoissonSampledEvent(q, GaussianEvent(z)), steps))
    # composed by hand with dp-accounting: the Gaussian mechanism + the sampled Gaussian steps
    sampled = dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps)
    total = _pld_epsilon([dpa.GaussianDpEvent(8.0), sampled])
    assert total <= TARGET + 1e-9 and total == pytest.approx(TARGET, abs=0.01)
    assert dp.epsilon() == pytest.approx(total, rel=1e-9)
    # the centre is paid for: the steps alone spend measurably less, and without the centre the
    # calibration gives a smaller sigma (less DP-SGD noise) for the same target
    assert _pld_epsilon([sampled]) < TARGET - 0.02
    assert _dp(x, y, centre=None).noise_multiplier < z


def test_neighbours_move_the_clipped_sum_by_at_most_the_sensitivity():
    x, _ = _data(d=6)
    c = PrivateCentre(2.0)
    sens = c.sensitivity(6)
    assert sens == pytest.approx(math.sqrt(6))
    full = c.clipped_sum(x)
    gaps = [float((full - c.clipped_sum(torch.cat([x[:i], x[i + 1:]]))).norm())
            for i in range(len(x))]
    assert max(gaps) <= sens + 1e-12
    # the bound is tight: a record at a corner of the box (or beyond it) moves the sum by sens
    corner = torch.full((1, 6), -5.0, dtype=torch.float64)
    gap = float((c.clipped_sum(torch.cat([x, corner])) - full).norm())
    assert gap == pytest.approx(sens, rel=1e-12)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_record_with_a_missing_value_moves_the_sum_by_at_most_the_sensitivity(bad):
    """Fiftieth hostile review: ``clamp`` keeps NaN, so one record with a NaN feature made the
    released centre (and its published norm) NaN whatever the noise: the neighbour told apart with
    certainty. A non-finite value now counts as 0 (NaN) or the box's edge (inf), per record."""
    x, y = _data(d=6)
    c = PrivateCentre(2.0)
    sens = c.sensitivity(6)
    odd = x.clone()
    odd[7, 2] = bad
    full, other = c.clipped_sum(x), c.clipped_sum(odd)
    assert torch.isfinite(other).all()
    assert float((full - other).norm()) <= 2 * sens + 1e-12  # replace-one: two records' worth
    assert float((c.clipped_sum(torch.cat([x[:7], x[8:]])) - other).norm()) <= sens + 1e-12
    model = nn.Sequential(nn.Linear(x.shape[1], 2)).double()
    dp = P.make_private(model, None, (odd, y), epsilon=TARGET, epochs=1, batch_size=32,
                        delta=DELTA, verbose=False, preprocess=PrivateCentre(8.0))
    assert torch.isfinite(dp.preprocess.output).all()
    assert math.isfinite(dp.describe()["preprocess_release"]["output_norm"])


def test_the_noise_std_is_z_times_the_sensitivity_and_the_estimate_is_unbiased():
    x, _ = _data(n=200, d=8)
    c, n, draws = PrivateCentre(3.0), 200, 4000
    g = torch.Generator().manual_seed(1)
    clipped_mean = c.clipped_sum(x) / n
    est = torch.stack([c.release(x, n, Releaser(g, 1)) for _ in range(draws)])  # (draws, d)
    noise_of_sum = (est - clipped_mean) * n
    std = float(noise_of_sum.std())
    assert std == pytest.approx(3.0 * math.sqrt(8), rel=0.03)  # 32k samples: ~0.4 % s.e.
    # unbiased: the mean of the estimates is the clipped mean (4 standard errors per coordinate)
    se = 3.0 * math.sqrt(8) / n / math.sqrt(draws)
    assert float((est.mean(0) - clipped_mean).abs().max()) < 4 * se
    # inside the box the clipped mean is the plain mean
    inside = x[7:]
    assert torch.allclose(c.clipped_sum(inside) / len(inside), inside.mean(0))


def test_the_release_draws_from_the_runs_secret_noise_generator():
    x, y = _data()
    dp = _dp(x, y, reproducible_noise=True, seed=5)
    g = PrivateRandomness.reproducible(5).noise
    want = PrivateCentre(8.0).release(x, len(x), Releaser(g, 1))
    assert torch.equal(dp.preprocess.output, want)
    assert torch.allclose(dp._x, x - want)
    # secure mode: two runs draw two different centres
    a, b = _dp(x, y).preprocess.output, _dp(x, y).preprocess.output
    assert not torch.equal(a, b)


def test_resume_reuses_the_checkpoints_centre_and_ledger():
    x, y = _data()
    dp = _dp(x, y)
    for _ in range(3):
        dp.step(*dp.sample())
    ck = dp.state_dict()
    other = _dp(x, y)  # a fresh run draws another centre ...
    assert not torch.equal(other.preprocess.output, dp.preprocess.output)
    other.load_state_dict(ck)  # ... and the checkpoint's replaces it
    assert torch.equal(other.preprocess.output, dp.preprocess.output)
    assert torch.equal(other._x, dp._x) and other.ledger == dp.ledger
    with pytest.raises(ValueError, match="centre='private'"):
        _dp(x, y, centre=None, epsilon=None,
            noise_multiplier=dp.noise_multiplier).load_state_dict(ck)


def test_the_breast_cancer_run_centres_train_and_test_with_the_release():
    from dpclip.training.trainer import TrainConfig, train

    opts = {"scaling": "declared-ranges", "centre": "private", "centre_noise_multiplier": 8.0}
    cfg = TrainConfig(dataset="breast-cancer", dataset_options=opts, model="tabular-mlp",
                      epochs=1, batch_size=64, lr=0.01, optimizer="adam", delta=DELTA,
                      accountant="pld", strategy="lip-dp-sgd", engine="summed", epsilon=TARGET,
                      strategy_params={"input_norm": 1.0, "weight_bound": 1.0}, seed=0)
    res = train(cfg, progress=False)
    assert res.ledger.entries[0] == (GaussianEvent(8.0), 1)
    rel = res.summary["preprocessing"]["release"]
    assert rel["sensitivity"] == pytest.approx(math.sqrt(30)) and rel["n_public"] == 455
    assert rel["noise_std_of_mean"] == pytest.approx(8.0 * math.sqrt(30) / 455)
    # the offset (norm 3.20 under the declared ranges) is removed up to the noise (~0.5)
    assert 2.5 < rel["output_norm"] < 4.0
    assert res.summary["epsilon"] <= TARGET + 1e-9


@pytest.mark.parametrize("opts, match", [
    ({"centre": "privat"}, "centre must be one of"),
    ({"centre": "private"}, "needs centre_noise_multiplier"),
    ({"centre": "private", "centre_noise_multiplier": 0.0}, "centre_noise_multiplier must be"),
    ({"centre": "private", "centre_noise_multiplier": -1.0}, "centre_noise_multiplier must be"),
    ({"centre": "private", "centre_noise_multiplier": float("nan")},
     "centre_noise_multiplier must be"),
    ({"centre_noise_multiplier": 8.0}, "only used with centre='private'"),
    ({"centre": "private", "centre_noise_multiplier": 8.0, "scaling": "train-statistics"},
     "needs scaling='declared-ranges'"),
])
def test_bad_options_name_the_option(opts, match):
    with pytest.raises(ValueError, match=match):
        load_dataset("breast-cancer", seed=0, **opts)


def test_refusals_of_the_run():
    x, y = _data()
    with pytest.raises(ValueError, match="sampling='poisson'"):
        _dp(x, y, sampling="fixed-size", accountant="rdp")
    # the centre alone costs more than the target: the error names the option to raise
    with pytest.raises(ValueError, match="centre_noise_multiplier"):
        _dp(x, y, centre=PrivateCentre(0.2))
    with pytest.raises(TypeError, match="preprocess= must be a dpclip.data.private_centre"):
        _dp(x, y, centre=object())
    assert ledger_epsilon(_dp(x, y)._plan.ledger(1.0, steps=0), DELTA) > 0  # planned first


def test_a_resumed_breast_cancer_run_keeps_one_centre_release(tmp_path):
    from dpclip.training.trainer import TrainConfig, train

    opts = {"scaling": "declared-ranges", "centre": "private", "centre_noise_multiplier": 8.0}
    cfg = TrainConfig(dataset="breast-cancer", dataset_options=opts, model="tabular-mlp",
                      epochs=1, batch_size=64, lr=0.01, optimizer="adam", delta=DELTA,
                      accountant="pld", strategy="fixed", strategy_params={"clip_norm": 1.0},
                      engine="vmap", epsilon=TARGET, seed=0)
    first = train(cfg, checkpoint_dir=tmp_path, stop_after_steps=3, progress=False)
    assert first.summary["interrupted"] and first.ledger.steps == 1 + 3
    res = train(cfg, checkpoint_dir=tmp_path, progress=False)
    centre = [(e, c) for e, c in res.ledger.entries if e == GaussianEvent(8.0)]
    assert centre == [(GaussianEvent(8.0), 1)]  # drawn and spent once, not again on resume
    assert res.ledger.steps == 1 + res.summary["steps"]
    assert res.summary["epsilon"] <= TARGET + 1e-9


def test_make_private_takes_the_centre():
    x, y = _data()
    model = nn.Sequential(nn.Linear(x.shape[1], 2)).double()
    dp = P.make_private(model, None, (x, y), epsilon=TARGET, epochs=1, batch_size=32,
                        delta=DELTA, verbose=False, preprocess=PrivateCentre(8.0))
    assert dp.ledger.entries == ((GaussianEvent(8.0), 1),)
    assert torch.allclose(dp.preprocess.apply(x), x - dp.preprocess.output)


def test_the_centre_is_refused_where_no_private_run_makes_its_release():
    from dpclip.audit.blackbox import blackbox_audit
    from dpclip.federated.spec import build_data
    from dpclip.training.trainer import TrainConfig

    opts = {"centre": "private", "centre_noise_multiplier": 8.0}
    fl = {"rounds": 2, "clients_per_round": 3, "delta": DELTA, "num_users": 10,
          "partition": "iid", "dataset": "breast-cancer", "dataset_options": opts}
    with pytest.raises(ValueError, match="DP-FedAvg has no user-level release"):
        build_data(fl)
    cfg = TrainConfig(dataset="breast-cancer", dataset_options=opts, model="tabular-mlp",
                      epochs=1, batch_size=64, strategy="fixed", epsilon=TARGET, delta=DELTA)
    with pytest.raises(ValueError, match="black-box audit does not support"):
        blackbox_audit(cfg, n_canaries=8)
