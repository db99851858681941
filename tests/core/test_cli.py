import json
import sqlite3

import pytest

from dpclip.cli import main

REQUIRED = {"dataset", "model", "strategy", "params", "epsilon", "delta", "accountant",
            "noise_multiplier", "sample_rate", "steps", "epochs", "test_accuracy", "wall_seconds"}


def test_train_json_and_store(tmp_path, capsys):
    db = tmp_path / "r.db"
    rc = main(["train", "--dataset", "synthetic", "--model", "logreg", "--strategy", "fixed",
               "--param", "clip_norm=0.5", "--noise-multiplier", "1.0", "--delta", "1e-5",
               "--epochs", "1", "--batch-size", "32", "--lr", "0.5", "--db", str(db),
               "--no-progress", "--json"])
    assert rc == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    obj = json.loads(last)
    assert REQUIRED <= set(obj)
    assert obj["params"] == {"clip_norm": 0.5}
    con = sqlite3.connect(db)
    (status, summary), = con.execute("SELECT status, summary FROM runs").fetchall()
    assert status == "finished" and json.loads(summary)["epsilon"] == obj["epsilon"]
    assert con.execute("SELECT count(*) FROM epochs").fetchone()[0] == 1


def test_epsilon_command(capsys):
    rc = main(["epsilon", "--sample-rate", str(256 / 60000), "--noise-multiplier", "1.1",
               "--steps", str(60 * 60000 // 256), "--delta", "1e-5", "--accountant", "rdp",
               "--json"])
    assert rc == 0
    obj = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert obj["accountant"] == "rdp" and 2.5 < obj["epsilon"] < 2.7


@pytest.mark.parametrize("what", ["strategies", "datasets", "models"])
def test_list_commands(what, capsys):
    assert main([what, "--json"]) == 0
    obj = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    names = [r["name"] for r in obj[what]]
    expect = {"strategies": "fixed", "datasets": "fashion-mnist", "models": "papernot-cnn"}[what]
    assert expect in names


def test_unknown_strategy_is_a_clear_error(capsys):
    rc = main(["train", "--dataset", "synthetic", "--model", "mlp", "--strategy", "nope",
               "--noise-multiplier", "1", "--delta", "1e-5", "--epochs", "1",
               "--batch-size", "8", "--lr", "0.1", "--no-progress"])
    assert rc == 2
    assert "valid strategies" in capsys.readouterr().err
