"""The report as a new user meets it (issue 35): a spec that leaves ``delta`` out, one seed,
the HTML's tables and embedded JSON, the privacy-utility plot, a diverging run flagged."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser

import pytest

from dpclip.cli import main

SPEC_NO_DELTA = """
name = "nodelta"
[train]
dataset = "synthetic"
model = "mlp"
epochs = 1
batch_size = 64
lr = 0.5
accountant = "rdp"
[grid]
epsilons = [1.0, 4.0]
seeds = [0]
[[strategies]]
name = "fixed"
label = "big"
params = { clip_norm = 1.0 }
[[strategies]]
name = "fixed"
label = "small"
params = { clip_norm = 0.1 }
"""


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """The grid run once with ``dpclip run SPEC --report`` (delta left out of the spec)."""
    tmp = tmp_path_factory.mktemp("nodelta")
    spec = tmp / "nodelta.toml"
    spec.write_text(SPEC_NO_DELTA)
    db, out = tmp / "r.db", tmp / "out"
    return spec, db, out


def test_run_report_without_delta_does_not_crash(grid, capsys):
    spec, db, out = grid
    rc = main(["run", str(spec), "--db", str(db), "--out", str(out), "--no-progress",
               "--report"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    md = (out / "nodelta.md").read_text()
    # the delta the runs used (chosen from N since the spec left it out) is named
    assert re.search(r"delta [0-9.e-]+", md) and "delta None" not in md
    # the Markdown report is written to a file, not dumped to stdout
    assert "| strategy |" not in captured.out
    assert str(out / "nodelta.html") in captured.out
    rc = main(["report", str(spec), "--db", str(db), "--out", str(out)])
    assert rc == 0
