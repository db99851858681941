"""Threshold schedules as stored artifacts, and their resolution at the CLI/harness boundary.

Strategies do no I/O, so two strategy parameters that name stored or computed data are resolved
here, before a run starts, into plain numbers recorded in the run's config and params:

* ``transfer`` with ``schedule = "NAME"`` (and no ``thresholds``): the thresholds of the stored
  schedule ``NAME`` (``dpclip schedules``). A schedule whose metadata says NON-PRIVATE (searched
  on private data) is refused: replaying it would not be private.
* ``transfer`` with ``schedule = "greedy"``: Lin's greedy search is run (once; stored and reused
  by name) on the public proxy of the run's dataset (``schedule_proxy``, default
  ``dpclip.data.public_proxy(dataset)``) in the run's own setting: its model, batch size,
  learning rate, optimizer and noise multiplier (calibrated from its epsilon when not given),
  search epochs as long as the private epochs, and ``schedule_epochs`` epochs (default: all of the
  run's epochs, so a 40-epoch run gets a 40-epoch schedule). With ``schedule_epochs`` below the
  run's epochs the policy beyond the schedule is Transfer's own: the last threshold is kept
  (recorded, and warned about). ``C_start, d, S`` are Lin's 0.05, 0.01, 0.02 unless
  ``schedule_c_start``, ``schedule_step``, ``schedule_tolerance``; ``schedule`` becomes the stored
  search's name.
* ``lin-decay`` with ``c0_from = "greedy"`` (and no ``clip_norm``): ``C0`` = the mean of the
  first-epoch greedy thresholds of ``c0_runs`` (default 5) one-epoch greedy searches, seeds
  ``0..c0_runs-1``, on the public proxy of the run's dataset (``c0_proxy``, default
  ``dpclip.data.public_proxy(dataset)``), with the run's model, batch size, learning rate,
  optimizer and noise multiplier (calibrated from its epsilon when not given), one search epoch
  as long as one epoch of the private run, Lin's ``C_start, d, S = 0.05, 0.01, 0.02`` (or
  ``c0_c_start``, ``c0_step``, ``c0_tolerance``). Each search is stored (and reused) by name in the
  results store; ``c0_from`` becomes ``"greedy:<proxy>:<runs> runs:<name of seed 0>"``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import warnings
from pathlib import Path
from typing import Any

from dpclip.search.greedy import (
    GreedyConfig,
    GreedyResult,
    default_schedule_name,
    greedy_search,
    search_noise_multiplier,
)

__all__ = [
    "C0_RESOLVER_KEYS",
    "greedy_c0",
    "private_noise_multiplier",
    "resolve_strategy_params",
    "run_or_reuse",
    "same_checkpoint",
    "same_search",
    "save_search",
]

#: lin-decay parameters consumed by the resolver (not strategy fields)
C0_RESOLVER_KEYS = ("c0_proxy", "c0_runs", "c0_c_start", "c0_step", "c0_tolerance")
#: transfer parameters consumed by the resolver with schedule = "greedy"
SCHEDULE_RESOLVER_KEYS = ("schedule_proxy", "schedule_epochs", "schedule_c_start",
                          "schedule_step", "schedule_tolerance")


def save_search(store: Any, name: str, result: GreedyResult) -> None:
    """Store a finished search's thresholds with its metadata and candidates under ``name``."""
    if result.interrupted:
        raise ValueError("save_search: the search was interrupted; resume it first")
    store.save_schedule(name, result.thresholds,
                        {**result.metadata, "name": name, "candidates": result.candidates})


def run_or_reuse(
    config: GreedyConfig,
    store: Any,
    *,
    name: str | None = None,
    checkpoint_root: str | os.PathLike | None = None,
    progress: bool = True,
    data: Any = None,
) -> tuple[str, list[float], dict[str, Any]]:
    """The stored schedule ``name`` of this search config, running (and storing) it if absent.

    A stored schedule of the same name from another config is an error (choose another name).
    Without ``name``, a stored search that differs from ``config`` only by the noise multiplier's
    calibration round-off is reused (``same_search``), and so is an unfinished one: a checkpoint
    under ``checkpoint_root`` of such a search (from another machine's image) is resumed under its
    own name and noise multiplier (``same_checkpoint``) rather than restarted.
    The search checkpoints into ``<checkpoint_root>/<name>`` and resumes from there.
    """
    if name is None:
        name = default_schedule_name(config)
        if not store.has_schedule(name):
            same = same_search(store.schedules(), config)
            if same is not None:
                return same["name"], same["thresholds"], same["metadata"]
            if checkpoint_root is not None and not (Path(checkpoint_root) / _safe(name)).exists():
                adopted = same_checkpoint(Path(checkpoint_root), config)
                if adopted is not None:
                    config, name = adopted, default_schedule_name(adopted)
    if store.has_schedule(name):
        thresholds, meta = store.schedule(name)
        if meta.get("fingerprint") != config.fingerprint():
            raise ValueError(
                f"a different schedule named {name!r} is already stored in {store.path} "
                f"(from {meta.get('dataset')}/{meta.get('model')}, seed {meta.get('seed')}); "
                "choose another --name"
            )
        return name, thresholds, meta
    ck = Path(checkpoint_root) / _safe(name) if checkpoint_root is not None else None
    result = greedy_search(config, checkpoint_dir=ck, progress=progress, data=data)
    save_search(store, name, result)
    thresholds, meta = store.schedule(name)
    return name, thresholds, meta


from dpclip.training.plan import NOISE_MATCH_RTOL  # noqa: E402 - the one calibration tolerance
from dpclip.data import (
    DATASETS,
    ProxyOverlapError,
    check_proxy_pair,
    load_dataset,
    provenance,
    public_proxy,
)
from dpclip.store import ResultsStore
from dpclip.training.sampling import make_sampler


def same_search(stored: list[dict[str, Any]], config: GreedyConfig) -> dict[str, Any] | None:
    """A stored greedy search (a row of ``ResultsStore.schedules()``) of ``config`` whose noise
    multiplier differs from ``config``'s only by calibration round-off, or None.

    A search runs at the noise multiplier its private run calibrates, whose last digits depend on
    the numerical libraries (seen: 1.4692802216793703 on a GPU image against 1.46928022153966 on
    this CPU image, 1e-10 relative). The exact fingerprint would then miss a finished search and
    rerun it (about 2,000 steps per epoch searched). The search reads public data only and is not
    accounted, so a search within ``NOISE_MATCH_RTOL`` is the same search; every other field of
    the config must be equal."""
    z, want = _search_key(config.to_dict())
    for row in stored:
        meta = row.get("metadata") or {}
        if meta.get("kind") != "lin-greedy" or not isinstance(meta.get("config"), dict):
            continue
        zh, have = _search_key(meta["config"])
        if have == want and _same_noise(zh, z):
            return row
    return None


def _search_key(d: dict[str, Any]) -> tuple[float | None, str]:
    """(noise multiplier, every other field that determines the thresholds) of a search config."""
    d = dict(d)
    z = d.pop("noise_multiplier", None)
    for k in ("data_dir", "device", "allow_private_data"):
        d.pop(k, None)
    return (None if z is None else float(z)), json.dumps(d, sort_keys=True, default=str)


def _same_noise(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and abs(a - b) <= NOISE_MATCH_RTOL * max(b, 1e-300)


def same_checkpoint(checkpoint_root: Path, config: GreedyConfig) -> GreedyConfig | None:
    """The config of an unfinished search checkpointed under ``checkpoint_root`` (a folder per
    search, ``greedy.pt`` inside) that is ``config`` up to the noise multiplier's calibration
    round-off, with ``config``'s machine fields (device, data_dir, the override flag); or None.

    Such a checkpoint (seen: a search started on a GPU image and resumed on the CPU) has another
    fingerprint, so its folder name differs and the search would restart from its first epoch.
    Resuming it under its own noise multiplier keeps one search with one sigma (the search reads
    public data only and is not accounted)."""
    import torch

    z, want = _search_key(config.to_dict())
    for ck_path in sorted(checkpoint_root.glob("*/greedy.pt")):
        try:
            ck = torch.load(ck_path, weights_only=False, map_location="cpu")
        except Exception:  # noqa: BLE001 - a torn or foreign file is not this search
            continue
        cfg = ck.get("config") if isinstance(ck, dict) else None
        if not isinstance(cfg, dict):
            continue
        zh, have = _search_key(cfg)
        if have != want or not _same_noise(zh, z):
            continue
        mine = config.to_dict()
        adopted = GreedyConfig.from_dict(
            {**cfg, **{k: mine[k] for k in ("data_dir", "device", "allow_private_data")}})
        if ck_path.parent.name == _safe(default_schedule_name(adopted)):
            return adopted
    return None


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in name)


def _private_size(config: Any) -> int:
    bundle = load_dataset(config.dataset, config.data_dir, seed=config.seed,
                          **config.dataset_options)
    return int(bundle.train.inputs.shape[0])


def private_noise_multiplier(config: Any, dataset_size: int | None = None) -> float:
    """The noise multiplier of private run ``config`` (a ``TrainConfig``): its
    ``noise_multiplier`` when given, else calibrated from its epsilon for Gaussian steps
    (fixed / transfer / lin-decay) on its dataset (``dataset_size`` or the loaded train split)."""
    if config.noise_multiplier is not None:
        return float(config.noise_multiplier)
    n = dataset_size if dataset_size is not None else _private_size(config)
    return search_noise_multiplier(config.epsilon, config.delta, batch_size=config.batch_size,
                                   epochs=config.epochs, dataset_size=n,
                                   sampling=config.sampling, accountant=config.accountant)


def greedy_c0(
    config: Any,
    store: Any,
    *,
    proxy: str | None = None,
    runs: int = 5,
    checkpoint_root: str | os.PathLike | None = None,
    progress: bool = True,
    dataset_size: int | None = None,
    c_start: float = 0.05,
    step: float = 0.01,
    tolerance: float = 0.02,
) -> tuple[float, list[str], list[float]]:
    """Lin et al.'s Decay ``C0`` for private run ``config``: the mean first-epoch greedy threshold
    of ``runs`` one-epoch searches (seeds 0..runs-1) on the public proxy. Returns ``(C0, schedule
    names, the first-epoch thresholds)``; the searches are stored in (and reused from) ``store``."""
    if not (isinstance(runs, int) and runs >= 1):
        raise ValueError(f"lin-decay: c0_runs must be an int >= 1 (Lin et al.: 5), got {runs!r}")
    proxy_name = public_proxy(config.dataset, proxy)
    n = dataset_size if dataset_size is not None else _private_size(config)
    z = private_noise_multiplier(config, n)
    spe = make_sampler(config.sampling, n, config.batch_size).steps_per_epoch
    configs = []
    for seed in range(runs):
        g = GreedyConfig(
            dataset=proxy_name, model=config.model, noise_multiplier=z,
            batch_size=config.batch_size, lr=config.lr, epochs=1, steps_per_epoch=spe,
            c_start=c_start, step=step, tolerance=tolerance, seed=seed, optimizer=config.optimizer, momentum=config.momentum,
            weight_decay=config.weight_decay, sampling=config.sampling, engine=config.engine,
            max_physical_batch=config.max_physical_batch,
            eval_batch_size=config.eval_batch_size, model_options=dict(config.model_options),
            proxy_for=config.dataset, data_dir=config.data_dir, device=config.device,
        )
        configs.append(g)
    workers = _search_workers(runs)
    if workers > 1 and getattr(store, "path", None) is not None:
        # independent searches (one seed each): run them in parallel processes, each with its own
        # connection to the (WAL) store; the results are identical to the sequential ones
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # "spawn": a forked child cannot use CUDA once the parent has touched it
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            futures = [pool.submit(_run_or_reuse_in_store, g, str(store.path), checkpoint_root)
                       for g in configs]
            done = [f.result() for f in futures]
    else:
        done = [run_or_reuse(g, store, checkpoint_root=checkpoint_root, progress=progress)[:2]
                for g in configs]
    names = [name for name, _ in done]
    firsts = [float(thresholds[0]) for _, thresholds in done]
    return float(statistics.fmean(firsts)), names, firsts


def _search_workers(runs: int) -> int:
    """Parallel processes for the C0 searches: ``$DPCLIP_SEARCH_WORKERS`` (default 1)."""
    raw = os.environ.get("DPCLIP_SEARCH_WORKERS", "").strip()
    try:
        workers = int(raw) if raw else 1
    except ValueError:
        raise ValueError(f"DPCLIP_SEARCH_WORKERS must be an integer, got {raw!r}") from None
    workers = max(1, min(workers, runs))
    if workers > 1 and not _main_is_importable():
        warnings.warn(
            "DPCLIP_SEARCH_WORKERS > 1 needs a __main__ that worker processes can import (a "
            "script file, not stdin or an interactive session); running the C0 searches one "
            "after another", stacklevel=3)
        return 1
    return workers


def _main_is_importable() -> bool:
    """Whether ``spawn`` workers can re-create ``__main__`` (a real file, or ``python -m``)."""
    import sys

    main = sys.modules.get("__main__")
    if main is None:
        return True
    spec = getattr(main, "__spec__", None)
    if spec is not None:  # python -m package.module
        return True
    path = getattr(main, "__file__", None)
    return path is None or os.path.isfile(path)


def _run_or_reuse_in_store(config: GreedyConfig, db: str,
                           checkpoint_root: str | os.PathLike | None) -> tuple[str, list[float]]:
    with ResultsStore(db) as store:
        name, thresholds, _ = run_or_reuse(config, store, checkpoint_root=checkpoint_root,
                                           progress=False)
    return name, list(thresholds)


def _check_schedule_use(config: Any, name: str, thresholds: list[float],
                        meta: dict[str, Any]) -> None:
    if meta.get("nonprivate") or meta.get("privacy") == "NON-PRIVATE":
        raise ValueError(
            f"schedule {name!r} was searched on private data ({meta.get('dataset')}, a "
            "--nonprivate-search): replaying it is not differentially private. Search a public "
            "proxy instead (`dpclip search --dataset mnist-5k ...`)"
        )

    entry = DATASETS.get(config.dataset)
    private_run = not (entry is not None and entry.is_public)
    if meta.get("dataset") == config.dataset and private_run:
        raise ValueError(
            f"schedule {name!r} was searched on {config.dataset!r} itself; Transfer replays a "
            "schedule found on a PUBLIC proxy dataset on the private one"
        )
    if private_run and meta.get("dataset") is None:
        raise ValueError(
            f"schedule {name!r} was stored without the dataset it was searched on (no "
            "'dataset' key): whether it came from public data cannot be checked, so it is "
            "not replayed on private data. Search it again on a public proxy (`dpclip search "
            "--dataset mnist-5k ...`), which records the dataset")
    if private_run and meta.get("dataset") is not None:
        searched = str(meta["dataset"])
        # the provenance recorded by the search (its bundle's), else the registry's
        recorded = tuple(str(p) for p in meta.get("provenance") or ()) \
            or tuple(provenance(searched))
        try:
            check_proxy_pair(searched, config.dataset, recorded)
        except ProxyOverlapError as exc:
            raise ValueError(
                f"schedule {name!r} cannot be replayed on {config.dataset!r}: {exc}"
            ) from None
    diffs = []
    for key, mine in (("model", config.model), ("batch_size", config.batch_size),
                      ("lr", config.lr), ("noise_multiplier", config.noise_multiplier)):
        theirs = meta.get(key)
        if mine is not None and theirs is not None and theirs != mine:
            diffs.append(f"{key} {theirs} (schedule) vs {mine} (run)")
    if meta.get("epochs") is not None and meta["epochs"] < config.epochs:
        diffs.append(f"the schedule has {meta['epochs']} epochs, the run {config.epochs} (its "
                     "last threshold is kept)")
    if diffs:
        warnings.warn(f"transfer: schedule {name!r} was searched in another setting: "
                      + "; ".join(diffs) + " (Lin et al. use the same setting)", stacklevel=3)


def resolve_strategy_params(
    config: Any,
    store: Any = None,
    *,
    checkpoint_root: str | os.PathLike | None = None,
    progress: bool = True,
    dry_run: bool = False,
) -> Any:
    """``config`` (a ``TrainConfig``) with ``transfer``'s ``schedule=NAME`` and ``lin-decay``'s
    ``c0_from="greedy"`` resolved (see the module docstring); other configs are returned as is.

    ``dry_run`` (spec validation): substitute placeholder values without touching a store, so
    the rest of the parameters can be validated.
    """
    params = dict(config.strategy_params)
    if config.strategy == "transfer" and str(params.get("schedule", "")).strip() == "greedy" \
            and "thresholds" not in params:
        return _resolve_greedy_schedule(config, params, store, checkpoint_root, progress, dry_run)
    for key in SCHEDULE_RESOLVER_KEYS:
        if config.strategy == "transfer" and key in params:
            raise ValueError(f"transfer: {key} is only used with schedule='greedy'")
    if config.strategy == "transfer" and "schedule" in params and "thresholds" not in params:
        name = str(params["schedule"])
        if dry_run:
            params["thresholds"] = [1.0]
        else:
            if store is None:
                raise ValueError(f"transfer: schedule={name!r} needs a results store (--db)")
            thresholds, meta = store.schedule(name)
            _check_schedule_use(config, name, thresholds, meta)
            params["thresholds"] = [float(c) for c in thresholds]
        return dataclasses.replace(config, strategy_params=params)
    if config.strategy == "lin-decay" and str(params.get("c0_from", "")).strip() == "greedy":
        if "clip_norm" in params:
            raise ValueError(
                "lin-decay: give either clip_norm (C0) or c0_from='greedy' (C0 from greedy "
                "searches on the public proxy), not both"
            )
        proxy = params.pop("c0_proxy", None)
        runs = params.pop("c0_runs", 5)
        search = {}
        try:
            runs = int(runs)
            for key, default in (("c_start", 0.05), ("step", 0.01), ("tolerance", 0.02)):
                search[key] = float(params.pop(f"c0_{key}", default))
        except (TypeError, ValueError):
            raise ValueError("lin-decay: c0_runs must be an int and c0_c_start, c0_step, "
                             "c0_tolerance numbers") from None
        if dry_run:
            public_proxy(config.dataset, None if proxy is None else str(proxy))
            params.update(clip_norm=1.0, c0_from="greedy:(unresolved)")
        else:
            if store is None:
                raise ValueError("lin-decay: c0_from='greedy' needs a results store (--db)")
            c0, names, _ = greedy_c0(config, store, proxy=None if proxy is None else str(proxy),
                                     runs=runs, checkpoint_root=checkpoint_root,
                                     progress=progress, **search)
            proxy_name = store.schedule(names[0])[1]["dataset"]
            params.update(clip_norm=c0, c0_from=f"greedy:{proxy_name}:{runs} runs:{names[0]}")
        return dataclasses.replace(config, strategy_params=params)
    for key in C0_RESOLVER_KEYS:
        if config.strategy == "lin-decay" and key in params:
            raise ValueError(f"lin-decay: {key} is only used with c0_from='greedy'")
    return config


def _resolve_greedy_schedule(config: Any, params: dict[str, Any], store: Any,
                             checkpoint_root: Any, progress: bool, dry_run: bool) -> Any:
    """``transfer`` with ``schedule = "greedy"`` (module docstring)."""
    proxy = params.pop("schedule_proxy", None)
    epochs = params.pop("schedule_epochs", config.epochs)
    search: dict[str, float] = {}
    try:
        for key, default in (("c_start", 0.05), ("step", 0.01), ("tolerance", 0.02)):
            search[key] = float(params.pop(f"schedule_{key}", default))
    except (TypeError, ValueError):
        raise ValueError("transfer: schedule_c_start, schedule_step and schedule_tolerance must "
                         "be numbers") from None
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"transfer: schedule_epochs must be an integer >= 1, got {epochs!r}")
    proxy_name = public_proxy(config.dataset, None if proxy is None else str(proxy))
    if dry_run:
        params.update(thresholds=[1.0], schedule="greedy:(unresolved)")
        return dataclasses.replace(config, strategy_params=params)
    if store is None:
        raise ValueError("transfer: schedule='greedy' needs a results store (--db)")
    n = _private_size(config)
    z = private_noise_multiplier(config, n)
    spe = make_sampler(config.sampling, n, config.batch_size).steps_per_epoch
    g = GreedyConfig(
        dataset=proxy_name, model=config.model, noise_multiplier=z,
        batch_size=config.batch_size, lr=config.lr, epochs=epochs, steps_per_epoch=spe,
        seed=0, optimizer=config.optimizer, momentum=config.momentum,
        weight_decay=config.weight_decay, sampling=config.sampling, engine=config.engine,
        max_physical_batch=config.max_physical_batch, eval_batch_size=config.eval_batch_size,
        model_options=dict(config.model_options), proxy_for=config.dataset,
        data_dir=config.data_dir, device=config.device, **search)
    name, thresholds, meta = run_or_reuse(g, store, checkpoint_root=checkpoint_root,
                                          progress=progress)
    _check_schedule_use(config, name, thresholds, meta)
    params.update(thresholds=[float(c) for c in thresholds], schedule=name)
    return dataclasses.replace(config, strategy_params=params)
