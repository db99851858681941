"""Experiment harness end to end on a tiny synthetic grid: spec, runner, kill/resume, report."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from dpclip.cli import main
from dpclip.harness.spec import SpecError, load_spec, parse_spec

SPEC = """
name = "tiny"
[train]
dataset = "synthetic"
model = "mlp"
epochs = 2
batch_size = 64
lr = 0.5
optimizer = "momentum"
delta = 1e-5
accountant = "rdp"
diagnostics = true
[grid]
epsilons = [1.0, 4.0]
seeds = [0, 1]
[[strategies]]
name = "fixed"
label = "big"
params = { clip_norm = 1.0 }
[[strategies]]
name = "fixed"
label = "small"
params = { clip_norm = 0.1 }
train = { lr = 2.0 }
"""


@pytest.fixture
def spec_file(tmp_path):
    p = tmp_path / "tiny.toml"
    p.write_text(SPEC)
    return p


def test_spec_expands_and_overrides(spec_file):
    spec = load_spec(spec_file)
    runs = spec.runs()
    assert len(runs) == 2 * 2 * 2
    assert {r.label for r in runs} == {"big", "small"}
    assert {r.config.lr for r in runs if r.label == "small"} == {2.0}
    assert len({r.fingerprint for r in runs}) == 8
    spec2 = load_spec(spec_file, ["train.epochs=1", "grid.seeds=[5]",
                                  "strategies.big.params.clip_norm=3.0"])
    runs2 = spec2.runs()
    assert len(runs2) == 4 and all(r.config.epochs == 1 and r.config.seed == 5 for r in runs2)
    assert {r.config.strategy_params["clip_norm"] for r in runs2} == {3.0, 0.1}


@pytest.mark.parametrize("mutate,match", [
    (lambda s: s.replace('epsilons = [1.0, 4.0]', 'epsilons = [1.0]\nnoise_multipliers = [1.0]'),
     "exactly one of"),
    (lambda s: s.replace('name = "fixed"\nlabel = "big"', 'name = "nope"\nlabel = "x"'),
     "unknown strategy"),
    (lambda s: s.replace('lr = 0.5', 'lr = 0.5\nlearning_rate = 1'), "unknown field"),
    (lambda s: s.replace('model = "mlp"', 'model = "resnet-1000"'), "unknown model"),
    (lambda s: s.replace('label = "small"', 'label = "big"'), "duplicate label"),
])
def test_spec_validation_errors(tmp_path, mutate, match):
    p = tmp_path / "bad.toml"
    p.write_text(mutate(SPEC))
    with pytest.raises(SpecError, match=match):
        load_spec(p)


def test_unknown_preset_lists_presets():
    with pytest.raises(SpecError, match="quick"):
        load_spec("no-such-preset")


def test_quick_preset_is_tuned_with_one_budget():
    """The demo compares a few strategies with settings from the tuning protocol (the same
    budget for each, selected on validation data), at one epsilon on Fashion-MNIST."""
    from dpclip.clipping import STRATEGIES

    spec = load_spec("quick")
    assert {s.name for s in spec.strategies} <= {n for n, e in STRATEGIES.items()
                                                 if e.kind == "norm"}
    assert len(spec.strategies) >= 3 and all(s.tune for s in spec.strategies)
    assert spec.tuning is not None and spec.tuning.source == "validation"
    assert spec.datasets == ("fashion-mnist",) and len(spec.epsilons) == 1


class _Parser(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.imgs = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "img":
            self.imgs.append(dict(attrs)["src"])


RUNNER = """
import sys
from dpclip.cli import main
sys.exit(main(["run", sys.argv[1], "--db", sys.argv[2], "--out", sys.argv[3], "--no-progress"]))
"""


def test_grid_killed_and_resumed_then_reported(spec_file, tmp_path):
    db, out = tmp_path / "r.db", tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, str(spec_file), str(db), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    finished = 0
    while time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
        if db.exists():
            try:
                finished = sqlite3.connect(db).execute(
                    "SELECT count(*) FROM runs WHERE status='finished'").fetchone()[0]
            except sqlite3.OperationalError:
                continue
            if finished >= 3:
                break
    assert proc.poll() is None, "runner ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = sqlite3.connect(db).execute(
        "SELECT count(*) FROM runs WHERE status='finished'").fetchone()[0]
    assert 3 <= done_before < 8
    rc = main(["run", str(spec_file), "--db", str(db), "--out", str(out), "--no-progress",
               "--report", "--json"])
    assert rc == 0
    con = sqlite3.connect(db)
    assert con.execute("SELECT count(*) FROM runs WHERE status='finished'").fetchone()[0] == 8
    assert con.execute("SELECT count(DISTINCT fingerprint) FROM runs WHERE status='finished'"
                       ).fetchone()[0] == 8  # nothing was run twice
    md = (out / "tiny.md").read_text()
    assert "big" in md and "eps=1" in md and "eps=4" in md and "**" in md
    for name in ("tiny_test_accuracy.png", "tiny_clip_threshold.png", "tiny_epsilon.png",
                 "tiny_nonprivate_norm_quantiles.png", "tiny_nonprivate_cosine.png",
                 "tiny_nonprivate_bias.png"):
        png = out / name
        assert png.exists() and png.stat().st_size > 1000
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    parser = _Parser()
    parser.feed((out / "tiny.html").read_text())
    assert "table" in parser.tags and len(parser.imgs) >= 6
    assert all(src.startswith("data:image/png;base64,") for src in parser.imgs)
    # a second run skips everything
    assert main(["run", str(spec_file), "--db", str(db), "--out", str(out), "--no-progress"]) == 0
    assert con.execute("SELECT count(*) FROM runs").fetchone()[0] >= 8


def test_report_without_runs_is_a_clear_error(tmp_path, capsys):
    rc = main(["report", "nothing", "--db", str(tmp_path / "e.db"), "--out", str(tmp_path)])
    assert rc == 2
    assert "no finished runs" in capsys.readouterr().err


def test_reproductions_regenerated_from_store(tmp_path):
    spec_dir = tmp_path / "repro"
    spec_dir.mkdir()
    text = SPEC.replace('name = "tiny"', 'name = "tiny-repro"\npaper = "a paper"\n'
                        '[published]\n"big" = { value = 90.0, source = "Table 9" }')
    text = text.replace("epsilons = [1.0, 4.0]", "epsilons = [4.0]").replace(
        "seeds = [0, 1]", "seeds = [0]").replace("epochs = 2", "epochs = 1")
    (spec_dir / "tiny.toml").write_text(text)
    db = tmp_path / "r.db"
    assert main(["run", str(spec_dir / "tiny.toml"), "--db", str(db), "--out",
                 str(tmp_path / "o"), "--no-progress"]) == 0
    doc = tmp_path / "doc.md"
    assert main(["reproductions", "--db", str(db), "--dir", str(spec_dir),
                 "--doc", str(doc)]) == 0
    rows = json.loads((spec_dir / "results" / "tiny-repro.json").read_text())
    assert len(rows) == 2
    for r in rows:
        assert {"dataset", "model", "strategy", "params", "epsilon", "delta", "seed", "epochs",
                "test_accuracy"} <= set(r)
    text = doc.read_text()
    assert "a paper" in text and "| big | eps=4 | 90.0 | Table 9 |" in text
    assert "not run" not in text


def test_published_must_name_a_label(tmp_path):
    p = tmp_path / "x.toml"
    p.write_text(SPEC.replace('name = "tiny"', 'name = "t"\n[published]\n"nope" = { value = 1 }'))
    with pytest.raises(SpecError, match="not a strategy label"):
        load_spec(p)


def test_compare_runs_a_spec_and_writes_its_report(tmp_path, capsys):
    """`dpclip compare` (the `make demo` path) runs the grid and always writes the report."""
    p = tmp_path / "mini.toml"
    p.write_text(SPEC.replace('name = "tiny"', 'name = "mini"')
                 .replace("epochs = 2", "epochs = 1")
                 .replace("epsilons = [1.0, 4.0]", "epsilons = [4.0]")
                 .replace("seeds = [0, 1]", "seeds = [0]"))
    rc = main(["compare", "--preset", str(p), "--db", str(tmp_path / "c.db"),
               "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    assert (tmp_path / "mini.md").exists() and (tmp_path / "mini.html").exists()
    assert "report:" in capsys.readouterr().out


def _fake_runs(label_accs, epsilon=2.7):
    return [{"label": lab, "config": {"strategy": "fixed", "epsilon": epsilon,
                                      "noise_multiplier": None},
             "summary": {"test_accuracy": a / 100}} for lab, accs in label_accs.items()
            for a in accs]


@pytest.mark.parametrize("better, than, expect", [
    ([85.0, 85.2, 84.9], [83.0, 83.1, 83.3], "holds"),
    ([83.0, 83.1, 83.3], [85.0, 85.2, 84.9], "does not hold (the opposite is measured)"),
    ([84.0, 85.0, 83.0], [84.2, 84.6, 83.6], "does not hold (difference within 2 standard errors)"),
    ([85.0], [83.0, 83.1], "not measurable yet (1 and 2 runs; 2 each needed)"),
])
def test_claim_verdicts_use_two_standard_errors(better, than, expect):
    from dpclip.harness.reproduce import verdict

    runs = _fake_runs({"A": better, "B": than}) + _fake_runs({"A": [10.0, 10.0]}, epsilon=8.0)
    v, measured = verdict({"text": "A beats B", "better": "A", "than": "B", "epsilon": 2.7},
                          runs, ("eps", 2.7), n_levels=2)
    assert v == expect
    assert f"(n={len(better)})" in measured  # the epsilon-8 runs are not counted


def test_level_claim_and_published_per_level(tmp_path):
    from dpclip.harness.reproduce import _published_at, verdict

    runs = _fake_runs({"A": [75.5, 74.9]})
    assert verdict({"text": "A reaches 75", "label": "A", "at_least": 75}, runs,
                   ("eps", 2.7))[0] == "holds"
    assert verdict({"text": "A reaches 76", "label": "A", "at_least": 76}, runs,
                   ("eps", 2.7))[0] == "does not hold"
    pub = {"value": 85.2, "at": {"1.5": 82.7, "2.7": 85.2}}
    assert _published_at(pub, ("eps", 1.5)) == 82.7
    assert _published_at(pub, ("eps", 4.5)) is None  # not published at that level
    assert _published_at({"value": 90.0}, ("eps", 4.0)) == 90.0


@pytest.mark.parametrize("claims, match", [
    ('[[claims]]\ntext = "x"\nbetter = "big"\nthan = "nope"\nepsilon = 1.0',
     "not a strategy label"),
    ('[[claims]]\ntext = "x"\nbetter = "big"\nthan = "small"', "several privacy levels"),
    ('[[claims]]\ntext = "x"\nbetter = "big"\nlabel = "small"\nepsilon = 1.0',
     "either better = LABEL and than = LABEL"),
    ('[[claims]]\ntext = "x"\nbeter = "big"\nthan = "small"\nepsilon = 1.0',
     "did you mean 'better'"),
    ('[[claims]]\ntext = "x"\nlabel = "big"\nat_least = "high"\nepsilon = 1.0',
     "at_least must be an accuracy"),
    ('[published]\n"big" = { value = 1.0, at = { "low" = 2.0 } }', "map privacy levels"),
])
def test_bad_claims_name_the_fix(tmp_path, claims, match):
    p = tmp_path / "x.toml"
    p.write_text(SPEC + "\n" + claims + "\n")
    with pytest.raises(SpecError, match=match):
        load_spec(p)


def test_reproductions_count_one_run_per_seed(tmp_path):
    """A seed rerun under a newer config (e.g. a changed default engine) supersedes the earlier
    run of the same strategy, level and seed: the mean and n count it once, and the page says so;
    other seeds and levels are all kept."""
    from dpclip.harness.reproduce import latest_per_seed

    def run(i, seed, acc, eps=4.0, engine="auto"):
        return {"id": i, "label": "big", "config": {"strategy": "fixed", "epsilon": eps,
                                                     "noise_multiplier": None, "seed": seed,
                                                     "engine": engine},
                "summary": {"test_accuracy": acc}}

    runs = [run(1, 0, 0.36, engine="vmap"), run(2, 1, 0.50), run(3, 0, 0.40), run(4, 0, 0.7, 8.0)]
    kept, old = latest_per_seed(runs)
    assert [r["id"] for r in kept] == [2, 3, 4] and [r["id"] for r in old] == [1]
    assert latest_per_seed(runs[1:]) == (runs[1:], [])

    # end to end: a stored run of seed 0 whose config differs (another engine) is rerun by the
    # grid, and the page counts seed 0 once
    spec_dir = tmp_path / "repro"
    spec_dir.mkdir()
    text = SPEC.replace('name = "tiny"', 'name = "tiny-repro"').replace(
        "epsilons = [1.0, 4.0]", "epsilons = [4.0]").replace(
        "seeds = [0, 1]", "seeds = [0]").replace("epochs = 2", "epochs = 1")
    (spec_dir / "tiny.toml").write_text(text)
    db = tmp_path / "r.db"
    args = ["run", str(spec_dir / "tiny.toml"), "--db", str(db), "--out", str(tmp_path / "o"),
            "--no-progress"]
    assert main(args) == 0
    with sqlite3.connect(db) as c:  # as if made before a default changed
        for rid, cfg in c.execute("SELECT id, config FROM runs").fetchall():
            c.execute("UPDATE runs SET config=?, fingerprint='old' || id WHERE id=?",
                      (json.dumps(dict(json.loads(cfg), engine="vmap-old")), rid))
    assert main(args) == 0  # reruns both strategies' seed 0
    doc = tmp_path / "doc.md"
    assert main(["reproductions", "--db", str(db), "--dir", str(spec_dir),
                 "--doc", str(doc)]) == 0
    rows = json.loads((spec_dir / "results" / "tiny-repro.json").read_text())
    assert len(rows) == 2  # 4 finished runs in the store: 2 strategies x seed 0, twice
    text = doc.read_text()
    assert "2 earlier run(s) of the same strategy, level and seed" in text
    assert "| 1 | 4.000 |" in text and "| 2 | 4.000 |" not in text
