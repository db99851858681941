"""The configuration of a ``dpclip train`` run, in three parts (jax_privacy's model).

* :class:`PrivacyConfig`: what epsilon depends on (the data, the strategy and its clipping unit,
  the noise or the target, delta, the sampler, the batch size, the number of epochs, the
  accountant, reproducible noise).
* :class:`OptimisationConfig`: what the trained model depends on besides privacy (the model, the
  optimizer and its schedule, augmentation, averaging, the public seed, BatchNorm evaluation
  statistics, the diagnostics the run reports).
* :class:`PerformanceFlags`: neither (the engine, the physical batch, the device, the evaluation
  batch and cadence, where the data is read from). Changing one never changes the mechanism,
  the ledger or the fingerprint.

:class:`TrainConfig` is the flat front that users, the CLI and the TOML specs write
(``TrainConfig(lr=0.1, unit="bc", ...)``); ``config.privacy``, ``config.optimisation`` and
``config.performance`` are its parts, and :meth:`TrainConfig.fingerprint` hashes the privacy and
optimisation parts, by construction (every field belongs to exactly one part: tested).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, TypeVar

from dpclip.training.units import UNIT_DEFAULTS, UnitConfig, resolve_unit

__all__ = ["DIAGNOSTICS", "DictFields", "OPTIMIZERS", "OptimisationConfig", "PerformanceFlags",
           "PrivacyConfig", "TrainConfig"]

OPTIMIZERS = ("sgd", "momentum", "adam")
#: the learning-rate schedule fields and their defaults (left out of the fingerprint at default)
_LR_DEFAULTS: dict[str, Any] = {"lr_schedule": "constant", "lr_gamma": None,
                                "lr_step_epochs": None, "lr_min": None, "lr_warmup_epochs": 0.0}
#: TrainConfig.diagnostics values -> the split they are computed on (None: off)
DIAGNOSTICS: dict[Any, str | None] = {False: None, "off": None, "test": "test", True: "train",
                                      "train": "train"}


#: performance flags that older fingerprints hashed: hashed at these constants, so that a config
#: at the defaults keeps its identity (stored runs, checkpoints) while no flag changes it
_LEGACY_HASHED = {"engine": "auto", "max_physical_batch": 256, "eval_batch_size": 2048}
_CLI = {"strategy_params": "--param", "model_options": "--model-option",
        "dataset_options": "--dataset-option", "weight_decay": None, "eval_batch_size": None}
_REAL, _INT = (int, float), int  # plain Python numbers: the config is JSON
_KINDS: dict[str, Any] = {
    "epsilon": _REAL, "noise_multiplier": _REAL, "delta": _REAL, "batch_size": _REAL,
    "lr": _REAL, "momentum": _REAL, "weight_decay": _REAL, "epochs": _INT, "seed": _INT,
    "max_physical_batch": _INT, "eval_batch_size": _INT, "eval_every": _INT,
    "dataset": str, "model": str, "strategy": str, "optimizer": str, "sampling": str,
    "accountant": str, "engine": str, "strategy_params": dict, "model_options": dict,
    "dataset_options": dict, "augment": str, "augment_multiplicity": _INT, "averaging": str,
    "unit": str, "bn_stats": str, "miniset_size": _INT, "public_fraction": _REAL}
_OPTIONAL = ("epsilon", "noise_multiplier", "delta", "miniset_size", "public_fraction",
             "max_physical_batch")


_C = TypeVar("_C", bound="DictFields")


def _flag(name: str) -> str:
    """The field and its command-line flag, where there is one."""
    f = _CLI.get(name, f"--{name.replace('_', '-')}")
    return f"{name} ({f})" if f else name


class DictFields:
    """Mixin of the config dataclasses (:class:`TrainConfig`, the greedy search's) that are stored
    as plain dicts (JSON files, checkpoints) and read back."""

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (``dataclasses.asdict``)."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[_C], d: Mapping[str, Any]) -> _C:
        """``cls(**d)``; a key that is not a field is refused, naming it and the valid fields."""
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}; valid: {sorted(names)}")
        return cls(**d)


@dataclass(frozen=True)
class TrainConfig(DictFields):
    """The public, serializable description of a private training run (the flat front of
    :class:`PrivacyConfig`, :class:`OptimisationConfig` and :class:`PerformanceFlags`)."""

    dataset: str = "fashion-mnist"
    model: str = "papernot-cnn"
    strategy: str = "fixed"
    #: the strategy's own parameters (the clipping unit settings used to travel here: still
    #: read, with a DeprecatedSpellingWarning, and moved to their own fields)
    strategy_params: dict[str, Any] = field(default_factory=dict)
    model_options: dict[str, Any] = field(default_factory=dict)
    dataset_options: dict[str, Any] = field(default_factory=dict)
    epsilon: float | None = None  #: target (calibrates the noise) or, with noise_multiplier, a cap
    noise_multiplier: float | None = None
    #: None: chosen below 1/N (1e-5, or the power of ten below 1/(10 N)) and printed
    delta: float | None = None
    epochs: int = 1
    batch_size: float = 256  #: expected batch size (Poisson) or exact size (fixed-size)
    lr: float = 0.1
    #: learning-rate schedule (``dpclip.lr_schedules``): "constant", "step", "exponential",
    #: "cosine"; post-processing only (no privacy effect), stepped per optimizer step
    lr_schedule: str = "constant"
    lr_gamma: float | None = None  #: step / exponential: the factor (per lr_step_epochs / epoch)
    lr_step_epochs: int | None = None  #: step: epochs between two multiplications by lr_gamma
    lr_min: float | None = None  #: cosine: the final learning rate (default 0)
    lr_warmup_epochs: float = 0.0  #: linear warm-up over this many epochs (any schedule)
    #: per-example image augmentation after the secret sampling (``dpclip.data.augment``):
    #: "none" or e.g. "crop:4,flip"; the sensitivity is unchanged, test data is never augmented
    augment: str = "none"
    #: augmentation multiplicity K (``dpclip.training.multiplicity``, De et al. 2022): each
    #: sampled example augmented K times, the K gradients averaged before clipping; needs
    #: ``augment``; sensitivity unchanged
    augment_multiplicity: int = 1
    #: weight averaging (``dpclip.training.averaging``): "none", "ema:D[:S]" or "polyak:S";
    #: evaluation and the returned model use the averaged weights; post-processing
    averaging: str = "none"
    optimizer: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 0.0
    #: public randomness only: model initialisation, data splits, public choices. The noise and
    #: batch-sampling generators draw their seeds from OS entropy unless ``reproducible_noise``.
    seed: int = 0
    #: derive the noise and sampling generators from ``seed`` (research reproducibility only): the
    #: run is NOT private against anyone who knows the seed, and is labelled so everywhere
    reproducible_noise: bool = False
    sampling: str = "poisson"
    accountant: str = "pld"
    engine: str = "auto"
    #: examples per forward/backward chunk (memory only; results do not change). None (the
    #: default): the engine's own: ghost / auto run the whole batch in one pass, as a non-private
    #: step; vmap / naive materialise 256 per-example gradients at a time. (256 for every engine
    #: before 0.3: a Fashion-MNIST batch of 2048 on ghost then ran 8 passes a step, each with its
    #: own host synchronisations, on a GPU ~4x the whole-batch step.)
    max_physical_batch: int | None = None
    eval_batch_size: int = 2048
    data_dir: str | None = None
    #: where the model, the data, the clipped sums and the secret generators live: "auto" (the
    #: default: cuda when available), "cpu", "cuda" or "cuda:N". A performance flag.
    device: str = "auto"
    #: clipping diagnostics each epoch (``dpclip.diagnostics``): False / "off" (default);
    #: "test": on a fixed batch of the TEST split (data never trained on; keys ``heldout/...``);
    #: True / "train": on private TRAINING examples, NON-PRIVATE (keys ``nonprivate/...``;
    #: research only: these numbers are not noised and not accounted)
    diagnostics: bool | str = False
    #: evaluate on the test split (and add a history row) every N epochs; 0: only at the end.
    #: A performance flag: the trained model does not depend on it
    eval_every: int = 1
    #: the clipping unit (``dpclip.training.units``): "ic" (per example), "bc" (batch
    #: clipping), "gbc" (mini-sets of ``miniset_size`` examples; needs fixed-size sampling)
    unit: str = "ic"
    miniset_size: int | None = None  #: gbc: examples per mini-set
    #: BatchNorm evaluation statistics: "auto", "batch" (test-batch) or "public" (public split)
    bn_stats: str = "auto"
    #: the share of the training set carved out as PUBLIC data; None: 0.1 when needed, else 0
    public_fraction: float | None = None

    def __post_init__(self) -> None:
        self._move_unit_settings()
        self._check_types()
        self._check_values()
        self._check_names()
        self._canonicalise()

    # ------------------------------------------------------------------------- validation

    def _move_unit_settings(self) -> None:
        """The clipping-unit settings of the old spelling (inside ``strategy_params``) move to
        their own fields, with a DeprecatedSpellingWarning (``dpclip.training.units.resolve_unit``)."""
        if not isinstance(self.strategy_params, dict):
            return  # reported by _check_types
        if not any(k in self.strategy_params for k in UNIT_DEFAULTS):
            return
        given = {k: getattr(self, k) for k in UNIT_DEFAULTS}
        unit, rest = resolve_unit(given, self.strategy_params, where="TrainConfig",
                                  front="TrainConfig")
        for key, value in unit.settings().items():
            object.__setattr__(self, key, value)
        object.__setattr__(self, "strategy_params", rest)

    def _check_types(self) -> None:
        """A TOML or JSON value of the wrong type gets a message, not a TypeError."""
        for name, kind in _KINDS.items():
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            if isinstance(value, bool) or not isinstance(value, kind):
                want = {_REAL: "a number", _INT: "an integer", str: "a string",
                        dict: "a table / dict"}[kind]
                hint = " (in a TOML spec, write numbers without quotes)" if (
                    isinstance(value, str) and kind in (_REAL, _INT)) else ""
                raise ValueError(
                    f"TrainConfig: {_flag(name)} must be {want}, got {type(value).__name__} "
                    f"{value!r}{hint}")

    def _check_values(self) -> None:
        if self.epsilon is None and self.noise_multiplier is None:
            raise ValueError("TrainConfig: give a target epsilon (--epsilon) or a noise "
                             "multiplier (--noise-multiplier)")
        if self.epsilon is not None and not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise ValueError(f"TrainConfig: epsilon must be a finite number > 0, got {self.epsilon}")
        if self.noise_multiplier is not None and not (
                self.noise_multiplier >= 0 and math.isfinite(self.noise_multiplier)):
            raise ValueError(
                f"TrainConfig: noise_multiplier must be >= 0, got {self.noise_multiplier}")
        if self.delta is not None and not (0 < self.delta < 1):
            raise ValueError(f"TrainConfig: delta must be in (0, 1), got {self.delta}")
        if not (isinstance(self.epochs, int) and self.epochs >= 1):
            raise ValueError(f"TrainConfig: epochs must be an int >= 1, got {self.epochs!r}")
        if not (self.batch_size > 0):
            raise ValueError(f"TrainConfig: batch_size must be > 0, got {self.batch_size}")
        if not (self.lr > 0):
            raise ValueError(f"TrainConfig: lr must be > 0, got {self.lr}")
        if not re.fullmatch(r"cpu|auto|cuda(:\d+)?", str(self.device)):
            raise ValueError(f"TrainConfig: device must be 'cpu', 'cuda', 'cuda:N' or 'auto', "
                             f"got {self.device!r}")
        if self.eval_every < 0:
            raise ValueError(f"TrainConfig: {_flag('eval_every')} must be >= 0 (0: evaluate only "
                             f"at the end), got {self.eval_every}")
        for name in ("max_physical_batch", "eval_batch_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(
                    f"TrainConfig: {_flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("momentum", "weight_decay"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise ValueError(
                    f"TrainConfig: {_flag(name)} must be >= 0, got {getattr(self, name)}")
        try:
            self.unit_config
        except ValueError as exc:
            raise ValueError(f"TrainConfig: {exc}") from None

    def _check_names(self) -> None:
        """Unknown names: "did you mean" and the valid names (the dataset is checked when
        loaded: ``train(config, data=bundle)`` may name a dataset of its own)."""
        from dpclip.accounting import ACCOUNTANTS
        from dpclip.clipping.registry import STRATEGIES
        from dpclip.engine import ENGINES
        from dpclip.errors import unknown_name
        from dpclip.models import MODELS
        from dpclip.training.sampling import SAMPLERS

        for name, valid in (("optimizer", OPTIMIZERS), ("sampling", SAMPLERS),
                            ("accountant", ACCOUNTANTS), ("engine", ENGINES),
                            ("strategy", STRATEGIES), ("model", MODELS)):
            if getattr(self, name) not in valid:
                raise ValueError(f"TrainConfig: {unknown_name(name, getattr(self, name), valid)}")

    def _canonicalise(self) -> None:
        """Augmentation, averaging and the schedule: parsed, and stored in canonical form."""
        from dpclip.data.augment import parse_augment
        from dpclip.lr_schedules import check_lr_schedule
        from dpclip.training.averaging import parse_averaging
        from dpclip.training.multiplicity import parse_multiplicity

        aug = parse_augment(self.augment, f"TrainConfig: {_flag('augment')}")
        object.__setattr__(self, "augment", aug.spec if aug is not None else "none")
        parse_multiplicity(self.augment_multiplicity,
                           f"TrainConfig: {_flag('augment_multiplicity')}")
        if self.augment_multiplicity > 1 and aug is None:
            raise ValueError(
                f"TrainConfig: {_flag('augment_multiplicity')} = {self.augment_multiplicity} "
                "averages the gradients of K AUGMENTED copies of each example, but augment is "
                "'none'; set --augment (e.g. crop:4,flip) or use K = 1")
        avg = parse_averaging(self.averaging, f"TrainConfig: {_flag('averaging')}")
        object.__setattr__(self, "averaging", avg.spec if avg is not None else "none")
        check_lr_schedule(self.lr_schedule, self.lr_gamma, self.lr_step_epochs, self.lr_min,
                          self.lr_warmup_epochs, self.lr)
        if self.diagnostics not in DIAGNOSTICS:
            raise ValueError(
                f"TrainConfig: diagnostics must be one of False, True, 'off', 'test', 'train', "
                f"got {self.diagnostics!r}")

    # ------------------------------------------------------------------------------ parts

    def _part(self, cls: type) -> Any:
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})

    @property
    def privacy(self) -> Any:
        """What epsilon depends on."""
        return self._part(PrivacyConfig)  # type: ignore[has-type]

    @property
    def optimisation(self) -> Any:
        """What the trained model depends on besides privacy."""
        return self._part(OptimisationConfig)

    @property
    def performance(self) -> Any:
        """Neither: engine, physical batch, device, evaluation batch and cadence, data_dir."""
        return self._part(PerformanceFlags)

    @property
    def unit_config(self) -> UnitConfig:
        """The clipping unit as a :class:`~dpclip.training.units.UnitConfig`."""
        return UnitConfig(**{k: getattr(self, k) for k in UNIT_DEFAULTS})

    @property
    def diagnostics_split(self) -> str | None:
        """``None`` (off), ``"test"`` or ``"train"`` (NON-PRIVATE)."""
        return DIAGNOSTICS[self.diagnostics]

    def fingerprint(self) -> str:
        """Hash of the privacy and optimisation parts (never a performance flag).

        Stored identities are kept: a field at its default hashes as before the field existed
        (the schedule, augmentation, averaging), the clipping unit hashes inside
        ``strategy_params`` where it used to travel, the performance flags older versions hashed
        are hashed at their defaults, and a ``reproducible_noise=True`` config hashes as it did
        before secure randomness became the default (dpclip < 0.2 always derived the noise from
        the seed). The data itself is fingerprinted separately (``data_fingerprint``)."""
        d = {**dataclasses.asdict(self.privacy), **dataclasses.asdict(self.optimisation),
             **_LEGACY_HASHED}
        unit = {k: d.pop(k) for k in UNIT_DEFAULTS}
        moved = {k: v for k, v in unit.items() if v != UNIT_DEFAULTS[k]}
        if moved:
            d["strategy_params"] = {**d["strategy_params"], **moved}
        for key, default in _LR_DEFAULTS.items():
            if d.get(key) == default:
                d.pop(key)
        if d.get("reproducible_noise"):
            d.pop("reproducible_noise")
        for key, default in (("augment", "none"), ("augment_multiplicity", 1),
                             ("averaging", "none")):
            if d.get(key) == default:  # hashes as before the field existed
                d.pop(key)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


#: the fields of each part (every TrainConfig field is in exactly one: tested)
_PARTS: dict[str, tuple[str, ...]] = {
    "PrivacyConfig": (
        "dataset", "dataset_options", "strategy", "strategy_params", "unit", "miniset_size",
        "public_fraction", "epsilon", "noise_multiplier", "delta", "epochs", "batch_size",
        "sampling", "accountant", "reproducible_noise"),
    "OptimisationConfig": (
        "model", "model_options", "lr", "lr_schedule", "lr_gamma", "lr_step_epochs", "lr_min",
        "lr_warmup_epochs", "augment", "augment_multiplicity", "averaging", "optimizer",
        "momentum", "weight_decay", "seed", "bn_stats", "diagnostics"),
    "PerformanceFlags": (
        "engine", "max_physical_batch", "eval_batch_size", "data_dir", "device", "eval_every"),
}


def _part_class(name: str, doc: str) -> type:
    """A frozen dataclass with the named TrainConfig fields (their types, defaults, docs)."""
    by_name = {f.name: f for f in dataclasses.fields(TrainConfig)}
    cls = dataclasses.make_dataclass(
        name, [(n, by_name[n].type, dataclasses.field(default=by_name[n].default,
                                                     default_factory=by_name[n].default_factory))
               for n in _PARTS[name]], frozen=True)
    cls.__doc__, cls.__module__ = doc, __name__
    return cls


PrivacyConfig = _part_class(
    "PrivacyConfig", "What the privacy guarantee (epsilon, delta) depends on: the data, the "
    "strategy and its clipping unit, the noise or the target, delta, the sampler, the batch size, "
    "the epochs, the accountant, reproducible noise.")
OptimisationConfig = _part_class(
    "OptimisationConfig", "What the trained model depends on besides privacy: the model, the "
    "optimizer and its schedule, augmentation, averaging, the public seed, BatchNorm evaluation "
    "statistics, the diagnostics the run reports.")
PerformanceFlags = _part_class(
    "PerformanceFlags", "Neither privacy nor the model depends on these (the mechanism and the "
    "ledger are identical whatever they are): not in the fingerprint.")

#: the fields that describe no outcome (listed by no config diff, hashed by no fingerprint)
PERFORMANCE_FIELDS = tuple(f.name for f in dataclasses.fields(PerformanceFlags))
