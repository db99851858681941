"""Lin et al.'s greedy per-epoch threshold search (Algorithm 1), with checkpoint and resume.

For each epoch ``t``, starting from the model AND optimizer state of epoch ``t-1``'s best
candidate, candidate thresholds ``C = C_start, C_start + d, ...`` are each trained for ONE epoch of
DP-SGD with fixed clipping at ``C`` and noise ``sigma C``; each candidate is scored by accuracy on
held-out data (the dataset's test split, as Lin et al.), the best is kept, and the loop stops when
the last accuracy falls MORE than ``S`` below the best so far (not at the first decrease)::

    C <- C_start; A <- 0; A_best <- 0; C_t <- C; theta_t <- theta_{t-1}
    while A_best - A <= S:
        theta <- theta_{t-1} trained one epoch with clip C   (copy of model and optimizer)
        A <- accuracy(theta)
        if A > A_best: A_best, C_t, theta_t <- A, C, theta
        C <- C + d
    return C_t, theta_t

Privacy: NONE on the data it runs on (many trainings and a selection on held-out data). It emits no
ledger and no epsilon. It therefore refuses a dataset that is not public
(``DatasetEntry.is_public``, or the declared public proxy of ``proxy_for``, see
``dpclip.data.PUBLIC_PROXIES``), a proxy that shares provenance with ``proxy_for`` (mnist-5k for
mnist) and a user-supplied bundle not itself declared public, unless
``allow_private_data=True``; the result's metadata then
says ``"privacy": "NON-PRIVATE"``. Its thresholds are public when the data is: the Transfer and
Decay strategies replay them on a private dataset at no privacy cost.

Randomness: all candidates of one epoch share the same batches, noise draws (scaled by their own
``C``) and torch RNG (common random numbers, seeded from ``(seed, epoch)``), so candidates differ
only by their threshold; a search is reproducible from its seed, and a killed search resumed from
its checkpoint (written atomically after every candidate) ends with the same thresholds.

``steps_per_epoch`` (optional) makes one search "epoch" that many steps, to match the epoch
length of the private run when the public proxy is smaller (mnist-5k: 4,000 examples vs 60,000).

Reference: Lin, Yan, Kou, Huang, Peng, Zhang, Dong, "Understanding adaptive gradient clipping in
DP-SGD, empirically", Int. J. Intell. Syst. 2022, Algorithm 1 (algorithms.md M8). Defaults
``C_start = 0.05, d = 0.01, S = 0.02`` (MNIST, FMNIST, CIFAR-10).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from dpclip import __version__
from dpclip.clipping import FixedClip
from dpclip.data import (
    DATASETS,
    PUBLIC_PROXIES,
    ProxyOverlapError,
    check_proxy_pair,
    is_public_proxy,
    load_dataset,
    provenance,
)
from dpclip.engine import ParamGroups, get_engine
from dpclip.models import build_model
from dpclip.noise import make_generator
from dpclip.training.checkpoint import atomic_private_save, make_private_dir
from dpclip.training.config import DictFields
from dpclip.training.plan import CLI_FLAGS, Plan, resolve_noise
from dpclip.training.sampling import make_sampler
from dpclip.training.step import dp_step
from dpclip.training.trainer import (
    TrainConfig,
    cross_entropy_per_example,
    evaluate,
    make_optimizer,
    resolve_device,
)

__all__ = [
    "Evaluator",
    "GreedyConfig",
    "GreedyResult",
    "PrivateDataError",
    "candidate_threshold",
    "check_public",
    "default_schedule_name",
    "greedy_search",
    "search_noise_multiplier",
]

#: ``evaluator(model, epoch, clip_norm) -> accuracy in [0, 1]`` (epoch 1-based); the default is
#: the accuracy on the dataset's test split.
Evaluator = Callable[[nn.Module, int, float], float]


class PrivateDataError(ValueError):
    """The greedy search was asked to run on a dataset that is not public."""


@dataclass(frozen=True)
class GreedyConfig(DictFields):
    """The public description of one greedy search (Lin et al. Algorithm 1)."""

    dataset: str
    model: str
    noise_multiplier: float  #: sigma of the private run the schedule is for
    batch_size: float  #: expected batch size (Poisson) or exact size (fixed-size)
    lr: float
    epochs: int = 1
    c_start: float = 0.05
    step: float = 0.01  #: d
    tolerance: float = 0.02  #: S, in accuracy units (fraction in [0, 1])
    #: safety cap on candidates per epoch (Algorithm 1 has none); reaching it is recorded and warned
    max_candidates: int = 1000
    #: steps of one search epoch (default: the dataset's own epoch, round(n / batch_size))
    steps_per_epoch: int | None = None
    seed: int = 0
    optimizer: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 0.0
    sampling: str = "poisson"
    engine: str = "auto"
    max_physical_batch: int | None = None  # None: the engine's own (TrainConfig's field)
    eval_batch_size: int = 2048
    model_options: dict[str, Any] = field(default_factory=dict)
    dataset_options: dict[str, Any] = field(default_factory=dict)
    #: the private dataset this search is a public proxy for (a PUBLIC_PROXIES pair makes the
    #: proxy public for that purpose, e.g. fashion-mnist for mnist)
    proxy_for: str | None = None
    #: run on a dataset marked private anyway (explicit; the schedule is then marked NON-PRIVATE)
    allow_private_data: bool = False
    data_dir: str | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"GreedyConfig: {name} {why}, got {getattr(self, name)!r}")

        for name in ("noise_multiplier",):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise bad(name, "must be a finite number >= 0 (the private run's sigma)")
        for name in ("batch_size", "lr", "c_start", "step"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise bad(name, "must be a finite number > 0")
        for name in ("noise_multiplier", "batch_size", "lr", "c_start", "step", "tolerance",
                     "momentum", "weight_decay"):  # 128 and 128.0 are the same search
            v = getattr(self, name)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                object.__setattr__(self, name, float(v))
        if not (isinstance(self.tolerance, (int, float)) and 0 <= self.tolerance < 1):
            raise bad("tolerance", "must be in [0, 1) (accuracy units, Lin et al.: 0.02)")
        if not (isinstance(self.epochs, int) and self.epochs >= 1):
            raise bad("epochs", "must be an int >= 1")
        if not (isinstance(self.max_candidates, int) and self.max_candidates >= 1):
            raise bad("max_candidates", "must be an int >= 1")
        if self.steps_per_epoch is not None and not (
            isinstance(self.steps_per_epoch, int) and self.steps_per_epoch >= 1
        ):
            raise bad("steps_per_epoch", "must be None or an int >= 1")

    def fingerprint(self) -> str:
        """Hash of what determines the thresholds (not data_dir, device, the override flag)."""
        d = self.to_dict()
        for k in ("data_dir", "device", "allow_private_data"):
            d.pop(k, None)
        # a memory knob (the thresholds do not change): hashed at its default before 0.3, so
        # that stored searches keep their names and checkpoints
        d["max_physical_batch"] = 256
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class GreedyResult:
    """Per-epoch thresholds, the best accuracy of each epoch and every candidate tried."""

    thresholds: list[float]
    accuracies: list[float]
    #: one row per candidate: epoch (1-based), index, clip_norm, accuracy, improved, digests
    candidates: list[dict[str, Any]]
    metadata: dict[str, Any]
    model: nn.Module | None = None  #: the final epoch's best model (None when interrupted)
    interrupted: bool = False


def candidate_threshold(c_start: float, step: float, k: int) -> float:
    """``C_start + k d``, rounded to 12 significant digits (no 0.060000000000000005)."""
    return float(f"{c_start + k * step:.12g}")


def default_schedule_name(config: GreedyConfig) -> str:
    """A readable, unique store name: dataset, model, sigma, batch, lr, epochs, seed, hash."""
    return (f"greedy-{config.dataset}-{config.model}-z{config.noise_multiplier:.4g}"
            f"-b{config.batch_size:g}-lr{config.lr:g}-e{config.epochs}-s{config.seed}"
            f"-{config.fingerprint()[:8]}")


def search_noise_multiplier(
    epsilon: float,
    delta: float,
    *,
    batch_size: float,
    epochs: int,
    dataset_size: int,
    sampling: str = "poisson",
    accountant: str = "pld",
) -> float:
    """The noise multiplier of the PRIVATE run the search is for: ``sigma`` such that ``epochs``
    epochs of DP-SGD with fixed clipping (Gaussian steps; also fixed/transfer/lin-decay) on a
    dataset of ``dataset_size`` examples at ``batch_size`` meet ``(epsilon, delta)``. Computed with
    the trainer's own plan and calibration, so it equals the sigma ``dpclip train --epsilon``
    uses for such a run."""

    TrainConfig(epsilon=epsilon, delta=delta, batch_size=batch_size, epochs=epochs,
                sampling=sampling, accountant=accountant)  # the same validation as a run
    sampler = make_sampler(sampling, int(dataset_size), batch_size)
    plan = Plan(FixedClip(), sampler, epochs * sampler.steps_per_epoch)
    return float(resolve_noise(plan, epsilon=epsilon, noise_multiplier=None, delta=delta,
                               accountant=accountant, flags=CLI_FLAGS))


def _digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def _derived_seed(seed: int, epoch: int, what: str) -> int:
    raw = hashlib.sha256(f"dpclip-greedy:{seed}:{epoch}:{what}".encode()).digest()
    return int.from_bytes(raw[:7], "little")


def _cpu_state(sd: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of a state dict with every tensor on the CPU."""
    def conv(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().to("cpu", copy=True)
        if isinstance(x, dict):
            return {k: conv(v) for k, v in x.items()}
        if isinstance(x, list):
            return [conv(v) for v in x]
        return x

    return conv(sd)


def check_public(config: GreedyConfig, data: Any = None) -> str:
    """``"public"`` / ``"public proxy for X"``, or raise ``PrivateDataError``; with
    ``allow_private_data`` a private dataset gives ``"NON-PRIVATE"``.

    Checks, in order: the dataset is registered; with ``proxy_for``, the dataset shares no
    provenance with it (``dpclip.data.check_proxy_pair``: ``mnist-5k`` is drawn from MNIST, so it
    is public but no proxy for ``mnist``); a user-supplied bundle ``data`` is the dataset named by
    ``config.dataset`` (same name), shares no provenance with ``proxy_for`` either (its own
    ``derived_from``) and is itself declared public (``data.is_public``): the bundle is what the
    search reads, so the registry's word for the name is not enough.
    """

    if config.dataset not in DATASETS:
        raise ValueError(f"unknown dataset {config.dataset!r}; valid datasets: "
                         f"{', '.join(sorted(DATASETS))}")
    if data is not None:
        name = getattr(data, "name", None)
        if name != config.dataset:
            raise ValueError(
                f"greedy_search: data is the bundle {name!r} but config.dataset is "
                f"{config.dataset!r}; pass the bundle of the configured dataset (or set "
                "config.dataset to the bundle's name)"
            )
    overlap = None
    if config.proxy_for is not None:
        try:
            check_proxy_pair(config.dataset, config.proxy_for)
            if data is not None:
                check_proxy_pair(config.dataset, config.proxy_for,
                                 tuple(getattr(data, "derived_from", ()) or ()))
        except ProxyOverlapError as exc:
            overlap = str(exc)
    if overlap is None:
        if data is not None:
            if bool(getattr(data, "is_public", False)):
                return "public" if config.proxy_for is None \
                    else f"public proxy for {config.proxy_for}"
        elif DATASETS[config.dataset].is_public:
            return "public" if config.proxy_for is None \
                else f"public proxy for {config.proxy_for}"
        elif is_public_proxy(config.dataset, config.proxy_for):
            return f"public proxy for {config.proxy_for}"
    if config.allow_private_data:
        return "NON-PRIVATE"
    if overlap is not None:
        raise PrivateDataError(
            f"the greedy threshold search is not differentially private, and its thresholds "
            f"would be replayed on {config.proxy_for!r}: {overlap}. Pass another proxy, or "
            "allow_private_data=True (--nonprivate-search) for an explicitly NON-PRIVATE analysis"
        )
    if data is not None:
        raise PrivateDataError(
            f"greedy_search: the bundle passed as data ({config.dataset!r}, source "
            f"{getattr(data, 'source', '?')!r}) is not declared public (is_public=False): the "
            "greedy search is not differentially private and may only read public data. Build "
            "the bundle with is_public=True if it is public, or pass allow_private_data=True "
            "(--nonprivate-search) for an explicitly NON-PRIVATE analysis"
        )
    public = sorted(n for n, e in DATASETS.items() if e.is_public)
    pairs = ", ".join(f"{p} for {k}" for k, v in sorted(PUBLIC_PROXIES.items()) for p in v)
    raise PrivateDataError(
        f"the greedy threshold search is not differentially private: it trains many times and "
        f"selects on held-out data, so it may only run on public data, and dataset "
        f"{config.dataset!r} is marked private. Run it on a public dataset ({', '.join(public)}) "
        f"or a declared public proxy ({pairs}; pass proxy_for / --proxy-for), or, for an "
        f"analysis that is explicitly NOT private, pass allow_private_data=True "
        f"(--nonprivate-search): its schedule is then marked NON-PRIVATE and must not be "
        f"replayed on that data as if it were private"
    )


def _save_checkpoint(ck: dict[str, Any], path: Path) -> None:
    """The search's checkpoint, written as the trainer's are: ``0700`` directory, ``0600`` file,
    atomically (:func:`dpclip.training.checkpoint.atomic_private_save`). It holds the generator
    seeds' effects and, with ``allow_private_data``, models trained on private data."""

    make_private_dir(path.parent)
    atomic_private_save(ck, path)


def _new_checkpoint(config: GreedyConfig, start: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint of a search that has not tried any candidate yet (``start``: theta_0)."""
    return {
        "fingerprint": config.fingerprint(),
        "config": config.to_dict(),
        "epoch": 0,  # 0-based epoch being searched
        "k": 0,  # next candidate index in this epoch
        "start": start,  # theta_{t-1} (model and optimizer)
        "best": {"clip_norm": config.c_start, "accuracy": 0.0, **start},
        "last_accuracy": 0.0,
        "thresholds": [],
        "accuracies": [],
        "capped": [],
        "candidates": [],
        "elapsed": 0.0,
        "done": False,
    }


class _Search:
    """One greedy search: the data, the sampler and engine, the checkpoint ``ck`` (the whole
    search state: every step below reads and writes it, and it is saved after every candidate).

    Candidates are trained with ``dp_step`` directly, not through ``PrivateTraining``: every
    candidate of epoch ``t`` must replay the same batches, noise and torch RNG (common random
    numbers seeded from ``(seed, t)``) starting at step ``t * steps_per_epoch`` from the best
    model AND optimizer state of epoch ``t - 1``, which ``PrivateTraining`` (one random stream per
    run, derived from its seed, starting at step 0 with a fresh plan) does not offer; going
    through it would change every threshold already published (issue 34: results do not move).
    """

    def __init__(self, config: GreedyConfig, data: Any, evaluator: Evaluator | None,
                 checkpoint_dir: str | os.PathLike | None) -> None:
        self.config = config
        self.t_start = time.perf_counter()
        bundle = data if data is not None else load_dataset(
            config.dataset, config.data_dir, seed=config.seed, **config.dataset_options
        )
        self.bundle = bundle
        derived = tuple(getattr(bundle, "derived_from", ()) or ())
        self.searched_provenance = sorted(provenance(config.dataset) | set(derived))
        self.device = device = resolve_device(config.device)
        self.x_train, self.y_train = bundle.train.inputs.to(device), bundle.train.targets.to(device)
        self.x_test, self.y_test = bundle.test.inputs.to(device), bundle.test.targets.to(device)
        self.sampler = make_sampler(config.sampling, int(self.x_train.shape[0]), config.batch_size)
        self.spe = config.steps_per_epoch or self.sampler.steps_per_epoch
        self.engine = get_engine(config.engine, **(
            {} if config.max_physical_batch is None else
            {"max_physical_batch": config.max_physical_batch})) \
            if config.engine in ("vmap", "naive", "ghost", "auto") else get_engine(config.engine)
        self.evaluator = evaluator or self._test_accuracy
        self.ckpt_path = Path(checkpoint_dir) / "greedy.pt" if checkpoint_dir is not None else None
        self.ck = self._load_or_start()
        self.elapsed_before = float(self.ck["elapsed"])

    def _test_accuracy(self, model: nn.Module, epoch: int, clip_norm: float) -> float:
        return float(evaluate(model, self.x_test, self.y_test,
                              self.config.eval_batch_size)["accuracy"])

    def fresh(self) -> tuple[nn.Module, Any]:
        """A newly built model (on the device, train mode) and its optimizer."""

        c = self.config
        m = build_model(c.model, self.bundle.input_shape, self.bundle.num_classes,
                        **c.model_options).to(self.device)
        m.train()
        params = [p for p in m.parameters() if p.requires_grad]
        return m, make_optimizer(c.optimizer, params, c.lr, c.momentum, c.weight_decay)

    def _load_or_start(self) -> dict[str, Any]:
        path, config = self.ckpt_path, self.config
        if path is not None and path.exists():
            ck = torch.load(path, weights_only=False, map_location="cpu")
            if ck["fingerprint"] != config.fingerprint():
                raise ValueError(
                    f"checkpoint {path} belongs to a different search configuration; use "
                    "another --checkpoint-dir or delete it"
                )
            return ck
        torch.manual_seed(config.seed)
        m0, o0 = self.fresh()
        return _new_checkpoint(config, {"model": _cpu_state(m0.state_dict()),
                                        "optimizer": _cpu_state(o0.state_dict()),
                                        "digest": _digest(m0)})

    def save(self) -> None:
        if self.ckpt_path is not None:
            self.ck["elapsed"] = self.elapsed_before + time.perf_counter() - self.t_start
            _save_checkpoint(self.ck, self.ckpt_path)

    def train_candidate(self, start: dict[str, Any], epoch: int,
                        clip: float) -> tuple[nn.Module, Any]:
        """One epoch of DP-SGD with ``FixedClip(clip)`` from ``start`` (common random numbers)."""

        config, spe, sampler = self.config, self.spe, self.sampler
        z = float(config.noise_multiplier)
        model, opt = self.fresh()
        model.load_state_dict(start["model"])
        opt.load_state_dict(start["optimizer"])
        strategy = FixedClip(clip)
        plan = Plan(strategy, sampler, config.epochs * spe, steps_per_epoch=spe)
        state = strategy.init_state()
        groups = ParamGroups.flat(model)
        sample_gen = make_generator(_derived_seed(config.seed, epoch, "sample"))
        noise_gen = make_generator(_derived_seed(config.seed, epoch, "noise"))
        torch.manual_seed(_derived_seed(config.seed, epoch, "torch"))
        for i in range(spe):
            idx = sampler.sample(sample_gen).to(self.device)
            out = dp_step(model, self.x_train[idx], self.y_train[idx],
                          loss_fn=cross_entropy_per_example, strategy=strategy, state=state,
                          engine=self.engine, groups=groups, sampler=sampler,
                          base_noise_multiplier=z, ctx=plan.ctx(epoch * spe + i, z),
                          generator=noise_gen)
            for name, p in model.named_parameters():
                if p.requires_grad:
                    p.grad = out.grads[name]
            opt.step()
            opt.zero_grad(set_to_none=True)
            state = out.state
        return model, opt

    def epoch_over(self) -> bool:
        """Algorithm 1's stop rule: the last accuracy fell MORE than S below the best (or the
        candidate cap is reached)."""
        ck, c = self.ck, self.config
        return ck["best"]["accuracy"] - ck["last_accuracy"] > c.tolerance or \
            ck["k"] >= c.max_candidates

    def close_epoch(self) -> None:
        """theta_t, C_t = the best candidate; the next epoch starts from it."""
        ck, config = self.ck, self.config
        t, best = ck["epoch"], ck["best"]
        capped = ck["k"] >= config.max_candidates and \
            best["accuracy"] - ck["last_accuracy"] <= config.tolerance
        if capped:
            warnings.warn(
                f"greedy search epoch {t + 1}: stopped at max_candidates="
                f"{config.max_candidates} before accuracy fell more than S below the best; "
                "raise max_candidates or the step d", stacklevel=3)
        ck["thresholds"].append(best["clip_norm"])
        ck["accuracies"].append(best["accuracy"])
        ck["capped"].append(bool(capped))
        ck["start"] = {k: best[k] for k in ("model", "optimizer", "digest")}
        ck["best"] = {"clip_norm": config.c_start, "accuracy": 0.0, **ck["start"]}
        ck["last_accuracy"] = 0.0
        ck["k"] = 0
        ck["epoch"] = t + 1
        ck["done"] = ck["epoch"] >= config.epochs
        self.save()

    def try_candidate(self) -> tuple[float, float]:
        """Train and score the next candidate of the epoch; returns ``(clip, accuracy)``."""
        ck, t, k = self.ck, self.ck["epoch"], self.ck["k"]
        clip = candidate_threshold(self.config.c_start, self.config.step, k)
        model, opt = self.train_candidate(ck["start"], t, clip)
        acc = float(self.evaluator(model, t + 1, clip))
        improved = acc > ck["best"]["accuracy"]
        digest = _digest(model)
        ck["candidates"].append({
            "epoch": t + 1, "index": k, "clip_norm": clip, "accuracy": acc,
            "improved": improved, "start_digest": ck["start"]["digest"], "digest": digest,
        })
        if improved:
            ck["best"] = {"clip_norm": clip, "accuracy": acc, "digest": digest,
                          "model": _cpu_state(model.state_dict()),
                          "optimizer": _cpu_state(opt.state_dict())}
        ck["last_accuracy"] = acc
        ck["k"] = k + 1
        self.save()
        return clip, acc

    def metadata(self, privacy: str) -> dict[str, Any]:
        """The public description of the finished search (stored with its schedule)."""

        config, ck = self.config, self.ck
        return {
            "kind": "lin-greedy",
            "dataset": config.dataset,
            "model": config.model,
            "noise_multiplier": config.noise_multiplier,
            "batch_size": config.batch_size,
            "lr": config.lr,
            "epochs": config.epochs,
            "seed": config.seed,
            "steps_per_epoch": self.spe,
            "c_start": config.c_start,
            "step": config.step,
            "tolerance": config.tolerance,
            "privacy": privacy,
            "nonprivate": privacy == "NON-PRIVATE",
            "proxy_for": config.proxy_for,
            # the example collections the searched data is drawn from: a schedule may not be
            # replayed on a private dataset that shares one (dpclip.search.resolve)
            "provenance": self.searched_provenance,
            "best_accuracies": list(ck["accuracies"]),
            "candidates_per_epoch": [sum(1 for c in ck["candidates"] if c["epoch"] == e + 1)
                                     for e in range(config.epochs)],
            "capped_epochs": [e + 1 for e, c in enumerate(ck["capped"]) if c],
            "fingerprint": config.fingerprint(),
            "config": {k: v for k, v in config.to_dict().items()
                       if k not in ("data_dir", "device")},
            "wall_seconds": self.elapsed_before + time.perf_counter() - self.t_start,
            "dpclip_version": __version__,
            "note": "selection on held-out data: not differentially private on the searched "
                    "data; no epsilon",
        }


def greedy_search(
    config: GreedyConfig,
    *,
    data: Any = None,
    evaluator: Evaluator | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    progress: bool = True,
    stop_after_candidates: int | None = None,
) -> GreedyResult:
    """Run Lin et al.'s Algorithm 1 for ``config.epochs`` epochs (see the module docstring).

    ``data`` (a ``DatasetBundle``) replaces loading ``config.dataset`` (tests); it must carry
    the configured dataset's name and be declared public itself (``is_public``, and no provenance
    shared with ``proxy_for``), else ``PrivateDataError`` (see :func:`check_public`); ``evaluator``
    replaces the test-split accuracy. With ``checkpoint_dir`` the search writes
    ``greedy.pt`` (owner-only, atomically) after every candidate and resumes from it when started
    again with the same config; ``stop_after_candidates`` ends this call early after that many
    candidates (for tests of resume), returning an ``interrupted`` result.

    Raises ``PrivateDataError`` on a private dataset unless ``config.allow_private_data``.
    """
    privacy = check_public(config, data)
    search = _Search(config, data, evaluator, checkpoint_dir)
    ck = search.ck
    bar: Any = None
    if progress and not ck["done"]:
        from tqdm.auto import tqdm

        bar = tqdm(desc=f"greedy {config.dataset} epoch {ck['epoch'] + 1}/{config.epochs}",
                   unit="cand", dynamic_ncols=True, leave=False)
    ran = 0
    while not ck["done"]:
        if search.epoch_over():
            search.close_epoch()
            if bar is not None and not ck["done"]:
                bar.set_description(f"greedy {config.dataset} epoch {ck['epoch'] + 1}/"
                                    f"{config.epochs}")
            continue
        if stop_after_candidates is not None and ran >= stop_after_candidates:
            search.save()
            if bar is not None:
                bar.close()
            return GreedyResult(list(ck["thresholds"]), list(ck["accuracies"]),
                                list(ck["candidates"]), {}, None, interrupted=True)
        clip, acc = search.try_candidate()
        ran += 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(C=f"{clip:g}", acc=f"{acc:.4f}",
                            best=f"{ck['best']['clip_norm']:g}@{ck['best']['accuracy']:.4f}")
    if bar is not None:
        bar.close()
    final, _ = search.fresh()
    final.load_state_dict(ck["start"]["model"])
    return GreedyResult(list(ck["thresholds"]), list(ck["accuracies"]),
                        list(ck["candidates"]), search.metadata(privacy), final)
