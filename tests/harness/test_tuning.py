"""The tuning protocol: one budget for every strategy, selection never on the test split, the
choice stored with the results, resume without repeating trials."""

import dataclasses

import pytest
import torch

import dpclip.training.trainer as trainer_mod
from dpclip.data import load_dataset
from dpclip.harness.runner import run_experiment
from dpclip.harness.spec import SpecError, parse_spec
from dpclip.store import ResultsStore
from dpclip.harness.tuning import search_points


def raw_spec(**tuning):
    t = dict(source="validation", validation_fraction=0.25, trials=3, epochs=1, seed=0)
    t.update(tuning)
    t = {k: v for k, v in t.items() if v is not None}
    return {
        "name": "tune-tiny",
        "train": dict(dataset="synthetic", model="mlp", epochs=2, batch_size=64, lr=0.5,
                      optimizer="momentum", delta=1e-5, accountant="rdp"),
        "grid": {"epsilons": [4.0], "seeds": [0]},
        "tuning": t,
        "strategies": [
            {"name": "fixed", "params": {"clip_norm": 1.0},
             "tune": {"clip_norm": [0.01, 1.0, 3.0]}},          # 3 points: the whole grid
            {"name": "auto-s", "params": {"clip_norm": 1.0},
             "tune": {"lr": [0.05, 0.5], "clip_norm": [0.5, 1.0]}},  # 4 points: a sample of 3
        ],
    }


class Recorder:
    """Wraps trainer.train: every call's data and config."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = trainer_mod.train

        def spy(config, **kw):
            self.calls.append((config, kw.get("data"), kw.get("stop_after_steps")))
            return real(config, **kw)

        monkeypatch.setattr(trainer_mod, "train", spy)


def _rows(x):
    return {tuple(r.tolist()) for r in x.reshape(x.shape[0], -1)}


def test_search_points_same_budget_and_deterministic():
    space = {"lr": [0.1, 0.5, 1.0], "clip_norm": [0.1, 1.0]}
    a = search_points(space, 4, seed=3)
    assert len(a) == 4 and a == search_points(space, 4, seed=3)
    assert all(p in [dict(clip_norm=c, lr=l) for c in (0.1, 1.0) for l in (0.1, 0.5, 1.0)]
               for p in a)
    assert len({tuple(sorted(p.items())) for p in a}) == 4  # no repeats
    assert search_points({"lr": [1, 2]}, 2, seed=0) == [{"lr": 1}, {"lr": 2}]
    with pytest.raises(ValueError, match="fewer than the budget"):
        search_points({"lr": [1, 2]}, 3, seed=0)


def test_tuned_grid_selects_on_validation_never_on_test(tmp_path, monkeypatch):
    spec = parse_spec(raw_spec())
    rec = Recorder(monkeypatch)
    db = tmp_path / "r.db"
    rep = run_experiment(spec, db=db, out_dir=tmp_path / "out", progress=False)
    assert not rep.failed and rep.total == 2

    full = load_dataset("synthetic", seed=0)
    test_rows, train_rows = _rows(full.test.inputs), _rows(full.train.inputs)
    selection = [c for c in rec.calls if c[0].epochs == 1 or c[2] == 0]
    finals = [c for c in rec.calls if c not in selection]
    # the same budget for every strategy: 3 trials each, 1 epoch
    trials = [c for c in selection if c[2] is None]
    assert len(trials) == 2 * 3 and {c[0].epochs for c in trials} == {1}
    for cfg, data, _ in selection:  # calibration and trials: never the test split
        assert data is not None, "a selection call loaded the dataset itself (with its test split)"
        seen = _rows(data.train.inputs) | _rows(data.test.inputs)
        assert not (seen & test_rows)
        assert seen <= train_rows
    for cfg, data, _ in trials:  # scored on the held-out quarter, trained on the rest
        assert len(data.test) == 128 and len(data.train) == 384
        assert not (_rows(data.train.inputs) & _rows(data.test.inputs))
        assert cfg.epsilon is None and cfg.noise_multiplier > 0  # the final run's sigma
    assert len(finals) == 2 and all(d is None for _, d, _ in finals)  # the real splits

    with ResultsStore(db) as store:
        final_runs = list(store.runs("finished", "tune-tiny"))
        trial_runs = list(store.runs("finished", "tune-tiny:tuning"))
    assert len(trial_runs) == 6 and len(final_runs) == 2
    for r in final_runs:
        t = r["summary"]["tuning"]
        assert t["source"] == "validation" and "NOT privacy-accounted" in t["privacy"]
        assert t["budget"] == {"trials": 3, "epochs_per_trial": 1}
        assert len(t["trials"]) == 3
        best = max(t["trials"], key=lambda x: x["selection_accuracy"])
        assert t["choice"] == best["setting"]
        # the chosen setting is what the final run trained with
        cfg = r["config"]
        for k, v in t["choice"].items():
            assert (cfg[k] if k == "lr" else cfg["strategy_params"][k]) == v
        # the final run's noise is the one its trials used
        assert r["summary"]["noise_multiplier"] == pytest.approx(
            t["trials"][0]["noise_multiplier"])
    # shown in reports and evidence tables
    from dpclip.harness.evidence import markdown_table
    from dpclip.harness.report import build_report

    with ResultsStore(db) as store:
        md = build_report(store, "tune-tiny", tmp_path / "rep").markdown_path.read_text()
    assert "## Tuning" in md and "NOT privacy-accounted" in md and "Settings and cost" in md
    chosen = final_runs[0]["summary"]["tuning"]["choice"]
    table = markdown_table([r["summary"] for r in final_runs], "x")
    assert "## Tuning" in table and str(chosen)[1:-1].replace("'", '"') in table
    fixed = [r for r in final_runs if r["label"] == "fixed"]
    # C = 0.01 barely moves the model in one epoch: never the choice
    assert all(r["summary"]["tuning"]["choice"]["clip_norm"] != 0.01 for r in fixed)


def test_tuning_resumes_without_repeating_trials(tmp_path, monkeypatch):
    raw = raw_spec()
    raw["strategies"] = raw["strategies"][:1]
    spec = parse_spec(raw)
    db, out = tmp_path / "r.db", tmp_path / "out"
    run_experiment(spec, db=db, out_dir=out, progress=False)
    rec = Recorder(monkeypatch)
    rep = run_experiment(spec, db=db, out_dir=out, progress=False)
    assert rep.skipped == rep.total == 1
    assert [c for c in rec.calls if c[2] is None] == []  # no trial and no final run again
    # a killed tuning: remove one finished trial; only that one runs again
    with ResultsStore(db) as store:
        store._conn.execute("DELETE FROM runs WHERE id = (SELECT MIN(id) FROM runs WHERE "
                            "experiment = 'tune-tiny:tuning')")
        store._conn.commit()
    rec.calls.clear()
    run_experiment(spec, db=db, out_dir=out, progress=False)
    assert len([c for c in rec.calls if c[2] is None]) == 1


def test_public_proxy_source_trains_on_the_proxy(tmp_path, monkeypatch):
    import dpclip.data.registry as reg

    monkeypatch.setitem(reg.PUBLIC_PROXIES, "synthetic", ("digits",))
    raw = raw_spec(source="public-proxy", validation_fraction=None, trials=2)
    raw["strategies"] = raw["strategies"][:1]
    raw["strategies"][0]["tune"] = {"clip_norm": [0.01, 1.0]}
    spec = parse_spec(raw)
    rec = Recorder(monkeypatch)
    run_experiment(spec, db=tmp_path / "r.db", out_dir=tmp_path / "o", progress=False)
    trials = [c for c in rec.calls if c[2] is None and c[0].dataset == "digits"]
    assert len(trials) == 2
    # as many steps as one private epoch (8 steps of 64 of 512): digits 1437 / 64 -> 22 per epoch
    assert {c[0].epochs for c in trials} == {1}
    with ResultsStore(tmp_path / "r.db") as store:
        (final,) = store.runs("finished", "tune-tiny")
    t = final["summary"]["tuning"]
    assert t["source"] == "public-proxy" and t["proxy"] is None
    assert "public" in t["privacy"] and {x["dataset"] for x in t["trials"]} == {"digits"}


@pytest.mark.parametrize("change,match", [
    (lambda r: r["strategies"][1].pop("tune"), r"\['auto-s'\] have no `tune`"),
    (lambda r: r["tuning"].update(trials=5), "fewer than the budget"),
    (lambda r: r["strategies"][0]["tune"].update(epsilon=[1.0, 2.0]), "cannot be tuned"),
    (lambda r: r["tuning"].update(source="test"), "source must be one of"),
    (lambda r: r["tuning"].update(epochs=0), "epochs must be an integer >= 1"),
    (lambda r: r["strategies"][0]["tune"].update(clip_nrom=[1.0]), "clip_nrom"),
    (lambda r: r["tuning"].update(proxy="mnist-5k"), "only used with source"),
    (lambda r: r["train"].update(lr_warmup_epochs=1), "does not fit in a trial"),
])
def test_bad_tuning_sections_name_the_fix(change, match):
    raw = raw_spec()
    change(raw)
    with pytest.raises(SpecError, match=match):
        parse_spec(raw)


def test_seed_dependent_split_is_refused_for_validation(tmp_path):
    raw = raw_spec()
    raw["grid"]["seeds"] = [0, 1]  # synthetic data differs per seed
    with pytest.raises(ValueError, match="overlaps another seed's test split"):
        run_experiment(parse_spec(raw), db=tmp_path / "r.db", out_dir=tmp_path / "o",
                       progress=False)


@pytest.mark.parametrize("rel, fraction, retrained, old_row", [
    (1e-10, 0.25, 0, False), (1e-6, 0.25, 3, False), (1e-10, 0.3, 3, False),
    (1e-10, 0.25, 0, True)])
def test_trials_match_across_calibration_round_off(tmp_path, monkeypatch, rel, fraction,
                                                   retrained, old_row):
    """A trial stored with a noise multiplier that differs by calibration round-off (another
    machine's libraries: 1e-10 relative was seen) is the same trial; a real difference is not,
    nor is a trial scored on another validation split (which the config does not show)."""
    import json

    raw = raw_spec()
    raw["strategies"] = raw["strategies"][:1]
    spec = parse_spec(raw)
    db, out = tmp_path / "r.db", tmp_path / "out"
    run_experiment(spec, db=db, out_dir=out, progress=False)
    with ResultsStore(db) as store:  # as if computed elsewhere: other digits, other fingerprint
        rows = store._conn.execute("SELECT id, config FROM runs WHERE experiment = "
                                   "'tune-tiny:tuning'").fetchall()
        assert len(rows) == 3
        for rid, cfg in rows:
            c = json.loads(cfg)
            c["noise_multiplier"] *= 1 + rel
            c["device"] = "cuda"
            if old_row:  # stored before these fields existed: absent means the default
                for k in ("augment", "augment_multiplicity", "averaging"):
                    del c[k]
            store._conn.execute("UPDATE runs SET config = ?, fingerprint = 'x' || fingerprint "
                                "WHERE id = ?", (json.dumps(c), rid))
        store._conn.execute("DELETE FROM runs WHERE experiment = 'tune-tiny'")
        store._conn.commit()
    rec = Recorder(monkeypatch)
    run_experiment(parse_spec(raw_spec(validation_fraction=fraction) | {
        "strategies": raw["strategies"]}), db=db, out_dir=out, progress=False)
    trained = [c for c in rec.calls if c[2] is None]
    assert len(trained) == retrained + 1  # the trials not matched, and the final run


def test_a_killed_trial_is_marked_interrupted(tmp_path):
    raw = raw_spec()
    raw["strategies"] = raw["strategies"][:1]
    spec = parse_spec(raw)
    db, out = tmp_path / "r.db", tmp_path / "out"
    with ResultsStore(db) as store:  # a trial whose process was killed
        store.start_run("tdead", {"x": 1}, experiment="tune-tiny:tuning", label="dead trial")
    run_experiment(spec, db=db, out_dir=out, progress=False)
    with ResultsStore(db) as store:
        st = store._conn.execute("SELECT status FROM runs WHERE fingerprint = 'tdead'").fetchone()
    assert st == ("interrupted",)


def test_tan_horizon_keeps_the_run_s_steps_and_sigma_over_b(tmp_path, monkeypatch):
    """horizon = "tan": a trial of E_t epochs for a run of E epochs trains at batch B E_t / E with
    noise multiplier sigma E_t / E, so it takes the run's number of steps (on the same data)
    with the same sigma / B, at the cost of E_t epochs."""
    raw = raw_spec(horizon="tan")
    raw["train"]["epochs"] = 4
    raw["strategies"] = raw["strategies"][:1]
    spec = parse_spec(raw)
    rec = Recorder(monkeypatch)
    db = tmp_path / "r.db"
    run_experiment(spec, db=db, out_dir=tmp_path / "out", progress=False)
    trials = [c for c in rec.calls if c[2] is None and c[0].epochs == 1]
    assert len(trials) == 3
    with ResultsStore(db) as store:
        final = next(store.runs("finished", "tune-tiny"))
    z = final["summary"]["noise_multiplier"]
    for cfg, data, _ in trials:
        assert cfg.batch_size == 16  # 64 x 1 / 4
        assert cfg.noise_multiplier == pytest.approx(z / 4, rel=1e-12)
        assert cfg.noise_multiplier / cfg.batch_size == pytest.approx(z / 64, rel=1e-12)
    t = final["summary"]["tuning"]
    assert "TAN" in t["horizon"] and t["budget"] == {"trials": 3, "epochs_per_trial": 1}


@pytest.mark.parametrize("change, match", [
    (dict(horizon="long"), "horizon must be one of"),
    (dict(horizon="tan", source="public-proxy", validation_fraction=None),
     "needs source = \"validation\""),
    (dict(horizon="tan", epochs=2), "needs tuning.epochs \\(2\\) < the run's epochs \\(2\\)"),
])
def test_bad_horizons_name_the_fix(change, match):
    with pytest.raises(SpecError, match=match):
        parse_spec(raw_spec(**change))
