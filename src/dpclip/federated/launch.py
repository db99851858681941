"""``dpclip fl flower --spec run.json``: a user-level DP-FedAvg run on Flower's deployment engine
(``flwr run`` of a ServerApp/ClientApp), started on this machine in one command.

It does what docs/federated.md shows step by step: checks the spec (a refused configuration ends
here, before any process starts), writes the Flower App (:func:`~dpclip.federated.flower.
write_flower_app`), starts one SuperLink (``flower-superlink --insecure``) and one SuperNode per
user (``flower-supernode --insecure --node-config "user=U"``) on localhost, runs
``flwr run APP local --stream``, prints the server's line per round, and stops every process it
started when the run ends (or fails, or times out): no client is left waiting. The public result
(ledger, user-level epsilon, clip per round, test accuracy of the final model) is written to
``--out`` and stored in the results store like every run.

Privacy: as :mod:`dpclip.federated.flower` (central DP, trusted server); the processes exchange
raw deltas over localhost only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["run_local_deployment"]

TOOLS = ("flower-superlink", "flower-supernode", "flwr")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:  # each in its own session: the group includes the app processes it started
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=5)


def run_local_deployment(spec_path: str | os.PathLike, *, out: str | os.PathLike | None = None,
                         timeout: float | None = None, workdir: str | os.PathLike | None = None,
                         echo: Any = print) -> dict[str, Any]:
    """Run the spec on a local SuperLink with one SuperNode per user; return the result dict.

    ``timeout`` (seconds, default 120 + 20 per user and round) bounds the whole run; on expiry
    every process is stopped and a ``RuntimeError`` names the logs."""
    from dpclip.federated.flower import check_spec, write_flower_app
    from dpclip.federated.spec import build_data

    spec_path = Path(spec_path).resolve()
    try:
        spec = json.loads(spec_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--spec {str(spec_path)!r}: {exc}; give the JSON file of the run "
                         "(docs/federated.md has one to copy)") from None
    check_spec(spec)  # every refusal before any process
    users = int(build_data(spec).num_users)
    rounds = int(spec.get("rounds", 1))
    bindir = os.path.dirname(sys.executable)
    tools = [os.path.join(bindir, t) for t in TOOLS]
    missing = [t for t in tools if not os.path.exists(t)]
    if missing:
        raise RuntimeError(f"Flower's executables are missing beside {sys.executable}: "
                           f"{', '.join(missing)}; pip install 'dpclip[flower]'")
    limit = float(timeout) if timeout is not None else 120.0 + 20.0 * users * rounds
    work = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="dpclip-fl-"))
    work.mkdir(parents=True, exist_ok=True)
    result_path = Path(out).resolve() if out is not None else work / "result.json"
    if result_path.exists():
        result_path.unlink()
    app = write_flower_app(work / "app", spec_path, result_path)
    home = work / "flwr_home"
    home.mkdir(exist_ok=True)
    port = _free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "local"\n[superlink.local]\naddress = "127.0.0.1:{port}"\n'
        "insecure = true\n")
    env = {**os.environ, "FLWR_HOME": str(home), "PATH": bindir + os.pathsep + os.environ["PATH"],
           "PYTHONUNBUFFERED": "1", "GRPC_VERBOSITY": "ERROR", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    procs: list[subprocess.Popen] = []
    deadline = time.monotonic() + limit

    def start(cmd: list[str], name: str) -> None:
        procs.append(subprocess.Popen(cmd, stdout=open(logs / name, "w"),
                                      stderr=subprocess.STDOUT, env=env, start_new_session=True))

    echo(f"dpclip fl flower: {users} users, {rounds} rounds on localhost:{port} (logs: {logs})")
    try:
        start([tools[0], "--insecure", "--isolation", "subprocess",
               "--disable-runtime-dependency-installation", "--host", "127.0.0.1",
               "--port", str(port), "--database", str(work / "superlink.db")], "superlink.log")
        while time.monotonic() < deadline:  # the SuperLink's API is up
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if procs[0].poll() is not None:
                raise RuntimeError(f"the SuperLink exited; see {logs / 'superlink.log'}")
            time.sleep(0.3)
        for user in range(users):
            start([tools[1], "--insecure", "--superlink", f"127.0.0.1:{port}",
                   "--port", str(_free_port()), "--node-config", f"user={user}"],
                  f"supernode{user}.log")
        run = subprocess.Popen([tools[2], "run", str(app), "local", "--stream"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
        procs.append(run)
        assert run.stdout is not None
        os.set_blocking(run.stdout.fileno(), False)
        tail: list[str] = []
        echoed = 0
        while time.monotonic() < deadline and not result_path.exists():
            line = run.stdout.readline()
            if line:
                tail = (tail + [line.rstrip()])[-40:]
                if "dpclip fl: round" in line:
                    echo(line[line.index("dpclip fl: round"):].rstrip())
                    echoed += 1
                continue
            if run.poll() is not None and not result_path.exists():
                time.sleep(1.0)  # the ServerApp writes the result as the run ends
                if not result_path.exists():
                    raise RuntimeError("the Flower run ended without a result:\n"
                                       + "\n".join(tail[-20:]) + f"\n(logs: {logs})")
            time.sleep(0.2)
        if not result_path.exists():
            raise RuntimeError(f"the Flower run did not finish within {limit:.0f} s (--timeout); "
                               f"every process was stopped; logs: {logs}")
        time.sleep(0.5)  # the file is written in one call; let it close
    finally:
        _stop(procs)
    result = json.loads(result_path.read_text())
    clips = result.get("clip_history") or []
    done = max(len(clips), int(result.get("rounds") or 0))
    # rounds whose streamed line had not been read when the result appeared (the loop above stops
    # at the result file: under load the server's last lines were still in the pipe, and a run
    # without a clip history echoed none of them)
    for r in range(echoed, done):
        echo(f"dpclip fl: round {r + 1}/{rounds} done"
             + (f", clip {clips[r]:.4g}" if r < len(clips) else ""))
    return result
