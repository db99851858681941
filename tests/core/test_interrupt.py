"""Ctrl-C as a new user presses it (issue 35): the run stops between two steps, writes its
checkpoint, is marked ``interrupted`` (not ``failed``), says how to resume without a traceback;
the same command resumes and says from where; an input refused before training leaves no row."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import threading
import time

import pytest

from dpclip.cli import main
from dpclip.interrupts import TrainingInterrupted
from dpclip.training.trainer import TrainConfig, train

FAST = dict(dataset="synthetic", model="logreg", strategy="fixed",
            strategy_params={"clip_norm": 1.0}, dataset_options={"n_train": 128, "n_test": 32},
            delta=1e-5, epochs=3, batch_size=32, lr=0.5, noise_multiplier=1.0)


def _sigint_self(row):
    os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C in the terminal


def test_sigint_stops_between_steps_checkpoints_and_resumes(tmp_path, capsys):
    cfg = TrainConfig(**FAST)
    with pytest.raises(TrainingInterrupted) as info:
        train(cfg, checkpoint_dir=tmp_path, progress=False, on_epoch=_sigint_self)
    exc = info.value
    assert isinstance(exc, KeyboardInterrupt)
    assert (exc.step, exc.total_steps) == (4, 12)  # after the first epoch's last step
    assert exc.checkpoint == tmp_path / "checkpoint.pt" and exc.checkpoint.exists()
    assert exc.message() == "interrupted at step 4/12; run the same command to resume"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored
    capsys.readouterr()
    resumed = train(cfg, checkpoint_dir=tmp_path, progress=False)
    err = capsys.readouterr().err
    assert f"resumed from step 4 (epsilon so far {exc.epsilon:.4g})" in err
    assert resumed.summary["steps"] == 12 and resumed.ledger.steps == 12
    # without a checkpoint directory the message says it cannot be resumed, and why
    with pytest.raises(TrainingInterrupted, match="no checkpoint was written, so it cannot be "
                                                  "resumed: pass checkpoint_dir="):
        train(cfg, progress=False, on_epoch=_sigint_self)


CLI = ["train", "--dataset", "synthetic", "--model", "logreg", "--delta", "1e-5",
       "--batch-size", "16", "--lr", "0.5", "--no-progress", "--noise-multiplier", "1",
       "--dataset-option", "n_train=1024", "--epochs", "4"]


def test_cli_ctrl_c_marks_interrupted_and_the_same_command_resumes(tmp_path, capsys):
    """`dpclip train` in this process; Ctrl-C arrives (from another thread, as from the terminal)
    once the run has started."""
    db = tmp_path / "r.db"

    def press_ctrl_c() -> None:
        deadline = time.time() + 120
        while time.time() < deadline:
            time.sleep(0.05)
            try:
                if sqlite3.connect(db).execute("SELECT count(*) FROM runs").fetchone()[0]:
                    break
            except sqlite3.OperationalError:
                continue
        os.kill(os.getpid(), signal.SIGINT)

    presser = threading.Thread(target=press_ctrl_c)
    presser.start()
    rc = main([*CLI, "--db", str(db)])
    presser.join()
    err = capsys.readouterr().err
    assert rc == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    m = re.search(r"dpclip train: interrupted at step (\d+)/256; run the same command to "
                  r"resume", err)
    assert m, err
    con = sqlite3.connect(db)
    assert con.execute("SELECT status FROM runs").fetchall() == [("interrupted",)]
    assert len(list((tmp_path / "out-private" / "checkpoints").glob("*/checkpoint.pt"))) == 1
    assert not (tmp_path / "out" / "checkpoints").exists()  # never beside the published reports
    # the same command resumes from the checkpoint
    assert main([*CLI, "--db", str(db)]) == 0
    assert f"resumed from step {m.group(1)} (epsilon so far" in capsys.readouterr().err
    assert con.execute("SELECT status FROM runs ORDER BY id").fetchall() == [
        ("interrupted",), ("finished",)]
    assert not list((tmp_path / "out-private" / "checkpoints").glob("*/checkpoint.pt"))  # cleaned up


def test_refused_input_leaves_no_row(tmp_path, capsys):
    db = tmp_path / "r.db"
    rc = main(["train", "--dataset", "synthetic", "--model", "logreg", "--delta", "1e-5",
               "--epochs", "1", "--batch-size", "32", "--no-progress", "--dataset-option",
               "n_train=128", "--epsilon", "0.1", "--noise-multiplier", "1", "--db", str(db)])
    assert rc == 2 and "allows 0 of the 4 planned steps" in capsys.readouterr().err
    assert sqlite3.connect(db).execute("SELECT count(*) FROM runs").fetchone()[0] == 0


SPEC = """
name = "ctrlc"
[train]
dataset = "synthetic"
model = "logreg"
epochs = 4
batch_size = 16
lr = 0.5
delta = 1e-5
dataset_options = { n_train = 1024 }
[grid]
epsilons = [2.0]
seeds = [0]
[[strategies]]
name = "fixed"
params = { clip_norm = 1.0 }
"""


@pytest.mark.slow
def test_dpclip_run_ctrl_c_marks_the_run_interrupted_and_resumes(tmp_path, capsys):
    spec, db, out = tmp_path / "ctrlc.toml", tmp_path / "r.db", tmp_path / "out"
    spec.write_text(SPEC)
    args = ["run", str(spec), "--db", str(db), "--out", str(out), "--no-progress"]

    def press_ctrl_c() -> None:
        deadline = time.time() + 120
        while time.time() < deadline:
            time.sleep(0.05)
            try:
                if sqlite3.connect(db).execute("SELECT count(*) FROM runs").fetchone()[0]:
                    break
            except sqlite3.OperationalError:
                continue
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGINT)

    presser = threading.Thread(target=press_ctrl_c)
    presser.start()
    rc = main(args)
    presser.join()
    err = capsys.readouterr().err
    assert rc == 130 and "Traceback" not in err, err
    m = re.search(r"dpclip run: interrupted at step (\d+)/256; run the same command to resume",
                  err)
    assert m, err
    con = sqlite3.connect(db)
    assert con.execute("SELECT status FROM runs").fetchall() == [("interrupted",)]
    assert main(args) == 0
    assert f"resumed from step {m.group(1)}" in capsys.readouterr().err
    assert con.execute("SELECT status FROM runs ORDER BY id").fetchall() == [
        ("interrupted",), ("finished",)]
