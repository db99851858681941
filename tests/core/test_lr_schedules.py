"""Learning-rate schedules: per-step rates against closed forms, exact resume mid-schedule, and
no effect on privacy (the ledger is the same with every schedule)."""

import hashlib
import json
import math

import pytest
import torch

from dpclip.lr_schedules import build_lr_scheduler
from dpclip.training.trainer import TrainConfig, train

BASE = dict(dataset="synthetic", model="mlp", strategy="fixed",
            strategy_params={"clip_norm": 1.0}, delta=1e-5, epochs=3, batch_size=64, lr=0.5,
            optimizer="momentum", seed=0)  # synthetic: 512 examples -> 8 steps per epoch
SPE = 8


def closed_form(t: int, schedule: str, lr: float, *, gamma=None, k=None, lr_min=0.0, w=0,
                total=0) -> float:
    """The learning rate of step t (0-based), written out from the definitions."""
    if t < w:
        return lr * (t + 1) / w
    s = t - w
    if schedule == "constant":
        return lr
    if schedule == "step":
        return lr * gamma ** (s // (k * SPE))
    if schedule == "exponential":
        return lr * gamma ** (s // SPE)
    return lr_min + (lr - lr_min) * (1 + math.cos(math.pi * s / (total - w))) / 2


CASES = [("constant", {}), ("step", dict(gamma=0.5, k=2)), ("exponential", dict(gamma=0.9)),
         ("cosine", dict(lr_min=0.01)), ("cosine", {})]


@pytest.mark.parametrize("schedule,kw", CASES)
@pytest.mark.parametrize("w", [0, 1, 5])
def test_rates_per_step_match_the_closed_form(schedule, kw, w):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.7)
    total = 40
    sched = build_lr_scheduler(opt, schedule=schedule, gamma=kw.get("gamma"),
                               step_epochs=kw.get("k"), lr_min=kw.get("lr_min"),
                               warmup_epochs=w / SPE, steps_per_epoch=SPE, total_steps=total)
    assert (sched is None) == (schedule == "constant" and w == 0)
    for t in range(total):
        want = closed_form(t, schedule, 0.7, w=w, total=total, **kw)
        assert opt.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12, abs=1e-15), t
        opt.step()
        if sched is not None:
            sched.step()


def test_exponential_schedule_in_training_per_epoch():
    cfg = TrainConfig(**dict(BASE, epochs=4), noise_multiplier=1.0, lr_schedule="exponential",
                      lr_gamma=0.9)
    res = train(cfg, progress=False)
    # the rate of each epoch's last step: lr x 0.9 per epoch (Nguyen et al.)
    assert [h["lr"] for h in res.history] == pytest.approx([0.5 * 0.9 ** e for e in range(4)])
    assert res.summary["lr_schedule"] == {"name": "exponential", "lr": 0.5, "per": "step",
                                          "gamma": 0.9}


def test_resume_mid_schedule_equals_an_uninterrupted_run(tmp_path):
    cfg = TrainConfig(**BASE, noise_multiplier=1.0, reproducible_noise=True,
                      lr_schedule="cosine", lr_min=0.05, lr_warmup_epochs=0.5)
    full = train(cfg, progress=False)
    part = train(cfg, checkpoint_dir=tmp_path, progress=False, stop_after_steps=11)
    assert part.summary.get("interrupted")  # stopped inside the second epoch, after warm-up
    resumed = train(cfg, checkpoint_dir=tmp_path, progress=False)
    assert [h["lr"] for h in resumed.history] == [h["lr"] for h in full.history]
    assert resumed.ledger == full.ledger
    for (n, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), n
    # and the rates are the closed form's (warm-up 4 steps, then cosine over 20)
    want = [closed_form(e * SPE - 1, "cosine", 0.5, lr_min=0.05, w=4, total=24)
            for e in (1, 2, 3)]
    assert [h["lr"] for h in full.history] == pytest.approx(want, rel=1e-12)


def test_schedule_does_not_change_the_privacy_ledger():
    runs = {}
    for name, extra in (("constant", {}), ("step", dict(lr_gamma=0.1, lr_step_epochs=1)),
                        ("cosine", dict(lr_warmup_epochs=1.0))):
        cfg = TrainConfig(**BASE, epsilon=3.0, reproducible_noise=True, lr_schedule=name, **extra)
        runs[name] = train(cfg, progress=False)
    base = runs["constant"]
    for name, r in runs.items():
        assert r.ledger == base.ledger, name
        assert r.summary["noise_multiplier"] == base.summary["noise_multiplier"]
        assert r.summary["epsilon"] == base.summary["epsilon"]
    # while the training itself did change (the schedule is not silently ignored)
    w0 = next(iter(base.model.state_dict().values()))
    assert not torch.equal(w0, next(iter(runs["step"].model.state_dict().values())))


def test_default_schedule_keeps_the_fingerprint_of_older_configs():
    cfg = TrainConfig(**BASE, noise_multiplier=1.0)
    d = cfg.to_dict()
    d["max_physical_batch"] = 256  # (the default of older configs: hashed at it)
    for key in ("data_dir", "device", "eval_every", "augment", "lr_schedule", "lr_gamma",
                "lr_step_epochs", "lr_min", "lr_warmup_epochs", "augment_multiplicity",
                "averaging", "unit", "miniset_size", "bn_stats", "public_fraction"):  # at default
        d.pop(key)
    assert cfg.fingerprint() == hashlib.sha256(
        json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
    other = TrainConfig(**BASE, noise_multiplier=1.0, lr_schedule="exponential", lr_gamma=0.9)
    assert other.fingerprint() != cfg.fingerprint()


@pytest.mark.parametrize("extra,match", [
    (dict(lr_schedule="exponentail"), "did you mean 'exponential'"),
    (dict(lr_schedule="exponential"), r"needs lr_gamma \(--lr-gamma\)"),
    (dict(lr_schedule="step", lr_gamma=0.5), r"needs lr_step_epochs"),
    (dict(lr_gamma=0.5), r"lr_gamma \(--lr-gamma\) is not used by lr_schedule 'constant'"),
    (dict(lr_schedule="exponential", lr_gamma=1.5), r"in \(0, 1\]"),
    (dict(lr_schedule="cosine", lr_min=0.9), r"lr_min .* \[0, lr = 0.5\)"),
    (dict(lr_warmup_epochs=-1), "lr_warmup_epochs"),
])
def test_bad_schedule_settings_name_the_field(extra, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**BASE, noise_multiplier=1.0, **extra)


def test_warmup_longer_than_the_run_is_refused():
    cfg = TrainConfig(**BASE, noise_multiplier=1.0, lr_warmup_epochs=3)
    with pytest.raises(ValueError, match="shorten the warm-up"):
        train(cfg, progress=False)


def test_cli_flags_reach_the_run_and_its_summary(tmp_path, capsys):
    from dpclip.cli import main

    common = ["train", "--dataset", "synthetic", "--model", "logreg", "--epochs", "2",
              "--batch-size", "128", "--noise-multiplier", "1", "--delta", "1e-5",
              "--db", str(tmp_path / "r.db"), "--no-progress"]
    assert main(common + ["--lr", "0.4", "--lr-schedule", "step", "--lr-gamma", "0.5",
                          "--lr-step-epochs", "1", "--json"]) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["lr_schedule"] == {"name": "step", "lr": 0.4, "per": "step", "gamma": 0.5,
                                "step_epochs": 1}
    assert main(common + ["--lr-schedule", "exponential"]) == 2
    assert "needs lr_gamma (--lr-gamma)" in capsys.readouterr().err
