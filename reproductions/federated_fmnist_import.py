"""Store the committed federated Fashion-MNIST rows as finished runs of ``fedavg-fmnist``.

The 15 runs of ``reproductions/results/fedavg-fmnist.json`` were made by the former script
``reproductions/federated_fmnist.py`` (commit ac61a9a) before federated grids ran in the harness,
with exactly the settings of ``reproductions/federated_fmnist.toml``. Re-running them (about
6 CPU-minutes unloaded, far more on the shared 2-core machine) was not possible here, so this
script converts them: each row becomes the run of the spec with the same label and seed (same
harness fingerprint, so ``dpclip run`` skips it), its summary is the row plus the evidence keys,
its history the row's per-round history, and its ledger the run's plan (``plan_ledger`` with the
row's noise multiplier: a DP-FedAvg run records exactly its planned events). The epsilon of that
ledger is checked against the row's before anything is stored.

    python reproductions/federated_fmnist_import.py [--db reproductions/results.db]
    dpclip reproductions --db reproductions/results.db     # rewrites the json/md/png from the store
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from dpclip.accounting import compute_epsilon
from dpclip.federated import plan_ledger
from dpclip.federated.spec import build_strategy, config_from_spec
from dpclip.harness.spec import load_spec
from dpclip.store import ResultsStore

HERE = Path(__file__).resolve().parent
SOURCE = ("converted from reproductions/results/fedavg-fmnist.json as made by "
          "reproductions/federated_fmnist.py (commit ac61a9a), the settings of "
          "reproductions/federated_fmnist.toml; ledger = the run's plan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--db", default=str(HERE / "results.db"))
    p.add_argument("--rows", default=str(HERE / "results" / "fedavg-fmnist.json"))
    args = p.parse_args(argv)
    spec = load_spec(HERE / "federated_fmnist.toml")
    runs = {(r.label, r.config.seed): r for r in spec.runs()}
    rows = json.loads(Path(args.rows).read_text())
    with ResultsStore(args.db) as store:
        done = store.finished_fingerprints(spec.name)
        for row in rows:
            if row.get("experiment") == spec.name:
                raise SystemExit(f"{args.rows} already holds rows regenerated from the store")
            run = runs[(row["label"], int(row["seed"]))]
            if run.fingerprint in done:
                print(f"{row['label']} seed {row['seed']}: already stored")
                continue
            fed = dict(run.config.spec)
            strategy = build_strategy(fed)
            if strategy.describe() != row["params"]:
                raise SystemExit(f"{row['label']}: row params {row['params']} differ from the "
                                 f"spec's {strategy.describe()}")
            ledger = plan_ledger(strategy, config_from_spec(fed), int(row["num_users"]),
                                 float(row["noise_multiplier"]))
            eps = compute_epsilon(ledger, float(row["delta"]), row["accountant"]).epsilon
            if not math.isclose(eps, float(row["epsilon"]), rel_tol=1e-6):
                raise SystemExit(f"{row['label']} seed {row['seed']}: the planned ledger gives "
                                 f"epsilon {eps}, the row {row['epsilon']}")
            history = [{**h, "epoch": h["round"], "clip_threshold": h["clip_norm"]}
                       for h in row.pop("history")]
            summary = {**row, "model": "mlp", "model_options": fed["model_options"],
                       "expected_batch_size": row["expected_clients"], "lr": row["server_lr"],
                       "optimizer": row["server_optimizer"], "source": SOURCE}
            rid = store.start_run(run.fingerprint, run.config.to_dict(), experiment=spec.name,
                                  label=run.label)
            for h in history:
                store.log_epoch(rid, h["epoch"], h)
            store.finish_run(rid, dict(summary, experiment=spec.name), ledger.to_dict())
            print(f"{row['label']} seed {row['seed']}: stored (epsilon {eps:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
