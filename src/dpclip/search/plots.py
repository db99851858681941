"""Lin et al.'s threshold figures from the results store (matplotlib, Agg, PNG).

* :func:`plot_thresholds` (Lin et al. Figures 2-5): the greedy thresholds per epoch of one or more
  stored schedules, their mean and a fitted trend ``C_t = c / t^a`` (least squares in log-log,
  the shape of the Decay strategy), beside the per-epoch thresholds that ``yu-linear``,
  ``du-dynamic``, ``quantile`` and ``lin-decay`` (and any other strategy) chose in finished runs
  of the given experiments (mean over seeds, one line per run label).
* :func:`plot_median_norms` (Lin et al. Figure 1): the median per-example gradient norm per epoch
  (``nonprivate/norm_q50``, recorded by runs with ``diagnostics = true``; NON-PRIVATE) for runs
  with fixed clipping, one line per clip value (mean over seeds).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

__all__ = ["fit_decay_trend", "plot_median_norms", "plot_thresholds", "run_threshold_series"]

#: strategies drawn beside the greedy thresholds by default (Lin et al. Figures 2-5)
COMPARED = ("yu-linear", "du-dynamic", "quantile", "lin-decay", "transfer")


def _save(fig: Any, path: str | Path) -> Path:
    """Tight layout; the figure saved to ``path`` (its folder created) and closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def fit_decay_trend(thresholds: Sequence[float]) -> tuple[float, float]:
    """``(c, a)`` of the least-squares fit ``log C_t = log c - a log t`` (``t`` from 1).

    One threshold gives ``a = 0``. Non-positive thresholds are rejected."""
    ys = [float(c) for c in thresholds]
    if not ys or any(not (c > 0 and math.isfinite(c)) for c in ys):
        raise ValueError(f"fit_decay_trend: thresholds must be positive and finite, got {ys}")
    if len(ys) == 1:
        return ys[0], 0.0
    xs = [math.log(t) for t in range(1, len(ys) + 1)]
    ls = [math.log(c) for c in ys]
    mx, my = statistics.fmean(xs), statistics.fmean(ls)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ls)) / sxx
    return math.exp(my - slope * mx), -slope


def _label(run: dict[str, Any]) -> str:
    return run["label"] or run["config"]["strategy"]


def run_threshold_series(store: Any, experiments: Sequence[str],
                         strategies: Sequence[str] | None = COMPARED
                         ) -> dict[str, tuple[list[float], list[float]]]:
    """``"experiment: label" -> (epochs, mean clip threshold over seeds)`` of finished runs."""
    by: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for exp in experiments:
        for r in store.runs("finished", experiment=exp):
            if strategies is not None and r["config"]["strategy"] not in strategies:
                continue
            for h in store.epochs(r["id"]):
                v = h.get("clip_threshold")
                if isinstance(v, (int, float)) and math.isfinite(v):
                    by[f"{exp}: {_label(r)}"][float(h["epoch"])].append(float(v))
    return {k: (sorted(d), [statistics.fmean(d[e]) for e in sorted(d)]) for k, d in by.items()}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_thresholds(
    store: Any,
    schedules: Sequence[str],
    path: str | Path,
    *,
    experiments: Sequence[str] = (),
    strategies: Sequence[str] | None = COMPARED,
    title: str | None = None,
) -> Path:
    """Greedy thresholds (+ mean and trend) beside other strategies' thresholds; writes ``path``."""
    if not schedules:
        raise ValueError("plot_thresholds: give at least one stored schedule name "
                         "(`dpclip schedules` lists them)")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    all_th = []
    meta0: dict[str, Any] = {}
    for name in schedules:
        th, meta = store.schedule(name)
        meta0 = meta0 or meta
        all_th.append([float(c) for c in th])
        ax.plot(range(1, len(th) + 1), th, color="0.6", lw=0.8, marker=".", ms=4,
                alpha=0.7 if len(schedules) > 1 else 1.0,
                label=f"greedy {name}" if len(schedules) <= 3 else None)
    n = min(len(t) for t in all_th)
    mean = [statistics.fmean(t[i] for t in all_th) for i in range(n)]
    if len(schedules) > 1:
        ax.plot(range(1, n + 1), mean, color="k", lw=1.8, marker="o", ms=4,
                label=f"greedy mean of {len(schedules)}")
    c, a = fit_decay_trend(mean)
    ts = [1 + i * (n - 1) / 200 for i in range(201)] if n > 1 else [1.0]
    ax.plot(ts, [c / t ** a for t in ts], "k--", lw=1.2,
            label=f"trend C = {c:.3g} / t^{a:.2f}")
    for lab, (xs, ys) in sorted(run_threshold_series(store, experiments, strategies).items()):
        ax.plot(xs, ys, marker="s", ms=3, lw=1.2, label=lab)
    ax.set_xlabel("epoch")
    ax.set_ylabel("clipping threshold C")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.set_title(title or (
        f"greedy thresholds on {meta0.get('dataset')} ({meta0.get('model')}, "
        f"sigma {meta0.get('noise_multiplier', float('nan')):.3g}, B {meta0.get('batch_size')}) "
        "vs other strategies"), fontsize=9)
    ax.legend(fontsize=7, ncol=1, loc="best")
    return _save(fig, path)


def plot_median_norms(store: Any, experiments: Sequence[str], path: str | Path,
                      *, key: str = "nonprivate/norm_q50") -> Path:
    """Median per-example gradient norm per epoch for fixed clipping, per clip value."""
    by: dict[float, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for exp in experiments:
        for r in store.runs("finished", experiment=exp):
            if r["config"]["strategy"] != "fixed":
                continue
            clip = float(r["summary"]["params"]["clip_norm"])
            for h in store.epochs(r["id"]):
                v = h.get(key)
                if isinstance(v, (int, float)) and math.isfinite(v):
                    by[clip][float(h["epoch"])].append(float(v))
    if not by:
        raise ValueError(
            f"plot_median_norms: no finished fixed-clipping run with {key!r} in experiment(s) "
            f"{list(experiments)}; run them with diagnostics = true"
        )
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for clip in sorted(by):
        d = by[clip]
        xs = sorted(d)
        ax.plot(xs, [statistics.fmean(d[e]) for e in xs], marker="o", ms=3, label=f"fixed C={clip:g}")
    ax.set_xlabel("epoch")
    ax.set_ylabel("median per-example gradient norm")
    ax.set_title("median pre-clipping per-example gradient norm per epoch (NON-PRIVATE "
                 "diagnostic; Lin et al. Fig. 1)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
