"""The report as a new user meets it (issue 35): a spec that leaves ``delta`` out, one seed,
the HTML's tables and embedded JSON, the privacy-utility plot, a diverging run flagged."""

from __future__ import annotations

import contextlib
import io
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
    """The grid run once with ``dpclip run SPEC --report`` (delta left out of the spec); a label
    with HTML and script-ending characters tests the escaping."""
    tmp = tmp_path_factory.mktemp("nodelta")
    spec = tmp / "nodelta.toml"
    spec.write_text(SPEC_NO_DELTA.replace('label = "small"', 'label = "small</script>&<b>"'))
    db, out = tmp / "r.db", tmp / "out"
    buf_out, buf_err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf_out), contextlib.redirect_stderr(buf_err):
        rc = main(["run", str(spec), "--db", str(db), "--out", str(out), "--no-progress",
                   "--report"])
    return spec, db, out, rc, buf_out.getvalue(), buf_err.getvalue()


def test_run_report_without_delta_does_not_crash(grid, capsys):
    spec, db, out, rc, stdout, stderr = grid
    assert rc == 0, stderr
    md = (out / "nodelta.md").read_text()
    # the delta the runs used (chosen from N since the spec left it out) is named
    assert re.search(r"delta [0-9.e-]+", md) and "delta None" not in md
    # the Markdown report is written to a file, not dumped to stdout
    assert "| strategy |" not in stdout
    assert str(out / "nodelta.html") in stdout
    rc = main(["report", str(spec), "--db", str(db), "--out", str(out)])
    assert rc == 0


def test_one_seed_has_no_std(grid):
    out = grid[2]
    md = (out / "nodelta.md").read_text()
    assert "(n=1" in md and "+- 0.00" not in md
    assert "± 0.00" not in (out / "nodelta.html").read_text()


class _Tables(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tables, self.pre, self.scripts, self.imgs = 0, 0, [], []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        self.tables += tag == "table"
        self.pre += tag == "pre"
        if tag == "img":
            self.imgs.append(dict(attrs)["alt"])
        self._in_script = tag == "script"

    def handle_endtag(self, tag):
        self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.scripts.append(data)


def test_html_tables_are_tables_and_the_json_parses(grid):
    out = grid[2]
    page = (out / "nodelta.html").read_text()
    p = _Tables()
    p.feed(page)
    assert p.pre == 0 and p.tables >= 2  # the accuracy table and the settings table
    assert "<td>small&lt;/script&gt;&amp;&lt;b&gt;</td>" in page  # escaped in the table
    (data,) = p.scripts
    rows = json.loads(data)  # parses as JSON, as a script reads it
    assert {r["strategy"] for r in rows} == {"big", "small</script>&<b>"}
    assert "</script>&" not in data


def test_privacy_utility_plot_is_embedded(grid):
    out = grid[2]
    png = out / "nodelta_privacy_utility.png"
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"
    p = _Tables()
    p.feed((out / "nodelta.html").read_text())
    assert any("privacy-utility" in a for a in p.imgs)
    assert "![privacy-utility" in (out / "nodelta.md").read_text()


def test_diverging_run_is_flagged():
    from dpclip.harness.report import accuracy_table, diverged

    def run(clips, accs, label="quantile"):
        hist = [{"epoch": i + 1, "test_accuracy": a, "clip_threshold": c, "test_loss": 1.0}
                for i, (c, a) in enumerate(zip(clips, accs))]
        return {"label": label, "config": {"strategy": "quantile", "epsilon": 2.0,
                                           "noise_multiplier": None, "seed": 0},
                "summary": {"test_accuracy": accs[-1], "epsilon": 2.0}, "history": hist}

    bad = run([0.3, 3.0, 30.0], [0.5, 0.4, 0.21])
    assert diverged(bad) == "test accuracy fell from 50.0 % (best epoch) to 21.0 %"
    assert diverged(run([0.3, 3.0, 30.0], [0.2, 0.21, 0.22])) == \
        "the clip threshold grew from 0.3 to 30"
    good = run([1.0, 0.9, 0.8], [0.5, 0.7, 0.8], label="fixed")
    assert diverged(good) is None
    levels, rows = accuracy_table([bad, good])
    assert rows[0][levels[0]]["diverged"] == 1 and rows[1][levels[0]]["diverged"] == 0


def test_six_strategies_keep_a_readable_legend():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dpclip.harness.report import _legend

    fig, ax = plt.subplots()
    for i in range(6):
        ax.plot([0, 1], [i, i], label=f"strategy-{i} eps=1")
    _legend(ax, 6)
    leg = ax.get_legend()
    assert leg._ncols == 1  # one entry per line, outside the axes (not 2 columns over the data)
    assert leg.get_bbox_to_anchor().x0 > ax.get_window_extent().x1 - 1
    plt.close(fig)


def test_audit_report_plots_claim_against_bound_with_a_verdict(tmp_path):
    from dpclip.harness.report import audit_plot

    rows = [{"claimed_epsilon": 2.0, "lower_bound": 0.8, "violates_claim": False,
             "mode": "blackbox", "strategy": "fixed"},
            {"claimed_epsilon": 1.0, "lower_bound": 1.6, "violates_claim": True,
             "mode": "whitebox", "strategy": "fixed"}]
    path, verdict = audit_plot(rows[:1], tmp_path / "a.png")
    assert verdict == "PASS" and path.read_bytes()[:4] == b"\x89PNG"
    assert audit_plot(rows, tmp_path / "b.png")[1] == "FAIL"
