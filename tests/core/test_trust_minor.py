"""The minor findings of the second trust review (issue 33), each attacked as found."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dpclip import make_private


# ------------------------------------------- the loss-shape error quotes no realised batch size

def test_the_loss_shape_error_does_not_quote_the_batch_size():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(400, 5, generator=g), torch.randint(0, 2, (400,), generator=g)
    model = nn.Linear(5, 2)
    dp = make_private(model, None, (x, y), noise_multiplier=1.0, steps=2, batch_size=40,
                      engine="ghost", verbose=False,
                      loss_fn=lambda out, t: F.cross_entropy(out, t, reduction="none")[None, :])
    xb, yb = dp.sample()
    with pytest.raises(ValueError, match="per-example losses of shape") as info:
        dp.backward(xb, yb)
    numbers = re.findall(r"\d+", str(info.value))
    assert str(len(xb)) not in numbers, str(info.value)


def test_failed_runs_store_no_numbers(tmp_path):
    from dpclip.store import ResultsStore

    with ResultsStore(tmp_path / "r.db") as store:
        rid = store.start_run("fp", {"a": 1}, experiment="e", label="l")
        store.fail_run(rid, "ValueError: got shape (37, 10) for a batch of 37; value 0.25")
        row = store._conn.execute("SELECT error FROM runs WHERE id=?", (rid,)).fetchone()
    assert re.findall(r"\d", row[0]) == [], row[0]
    assert row[0].startswith("ValueError: got shape (#, #) for a batch of #")


# ---------------------------------------------------------- is_public follows the data

def test_replacing_the_split_of_a_public_bundle_with_private_data_is_refused():
    from dpclip.data import load_dataset
    from dpclip.data.base import DatasetBundle, TensorSplit

    public = load_dataset("mnist-5k")
    assert public.is_public
    g = torch.Generator().manual_seed(0)
    mine = DatasetBundle("mine", TensorSplit(torch.rand(20, 1, 28, 28, generator=g),
                                             torch.randint(0, 10, (20,), generator=g)),
                         TensorSplit(torch.rand(5, 1, 28, 28, generator=g),
                                     torch.randint(0, 10, (5,), generator=g)),
                         10, (1, 28, 28), source="a private file")
    with pytest.raises(ValueError, match="holds the data of a bundle declared private"):
        dataclasses.replace(public, train=mine.train)
    with pytest.raises(ValueError, match="holds the data of a bundle declared private"):
        dataclasses.replace(public, train=mine.train.subset(torch.arange(10)))
    # declaring it private is the way
    assert not dataclasses.replace(public, train=mine.train, is_public=False).is_public
    # public data stays public through replace
    assert dataclasses.replace(public, train=public.train.subset(torch.arange(10))).is_public


# ------------------------------------------------ a schedule without a dataset is not replayed

def test_a_stored_schedule_without_a_dataset_key_is_refused_for_transfer(tmp_path):
    from dpclip.store import ResultsStore
    from dpclip.search import resolve_strategy_params
    from dpclip.training.trainer import TrainConfig

    cfg = TrainConfig(dataset="synthetic", model="mlp", strategy="transfer",
                      strategy_params={"schedule": "nods"}, delta=1e-5, epochs=1,
                      batch_size=64, lr=0.5, noise_multiplier=1.0)
    with ResultsStore(tmp_path / "r.db") as store:
        store.save_schedule("nods", [1.0], {"model": "mlp"})  # no "dataset" key
        with pytest.raises(ValueError, match="stored without the dataset it was searched on"):
            resolve_strategy_params(cfg, store)


# ----------------------------------------- white-box audit: --epsilon beside --noise-multiplier

def test_whitebox_audit_refuses_epsilon_beside_a_noise_multiplier(capsys, tmp_path):
    """It used to ignore --epsilon silently, so "z = 0.1 claimed as epsilon 1" looked audited."""
    from dpclip.cli import main

    rc = main(["audit", "--strategy", "fixed", "--noise-multiplier", "0.1", "--epsilon", "1",
               "--delta", "1e-5", "--db", str(tmp_path / "a.db"), "--canaries", "8",
               "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--epsilon is not used with --noise-multiplier" in err


# ------------------------------------------ Flower: results validated before the ledger records

def _fl_strategy():
    pytest.importorskip("flwr", reason="Flower not installed (pip install 'dpclip[flower]')")
    from dpclip.federated.flower import _server_for

    spec = {"dataset": "synthetic", "dataset_options": {"n_train": 96, "n_test": 64},
            "num_users": 4, "partition": "iid", "model": "mlp", "model_options": {"hidden": [8]},
            "strategy": "fixed", "params": {"clip_norm": 1.0}, "rounds": 2,
            "clients_per_round": 2, "sampling": "poisson", "noise_multiplier": 0.3,
            "delta": 1e-3, "local_epochs": 1, "local_batch_size": 8, "client_lr": 0.1,
            "seed": 5, "reproducible_noise": True, "eval_every": 2}
    strategy, _ = _server_for(spec, wait_timeout=1.0)
    return strategy


def _fit_res(user, size):
    import numpy as np
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

    return (None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(
        [np.zeros(size, dtype=np.float32)]), 1, {"dpclip_user_id": user}))


@pytest.mark.parametrize("case", ["duplicate", "wrong-size"])
def test_flower_results_are_validated_before_anything_is_recorded(case):
    strategy = _fl_strategy()
    d = strategy.server.theta.numel()
    strategy._sampled = frozenset({0, 1})
    if case == "duplicate":  # two results claiming the same user: used to crash in sorted()
        results, match = [_fit_res(0, d), _fit_res(0, d)], "two results claim user 0"
    else:  # every delta of a wrong size: used to be recorded in the ledger, then fail
        results, match = [_fit_res(0, d + 3), _fit_res(1, d + 3)], "not one array of the model"
    with pytest.raises(ValueError, match=match):
        strategy.aggregate_fit(1, results, [])
    assert strategy.server.aggregator.ledger.steps == 0


# ------------------------------------ the committed evidence store holds no unlabelled diagnostics

def test_committed_reproductions_store_has_no_nonprivate_metrics_or_step_timings():
    """42 older runs kept nonprivate/ norm quantiles (and every run ms_per_step) in their
    per-epoch history, although their summaries did not label diagnostics NON-PRIVATE."""
    import json
    import sqlite3
    from pathlib import Path

    db = Path(__file__).resolve().parents[2] / "reproductions" / "results.db"
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        labelled = {rid for rid, s in con.execute("SELECT id, summary FROM runs")
                    if s and "NON-PRIVATE" in str(json.loads(s).get("diagnostics"))}
        bad = [(rid, k) for rid, m in con.execute("SELECT run_id, metrics FROM epochs")
               for k in json.loads(m)
               if (k.startswith("nonprivate/") and rid not in labelled) or k == "ms_per_step"]
    finally:
        con.close()
    assert bad == [], bad[:5]


def test_flower_failures_keep_no_message():
    strategy = _fl_strategy()
    strategy._sampled = frozenset()
    strategy.aggregate_fit(1, [], [RuntimeError("user 3 has 17 examples of shape (17, 20)")])
    assert strategy.failures == ["RuntimeError"]
