"""DP-FedAvg on Flower's own gRPC runtime (server + one process per user on localhost).

Skipped without the optional extra (``pip install 'dpclip[flower]'``). Bounded in time: every
process is killed in ``finally``; the whole test stays under ~90 s.
"""

from __future__ import annotations

import json
import os
import signal
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


def _assert_matches_simulation(result: dict, spec: dict) -> None:
    """The Flower run recorded what the in-process simulation records with the same plan and
    randomness: the same ledger, epsilon, clip trajectory and final parameters."""
    data, model, strategy, config = build_run(spec)
    sim = run_fedavg(data, model, strategy, config,
                     randomness=PrivateRandomness.reproducible(spec["seed"]))
    assert Ledger.from_dict(result["ledger"]) == sim.ledger
    assert result["epsilon"] == pytest.approx(sim.epsilon)
    assert result["clip_history"] == pytest.approx(sim.clip_history)
    torch.testing.assert_close(torch.tensor(result["theta"]), torch.cat(
        [p.detach().reshape(-1) for p in sim.model.parameters()]))


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
    assert result["rounds"] == SPEC["rounds"] and "failures" not in result

    # the same plan in process: same users, same noise, same ledger, same parameters
    _assert_matches_simulation(result, SPEC)
    assert result["randomness"] == "reproducible" and result["privacy_unit"] == "user"


def _start(cmd: list[str], log, env) -> subprocess.Popen:
    # a session of its own: killing the group also ends the SuperExec / app processes it starts
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=10)


DEPLOY_SPEC = {**SPEC, "num_users": 3, "rounds": 2, "seed": 7}


def test_flower_deployment_engine_superlink_supernodes_flwr_run(tmp_path):
    """ServerApp/ClientApp through Flower's deployment runtime: one SuperLink, one SuperNode per
    user, ``flwr run`` of the Flower App; the ledger equals the in-process simulation's."""
    from dpclip.federated.flower import write_flower_app

    bindir = os.path.dirname(sys.executable)
    tools = [os.path.join(bindir, t) for t in ("flower-superlink", "flower-supernode", "flwr")]
    if not all(os.path.exists(t) for t in tools):
        pytest.skip("Flower's deployment executables are not installed beside this Python")
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(DEPLOY_SPEC))
    out = tmp_path / "result.json"
    app = write_flower_app(tmp_path / "app", spec_path, out, wait_timeout=60)
    home = tmp_path / "flwr_home"
    home.mkdir()
    port = _free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "test"\n[superlink.test]\naddress = "127.0.0.1:{port}"\n'
        "insecure = true\n")
    env = {**os.environ, "FLWR_HOME": str(home), "PATH": bindir + os.pathsep + os.environ["PATH"],
           "PYTHONUNBUFFERED": "1", "GRPC_VERBOSITY": "ERROR",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    logs = tmp_path / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen] = []
    deadline = time.monotonic() + 200  # generous: each message starts a process
    try:
        procs.append(_start([tools[0], "--insecure", "--isolation", "subprocess",
                             "--disable-runtime-dependency-installation", "--host", "127.0.0.1",
                             "--port", str(port), "--database", str(tmp_path / "link.db")],
                            open(logs / "superlink.log", "w"), env))
        while time.monotonic() < deadline:  # the SuperLink's HTTP API is up
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.3)
        for user in range(DEPLOY_SPEC["num_users"]):
            procs.append(_start([tools[1], "--insecure", "--superlink", f"127.0.0.1:{port}",
                                 "--port", str(_free_port()), "--node-config", f"user={user}"],
                                open(logs / f"supernode{user}.log", "w"), env))
        run = subprocess.run([tools[2], "run", str(app), "test", "--stream"], env=env,
                             capture_output=True, text=True,
                             timeout=max(deadline - time.monotonic(), 1))
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        if not out.exists():
            pytest.fail("the ServerApp wrote no result within the time bound:\n"
                        + run.stdout[-3000:] + run.stderr[-2000:])
    finally:
        _stop(procs)
    result = json.loads(out.read_text())
    assert result["rounds"] == DEPLOY_SPEC["rounds"] and "failures" not in result
    # Flower's own lines named each round's realised number of sampled users and of failures
    # (private under Poisson sampling: fifty-first hostile review); the ServerApp silences them
    assert "configure_fit" not in run.stdout + run.stderr
    assert "aggregate_fit" not in run.stdout + run.stderr
    _assert_matches_simulation(result, DEPLOY_SPEC)


def test_flower_app_run_config_and_node_config_errors(tmp_path):
    from flwr.common import Context, RecordDict

    from dpclip.federated.flower import _client_fn, write_flower_app

    app = write_flower_app(tmp_path / "app", tmp_path / "s.json", tmp_path / "o.json")
    toml = (app / "pyproject.toml").read_text()
    assert 'serverapp = "dpclip_fedavg_app:server_app"' in toml and "s.json" in toml
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                  run_config={"spec": str(tmp_path / "s.json")})
    with pytest.raises(ValueError, match='--node-config "user=U"'):
        _client_fn(ctx)
    ctx = Context(run_id=1, node_id=1, node_config={"user": 0}, state=RecordDict(), run_config={})
    with pytest.raises(ValueError, match="run config needs `spec`"):
        _client_fn(ctx)


def test_flower_simulation_engine_matches_in_process(tmp_path):
    """Flower's Ray-based simulation engine with the same apps (skipped without Ray, which the
    `test` extra does not install: pip install 'flwr[simulation]')."""
    pytest.importorskip("ray", reason="Flower's simulation engine needs Ray (flwr[simulation])")
    from flwr.simulation import run_simulation

    from dpclip.federated.flower import flower_apps

    spec_path, out = tmp_path / "spec.json", tmp_path / "result.json"
    spec_path.write_text(json.dumps(DEPLOY_SPEC))
    server, client = flower_apps(spec_path, out)
    run_simulation(server_app=server, client_app=client,
                   num_supernodes=DEPLOY_SPEC["num_users"],
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 2}})
    _assert_matches_simulation(json.loads(out.read_text()), DEPLOY_SPEC)
