"""Black-box audit (issue 16, item 2): a real `dpclip train` run with input canaries, final model
only. The no-noise run must be flagged against the honest run's claim (the audit has power), the
honest run must not be; the CLI stores the audit and `dpclip report` shows it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dpclip.audit.blackbox import blackbox_audit, make_canaries
from dpclip.cli import main as cli_main
from dpclip.data import load_dataset
from dpclip.training.trainer import TrainConfig

BASE = dict(dataset="synthetic", model="mlp", epochs=20, batch_size=64, lr=4.0, delta=1e-4,
            seed=0, reproducible_noise=True, strategy="fixed",
            strategy_params={"clip_norm": 1.0})
CANARIES = 300


@pytest.fixture(scope="module")
def honest():
    b = blackbox_audit(TrainConfig(**BASE, epsilon=1.0), n_canaries=CANARIES)
    assert b.claimed_epsilon == pytest.approx(1.0, rel=1e-3)  # the run's own ledger
    return b


def test_honest_run_is_not_flagged(honest):
    assert not honest.violates_claim, honest.to_dict()
    assert honest.n_canaries == CANARIES
    assert honest.in_scores.size + honest.out_scores.size == CANARIES
    row = honest.to_dict()
    assert row["claim_source"] == "run" and row["canary"] == "ood"
    assert row["epochs"] == 20 and row["dataset"] == "synthetic"


def test_no_noise_run_is_flagged(honest):
    # the same run without noise, compared with the honest run's claim: memorised canaries
    b = blackbox_audit(TrainConfig(**BASE, noise_multiplier=0.0), n_canaries=CANARIES,
                       claimed_epsilon=honest.claimed_epsilon)
    assert b.run_summary["noise_multiplier"] == 0.0
    assert b.claim_source == "given"
    assert b.auc > 0.9, b.to_dict()
    assert b.violates_claim, b.to_dict()
    assert b.one_run_fdp.epsilon > 1.3 * honest.claimed_epsilon, b.to_dict()


def test_ood_canaries_are_far_from_the_data_and_seeded():
    bundle = load_dataset("synthetic", seed=0)
    x1, y1 = make_canaries(bundle, 50, "ood", 3.0, np.random.default_rng(1))
    x2, y2 = make_canaries(bundle, 50, "ood", 3.0, np.random.default_rng(1))
    assert (x1 == x2).all() and (y1 == y2).all()
    mean_norm = float(bundle.train.inputs.norm(dim=1).mean())
    assert x1.norm(dim=1).numpy() == pytest.approx(3.0 * mean_norm, rel=1e-5)
    assert set(y1.tolist()) <= set(range(bundle.num_classes))


def test_public_split_is_refused():
    cfg = TrainConfig(**{**BASE, "strategy_params": {"clip_norm": 1.0, "public_fraction": 0.1}},
                      noise_multiplier=1.0)
    with pytest.raises(ValueError, match="public split"):
        blackbox_audit(cfg, n_canaries=CANARIES)


def test_bad_arguments_name_the_argument():
    cfg = TrainConfig(**BASE, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="canary must be one of"):
        blackbox_audit(cfg, canary="random")
    with pytest.raises(ValueError, match="n_canaries"):
        blackbox_audit(cfg, n_canaries=4)
    with pytest.raises(ValueError, match="claimed_epsilon"):
        blackbox_audit(cfg, claimed_epsilon=-1.0)


def test_cli_stores_the_audit_and_report_shows_it(tmp_path, capsys):
    db = str(tmp_path / "r.db")
    rc = cli_main(["audit", "--mode", "blackbox", "--dataset", "synthetic", "--model", "mlp",
                   "--noise-multiplier", "0", "--claim", "1", "--epochs", "20",
                   "--batch-size", "64", "--lr", "4", "--canaries", str(CANARIES),
                   "--delta", "1e-4", "--db", db, "--no-progress", "--json"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 1 and summary["violates_claim"]  # exit status 1: a violation
    assert summary["claimed_epsilon"] == 1.0 and summary["claim_source"] == "given"
    assert cli_main(["report", "audit", "--db", db, "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "audit.md").read_text()
    assert "claimed epsilon vs empirical lower bound" in md
    assert f"| {summary['run_id']} | blackbox | fixed |" in md
    assert "claimed_epsilon" in (tmp_path / "rep" / "audit.html").read_text()


def test_cli_whitebox_with_epsilon_audits_the_runs_calibrated_multiplier(tmp_path, capsys):
    # white-box from a `dpclip train` configuration given by its target epsilon: the step is
    # audited at the multiplier train calibrates for that run
    from dpclip.training.trainer import train

    run = train(TrainConfig(dataset="synthetic", model="mlp", epsilon=2.0, epochs=5,
                            batch_size=64, delta=1e-4, seed=0), progress=False)
    rc = cli_main(["audit", "--strategy", "fixed", "--epsilon", "2", "--dataset", "synthetic",
                   "--epochs", "5", "--batch-size", "64", "--delta", "1e-4", "--canaries",
                   "2000", "--db", str(tmp_path / "r.db"), "--no-progress", "--json"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and not summary["violates_claim"]
    assert summary["noise_multiplier"] == pytest.approx(run.summary["noise_multiplier"],
                                                        rel=1e-9)
    assert "calibrated" in summary["noise_multiplier_source"]
    assert summary["gaussian_epsilon"] > 0.5 * summary["claimed_epsilon"]


def test_cli_whitebox_without_noise_or_epsilon_is_a_clear_error(capsys):
    rc = cli_main(["audit", "--strategy", "fixed", "--delta", "1e-5"])
    assert rc == 2
    assert "--noise-multiplier" in capsys.readouterr().err


def test_cli_claim_in_whitebox_mode_is_refused(capsys):
    rc = cli_main(["audit", "--strategy", "fixed", "--noise-multiplier", "1", "--delta", "1e-5",
                   "--claim", "2"])
    assert rc == 2
    assert "--claim is for --mode blackbox" in capsys.readouterr().err
