"""Public proxies must not share examples with the private dataset; a user bundle is checked itself.

* every declared pair of ``PUBLIC_PROXIES`` has disjoint provenance; mnist-5k (5,000 images of the
  MNIST training set) is refused as a proxy for mnist, in the registry, in ``check_public`` and
  when a schedule searched on it is replayed on mnist; it stays a proxy for fashion-mnist;
* ``greedy_search(config, data=bundle)`` checks the bundle: its name must be config.dataset, it
  must be declared public, and its own provenance must not overlap ``proxy_for``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dpclip.data import (
    DATASETS,
    PUBLIC_PROXIES,
    DatasetBundle,
    ProxyOverlapError,
    TensorSplit,
    check_proxy_pair,
    is_public_proxy,
    load_dataset,
    public_proxy,
)
from dpclip.store import ResultsStore
from dpclip.search import GreedyConfig, PrivateDataError, check_public, greedy_search
from dpclip.search.resolve import resolve_strategy_params
from dpclip.training.trainer import TrainConfig

CFG = dict(model="logreg", noise_multiplier=1.0, batch_size=64, lr=0.5, epochs=1,
           c_start=0.5, step=0.5, tolerance=0.05)


def test_every_declared_pair_has_disjoint_provenance():
    for private, proxies in PUBLIC_PROXIES.items():
        for proxy in proxies:
            check_proxy_pair(proxy, private)  # raises on overlap
            assert not (DATASETS[proxy].provenance & DATASETS[private].provenance)
    assert "mnist-5k" not in PUBLIC_PROXIES["mnist"]
    assert "mnist-5k" in PUBLIC_PROXIES["fashion-mnist"]
    assert DATASETS["mnist-5k"].provenance >= {"mnist"}


def test_mnist_5k_is_no_proxy_for_mnist():
    with pytest.raises(ProxyOverlapError, match="'mnist-5k' cannot be a public proxy for 'mnist'"):
        check_proxy_pair("mnist-5k", "mnist")
    with pytest.raises(ProxyOverlapError, match="MNIST training set"):
        public_proxy("mnist", "mnist-5k")
    assert public_proxy("mnist") == "fashion-mnist"
    assert public_proxy("fashion-mnist") == "mnist-5k"
    assert not is_public_proxy("mnist-5k", "mnist")
    assert is_public_proxy("mnist-5k", "fashion-mnist")
    assert is_public_proxy("digits", "mnist") and is_public_proxy("cifar100", "cifar10")


def test_greedy_check_public_refuses_an_overlapping_proxy():
    base = dict(CFG, dataset="mnist-5k")
    assert check_public(GreedyConfig(**base)) == "public"
    assert check_public(GreedyConfig(proxy_for="fashion-mnist", **base)) \
        == "public proxy for fashion-mnist"
    with pytest.raises(PrivateDataError, match="cannot be a public proxy for 'mnist'"):
        check_public(GreedyConfig(proxy_for="mnist", **base))
    assert check_public(GreedyConfig(proxy_for="mnist", allow_private_data=True, **base)) \
        == "NON-PRIVATE"


def test_schedule_searched_on_mnist_5k_is_not_replayed_on_mnist(tmp_path):
    with ResultsStore(tmp_path / "r.db") as store:
        store.save_schedule("g", [0.3, 0.2], {"dataset": "mnist-5k", "privacy": "public",
                                              "nonprivate": False})
        mnist = TrainConfig(dataset="mnist", model="logreg", strategy="transfer",
                            strategy_params={"schedule": "g"}, noise_multiplier=1.0)
        with pytest.raises(ValueError, match="cannot be replayed on 'mnist'.*MNIST training set"):
            resolve_strategy_params(mnist, store)
        fmnist = dataclasses.replace(mnist, dataset="fashion-mnist")
        assert resolve_strategy_params(fmnist, store).strategy_params["thresholds"] == [0.3, 0.2]
        # the provenance recorded by the search wins over the registry's
        store.save_schedule("h", [0.3], {"dataset": "digits", "privacy": "public",
                                         "nonprivate": False, "provenance": ["digits", "mnist"]})
        with pytest.raises(ValueError, match="cannot be replayed on 'mnist'"):
            resolve_strategy_params(dataclasses.replace(
                mnist, strategy_params={"schedule": "h"}), store)


def _bundle(name: str, *, is_public: bool, derived_from: tuple[str, ...] = ()) -> DatasetBundle:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1, 8, 8, generator=g)
    y = torch.arange(64) % 10
    split = TensorSplit(x, y)
    return DatasetBundle(name, split, split, 10, (1, 8, 8), source="test", is_public=is_public,
                         derived_from=derived_from)


def test_greedy_search_checks_the_supplied_bundle_not_only_the_name():
    cfg = GreedyConfig(dataset="digits", **CFG)
    # private data under a public dataset's name: refused (the old check read only the name)
    with pytest.raises(PrivateDataError, match="not declared public"):
        greedy_search(cfg, data=_bundle("digits", is_public=False), progress=False)
    # a bundle of another dataset than the configured one: refused
    with pytest.raises(ValueError, match="config.dataset is 'digits'"):
        greedy_search(cfg, data=_bundle("synthetic", is_public=True), progress=False)
    # a public bundle whose own provenance overlaps proxy_for: refused
    with pytest.raises(PrivateDataError, match="cannot be a public proxy for 'mnist'"):
        greedy_search(dataclasses.replace(cfg, proxy_for="mnist"),
                      data=_bundle("digits", is_public=True, derived_from=("mnist",)),
                      progress=False)
    # explicitly NON-PRIVATE analysis is still possible
    res = greedy_search(dataclasses.replace(cfg, allow_private_data=True),
                        data=_bundle("digits", is_public=False), progress=False)
    assert res.metadata["privacy"] == "NON-PRIVATE"
    # the real public bundle passes, and its provenance is recorded
    res = greedy_search(cfg, data=load_dataset("digits"), progress=False)
    assert res.metadata["privacy"] == "public" and res.metadata["provenance"] == ["digits"]
