"""Evidence rows for a run that was stopped before its planned end (CPU budget): the per-epoch
history that `dpclip run` wrote to the run's checkpoint (public: test accuracy of released models,
epsilon spent so far), as one JSON row plus a Markdown table. The run itself resumes from the same
checkpoint with the same `dpclip run` command; its final row then replaces this one.

    python reproductions/partial_run_evidence.py CHECKPOINT.pt NAME [--note TEXT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dpclip.harness.evidence import lr_text

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("name")
    ap.add_argument("--note", default="")
    a = ap.parse_args()
    ck = torch.load(a.checkpoint, map_location="cpu", weights_only=False)
    cfg, hist = ck["config"], ck["history"]  # only public fields are read; ck["private"] is not
    last = hist[-1]
    row = {
        "dataset": cfg["dataset"], "model": cfg["model"], "model_options": cfg["model_options"],
        "strategy": cfg["strategy"], "params": cfg["strategy_params"],
        "epsilon": last["epsilon"], "epsilon_target": cfg["epsilon"], "delta": cfg["delta"],
        "accountant": cfg["accountant"], "noise_multiplier": last["noise_multiplier"],
        "batch_size": cfg["batch_size"], "lr": cfg["lr"], "optimizer": cfg["optimizer"],
        "seed": cfg["seed"], "epochs": last["epoch"], "epochs_planned": cfg["epochs"],
        "test_accuracy": last["test_accuracy"],
        "randomness": "seeded" if cfg.get("reproducible_noise") else "secure",
        "status": "stopped before the planned end (CPU budget)", "note": a.note,
        "history": [{k: h[k] for k in ("epoch", "test_accuracy", "epsilon")} for h in hist],
    }
    RESULTS.joinpath(f"{a.name}.json").write_text(json.dumps([row], indent=1) + "\n")
    md = [f"# {a.name} (generated from {a.name}.json by reproductions/partial_run_evidence.py)", "",
          f"{row['dataset']}, {row['model']} {json.dumps(row['model_options'])}, {row['strategy']} "
          f"{json.dumps(row['params'])}, target epsilon {row['epsilon_target']} over "
          f"{row['epochs_planned']} epochs (sigma {row['noise_multiplier']:.3f}), delta "
          f"{row['delta']:g}, B {row['batch_size']}, lr {lr_text(dict(lr=row['lr']))}, "
          f"{row['optimizer']}, seed {row['seed']}, noise {row['randomness']}. "
          f"**{row['status']}** after {row['epochs']} of {row['epochs_planned']} epochs. {a.note}",
          "", "| epoch | epsilon spent | test acc |", "|---|---|---|"]
    md += [f"| {h['epoch']} | {h['epsilon']:.3f} | {100 * h['test_accuracy']:.2f} % |"
           for h in row["history"]]
    RESULTS.joinpath(f"{a.name}.md").write_text("\n".join(md) + "\n")
    print(f"wrote {RESULTS / a.name}.json and .md")


if __name__ == "__main__":
    main()
