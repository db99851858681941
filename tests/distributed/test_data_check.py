"""check_same compares the data each rank holds (docs/distributed.md), not only the config."""

from __future__ import annotations

import torch

from dpclip.training.distributed import data_digest
from tests.distributed import _scenarios as S
from tests.distributed._launch import launch


def test_ranks_with_different_data_of_the_same_size_are_refused(tmp_path):
    out = launch(S.data_mismatch, 2, tmp_path, timeout=55.0)
    for res in out:
        assert "ranks [1] disagree with rank 0 on the training data" in res["data"]


def test_the_digest_sees_one_changed_value_and_the_structure():
    x, y = torch.randn(10, 3), torch.arange(10)
    base = data_digest(x, y)
    x2 = x.clone()
    x2[9, 2] = x2[9, 2].item() + 1e-3
    assert data_digest(x2, y) != base
    assert data_digest(x.clone(), y.clone()) == base
    assert data_digest({"a": x}, y) == data_digest({"a": x.clone()}, y)
    assert data_digest(x.double(), y) != base  # dtype is part of the digest
    ds = torch.utils.data.TensorDataset(x, y)
    assert data_digest(ds) == data_digest(torch.utils.data.TensorDataset(x.clone(), y))
