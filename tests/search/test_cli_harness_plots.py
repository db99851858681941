"""`dpclip search | schedules | search-report`, transfer through `dpclip train` and TOML specs,
and the plots (non-empty PNGs)."""

import json
import sqlite3

import pytest

from dpclip.cli import main
from dpclip.data import PUBLIC_PROXIES
from dpclip.harness.runner import run_experiment
from dpclip.harness.spec import parse_spec
from dpclip.store import ResultsStore
from dpclip.search.plots import fit_decay_trend, plot_median_norms, plot_thresholds

SEARCH = ["search", "--dataset", "digits", "--model", "logreg", "--noise-multiplier", "0.8",
          "--batch-size", "256", "--lr", "0.5", "--epochs", "2", "--c-start", "0.5",
          "--step", "0.5", "--tolerance", "0.05", "--no-progress", "--json"]


def last_json(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_cli_search_schedules_and_transfer_train(tmp_path, capsys):
    db = str(tmp_path / "r.db")
    ck = str(tmp_path / "ck")
    assert main([*SEARCH, "--db", db, "--checkpoint-dir", ck, "--name", "dg"]) == 0
    obj = last_json(capsys)
    assert obj["name"] == "dg" and len(obj["thresholds"]) == 2 and obj["privacy"] == "public"
    assert "epsilon" not in obj
    assert main(["schedules", "--db", db, "--json"]) == 0
    (row,) = last_json(capsys)["schedules"]
    assert row["name"] == "dg" and row["thresholds"] == obj["thresholds"]
    assert "candidates" not in row["metadata"]
    assert main(["schedules", "--db", db]) == 0
    assert "thresholds:" in capsys.readouterr().out
    # transfer on a private dataset replays it; params record name and thresholds
    rc = main(["train", "--dataset", "synthetic", "--model", "logreg", "--strategy", "transfer",
               "--param", "schedule=dg", "--noise-multiplier", "0.8", "--delta", "1e-5",
               "--epochs", "3", "--batch-size", "256", "--lr", "0.5", "--db", db,
               "--no-progress", "--json"])
    assert rc == 0
    s = last_json(capsys)
    th = obj["thresholds"]
    assert s["params"]["schedule"] == "dg" and s["params"]["thresholds"] == th
    con = sqlite3.connect(db)
    per_epoch = [json.loads(m)["clip_threshold"] for (m,) in
                 con.execute("SELECT metrics FROM epochs ORDER BY epoch")]
    assert per_epoch == [th[0], th[1], th[1]]


def test_cli_refuses_private_data_without_the_override(tmp_path, capsys):
    args = [a if a != "digits" else "synthetic" for a in SEARCH]
    args = [*args[:args.index("--epochs") + 1], "1", *args[args.index("--epochs") + 2:]]
    db = str(tmp_path / "r.db")
    assert main([*args, "--db", db]) == 2
    assert "not differentially private" in capsys.readouterr().err
    assert main([*args, "--db", db, "--nonprivate-search", "--name", "np"]) == 0
    out = capsys.readouterr()
    assert "NOT differentially private" in out.err
    assert last_json_from(out.out)["privacy"] == "NON-PRIVATE"


def last_json_from(text):
    return json.loads(text.strip().splitlines()[-1])


SPEC = """
name = "lin-tiny"
[train]
dataset = "synthetic"
model = "logreg"
epochs = 2
batch_size = 128
lr = 0.5
delta = 1e-5
accountant = "rdp"
[grid]
noise_multipliers = [0.8]
seeds = [0]
[[strategies]]
name = "fixed"
params = { clip_norm = 0.5 }
[[strategies]]
name = "transfer"
params = { schedule = "pub" }
[[strategies]]
name = "lin-decay"
label = "decay greedy"
params = { c0_from = "greedy", c0_runs = 2, c0_c_start = 0.25, c0_step = 0.5, c0_tolerance = 0.05 }
"""


def test_toml_spec_with_transfer_schedule_and_greedy_c0(tmp_path, monkeypatch, capsys):
    import tomllib

    monkeypatch.setitem(PUBLIC_PROXIES, "synthetic", ("digits",))
    spec = parse_spec(tomllib.loads(SPEC))  # validates with placeholders, no store needed
    db = tmp_path / "r.db"
    with ResultsStore(db) as store:
        store.save_schedule("pub", [0.6, 0.3], {"dataset": "digits", "privacy": "public",
                                                "model": "logreg"})
    rep = run_experiment(spec, db=db, out_dir=tmp_path / "out", progress=False)
    assert not rep.failed and len(rep.finished) == 3
    with ResultsStore(db) as store:
        runs = {r["label"]: r for r in store.runs("finished", experiment="lin-tiny")}
        tr = runs["transfer"]["summary"]["params"]
        assert tr["schedule"] == "pub" and tr["thresholds"] == [0.6, 0.3]
        ld = runs["decay greedy"]["summary"]["params"]
        firsts = [s["thresholds"][0] for s in store.schedules() if s["name"] != "pub"]
        assert len(firsts) == 2 and ld["clip_norm"] == pytest.approx(sum(firsts) / 2)
        assert ld["c0_from"].startswith("greedy:digits:2 runs:")
        # plots from the store
        p1 = plot_thresholds(store, [s["name"] for s in store.schedules()
                                     if s["name"] != "pub"], tmp_path / "th.png",
                             experiments=["lin-tiny"])
        assert p1.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p1.stat().st_size > 5000
    # a second run of the grid skips everything (resolved fingerprints are stable)
    rep2 = run_experiment(spec, db=db, out_dir=tmp_path / "out", progress=False)
    assert rep2.skipped == 3 and not rep2.finished


def test_spec_errors_for_unresolvable_params():
    import tomllib

    from dpclip.harness.spec import SpecError

    bad = SPEC.replace('c0_from = "greedy", c0_runs = 2', 'c0_from = "greedy", c0_runs = 2, '
                       'clip_norm = 1.0')
    with pytest.raises(SpecError, match="either clip_norm"):
        parse_spec(tomllib.loads(bad))
    with pytest.raises(SpecError, match="no public proxy is known for dataset 'synthetic'"):
        parse_spec(tomllib.loads(SPEC))


def _fake_run(store, exp, strategy, params, thresholds, q50=None, seed=0):
    rid = store.start_run(f"{exp}{strategy}{seed}{params}", {"strategy": strategy},
                          experiment=exp, label=strategy)
    for e, c in enumerate(thresholds, 1):
        m = {"epoch": e, "clip_threshold": c}
        if q50 is not None:
            m["nonprivate/norm_q50"] = q50[e - 1]
        store.log_epoch(rid, e, m)
    store.finish_run(rid, {"params": params, "test_accuracy": 0.5, "epsilon": 1.0}, {})


def test_plots_are_non_empty_pngs(tmp_path, capsys):
    db = tmp_path / "r.db"
    with ResultsStore(db) as store:
        for seed, th in enumerate(([0.5, 0.3, 0.25, 0.2], [0.6, 0.35, 0.2, 0.22])):
            store.save_schedule(f"g{seed}", th, {"dataset": "mnist-5k", "model": "papernot-cnn",
                                                "noise_multiplier": 0.97, "batch_size": 1024})
        for strat, th in (("yu-linear", [1.0, 0.8, 0.66, 0.57]), ("quantile", [3, 5, 6, 7]),
                          ("du-dynamic", [1.0, 0.93, 0.87, 0.81]),
                          ("lin-decay", [0.55, 0.39, 0.32, 0.28])):
            _fake_run(store, "exp", strat, {}, th)
        for c in (0.1, 0.4, 1.0):
            for seed in (0, 1):
                _fake_run(store, "exp", "fixed", {"clip_norm": c}, [c] * 4,
                          q50=[2 + c, 3 + c, 2.5 + c, 2 + c], seed=seed)
        p = plot_thresholds(store, ["g0", "g1"], tmp_path / "a.png", experiments=["exp"])
        q = plot_median_norms(store, ["exp"], tmp_path / "b.png")
        for f in (p, q):
            assert f.read_bytes()[:4] == b"\x89PNG" and f.stat().st_size > 5000
        with pytest.raises(ValueError, match="diagnostics = true"):
            plot_median_norms(store, ["nope"], tmp_path / "c.png")
    assert main(["search-report", "--db", str(db), "--out", str(tmp_path / "rep"),
                 "--schedule-prefix", "g", "--experiment", "exp", "--norms-experiment", "exp",
                 "--json"]) == 0
    plots = last_json(capsys)["plots"]
    assert len(plots) == 2 and all(p.endswith(".png") for p in plots)


def test_fit_decay_trend_recovers_c_over_t_to_the_a():
    c, a = fit_decay_trend([0.8 / t ** 0.5 for t in range(1, 11)])
    assert c == pytest.approx(0.8) and a == pytest.approx(0.5)
    assert fit_decay_trend([0.3]) == (0.3, 0.0)


def test_transfer_schedule_greedy_is_searched_in_the_runs_setting(tmp_path, monkeypatch):
    """schedule = "greedy": one search on the proxy, as many epochs as the run (or
    schedule_epochs), at the run's own sigma; stored and reused; the last threshold is kept
    beyond a shorter schedule."""
    import tomllib

    monkeypatch.setitem(PUBLIC_PROXIES, "synthetic", ("digits",))
    raw = tomllib.loads(SPEC)
    raw["train"]["epochs"] = 3
    raw["strategies"] = [
        {"name": "transfer", "label": "full",
         "params": {"schedule": "greedy", "schedule_c_start": 0.25, "schedule_step": 0.5,
                    "schedule_tolerance": 0.05}},
        {"name": "transfer", "label": "short",
         "params": {"schedule": "greedy", "schedule_epochs": 2, "schedule_c_start": 0.25,
                    "schedule_step": 0.5, "schedule_tolerance": 0.05}}]
    spec = parse_spec(raw)
    db = tmp_path / "r.db"
    with pytest.warns(UserWarning, match="its last threshold is kept"):  # the short one
        rep = run_experiment(spec, db=db, out_dir=tmp_path / "out", progress=False)
    assert not rep.failed
    with ResultsStore(db) as store:
        scheds = {s["name"]: s for s in store.schedules()}
        runs = {r["label"]: r for r in store.runs("finished", experiment="lin-tiny")}
    assert len(scheds) == 2
    for label, epochs in (("full", 3), ("short", 2)):
        p = runs[label]["summary"]["params"]
        s = scheds[p["schedule"]]
        assert p["thresholds"] == s["thresholds"] and len(s["thresholds"]) == epochs
        assert s["metadata"]["dataset"] == "digits"
        assert s["metadata"]["noise_multiplier"] == pytest.approx(0.8)  # the run's sigma
        hist = [h["clip_threshold"] for h in
                ResultsStore(db).epochs(runs[label]["id"])]
        assert hist == pytest.approx((s["thresholds"] + s["thresholds"][-1:])[:3])
    with pytest.raises(Exception, match="schedule_epochs"):
        parse_spec({**raw, "strategies": [{"name": "transfer", "params": {
            "schedule": "pub", "schedule_epochs": 2}}]})
