"""DP-FedAvg on Flower's own gRPC runtime (server + one process per user on localhost).

Skipped without the optional extra (``pip install 'dpclip[flower]'``). Bounded in time: every
process is killed in ``finally``; the whole test stays under ~90 s.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

flwr = pytest.importorskip("flwr", reason="Flower not installed (pip install 'dpclip[flower]')")

from dpclip.accounting import Ledger  # noqa: E402
from dpclip.federated import run_fedavg  # noqa: E402
from dpclip.federated.spec import build_run  # noqa: E402
from dpclip.randomness import PrivateRandomness  # noqa: E402

SPEC = {
    "dataset": "synthetic", "dataset_options": {"n_train": 96, "n_test": 64},
    "num_users": 4, "partition": "iid", "model": "mlp", "model_options": {"hidden": [8]},
    "strategy": "quantile", "params": {"initial_clip_norm": 0.1, "count_noise_std": 1.0},
    "rounds": 4, "clients_per_round": 2, "sampling": "poisson", "noise_multiplier": 0.3,
    "delta": 1e-3, "local_epochs": 1, "local_batch_size": 8, "client_lr": 0.1,
    "seed": 5, "reproducible_noise": True, "eval_every": 4,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_flower_run_matches_in_process_simulation(tmp_path):
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(SPEC))
    out = tmp_path / "server.json"
    address = f"127.0.0.1:{_free_port()}"
    cmd = [sys.executable, "-m", "dpclip.federated.flower"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GRPC_VERBOSITY": "ERROR"}
    procs = []
    deadline = time.monotonic() + 85
    try:
        procs.append(subprocess.Popen(
            cmd + ["server", "--address", address, "--spec", str(spec_path), "--out", str(out),
                   "--wait-timeout", "60"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env))
        time.sleep(2.0)
        for user in range(SPEC["num_users"]):
            procs.append(subprocess.Popen(
                cmd + ["client", "--address", address, "--spec", str(spec_path),
                       "--user", str(user)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))
        server = procs[0]
        try:
            server.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            pytest.fail("Flower server did not finish within the time bound")
        log = server.stdout.read().decode(errors="replace")
        assert server.returncode == 0, log[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
    result = json.loads(out.read_text())
    assert result["rounds"] == SPEC["rounds"] and result["failures"] == []

    # the same plan in process: same users, same noise, same ledger, same parameters
    data, model, strategy, config = build_run(SPEC)
    sim = run_fedavg(data, model, strategy, config,
                     randomness=PrivateRandomness.reproducible(SPEC["seed"]))
    assert Ledger.from_dict(result["ledger"]) == sim.ledger
    assert result["epsilon"] == pytest.approx(sim.epsilon)
    assert result["clip_history"] == pytest.approx(sim.clip_history)
    theta = torch.tensor(result["theta"])
    torch.testing.assert_close(theta, torch.cat([p.detach().reshape(-1)
                                                 for p in sim.model.parameters()]))
    assert result["randomness"] == "reproducible" and result["privacy_unit"] == "user"
