"""Experiment specs: a grid of datasets x models x strategies x privacy levels x seeds, in TOML.

```toml
name = "quick"
description = "every norm-based strategy on Fashion-MNIST at epsilon 2.7"

[train]                 # TrainConfig fields shared by every run
dataset = "fashion-mnist"
model = "papernot-cnn"
epochs = 3
batch_size = 1024
lr = 2.0
optimizer = "momentum"
delta = 1e-5

[grid]
datasets = ["fashion-mnist"]      # optional, overrides train.dataset
models = ["papernot-cnn"]         # optional, overrides train.model
epsilons = [1.0, 2.7]             # or noise_multipliers = [...], not both
seeds = [0, 1, 2]

[[strategies]]
name = "fixed"                    # a registered strategy
label = "fixed C=0.1"             # optional; defaults to the name
params = { clip_norm = 0.1 }
train = { lr = 4.0 }              # optional per-strategy TrainConfig overrides
```

``load_spec(path, overrides)`` validates everything (unknown keys, unknown strategies, models and
datasets, values of the wrong type, missing sections) into frozen dataclasses with errors that
name the file, the key and the fix (with "did you mean ...?" for misspelt keys and names);
``--set key=value`` overrides use dotted keys (``train.epochs=1``, ``grid.seeds=[0]``,
``strategies.fixed.params.clip_norm=0.2``) with TOML values.

A ``[tuning]`` section (``docs/tuning.md``, ``dpclip.harness.tuning``) gives every strategy the
same hyperparameter budget over its own search space, selected on a validation split of the
private training data (not privacy-accounted) or on a public proxy, never on the test split:

```toml
[tuning]
source = "validation"             # or "public-proxy" (then optionally proxy = "mnist-5k")
validation_fraction = 0.1         # validation: held out from the private training split
trials = 4                        # settings tried per strategy and privacy level (same for all)
epochs = 5                        # epochs per trial
seed = 0                          # trials' seed and the search order

[[strategies]]
name = "fixed"
params = { clip_norm = 0.4 }
tune = { clip_norm = [0.1, 0.4, 1.0, 2.0] }   # strategy parameters and/or lr (and its schedule)
```

**Federated grids** (user-level DP-FedAvg, ``dpclip.federated``): a ``[federated]`` table in place
of ``[train]`` holds the keys of ``dpclip.federated.spec`` (dataset, num_users, partition, model,
rounds, clients_per_round, delta, local/server optimisation, ...); ``[grid]`` and
``[[strategies]]`` are as above (``epsilons`` are user-level; a strategy's ``train`` table
overrides federated keys), and each cell is a ``dpclip.federated.FederatedRunConfig``:

```toml
name = "fedavg-tiny"
[federated]
dataset = "synthetic"
num_users = 40
rounds = 10
clients_per_round = 8
delta = 1e-3
[grid]
epsilons = [4.0]
seeds = [0, 1]
[[strategies]]
name = "quantile"
label = "adaptive-median"
params = { initial_clip_norm = 0.1, target_quantile = 0.5 }
```

**Papers and claims** (``dpclip reproductions`` turns them into ``docs/reproductions.md``):
``paper`` names the table, ``[published]`` gives its number per strategy label (``at`` per
privacy level when the grid has several), and each ``[[claims]]`` entry is a claim of the paper
that the stored runs decide (``dpclip.harness.reproduce.verdict``): a comparison ``better`` vs
``than`` (holds when the means differ by more than two standard errors, with at least 2 runs
each) or a level ``label`` / ``at_least``, at one ``epsilon`` of the grid:

```toml
paper = "Lin et al. 2022 Table 2 (FMNIST)"
[published]
"Decay" = { value = 87.7, source = "Lin Table 2", at = { "1.5" = 84.7, "2.7" = 87.7 } }
[[claims]]
text = "Decay beats fixed clipping"
better = "Decay"
than = "Papernot"
epsilon = 2.7
note = "optional context shown beside the verdict"
```

Strategy parameters that name stored or computed data, ``transfer``'s ``schedule = "NAME"`` and
``lin-decay``'s ``c0_from = "greedy"``, are resolved by the runner against the results store
(``dpclip.search.resolve_strategy_params``) before the grid runs; the resolved numbers are part
of each run's config (and fingerprint).
"""

from __future__ import annotations

import copy
import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from dpclip.errors import did_you_mean, unknown_name
from dpclip.harness.tuning import (HORIZONS, SOURCES, TUNABLE_TRAIN_FIELDS, TuningSpec,
                                   apply_point, search_points)
from dpclip.training.trainer import TrainConfig
from dpclip.clipping import STRATEGIES, make_strategy
from dpclip.data import DATASETS, public_proxy
from dpclip.federated.aggregator import check_federated_strategy
from dpclip.federated.models import FEDERATED_MODELS
from dpclip.federated.spec import FederatedRunConfig, valid_keys
from dpclip.federated.tff import TFF_DATASETS
from dpclip.models import MODELS
from dpclip.search.resolve import resolve_strategy_params
from dpclip.training.units import UnitConfig, check_unit_sampling

__all__ = ["ExperimentSpec", "RunSpec", "StrategySpec", "load_spec", "parse_spec"]

_TOP = {"name", "description", "paper", "published", "train", "federated", "grid", "strategies",
        "tuning", "claims"}
_CLAIM = {"text", "better", "than", "label", "at_least", "epsilon", "note"}
_TUNING = {"source", "trials", "epochs", "seed", "validation_fraction", "proxy", "horizon"}
_GRID = {"datasets", "models", "epsilons", "noise_multipliers", "seeds"}
_STRAT = {"name", "label", "params", "train", "tune"}
_TRAIN_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}
_GRID_OWNED = {"dataset", "model", "epsilon", "noise_multiplier", "seed", "strategy",
               "strategy_params"}
#: keys of a [federated] table the grid sets (dataset/model may also come from the table)
_FED_GRID_OWNED = {"epsilon", "noise_multiplier", "seed", "strategy", "params"}


def _train_fields(kind: str) -> set[str]:
    if kind == "federated":
        return valid_keys()
    return _TRAIN_FIELDS


class SpecError(ValueError):
    """An invalid experiment spec; the message names the offending key (and, from
    ``load_spec``, the file)."""


def _unknown_keys(where: str, bad: list[str], valid: set[str],
                  noun: str = "key(s)") -> SpecError:
    """``[train]: unknown field(s) ['epoch'] (did you mean 'epochs'?); valid: [...]``."""
    hints = [f"{k!r}{did_you_mean(k, valid)}" for k in bad if did_you_mean(k, valid)]
    if len(bad) == 1:
        hint = did_you_mean(bad[0], valid)
    else:
        hint = f" ({'; '.join(hints)})" if hints else ""
    return SpecError(f"{where}: unknown {noun} {bad}{hint}; valid: {sorted(valid)}")


def _table(raw: Any, where: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise SpecError(f"{where} must be a table ([{where}] or {where} = {{ ... }}), got "
                        f"{type(raw).__name__} {raw!r}")
    return dict(raw)


@dataclass(frozen=True)
class StrategySpec:
    name: str
    label: str
    params: dict[str, Any]
    train: dict[str, Any]
    #: the search space of the tuning protocol: name -> list of values (strategy parameters,
    #: or TrainConfig fields of ``dpclip.harness.tuning.TUNABLE_TRAIN_FIELDS``)
    tune: dict[str, list[Any]] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class RunSpec:
    """One cell of the grid: a label for reports and the complete training config (a
    ``TrainConfig``, or a ``dpclip.federated.FederatedRunConfig`` in a federated grid) and, for a
    tuned spec, the tuning record (budget, trials, choice; not part of the fingerprint, the chosen
    values are in the config)."""

    experiment: str
    label: str
    config: Any
    tuning: dict[str, Any] | None = dataclasses.field(default=None, compare=False)

    @property
    def fingerprint(self) -> str:
        return self.config.fingerprint()


@dataclass(frozen=True)
class ExperimentSpec:
    name: str
    description: str
    train: dict[str, Any]
    datasets: tuple[str, ...]
    models: tuple[str, ...]
    epsilons: tuple[float, ...]
    noise_multipliers: tuple[float, ...]
    seeds: tuple[int, ...]
    strategies: tuple[StrategySpec, ...]
    #: the paper table this spec reproduces, and its published numbers per strategy label
    paper: str = ""
    published: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    tuning: Any = None  #: a ``dpclip.harness.tuning.TuningSpec`` or None
    #: "train" (example-level DP-SGD, [train]) or "federated" (user-level DP-FedAvg, [federated])
    kind: str = "train"
    #: the paper's claims, each judged from the stored runs (``dpclip.harness.reproduce.verdict``)
    claims: tuple[dict[str, Any], ...] = ()

    def runs(self) -> list[RunSpec]:
        """Every run of the grid, in a stable order (strategy-major, then privacy, then seed)."""
        levels: list[tuple[str, float]] = [("epsilon", e) for e in self.epsilons] + [
            ("noise_multiplier", z) for z in self.noise_multipliers
        ]
        out = []
        for ds in self.datasets:
            for model in self.models:
                for st in self.strategies:
                    for key, value in levels:
                        for seed in self.seeds:
                            fields = dict(self.train)
                            fields.update(st.train)
                            # a strategy's own `train.model` wins (e.g. a BatchNorm-free
                            # variant for per-example clipping beside batch-clipped BN models)
                            fields.update(dataset=ds, model=st.train.get("model", model),
                                          strategy=st.name,
                                          strategy_params=dict(st.params), seed=seed)
                            fields[key] = value
                            out.append(RunSpec(self.name, st.label, self._config(fields)))
        return out

    def _config(self, fields: dict[str, Any]) -> Any:
        if self.kind != "federated":
            return TrainConfig(**fields)

        fields["params"] = fields.pop("strategy_params")
        return FederatedRunConfig(fields)


def _apply_set(raw: dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise SpecError(f"--set expects key=value, got {item!r}")
    key, text = item.split("=", 1)
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    parts = key.strip().split(".")
    if parts[0] == "strategies" and len(parts) >= 3:
        matches = [s for s in raw.get("strategies", [])
                   if s.get("label", s.get("name")) == parts[1] or s.get("name") == parts[1]]
        if not matches:
            raise SpecError(f"--set {key}: no strategy named or labelled {parts[1]!r} in the spec")
        targets = matches
        parts = parts[2:]
    else:
        targets = [raw]
    for target in targets:
        node = target
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise SpecError(f"--set {key}: {p!r} is not a table")
        node[parts[-1]] = value


def _as_tuple(raw: Any, key: str, kind: type) -> tuple:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raw = [raw]
    try:
        return tuple(kind(v) for v in raw)
    except (TypeError, ValueError):
        raise SpecError(f"grid.{key} must be a list of {kind.__name__}, got {raw!r}") from None


def parse_spec(raw: dict[str, Any], overrides: Iterable[str] = (), *,
               validate_names: bool = True) -> ExperimentSpec:
    """Validate a spec already parsed from TOML (``overrides`` are ``--set`` items)."""
    raw = copy.deepcopy(raw)
    for item in overrides:
        _apply_set(raw, item)
    unknown = sorted(set(raw) - _TOP)
    if unknown:
        raise _unknown_keys("top level", unknown, _TOP)
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise SpecError("the spec needs a non-empty string `name` (top level: name = \"...\")")
    if "train" in raw and "federated" in raw:
        raise SpecError("give [train] (example-level DP-SGD) or [federated] (user-level "
                        "DP-FedAvg), not both")
    kind = "federated" if "federated" in raw else "train"
    fields_valid = _train_fields(kind)
    train = _table(raw.get(kind), kind)
    bad = sorted(set(train) - fields_valid)
    if bad:
        raise _unknown_keys(f"[{kind}]", bad, fields_valid, "field(s)")
    owned_keys = _FED_GRID_OWNED if kind == "federated" else _GRID_OWNED - {"dataset", "model"}
    owned = sorted(set(train) & owned_keys)
    if owned:
        raise SpecError(f"[{kind}]: {owned} are set by [grid]/[[strategies]], not [{kind}]")
    grid = _table(raw.get("grid"), "grid")
    bad = sorted(set(grid) - _GRID)
    if bad:
        raise _unknown_keys("[grid]", bad, _GRID)
    datasets = _as_tuple(grid.get("datasets", train.pop("dataset", None)), "datasets", str)
    models = _as_tuple(grid.get("models", train.pop("model", None)), "models", str)
    train.pop("dataset", None)
    train.pop("model", None)
    epsilons = _as_tuple(grid.get("epsilons"), "epsilons", float)
    noises = _as_tuple(grid.get("noise_multipliers"), "noise_multipliers", float)
    seeds = _as_tuple(grid.get("seeds", [0]), "seeds", int)
    if not datasets or not models:
        if kind == "federated" and datasets and not models:
            models = ("mlp",)  # the federated spec's default model
        else:
            raise SpecError(f"give the dataset(s) and model(s): [{kind}] dataset/model or [grid] "
                            "datasets/models")
    if bool(epsilons) == bool(noises):
        raise SpecError("[grid] needs exactly one of `epsilons` or `noise_multipliers`")
    if not seeds:
        raise SpecError("[grid] seeds must not be empty")
    strategies = []
    labels: set[str] = set()
    raw_strategies = raw.get("strategies", [])
    if not isinstance(raw_strategies, list):
        raise SpecError("`strategies` must be an array of tables: write each as [[strategies]] "
                        "with name = \"...\" (and optional label, params, train)")
    for i, s in enumerate(raw_strategies):
        if not isinstance(s, dict):
            raise SpecError(f"strategies[{i}] must be a table")
        bad = sorted(set(s) - _STRAT)
        if bad:
            raise _unknown_keys(f"strategies[{i}]", bad, _STRAT)
        if "name" not in s:
            raise SpecError(f"strategies[{i}] needs a `name`")
        _table(s.get("params"), f"strategies[{i}].params")
        st_train = _table(s.get("train"), f"strategies[{i}].train")
        bad = sorted(set(st_train) - fields_valid)
        if bad:
            raise _unknown_keys(f"strategies[{i}].train", bad, fields_valid, "field(s)")
        owned = sorted(set(st_train) & (owned_keys - {"dataset", "model"}))
        if owned:
            raise SpecError(f"strategies[{i}].train: {owned} are set by [grid]/[[strategies]]")
        label = str(s.get("label", s["name"]))
        if label in labels:
            raise SpecError(f"strategies[{i}]: duplicate label {label!r}; give each a `label`")
        labels.add(label)
        tune = _table(s.get("tune"), f"strategies[{i}].tune")
        for key, values in tune.items():
            if key in _TRAIN_FIELDS and key not in TUNABLE_TRAIN_FIELDS:
                raise SpecError(
                    f"strategies[{i}].tune: {key!r} cannot be tuned (it changes the privacy plan "
                    f"or the budget); tunable TrainConfig fields: {list(TUNABLE_TRAIN_FIELDS)}, "
                    "and the strategy's own parameters")
            if not isinstance(values, list) or not values:
                raise SpecError(f"strategies[{i}].tune.{key} must be a non-empty list of values, "
                                f"got {values!r}")
        strategies.append(StrategySpec(str(s["name"]), label, dict(s.get("params", {})),
                                       st_train, tune))
    if not strategies:
        raise SpecError("the spec needs at least one [[strategies]] entry")
    published = raw.get("published", {})
    if not isinstance(published, dict):
        raise SpecError("[published] must be a table: label = { value = ..., source = ... }")
    for lab, entry in published.items():
        if lab not in labels:
            raise SpecError(f"[published]: {lab!r} is not a strategy label of this spec; "
                            f"labels: {sorted(labels)}")
        if not (isinstance(entry, dict) and isinstance(entry.get("value"), (int, float))):
            raise SpecError(f"[published].{lab} must be {{ value = <accuracy %>, source = ... }}")
        at = entry.get("at", {})
        if not isinstance(at, dict) or not all(
                isinstance(v, (int, float)) and _is_number(k) for k, v in at.items()):
            raise SpecError(f"[published].{lab}.at must map privacy levels to published "
                            f"accuracies, e.g. at = {{ \"1.5\" = 82.7, \"2.7\" = 85.2 }}; got {at!r}")
    claims = _parse_claims(raw.get("claims", []), labels)
    if len(epsilons) + len(noises) > 1:
        for i, c in enumerate(claims):
            if "epsilon" not in c:
                raise SpecError(f"claims[{i}]: the grid has several privacy levels; say at which "
                                f"one the claim is judged, e.g. epsilon = {(epsilons or noises)[0]}")
    if kind == "federated" and ("tuning" in raw or any(st.tune for st in strategies)):
        raise SpecError("[tuning] and `tune` are for example-level [train] grids; a [federated] "
                        "grid has no tuning protocol yet: remove them, or tune by hand with a grid")
    tuning = _parse_tuning(raw.get("tuning"), strategies)
    spec = ExperimentSpec(name, str(raw.get("description", "")), train, datasets, models,
                          epsilons, noises, seeds, tuple(strategies), str(raw.get("paper", "")),
                          dict(published), tuning, kind, tuple(claims))
    if validate_names:
        _validate_names(spec)
    return spec


def _is_number(x: Any) -> bool:
    try:
        float(x)
    except (TypeError, ValueError):
        return False
    return True


def _parse_claims(raw: Any, labels: set[str]) -> list[dict[str, Any]]:
    """``[[claims]]``: a paper claim the stored runs decide. Either a comparison
    (``better`` beats ``than``) or a level (``label`` reaches ``at_least`` %), optionally at one
    ``epsilon`` (or noise multiplier) of the grid; ``text`` states it, ``note`` adds context."""
    if not isinstance(raw, list):
        raise SpecError("[[claims]] must be an array of tables: [[claims]] text = ..., "
                        "better = LABEL, than = LABEL (or label = LABEL, at_least = %)")
    out = []
    for i, c in enumerate(raw):
        where = f"claims[{i}]"
        if not isinstance(c, dict):
            raise SpecError(f"{where} must be a table")
        bad = [k for k in c if k not in _CLAIM]
        if bad:
            raise _unknown_keys(where, bad, _CLAIM)
        if not isinstance(c.get("text"), str) or not c["text"]:
            raise SpecError(f"{where}.text: state the claim, e.g. text = \"Decay beats Abadi\"")
        compare = "better" in c or "than" in c
        level = "label" in c or "at_least" in c
        if compare == level:
            raise SpecError(f"{where}: give either better = LABEL and than = LABEL (a comparison) "
                            "or label = LABEL and at_least = <accuracy %> (a level)")
        need = ("better", "than") if compare else ("label",)
        for k in need:
            if c.get(k) not in labels:
                raise SpecError(f"{where}.{k} = {c.get(k)!r} is not a strategy label of this "
                                f"spec; labels: {sorted(labels)}")
        if level and not isinstance(c.get("at_least"), (int, float)):
            raise SpecError(f"{where}.at_least must be an accuracy in %, got {c.get('at_least')!r}")
        if "epsilon" in c and not isinstance(c["epsilon"], (int, float)):
            raise SpecError(f"{where}.epsilon must be a number, got {c['epsilon']!r}")
        out.append(dict(c))
    return out


def _parse_tuning(raw: Any, strategies: list[StrategySpec]) -> TuningSpec | None:
    if raw is None:
        for st in strategies:
            if st.tune:
                raise SpecError(f"strategy {st.label!r} has a `tune` search space but the spec "
                                "has no [tuning] section (source, trials, epochs)")
        return None
    t = _table(raw, "tuning")
    bad = sorted(set(t) - _TUNING)
    if bad:
        raise _unknown_keys("[tuning]", bad, _TUNING)
    source = t.get("source")
    if source not in SOURCES:
        raise SpecError(f"[tuning] source must be one of {sorted(SOURCES)}, got {source!r}")
    for key in ("trials", "epochs"):
        v = t.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise SpecError(f"[tuning] {key} must be an integer >= 1 (the budget, the same for "
                            f"every strategy), got {v!r}")
    seed = t.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise SpecError(f"[tuning] seed must be an integer, got {seed!r}")
    frac = t.get("validation_fraction", 0.1)
    if source == "validation":
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac < 1:
            raise SpecError(f"[tuning] validation_fraction must be in (0, 1), got {frac!r}")
        if "proxy" in t:
            raise SpecError("[tuning] proxy is only used with source = \"public-proxy\"")
    elif "validation_fraction" in t:
        raise SpecError("[tuning] validation_fraction is only used with source = \"validation\"")
    proxy = t.get("proxy")
    if proxy is not None and not isinstance(proxy, str):
        raise SpecError(f"[tuning] proxy must be a dataset name, got {proxy!r}")
    horizon = t.get("horizon", "truncated")
    if horizon not in HORIZONS:
        raise SpecError(f"[tuning] horizon must be one of {sorted(HORIZONS)}, got {horizon!r}")
    if horizon == "tan" and source != "validation":
        raise SpecError("[tuning] horizon = \"tan\" needs source = \"validation\" (a public "
                        "proxy has its own size and steps); use horizon = \"truncated\"")
    missing = [st.label for st in strategies if not st.tune]
    if missing:
        raise SpecError(
            f"[tuning]: every strategy gets the same budget over its own search space; "
            f"{missing} have no `tune` table (e.g. tune = {{ lr = [0.5, 1.0] }})")
    tuning = TuningSpec(str(source), int(t["trials"]), int(t["epochs"]), int(seed),
                        float(frac), proxy, str(horizon))
    for st in strategies:  # the same number of trials for everyone (or a clear error now)
        try:
            search_points(st.tune, tuning.trials, tuning.seed, f"strategy {st.label!r} tune")
        except ValueError as exc:
            raise SpecError(str(exc)) from None
    return tuning


def _validate_names(spec: ExperimentSpec) -> None:
    datasets, models = list(DATASETS), list(MODELS)
    if spec.kind == "federated":  # + the TFF federated datasets and the benchmarks' models

        datasets += list(TFF_DATASETS)
        models += list(FEDERATED_MODELS)
    for ds in spec.datasets:
        if ds not in datasets:
            raise SpecError(f"[grid] datasets / [{spec.kind}] dataset: "
                            f"{unknown_name('dataset', ds, datasets)}")
    for m in spec.models:
        if m not in models:
            raise SpecError(f"[grid] models / [{spec.kind}] model: "
                            f"{unknown_name('model', m, models)}")

    if spec.tuning is not None and spec.tuning.source == "public-proxy":
        for ds in spec.datasets:
            try:
                public_proxy(ds, spec.tuning.proxy)
            except ValueError as exc:
                raise SpecError(f"[tuning] source = \"public-proxy\": {exc}") from None
    for st in spec.strategies:
        if st.name not in STRATEGIES:
            raise SpecError(f"[[strategies]] {st.label!r}: "
                            f"{unknown_name('strategy', st.name, STRATEGIES)}")
    runs = []
    for st in spec.strategies:  # TrainConfig validation, blamed on the table that set the value
        try:
            runs += dataclasses.replace(spec, strategies=(st,)).runs()
        except ValueError as exc:
            where = f"[train] with [[strategies]] {st.label!r} train" if st.train else "[train]"
            raise SpecError(f"{where}: {exc}") from None
    if spec.kind == "federated":
        for st in spec.strategies:
            try:
                check_federated_strategy(make_strategy(st.name, dict(st.params)))
            except ValueError as exc:
                raise SpecError(f"strategy {st.label!r}: {exc}") from None
        return
    for st in spec.strategies:
        try:
            # transfer's schedule=NAME and lin-decay's c0_from="greedy" are resolved from the
            # store by the runner; here they get placeholders so the rest is validated
            cfg = next(r.config for r in runs if r.label == st.label)
            cfg = resolve_strategy_params(cfg, None, dry_run=True)

            # the clipping unit is a TrainConfig field ([train] unit = ...; the old spelling in
            # params was moved there by TrainConfig, with a deprecation note)
            check_unit_sampling(cfg.unit_config, cfg.sampling)
            make_strategy(st.name, cfg.strategy_params)
            if spec.tuning is not None and spec.tuning.horizon == "tan" \
                    and spec.tuning.epochs >= cfg.epochs:
                raise ValueError(
                    f"[tuning] horizon = \"tan\" scales the batch by tuning.epochs / epochs, "
                    f"which needs tuning.epochs ({spec.tuning.epochs}) < the run's epochs "
                    f"({cfg.epochs}); lower tuning.epochs or use horizon = \"truncated\"")
            if spec.tuning is not None:  # every setting of the search space is a valid config
                for point in search_points(st.tune, spec.tuning.trials, spec.tuning.seed):
                    tuned = apply_point(cfg, point)
                    if tuned.lr_warmup_epochs >= spec.tuning.epochs:
                        raise ValueError(
                            f"lr_warmup_epochs {tuned.lr_warmup_epochs:g} does not fit in a trial "
                            f"of [tuning] epochs = {spec.tuning.epochs}; raise tuning.epochs or "
                            "shorten the warm-up")
                    make_strategy(st.name, tuned.strategy_params)
        except ValueError as exc:
            raise SpecError(f"strategy {st.label!r}: {exc}") from None


def load_spec(path: str | Path, overrides: Iterable[str] = ()) -> ExperimentSpec:
    """Read and validate a TOML spec file (a preset name is resolved by ``resolve_spec_path``)."""
    p = resolve_spec_path(path)
    with open(p, "rb") as fh:
        try:
            raw = tomllib.load(fh)
        except tomllib.TOMLDecodeError as exc:
            raise SpecError(f"{p}: invalid TOML: {exc}") from None
    try:
        return parse_spec(raw, overrides)
    except SpecError as exc:
        raise SpecError(f"{p}: {exc}") from None


PRESETS_DIR = Path(__file__).resolve().parent / "presets"


def resolve_spec_path(path: str | Path) -> Path:
    """A file path, or the name of a shipped preset (``quick``, ...)."""
    p = Path(path)
    if p.exists():
        return p
    preset = PRESETS_DIR / f"{path}.toml"
    if preset.exists():
        return preset
    names = sorted(x.stem for x in PRESETS_DIR.glob("*.toml"))
    raise SpecError(f"no spec file {str(path)!r} and no preset of that name; presets: {names}")
