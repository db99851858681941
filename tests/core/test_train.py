"""The training loop: learning, calibration, the epsilon cap, and kill/resume."""

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dpclip.accounting import epsilon as ledger_epsilon
from dpclip.training.trainer import TrainConfig, train

BASE = dict(dataset="synthetic", model="mlp", strategy="fixed",
            strategy_params={"clip_norm": 1.0}, delta=1e-5, epochs=3, batch_size=64, lr=0.5,
            optimizer="momentum", seed=0)


def test_train_learns_and_reports():
    cfg = TrainConfig(**BASE, noise_multiplier=0.5)
    res = train(cfg, progress=False)
    s = res.summary
    for key in ("dataset", "model", "strategy", "params", "epsilon", "delta", "accountant",
                "noise_multiplier", "sample_rate", "steps", "epochs", "test_accuracy",
                "wall_seconds", "adjacency"):
        assert key in s
    assert s["test_accuracy"] > 0.6  # 4 classes: chance is 0.25
    assert s["steps"] == res.ledger.steps == 3 * round(512 / 64)
    assert len(res.history) == 3
    assert s["epsilon"] == pytest.approx(ledger_epsilon(res.ledger, 1e-5, accountant="pld"))
    assert [h["epsilon"] for h in res.history] == sorted(h["epsilon"] for h in res.history)


def test_calibrated_run_meets_target_epsilon():
    cfg = TrainConfig(**BASE, epsilon=3.0)
    s = train(cfg, progress=False).summary
    assert s["epsilon"] <= 3.0 + 1e-9
    assert s["epsilon"] >= 3.0 - 1e-3
    assert not s["stopped_by_budget"]


def test_epsilon_cap_stops_before_exceeding():
    cfg = TrainConfig(**dict(BASE, epochs=20), noise_multiplier=1.5, epsilon=2.0)
    res = train(cfg, progress=False)
    s = res.summary
    assert s["stopped_by_budget"] and s["steps"] < s["planned_steps"]
    assert s["epsilon"] <= 2.0
    # one more step would have exceeded the cap
    led = res.ledger
    led.record(led.entries[-1][0])
    assert ledger_epsilon(led, 1e-5, accountant="pld") > 2.0


def test_resume_in_process_is_identical(tmp_path):
    # reproducible noise: the uninterrupted run must replay the same randomness to compare weights
    cfg = TrainConfig(**BASE, noise_multiplier=1.0, reproducible_noise=True)
    full = train(cfg, progress=False)
    part = train(cfg, checkpoint_dir=tmp_path, progress=False, stop_after_steps=5)
    assert part.summary.get("interrupted")
    resumed = train(cfg, checkpoint_dir=tmp_path, progress=False)
    assert resumed.ledger == full.ledger
    assert resumed.summary["epsilon"] == full.summary["epsilon"]
    for (n, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), n


def test_checkpoint_of_another_config_is_refused(tmp_path):
    cfg = TrainConfig(**BASE, noise_multiplier=1.0)
    train(cfg, checkpoint_dir=tmp_path, progress=False, stop_after_steps=2)
    other = TrainConfig(**dict(BASE, lr=0.1), noise_multiplier=1.0)
    with pytest.raises(ValueError, match="different run configuration"):
        train(other, checkpoint_dir=tmp_path, progress=False)


KILLER = textwrap.dedent("""
    import json, os, signal, sys
    import dpclip.training.private as P
    import dpclip.training.trainer as T
    cfg = T.TrainConfig.from_dict(json.loads(sys.argv[1]))
    kill_at = int(sys.argv[3])
    orig, calls = P.dp_step, [0]
    def killer(*a, **k):
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return orig(*a, **k)
    P.dp_step = killer
    T.train(cfg, checkpoint_dir=sys.argv[2], checkpoint_interval_s=0.0, progress=False)
""")


@pytest.mark.parametrize("kill_at", [7, 17])  # mid-epoch and just after an epoch boundary
def test_sigkill_and_resume_gives_the_same_ledger(tmp_path, kill_at):
    cfg = TrainConfig(**BASE, noise_multiplier=1.0, reproducible_noise=True)
    full = train(cfg, progress=False)
    ck = tmp_path / "ck"
    proc = subprocess.run([sys.executable, "-c", KILLER, json.dumps(cfg.to_dict()), str(ck),
                           str(kill_at)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert (ck / "checkpoint.pt").exists()
    ckpt = torch.load(ck / "checkpoint.pt", weights_only=False)
    assert ckpt["step"] == kill_at - 1
    resumed = train(cfg, checkpoint_dir=ck, progress=False)
    assert resumed.ledger == full.ledger
    assert resumed.summary["epsilon"] == full.summary["epsilon"]
    assert resumed.summary["test_accuracy"] == full.summary["test_accuracy"]


def test_bad_config_errors():
    with pytest.raises(ValueError, match="--epsilon"):
        TrainConfig(**BASE)
    with pytest.raises(ValueError, match="optimizer"):
        TrainConfig(**dict(BASE, optimizer="rmsprop"), noise_multiplier=1.0)
    with pytest.raises(ValueError, match="delta"):
        TrainConfig(**dict(BASE, delta=1.5), noise_multiplier=1.0)


def test_calibration_searches_below_a_strategy_noise_limit():
    # quantile needs z < 2 sigma_b = B/10 = 6.4 at B=64; epsilon 1 needs z ~ 2.7, and the
    # calibration's bracket search must not fail on the invalid large values it probes
    cfg = TrainConfig(**dict(BASE, strategy="quantile", strategy_params={}), epsilon=1.0)
    s = train(cfg, progress=False).summary
    assert 0.999 <= s["epsilon"] <= 1.0 and s["noise_multiplier"] < 6.4


def test_diagnostics_are_logged_under_nonprivate_prefix():
    cfg = TrainConfig(**dict(BASE, epochs=1, strategy_params={"clip_norm": 0.01}),
                      noise_multiplier=1.0, diagnostics=True)
    row = train(cfg, progress=False).history[-1]
    assert row["nonprivate/ms_per_step"] > 0 and "ms_per_step" not in row  # NON-PRIVATE timing
    q10, q50, q90 = (row[f"nonprivate/norm_q{q}"] for q in (10, 50, 90))
    assert 0 < q10 <= q50 <= q90
    # with C far below the norms every example is clipped: weights ~ C/n, bias is large, and the
    # cosine of the clipped sum with the true sum is below 1 but positive
    assert row["nonprivate/unclipped_fraction"] == 0.0
    assert 0 < row["nonprivate/cosine"] < 1
    assert row["nonprivate/clip_bias_rel"] > 0.5
    plain = train(TrainConfig(**dict(BASE, epochs=1), noise_multiplier=1.0), progress=False)
    assert not any(k.startswith("nonprivate/") for k in plain.history[-1])


def test_diagnostics_oracle_no_clipping_means_no_bias():
    import torch
    from torch import nn

    from dpclip.clipping import FixedClip
    from dpclip.diagnostics import nonprivate_diagnostics
    from dpclip.engine import ParamGroups

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3)).double()
    x, y = torch.randn(9, 4, dtype=torch.float64), torch.randint(0, 3, (9,))
    ce = lambda o, t: nn.functional.cross_entropy(o, t, reduction="none")  # noqa: E731
    d = nonprivate_diagnostics(model, ce, x, y, FixedClip(1e6), {}, ParamGroups.flat(model))
    assert d["nonprivate/clip_bias"] < 1e-12 and abs(d["nonprivate/cosine"] - 1) < 1e-12
    assert d["nonprivate/unclipped_fraction"] == 1.0


# ------------------------------------------------------------------------------------- device
@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "CPU", ""])
def test_bad_device_is_refused_naming_the_choices(bad):
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda', 'cuda:N' or 'auto'"):
        TrainConfig(**BASE, noise_multiplier=1.0, device=bad)


def test_device_is_an_execution_setting_not_part_of_the_fingerprint():
    a = TrainConfig(**BASE, noise_multiplier=1.0)
    b = TrainConfig(**BASE, noise_multiplier=1.0, device="cuda")
    c = TrainConfig(**BASE, noise_multiplier=1.1, device="cuda")
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error_and_auto_runs_on_cpu():
    with pytest.raises(ValueError, match="no CUDA device; use --device cpu"):
        train(TrainConfig(**BASE, noise_multiplier=1.0, device="cuda"), progress=False)
    cfg = dict(BASE, epochs=1, reproducible_noise=True)  # same noise: results comparable
    auto = train(TrainConfig(**cfg, noise_multiplier=1.0, device="auto"), progress=False)
    cpu = train(TrainConfig(**cfg, noise_multiplier=1.0), progress=False)
    assert auto.summary["device"] == "cpu"
    assert auto.ledger.to_dict() == cpu.ledger.to_dict()
    assert auto.summary["test_accuracy"] == cpu.summary["test_accuracy"]


# ------------------------------------------------------------------- evaluation where asked
def test_eval_every_evaluates_where_asked_and_is_not_part_of_the_fingerprint():
    cfg = dict(BASE, epochs=3, reproducible_noise=True)
    every = train(TrainConfig(**cfg, noise_multiplier=1.0), progress=False)
    end = train(TrainConfig(**cfg, noise_multiplier=1.0, eval_every=0), progress=False)
    two = train(TrainConfig(**cfg, noise_multiplier=1.0, eval_every=2), progress=False)
    assert [r["epoch"] for r in every.history] == [1, 2, 3]
    assert [r["epoch"] for r in end.history] == [3]
    assert [r["epoch"] for r in two.history] == [2, 3]
    # the same model and ledger: evaluation is an execution setting
    assert end.ledger.to_dict() == every.ledger.to_dict()
    assert end.summary["test_accuracy"] == every.summary["test_accuracy"]
    assert end.history[-1]["epsilon"] == every.history[-1]["epsilon"]
    assert TrainConfig(**cfg, noise_multiplier=1.0, eval_every=0).fingerprint() == \
        TrainConfig(**cfg, noise_multiplier=1.0).fingerprint()
    s = end.summary
    assert 0 < s["train_seconds"] <= s["wall_seconds"]
    with pytest.raises(ValueError, match=r"eval_every \(--eval-every\) must be >= 0"):
        TrainConfig(**cfg, noise_multiplier=1.0, eval_every=-1)
