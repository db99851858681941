"""`dpclip fl train` as a new user runs it (issue 35): a line per evaluated round, and the run in
the results store like every other run (a refused spec leaves no row)."""

from __future__ import annotations

import sqlite3

from dpclip.cli import main

ARGS = ["fl", "train", "--dataset", "synthetic", "--dataset-option", "n_train=120",
        "--num-users", "20", "--rounds", "3", "--clients-per-round", "5", "--strategy", "fixed",
        "--noise-multiplier", "0.5", "--delta", "1e-3", "--model-option", "hidden=[8]",
        "--eval-every", "1"]


def test_fl_train_prints_per_round_and_stores_the_run(tmp_path, capsys):
    db = tmp_path / "r.db"
    assert main([*ARGS, "--db", str(db)]) == 0
    out = capsys.readouterr().out
    for r in (1, 2, 3):
        assert f"round {r:>4}/3  test_acc " in out
    assert "stored as run 1 in" in out
    con = sqlite3.connect(db)
    assert con.execute("SELECT status FROM runs").fetchall() == [("finished",)]
    assert con.execute("SELECT count(*) FROM epochs").fetchone()[0] == 3


def test_fl_train_refused_spec_leaves_no_row(tmp_path, capsys):
    db = tmp_path / "r.db"
    bad = [a if a != "1e-3" else "0.5" for a in ARGS]  # delta 0.5: refused before any round
    assert main([*bad, "--db", str(db)]) == 2
    assert "delta=0.5 is >= 1/N = 1/20 (20 users, the privacy unit)" in capsys.readouterr().err
    assert not db.exists() or sqlite3.connect(db).execute(
        "SELECT count(*) FROM runs").fetchone()[0] == 0


def test_fl_train_runs_report_per_round(tmp_path, capsys):
    """`dpclip fl train` runs are the experiment `fl-train`: `dpclip report fl-train` plots them
    per round (accuracy, clip, epsilon), embedded in the self-contained HTML."""
    db = tmp_path / "r.db"
    assert main([*ARGS, "--db", str(db)]) == 0
    assert main(["report", "fl-train", "--db", str(db), "--out", str(tmp_path / "rep")]) == 0
    page = (tmp_path / "rep" / "fl-train.html").read_text()
    assert "test accuracy per round" in page and "data:image/png;base64," in page
