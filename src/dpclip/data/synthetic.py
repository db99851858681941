"""A seeded Gaussian-mixture classification task for fast tests and smoke runs."""

from __future__ import annotations

import math
import os

import torch

from dpclip._checks import positive_ints
from dpclip.data.base import DatasetBundle, TensorSplit

__all__ = ["DEFAULT_NUM_FEATURES", "load_synthetic"]

#: Number of features when neither ``num_features`` nor ``image_shape`` is given.
DEFAULT_NUM_FEATURES = 20


def _positive_int(value: int, argument: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{argument} must be an integer >= {minimum}, got {value!r}")
    return value


def load_synthetic(
    data_dir: str | os.PathLike[str] | None = None,
    seed: int = 0,
    *,
    n_train: int = 512,
    n_test: int = 256,
    num_features: int | None = None,
    image_shape: tuple[int, ...] | None = None,
    num_classes: int = 4,
    separation: float = 1.0,
) -> DatasetBundle:
    """Gaussian mixture: class ``k`` has mean ``mu_k ~ separation * N(0, I)`` and unit noise.

    With the defaults (20 features, 4 classes, ``separation=1``) the class means are ~6 noise
    standard deviations apart, so the task is nearly linearly separable and a linear model or a
    small MLP learns it within a few steps. Classes are balanced (``i % num_classes``, shuffled).

    Args:
        data_dir: ignored (the data are generated).
        seed: seeds a private ``torch.Generator``; everything (means, examples, order) is a
            function of the seed and the options only.
        n_train, n_test: split sizes.
        num_features: flat feature count (default 20); inputs have shape ``(N, num_features)``.
        image_shape: alternative to ``num_features``: e.g. ``(1, 8, 8)`` gives image-shaped
            inputs ``(N, 1, 8, 8)`` (features = product of the shape).
        num_classes: number of mixture components / classes (>= 2).
        separation: scale of the class means relative to the unit noise; larger is easier.
    """
    del data_dir
    n_train = _positive_int(n_train, "n_train")
    n_test = _positive_int(n_test, "n_test")
    num_classes = _positive_int(num_classes, "num_classes", minimum=2)
    if image_shape is not None:
        shape = tuple(image_shape)
        if not positive_ints(shape):
            raise ValueError(
                f"image_shape must be a tuple of positive integers, got {image_shape!r}"
            )
        if num_features is not None and num_features != math.prod(shape):
            raise ValueError(
                f"num_features={num_features} contradicts image_shape={shape} "
                f"({math.prod(shape)} features); give only one of them"
            )
    else:
        shape = (_positive_int(num_features or DEFAULT_NUM_FEATURES, "num_features"),)
    if not (isinstance(separation, (int, float)) and math.isfinite(separation) and separation > 0):
        raise ValueError(f"separation must be a positive finite number, got {separation!r}")
    dim = math.prod(shape)

    generator = torch.Generator().manual_seed(int(seed))
    means = float(separation) * torch.randn(num_classes, dim, generator=generator)

    def sample(n: int) -> TensorSplit:
        labels = torch.arange(n) % num_classes
        labels = labels[torch.randperm(n, generator=generator)]
        x = means[labels] + torch.randn(n, dim, generator=generator)
        return TensorSplit(x.reshape(n, *shape).to(torch.float32), labels.to(torch.int64))

    train = sample(n_train)
    test = sample(n_test)
    return DatasetBundle(
        "synthetic",
        train,
        test,
        num_classes,
        shape,
        source=f"generated: Gaussian mixture (seed={int(seed)}, separation={float(separation)})",
    )
