"""The training loop: thin, reads like the paper's algorithm; checkpoint and resume.

``train(config)`` runs DP-SGD as described by a ``TrainConfig`` and returns a ``RunResult``. The
registries turn names into data, a model and an optimizer; the private loop is
``dpclip.training.private.PrivateTraining`` (the own-model API): each step is ``dpclip.training.step.dp_step``, the
ledger records the event the sampler and strategy emit, and the loop stops before the ledger would
exceed ``config.epsilon``. With ``checkpoint_dir`` set, the run
writes atomic checkpoints (model, optimizer, strategy state, ledger, every RNG, history) and, when
started again with the same config and directory, resumes from the last one: a run killed with
SIGKILL and resumed ends with the same ledger and epsilon (and the same weights) as an
uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from dpclip.accounting import Ledger
from dpclip.clipping import make_strategy
from dpclip.clipping.capabilities import capabilities_of
from dpclip.data import DatasetBundle, load_dataset, public_private_split
from dpclip.training.distributed import init_from_env
from dpclip.interrupts import TrainingInterrupted, defer_sigint, interrupt_requested
from dpclip.models import build_model
from dpclip.training.plan import CLI_FLAGS
from dpclip.training.private import PrivateTraining, default_delta
from dpclip.training.step import private_buffer_guard
from dpclip.training.units import (
    UnitConfig,
    batchnorm_layers,
    check_unit_sampling,
    frozen_bn_buffers,
    recompute_bn_stats,
)

__all__ = ["RunResult", "TrainConfig", "data_fingerprint", "evaluate", "make_optimizer",
           "resolve_device", "train"]

OPTIMIZERS = ("sgd", "momentum", "adam")
#: the learning-rate schedule fields and their defaults (left out of the fingerprint at default)
_LR_DEFAULTS: dict[str, Any] = {"lr_schedule": "constant", "lr_gamma": None,
                                "lr_step_epochs": None, "lr_min": None, "lr_warmup_epochs": 0.0}
#: TrainConfig.diagnostics values -> the split they are computed on (None: off)
DIAGNOSTICS: dict[Any, str | None] = {False: None, "off": None, "test": "test", True: "train",
                                      "train": "train"}


@dataclass(frozen=True)
class TrainConfig:
    """The public, serializable description of a private training run."""

    dataset: str = "fashion-mnist"
    model: str = "papernot-cnn"
    strategy: str = "fixed"
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
    #: augmentation multiplicity K (``dpclip.training.multiplicity``, De et al. 2022): each sampled example
    #: augmented K times, the K gradients averaged before clipping; needs ``augment``; sensitivity
    #: unchanged
    augment_multiplicity: int = 1
    #: weight averaging (``dpclip.training.averaging``): "none", "ema:D[:S]" or "polyak:S"; evaluation and
    #: the returned model use the averaged weights; post-processing (no privacy cost)
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
    max_physical_batch: int = 256
    eval_batch_size: int = 2048
    data_dir: str | None = None
    #: where the model, the data, the clipped sums and the secret generators live: "auto" (the
    #: default: cuda when available), "cpu", "cuda" or "cuda:N". An execution setting: not part of
    #: the fingerprint (the mechanism and the ledger are identical on every device; each device
    #: draws from its own secret generator, dpclip.randomness).
    device: str = "auto"
    #: clipping diagnostics each epoch (``dpclip.diagnostics``): False / "off" (default);
    #: "test": on a fixed batch of the TEST split (data never trained on; keys ``heldout/...``);
    #: True / "train": on private TRAINING examples, NON-PRIVATE (keys ``nonprivate/...``;
    #: research only: these numbers are not noised and not accounted)
    diagnostics: bool | str = False
    #: evaluate on the test split (and add a history row) every N epochs; 0: only at the end.
    #: An execution setting (not in the fingerprint): the trained model does not depend on it
    eval_every: int = 1

    def __post_init__(self) -> None:
        from dpclip.accounting import ACCOUNTANTS
        from dpclip.clipping.registry import STRATEGIES
        from dpclip.engine import ENGINES
        from dpclip.errors import unknown_name
        from dpclip.models import MODELS
        from dpclip.training.sampling import SAMPLERS

        cli = {"strategy_params": "--param", "model_options": "--model-option",
               "dataset_options": "--dataset-option", "weight_decay": None,
               "eval_batch_size": None}

        def flag(name: str) -> str:  # the field and its command-line flag, where there is one
            f = cli.get(name, f"--{name.replace('_', '-')}")
            return f"{name} ({f})" if f else name

        # types first: a TOML or JSON value of the wrong type gets a message, not a TypeError
        real, integer = (int, float), int  # plain Python numbers: the config is JSON
        kinds: dict[str, Any] = {
            "epsilon": real, "noise_multiplier": real, "delta": real, "batch_size": real,
            "lr": real, "momentum": real, "weight_decay": real, "epochs": integer,
            "seed": integer, "max_physical_batch": integer, "eval_batch_size": integer,
            "eval_every": integer,
            "dataset": str, "model": str, "strategy": str, "optimizer": str, "sampling": str,
            "accountant": str, "engine": str, "strategy_params": dict, "model_options": dict,
            "dataset_options": dict, "augment": str, "augment_multiplicity": integer,
            "averaging": str}
        for name, kind in kinds.items():
            value = getattr(self, name)
            if value is None and name in ("epsilon", "noise_multiplier", "delta"):
                continue
            if isinstance(value, bool) or not isinstance(value, kind):
                want = {real: "a number", integer: "an integer", str: "a string",
                        dict: "a table / dict"}[kind]
                hint = " (in a TOML spec, write numbers without quotes)" if (
                    isinstance(value, str) and kind in (real, integer)) else ""
                raise ValueError(
                    f"TrainConfig: {flag(name)} must be {want}, got {type(value).__name__} "
                    f"{value!r}{hint}"
                )
        if self.epsilon is None and self.noise_multiplier is None:
            raise ValueError(
                "TrainConfig: give a target epsilon (--epsilon) or a noise multiplier "
                "(--noise-multiplier)"
            )
        if self.epsilon is not None and not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise ValueError(f"TrainConfig: epsilon must be a finite number > 0, got {self.epsilon}")
        if self.noise_multiplier is not None and not (
            self.noise_multiplier >= 0 and math.isfinite(self.noise_multiplier)
        ):
            raise ValueError(
                f"TrainConfig: noise_multiplier must be >= 0, got {self.noise_multiplier}"
            )
        if self.delta is not None and not (0 < self.delta < 1):
            raise ValueError(f"TrainConfig: delta must be in (0, 1), got {self.delta}")
        if not (isinstance(self.epochs, int) and self.epochs >= 1):
            raise ValueError(f"TrainConfig: epochs must be an int >= 1, got {self.epochs!r}")
        if not (self.batch_size > 0):
            raise ValueError(f"TrainConfig: batch_size must be > 0, got {self.batch_size}")
        if not (self.lr > 0):
            raise ValueError(f"TrainConfig: lr must be > 0, got {self.lr}")
        if not re.fullmatch(r"cpu|auto|cuda(:\d+)?", str(self.device)):
            raise ValueError(
                f"TrainConfig: device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {self.device!r}"
            )
        if self.eval_every < 0:
            raise ValueError(f"TrainConfig: {flag('eval_every')} must be >= 0 (0: evaluate only "
                             f"at the end), got {self.eval_every}")
        for name in ("max_physical_batch", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"TrainConfig: {flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("momentum", "weight_decay"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise ValueError(
                    f"TrainConfig: {flag(name)} must be >= 0, got {getattr(self, name)}")
        # unknown names: "did you mean" and the valid names (the dataset is checked when loaded:
        # train(config, data=bundle) may name a dataset of its own)
        for name, valid in (("optimizer", OPTIMIZERS), ("sampling", SAMPLERS),
                            ("accountant", ACCOUNTANTS), ("engine", ENGINES),
                            ("strategy", STRATEGIES), ("model", MODELS)):
            if getattr(self, name) not in valid:
                raise ValueError(f"TrainConfig: {unknown_name(name, getattr(self, name), valid)}")

        from dpclip.data.augment import parse_augment
        from dpclip.lr_schedules import check_lr_schedule

        aug = parse_augment(self.augment, f"TrainConfig: {flag('augment')}")
        object.__setattr__(self, "augment", aug.spec if aug is not None else "none")  # canonical
        from dpclip.training.averaging import parse_averaging
        from dpclip.training.multiplicity import parse_multiplicity

        parse_multiplicity(self.augment_multiplicity,
                           f"TrainConfig: {flag('augment_multiplicity')}")
        if self.augment_multiplicity > 1 and aug is None:
            raise ValueError(
                f"TrainConfig: {flag('augment_multiplicity')} = {self.augment_multiplicity} "
                "averages the gradients of K AUGMENTED copies of each example, but augment is "
                "'none'; set --augment (e.g. crop:4,flip) or use K = 1")
        avg = parse_averaging(self.averaging, f"TrainConfig: {flag('averaging')}")
        object.__setattr__(self, "averaging", avg.spec if avg is not None else "none")

        check_lr_schedule(self.lr_schedule, self.lr_gamma, self.lr_step_epochs, self.lr_min,
                          self.lr_warmup_epochs, self.lr)
        if self.diagnostics not in DIAGNOSTICS:
            raise ValueError(
                f"TrainConfig: diagnostics must be one of False, True, 'off', 'test', 'train', got "
                f"{self.diagnostics!r}"
            )

    @property
    def diagnostics_split(self) -> str | None:
        """``None`` (off), ``"test"`` or ``"train"`` (NON-PRIVATE)."""
        return DIAGNOSTICS[self.diagnostics]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(TrainConfig)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"TrainConfig: unknown field(s) {unknown}; valid: {sorted(names)}")
        return TrainConfig(**d)

    def fingerprint(self) -> str:
        """Hash of everything that determines the run's outcome (not data_dir, not device).

        A ``reproducible_noise=True`` config hashes as the same config did before secure randomness
        became the default (dpclip < 0.2 always derived the noise from the seed, exactly as the
        reproducible mode does), so stored seeded runs keep their identity; a secure config gets
        a new fingerprint. The data itself is fingerprinted separately (``data_fingerprint``)."""
        d = self.to_dict()
        d.pop("data_dir", None)
        d.pop("device", None)
        d.pop("eval_every", None)  # execution setting: when the test split is evaluated
        # the schedule fields at their defaults hash as before they existed (a constant rate),
        # so stored runs and checkpoints keep their identity
        for key, default in _LR_DEFAULTS.items():
            if d.get(key) == default:
                d.pop(key)
        if d.get("reproducible_noise"):
            d.pop("reproducible_noise")
        if d.get("augment") == "none":  # hashes as before the field existed
            d.pop("augment")
        if d.get("augment_multiplicity") == 1:  # hashes as before the field existed
            d.pop("augment_multiplicity")
        if d.get("averaging") == "none":  # hashes as before the field existed
            d.pop("averaging")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def data_fingerprint(bundle: DatasetBundle) -> str:
    """SHA-256 of a dataset bundle's name, shapes, classes and every tensor's bytes.

    PRIVATE (a hash of the training data lets anyone holding a candidate dataset confirm it): it
    is kept in the run's checkpoint only, so that a run never resumes on different data."""
    h = hashlib.sha256()
    h.update(json.dumps([bundle.name, list(bundle.input_shape), int(bundle.num_classes)]).encode())
    for split in (bundle.train, bundle.test):
        for t in (split.inputs, split.targets):
            t = t.detach().to("cpu").contiguous()
            h.update(json.dumps([str(t.dtype), list(t.shape)]).encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def describe_config_diff(old: dict[str, Any], new: dict[str, Any]) -> str:
    """The fields of two ``TrainConfig.to_dict()`` dicts that differ, for error messages:
    ``"lr: 0.5 -> 0.1; epochs: 3 -> 4"`` (``data_dir`` and ``device`` are execution settings and
    never listed). Nested dicts (strategy_params, ...) are compared key by key."""
    ignore = {"data_dir", "device", "eval_every"}
    parts: list[str] = []
    for key in sorted((set(old) | set(new)) - ignore):
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            for sub in sorted(set(a) | set(b)):
                sa, sb = a.get(sub, "<absent>"), b.get(sub, "<absent>")
                if sa != sb:
                    parts.append(f"{key}.{sub}: {sa!r} -> {sb!r}")
        else:
            parts.append(f"{key}: {a!r} -> {b!r}")
    return "; ".join(parts) if parts else "(no field differs)"




def _check_run_inputs(config: TrainConfig, bundle: Any) -> None:
    """Checks of the data against the config, before anything is built (errors name the fix).

    * ``bundle`` is a ``DatasetBundle`` with a non-empty training split (its own construction
      checked shapes, label ranges and finite inputs);
    * ``delta < 1/N``, N the number of PRIVATE training examples (after the public split the
      strategy asks for): with ``delta >= 1/N`` a mechanism that publishes one random record in
      the clear meets the guarantee, so the (epsilon, delta) claim would be meaningless.
    """
    if not isinstance(bundle, DatasetBundle):
        raise TypeError(
            f"train(config, data=...): data must be a dpclip.data.DatasetBundle, got "
            f"{type(bundle).__name__}; build one with DatasetBundle(name, TensorSplit(x_train, "
            "y_train), TensorSplit(x_test, y_test), num_classes, input_shape, source='...')"
        )
    n = len(bundle.train)
    if n == 0:
        raise ValueError(f"dataset {bundle.name!r}: the training split has no examples")
    unit, params = UnitConfig.pop_from(config.strategy_params)
    fraction = unit.public_fraction
    if fraction is None:
        try:
            needs = bool(getattr(make_strategy(config.strategy, params), "needs_public_norms",
                                 False))
        except ValueError:  # reported with its own message when the run builds the strategy
            needs = False
        fraction = 0.1 if (needs or unit.bn_stats == "public") else 0.0
    n_private = n - int(round(fraction * n)) if fraction > 0 else n
    if n_private >= 1 and config.delta is not None and config.delta >= 1.0 / n_private:
        what = (f"{n_private} private training examples" if n_private == n else
                f"{n_private} private training examples ({n} minus the public split)")
        raise ValueError(
            f"delta={config.delta:g} (--delta) is >= 1/N = 1/{n_private} ({what}): a mechanism "
            "that publishes one random record in the clear meets this delta, so the guarantee "
            f"would mean nothing; use delta < 1/N, e.g. {default_delta(n_private):g}"
        )


@dataclass
class RunResult:
    """The summary of a run (every field JSON-serializable except ``model`` and ``ledger``)."""

    summary: dict[str, Any]
    history: list[dict[str, Any]]
    ledger: Ledger
    model: nn.Module


def make_optimizer(name: str, params: Any, lr: float, momentum: float, weight_decay: float):
    """SGD, SGD with (heavy-ball) momentum, or Adam — all post-processing of the noisy gradient."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(OPTIMIZERS)}")


def resolve_device(name: str) -> torch.device:
    """``torch.device`` for a ``TrainConfig.device`` value (``dpclip.devices.resolve_device``);
    a clear error naming ``--device`` if CUDA is missing."""
    from dpclip.devices import resolve_device as _resolve

    return _resolve(name, "--device")


def cross_entropy_per_example(outputs: Tensor, targets: Tensor) -> Tensor:
    return nn.functional.cross_entropy(outputs, targets, reduction="none")


@torch.no_grad()
def evaluate(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    batch_size: int = 2048,
    *,
    bn_batch_stats: bool = False,
) -> dict:
    """Accuracy and mean cross-entropy (the model is put in eval mode and restored).

    ``bn_batch_stats``: BatchNorm layers normalize with the statistics of each evaluation batch
    (their running statistics are neither used nor changed).
    """
    was_training = model.training
    model.eval()
    bns = [m for _, m in batchnorm_layers(model)] if bn_batch_stats else []
    correct, loss, n = 0, 0.0, int(inputs.shape[0])
    with frozen_bn_buffers(model):
        for m in bns:
            m.train()
        for i in range(0, n, batch_size):
            out = model(inputs[i : i + batch_size])
            y = targets[i : i + batch_size]
            loss += float(nn.functional.cross_entropy(out, y, reduction="sum"))
            correct += int((out.argmax(dim=1) == y).sum())
    model.train(was_training)
    return {"accuracy": correct / max(n, 1), "loss": loss / max(n, 1)}


def _atomic_save(obj: Any, path: Path) -> None:
    """Write ``path`` atomically (a ``.tmp`` then ``os.replace``): a failed write (full disk)
    leaves the previous checkpoint intact and says so."""
    from dpclip.training.checkpoint import atomic_private_save

    try:
        atomic_private_save(obj, path)  # owner-only (0600): the checkpoint is private
    except OSError as exc:
        kept = (f"the previous checkpoint {path} is intact" if path.exists()
                else "no checkpoint was written")
        raise OSError(
            exc.errno,
            f"could not write checkpoint {path} ({exc.strerror or exc}); {kept}. Free disk space "
            "or use another --checkpoint-dir, then run the same command again to resume",
        ) from exc


@defer_sigint  # Ctrl-C stops between two steps, checkpoints, raises TrainingInterrupted
def train(
    config: TrainConfig,
    *,
    data: DatasetBundle | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_interval_s: float = 60.0,
    progress: bool = True,
    on_epoch: Callable[[dict[str, Any]], None] | None = None,
    stop_after_steps: int | None = None,
    on_start: Callable[[], None] | None = None,
) -> RunResult:
    """Run DP-SGD as ``config`` describes (see the module docstring).

    The registries turn names into a dataset, a model and an optimizer; the private loop itself is
    :class:`dpclip.training.private.PrivateTraining`, the same object the own-model API returns (one path:
    the plan, calibration, budget, step, ledger and randomness are shared). This function adds
    evaluation, history, progress and checkpoints.

    ``stop_after_steps`` ends the process-local run early (for tests of resume); the checkpoint
    written then lets a later call continue.

    Ctrl-C (SIGINT) stops between two steps: the checkpoint is written (with ``checkpoint_dir``)
    and :class:`dpclip.interrupts.TrainingInterrupted` is raised; calling ``train`` again with the
    same config and directory resumes, saying ``resumed from step N (epsilon so far X)`` on
    stderr. ``on_start`` is called once every input has been checked, just before the first step
    (``dpclip train`` stores its run only then: a refused input leaves no row).
    """
    t_start = time.perf_counter()
    # torchrun: one private run across the ranks (dpclip.training.distributed); None in one process
    dist_ctx = init_from_env()
    is_main = dist_ctx is None or dist_ctx.is_main
    bundle = data or load_dataset(
        config.dataset, config.data_dir, seed=config.seed, **config.dataset_options
    )
    _check_run_inputs(config, bundle)
    device = resolve_device(config.device)
    if dist_ctx is not None and device.type == "cuda" and device.index is None:
        device = dist_ctx.device  # each rank on its own GPU (cuda:LOCAL_RANK)
    unit, strategy_params = UnitConfig.pop_from(config.strategy_params)
    check_unit_sampling(unit, config.sampling)
    strategy = make_strategy(config.strategy, strategy_params)
    needs_public = capabilities_of(strategy).public_norms or unit.bn_stats == "public"
    public_fraction = unit.public_fraction if unit.public_fraction is not None \
        else (0.1 if needs_public else 0.0)
    if needs_public and public_fraction <= 0:
        raise ValueError(
            f"strategy {config.strategy!r} / bn_stats={unit.bn_stats!r} needs a public split; set "
            "--param public_fraction=F with F > 0 (default 0.1)"
        )
    train_split, public_split = bundle.train, None
    if public_fraction > 0:  # carved out once, never trained on privately, never accounted
        public_split, train_split = public_private_split(bundle.train, public_fraction, config.seed)
    x_train, y_train = train_split.inputs.to(device), train_split.targets.to(device)
    x_test, y_test = bundle.test.inputs.to(device), bundle.test.targets.to(device)
    x_pub = y_pub = None
    if public_split is not None:
        x_pub, y_pub = public_split.inputs.to(device), public_split.targets.to(device)
    n_train = int(x_train.shape[0])
    delta = config.delta
    if delta is None:  # the default: well below 1/N of the private examples, and said so
        delta = default_delta(n_train)
        if is_main:
            print(f"dpclip: delta = {delta:g} (below 1/N = 1/{n_train}; --delta to choose)",
                  file=sys.stderr)

    torch.manual_seed(config.seed)  # public randomness: model initialisation (and dropout)
    model = build_model(
        config.model, bundle.input_shape, bundle.num_classes, **config.model_options
    ).to(device)
    model.train()
    bn_layers = batchnorm_layers(model)
    if unit.is_individual and bn_layers:
        raise ValueError(
            f"model {config.model!r} has BatchNorm layer {bn_layers[0][0]!r}: BatchNorm mixes the "
            "examples of a batch, so per-example clipping (unit=ic) cannot bound one example's "
            "influence. Use a GroupNorm variant of the model (e.g. lenet5, or --model-option "
            "norm=gn for resnet18) or batch clipping: --param unit=bc (or unit=gbc "
            "miniset_size=S with --sampling fixed-size)"
        )
    bn_mode = unit.bn_stats if unit.bn_stats != "auto" else (
        "public" if x_pub is not None else "batch")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(
        config.optimizer, params, config.lr, config.momentum, config.weight_decay
    )
    # the private loop: plan, calibration, budget, secret randomness, step and ledger
    dp = PrivateTraining(
        model, optimizer, (x_train, y_train),
        loss_fn=None if capabilities_of(strategy).bound_based else cross_entropy_per_example,
        strategy=strategy,
        strategy_params={k: v for k, v in config.strategy_params.items()
                         if k not in strategy_params},  # the clipping-unit keys
        epsilon=config.epsilon, noise_multiplier=config.noise_multiplier, delta=delta,
        epochs=config.epochs, batch_size=config.batch_size, sampling=config.sampling,
        accountant=config.accountant, engine=config.engine,
        max_physical_batch=config.max_physical_batch,
        reproducible_noise=config.reproducible_noise, seed=config.seed,
        public_data=(x_pub, y_pub) if x_pub is not None else None,
        input_shape=bundle.input_shape, verbose=False, flags=CLI_FLAGS,
        distributed=dist_ctx if dist_ctx is not None else False, augment=config.augment,
        augment_multiplicity=config.augment_multiplicity, averaging=config.averaging,
    )
    total_steps, spe = dp.total_steps, dp.steps_per_epoch
    # the learning-rate schedule: post-processing of the noisy gradient (no privacy effect)
    from dpclip.lr_schedules import build_lr_scheduler, describe_lr_schedule

    lr_kwargs = dict(gamma=config.lr_gamma, step_epochs=config.lr_step_epochs,
                     lr_min=config.lr_min, warmup_epochs=config.lr_warmup_epochs)
    scheduler = build_lr_scheduler(optimizer, schedule=config.lr_schedule, **lr_kwargs,
                                   steps_per_epoch=spe, total_steps=total_steps)

    ckpt_path = Path(checkpoint_dir) / "checkpoint.pt" if checkpoint_dir is not None else None
    data_fp = data_fingerprint(bundle) if ckpt_path is not None else None
    history: list[dict[str, Any]] = []
    elapsed_before = 0.0
    if ckpt_path is not None and ckpt_path.exists():
        ck = torch.load(ckpt_path, weights_only=False, map_location="cpu")
        if ck["fingerprint"] != config.fingerprint():
            raise ValueError(
                f"checkpoint {ckpt_path} belongs to a different run configuration (changed: "
                f"{describe_config_diff(ck.get('config', {}), config.to_dict())}); use another "
                "--checkpoint-dir or delete it"
            )
        if not ck.get("finished") and ck.get("data_fingerprint") != data_fp:
            raise ValueError(
                f"checkpoint {ckpt_path} was written for different data than dataset "
                f"{config.dataset!r} loaded now (from {bundle.source!r}): resuming would mix two "
                "datasets in one privacy ledger. Point --data-dir at the data the run started with, "
                "or use another --checkpoint-dir"
            )
        if "private" not in ck:
            raise ValueError(
                f"checkpoint {ckpt_path} was written by an older dpclip (no private randomness "
                "state); it cannot be resumed: delete it or use another --checkpoint-dir"
            )
        dp.load_state_dict(ck["private"])
        if scheduler is not None:  # the schedule continues where it stopped
            scheduler.load_state_dict(ck["lr_scheduler"])
        history = ck["history"]
        torch.set_rng_state(ck["torch_rng"])
        elapsed_before = ck["elapsed"]
        if is_main:
            print(f"dpclip: resumed from step {dp.steps} (epsilon so far {dp.epsilon():.4g})",
                  file=sys.stderr)

    def save(finished: bool = False) -> None:
        if ckpt_path is None or not is_main:  # rank 0 writes; every rank resumes from its file
            return
        from dpclip.training.checkpoint import finished_checkpoint, make_private_dir

        make_private_dir(ckpt_path.parent)  # owner-only
        ck = {
                "fingerprint": config.fingerprint(),
                "data_fingerprint": data_fp,  # PRIVATE (a hash of the data)
                "config": config.to_dict(),
                # PRIVATE: model, optimizer, strategy state, ledger and the secret generators
                "private": dp.state_dict(),
                "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
                "step": dp.steps,
                "history": history,
                "torch_rng": torch.get_rng_state(),
                "elapsed": elapsed_before + time.perf_counter() - t_start,
            }
        # a finished run keeps no secret generator state and no data fingerprint
        _atomic_save(finished_checkpoint(ck) if finished else ck, ckpt_path)

    bar = None
    if progress and is_main:
        from tqdm.auto import tqdm

        bar = tqdm(total=total_steps, initial=dp.steps, desc=f"{config.strategy}", unit="step",
                   dynamic_ncols=True, leave=False)
    last_save = time.perf_counter()
    step_seconds = 0.0
    train_seconds = 0.0  # time inside steps (sampling + step), summed over the run
    steps_in_epoch_timed = 0
    diag_idx = torch.arange(min(256, n_train), device=device)
    diag_test_idx = torch.arange(min(256, int(x_test.shape[0])), device=device)
    steps_this_call = 0

    def evaluate_now() -> dict:
        with dp.averaged_weights():  # the averaged weights, when averaging is on
            if bn_layers and bn_mode == "public" and x_pub is not None:
                recompute_bn_stats(model, x_pub)  # public statistics only
            return evaluate(model, x_test, y_test, config.eval_batch_size,
                            bn_batch_stats=bool(bn_layers) and bn_mode == "batch")

    if on_start is not None and is_main:
        on_start()
    while not dp.exhausted:
        if interrupt_requested():  # Ctrl-C: between two steps, so the checkpoint is one step's
            save()
            if bar is not None:
                bar.close()
            raise TrainingInterrupted(dp.steps, total_steps, dp.epsilon(),
                                      ckpt_path if ckpt_path is not None and is_main else None)
        if stop_after_steps is not None and steps_this_call >= stop_after_steps:
            save()
            if bar is not None:
                bar.close()
            # public facts of the plan (stop_after_steps=0 gives the calibrated noise, no step)
            return RunResult({"interrupted": True, "step": dp.steps,
                              "noise_multiplier": dp.noise_multiplier,
                              "steps_per_epoch": spe, "private_examples": n_train},
                             history, dp.ledger, model)
        t_step = time.perf_counter()
        xb, yb = dp.sample()
        lr_used = optimizer.param_groups[0]["lr"]
        dp.step(xb, yb)
        if scheduler is not None:
            scheduler.step()
        step = dp.steps
        step_seconds += time.perf_counter() - t_step
        train_seconds += time.perf_counter() - t_step
        steps_in_epoch_timed += 1
        steps_this_call += 1
        if bar is not None:
            bar.update(1)
        epoch_end = step % spe == 0 or step == total_steps
        eval_due = step == total_steps or (config.eval_every > 0 and
                                           ((step - 1) // spe + 1) % config.eval_every == 0)
        if epoch_end and not eval_due:  # --eval-every: no evaluation this epoch
            save()
            last_save = time.perf_counter()
        elif epoch_end:  # end of an epoch with an evaluation
            ev = evaluate_now()
            eps_now = dp.epsilon()
            row = {
                "epoch": (step - 1) // spe + 1,
                "step": step,
                "test_accuracy": ev["accuracy"],
                "test_loss": ev["loss"],
                "epsilon": eps_now,
                "clip_threshold": dp.clip_threshold,
                "noise_multiplier": dp.last_output.noise_multiplier if dp.last_output
                else dp.noise_multiplier,
                "lr": lr_used,  # the learning rate of the epoch's last step
                "wall_seconds": elapsed_before + time.perf_counter() - t_start,
            }
            if config.diagnostics_split == "train":  # NON-PRIVATE opt-in: a step's time
                # depends on the realised (private) batch size (docs/privacy.md, "Timing")
                row["nonprivate/ms_per_step"] = (1000.0 * step_seconds
                                                 / max(steps_in_epoch_timed, 1))
            step_seconds, steps_in_epoch_timed = 0.0, 0
            if config.diagnostics_split and unit.is_individual \
                    and not capabilities_of(dp.strategy).per_example_grads:
                from dpclip.diagnostics import nonprivate_diagnostics

                if config.diagnostics_split == "test":  # held-out data: not the protected data
                    xd, yd, prefix = x_test[diag_test_idx], y_test[diag_test_idx], "heldout/"
                else:  # private training examples: NON-PRIVATE, only when asked for
                    xd, yd, prefix = x_train[diag_idx], y_train[diag_idx], "nonprivate/"
                with private_buffer_guard(model, "diagnostics"):
                    diag = nonprivate_diagnostics(model, cross_entropy_per_example, xd, yd,
                                                  dp.strategy, dp.state, dp.groups)
                row.update({prefix + k.removeprefix("nonprivate/"): v for k, v in diag.items()})
            history.append(row)
            if bar is not None:
                bar.set_postfix(acc=f"{ev['accuracy']:.4f}", eps=f"{eps_now:.3f}")
            if on_epoch is not None and is_main:
                on_epoch(row)
            save()
            last_save = time.perf_counter()
        elif ckpt_path is not None and is_main \
                and time.perf_counter() - last_save > checkpoint_interval_s:
            save()
            last_save = time.perf_counter()
    if bar is not None:
        bar.close()
    step = dp.steps
    if not history or history[-1]["step"] != step:
        ev = evaluate_now()
        history.append({
            "epoch": step / spe, "step": step, "test_accuracy": ev["accuracy"],
            "test_loss": ev["loss"], "epsilon": dp.epsilon(),
            "clip_threshold": dp.clip_threshold, "noise_multiplier": dp.noise_multiplier,
            "wall_seconds": elapsed_before + time.perf_counter() - t_start,
        })
        save()
    if ckpt_path is not None and is_main:  # finished (dpclip.training.checkpoint): drop the secrets
        from dpclip.training.checkpoint import FINISHED_NOTE

        save(finished=True)
        print(f"dpclip: {ckpt_path}: {FINISHED_NOTE}", file=sys.stderr)
    facts = dp.describe()
    summary = {
        "dataset": config.dataset,
        "model": config.model,
        "strategy": config.strategy,
        **{k: facts[k] for k in ("params", "epsilon", "target_epsilon", "delta", "accountant",
                                 "adjacency", "sampling", "unit", "sensitivity_factor",
                                 "clip_groups")},
        "public_examples": 0 if x_pub is None else int(x_pub.shape[0]),
        "private_examples": n_train,
        "bn_stats": bn_mode if bn_layers else None,
        **{k: facts[k] for k in ("noise_multiplier", "sample_rate", "expected_batch_size",
                                 "steps", "planned_steps")},
        "epochs": config.epochs,
        "epochs_completed": step / spe,
        "stopped_by_budget": facts["stopped_by_budget"],
        "test_accuracy": history[-1]["test_accuracy"],
        "lr": config.lr,
        "lr_schedule": describe_lr_schedule(config.lr_schedule, lr=config.lr,
                                            steps_per_epoch=spe, **lr_kwargs),
        "optimizer": config.optimizer,
        "seed": config.seed,
        **dp.rng.describe(),
        "diagnostics": {None: "off", "test": "test split",
                        "train": "training examples (NON-PRIVATE)"}[config.diagnostics_split],
        "preprocessing": dict(getattr(bundle, "preprocessing", None) or {}),
        # the engine that ran (not the one requested: "auto" resolves per model and strategy)
        "engine": facts["engine"] if dp.engines_ran
        else (dp.engine.name if unit.is_individual else "unit"),
        "engine_requested": config.engine,
        "engine_fallback": facts["engine_fallback"],
        "device": str(device),
        "distributed": facts.get("distributed"),
        "model_options": config.model_options,
        "augment": facts["augment"],
        "augment_multiplicity": facts["augment_multiplicity"],
        "averaging": facts["averaging"],
        "wall_seconds": elapsed_before + time.perf_counter() - t_start,
        # seconds inside the steps of this call (sampling and step; no evaluation, calibration
        # or start-up): the figure to compare with another library's training loop
        "train_seconds": train_seconds,
    }
    # the released model: the averaged weights when averaging is on (what was evaluated)
    return RunResult(summary, history, dp.ledger,
                     dp.averaged_model() if dp.averager is not None else model)
