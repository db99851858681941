"""Tables and plots of DP-FedAvg result rows (``reproductions/results/fedavg-*.json``).

A row is one run: ``dataset, model, strategy, label, params, epsilon, delta, seed, rounds,
test_accuracy, history`` (``history``: ``round, test_accuracy, clip_norm, ...`` every few rounds).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

__all__ = ["summarize", "write_markdown", "write_plot"]


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and std of the final test accuracy per label (strategy + parameters), over seeds."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[r.get("label", r["strategy"])].append(r)
    out = []
    for label, rs in groups.items():
        accs = [float(r["test_accuracy"]) for r in rs]
        out.append({
            "label": label, "strategy": rs[0]["strategy"], "runs": len(rs),
            "seeds": sorted(int(r["seed"]) for r in rs),
            "mean_accuracy": statistics.fmean(accs),
            "std_accuracy": statistics.stdev(accs) if len(accs) > 1 else 0.0,
            "epsilon": max(float(r["epsilon"]) for r in rs),
            "final_clip_norm": statistics.fmean(float(r.get("final_clip_norm", math.nan))
                                                for r in rs),
        })
    return sorted(out, key=lambda s: -s["mean_accuracy"])


def write_markdown(rows: Sequence[dict[str, Any]], path: str | Path, title: str) -> str:
    """Per-run table, per-label summary, and the adaptive-vs-best-fixed verdict."""
    lines = [f"# {title} (generated from {Path(path).with_suffix('.json').name} by "
             "dpclip.federated.report)", "",
             "| dataset | model | strategy | params | epsilon | delta | users | m | z | seed | "
             "rounds | final C | test acc |", "|" + "---|" * 13]
    for r in sorted(rows, key=lambda r: (r.get("label", ""), r["seed"])):
        params = json.dumps(r["params"], sort_keys=True)
        lines.append(
            f"| {r['dataset']} | {r['model']} | {r.get('label', r['strategy'])} | {params} | "
            f"{r['epsilon']:.3f} | {r['delta']:g} | {r.get('num_users', '')} | "
            f"{r.get('expected_clients', '')} | {r.get('noise_multiplier', math.nan):.4f} | "
            f"{r['seed']} | {r['rounds']} | {r.get('final_clip_norm', math.nan):.3g} | "
            f"{100 * r['test_accuracy']:.2f} % |")
    summ = summarize(rows)
    lines += ["", "## Mean over seeds", "", "| label | runs | mean acc | std | final C (mean) |",
              "|---|---|---|---|---|"]
    for s in summ:
        lines.append(f"| {s['label']} | {s['runs']} | {100 * s['mean_accuracy']:.2f} % | "
                     f"{100 * s['std_accuracy']:.2f} | {s['final_clip_norm']:.3g} |")
    adaptive = [s for s in summ if s["strategy"] == "quantile"]
    fixed = [s for s in summ if s["strategy"] == "fixed"]
    if adaptive and fixed:
        a, best = adaptive[0], max(fixed, key=lambda s: s["mean_accuracy"])
        gap = a["mean_accuracy"] - best["mean_accuracy"]
        se = math.sqrt((a["std_accuracy"] ** 2 + best["std_accuracy"] ** 2) / max(a["runs"], 1))
        verdict = ("matches" if abs(gap) <= max(2 * se, 0.01) else
                   "beats" if gap > 0 else "falls short of")
        lines += ["", f"**Adaptive ({a['label']}) {verdict} the best fixed clip in hindsight "
                  f"({best['label']})**: {100 * a['mean_accuracy']:.2f} % vs "
                  f"{100 * best['mean_accuracy']:.2f} % (difference {100 * gap:+.2f} points; "
                  f"2 x standard error of the difference {200 * se:.2f} points, "
                  f"{a['runs']} seeds)."]
    text = "\n".join(lines) + "\n"
    Path(path).write_text(text)
    return text


def write_plot(rows: Sequence[dict[str, Any]], path: str | Path, title: str) -> None:
    """Test accuracy per round (mean over seeds) per label; the clip norm C_t below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[str, dict[int, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        for h in r.get("history", []):
            curves[r.get("label", r["strategy"])][int(h["round"])].append(
                (float(h["test_accuracy"]), float(h["clip_norm"])))
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    for label in sorted(curves):
        rounds = sorted(curves[label])
        acc = [statistics.fmean(a for a, _ in curves[label][t]) for t in rounds]
        clip = [statistics.fmean(c for _, c in curves[label][t]) for t in rounds]
        style = "-" if label.startswith("adaptive") else "--"
        ax.plot(rounds, acc, style, label=label, lw=2 if style == "-" else 1)
        bx.plot(rounds, clip, style, label=label, lw=2 if style == "-" else 1)
    ax.set_ylabel("test accuracy (mean over seeds)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    bx.set_yscale("log")
    bx.set_ylabel("clip norm C_t")
    bx.set_xlabel("round")
    bx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
