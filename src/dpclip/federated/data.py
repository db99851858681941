"""Datasets as users: partitions of a centralised dataset, and the federated files of TFF.

A :class:`FederatedData` is a list of users (each a ``TensorSplit`` of its own examples) plus a
centralised test split. The user is the privacy unit: everything a user holds may change between
neighbouring datasets.

Partitions of a ``dpclip.data`` bundle (``federate``), all following a PUBLIC seed:

* ``"iid"``: shuffle and deal the examples into ``num_users`` users of (almost) equal size;
* ``"label-skew"``: McMahan et al. 2017's pathological non-IID split: sort by label, cut into
  ``num_users * shards_per_user`` shards, give each user ``shards_per_user`` random shards (so
  most users see about ``shards_per_user`` classes);
* ``"dirichlet"``: each user's class proportions ~ Dirichlet(``alpha``) (Hsu et al. 2019),
  ``alpha -> 0`` one class per user, ``alpha -> inf`` IID; sizes (almost) equal;
* ``"attribute"``: users are the groups of examples sharing the value of a feature column
  (``attribute_columns``: one column, or the columns of a one-hot block), e.g. the UCI tabular sets
  split by an attribute; groups larger than ``max_user_size`` are cut into several users.

The federated EMNIST / Shakespeare / Stack Overflow files of TensorFlow Federated, whose users
are their clients, are read by ``dpclip.federated.tff``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from dpclip.data.base import DatasetBundle, TensorSplit

__all__ = [
    "FederatedData",
    "PARTITIONS",
    "federate",
    "partition_attribute",
    "partition_dirichlet",
    "partition_iid",
    "partition_label_skew",
]

PARTITIONS = ("iid", "label-skew", "dirichlet", "attribute")


@dataclass(frozen=True, eq=False)
class FederatedData:
    """Users (the privacy unit) and a centralised test split.

    ``ignore_index``: for sequence tasks (targets ``(n, L)``, model outputs ``(n, classes, L)``)
    the padding target, which counts in neither the loss nor the accuracy; ``None`` for
    classification."""

    name: str
    users: tuple[TensorSplit, ...]
    test: TensorSplit
    num_classes: int
    input_shape: tuple[int, ...]
    partition: dict[str, Any] = field(default_factory=dict)
    ignore_index: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "users", tuple(self.users))
        if not self.users:
            raise ValueError("FederatedData needs at least one user")

    @property
    def num_users(self) -> int:
        return len(self.users)

    def user_sizes(self) -> list[int]:
        return [len(u) for u in self.users]

    def loss_fn(self) -> Any:
        """Cross-entropy, skipping ``ignore_index`` targets where set."""
        import functools

        if self.ignore_index is None:
            return torch.nn.functional.cross_entropy
        return functools.partial(torch.nn.functional.cross_entropy,
                                 ignore_index=self.ignore_index)

    def describe(self, nonprivate: bool = False) -> dict[str, Any]:
        """Public facts of the federation: the dataset, the number of users (public, as the
        dataset size of DP-SGD: the user sampling rate is ``clients_per_round / num_users``) and
        the partition's configuration. The user sizes are PRIVATE (removing the largest user
        changes their maximum): they are added only with ``nonprivate=True``, under the
        ``nonprivate/`` prefix (``FedAvgConfig.log_nonprivate``, off by default)."""
        out = {"dataset": self.name, "num_users": self.num_users, **self.partition}
        if nonprivate:
            sizes = self.user_sizes()
            out.update({"nonprivate/user_size_min": min(sizes),
                        "nonprivate/user_size_max": max(sizes),
                        "nonprivate/user_size_mean": sum(sizes) / len(sizes)})
        return out


def _check_users(num_users: int, n: int) -> None:
    if isinstance(num_users, bool) or not isinstance(num_users, int) or num_users < 1:
        raise ValueError(f"num_users must be an int >= 1, got {num_users!r}")
    if num_users > n:
        raise ValueError(f"num_users={num_users} exceeds the number of examples {n}; lower num_users")


def partition_iid(n: int, num_users: int, seed: int) -> list[Tensor]:
    """Indices of ``num_users`` IID users (sizes differ by at most one)."""
    _check_users(num_users, n)
    g = torch.Generator().manual_seed(int(seed))
    perm = torch.randperm(n, generator=g)
    return [c.sort().values for c in torch.tensor_split(perm, num_users)]


def partition_label_skew(targets: Tensor, num_users: int, seed: int,
                         shards_per_user: int = 2) -> list[Tensor]:
    """McMahan et al. 2017's shards: sort by label, ``num_users * shards_per_user`` shards,
    ``shards_per_user`` random shards per user."""
    n = int(targets.shape[0])
    if isinstance(shards_per_user, bool) or not isinstance(shards_per_user, int) \
            or shards_per_user < 1:
        raise ValueError(f"shards_per_user must be an int >= 1, got {shards_per_user!r}")
    _check_users(num_users * shards_per_user, n)
    g = torch.Generator().manual_seed(int(seed))
    # stable sort by label, ties broken by a random permutation (public seed)
    perm = torch.randperm(n, generator=g)
    order = perm[torch.argsort(targets[perm], stable=True)]
    shards = torch.tensor_split(order, num_users * shards_per_user)
    pick = torch.randperm(len(shards), generator=g).view(num_users, shards_per_user)
    return [torch.cat([shards[int(j)] for j in row]).sort().values for row in pick]


def partition_dirichlet(targets: Tensor, num_users: int, seed: int,
                        alpha: float = 0.5) -> list[Tensor]:
    """Label proportions per user ~ Dirichlet(alpha); every user gets ``n // num_users`` (or one
    more) examples, drawn class by class without replacement (classes that run out are replaced
    by the remaining ones)."""
    n = int(targets.shape[0])
    _check_users(num_users, n)
    if not (math.isfinite(float(alpha)) and alpha > 0):
        raise ValueError(f"alpha (Dirichlet concentration) must be > 0, got {alpha!r}")
    rng = np.random.default_rng(int(seed))
    y = targets.numpy()
    classes = np.unique(y)
    pools = {int(c): list(rng.permutation(np.flatnonzero(y == c))) for c in classes}
    sizes = [len(c) for c in np.array_split(np.arange(n), num_users)]
    users: list[Tensor] = []
    for size in sizes:
        p = rng.dirichlet(np.full(len(classes), float(alpha)))
        want = rng.multinomial(size, p)
        idx: list[int] = []
        for c, k in zip(classes, want):
            pool = pools[int(c)]
            take = min(int(k), len(pool))
            idx.extend(pool[:take])
            del pool[:take]
        while len(idx) < size:  # classes ran out: fill from the largest remaining pool
            c = max(pools, key=lambda k: len(pools[k]))
            idx.append(pools[c].pop())
        users.append(torch.tensor(sorted(idx), dtype=torch.int64))
    return users


def partition_attribute(inputs: Tensor, attribute_columns: Sequence[int],
                        max_user_size: int | None = None, seed: int = 0) -> list[Tensor]:
    """Users = groups of examples with equal values in ``attribute_columns`` of the (flattened)
    inputs; groups above ``max_user_size`` are cut (after a seeded shuffle) into several users."""
    x = inputs.reshape(inputs.shape[0], -1)
    cols = [int(c) for c in attribute_columns]
    if not cols or any(c < 0 or c >= x.shape[1] for c in cols):
        raise ValueError(
            f"attribute_columns must be column indices in [0, {x.shape[1]}), got {list(attribute_columns)!r}"
        )
    keys = x[:, cols]
    _, group = torch.unique(keys, dim=0, return_inverse=True)
    g = torch.Generator().manual_seed(int(seed))
    users: list[Tensor] = []
    for k in range(int(group.max()) + 1):
        idx = torch.nonzero(group == k, as_tuple=True)[0]
        if max_user_size is None or len(idx) <= max_user_size:
            users.append(idx)
            continue
        idx = idx[torch.randperm(len(idx), generator=g)]
        parts = math.ceil(len(idx) / max_user_size)
        users.extend(c.sort().values for c in torch.tensor_split(idx, parts))
    return users


def federate(bundle: DatasetBundle, num_users: int | None = None, partition: str = "iid", *,
             seed: int = 0, shards_per_user: int = 2, alpha: float = 0.5,
             attribute_columns: Sequence[int] | None = None,
             max_user_size: int | None = None, max_examples: int | None = None) -> FederatedData:
    """Split ``bundle.train`` into users (``partition`` one of :data:`PARTITIONS`).

    ``max_examples`` first keeps a seeded random subset of the training split (e.g. 30,000
    examples of Fashion-MNIST for 1,000 users of 30). ``num_users`` is required except for
    ``"attribute"`` (the groups decide it).
    """
    if partition not in PARTITIONS:
        raise ValueError(f"unknown partition {partition!r}; valid: {', '.join(PARTITIONS)}")
    train = bundle.train
    if max_examples is not None:
        if not (isinstance(max_examples, int) and 1 <= max_examples):
            raise ValueError(f"max_examples must be an int >= 1, got {max_examples!r}")
        if max_examples < len(train):
            g = torch.Generator().manual_seed(int(seed) + 7919)
            train = train.subset(torch.randperm(len(train), generator=g)[:max_examples].sort().values)
    info: dict[str, Any] = {"partition": partition, "partition_seed": int(seed)}
    if partition == "attribute":
        if not attribute_columns:
            raise ValueError("partition='attribute' needs attribute_columns (feature indices)")
        parts = partition_attribute(train.inputs, attribute_columns, max_user_size, seed)
        info.update(attribute_columns=list(attribute_columns), max_user_size=max_user_size)
    else:
        if num_users is None:
            raise ValueError(f"partition={partition!r} needs num_users")
        if partition == "iid":
            parts = partition_iid(len(train), num_users, seed)
        elif partition == "label-skew":
            parts = partition_label_skew(train.targets, num_users, seed, shards_per_user)
            info["shards_per_user"] = shards_per_user
        else:
            parts = partition_dirichlet(train.targets, num_users, seed, alpha)
            info["alpha"] = alpha
    return FederatedData(bundle.name, tuple(train.subset(p) for p in parts), bundle.test,
                         bundle.num_classes, bundle.input_shape, info)
