"""A DP-FedAvg run described by a flat mapping (CLI flags, TOML/JSON specs, Flower processes).

``build_run(spec)`` turns the public description into ``(data, model, strategy, config)``; the
same function is used by ``dpclip fl train``, the Flower server and every Flower client process,
so all of them agree on the users, the model and the plan. Keys (defaults in :data:`DEFAULTS`):

``dataset`` (a ``dpclip.data`` name), ``dataset_options``, ``data_dir``, ``num_users``,
``partition`` (iid, label-skew, dirichlet, attribute; default iid, and natural = the clients
of a TFF federated dataset), ``shards_per_user``, ``alpha``,
``attribute_columns``, ``max_user_size``, ``max_examples``; ``model``, ``model_options``;
``strategy``, ``params`` (strategy parameters); ``rounds``, ``clients_per_round``, ``sampling``,
``noise_multiplier`` or ``epsilon``, ``delta``, ``accountant``; ``local_epochs``,
``local_batch_size``, ``client_lr``; ``server_optimizer``, ``server_lr``, ``server_momentum``;
``seed``, ``reproducible_noise``, ``eval_every``, ``weight_cap`` (declared capped weights
``min(n_u / weight_cap, 1)``; default equal weights).

:class:`FederatedRunConfig` is the same mapping as a frozen, fingerprinted run config: the
experiment harness (``dpclip run spec.toml`` with a ``[federated]`` table) stores it, skips a
finished run by its fingerprint and calls :func:`run_from_config`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import torch
from torch import nn

from dpclip.clipping.base import ClippingStrategy
from dpclip.clipping.registry import make_strategy
from dpclip.data import load_dataset
from dpclip.federated.client import LocalTraining
from dpclip.federated.data import FederatedData, federate
from dpclip.federated.server import ServerOptimizer
from dpclip.federated.simulation import FedAvgConfig, FedAvgResult, run_fedavg
from dpclip.federated.models import build_federated_model

__all__ = ["DEFAULTS", "FederatedRunConfig", "build_data", "build_model_for", "build_run",
           "build_strategy", "config_from_spec", "run_from_config", "valid_keys"]

DEFAULTS: dict[str, Any] = {
    "dataset_options": {}, "data_dir": None, "partition": None, "shards_per_user": 2,
    "alpha": 0.5, "attribute_columns": None, "max_user_size": None, "max_examples": None,
    "model": "mlp", "model_options": {}, "strategy": "quantile", "params": {},
    "sampling": "poisson", "noise_multiplier": None, "epsilon": None, "accountant": "pld",
    "local_epochs": 1, "local_batch_size": 16, "client_lr": 0.1, "server_optimizer": "momentum",
    "server_lr": 1.0, "server_momentum": 0.9, "seed": 0, "reproducible_noise": False,
    "eval_every": 10, "weight_cap": None,
}
REQUIRED = ("dataset", "num_users", "rounds", "clients_per_round", "delta")


def valid_keys() -> set[str]:
    """Every key a federated spec may hold."""
    return {*REQUIRED, *DEFAULTS}


def _full(spec: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(spec) - set(DEFAULTS) - set(REQUIRED))
    if unknown:
        raise ValueError(
            f"federated spec has unknown key(s) {unknown}; valid keys: "
            f"{', '.join(sorted([*REQUIRED, *DEFAULTS]))}")
    missing = [k for k in REQUIRED if spec.get(k) is None and k != "num_users"]
    if missing:
        raise ValueError(f"federated spec misses required key(s) {missing}")
    return {**DEFAULTS, **spec}


def build_data(spec: Mapping[str, Any]) -> FederatedData:
    """The users: a ``dpclip.data`` dataset partitioned by ``partition``, or a TFF federated
    dataset (``emnist-fed``, ``emnist-digits-fed``, ``shakespeare``, ``stackoverflow``) whose
    users are its clients (``num_users``: a seeded sample of them; ``dataset_options``:
    ``max_user_examples``, ``max_test_examples``, ``sequence_length``, ``vocab_size``,
    ``test_split``; see ``dpclip.federated.tff``)."""
    from dpclip.federated.tff import TFF_DATASETS, load_tff

    s = _full(spec)
    partition = s["partition"] or ("natural" if s["dataset"] in TFF_DATASETS else "iid")
    if s["dataset"] in TFF_DATASETS:
        if partition != "natural":
            raise ValueError(f"dataset {s['dataset']!r} is federated already (users = its "
                             f"clients): leave `partition` out or set it to 'natural', not "
                             f"{partition!r}")
        options = dict(s["dataset_options"])
        valid = {"max_user_examples", "max_test_examples", "sequence_length", "vocab_size",
                 "test_split"}
        bad = sorted(set(options) - valid)
        if bad:
            raise ValueError(f"dataset_options {bad} do not apply to {s['dataset']!r}; valid: "
                             f"{sorted(valid)}")
        return load_tff(s["dataset"], s["data_dir"], num_users=s.get("num_users"),
                        seed=int(s["seed"]), **options)
    if partition == "natural":
        raise ValueError(f"partition='natural' is for the TFF federated datasets "
                         f"({', '.join(TFF_DATASETS)}); {s['dataset']!r} needs iid, label-skew, "
                         "dirichlet or attribute")
    bundle = load_dataset(s["dataset"], s["data_dir"], seed=int(s["seed"]),
                          **dict(s["dataset_options"]))
    if bundle.private_preprocessing is not None:  # its release is made by a central private run
        raise ValueError("dataset option centre='private' is for central DP-SGD runs (dpclip "
                         "train / run): DP-FedAvg has no user-level release of the centre; drop "
                         "the option")
    return federate(bundle, s.get("num_users"), partition, seed=int(s["seed"]),
                    shards_per_user=int(s["shards_per_user"]), alpha=float(s["alpha"]),
                    attribute_columns=s["attribute_columns"], max_user_size=s["max_user_size"],
                    max_examples=s["max_examples"])


def build_model_for(spec: Mapping[str, Any], data: FederatedData) -> nn.Module:
    """The global model, initialised from the public seed."""
    s = _full(spec)
    torch.manual_seed(int(s["seed"]))
    return build_federated_model(s["model"], data.input_shape, data.num_classes,
                                 **dict(s["model_options"]))


def build_strategy(spec: Mapping[str, Any]) -> ClippingStrategy:
    s = _full(spec)
    return make_strategy(s["strategy"], dict(s["params"]))


def check_user_delta(delta: float, num_users: int) -> None:
    """User-level DP: ``delta < 1/N``, N the number of users (the privacy unit); with
    ``delta >= 1/N`` publishing one random user's data in the clear meets the guarantee."""
    if num_users >= 1 and float(delta) >= 1.0 / num_users:
        from dpclip.training.private import default_delta

        raise ValueError(
            f"delta={float(delta):g} is >= 1/N = 1/{num_users} ({num_users} users, the privacy "
            "unit): a mechanism that publishes one random user's data in the clear meets this "
            f"delta, so the guarantee would mean nothing; use delta < 1/N, e.g. "
            f"{default_delta(num_users):g}")


def config_from_spec(spec: Mapping[str, Any]) -> FedAvgConfig:
    s = _full(spec)
    if isinstance(s.get("num_users"), int):  # refused before any data, model or client
        check_user_delta(float(s["delta"]), int(s["num_users"]))
    return FedAvgConfig(
        rounds=int(s["rounds"]), clients_per_round=float(s["clients_per_round"]),
        delta=float(s["delta"]),
        noise_multiplier=None if s["noise_multiplier"] is None else float(s["noise_multiplier"]),
        target_epsilon=None if s["epsilon"] is None else float(s["epsilon"]),
        sampling=s["sampling"], accountant=s["accountant"],
        local=LocalTraining(int(s["local_epochs"]), int(s["local_batch_size"]),
                            float(s["client_lr"])),
        server=ServerOptimizer(s["server_optimizer"], float(s["server_lr"]),
                               float(s["server_momentum"])),
        seed=int(s["seed"]), reproducible_noise=bool(s["reproducible_noise"]),
        eval_every=int(s["eval_every"]),
        weight_cap=None if s["weight_cap"] is None else int(s["weight_cap"]),
    )


def build_run(spec: Mapping[str, Any]) -> tuple[FederatedData, nn.Module, ClippingStrategy,
                                                FedAvgConfig]:
    """``(data, model, strategy, config)`` of the run described by ``spec``."""
    config = config_from_spec(spec)
    data = build_data(spec)
    check_user_delta(config.delta, data.num_users)  # natural partitions: N known from the data
    return data, build_model_for(spec, data), build_strategy(spec), config


@dataclass(frozen=True)
class FederatedRunConfig:
    """One federated run of an experiment grid: the full spec (defaults filled in), frozen.

    ``fingerprint()`` hashes everything that determines the outcome (not ``data_dir``), so the
    harness recognises a finished run; ``to_dict()`` is what the store keeps as the run's config
    (with ``kind = "federated"``)."""

    spec: Mapping[str, Any]
    kind: ClassVar[str] = "federated"

    def __post_init__(self) -> None:
        full = _full(self.spec)
        config_from_spec(full)  # validates the plan (rounds, delta, sampling/accountant, ...)
        object.__setattr__(self, "spec", full)

    def __getattr__(self, name: str) -> Any:  # seed, strategy, dataset, ... as on TrainConfig
        spec = self.__dict__.get("spec")
        if spec is not None and name in spec:
            return spec[name]
        raise AttributeError(name)

    def __getstate__(self) -> dict[str, Any]:
        return {"spec": dict(self.spec)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        object.__setattr__(self, "spec", state["spec"])

    @property
    def strategy_params(self) -> dict[str, Any]:
        return dict(self.spec["params"])

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "federated", **json.loads(json.dumps(dict(self.spec), default=str))}

    def fingerprint(self) -> str:
        d = self.to_dict()
        d.pop("data_dir", None)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def run_from_config(config: FederatedRunConfig) -> tuple[FedAvgResult, dict[str, Any],
                                                         list[dict[str, Any]]]:
    """Run ``config``; returns the result, the evidence summary (the row keys of
    ``dpclip.harness.evidence``: dataset, model, strategy, params, epsilon, delta, seed, epochs,
    test_accuracy, plus the federated facts) and the per-round history rows for the store (each
    with ``epoch`` = the round and ``clip_threshold`` = the round's clip ``C_t``)."""
    data, model, strategy, fed_config = build_run(config.spec)
    res = run_fedavg(data, model, strategy, fed_config)
    s = res.summary
    spec = config.spec
    summary = {
        **s, "model": spec["model"], "model_options": dict(spec["model_options"]),
        "strategy": strategy.name, "params": strategy.describe(),
        "epochs": s["rounds"], "privacy_unit": "user",
        # the evidence table's batch / lr / optimizer columns: users per round and the server's
        "expected_batch_size": s["expected_clients"], "lr": s["server_lr"],
        "optimizer": s["server_optimizer"],
        "final_clip_norm": res.clip_history[-1],
    }
    history = [{**h, "epoch": h["round"], "clip_threshold": h["clip_norm"]} for h in res.history]
    return res, summary, history
