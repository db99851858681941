"""The tuning protocol: the same hyperparameter budget for every strategy, chosen without the test set.

A spec with a ``[tuning]`` section (see ``docs/tuning.md``) gives every ``[[strategies]]`` entry a
search space over its own hyperparameters (``tune = { clip_norm = [...], lr = [...] }``: strategy
parameters such as C / C0, a, r, and the learning rate and its schedule) and ONE budget for all:
``trials`` settings, each trained for ``epochs`` epochs. For every cell of the grid (strategy x
dataset x model x privacy level), before the grid runs:

1. the trial settings are the search space's grid (keys sorted, values in the order given) when it
   has exactly ``trials`` points, else a sample of ``trials`` of its points drawn with
   ``random.Random(seed)``: a deterministic order, the same budget for every strategy (a space with
   fewer points than ``trials`` is refused);
2. each trial is a shortened copy of the final run with that setting: the same noise multiplier
   (the one the final run calibrates for its epsilon and epochs), batch size, sampling and
   optimizer, for ``epochs`` epochs (with ``horizon = "tan"``: the final run's number of steps
   and sigma / B, at batch ``B epochs / E`` and noise multiplier ``sigma epochs / E``), on the
   selection data of ``source``:

   * ``validation``: a stratified ``validation_fraction`` of the PRIVATE training split is held
     out; the trial trains on the rest and is scored on it. This selection is NOT privacy-accounted
     (as in the papers: the final run's epsilon covers its own training only). The test split is
     never given to a trial: the bundle a trial trains on has the validation split in place of the
     test split;
   * ``public-proxy``: the trial trains and is scored on a public dataset (``proxy``, default the
     registry's proxy of the private dataset, e.g. ``mnist-5k`` for Fashion-MNIST), for as many
     steps as ``epochs`` epochs of the private run; accounted nowhere because the data is public;
3. the setting with the best selection accuracy (the first in the order on a tie) is the choice;
   the grid's runs of that cell (every seed) run with it on the real train / test split.

Trials are runs in the results store under the experiment ``<name>:tuning`` (checkpointed under
``<out>/tuning``), so an interrupted tuning resumes and a finished trial is never repeated. The
choice, the trials and the budget are stored in each final run's summary (``tuning``) and so in the
evidence rows and reports.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["HORIZONS", "SOURCES", "TUNABLE_TRAIN_FIELDS", "TuningSpec", "apply_point",
           "search_points", "tune_runs", "tuning_table"]

#: selection sources and what they mean for privacy (stored with every tuned result)
SOURCES: dict[str, str] = {
    "validation": ("selected on a validation split carved from the private training data: NOT "
                   "privacy-accounted (as in the papers); the test split is never used"),
    "public-proxy": ("selected on a public proxy dataset: accounted nowhere because the data is "
                     "public; the private data and its test split are never used"),
}

#: how a trial relates to its final run
HORIZONS: dict[str, str] = {
    "truncated": "the final run's batch and noise multiplier, cut to the trial's epochs",
    "tan": ("the final run's number of steps and sigma / B at a batch (trial epochs / final "
            "epochs) times smaller, noise multiplier scaled alike (TAN, Sander et al. 2023): the "
            "noise of the whole run at the cost of the trial's epochs"),
}

#: TrainConfig fields a search space may contain (post-processing of the noisy gradient: no
#: effect on the privacy plan). Everything else a space names is a strategy parameter.
TUNABLE_TRAIN_FIELDS = ("lr", "momentum", "weight_decay", "optimizer", "lr_schedule", "lr_gamma",
                        "lr_step_epochs", "lr_min", "lr_warmup_epochs", "averaging")


@dataclass(frozen=True)
class TuningSpec:
    """The ``[tuning]`` section of a spec: one budget for every strategy, and where to select."""

    source: str
    trials: int
    epochs: int
    seed: int = 0
    validation_fraction: float = 0.1
    proxy: str | None = None
    #: "truncated" (the final run cut to ``epochs``) or "tan" (the final run's number of steps
    #: at a batch ``epochs / final epochs`` times smaller, with the noise multiplier scaled alike)
    horizon: str = "truncated"

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"source": self.source, "privacy": SOURCES[self.source],
                             "budget": {"trials": self.trials, "epochs_per_trial": self.epochs},
                             "seed": self.seed, "metric": "selection accuracy (last epoch)"}
        if self.horizon != "truncated":
            d["horizon"] = HORIZONS[self.horizon]
        if self.source == "validation":
            d["validation_fraction"] = self.validation_fraction
        else:
            d["proxy"] = self.proxy
        return d


def search_points(space: dict[str, list[Any]], trials: int, seed: int,
                  where: str = "tune") -> list[dict[str, Any]]:
    """The ``trials`` settings of a search space, in a deterministic order (module docstring)."""
    keys = sorted(space)
    grid = [dict(zip(keys, values)) for values in itertools.product(*(space[k] for k in keys))]
    if len(grid) < trials:
        raise ValueError(
            f"{where}: the search space has {len(grid)} setting(s), fewer than the budget "
            f"[tuning] trials = {trials}; every strategy gets the same number of trials: add "
            "values to the space or lower trials")
    if len(grid) == trials:
        return grid
    idx = sorted(random.Random(seed).sample(range(len(grid)), trials))
    return [grid[i] for i in idx]


def apply_point(config: Any, point: dict[str, Any]) -> Any:
    """``config`` (a ``TrainConfig``) with the setting applied: TrainConfig fields of
    ``TUNABLE_TRAIN_FIELDS`` replace the config's, the other keys are strategy parameters."""
    params = dict(config.strategy_params)
    fields: dict[str, Any] = {}
    for key, value in point.items():
        if key in TUNABLE_TRAIN_FIELDS:
            fields[key] = value
        else:
            params[key] = value
    return dataclasses.replace(config, strategy_params=params, **fields)


def cell_key(config: Any, label: str) -> tuple:
    """The grid cell a run belongs to: strategy label, dataset, model and privacy level."""
    level = ("epsilon", config.epsilon) if config.noise_multiplier is None \
        else ("noise_multiplier", config.noise_multiplier)
    return (label, config.dataset, config.model, level)


from dpclip.training.plan import NOISE_MATCH_RTOL  # noqa: E402 - the one calibration tolerance
from dpclip.data import load_dataset, public_private_split, public_proxy
from dpclip.training.checkpoint import private_root
from dpclip.training.sampling import make_sampler
from dpclip.training import trainer  # trainer.train looked up at call time (tests wrap it)
from dpclip.training.trainer import TrainConfig


def _same_trial(stored: Any, cfg: Any, label: str, scored_on: str) -> dict[str, Any] | None:
    """A finished trial of the same cell, setting and selection data (``scored_on``: the source
    and validation fraction, which the config does not hold) whose noise multiplier differs from
    ``cfg``'s only by calibration round-off, or None.

    A trial runs at the noise multiplier its final run calibrates, and the calibration's last
    digits depend on the numerical libraries (seen: 1.779084380579463 on this CPU image against
    1.7790843807577483 on a GPU image, 1e-10 relative), which would change the fingerprint and
    retrain every trial on resume elsewhere. Selection is not privacy-accounted, so a trial
    within ``NOISE_MATCH_RTOL`` is the same trial; everything else must be equal."""
    want = cfg.to_dict()
    defaults = _field_defaults()
    z = float(want.pop("noise_multiplier"))
    for k in ("device", "data_dir"):
        want.pop(k, None)
    for row in stored:
        trial = (row.get("summary") or {}).get("tuning_trial") or {}
        if row.get("label") != label or trial.get("scored_on") != scored_on:
            continue
        have = dict(row.get("config") or {})
        zh = have.pop("noise_multiplier", None)
        for k in ("device", "data_dir"):
            have.pop(k, None)
        # a field added to TrainConfig after the row was stored is absent from it: at its
        # default it is the same trial (as config.fingerprint() treats it)
        want_row = {k: v for k, v in want.items()
                    if k in have or k not in defaults or v != defaults[k]}
        if (zh is not None and abs(float(zh) - z) <= NOISE_MATCH_RTOL * z
                and json.dumps(have, sort_keys=True, default=str)
                == json.dumps(want_row, sort_keys=True, default=str)):
            return row
    return None


def _field_defaults() -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(TrainConfig)
            if f.default is not dataclasses.MISSING}


def _trial_fingerprint(config: Any, tuning: TuningSpec) -> str:
    key = {"config": config.fingerprint(), "source": tuning.source}
    if tuning.source == "validation":
        key["validation_fraction"] = tuning.validation_fraction
    return "t" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:15]


class _Tuner:
    """Runs the trials of every cell (see the module docstring)."""

    def __init__(self, spec: Any, store: Any, out_dir: Path, progress: bool) -> None:
        self.spec, self.tuning, self.store = spec, spec.tuning, store
        self.out, self.progress = out_dir, progress
        self.experiment = f"{spec.name}:tuning"
        self._bundles: dict[tuple, Any] = {}
        self._facts: dict[str, dict[str, Any]] = {}
        self._validation: dict[tuple, Any] = {}
        self._checked: set[tuple] = set()

    # ------------------------------------------------------------------ data
    def _private(self, config: Any) -> Any:
        """The private dataset as the final runs load it (seed = the tuning seed)."""
        key = (config.dataset, config.data_dir, self.tuning.seed,
               json.dumps(config.dataset_options, sort_keys=True))
        if key not in self._bundles:
            self._bundles[key] = load_dataset(config.dataset, config.data_dir,
                                              seed=self.tuning.seed, **config.dataset_options)
        return self._bundles[key]

    def check_split_is_seed_independent(self, config: Any, seeds: list[int]) -> None:
        """The validation split is carved from the training split of the tuning seed; a dataset
        whose train/test split changes with the seed would let the selection see examples that
        are test examples of another seed's run. Refused, naming the fix."""
        key = (config.dataset, config.data_dir, json.dumps(config.dataset_options,
                                                           sort_keys=True), tuple(seeds))
        if self.tuning.source != "validation" or key in self._checked:
            return
        self._checked.add(key)
        import torch

        mine = self._private(config).test
        for s in seeds:
            if s == self.tuning.seed:
                continue
            other = load_dataset(config.dataset, config.data_dir, seed=s,
                                 **config.dataset_options).test
            if not (other.inputs.shape == mine.inputs.shape
                    and torch.equal(other.inputs, mine.inputs)
                    and torch.equal(other.targets, mine.targets)):
                raise ValueError(
                    f"[tuning] source = \"validation\": dataset {config.dataset!r} draws its "
                    f"train/test split from the seed (seed {s} differs from the tuning seed "
                    f"{self.tuning.seed}), so a validation split of one seed's training data "
                    "overlaps another seed's test split. Use grid seeds = [tuning seed] or "
                    "source = \"public-proxy\"")

    def _validation_bundle(self, config: Any) -> Any:
        """Train on the private training split minus the validation split; the validation split
        takes the place of the test split (the test split is never given to a trial)."""
        key = (config.dataset, config.data_dir,
               json.dumps(config.dataset_options, sort_keys=True))
        if key not in self._validation:  # carved once per dataset (the same split every trial)
            full = self._private(config)
            val, rest = public_private_split(full.train, self.tuning.validation_fraction,
                                             self.tuning.seed)
            self._validation[key] = dataclasses.replace(full, train=rest, test=val)
        return self._validation[key]

    def _facts_of(self, config: Any) -> dict[str, Any]:
        """The final run's public plan facts (calibrated noise multiplier, steps per epoch),
        from a run of the real trainer stopped before its first step. The bundle it gets holds
        the full training split and, in place of the test split, the validation split: the test
        split is not needed (nothing is evaluated) and is not handed over."""
        key = json.dumps({k: v for k, v in config.to_dict().items()
                          if k not in TUNABLE_TRAIN_FIELDS}, sort_keys=True, default=str)
        if key not in self._facts:
            full = self._private(config)
            bundle = dataclasses.replace(full, test=self._validation_bundle(config).test)
            r = trainer.train(dataclasses.replace(config, seed=self.tuning.seed), data=bundle,
                              progress=False, stop_after_steps=0)
            self._facts[key] = {k: r.summary[k] for k in
                                ("noise_multiplier", "steps_per_epoch", "private_examples")}
        return self._facts[key]

    def trial(self, final: Any) -> tuple[Any, Any, dict[str, Any]]:
        """``(trial config, data bundle or None, facts)`` for the final config ``final``."""
        facts = self._facts_of(final)
        base = dict(epsilon=None, noise_multiplier=float(facts["noise_multiplier"]),
                    seed=self.tuning.seed, diagnostics=False)
        if self.tuning.source == "validation":
            if self.tuning.horizon == "tan":
                k = final.epochs / self.tuning.epochs
                batch = max(1, round(final.batch_size / k))
                base["noise_multiplier"] *= batch / final.batch_size
                cfg = dataclasses.replace(final, epochs=self.tuning.epochs, batch_size=batch,
                                          **base)
            else:
                cfg = dataclasses.replace(final, epochs=self.tuning.epochs, **base)
            return cfg, self._validation_bundle(final), facts

        proxy = public_proxy(final.dataset, self.tuning.proxy)
        pub = load_dataset(proxy, final.data_dir, seed=self.tuning.seed)
        if not pub.is_public:
            raise ValueError(f"[tuning] proxy {proxy!r} is not a public dataset")
        spe_proxy = make_sampler(final.sampling, len(pub.train), final.batch_size).steps_per_epoch
        steps = self.tuning.epochs * int(facts["steps_per_epoch"])
        epochs = max(1, math.ceil(steps / spe_proxy))
        cfg = dataclasses.replace(final, dataset=proxy, dataset_options={}, epochs=epochs,
                                  delta=None, **base)
        return cfg, pub, dict(facts, proxy_steps=epochs * spe_proxy)

    # ------------------------------------------------------------------ the protocol
    def run_cell(self, runs: list[Any], strategy: Any) -> dict[str, Any]:
        t = self.tuning
        first = runs[0]
        base = dataclasses.replace(first.config, seed=t.seed)
        self.check_split_is_seed_independent(base, sorted({r.config.seed for r in runs}))
        points = search_points(strategy.tune, t.trials, t.seed,
                               where=f"strategy {strategy.label!r} tune")
        done = {r["fingerprint"]: r for r in self.store.runs("finished", self.experiment)}
        level = cell_key(first.config, first.label)[3]
        trials = []
        for i, point in enumerate(points):
            final = apply_point(base, point)
            cfg, data, facts = self.trial(final)
            fp = _trial_fingerprint(cfg, t)
            label = (f"{first.label} | {first.config.dataset}/{first.config.model} | "
                     f"{level[0]}={level[1]:g} | trial {i}")
            match = done.get(fp) or _same_trial(done.values(), cfg, label,
                                                self._scored_on(cfg))
            if match is not None:
                summary = match["summary"]
            else:
                rid = self.store.start_run(fp, cfg.to_dict(), experiment=self.experiment,
                                           label=label)
                try:
                    res = trainer.train(cfg, data=data,
                                        checkpoint_dir=private_root(self.out) / "tuning" / fp,
                                        progress=self.progress)
                except Exception as exc:
                    self.store.fail_run(rid, f"{type(exc).__name__}: {exc}")
                    raise
                summary = dict(res.summary, label=label, experiment=self.experiment,
                               tuning_trial={"trial": i, "setting": point,
                                             "scored_on": self._scored_on(cfg)})
                for row in res.history:
                    self.store.log_epoch(rid, row["epoch"], row)
                self.store.finish_run(rid, summary, res.ledger.to_dict())
            trials.append({"trial": i, "setting": point,
                           "selection_accuracy": float(summary["test_accuracy"]),
                           "noise_multiplier": float(cfg.noise_multiplier),
                           "epochs": cfg.epochs, "dataset": cfg.dataset, "fingerprint": fp})
        best = max(range(len(trials)), key=lambda j: (trials[j]["selection_accuracy"], -j))
        return dict(t.describe(), space=dict(strategy.tune), choice=dict(points[best]),
                    selection_accuracy=trials[best]["selection_accuracy"], trials=trials)

    def _scored_on(self, cfg: Any) -> str:
        if self.tuning.source == "validation":
            return (f"validation split ({self.tuning.validation_fraction:g} of the private "
                    "training split; NOT privacy-accounted)")
        return f"test split of the public proxy {cfg.dataset}"


def tune_runs(spec: Any, runs: list[Any], store: Any, out_dir: str | Path,
              progress: bool = True) -> list[Any]:
    """``runs`` with each cell's chosen setting applied and its tuning record attached
    (``RunSpec.tuning``); runs the trials that are not finished in ``store`` first."""
    if spec.tuning is None:
        return runs
    tuner = _Tuner(spec, store, Path(out_dir), progress)
    by_label = {s.label: s for s in spec.strategies}
    cells: dict[tuple, list[Any]] = {}
    for r in runs:
        cells.setdefault(cell_key(r.config, r.label), []).append(r)
    out = []
    records = {key: tuner.run_cell(rs, by_label[key[0]]) for key, rs in cells.items()}
    for r in runs:
        rec = records[cell_key(r.config, r.label)]
        cfg = apply_point(r.config, rec["choice"])
        out.append(dataclasses.replace(r, config=cfg, tuning=rec))
    return out


def tuning_table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: one per tuned setting (strategy label, privacy level): the selection
    source, the budget, the choice and every trial's selection accuracy. ``rows`` are run
    summaries (or evidence rows) with ``label``, ``target_epsilon`` / ``noise_multiplier`` and
    ``tuning``; empty when none was tuned."""
    seen: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        t = r.get("tuning")
        if not t:
            continue
        level = (f"eps={r['target_epsilon']:g}" if r.get("target_epsilon") is not None
                 else f"sigma={r.get('noise_multiplier', float('nan')):.4g}")
        seen.setdefault((str(r.get("label") or r.get("strategy")), r.get("dataset"),
                         r.get("model"), level), t)
    if not seen:
        return []
    first = next(iter(seen.values()))
    out = ["", "## Tuning", "",
           f"Settings chosen by the tuning protocol (docs/tuning.md): {first['privacy']}. "
           f"Budget for every strategy: {first['budget']['trials']} trials of "
           f"{first['budget']['epochs_per_trial']} epoch(s), "
           + (f"validation fraction {first['validation_fraction']:g}"
              if first["source"] == "validation"
              else f"public proxy {first.get('proxy') or '(the dataset default)'}")
           + "; metric: selection accuracy at the end of the trial.", "",
           "| strategy | dataset/model | level | choice | selection acc | trials (setting: acc) |",
           "|---|---|---|---|---|---|"]
    for (label, ds, model, level), t in seen.items():
        trials = "; ".join(
            f"{json.dumps(x['setting'], sort_keys=True)}: {100 * x['selection_accuracy']:.2f}"
            for x in t["trials"])
        out.append(f"| {label} | {ds}/{model} | {level} | "
                   f"{json.dumps(t['choice'], sort_keys=True)} | "
                   f"{100 * t['selection_accuracy']:.2f} % | {trials} |")
    return out
