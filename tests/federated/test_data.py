"""Users from centralised datasets, and the TFF federated files."""

from __future__ import annotations

import pytest
import torch

from dpclip.data import load_dataset
from dpclip.federated.data import (
    federate,
    partition_attribute,
    partition_dirichlet,
    partition_iid,
    partition_label_skew,
)


def _is_partition(parts, n):
    allidx = torch.cat(parts).sort().values
    return torch.equal(allidx, torch.arange(n))


def test_iid_partition_covers_every_example_once():
    parts = partition_iid(103, 10, seed=1)
    assert _is_partition(parts, 103)
    assert {len(p) for p in parts} <= {10, 11}
    assert all(torch.equal(a, b) for a, b in zip(parts, partition_iid(103, 10, seed=1)))


def test_label_skew_users_see_few_classes():
    y = torch.arange(400) % 10
    parts = partition_label_skew(y, 20, seed=0, shards_per_user=2)
    assert _is_partition(parts, 400)
    assert max(len(torch.unique(y[p])) for p in parts) <= 2 + 1  # a shard may straddle a label
    iid_classes = [len(torch.unique(y[p])) for p in partition_iid(400, 20, seed=0)]
    assert sum(len(torch.unique(y[p])) for p in parts) < sum(iid_classes)


def test_dirichlet_small_alpha_concentrates_labels():
    y = torch.arange(1000) % 10
    parts = partition_dirichlet(y, 20, seed=0, alpha=0.05)
    assert _is_partition(parts, 1000) and {len(p) for p in parts} == {50}
    top = [torch.bincount(y[p], minlength=10).max().item() / len(p) for p in parts]
    assert sum(top) / len(top) > 0.6
    with pytest.raises(ValueError, match="alpha"):
        partition_dirichlet(y, 20, seed=0, alpha=0)


def test_attribute_partition_groups_by_column_and_caps_size():
    x = torch.zeros(30, 3)
    x[:, 1] = torch.tensor([0, 1, 2] * 10, dtype=torch.float32)
    parts = partition_attribute(x, [1], max_user_size=4)
    assert _is_partition(parts, 30)
    assert all(len(torch.unique(x[p, 1])) == 1 and len(p) <= 4 for p in parts)
    with pytest.raises(ValueError, match="attribute_columns"):
        partition_attribute(x, [7])


def test_federate_mnist_5k_users_with_a_few_dozen_examples():
    fd = federate(load_dataset("mnist-5k"), 100, "label-skew", seed=0)
    assert fd.num_users == 100 and 30 <= min(fd.user_sizes()) and max(fd.user_sizes()) <= 50
    assert fd.describe()["partition"] == "label-skew"
    with pytest.raises(ValueError, match="partition"):
        federate(load_dataset("mnist-5k"), 10, "by-magic")


def test_fashion_mnist_label_skew_users_of_a_few_dozen_examples():
    from dpclip.data import DatasetNotFoundError

    try:
        bundle = load_dataset("fashion-mnist")
    except DatasetNotFoundError:
        pytest.skip("Fashion-MNIST files not on this machine")
    fd = federate(bundle, 1000, "label-skew", seed=0)
    assert fd.num_users == 1000 and set(fd.user_sizes()) == {60}
    classes = [len(torch.unique(u.targets)) for u in fd.users]
    assert max(classes) <= 3 and sum(classes) / len(classes) < 2.5  # IID users would see ~10


def test_uci_set_split_by_an_attribute(tmp_path):
    """UCI Nursery in its published format (here 200 rows of it): users = examples sharing the
    `parents` attribute (its one-hot block, columns 0-2), cut into users of at most 20."""
    import random

    values = [["usual", "pretentious", "great_pret"],
              ["proper", "less_proper", "improper", "critical", "very_crit"],
              ["complete", "completed", "incomplete", "foster"], ["1", "2", "3", "more"],
              ["convenient", "less_conv", "critical"], ["convenient", "inconv"],
              ["nonprob", "slightly_prob", "problematic"],
              ["recommended", "priority", "not_recom"]]
    labels = ["not_recom", "recommend", "very_recom", "priority", "spec_prior"]
    rng = random.Random(0)
    rows = [",".join([rng.choice(v) for v in values] + [labels[i % 5]]) for i in range(200)]
    (tmp_path / "nursery.data").write_text("\n".join(rows) + "\n")
    bundle = load_dataset("nursery", tmp_path)
    fd = federate(bundle, partition="attribute", attribute_columns=[0, 1, 2], max_user_size=20)
    block = [u.inputs[:, :3] for u in fd.users]
    assert all(torch.equal(b, b[:1].expand_as(b)) for b in block)  # one parents value per user
    assert len({tuple(b[0].tolist()) for b in block}) == 3
    assert sum(fd.user_sizes()) == len(bundle.train) and max(fd.user_sizes()) <= 20
