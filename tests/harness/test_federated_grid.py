"""Federated grids in the experiment harness: [federated] specs, the store, resume, report,
evidence rows. Tiny synthetic federated data (40 users, 6 rounds)."""

import json
import sqlite3

import pytest

from dpclip.accounting import Ledger, compute_epsilon
from dpclip.cli import main
from dpclip.federated import plan_ledger
from dpclip.federated.spec import FederatedRunConfig, build_strategy, config_from_spec
from dpclip.harness.spec import SpecError, load_spec, parse_spec
from dpclip.store import ResultsStore

SPEC = """
name = "fed-tiny"
description = "tiny federated grid"
[federated]
dataset = "synthetic"
dataset_options = { n_train = 240, n_test = 128 }
num_users = 40
model = "mlp"
model_options = { hidden = [8] }
rounds = 6
clients_per_round = 8
delta = 1e-3
accountant = "rdp"
local_batch_size = 8
eval_every = 3
[grid]
epsilons = [2.0, 8.0]
seeds = [0]
[[strategies]]
name = "quantile"
label = "adaptive-median"
params = { initial_clip_norm = 0.1, target_quantile = 0.5, count_noise_std = 2.0 }
[[strategies]]
name = "fixed"
label = "fixed-1"
params = { clip_norm = 1.0 }
train = { client_lr = 0.2 }
"""


@pytest.fixture
def spec_file(tmp_path):
    p = tmp_path / "fed.toml"
    p.write_text(SPEC)
    return p


def test_federated_spec_expands_to_fingerprinted_federated_runs(spec_file):
    spec = load_spec(spec_file)
    assert spec.kind == "federated"
    runs = spec.runs()
    assert len(runs) == 2 * 2 * 1
    assert all(isinstance(r.config, FederatedRunConfig) for r in runs)
    assert len({r.fingerprint for r in runs}) == 4
    assert len({r.fingerprint for r in load_spec(spec_file, ["grid.seeds=[0,1]"]).runs()}) == 8
    assert {r.config.client_lr for r in runs if r.label == "fixed-1"} == {0.2}
    assert {r.config.client_lr for r in runs if r.label != "fixed-1"} == {0.1}  # the default
    assert {r.config.epsilon for r in runs} == {2.0, 8.0}
    assert all(r.config.noise_multiplier is None for r in runs)
    # --set on the federated table and a strategy's params
    spec2 = load_spec(spec_file, ["federated.rounds=3", "grid.seeds=[5]",
                                  "strategies.fixed-1.params.clip_norm=3.0"])
    r2 = spec2.runs()
    assert {r.config.rounds for r in r2} == {3} and {r.config.seed for r in r2} == {5}
    assert {r.config.params["clip_norm"] for r in r2 if r.label == "fixed-1"} == {3.0}
    # the fingerprint ignores data_dir but not what determines the outcome
    a = runs[0].config
    assert FederatedRunConfig({**a.spec, "data_dir": "/elsewhere"}).fingerprint() == a.fingerprint()
    assert FederatedRunConfig({**a.spec, "rounds": 7}).fingerprint() != a.fingerprint()


@pytest.mark.parametrize("edit, match", [
    (("rounds = 6", "round = 6"), r"\[federated\]: unknown field\(s\) \['round'\].*'rounds'"),
    (("rounds = 6", "rounds = 6\nepsilon = 3.0"), r"\['epsilon'\] are set by \[grid\]"),
    (("[federated]", "[train]\nepochs = 1\n[federated]"), "not both"),
    (('name = "fixed"', 'name = "per-layer"'), "clips per parameter group"),
    (('name = "fixed"', 'name = "fixd"'), "did you mean"),
    (("rounds = 6", "rounds = 0"), "rounds must be an int >= 1"),
    (('accountant = "rdp"', 'accountant = "pld"\nsampling = "fixed-size"'), "accountant='rdp'"),
])
def test_federated_spec_errors_name_the_key(tmp_path, edit, match):
    p = tmp_path / "bad.toml"
    p.write_text(SPEC.replace(*edit, 1))
    with pytest.raises(SpecError, match=match):
        load_spec(p)


def test_federated_grid_store_resume_report_and_evidence(spec_file, tmp_path):
    db, out = tmp_path / "r.db", tmp_path / "out"
    # an interrupted grid: epsilon 8 finished, one epsilon-2 run left 'running' by a killed runner
    assert main(["run", str(spec_file), "--db", str(db), "--out", str(out), "--no-progress",
                 "--set", "grid.epsilons=[8.0]"]) == 0
    spec = load_spec(spec_file)
    killed = next(r for r in spec.runs() if r.config.epsilon == 2.0)
    with ResultsStore(db) as store:
        store.start_run(killed.fingerprint, killed.config.to_dict(), experiment=spec.name,
                        label=killed.label)
    rc = main(["run", str(spec_file), "--db", str(db), "--out", str(out), "--no-progress",
               "--report", "--json"])
    assert rc == 0
    con = sqlite3.connect(db)
    statuses = dict(con.execute("SELECT status, count(*) FROM runs GROUP BY status").fetchall())
    assert statuses == {"finished": 4, "interrupted": 1}
    assert con.execute("SELECT count(DISTINCT fingerprint) FROM runs WHERE status='finished'"
                       ).fetchone()[0] == 4  # no finished run was repeated
    with ResultsStore(db) as store:
        runs = list(store.runs("finished", experiment=spec.name))
        for r in runs:
            cfg = r["config"]
            assert cfg["kind"] == "federated"
            s = r["summary"]
            # the stored ledger is the plan of the run, and its epsilon is the reported one
            fed_spec = {k: v for k, v in cfg.items() if k != "kind"}
            strategy = build_strategy(fed_spec)
            z = s["noise_multiplier"]
            planned = plan_ledger(strategy, config_from_spec(fed_spec), s["num_users"], z)
            ledger = Ledger.from_dict(r["ledger"])
            assert ledger == planned and ledger.steps == 6
            eps = compute_epsilon(ledger, cfg["delta"], "rdp").epsilon
            assert s["epsilon"] == pytest.approx(eps, rel=1e-9)
            assert s["epsilon"] == pytest.approx(cfg["epsilon"], rel=1e-3)  # calibrated to it
            assert s["privacy_unit"] == "user" and s["randomness"] == "secure"
            hist = store.epochs(r["id"])
            assert [h["round"] for h in hist] == [3, 6] == [h["epoch"] for h in hist]
            assert all(h["clip_threshold"] == h["clip_norm"] for h in hist)
            if strategy.name == "fixed":
                assert {h["clip_norm"] for h in hist} == {1.0}
    md = (out / "fed-tiny.md").read_text()
    assert "user-level DP-FedAvg" in md and "adaptive-median" in md
    assert "eps=2" in md and "eps=8" in md
    for key in ("test_accuracy", "clip_threshold", "epsilon"):
        png = out / f"fed-tiny_{key}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "per round" in (out / "fed-tiny.html").read_text()
    # evidence rows from the store, with the same evidence code as the other reproductions
    spec_dir = tmp_path / "repro"
    spec_dir.mkdir()
    (spec_dir / "fed.toml").write_text(SPEC)
    doc = tmp_path / "doc.md"
    assert main(["reproductions", "--db", str(db), "--dir", str(spec_dir), "--doc",
                 str(doc)]) == 0
    rows = json.loads((spec_dir / "results" / "fed-tiny.json").read_text())
    assert len(rows) == 4
    for r in rows:
        assert {"dataset", "model", "strategy", "params", "epsilon", "delta", "seed", "epochs",
                "test_accuracy", "label", "history", "privacy_unit"} <= set(r)
        assert r["epochs"] == 6 and r["privacy_unit"] == "user"
    table = (spec_dir / "results" / "fed-tiny.md").read_text()
    assert "by dpclip.harness.evidence" in table and "fixed" in table
    assert (spec_dir / "results" / "fed-tiny.png").read_bytes()[:4] == b"\x89PNG"
    text = doc.read_text()
    assert "fed-tiny (user-level DP-FedAvg)" in text and "| adaptive-median |" in text


def test_federated_grid_refuses_torchrun(spec_file, tmp_path, monkeypatch):
    from dpclip.harness import runner

    monkeypatch.setattr("dpclip.training.distributed.init_from_env", lambda: object())
    with pytest.raises(ValueError, match="federated grid"):
        runner.run_experiment(load_spec(spec_file), db=tmp_path / "x.db", out_dir=tmp_path)


def test_fl_train_reads_the_federated_table_of_an_experiment_spec(spec_file, capsys):
    rc = main(["fl", "train", "--spec", str(spec_file), "--strategy", "fixed",
               "--param", "clip_norm=0.5", "--noise-multiplier", "0.3", "--json"])
    assert rc == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["num_users"] == 40 and s["rounds"] == 6 and s["noise_multiplier"] == 0.3


def test_parse_spec_without_names_keeps_kind():
    import tomllib

    spec = parse_spec(tomllib.loads(SPEC), validate_names=False)
    assert spec.kind == "federated" and len(spec.runs()) == 4


def test_weight_cap_declares_capped_weights(capsys):
    from dpclip.federated.spec import build_run

    spec = {**__import__("tomllib").loads(SPEC)["federated"], "strategy": "fixed",
            "params": {"clip_norm": 1.0}, "noise_multiplier": 0.5, "weight_cap": 4}
    spec["dataset_options"] = {"n_train": 230, "n_test": 64}  # users of 5 or 6 examples
    data, _, _, config = build_run(spec)
    assert config.weight_cap == 4 and set(data.user_sizes()) == {5, 6}
    rc = main(["fl", "train", "--dataset", "synthetic", "--dataset-option", "n_train=230",
               "--num-users", "40", "--rounds", "2", "--clients-per-round", "8", "--delta", "1e-3",
               "--strategy", "fixed", "--param", "clip_norm=1.0", "--noise-multiplier", "0.5",
               "--weight-cap", "10", "--json", "--eval-every", "2"])
    assert rc == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["weighting"] == "declared-capped"
    with pytest.raises(ValueError, match="weight_cap"):
        config_from_spec({**spec, "weight_cap": 0})


def test_federated_spec_accepts_tff_datasets_and_benchmark_models(tmp_path):
    p = tmp_path / "tff.toml"
    p.write_text(SPEC.replace('dataset = "synthetic"', 'dataset = "shakespeare"')
                 .replace('model = "mlp"', 'model = "char-lstm"')
                 .replace("model_options = { hidden = [8] }", "model_options = { hidden = 8 }"))
    spec = load_spec(p)  # validated without the files (they are read when a run starts)
    assert {r.config.dataset for r in spec.runs()} == {"shakespeare"}
    p.write_text(SPEC.replace('model = "mlp"', 'model = "char-lstn"'))
    with pytest.raises(SpecError, match="did you mean 'char-lstm'"):
        load_spec(p)


def test_federated_spec_refuses_the_tuning_protocol(tmp_path):
    p = tmp_path / "fed.toml"
    p.write_text(SPEC + '\n[tuning]\nsource = "validation"\ntrials = 1\nepochs = 1\n')
    with pytest.raises(SpecError, match=r"\[tuning\] and `tune` are for example-level"):
        load_spec(p)
