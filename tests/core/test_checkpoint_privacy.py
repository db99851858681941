"""What a checkpoint keeps (dpclip.training.checkpoint, issue 33): a finished run drops the secret
generator state and the data fingerprint; checkpoints are owner-only; the harness keeps them
outside the directory of its reports."""

import os
import stat

import pytest
import torch

from dpclip.training.checkpoint import FINISHED_NOTE, private_root
from dpclip.training.trainer import TrainConfig, train

BASE = dict(dataset="synthetic", model="mlp", strategy="fixed",
            strategy_params={"clip_norm": 1.0}, delta=1e-5, epochs=1, batch_size=64, lr=0.5,
            optimizer="momentum", seed=0, noise_multiplier=1.0)


def test_a_finished_run_drops_the_generator_state_and_says_so(tmp_path, capsys):
    cfg = TrainConfig(**BASE)
    part = train(cfg, checkpoint_dir=tmp_path, progress=False, stop_after_steps=3)
    assert part.summary.get("interrupted")
    ck = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert "sampling" in ck["private"]["randomness"] and ck["data_fingerprint"]  # resumable
    done = train(cfg, checkpoint_dir=tmp_path, progress=False)
    ck = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert ck["finished"] is True
    assert set(ck["private"]["randomness"]) == {"mode"}  # public: "secure"
    assert "data_fingerprint" not in ck
    # (its copy under "private" survived before: a hash of the training data that confirms which
    # neighbouring dataset was trained on; thirty-second hostile review)
    assert "data_fingerprint" not in ck["private"]
    assert FINISHED_NOTE in capsys.readouterr().err
    # running it again re-reads the finished run (no step, no secret needed)
    again = train(cfg, checkpoint_dir=tmp_path, progress=False)
    assert again.ledger == done.ledger and again.summary["epsilon"] == done.summary["epsilon"]


def test_a_finished_checkpoint_cannot_be_resumed_into_more_steps(tmp_path):
    from dpclip import make_private
    from dpclip.training.checkpoint import finished_checkpoint
    from torch import nn

    x, y = torch.randn(100, 4), torch.randint(0, 2, (100,))
    model = nn.Linear(4, 2)
    dp = make_private(model, None, (x, y), noise_multiplier=1.0, steps=2, batch_size=10,
                      verbose=False)
    xb, yb = dp.sample()
    dp.backward(xb, yb)
    ck = finished_checkpoint({"private": dp.state_dict()})["private"]
    dp2 = make_private(model, None, (x, y), noise_multiplier=1.0, steps=2, batch_size=10,
                       verbose=False)
    with pytest.raises(ValueError, match="finished run"):
        dp2.load_state_dict(ck)


def test_checkpoints_are_owner_only(tmp_path):
    ckdir = tmp_path / "ck"
    train(TrainConfig(**BASE), checkpoint_dir=ckdir, progress=False, stop_after_steps=2)
    assert stat.S_IMODE(os.stat(ckdir / "checkpoint.pt").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(ckdir).st_mode) == 0o700


def test_harness_checkpoints_are_not_beside_the_reports(tmp_path, monkeypatch):
    monkeypatch.delenv("DPCLIP_PRIVATE", raising=False)
    assert private_root(tmp_path / "runs") == tmp_path / "runs-private"
    from dpclip.harness.runner import run_experiment
    from dpclip.harness.spec import parse_spec

    train_fields = {k: v for k, v in BASE.items()
                    if k not in ("strategy", "strategy_params", "noise_multiplier", "seed")}
    spec = parse_spec({
        "name": "ckpriv",
        "train": train_fields,
        "grid": {"noise_multipliers": [1.0]},
        "strategies": [{"name": "fixed", "params": {"clip_norm": 1.0}}],
    })
    out = tmp_path / "runs"
    run_experiment(spec, db=tmp_path / "r.db", out_dir=out, progress=False)
    published = [p for p in out.rglob("*") if p.is_file()] if out.exists() else []
    assert not any(p.suffix in (".pt", ".tmp") for p in published), published
    cks = list((tmp_path / "runs-private" / "checkpoints").rglob("checkpoint.pt"))
    assert len(cks) == 1
    assert set(torch.load(cks[0], weights_only=False)["private"]["randomness"]) == {"mode"}


def test_a_checkpoint_cannot_be_loaded_into_an_object_that_already_released_steps():
    """Thirty-second hostile review: an object that had released 5 steps loaded a 2-step
    checkpoint and its ledger went back to 2 steps (23 steps ran, 20 were counted)."""
    from dpclip import make_private
    from torch import nn

    x, y = torch.randn(200, 5), torch.randint(0, 2, (200,))

    def build():
        torch.manual_seed(0)
        m = nn.Linear(5, 2)
        return make_private(m, torch.optim.SGD(m.parameters(), lr=0.1), (x, y),
                            noise_multiplier=1.0, steps=20, batch_size=20, verbose=False)

    a = build()
    for _ in range(2):
        a.step(*a.sample())
    ck = a.state_dict()
    b = build()
    for _ in range(5):
        b.step(*b.sample())
    with pytest.raises(RuntimeError, match="after 5 private step"):
        b.load_state_dict(ck)
    assert b.steps == 5 and b.ledger.steps == 5
    fresh = build()
    fresh.load_state_dict(ck)  # (before any step: the resume)
    assert fresh.steps == 2 and fresh.ledger.steps == 2


def test_a_finished_checkpoint_keeps_no_count_of_compiled_steps():
    """Hundred-and-twenty-third hostile review: the finished checkpoint kept
    ``private.engine_compiled_steps`` (NON-PRIVATE: the non-empty Poisson batches less one; a
    threshold on it told D from D' in 83 % of runs)."""
    from dpclip.training.checkpoint import finished_checkpoint

    ck = {"private": {"randomness": {"mode": "secure", "state": 1}, "engine_compiled_steps": 16,
                      "data_fingerprint": "x", "step": 24},
          "torch_rng": b"", "data_fingerprint": "x"}
    out = finished_checkpoint(ck)
    assert "engine_compiled_steps" not in out["private"]
    assert out["private"]["step"] == 24 and out["private"]["finished"] is True
