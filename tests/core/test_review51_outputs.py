"""Fifty-first hostile review (of 76ed0fe): what leaves a run. Each of these published something
that follows the realised (private) batch size or a private value, unlabelled:

* the progress bar, redrawn after every step, showed its rate: each step's time (correlation 0.69
  with the realised batch size over 20 steps); it now counts epochs and shows no time;
* an evaluated epoch's ``wall_seconds``: with one step per epoch its differences were step times;
  a row now carries it only when it covers ``MIN_TIMED_STEPS`` steps;
* an error raised inside a private step quoted torch's shapes (``(56x8 and 9x2)``: 56 is the
  realised batch size) or the model's values: its numbers are removed
  (``DPCLIP_SHOW_PRIVATE_ERRORS=1`` shows the original, NON-PRIVATE);
* the tabular loader quoted a private cell or unknown labels (tests/data, tests/examples).
(The Flower ServerApp's per-round log lines: tests/federated/test_flower.py.)
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import dpclip
from dpclip.cli import main
from dpclip.engine.batch import padded_rows
from dpclip.training import trainer
from dpclip.training.private import SHOW_PRIVATE_ERRORS


def _private_with_a_shape_bug(engine: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(9, 2))  # 8 != 9: fails on every batch
    x, y = torch.randn(200, 4), torch.randint(0, 2, (200,))
    dp = dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y),
                             noise_multiplier=1.0, steps=2, batch_size=50.0, engine=engine,
                             verbose=False)
    return dp, dp.sample()


@pytest.mark.parametrize("engine", ["vmap", "naive"])
def test_an_error_inside_a_private_step_loses_its_numbers(engine, monkeypatch):
    monkeypatch.delenv(SHOW_PRIVATE_ERRORS, raising=False)
    dp, (xs, ys) = _private_with_a_shape_bug(engine)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as got:
        dp.backward(xs, ys)
    text = str(got.value)
    assert f"{len(xs)}x" not in text and not re.search(r"\(\d", text)
    assert SHOW_PRIVATE_ERRORS in text and got.value.__cause__ is None
    assert got.value.__suppress_context__


def test_the_original_error_is_shown_when_asked(monkeypatch):
    monkeypatch.setenv(SHOW_PRIVATE_ERRORS, "1")
    dp, (xs, ys) = _private_with_a_shape_bug("vmap")
    # (the rows the engine ran: the batch padded to the row block, dpclip.engine.batch)
    with pytest.raises(RuntimeError, match=rf"\({padded_rows(len(xs))}x8 and 9x2\)"):
        dp.backward(xs, ys)


def _train(tmp_path, *extra):
    return main(["train", "--dataset", "synthetic", "--model", "logreg", "--strategy", "fixed",
                 "--param", "clip_norm=0.5", "--noise-multiplier", "1.0", "--delta", "1e-5",
                 "--lr", "0.5", "--db", str(tmp_path / "r.db"), *extra])


def test_the_progress_bar_counts_epochs_and_shows_no_time(tmp_path, capsys):
    assert _train(tmp_path, "--epochs", "3", "--batch-size", "32") == 0
    err = capsys.readouterr().err
    assert "epochs" in err
    assert not re.search(r"step/s|s/step|it/s|s/it|\d\d:\d\d", err), err[-500:]


def test_an_epoch_row_of_few_steps_carries_no_wall_time(tmp_path):
    import sqlite3
    import json

    # synthetic: 512 examples; batch 256 -> 2 steps an epoch (< MIN_TIMED_STEPS)
    assert trainer.MIN_TIMED_STEPS > 2
    assert _train(tmp_path, "--epochs", "3", "--batch-size", "256", "--no-progress") == 0
    con = sqlite3.connect(tmp_path / "r.db")
    rows = [json.loads(m) for (m,) in con.execute("SELECT metrics FROM epochs")]
    assert rows and all(r.get("wall_seconds") is None for r in rows)
    (summary,) = con.execute("SELECT summary FROM runs").fetchone()
    assert json.loads(summary)["wall_seconds"] > 0  # (the run's total stays)
