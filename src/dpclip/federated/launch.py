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
import random
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


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux; the IANA range elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def _free_port(taken: set[int] | None = None) -> int:
    """A port free on 127.0.0.1 now, outside the kernel's range for outgoing connections and not
    in ``taken`` (which it joins). A port picked from that range (``bind(0)``) can be taken as the
    source port of any connection made before the process meant for it binds it: the SuperNodes
    connect to the SuperLink while the later ones start."""
    taken = set() if taken is None else taken
    low, _ = _ephemeral_range()
    pick = random.Random()
    for _ in range(200):
        port = pick.randrange(20000, low) if low > 21000 else pick.randrange(low // 2, low)
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        taken.add(port)
        return port
    with socket.socket() as s:  # (a crowded machine: the kernel's choice)
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    taken.add(port)
    return port


def _log_tails(logs: Path, lines: int = 12) -> str:
    """The last lines of every log that reports an error (all of them if none does)."""
    files = sorted(logs.glob("*.log"))
    bad = [f for f in files if any(k in f.read_text(errors="replace")
                                   for k in ("Traceback", "ERROR", "Error"))]
    out = []
    for f in bad or files:
        tail = f.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {f.name} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "\n".join(out)


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
    ports: set[int] = set()
    port = _free_port(ports)
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
    stream = None
    try:
        start([tools[0], "--insecure", "--isolation", "subprocess",
               "--disable-runtime-dependency-installation", "--host", "127.0.0.1",
               "--port", str(port), "--database", str(work / "superlink.db")], "superlink.log")
        while time.monotonic() < deadline:  # the SuperLink's API is up
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if procs[0].poll() is not None:
                raise RuntimeError(f"the SuperLink exited before its API was up:\n"
                                   f"{_log_tails(logs)}\n(logs: {logs})")
            time.sleep(0.3)
        for user in range(users):
            start([tools[1], "--insecure", "--superlink", f"127.0.0.1:{port}",
                   "--port", str(_free_port(ports)), "--node-config", f"user={user}"],
                  f"supernode{user}.log")
        run = subprocess.Popen([tools[2], "run", str(app), "local", "--stream"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
        procs.append(run)
        assert run.stdout is not None
        os.set_blocking(run.stdout.fileno(), False)
        tail: list[str] = []
        echoed = 0
        stream = open(logs / "run.log", "w")  # what ``flwr run --stream`` printed, kept
        procs_started = list(procs[:-1])
        while time.monotonic() < deadline and not result_path.exists():
            line = run.stdout.readline()
            if line:
                stream.write(line)
                stream.flush()
                tail = (tail + [line.rstrip()])[-40:]
                if "dpclip fl: round" in line:
                    echo(line[line.index("dpclip fl: round"):].rstrip())
                    echoed += 1
                continue
            dead = [p for p in procs_started if p.poll() is not None]
            if dead:  # a SuperNode (or the SuperLink) ended: the run cannot finish
                raise RuntimeError(f"{len(dead)} of the Flower processes exited during the run "
                                   f"(exit codes {[p.returncode for p in dead]}):\n"
                                   f"{_log_tails(logs)}\n(logs: {logs})")
            if run.poll() is not None and not result_path.exists():
                time.sleep(1.0)  # the ServerApp writes the result as the run ends
                if not result_path.exists():
                    raise RuntimeError("the Flower run ended without a result:\n"
                                       + "\n".join(tail[-20:]) + "\n" + _log_tails(logs)
                                       + f"\n(logs: {logs})")
            time.sleep(0.2)
        if not result_path.exists():
            raise RuntimeError(f"the Flower run did not finish within {limit:.0f} s (--timeout); "
                               "every process was stopped; the server's last lines:\n"
                               + "\n".join(tail[-20:]) + f"\n{_log_tails(logs)}\n(logs: {logs})")
        time.sleep(0.5)  # the file is written in one call; let it close
    finally:
        _stop(procs)
        if stream is not None:
            stream.close()
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
