"""Lin et al.'s Algorithm 1: exact control flow, public-data rule, resume, noise helper."""

import pytest
import torch

from dpclip.search import (
    GreedyConfig,
    PrivateDataError,
    candidate_threshold,
    check_public,
    greedy_search,
    search_noise_multiplier,
)

#: accuracy of candidate k (C = 0.1 + 0.1 k) per epoch; binary fractions so "A_best - A <= S"
#: is exact. S = 0.125.
TABLE = {
    1: [0.5, 0.625, 0.5, 0.75, 0.625, 0.5, 0.99],  # falls by exactly S twice, then by 2S: stop
    2: [0.875, 0.75, 0.625, 0.99],  # best first; stop at the 3rd
    3: [0.25, 0.25, 0.375, 0.25, 0.25, 0.125, 0.99],  # ties are not improvements
}
S = 0.125


def reference_algorithm1(accs, tolerance, c_start=0.1, step=0.1):
    """Algorithm 1 literally: returns (C_t, index of the best, number of candidates tried)."""
    c_best, a, a_best, k, best_k = c_start, 0.0, 0.0, 0, None
    while a_best - a <= tolerance:
        a = accs[k]
        if a > a_best:
            a_best, c_best, best_k = a, c_start + k * step, k
        k += 1
    return c_best, best_k, k


def digits_config(**kw):
    base = dict(dataset="digits", model="logreg", noise_multiplier=0.5, batch_size=256, lr=0.5,
                epochs=3, c_start=0.1, step=0.1, tolerance=S, seed=0)
    base.update(kw)
    return GreedyConfig(**base)


def test_follows_algorithm_1_exactly_with_a_fake_evaluator():
    calls = []

    def fake(model, epoch, clip):
        k = round((clip - 0.1) / 0.1)
        calls.append((epoch, clip))
        return TABLE[epoch][k]

    res = greedy_search(digits_config(), evaluator=fake, progress=False)
    expect = [reference_algorithm1(TABLE[e], S) for e in (1, 2, 3)]
    assert res.thresholds == pytest.approx([e[0] for e in expect])
    assert res.thresholds == [0.4, 0.1, 0.3]
    # not stopped at the first decrease: epoch 1 tried 6 candidates, epoch 2 three, epoch 3 six
    assert [sum(c["epoch"] == e for c in res.candidates) for e in (1, 2, 3)] == \
        [e[2] for e in expect] == [6, 3, 6]
    assert res.accuracies == [0.75, 0.875, 0.375]
    assert [c for _, c in calls][:6] == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    # every candidate of an epoch starts from the previous epoch's BEST candidate
    by_epoch = {e: [c for c in res.candidates if c["epoch"] == e] for e in (1, 2, 3)}
    assert len({c["start_digest"] for c in by_epoch[1]}) == 1
    for e, best_k in ((2, 3), (3, 0)):
        best = by_epoch[e - 1][best_k]
        assert best["improved"] and best["clip_norm"] == res.thresholds[e - 2]
        assert {c["start_digest"] for c in by_epoch[e]} == {best["digest"]}
    # the candidates really differ (threshold changes the trained model)
    assert len({c["digest"] for c in by_epoch[1]}) == 6
    assert res.metadata["best_accuracies"] == res.accuracies
    assert "epsilon" not in res.metadata and res.metadata["privacy"] == "public"


def test_candidate_thresholds_are_clean_decimals():
    assert [candidate_threshold(0.05, 0.01, k) for k in range(4)] == [0.05, 0.06, 0.07, 0.08]


def test_private_dataset_is_refused_unless_explicitly_allowed():
    cfg = dict(model="logreg", noise_multiplier=1.0, batch_size=64, lr=0.5, epochs=1,
               c_start=0.5, step=0.5, tolerance=0.05)
    with pytest.raises(PrivateDataError, match="not differentially private.*'synthetic' is "
                       "marked private.*--nonprivate-search"):
        greedy_search(GreedyConfig(dataset="synthetic", **cfg), progress=False)
    res = greedy_search(GreedyConfig(dataset="synthetic", allow_private_data=True, **cfg),
                        progress=False)
    assert res.metadata["privacy"] == "NON-PRIVATE" and res.metadata["nonprivate"] is True
    assert not any("epsilon" in k for k in res.metadata)
    # declared pairs: fashion-mnist is the public proxy FOR mnist, not in general
    base = dict(cfg, dataset="fashion-mnist")
    assert check_public(GreedyConfig(proxy_for="mnist", **base)) == "public proxy for mnist"
    with pytest.raises(PrivateDataError):
        check_public(GreedyConfig(**base))
    assert check_public(GreedyConfig(**dict(base, dataset="mnist-5k"))) == "public"


def test_killed_search_resumes_to_the_same_thresholds(tmp_path):
    cfg = digits_config(epochs=2, c_start=0.5, step=0.5, tolerance=0.05, noise_multiplier=1.0)
    full = greedy_search(cfg, progress=False)
    ck = tmp_path / "ck"
    part = greedy_search(cfg, checkpoint_dir=ck, progress=False, stop_after_candidates=2)
    assert part.interrupted and (ck / "greedy.pt").exists()
    part = greedy_search(cfg, checkpoint_dir=ck, progress=False, stop_after_candidates=3)
    assert part.interrupted
    resumed = greedy_search(cfg, checkpoint_dir=ck, progress=False)
    assert not resumed.interrupted
    assert resumed.thresholds == full.thresholds
    assert [(c["clip_norm"], c["accuracy"], c["digest"]) for c in resumed.candidates] == \
        [(c["clip_norm"], c["accuracy"], c["digest"]) for c in full.candidates]
    for a, b in zip(resumed.model.state_dict().values(), full.model.state_dict().values()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="different search configuration"):
        greedy_search(digits_config(epochs=2, c_start=0.5, step=0.5, seed=1),
                      checkpoint_dir=ck, progress=False)


def test_config_validation():
    with pytest.raises(ValueError, match="tolerance must be in"):
        digits_config(tolerance=2.0)
    with pytest.raises(ValueError, match="step must be"):
        digits_config(step=0)


def test_noise_helper_matches_the_trainer():
    from dpclip.training.trainer import TrainConfig, train

    z = search_noise_multiplier(3.0, 1e-5, batch_size=64, epochs=2, dataset_size=512,
                                accountant="rdp")
    cfg = TrainConfig(dataset="synthetic", model="logreg", strategy="fixed",
                      strategy_params={"clip_norm": 1.0}, epsilon=3.0, delta=1e-5, epochs=2,
                      batch_size=64, lr=0.1, accountant="rdp")
    full = train(cfg, progress=False)
    assert full.summary["noise_multiplier"] == pytest.approx(z, rel=1e-9)


RUNNER = """
import sys
from dpclip.cli import main
sys.exit(main(["search", "--dataset", "digits", "--model", "logreg", "--noise-multiplier", "1",
               "--batch-size", "128", "--lr", "0.5", "--epochs", "2", "--c-start", "0.05",
               "--step", "0.25", "--tolerance", "0.03", "--db", sys.argv[1], "--checkpoint-dir",
               sys.argv[2], "--name", "k", "--no-progress"]))
"""


def test_sigkilled_search_resumes(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from dpclip.store import ResultsStore
    from dpclip.search import run_or_reuse

    db, ck = tmp_path / "r.db", tmp_path / "ck"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, str(db), str(ck)], env=env)
    t0 = time.time()
    while not (ck / "k" / "greedy.pt").exists() and proc.poll() is None and time.time() - t0 < 60:
        time.sleep(0.02)
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    cfg = GreedyConfig(dataset="digits", model="logreg", noise_multiplier=1.0, batch_size=128,
                       lr=0.5, epochs=2, c_start=0.05, step=0.25, tolerance=0.03)
    with ResultsStore(db) as store:
        _, resumed, _ = run_or_reuse(cfg, store, name="k", checkpoint_root=ck, progress=False)
    assert resumed == greedy_search(cfg, progress=False).thresholds


@pytest.mark.parametrize("rel, reused", [(1e-10, True), (-1e-10, True), (1e-6, False)])
def test_run_or_reuse_matches_a_stored_search_across_noise_round_off(tmp_path, monkeypatch,
                                                                      rel, reused):
    """A finished search stored from another machine, whose calibrated sigma differs only in its
    last digits (1e-10 relative, seen between the CPU and GPU images), is reused; a sigma that
    really differs (1e-6) runs a new search."""
    from dpclip.store import ResultsStore
    from dpclip.search import default_schedule_name, run_or_reuse
    from dpclip.search import greedy as greedy_mod
    from dpclip.search import resolve as resolve_mod

    base = dict(dataset="digits", model="logreg", batch_size=128, lr=0.5, epochs=1,
                c_start=0.05, step=0.25, tolerance=0.03)
    stored_cfg = GreedyConfig(noise_multiplier=1.4692802216793703, **base)
    calls = []

    def fake_search(config, **kw):
        calls.append(config.noise_multiplier)
        return greedy_mod.GreedyResult(
            thresholds=[0.3 if config is stored_cfg else 0.55], accuracies=[0.9], candidates=[],
            metadata={"kind": "lin-greedy", "config": config.to_dict(),
                      "fingerprint": config.fingerprint()})

    monkeypatch.setattr(resolve_mod, "greedy_search", fake_search)
    with ResultsStore(tmp_path / "r.db") as store:
        name0, th0, _ = run_or_reuse(stored_cfg, store, progress=False)
        assert calls == [stored_cfg.noise_multiplier] and th0 == [0.3]
        other = GreedyConfig(noise_multiplier=stored_cfg.noise_multiplier * (1 + rel), **base)
        assert default_schedule_name(other) != name0  # the exact fingerprint misses it
        name, th, _ = run_or_reuse(other, store, progress=False)
        if reused:
            assert (name, th, len(calls)) == (name0, [0.3], 1)
        else:
            assert name == default_schedule_name(other) and th == [0.55] and len(calls) == 2
        # any other field differing is another search, round-off or not
        other_lr = GreedyConfig(noise_multiplier=stored_cfg.noise_multiplier * (1 + rel),
                                **{**base, "lr": 0.25})
        assert run_or_reuse(other_lr, store, progress=False)[0] == default_schedule_name(other_lr)


@pytest.mark.parametrize("rel, adopted", [(1e-10, True), (1e-6, False)])
def test_run_or_reuse_resumes_an_unfinished_search_across_noise_round_off(tmp_path, rel, adopted):
    """An unfinished search checkpointed on another machine's image (its calibrated sigma differs
    in the last digits, so its folder name differs) resumes under its own name and sigma instead of
    restarting; a sigma that really differs starts its own search."""
    from dpclip.store import ResultsStore
    from dpclip.search import default_schedule_name, run_or_reuse, same_checkpoint
    from dpclip.search.resolve import _safe

    there = digits_config(epochs=2, c_start=0.5, step=0.5, tolerance=0.05,
                          noise_multiplier=1.0717701355348621, device="cpu")
    root = tmp_path / "ck"
    ck_dir = root / _safe(default_schedule_name(there))
    part = greedy_search(there, checkpoint_dir=ck_dir, progress=False, stop_after_candidates=2)
    assert part.interrupted
    done_before = len(torch.load(ck_dir / "greedy.pt", weights_only=False)["candidates"])
    here = digits_config(epochs=2, c_start=0.5, step=0.5, tolerance=0.05,
                         noise_multiplier=there.noise_multiplier * (1 + rel))
    assert default_schedule_name(here) != default_schedule_name(there)
    found = same_checkpoint(root, here)
    assert (found == there) is adopted and (found is None) is not adopted
    with ResultsStore(tmp_path / "r.db") as store:
        name, th, meta = run_or_reuse(here, store, checkpoint_root=root, progress=False)
    if adopted:
        assert name == default_schedule_name(there)
        assert meta["config"]["noise_multiplier"] == there.noise_multiplier
        assert th == greedy_search(there, progress=False).thresholds
        assert done_before > 0 and len(meta["candidates"]) > done_before
    else:
        assert name == default_schedule_name(here)
        assert th == greedy_search(here, progress=False).thresholds
    # any other field differing is another search
    assert same_checkpoint(root, digits_config(epochs=2, c_start=0.5, step=0.5, tolerance=0.05,
                                               noise_multiplier=there.noise_multiplier,
                                               lr=0.25)) is None


def test_checkpoint_is_written_owner_only_like_the_trainers(tmp_path):
    """One atomic save (dpclip.training.checkpoint.atomic_private_save) for the trainer and the
    search: 0700 directory, 0600 file, no temporary file left behind."""
    import stat

    ck = tmp_path / "ck"
    cfg = digits_config(epochs=1, c_start=0.5, step=0.5, tolerance=0.05, noise_multiplier=1.0)
    greedy_search(cfg, checkpoint_dir=ck, progress=False, stop_after_candidates=1)
    assert stat.S_IMODE((ck / "greedy.pt").stat().st_mode) == 0o600
    assert stat.S_IMODE(ck.stat().st_mode) == 0o700
    assert sorted(p.name for p in ck.iterdir()) == ["greedy.pt"]
