"""The training loop: thin, reads like the paper's algorithm; checkpoint and resume.

``train(config)`` runs DP-SGD as described by a ``TrainConfig`` (``dpclip.training.config``) and
returns a ``RunResult``. The registries turn names into data, a model and an optimizer; the
private loop is ``dpclip.training.private.PrivateTraining`` (the own-model API): each step is
``dpclip.training.step.dp_step``, the ledger records the event the sampler and strategy emit, and
the loop stops before the ledger would exceed ``config.epsilon``. With ``checkpoint_dir`` set, the
run writes atomic checkpoints (model, optimizer, strategy state, ledger, every RNG, history) and,
when started again with the same config and directory, resumes from the last one: a run killed
with SIGKILL and resumed ends with the same ledger and epsilon (and the same weights) as an
uninterrupted run.

``train`` reads in four parts: :func:`_build_run` (data, split, model, optimizer, the private
loop, the schedule), :class:`_Checkpointer` (resume and atomic saves), :func:`_epoch_row` (the
history row of an evaluated epoch) and the loop itself.
"""

from __future__ import annotations

import hashlib
import json
import os
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
from dpclip.data import DatasetBundle, independent_public_split, load_dataset
from dpclip.data.features import check_features_augment, parse_features
from dpclip.interrupts import TrainingInterrupted, defer_sigint, interrupt_requested
from dpclip.engine.known_losses import cross_entropy_per_example  # noqa: F401 (re-exported)
from dpclip.models import build_model
from dpclip.training.config import OPTIMIZERS, PERFORMANCE_FIELDS, TrainConfig
from dpclip.training.distributed import init_from_env
from dpclip.training.plan import CLI_FLAGS
from dpclip.training.private import PrivateTraining, resolve_delta
from dpclip.training.step import private_buffer_guard
from dpclip.training.units import (
    batchnorm_layers,
    check_unit_sampling,
    frozen_bn_buffers,
    public_fraction_of,
    recompute_bn_stats,
)
from dpclip.devices import resolve_device as _resolve
from dpclip.diagnostics import nonprivate_diagnostics
from dpclip.lr_schedules import build_lr_scheduler, describe_lr_schedule
from dpclip.training.checkpoint import (
    FINISHED_NOTE,
    atomic_private_save,
    finished_checkpoint,
    make_private_dir,
)

__all__ = ["RunResult", "TrainConfig", "data_fingerprint", "evaluate", "make_optimizer",
           "resolve_device", "train"]


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
    ``"lr: 0.5 -> 0.1; epochs: 3 -> 4"`` (performance flags, ``PerformanceFlags``, are never
    listed). Nested dicts (strategy_params, ...) are compared key by key."""
    ignore = set(PERFORMANCE_FIELDS)
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

    return _resolve(name, "--device")




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




def _check_bundle(bundle: Any) -> None:
    """``bundle`` is a ``DatasetBundle`` with a non-empty training split (its own construction
    checked shapes, label ranges and finite inputs)."""
    if not isinstance(bundle, DatasetBundle):
        raise TypeError(
            f"train(config, data=...): data must be a dpclip.data.DatasetBundle, got "
            f"{type(bundle).__name__}; build one with DatasetBundle(name, TensorSplit(x_train, "
            "y_train), TensorSplit(x_test, y_test), num_classes, input_shape, source='...')"
        )
    if len(bundle.train) == 0:
        raise ValueError(f"dataset {bundle.name!r}: the training split has no examples")


@dataclass
class _Run:
    """Everything ``train`` builds before its loop (see :func:`_build_run`)."""

    config: TrainConfig
    bundle: DatasetBundle
    is_main: bool
    device: torch.device
    model: nn.Module
    optimizer: torch.optim.Optimizer
    dp: PrivateTraining
    scheduler: Any
    lr_kwargs: dict[str, Any]
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    x_pub: Tensor | None
    y_pub: Tensor | None
    bn_mode: str
    #: the feature map applied to each drawn (augmented) batch; x_train holds the images
    features: Any = None

    @property
    def n_train(self) -> int:
        return int(self.x_train.shape[0])

    @property
    def has_bn(self) -> bool:
        return bool(batchnorm_layers(self.model))

    def evaluate(self) -> dict:
        """Test accuracy and loss of the released weights (averaged, when averaging is on); a
        BatchNorm model uses public or test-batch statistics, never private ones."""
        with self.dp.averaged_weights():
            if self.has_bn and self.bn_mode == "public" and self.x_pub is not None:
                recompute_bn_stats(self.model, self.x_pub)  # public statistics only
            return evaluate(self.model, self.x_test, self.y_test, self.config.eval_batch_size,
                            bn_batch_stats=self.has_bn and self.bn_mode == "batch")


def _build_run(config: TrainConfig, data: DatasetBundle | None) -> _Run:
    """The data (split into public and private parts), the model, the optimizer, the private
    loop (``PrivateTraining``: plan, calibration, budget, randomness, step, ledger) and the
    learning-rate schedule. Every input is checked here, before the first step."""
    # torchrun: one private run across the ranks (dpclip.training.distributed); None in one process
    dist_ctx = init_from_env()
    is_main = dist_ctx is None or dist_ctx.is_main
    options, fmap = dict(config.dataset_options), None
    if data is None and _augments(config.augment) and parse_features(options.get("features")):
        # augment the images, then map each drawn batch (dpclip.data.features): not the bundle
        fmap = parse_features(options.pop("features"))
    bundle = data or load_dataset(config.dataset, config.data_dir, seed=config.seed, **options)
    _check_bundle(bundle)
    # augmentation crops images, not the coefficients of a feature map (dataset option features)
    check_features_augment(bundle.preprocessing, config.augment)
    input_shape = bundle.input_shape if fmap is None else fmap.output_shape(bundle.input_shape)
    unit = config.unit_config
    check_unit_sampling(unit, config.sampling)
    strategy = make_strategy(config.strategy, config.strategy_params)  # built once
    public_fraction = public_fraction_of(unit, strategy)
    train_split, public_split = bundle.train, None
    pending = getattr(bundle, "private_preprocessing", None)  # e.g. centre="private"
    if pending is not None and public_fraction > 0:
        raise ValueError("the dataset option centre='private' (a private preprocessing release) "
                         "cannot be combined with a public split of the training data (the "
                         "strategy's public_fraction): drop one of the two")
    if fmap is not None and public_fraction > 0:
        raise ValueError("the dataset option features with an augmentation maps each drawn batch; "
                         "a public split of the training data (the strategy's public_fraction) "
                         "is not built with it: drop the augmentation or the public split")
    if public_fraction > 0:  # carved out once, never trained on privately, never accounted
        # (each example public or private on its own: a stratified split let one private
        # example move others between the parts, two-hundred-and-sixth hostile review)
        public_split, train_split = independent_public_split(bundle.train, public_fraction,
                                                             config.seed)
    n_train, n = len(train_split), len(bundle.train)
    what = f" ({n_train} private training examples" + (
        ")" if n_train == n else f" ({n} minus the public split))")
    delta = resolve_delta(config.delta, n_train, where="", verbose=is_main, flag="--delta",
                          detail=what)
    device = resolve_device(config.device)
    if dist_ctx is not None and device.type == "cuda" and device.index is None:
        device = dist_ctx.device  # each rank on its own GPU (cuda:LOCAL_RANK)
    x_train, y_train = train_split.inputs.to(device), train_split.targets.to(device)
    x_test, y_test = bundle.test.inputs.to(device), bundle.test.targets.to(device)
    if fmap is not None:  # the test split once (public post-processing of nothing private)
        x_test = fmap.transform(x_test, progress=f"{bundle.name} test: {fmap.spec}")
    x_pub = y_pub = None
    if public_split is not None:
        x_pub, y_pub = public_split.inputs.to(device), public_split.targets.to(device)

    torch.manual_seed(config.seed)  # public randomness: model initialisation (and dropout)
    model = build_model(
        config.model, input_shape, bundle.num_classes, **config.model_options
    ).to(device)
    model.train()
    bn_mode = unit.bn_stats if unit.bn_stats != "auto" else (
        "public" if x_pub is not None else "batch")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(
        config.optimizer, params, config.lr, config.momentum, config.weight_decay
    )
    bound = capabilities_of(strategy).bound_based
    dp = PrivateTraining(
        model, optimizer, (x_train, y_train),
        loss_fn=None if bound else cross_entropy_per_example, strategy=strategy, unit=unit,
        epsilon=config.epsilon, noise_multiplier=config.noise_multiplier, delta=delta,
        epochs=config.epochs, batch_size=config.batch_size, sampling=config.sampling,
        accountant=config.accountant, engine=config.engine,
        max_physical_batch=config.max_physical_batch,
        reproducible_noise=config.reproducible_noise, seed=config.seed,
        public_data=(x_pub, y_pub) if x_pub is not None else None,
        input_shape=input_shape, verbose=False, flags=CLI_FLAGS,
        distributed=dist_ctx if dist_ctx is not None else False, augment=config.augment,
        augment_multiplicity=config.augment_multiplicity, averaging=config.averaging,
        preprocess=pending, features=fmap,
    )
    # the learning-rate schedule: post-processing of the noisy gradient (no privacy effect)

    lr_kwargs = dict(gamma=config.lr_gamma, step_epochs=config.lr_step_epochs,
                     lr_min=config.lr_min, warmup_epochs=config.lr_warmup_epochs)
    scheduler = build_lr_scheduler(optimizer, schedule=config.lr_schedule, **lr_kwargs,
                                   steps_per_epoch=dp.steps_per_epoch, total_steps=dp.total_steps)
    return _Run(config, bundle, is_main, device, model, optimizer, dp, scheduler, lr_kwargs,
                x_train, y_train, x_test, y_test, x_pub, y_pub, bn_mode, fmap)


def _augments(augment: Any) -> bool:
    """Whether the config's ``augment`` asks for an augmentation."""
    return augment is not None and str(getattr(augment, "spec", augment)).strip().lower() not in (
        "", "none")


@dataclass
class _Checkpointer:
    """Resume from, and atomically write, the run's checkpoint (``checkpoint_dir``; rank 0
    writes, every rank resumes). The checkpoint is PRIVATE: it holds the secret generators'
    state and a hash of the data, both dropped when the run finishes."""

    run: _Run
    path: Path | None
    interval_s: float
    t_start: float
    history: list[dict[str, Any]] = field(default_factory=list)
    elapsed_before: float = 0.0
    last_save: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self.data_fp = data_fingerprint(self.run.bundle) if self.path is not None else None

    @property
    def writes(self) -> bool:
        return self.path is not None and self.run.is_main

    def resume(self) -> None:
        """Load the checkpoint when there is one (refusing another config or other data)."""
        if self.path is None or not self.path.exists():
            return
        run, config, path = self.run, self.run.config, self.path
        ck = torch.load(path, weights_only=False, map_location="cpu")
        if ck["fingerprint"] != config.fingerprint():
            raise ValueError(
                f"checkpoint {path} belongs to a different run configuration (changed: "
                f"{describe_config_diff(ck.get('config', {}), config.to_dict())}); use another "
                "--checkpoint-dir or delete it")
        if not ck.get("finished") and ck.get("data_fingerprint") != self.data_fp:
            raise ValueError(
                f"checkpoint {path} was written for different data than dataset "
                f"{config.dataset!r} loaded now (from {run.bundle.source!r}): resuming would mix "
                "two datasets in one privacy ledger. Point --data-dir at the data the run started "
                "with, or use another --checkpoint-dir")
        if "private" not in ck:
            raise ValueError(
                f"checkpoint {path} was written by an older dpclip (no private randomness "
                "state); it cannot be resumed: delete it or use another --checkpoint-dir")
        run.dp.load_state_dict(ck["private"])
        if run.scheduler is not None:  # the schedule continues where it stopped
            run.scheduler.load_state_dict(ck["lr_scheduler"])
        self.history = ck["history"]
        if "torch_rng" in ck:  # (a finished checkpoint has none: it resumes into no step)
            torch.set_rng_state(ck["torch_rng"])
        self.elapsed_before = ck["elapsed"]
        if run.is_main:
            print(f"dpclip: resumed from step {run.dp.steps} (epsilon so far "
                  f"{run.dp.epsilon():.4g})", file=sys.stderr)

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.t_start

    def save(self, finished: bool = False) -> None:
        if not self.writes:  # rank 0 writes; every rank resumes from its file
            return

        assert self.path is not None
        run = self.run
        make_private_dir(self.path.parent)  # owner-only
        ck = {
            "fingerprint": run.config.fingerprint(),
            "data_fingerprint": self.data_fp,  # PRIVATE (a hash of the data)
            "config": run.config.to_dict(),
            # PRIVATE: model, optimizer, strategy state, ledger and the secret generators
            "private": run.dp.state_dict(),
            "lr_scheduler": run.scheduler.state_dict() if run.scheduler is not None else None,
            "step": run.dp.steps,
            "history": self.history,
            "torch_rng": torch.get_rng_state(),
            "elapsed": self.elapsed(),
        }
        # a finished run keeps no secret generator state and no data fingerprint
        _atomic_save(finished_checkpoint(ck) if finished else ck, self.path)
        self.last_save = time.perf_counter()

    def save_if_due(self) -> None:
        """Between two epochs: a save every ``interval_s`` seconds."""
        if self.writes and time.perf_counter() - self.last_save > self.interval_s:
            self.save()

    def finish(self) -> None:
        if self.writes:  # finished (dpclip.training.checkpoint): drop the secrets

            self.save(finished=True)
            print(f"dpclip: {self.path}: {FINISHED_NOTE}", file=sys.stderr)


#: an evaluated epoch's row carries the run's wall time only when it covers this many steps since
#: the last row: with one or a few steps per epoch, the differences of ``wall_seconds`` were the
#: time of a step, which follows the realised (private) batch size (fifty-first hostile review)
MIN_TIMED_STEPS = 10


def _epoch_row(run: _Run, step: int, lr_used: float, wall_seconds: float | None,
               ms_per_step: float) -> dict[str, Any]:
    """The history row of an evaluated epoch: test accuracy and loss, epsilon, threshold, noise,
    learning rate; the opt-in diagnostics (``heldout/`` on the test split, or NON-PRIVATE
    ``nonprivate/`` on training examples)."""
    config, dp = run.config, run.dp
    spe = dp.steps_per_epoch
    ev = run.evaluate()
    row = {
        "epoch": (step - 1) // spe + 1,
        "step": step,
        "test_accuracy": ev["accuracy"],
        "test_loss": ev["loss"],
        "epsilon": dp.epsilon(),
        "clip_threshold": dp.clip_threshold,
        "noise_multiplier": dp.last_output.noise_multiplier if dp.last_output
        else dp.noise_multiplier,
        "lr": lr_used,  # the learning rate of the epoch's last step
        "wall_seconds": wall_seconds,
    }
    split = config.diagnostics_split
    if split == "train":  # NON-PRIVATE opt-in: a step's time depends on the realised (private)
        row["nonprivate/ms_per_step"] = ms_per_step  # batch size (docs/privacy.md, "Timing")
    if split and dp.unit.is_individual and not capabilities_of(dp.strategy).per_example_grads:

        if split == "test":  # held-out data: not the protected data
            idx = torch.arange(min(256, int(run.x_test.shape[0])), device=run.device)
            xd, yd, prefix = run.x_test[idx], run.y_test[idx], "heldout/"
        else:  # private training examples: NON-PRIVATE, only when asked for
            idx = torch.arange(min(256, run.n_train), device=run.device)
            xd, yd, prefix = run.x_train[idx], run.y_train[idx], "nonprivate/"
            if run.features is not None:  # images -> the model's coefficients
                xd = run.features.transform(xd)
        with private_buffer_guard(run.model, "diagnostics"):
            diag = nonprivate_diagnostics(run.model, cross_entropy_per_example, xd, yd,
                                          dp.strategy, dp.state, dp.groups)
        row.update({prefix + k.removeprefix("nonprivate/"): v for k, v in diag.items()})
    return row


def _summary(run: _Run, history: list[dict[str, Any]], wall_seconds: float,
             train_seconds: float) -> dict[str, Any]:
    """The public summary of a finished run."""

    config, dp = run.config, run.dp
    facts, spe = dp.describe(), dp.steps_per_epoch
    return {
        "dataset": config.dataset,
        "model": config.model,
        "strategy": config.strategy,
        **{k: facts[k] for k in ("params", "epsilon", "target_epsilon", "delta", "accountant",
                                 "adjacency", "sampling", "unit", "sensitivity_factor",
                                 "clip_groups")},
        "public_examples": 0 if run.x_pub is None else int(run.x_pub.shape[0]),
        "private_examples": run.n_train,
        "bn_stats": run.bn_mode if run.has_bn else None,
        **{k: facts[k] for k in ("noise_multiplier", "sample_rate", "expected_batch_size",
                                 "steps", "planned_steps")},
        "epochs": config.epochs,
        "epochs_completed": dp.steps / spe,
        "stopped_by_budget": facts["stopped_by_budget"],
        "test_accuracy": history[-1]["test_accuracy"],
        "lr": config.lr,
        "lr_schedule": describe_lr_schedule(config.lr_schedule, lr=config.lr,
                                            steps_per_epoch=spe, **run.lr_kwargs),
        "optimizer": config.optimizer,
        "seed": config.seed,
        **dp.rng.describe(),
        "diagnostics": {None: "off", "test": "test split",
                        "train": "training examples (NON-PRIVATE)"}[config.diagnostics_split],
        "preprocessing": {**(getattr(run.bundle, "preprocessing", None) or {}),
                          **({"release": facts["preprocess_release"]}
                             if facts["preprocess_release"] else {}),
                          **({"features": run.features.describe() + "; applied to each drawn "
                              "batch after its augmentation"} if run.features is not None
                             else {})},
        # the engine that ran (not the one requested: "auto" resolves per model and strategy)
        "engine": facts["engine"] if dp.engines_ran
        else (dp.engine.name if dp.unit.is_individual else "unit"),
        "engine_requested": config.engine,
        "engine_fallback": facts["engine_fallback"],
        "device": str(run.device),
        "distributed": facts.get("distributed"),
        "model_options": config.model_options,
        "augment": facts["augment"],
        "augment_multiplicity": facts["augment_multiplicity"],
        "averaging": facts["averaging"],
        "wall_seconds": wall_seconds,
        # seconds inside the steps of this call (sampling and step; no evaluation, calibration
        # or start-up): the figure to compare with another library's training loop
        "train_seconds": train_seconds,
    }


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

    The registries turn names into a dataset, a model and an optimizer; the private loop itself
    is :class:`dpclip.training.private.PrivateTraining`, the same object the own-model API
    returns (one path: the plan, calibration, budget, step, ledger and randomness are shared).
    This function adds evaluation, history, progress and checkpoints.

    ``stop_after_steps`` ends the process-local run early (for tests of resume); the checkpoint
    written then lets a later call continue.

    Ctrl-C (SIGINT) stops between two steps: the checkpoint is written (with ``checkpoint_dir``)
    and :class:`dpclip.interrupts.TrainingInterrupted` is raised; calling ``train`` again with the
    same config and directory resumes, saying ``resumed from step N (epsilon so far X)`` on
    stderr. ``on_start`` is called once every input has been checked, just before the first step
    (``dpclip train`` stores its run only then: a refused input leaves no row).
    """
    t_start = time.perf_counter()
    run = _build_run(config, data)
    dp, is_main = run.dp, run.is_main
    total_steps, spe = dp.total_steps, dp.steps_per_epoch
    ck = _Checkpointer(run, Path(checkpoint_dir) / "checkpoint.pt"
                       if checkpoint_dir is not None else None, checkpoint_interval_s, t_start)
    ck.resume()
    if dp.preprocess is not None:  # the release (made now, or the checkpoint's): post-processing
        run.x_test = dp.preprocess.apply(run.x_test)
        run.x_train = dp.preprocess.apply(run.x_train)  # only for NON-PRIVATE diagnostics
    history = ck.history
    bar = None
    if progress and is_main:
        from tqdm.auto import tqdm

        # epochs, with no rate or time: redrawn after every step, the bar's rate gave each step's
        # time, which follows the realised (private) batch size (corr 0.69 over 20 steps,
        # fifty-first hostile review; docs/privacy.md, "Timing")
        bar = tqdm(total=-(-total_steps // spe), initial=dp.steps // spe,
                   desc=f"{config.strategy}", unit="epoch", dynamic_ncols=True, leave=False,
                   bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} epochs"
                              "{postfix}")
    step_seconds = train_seconds = 0.0  # time inside steps (sampling + step)
    steps_in_epoch_timed = steps_this_call = 0
    if on_start is not None and is_main:
        on_start()
    while not dp.exhausted:
        if interrupt_requested() or (stop_after_steps is not None
                                     and steps_this_call >= stop_after_steps):
            ck.save()  # Ctrl-C: between two steps, so the checkpoint is one step's
            if bar is not None:
                bar.close()
            if interrupt_requested():
                raise TrainingInterrupted(dp.steps, total_steps, dp.epsilon(),
                                          ck.path if ck.writes else None)
            # public facts of the plan (stop_after_steps=0 gives the calibrated noise, no step)
            return RunResult({"interrupted": True, "step": dp.steps,
                              "noise_multiplier": dp.noise_multiplier,
                              "steps_per_epoch": spe, "private_examples": run.n_train},
                             history, dp.ledger, run.model)
        t_step = time.perf_counter()
        xb, yb = dp.sample()
        lr_used = run.optimizer.param_groups[0]["lr"]
        dp.step(xb, yb)
        if run.scheduler is not None:
            run.scheduler.step()
        step = dp.steps
        step_seconds += time.perf_counter() - t_step
        train_seconds += time.perf_counter() - t_step
        steps_in_epoch_timed += 1
        steps_this_call += 1
        epoch_end = step % spe == 0 or step == total_steps
        if bar is not None and epoch_end:
            bar.update(1)
        eval_due = step == total_steps or (config.eval_every > 0 and
                                           ((step - 1) // spe + 1) % config.eval_every == 0)
        if epoch_end and eval_due:
            # (a row that covers few steps would give their time: the realised batch sizes')
            row = _epoch_row(run, step, lr_used,
                             ck.elapsed() if steps_in_epoch_timed >= MIN_TIMED_STEPS else None,
                             1000.0 * step_seconds / max(steps_in_epoch_timed, 1))
            history.append(row)
            if bar is not None:
                bar.set_postfix(acc=f"{row['test_accuracy']:.4f}", eps=f"{row['epsilon']:.3f}")
            if on_epoch is not None and is_main:
                on_epoch(row)
        if epoch_end:  # --eval-every: a checkpoint every epoch, evaluated or not
            step_seconds, steps_in_epoch_timed = (0.0, 0) if eval_due else (
                step_seconds, steps_in_epoch_timed)
            ck.save()
        else:
            ck.save_if_due()
    if bar is not None:
        bar.close()
    step = dp.steps
    if not history or history[-1]["step"] != step:
        ev = run.evaluate()
        history.append({
            "epoch": step / spe, "step": step, "test_accuracy": ev["accuracy"],
            "test_loss": ev["loss"], "epsilon": dp.epsilon(),
            "clip_threshold": dp.clip_threshold, "noise_multiplier": dp.noise_multiplier,
            "wall_seconds": ck.elapsed(),
        })
        ck.save()
    ck.finish()
    summary = _summary(run, history, ck.elapsed(), train_seconds)
    # the released model: the averaged weights when averaging is on (what was evaluated)
    return RunResult(summary, history, dp.ledger,
                     dp.averaged_model() if dp.averager is not None else run.model)
