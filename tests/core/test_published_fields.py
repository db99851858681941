"""Every field that dpclip train / fl train / the store publish is classified (dpclip.published),
the doc is the generated table, and a neighbouring dataset (one example or one user removed)
changes no field that is not accounted, held-out, timing, NON-PRIVATE or the dataset size."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dpclip import published as P
from dpclip.clipping.fixed import FixedClip
from dpclip.data import load_dataset
from dpclip.federated import FedAvgConfig, LocalTraining, federate, run_fedavg
from dpclip.models import build_model
from dpclip.training.trainer import TrainConfig, train

MAY_DIFFER = {"accounted", "heldout", "timing", "nonprivate"}
DATASET_SIZE = P.DATASET_SIZE_FIELDS

BASE = dict(dataset="synthetic", model="mlp", strategy="quantile", strategy_params={},
            delta=1e-5, epochs=1, batch_size=64, lr=0.5, optimizer="momentum", seed=0,
            noise_multiplier=1.0, reproducible_noise=True)


def _unclassified(record: dict, table: dict) -> list[str]:
    return sorted(k for k in record if P.classify(k, table) is None)


def _train(data=None):
    return train(TrainConfig(**BASE), data=data, progress=False)


def test_every_train_field_is_classified_and_neighbours_differ_only_where_allowed():
    bundle = load_dataset("synthetic", seed=0)
    full = _train(bundle)
    assert _unclassified(full.summary, P.TRAIN_SUMMARY) == []
    for row in full.history:
        assert _unclassified(row, P.TRAIN_HISTORY) == []  # e.g. no per-step timing
    n = len(bundle.train)
    keep = torch.arange(1, n)  # the neighbour: example 0 removed
    smaller = dataclasses.replace(bundle, train=bundle.train.subset(keep))
    near = _train(smaller)
    differ = {k for k in full.summary if full.summary[k] != near.summary.get(k)}
    bad = sorted(k for k in differ
                 if P.classify(k, P.TRAIN_SUMMARY) not in MAY_DIFFER and k not in DATASET_SIZE)
    assert bad == [], bad


def _fed(sizes_seed=0):
    # users of unequal size: the dirichlet partition
    bundle = load_dataset("synthetic", seed=0, n_train=240, n_test=64)
    return federate(bundle, 12, "dirichlet", seed=sizes_seed, alpha=0.3)


def _fl(fed):
    torch.manual_seed(0)
    model = build_model("mlp", fed.input_shape, fed.num_classes, hidden=(8,))
    cfg = FedAvgConfig(rounds=2, clients_per_round=4, delta=1e-3, noise_multiplier=0.5,
                       local=LocalTraining(1, 8, 0.2), reproducible_noise=True, eval_every=2)
    return run_fedavg(fed, model, FixedClip(1.0), cfg)


def test_every_fl_field_is_classified_and_removing_the_largest_user_changes_nothing_private():
    """`dpclip fl train --json` used to publish user_size_min/max/mean: removing the largest user
    changed user_size_max, printed next to a user-level epsilon."""
    fed = _fed()
    full = _fl(fed)
    assert _unclassified(full.summary, P.FL_SUMMARY) == []
    for row in full.history:
        assert _unclassified(row, P.FL_HISTORY) == []
        # twelfth hostile review: a round's time showed which users were sampled
        assert not any("seconds" in k and not k.startswith("nonprivate/") for k in row)
    sizes = fed.user_sizes()
    largest = max(range(len(sizes)), key=sizes.__getitem__)
    near_fed = dataclasses.replace(fed, users=tuple(u for i, u in enumerate(fed.users)
                                                   if i != largest))
    near = _fl(near_fed)
    differ = {k for k in full.summary if full.summary[k] != near.summary.get(k)}
    bad = sorted(k for k in differ
                 if P.classify(k, P.FL_SUMMARY) not in MAY_DIFFER and k not in DATASET_SIZE)
    assert bad == [], bad
    assert not any("user_size" in k for k in full.summary)


def test_user_sizes_only_under_the_nonprivate_opt_in():
    fed = _fed()
    assert "nonprivate/user_size_max" in fed.describe(nonprivate=True)
    assert not any("size" in k for k in fed.describe())


def test_the_doc_lists_every_field_as_generated():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "privacy.md").read_text()
    begin, end = "<!-- published-fields:begin -->", "<!-- published-fields:end -->"
    assert begin in doc and end in doc
    section = doc.split(begin, 1)[1].split(end, 1)[0].strip("\n") + "\n"
    assert section == P.markdown(), "regenerate: python -c 'import dpclip.published as p; " \
                                    "print(p.markdown())'"


@pytest.mark.parametrize("table", list(P.TABLES.values()))
def test_every_class_is_known(table):
    assert set(table.values()) <= set(P.CLASSES)


def test_every_field_dpclip_run_stores_is_classified(tmp_path):
    """The results store (runs.summary and epochs.metrics) of a `dpclip run` grid."""
    import json
    import sqlite3

    from dpclip.harness.runner import run_experiment
    from dpclip.harness.spec import parse_spec

    train_fields = {k: v for k, v in BASE.items()
                    if k not in ("strategy", "strategy_params", "noise_multiplier", "seed")}
    spec = parse_spec({"name": "pubfields", "train": train_fields,
                       "grid": {"noise_multipliers": [1.0]},
                       "strategies": [{"name": "quantile"}]})
    run_experiment(spec, db=tmp_path / "r.db", out_dir=tmp_path / "runs", progress=False)
    con = sqlite3.connect(tmp_path / "r.db")
    try:
        summaries = [json.loads(s) for (s,) in con.execute("SELECT summary FROM runs")]
        rows = [json.loads(m) for (m,) in con.execute("SELECT metrics FROM epochs")]
    finally:
        con.close()
    assert summaries and rows
    for s in summaries:
        assert _unclassified(s, P.TRAIN_SUMMARY) == []
    for r in rows:
        assert _unclassified(r, P.TRAIN_HISTORY) == []
