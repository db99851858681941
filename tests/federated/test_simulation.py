"""In-process DP-FedAvg: the loop, the server optimizer, the client, calibration and the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from dpclip.accounting import compute_epsilon
from dpclip.cli import main as cli_main
from dpclip.clipping.fixed import FixedClip
from dpclip.clipping.quantile import QuantileClip
from dpclip.data import load_dataset
from dpclip.federated import (
    DPAggregator,
    FedAvgConfig,
    FedAvgServer,
    LocalTraining,
    ServerOptimizer,
    federate,
    flat_parameters,
    local_update,
    make_user_sampler,
    plan_ledger,
    run_fedavg,
)
from dpclip.models import build_model
from dpclip.randomness import PrivateRandomness


@pytest.fixture(scope="module")
def fed():
    return federate(load_dataset("synthetic", seed=0, n_train=240, n_test=128), 30, "iid", seed=0)


def model_for(fed, seed=0):
    torch.manual_seed(seed)
    return build_model("mlp", fed.input_shape, fed.num_classes, hidden=(8,))


def cfg(**kw):
    base = dict(rounds=8, clients_per_round=6, delta=1e-3, noise_multiplier=0.2,
                local=LocalTraining(1, 8, 0.2), reproducible_noise=True, eval_every=8)
    base.update(kw)
    return FedAvgConfig(**base)


def test_run_trains_records_every_round_and_reports_ledger_epsilon(fed):
    res = run_fedavg(fed, model_for(fed), QuantileClip(initial_clip_norm=1.0, count_noise_std=1.0),
                     cfg())
    assert res.ledger.steps == 8 and len(res.clip_history) == 8
    assert res.ledger == plan_ledger(QuantileClip(count_noise_std=1.0), cfg(), 30, 0.2)  # same events
    assert res.epsilon == pytest.approx(compute_epsilon(res.ledger, 1e-3).epsilon)
    assert res.summary["test_accuracy"] > 0.5  # 4 classes: chance is 0.25
    assert res.summary["randomness"] == "reproducible"
    assert res.summary["private_against_seed"] is False


def test_reproducible_mode_replays_and_secure_mode_does_not(fed):
    a = run_fedavg(fed, model_for(fed), FixedClip(1.0), cfg(rounds=3, eval_every=3))
    b = run_fedavg(fed, model_for(fed), FixedClip(1.0), cfg(rounds=3, eval_every=3))
    torch.testing.assert_close(flat_parameters(a.model), flat_parameters(b.model), rtol=0, atol=0)
    s1 = run_fedavg(fed, model_for(fed), FixedClip(1.0),
                    cfg(rounds=2, eval_every=2, reproducible_noise=False))
    s2 = run_fedavg(fed, model_for(fed), FixedClip(1.0),
                    cfg(rounds=2, eval_every=2, reproducible_noise=False))
    assert s1.summary["randomness"] == "secure"
    assert not torch.equal(flat_parameters(s1.model), flat_parameters(s2.model))


def test_target_epsilon_calibrates_z_and_is_met(fed):
    c = cfg(noise_multiplier=None, target_epsilon=8.0, rounds=5, eval_every=5)
    res = run_fedavg(fed, model_for(fed), QuantileClip(count_noise_std=2.0), c)
    assert 7.9 <= res.epsilon <= 8.0


def test_local_update_does_not_touch_the_global_vector(fed):
    """A client sharing storage with the server's parameters would move the global model without
    clipping or noise (a bug this test caught in development)."""
    model = model_for(fed)
    theta = flat_parameters(model)
    before = theta.clone()
    delta = local_update(model, theta, fed.users[0], LocalTraining(2, 4, 0.5), seed=1)
    assert torch.equal(theta, before)
    assert float(delta.norm()) > 0
    torch.testing.assert_close(flat_parameters(model), before + delta)


def test_momentum_server_optimizer_matches_formula(fed):
    model = model_for(fed)
    agg = DPAggregator(FixedClip(100.0), make_user_sampler("poisson", 30, 6), 0.0, 3,
                       PrivateRandomness.reproducible(0))
    server = FedAvgServer(model, agg, ServerOptimizer("momentum", lr=2.0, momentum=0.5))
    theta0 = server.theta.clone()
    d = theta0.numel()
    u1, u2 = torch.full((1, d), 0.6), torch.full((1, d), -1.2)
    server.finish_round(u1)
    server.finish_round(u2)
    v1 = 0.5 * (0.6 / 6)
    v2 = 0.5 * v1 + 0.5 * (-1.2 / 6)
    torch.testing.assert_close(server.theta, theta0 + 2.0 * v1 + 2.0 * v2)
    torch.testing.assert_close(flat_parameters(model), server.theta)


def test_adam_server_and_fixed_size_sampling_with_rdp(fed):
    c = cfg(sampling="fixed-size", accountant="rdp", rounds=3, eval_every=3,
            server=ServerOptimizer("adam", lr=0.01))
    res = run_fedavg(fed, model_for(fed), FixedClip(1.0), c)
    assert res.summary["adjacency"] == "replace-one" and res.epsilon > 0
    with pytest.raises(ValueError, match="rdp"):
        cfg(sampling="fixed-size", accountant="pld")


def test_model_with_buffers_is_refused(fed):
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(20, 4), torch.nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match="buffer"):
        run_fedavg(fed, model, FixedClip(1.0), cfg(rounds=1, eval_every=1))


def test_cli_fl_train_json(capsys):
    rc = cli_main(["fl", "train", "--dataset", "synthetic", "--dataset-option", "n_train=120",
                   "--num-users", "20", "--rounds", "2", "--clients-per-round", "5",
                   "--strategy", "quantile", "--param", "count_noise_std=1.0",
                   "--noise-multiplier", "0.5", "--delta", "1e-3", "--model-option",
                   "hidden=[8]", "--reproducible-noise", "--eval-every", "2", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["strategy"] == "quantile" and out["rounds"] == 2 and out["epsilon"] > 0
    assert out["privacy_unit"] == "user" and out["randomness"] == "reproducible"
