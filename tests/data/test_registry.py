"""The dataset registry: names, typed entries, option handling, curated __all__."""

import dataclasses

import pytest
import torch

import dpclip.data as data
from dpclip.data import (
    DATASETS,
    DatasetBundle,
    DatasetEntry,
    TensorSplit,
    list_datasets,
    load_dataset,
)

EXPECTED = {"breast-cancer", "digits", "fashion-mnist", "mnist", "mnist-5k", "synthetic",
            "adult", "german-credit", "default-credit", "nursery", "android-permissions",
            "dropout", "cifar10", "cifar100"}


def test_registered_names():
    assert set(DATASETS) == EXPECTED
    assert [e.name for e in list_datasets()] == sorted(EXPECTED)
    assert all(isinstance(e, DatasetEntry) for e in list_datasets())


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as info:
        load_dataset("cifar-11")
    message = str(info.value)
    assert "cifar-11" in message
    for name in EXPECTED:
        assert name in message


def test_unknown_option_names_it_and_the_valid_ones():
    with pytest.raises(ValueError) as info:
        load_dataset("synthetic", n_trian=10)
    message = str(info.value)
    assert "n_trian" in message and "n_train" in message and "num_classes" in message


def test_bad_option_value_is_named():
    with pytest.raises(ValueError, match="n_train='many'"):
        load_dataset("synthetic", n_train="many")


@pytest.mark.parametrize("name", ["digits", "breast-cancer", "mnist-5k", "synthetic"])
def test_entry_metadata_matches_loaded_bundle(name):
    entry = DATASETS[name]
    bundle = load_dataset(name)
    assert bundle.name == name
    assert bundle.num_classes == entry.num_classes
    assert bundle.input_shape == entry.input_shape
    assert bundle.is_public == entry.is_public
    assert bundle.source
    assert bundle.train.targets.max() < bundle.num_classes


def test_only_the_bundled_proxies_are_public():
    assert {e.name for e in list_datasets() if e.is_public} == {"mnist-5k", "digits"}
    assert load_dataset("digits").is_public


def test_bundle_validates_consistency():
    split = TensorSplit(torch.zeros(4, 3), torch.tensor([0, 1, 2, 1]))
    with pytest.raises(ValueError, match="input_shape"):
        DatasetBundle("x", split, split, 3, (4,), source="test")
    with pytest.raises(ValueError, match="targets must lie"):
        DatasetBundle("x", split, split, 2, (3,), source="test")
    bundle = DatasetBundle("x", split, split, 3, (3,), source="test")
    assert bundle.is_public is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        bundle.name = "y"  # frozen


def test_curated_all():
    assert len(set(data.__all__)) == len(data.__all__)
    for name in data.__all__:
        assert hasattr(data, name), name
    for required in (
        "DATASETS",
        "DatasetBundle",
        "DatasetNotFoundError",
        "TensorSplit",
        "list_datasets",
        "load_dataset",
        "public_private_split",
    ):
        assert required in data.__all__
