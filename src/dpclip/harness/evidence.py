"""Append training runs to a committed evidence file and regenerate its Markdown table.

    dpclip train ARGS... --evidence reproductions/results/NAME.json

appends the run's summary row (a list of rows per file,
each with at least dataset, model, strategy, params, epsilon, delta, seed, epochs, test_accuracy)
to ``NAME.json`` and rewrites ``NAME.md`` with one line per run plus mean and std per setting.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any
from dpclip.harness.tuning import tuning_table

__all__ = ["append_row", "lr_text", "markdown_table"]

KEYS = ("dataset", "model", "strategy", "params", "epsilon", "delta", "seed", "epochs",
        "test_accuracy")


def append_row(path: Path, row: dict[str, Any]) -> list[dict[str, Any]]:
    missing = [k for k in KEYS if k not in row]
    if missing:
        raise ValueError(f"evidence row lacks {missing}")
    rows = json.loads(path.read_text()) if path.exists() else []
    rows.append(row)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1, default=str) + "\n")
    path.with_suffix(".md").write_text(markdown_table(rows, path.stem))
    return rows


def _model(r: dict[str, Any]) -> str:
    """The model name, with its options, augmentation (multiplicity) and averaging when any (runs
    differing only there are distinct)."""
    opts = r.get("model_options") or {}
    aug = r.get("augment") or "none"
    k, avg = int(r.get("augment_multiplicity") or 1), r.get("averaging") or "none"
    return r["model"] + (f" {json.dumps(opts, sort_keys=True)}" if opts else "") + (
        f" augment {aug}" if aug != "none" else "") + (f" x{k}" if k > 1 else "") + (
        f" averaging {avg}" if avg != "none" else "")


def _setting(r: dict[str, Any]) -> tuple:
    return (r["dataset"], _model(r), r["strategy"], json.dumps(r["params"], sort_keys=True),
            r.get("target_epsilon"), r.get("noise_multiplier_arg"), r["epochs"],
            r.get("expected_batch_size"), lr_text(r), r.get("optimizer"), r.get("accountant"),
            json.dumps(r.get("tuning", {}).get("choice"), sort_keys=True))


def lr_text(r: dict[str, Any]) -> str:
    """The learning rate and its schedule: ``1`` or ``1 exponential(gamma 0.9)``, ``0.5 cosine(
    lr_min 0, warm-up 1 ep)`` (rows without ``lr_schedule`` had a constant rate)."""
    lr = r.get("lr", "")
    sch = r.get("lr_schedule") or {}
    if not sch or (sch.get("name") == "constant" and not sch.get("warmup_epochs")):
        return f"{lr}"
    parts = [f"{k} {sch[k]:g}" for k in ("gamma", "step_epochs", "lr_min") if k in sch]
    if sch.get("warmup_epochs"):
        parts.append(f"warm-up {sch['warmup_epochs']:g} ep")
    return f"{lr} {sch['name']}({', '.join(parts)})"


def _noise(r: dict[str, Any]) -> str:
    """``secure`` or ``seeded`` (rows without the field predate secure randomness: seeded)."""
    return "secure" if r.get("randomness") == "secure" else "seeded"


def markdown_table(rows: list[dict[str, Any]], title: str) -> str:
    out = [f"# {title} (generated from {title}.json by dpclip.harness.evidence)", "",
           "| dataset | model | strategy | params | epsilon | delta | accountant | sigma | B | lr "
           "| optimizer | epochs | seed | noise | test acc |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r['dataset']} | {_model(r)} | {r['strategy']} | "
            f"{json.dumps(r['params'], sort_keys=True)} | {r['epsilon']:.3f} | {r['delta']:g} | "
            f"{r.get('accountant', '')} | {r.get('noise_multiplier', float('nan')):.4f} | "
            f"{r.get('expected_batch_size', '')} | {lr_text(r)} | {r.get('optimizer', '')} | "
            f"{r.get('epochs_completed', r['epochs'])} | {r['seed']} | {_noise(r)} | "
            f"{100 * r['test_accuracy']:.2f} % |")
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(_setting(r), []).append(r)
    if any(_noise(r) == "seeded" for r in rows):
        out += ["", "*seeded*: the noise and batch sampling were derived from the published seed "
                "(--reproducible-noise, or a run made before dpclip 0.2): NOT private against "
                "anyone who knows the seed."]
    out += ["", "## Mean and standard deviation per setting", "",
            "| dataset | model | strategy | params | epsilon (max) | runs | test acc mean | std |",
            "|---|---|---|---|---|---|---|---|"]
    for rs in groups.values():
        accs = [100 * r["test_accuracy"] for r in rs]
        sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
        r0 = rs[0]
        out.append(f"| {r0['dataset']} | {_model(r0)} | {r0['strategy']} | "
                   f"{json.dumps(r0['params'], sort_keys=True)} | "
                   f"{max(r['epsilon'] for r in rs):.3f} | {len(rs)} | "
                   f"{statistics.fmean(accs):.2f} % | {sd:.2f} |")

    out += tuning_table(rows)
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """The former ``python -m dpclip.harness.evidence FILE -- train ARGS`` entry point: the
    harness no longer runs the command line (it sits below it); the same run is
    ``dpclip train ARGS --evidence FILE``. Prints that command and returns 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv and argv.index("--") == 1 and argv[2:3] == ["train"]:
        print("evidence: run `dpclip " + " ".join(argv[2:] + ["--evidence", argv[0]]) + "` "
              "(the evidence row is now appended by `dpclip train --evidence FILE`)",
              file=sys.stderr)
    else:
        print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
