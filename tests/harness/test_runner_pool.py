"""The runner's worker pool: forked by default, spawned once this process holds a CUDA context
(a forked child cannot use the CUDA context it inherits, so `--workers N` after trials on a GPU
would fail every run)."""

import torch

from dpclip.harness import runner
from dpclip.harness.runner import run_experiment
from dpclip.harness.spec import parse_spec
from dpclip.store import ResultsStore


def tiny_spec():
    return parse_spec({
        "name": "pool-tiny",
        "train": dict(dataset="synthetic", model="logreg", epochs=1, batch_size=64, lr=0.5,
                      delta=1e-5, accountant="rdp"),
        "grid": {"epsilons": [4.0], "seeds": [0, 1]},
        "strategies": [{"name": "fixed", "params": {"clip_norm": 1.0}}],
    })


def test_pool_context_is_default_without_cuda_and_spawn_with_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert runner._pool_context() is None
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    ctx = runner._pool_context()
    assert ctx is not None and ctx.get_start_method() == "spawn"


def test_parallel_runs_finish_in_spawned_workers(tmp_path, monkeypatch):
    """What a GPU cell does after its trials: the final runs in a spawned pool, each worker
    opening the store itself; both seeds finish and are stored once."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    used = []
    real = runner.ProcessPoolExecutor

    def spy(*a, **kw):
        used.append(kw.get("mp_context"))
        return real(*a, **kw)

    monkeypatch.setattr(runner, "ProcessPoolExecutor", spy)
    db = str(tmp_path / "r.db")
    rep = run_experiment(tiny_spec(), db=db, out_dir=tmp_path / "out", workers=2, threads=1,
                         progress=False)
    assert not rep.failed and len(rep.finished) == 2
    assert [c.get_start_method() for c in used] == ["spawn"]
    with ResultsStore(db) as store:
        rows = list(store.runs("finished", "pool-tiny"))
    assert sorted(r["config"]["seed"] for r in rows) == [0, 1]
