"""The documented Flower command (docs/federated.md, issue 35): `dpclip fl flower --spec run.json`
with the run.json printed there (6 users, 3 rounds) on localhost, first time, within its timeout;
a refused spec ends before any process starts."""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import pytest

from dpclip.cli import main

pytest.importorskip("flwr", reason="Flower not installed (pip install 'dpclip[flower]')")

DOC = Path(__file__).resolve().parents[2] / "docs" / "federated.md"


def documented_spec() -> dict:
    text = DOC.read_text()
    section = text[text.index("### Run it"):]
    return json.loads(re.search(r"```json\n(.*?)```", section, re.S).group(1))


def test_refused_spec_ends_before_any_process(tmp_path, capsys):
    spec = dict(documented_spec(), delta=0.5)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(spec))
    rc = main(["fl", "flower", "--spec", str(path), "--workdir", str(tmp_path / "w"),
               "--db", str(tmp_path / "r.db")])
    assert rc == 2
    assert "delta=0.5 is >= 1/N = 1/6 (6 users, the privacy unit)" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()  # nothing was started


def test_client_refuses_the_spec_the_server_would_refuse(tmp_path, capsys):
    from dpclip.federated.flower import main as flower_main

    path = tmp_path / "run.json"
    path.write_text(json.dumps(dict(documented_spec(), delta=0.5)))
    rc = flower_main(["client", "--address", "127.0.0.1:1", "--spec", str(path), "--user", "0"])
    assert rc == 2
    assert capsys.readouterr().err.startswith("dpclip fl client: error: delta=0.5 is >= 1/N")


@pytest.mark.slow
def test_documented_command_runs_6_clients_3_rounds_first_time(tmp_path, capsys):
    spec = documented_spec()
    assert (spec["num_users"], spec["rounds"]) == (6, 3)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(spec))
    db = tmp_path / "r.db"
    rc = main(["fl", "flower", "--spec", str(path), "--out", str(tmp_path / "result.json"),
               "--workdir", str(tmp_path / "w"), "--db", str(db), "--timeout", "540"])
    captured = capsys.readouterr()
    out = captured.out
    assert rc == 0, out + captured.err  # (the error names the logs' last lines)
    for r in (1, 2, 3):
        assert f"dpclip fl: round {r}/3 done" in out
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["rounds"] == 3 and "failures" not in result
    assert 0 <= result["test_accuracy"] <= 1 and result["epsilon"] > 0
    assert sqlite3.connect(db).execute("SELECT status FROM runs").fetchall() == [("finished",)]


def test_server_wait_scales_with_the_number_of_clients():
    from dpclip.federated.flower import _server_for

    spec = documented_spec()
    fl, _ = _server_for(spec, None)
    assert fl.wait_timeout == 30.0 + 10.0 * 6  # the old fixed 60 s was too short for 6 on 2 cores
    fl, _ = _server_for(dict(spec, num_users=20, dataset_options={"n_train": 400}), None)
    assert fl.wait_timeout == 230.0
    assert _server_for(spec, 15.0)[0].wait_timeout == 15.0  # --wait-timeout still wins


def test_ports_are_outside_the_outgoing_range_distinct_and_free():
    import socket

    from dpclip.federated.launch import _ephemeral_range, _free_port

    low, high = _ephemeral_range()
    taken: set[int] = set()
    ports = [_free_port(taken) for _ in range(30)]
    assert len(set(ports)) == 30 and taken == set(ports)
    # (a port in the range can become the source port of the SuperNodes' own connections)
    assert all(not low <= p <= high for p in ports)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_failure_names_the_log_lines_that_report_it(tmp_path):
    from dpclip.federated.launch import _log_tails

    (tmp_path / "supernode0.log").write_text("INFO ok\n" * 50)
    (tmp_path / "supernode1.log").write_text("INFO start\nTraceback (most recent call last):\n"
                                             "OSError: [Errno 98] Address already in use\n")
    text = _log_tails(tmp_path)
    assert "supernode1.log" in text and "Address already in use" in text
    assert "supernode0.log" not in text
