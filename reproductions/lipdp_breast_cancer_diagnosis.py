"""Why Lip-DP-SGD does not learn on breast cancer under declared-range scaling (issue 36).

The committed row (reproductions/lipdp_breast_cancer.toml, 10 seeds) is 62.98 +- 1.29 against
Barczewski & Ramon's 79.8, about the majority rate. This script separates the causes; each setting
is the spec's Lip-DP-SGD run (2-layer MLP, B 64, 10 epochs, Adam lr 0.01, X_0 5, weight bound 1,
summed engine, eps 1.672, delta 1e-5, PLD) with ONE change:

* ``spec``: as committed (declared ranges, private);
* ``no-noise``: sigma 0 (NOT private; is it the optimisation or the noise?);
* ``train-statistics``: the paper's preprocessing, standardised with the noiseless train-split
  mean and std (NON-PRIVATE preprocessing; the DP-SGD part is the same);
* ``train-statistics, no-noise``;
* ``lr 0.05``: the spec with a 5x learning rate;
* ``centred, X_0 1``: declared ranges, then centred at the train-split mean (NON-PRIVATE oracle: an
  upper bound for any declared centre) with the input norm bound lowered to 1;
* ``[0, 1] map, X_0 1.5``: the same declared ranges mapped to ``[0, 1]`` instead of ``[-1, 1]`` (a
  fixed per-record map: private), which shrinks the common offset, with X_0 1.5.

Writes ``reproductions/results/lipdp_breast_cancer_diagnosis.{json,md}`` (rows with device and
torch version). Runs in about two CPU-minutes::

    PYTHONPATH=src python reproductions/lipdp_breast_cancer_diagnosis.py

``--strategy fix-lip-dp-sgd`` runs the same settings for Fix-Lip-DP-SGD (the spec's fix-lip row:
the same model, budget and parameters) and writes
``reproductions/results/fixlip_breast_cancer_diagnosis.{json,md}``; ``--seeds 0 1 2`` picks seeds::

    PYTHONPATH=src python reproductions/lipdp_breast_cancer_diagnosis.py \
        --strategy fix-lip-dp-sgd --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

from dpclip.data import load_dataset
from dpclip.data.base import TensorSplit
from dpclip.training.trainer import TrainConfig, train

SEEDS = (0, 1, 2, 3, 4)
RESULTS = Path(__file__).resolve().parent / "results"
#: strategy -> (output stem, title)
OUTPUTS = {"lip-dp-sgd": ("lipdp_breast_cancer_diagnosis", "Lip-DP-SGD"),
           "fix-lip-dp-sgd": ("fixlip_breast_cancer_diagnosis", "Fix-Lip-DP-SGD")}

BASE = dict(dataset="breast-cancer", model="tabular-mlp", epochs=10, batch_size=64, lr=0.01,
            optimizer="adam", delta=1e-5, accountant="pld", strategy="lip-dp-sgd",
            strategy_params={"input_norm": 5.0, "weight_bound": 1.0}, engine="summed",
            epsilon=1.672)

#: label -> (TrainConfig changes, scaling, transform ("none", "centre": at the train mean,
#: "01": declared [-1, 1] -> [0, 1]), privacy)
SETTINGS: dict[str, tuple[dict, str, str, str]] = {
    "spec": ({}, "declared-ranges", "none", "private"),
    "no-noise": ({"epsilon": None, "noise_multiplier": 0.0}, "declared-ranges", "none",
                 "NOT private (no noise)"),
    "train-statistics": ({}, "train-statistics", "none", "NON-PRIVATE preprocessing"),
    "train-statistics, no-noise": ({"epsilon": None, "noise_multiplier": 0.0}, "train-statistics",
                                   "none", "NOT private"),
    "lr 0.05": ({"lr": 0.05}, "declared-ranges", "none", "private"),
    "centred, X_0 1": ({"strategy_params": {"input_norm": 1.0, "weight_bound": 1.0}},
                       "declared-ranges", "centre", "NON-PRIVATE preprocessing (oracle centre)"),
    "[0, 1] map, X_0 1.5": ({"strategy_params": {"input_norm": 1.5, "weight_bound": 1.0}},
                            "declared-ranges", "01", "private"),
}


def _bundle(seed: int, scaling: str, transform: str):
    b = load_dataset("breast-cancer", None, seed=seed, scaling=scaling)
    if transform == "none":
        return b
    if transform == "centre":
        c = b.train.inputs.mean(0)  # NON-PRIVATE: a statistic of the training split, noiseless
        f = lambda t: t - c  # noqa: E731
    else:  # "01": a fixed per-record map
        f = lambda t: (t + 1) / 2  # noqa: E731
    return dataclasses.replace(b, train=TensorSplit(f(b.train.inputs), b.train.targets),
                               test=TensorSplit(f(b.test.inputs), b.test.targets))


def _data_facts(scaling: str) -> dict[str, float]:
    b = load_dataset("breast-cancer", None, seed=0, scaling=scaling)
    x, y = b.train.inputs.double(), b.train.targets
    norms = x.norm(dim=1)
    return {"input_norm_median": float(norms.median()), "input_norm_max": float(norms.max()),
            "feature_std_median": float(x.std(0).median()),
            "class_mean_distance": float((x[y == 0].mean(0) - x[y == 1].mean(0)).norm()),
            "offset_norm": float(x.mean(0).norm()),
            "test_majority_rate": float(max(b.test.targets.float().mean(),
                                            1 - b.test.targets.float().mean()))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategy", choices=sorted(OUTPUTS), default="lip-dp-sgd")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    args = ap.parse_args(argv)
    stem, title = OUTPUTS[args.strategy]
    out = RESULTS / stem
    rows = []
    for label, (change, scaling, transform, privacy) in SETTINGS.items():
        for seed in args.seeds:
            cfg = TrainConfig(**{**BASE, **change, "seed": seed, "strategy": args.strategy,
                                 "dataset_options": {"scaling": scaling}})
            res = train(cfg, data=_bundle(seed, scaling, transform), progress=False)
            s = res.summary
            rows.append({"setting": label, "strategy": args.strategy, "privacy": privacy, "scaling": scaling,
                         "transform": transform, "seed": seed, "test_accuracy": s["test_accuracy"],
                         "epsilon": s["epsilon"], "noise_multiplier": s["noise_multiplier"],
                         "lr": cfg.lr, "input_norm": cfg.strategy_params["input_norm"],
                         "epochs": cfg.epochs, "device": "cpu (2 shared cores)",
                         "torch": torch.__version__,
                         "machine": platform.machine()})
            print(label, seed, s["test_accuracy"], file=sys.stderr)
    facts = {sc: _data_facts(sc) for sc in ("declared-ranges", "train-statistics")}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"rows": rows, "data": facts}, indent=1) + "\n")
    flag = "" if args.strategy == "lip-dp-sgd" else f" --strategy {args.strategy}"
    lines = [f"# {title} on breast cancer: diagnosis (generated by "
             f"reproductions/lipdp_breast_cancer_diagnosis.py{flag})", "",
             f"Each setting: {BASE['epochs']} epochs, seeds {args.seeds}; a diagnostic, not a "
             "reproduction (the reproduction is reproductions/lipdp_breast_cancer.toml).", "",
             "| setting | privacy | sigma | test acc (%) mean +- std | seeds |",
             "|---|---|---|---|---|"]
    for label in SETTINGS:
        rs = [r for r in rows if r["setting"] == label]
        accs = [100 * r["test_accuracy"] for r in rs]
        lines.append(f"| {label} | {rs[0]['privacy']} | {rs[0]['noise_multiplier']:.3f} | "
                     f"{statistics.mean(accs):.2f} +- {statistics.pstdev(accs):.2f} | {len(rs)} |")
    lines += ["", "| scaling | median input norm | max input norm | median feature std | "
              "class-mean distance | norm of the mean (offset) |", "|---|---|---|---|---|---|"]
    for sc, f in facts.items():
        lines.append(f"| {sc} | {f['input_norm_median']:.2f} | {f['input_norm_max']:.2f} | "
                     f"{f['feature_std_median']:.3f} | {f['class_mean_distance']:.2f} | "
                     f"{f['offset_norm']:.2f} |")
    majority = 100 * facts["declared-ranges"]["test_majority_rate"]
    lines.append(f"\nTest majority rate {majority:.2f} % (seed 0's split); torch "
                 f"{torch.__version__}, cpu (2 shared cores).")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
