"""Reports from the results store: a Markdown and a self-contained HTML report per experiment.

The table gives test accuracy mean +- std over seeds per strategy (rows) and privacy level
(columns), the best mean of each column in bold. Plots (matplotlib PNGs, embedded in the HTML as
base64): accuracy, clip threshold and epsilon per epoch per strategy (means over seeds) and, when
the runs recorded them, the non-private diagnostics (per-example gradient-norm quantiles, cosine
between the clipped-and-weighted and the true batch gradient, clipping bias) — labelled as
non-private.
"""

from __future__ import annotations

import base64
import html
import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpclip.store import ResultsStore
from dpclip.harness.evidence import lr_text
from dpclip.harness.tuning import tuning_table

__all__ = ["Report", "accuracy_plots", "build_report", "collect_runs", "is_federated",
           "settings_table"]

DIAGNOSTIC_PLOTS = {
    "norm_quantiles": ("norm_q", "per-example gradient norm quantiles"),
    "cosine": ("cosine", "cosine(clipped-weighted sum, true batch gradient)"),
    "bias": ("clip_bias", "clipping bias ||E[clipped mean] - true mean||"),
}
#: diagnostics prefixes: computed on private training examples (NON-PRIVATE) or on held-out data
DIAGNOSTIC_SOURCES = {"nonprivate/": "NON-PRIVATE: private training examples",
                      "heldout/": "held-out test examples"}


def seeded_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs whose noise and sampling were derived from the published seed: made with
    ``reproducible_noise``, or before secure randomness was the default (no ``randomness`` field:
    dpclip < 0.2 seeded every run). NOT private against anyone who knows the seed."""
    return [r for r in runs if (r.get("summary") or {}).get("randomness") != "secure"]


SEEDED_NOTE = ("seeded noise: the noise and batch sampling were derived from the published seed "
               "(--reproducible-noise, or a run made before dpclip 0.2): NOT private against "
               "anyone who knows the seed")


@dataclass
class Report:
    markdown_path: Path
    html_path: Path
    plots: list[Path]
    table: list[dict[str, Any]]


def collect_runs(store: ResultsStore, experiment: str) -> list[dict[str, Any]]:
    """Finished runs of ``experiment`` with their per-epoch history."""
    runs = []
    for r in store.runs("finished", experiment=experiment):
        r["history"] = store.epochs(r["id"])
        runs.append(r)
    return runs


def _level(run: dict[str, Any]) -> str:
    cfg = run["config"]
    if cfg.get("epsilon") is not None and cfg.get("noise_multiplier") is None:
        return f"eps={cfg['epsilon']:g}"
    return f"sigma={cfg['noise_multiplier']:g}"


def deltas_text(runs: list[dict[str, Any]]) -> str:
    """The delta(s) the runs used: the summary's (what the accountant used; chosen from N when the
    spec left ``delta`` out), else the config's; ``"-"`` when neither recorded one."""
    vals = sorted({float(d) for r in runs
                   if (d := (r.get("summary") or {}).get("delta", r["config"].get("delta")))
                   is not None})
    return ", ".join(f"{d:g}" for d in vals) or "-"


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def accuracy_table(runs: list[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    cells: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    labels: list[str] = []
    levels: list[str] = []
    for r in runs:
        lab, lev = r["label"] or r["config"]["strategy"], _level(r)
        cells[(lab, lev)].append(r)
        if lab not in labels:
            labels.append(lab)
        if lev not in levels:
            levels.append(lev)
    rows = []
    for lab in labels:
        row: dict[str, Any] = {"strategy": lab}
        for lev in levels:
            rs = cells.get((lab, lev), [])
            if rs:
                accs = [100 * x["summary"]["test_accuracy"] for x in rs]
                eps = [x["summary"]["epsilon"] for x in rs]
                m, s = _mean_std(accs)
                row[lev] = {"mean": m, "std": s, "n": len(rs), "epsilon": max(eps),
                            "epsilon_mean": statistics.fmean(eps),
                            "diverged": sum(diverged(x) is not None for x in rs)}
        rows.append(row)
    return levels, rows


def _pm(mean: float, std: float, n: int, sep: str = "+-") -> str:
    """``mean +- std`` over seeds; the mean alone for one seed (no std to show)."""
    return f"{mean:.2f}" if n < 2 else f"{mean:.2f} {sep} {std:.2f}"


def diverged(run: dict[str, Any]) -> str | None:
    """Why a finished run looks diverged (or None): a non-finite test loss, a final accuracy more
    than 20 points below the run's best epoch, or a clip threshold that grew more than tenfold
    (an adaptive strategy running away). Computed from the stored (private-as-released) history;
    a flag for the reader, not a verdict."""
    hist = [h for h in run.get("history") or [] if isinstance(h.get("test_accuracy"), (int, float))]
    if not hist:
        return None
    last = hist[-1]
    loss = last.get("test_loss")
    if isinstance(loss, (int, float)) and not math.isfinite(loss):
        return "the test loss is not finite"
    best = max(h["test_accuracy"] for h in hist)
    if best - last["test_accuracy"] > 0.20:
        return (f"test accuracy fell from {100 * best:.1f} % (best epoch) to "
                f"{100 * last['test_accuracy']:.1f} %")
    clips = [h.get("clip_threshold") for h in hist]
    clips = [c for c in clips if isinstance(c, (int, float)) and math.isfinite(c) and c > 0]
    if len(clips) >= 2 and clips[-1] > 10 * clips[0]:
        return f"the clip threshold grew from {clips[0]:.3g} to {clips[-1]:.3g}"
    return None


def _best(levels: list[str], rows: list[dict[str, Any]]) -> dict[str, str]:
    best = {}
    for lev in levels:
        cand = [(r[lev]["mean"], r["strategy"]) for r in rows if lev in r]
        if cand:
            best[lev] = max(cand)[1]
    return best


def _markdown_table(levels: list[str], rows: list[dict[str, Any]]) -> str:
    best = _best(levels, rows)
    out = ["| strategy | " + " | ".join(levels) + " |", "|---|" + "---|" * len(levels)]
    for r in rows:
        cells = []
        for lev in levels:
            if lev not in r:
                cells.append("-")
                continue
            c = r[lev]
            text = f"{_pm(c['mean'], c['std'], c['n'])} (n={c['n']}, eps {c['epsilon']:.2f})"
            text = f"**{text}**" if best.get(lev) == r["strategy"] else text
            cells.append(text + (" (diverged)" if c.get("diverged") else ""))
        out.append(f"| {r['strategy']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def settings_table(runs: list[dict[str, Any]]) -> str:
    """Markdown: one line per strategy and privacy level with what a newcomer needs to read the
    accuracy: epsilon (target and spent), sigma, the strategy's parameters, the learning rate
    (and schedule), epochs, seconds per run and test accuracy (mean +- std over seeds). For a
    federated grid the epochs are rounds and the learning rate is the server's."""
    cells: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        cells[(r["label"] or r["config"]["strategy"], _level(r))].append(r)
    out = ["| strategy | epsilon (target) | epsilon spent | sigma | params | lr | epochs | "
           "s / run | runs | test acc (%) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (label, _lev), rs in cells.items():
        s0, cfg = rs[0]["summary"], rs[0]["config"]
        target = cfg.get("epsilon")
        params = {k: v for k, v in (s0.get("params") or cfg["strategy_params"]).items()
                  if not isinstance(v, (list, dict))}
        if (s0.get("augment") or "none") != "none":  # training augmentation (dpclip.data.augment)
            params["augment"] = s0["augment"]
        if int(s0.get("augment_multiplicity") or 1) > 1:  # dpclip.training.multiplicity
            params["augment_multiplicity"] = s0["augment_multiplicity"]
        if (s0.get("averaging") or "none") != "none":  # dpclip.training.averaging: evaluated weights
            params["averaging"] = s0["averaging"]
        m, sd = _mean_std([100 * x["summary"]["test_accuracy"] for x in rs])
        secs = statistics.fmean(x["summary"].get("wall_seconds", float("nan")) for x in rs)
        out.append(
            f"| {label} | {'-' if target is None else f'{target:g}'} | "
            f"{max(x['summary']['epsilon'] for x in rs):.3f} | "
            f"{s0.get('noise_multiplier', float('nan')):.3f} | "
            f"{json.dumps(params, sort_keys=True)} | {lr_text(s0)} | "
            f"{s0.get('epochs_completed', cfg.get('epochs', s0.get('epochs'))):g} | {secs:.0f} | {len(rs)} | "
            f"{_pm(m, sd, len(rs))} |")
    return "\n".join(out)


def is_federated(runs: list[dict[str, Any]]) -> bool:
    """Runs of a federated grid (user-level DP-FedAvg; their history is per round)."""
    return bool(runs) and all(r["config"].get("kind") == "federated" for r in runs)


def accuracy_plots(unit: str = "epoch") -> tuple[tuple[str, str, str, bool], ...]:
    """(history key, title, y label, log scale) of the report's standard plots."""
    return (
        ("test_accuracy", f"test accuracy per {unit}", "test accuracy", False),
        ("clip_threshold", f"clip threshold (sensitivity) per {unit}", "threshold", True),
        ("epsilon", f"epsilon spent per {unit}", "epsilon", False),
    )


def _series(runs: list[dict[str, Any]], key: str) -> dict[str, tuple[list[float], list[float]]]:
    """label -> (epochs, mean over seeds of history[key]) for runs that recorded ``key``."""
    by: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        lab = f"{r['label'] or r['config']['strategy']} {_level(r)}"
        for h in r["history"]:
            v = h.get(key)
            if isinstance(v, (int, float)) and math.isfinite(v):
                by[lab][float(h["epoch"])].append(float(v))
    return {lab: (sorted(d), [statistics.fmean(d[e]) for e in sorted(d)]) for lab, d in by.items()}


def _finish(fig: Any, ax: Any, path: Path, n_series: int) -> Path:
    """Grid, legend, tight layout; the figure saved to ``path`` and closed."""
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    _legend(ax, n_series)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _plot(series: dict[str, tuple[list[float], list[float]]], title: str, ylabel: str,
          path: Path, logy: bool = False, xlabel: str = "epoch") -> Path | None:
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for lab, (xs, ys) in sorted(series.items()):
        ax.plot(xs, ys, marker="o", markersize=3, label=lab)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if logy:
        ax.set_yscale("log")
    return _finish(fig, ax, path, len(series))


def _legend(ax: Any, n: int) -> None:
    """A legend that stays readable with many series: inside for a few, else to the right of the
    axes, one entry per line."""
    if n <= 3:
        ax.legend(fontsize=8)
    else:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def privacy_utility_series(levels: list[str], rows: list[dict[str, Any]]
                           ) -> dict[str, tuple[list[float], list[float], list[float]]]:
    """strategy -> (epsilon spent, mean test accuracy %, std) per privacy level, by epsilon."""
    out = {}
    for r in rows:
        pts = sorted((r[lev]["epsilon_mean"], r[lev]["mean"], r[lev]["std"]) for lev in levels
                     if lev in r and math.isfinite(r[lev].get("epsilon_mean", math.nan)))
        if pts:
            out[r["strategy"]] = ([p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts])
    return out


def privacy_utility_plot(levels: list[str], rows: list[dict[str, Any]], path: Path,
                         title: str = "privacy-utility: test accuracy vs epsilon spent"
                         ) -> Path | None:
    """Test accuracy (mean over seeds, +- std bars) against the epsilon spent, one line per
    strategy: the privacy-utility curve."""
    series = privacy_utility_series(levels, rows)
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    for lab, (xs, ys, sds) in sorted(series.items()):
        ax.errorbar(xs, ys, yerr=sds, marker="o", markersize=4, capsize=3, label=lab)
    ax.set_xlabel("epsilon spent")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title, fontsize=10)
    return _finish(fig, ax, path, len(series))


def audit_plot(rows: list[dict[str, Any]], path: Path) -> tuple[Path, str] | None:
    """Claimed epsilon (x) against the empirical lower bound (y) of each audit, with the y = x
    line: a point above it refutes its claim. Returns the path and ``PASS``/``FAIL``."""
    pts = [(float(r["claimed_epsilon"]), float(r["lower_bound"]), bool(r.get("violates_claim")),
            f"{r.get('mode') or ''} {r.get('strategy') or ''}".strip())
           for r in rows if isinstance(r.get("claimed_epsilon"), (int, float))
           and isinstance(r.get("lower_bound"), (int, float))]
    if not pts:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    verdict = "FAIL" if any(v for _, _, v, _ in pts) else "PASS"
    top = max(max(c, b) for c, b, _, _ in pts) * 1.15 or 1.0
    fig, ax = plt.subplots(figsize=(5.5, 4.5), dpi=110)
    ax.plot([0, top], [0, top], color="grey", linestyle="--", label="y = x (bound = claim)")
    for c, b, v, lab in pts:
        ax.scatter([c], [b], color="red" if v else "tab:blue", zorder=3)
        ax.annotate(lab, (c, b), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("claimed epsilon (what the audit tested)")
    ax.set_ylabel("empirical lower bound on epsilon")
    ax.set_title(f"{verdict}: " + ("a lower bound above its claim refutes it" if verdict == "FAIL"
                                   else "every lower bound is at or below its claim"),
                 fontsize=10, color="red" if verdict == "FAIL" else "green")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path, verdict


def md_table_html(md: str) -> str:
    """A Markdown pipe table (header, separator, rows) as an HTML table, cells escaped; lines
    that are not table rows become paragraphs."""
    out, rows = [], []

    def flush() -> None:
        if rows:
            head, *body = rows
            out.append("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in head)
                       + "</tr>" + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>"
                                                             for c in r) + "</tr>" for r in body)
                       + "</table>")
            rows.clear()

    for line in md.splitlines():
        t = line.strip()
        if t.startswith("|") and t.endswith("|"):
            cells = [c.strip() for c in t[1:-1].split("|")]
            if not all(set(c) <= set("-: ") for c in cells):
                rows.append(cells)
            continue
        flush()
        if t:
            out.append(f"<p>{html.escape(t.lstrip('#').strip())}</p>")
    flush()
    return "".join(out)


def script_json(obj: Any) -> str:
    """JSON for a ``<script type="application/json">`` element: not HTML-escaped (a script's
    content is raw text), only ``</`` written as ``<\\/`` so that no ``</script>`` can end it."""
    return json.dumps(obj, default=str).replace("</", "<\\/")


AUDIT_COLUMNS = ("mode", "strategy", "unit", "sampling", "engine", "dataset", "model",
                 "canaries", "claimed_epsilon", "lower_bound", "one_run_epsilon",
                 "one_run_fdp_epsilon", "gaussian_epsilon", "significance", "delta",
                 "violates_claim")


def is_audit(run: dict[str, Any]) -> bool:
    """A ``dpclip audit`` record (summary with a lower bound and a claim), not a training run."""
    return "lower_bound" in run["summary"] and "claimed_epsilon" in run["summary"]


def audit_table(audits: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per stored audit: the claimed epsilon next to the lower bound and its confidence."""
    rows = []
    for r in audits:
        s = r["summary"]
        row = {k: s.get(k) for k in AUDIT_COLUMNS}
        row["mode"] = s.get("mode", s.get("design"))
        row["confidence"] = 1 - float(s.get("significance") or 0.05)
        row["run_id"] = r["id"]
        rows.append(row)
    return rows


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return {True: "yes", False: "no", None: "-"}[v]
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _audit_markdown(rows: list[dict[str, Any]]) -> str:
    cols = ["run_id", "mode", "strategy", "unit", "sampling", "engine", "dataset", "model",
            "canaries", "claimed_epsilon", "lower_bound", "confidence", "one_run_epsilon",
            "one_run_fdp_epsilon", "gaussian_epsilon", "violates_claim"]
    out = ["## Audits (`dpclip audit`): claimed epsilon vs empirical lower bound", "",
           "A lower bound above the claim (`violates_claim`) refutes the claim; an audit never "
           "proves one. White-box claims are one step's epsilon; black-box claims the whole "
           "run's. See docs/audit.md.", "",
           "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(out) + "\n"


def _audit_html(rows: list[dict[str, Any]], plot: tuple[Path, str] | None = None) -> str:
    if not rows:
        return ""
    cols = list(rows[0])
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in cols)
                   + "</tr>" for r in rows)
    fig = ""
    if plot is not None:
        path, verdict = plot
        cap = f"{verdict}: claimed epsilon vs empirical lower bound (y = x dashed)"
        fig = (f'<figure><img alt="{html.escape(cap)}" src="data:image/png;base64,'
               f'{base64.b64encode(path.read_bytes()).decode()}"/>'
               f"<figcaption>{html.escape(cap)}</figcaption></figure>")
    return (f"<h2>Audits: claimed epsilon vs empirical lower bound</h2>{fig}<table><tr>{head}</tr>"
            f"{body}</table>")


def _audit_only_report(out: Path, experiment: str, rows: list[dict[str, Any]]) -> Report:
    md_path = out / f"{experiment}.md"
    plot = audit_plot(rows, out / f"{experiment}_audit.png")
    md = f"# Experiment `{experiment}`\n\n{len(rows)} audits.\n\n" + _audit_markdown(rows)
    if plot is not None:
        md += f"\n**{plot[1]}**\n\n![claimed epsilon vs lower bound]({plot[0].name})\n"
    md_path.write_text(md)
    html_path = out / f"{experiment}.html"
    html_path.write_text(
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"/>"
        f"<title>dpclip report: {html.escape(experiment)}</title>{_STYLE}</head><body>"
        f"<h1>Experiment {html.escape(experiment)}</h1>{_audit_html(rows, plot)}"
        f"<script type=\"application/json\" id=\"audits\">{script_json(rows)}"
        "</script></body></html>\n")
    return Report(md_path, html_path, [plot[0]] if plot else [], rows)


_STYLE = ("<style>body{font-family:sans-serif;max-width:1000px;margin:2em auto}"
          "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;"
          "padding:4px 8px}figure{display:inline-block;margin:8px}.warn{color:#b00}</style>")


def _diagnostic_plots(runs: list[dict[str, Any]], out: Path,
                      experiment: str) -> list[tuple[str, Path]]:
    """The clipping-diagnostic figures (norm quantiles, cosine, bias) of each source that the
    runs logged (``heldout/`` or ``nonprivate/``)."""
    plots: list[tuple[str, Path]] = []
    for prefix, source in DIAGNOSTIC_SOURCES.items():
        tag = prefix.rstrip("/")
        qkey = prefix + DIAGNOSTIC_PLOTS["norm_quantiles"][0]
        keys = sorted({k for r in runs for h in r["history"] for k in h if k.startswith(qkey)})
        if keys:
            series = {}
            for k in keys:
                for lab, xy in _series(runs, k).items():
                    series[f"{lab} {k.removeprefix(prefix + 'norm_')}"] = xy
            title = f"{DIAGNOSTIC_PLOTS['norm_quantiles'][1]} ({source})"
            p = _plot(series, title, "norm", out / f"{experiment}_{tag}_norm_quantiles.png",
                      logy=True)
            if p:
                plots.append((title, p))
        for name in ("cosine", "bias"):
            key, title = DIAGNOSTIC_PLOTS[name]
            title = f"{title} ({source})"
            p = _plot(_series(runs, prefix + key), title, name,
                      out / f"{experiment}_{tag}_{name}.png")
            if p:
                plots.append((title, p))
    return plots


def _html_rows(levels: list[str], rows: list[dict[str, Any]]) -> list[str]:
    """The HTML rows of the accuracy table (best mean per column in bold)."""
    best = _best(levels, rows)
    trs = []
    for r in rows:
        tds = [f"<td>{html.escape(r['strategy'])}</td>"]
        for lev in levels:
            if lev not in r:
                tds.append("<td>-</td>")
                continue
            c = r[lev]
            text = html.escape(f"{_pm(c['mean'], c['std'], c['n'], '±')} (n={c['n']}, "
                               f"ε {c['epsilon']:.2f})")
            flag = ' <span class="warn">(diverged)</span>' if c.get("diverged") else ""
            tds.append(f"<td><b>{text}</b>{flag}</td>" if best.get(lev) == r["strategy"]
                       else f"<td>{text}{flag}</td>")
        trs.append("<tr>" + "".join(tds) + "</tr>")
    return trs


def build_report(store: ResultsStore, experiment: str, out_dir: str | Path) -> Report:
    """Write ``<out>/<experiment>.md``, ``<experiment>.html`` and the PNG plots.

    Stored audits (``dpclip audit``, experiment ``audit`` by default) get their own table: the
    claimed epsilon next to the lower bound and its confidence."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = collect_runs(store, experiment)
    if not runs:
        raise ValueError(f"no finished runs of experiment {experiment!r} in {store.path}; "
                         "run it first with `dpclip run`")
    audits = audit_table([r for r in runs if is_audit(r)])
    runs = [r for r in runs if not is_audit(r)]
    if not runs:
        return _audit_only_report(out, experiment, audits)
    levels, rows = accuracy_table(runs)
    plots: list[tuple[str, Path]] = []
    federated = is_federated(runs)
    unit = "round" if federated else "epoch"
    pu = privacy_utility_plot(levels, rows, out / f"{experiment}_privacy_utility.png")
    if pu:
        plots.append(("privacy-utility: test accuracy vs epsilon spent, per strategy", pu))
    for key, title, ylabel, logy in accuracy_plots(unit):
        p = _plot(_series(runs, key), title, ylabel, out / f"{experiment}_{key}.png", logy,
                  xlabel=unit)
        if p:
            plots.append((title, p))
    plots += _diagnostic_plots(runs, out, experiment)
    first = runs[0]["config"]
    scope = ("user-level DP-FedAvg (privacy unit: user; epoch = round); " if federated else "")
    header = (f"# Experiment `{experiment}`\n\n{len(runs)} finished runs; {scope}dataset(s) "
              f"{sorted({r['config']['dataset'] for r in runs})}, model(s) "
              f"{sorted({r['config']['model'] for r in runs})}, delta {deltas_text(runs)}, "
              f"accountant {first['accountant']}, sampling {first['sampling']}.\n\n"
              "Test accuracy (%), mean +- std over seeds; best mean per column in bold; "
              "eps = largest epsilon spent in the cell.\n\n")
    seeded = seeded_runs(runs)
    if seeded:
        header += (f"**Warning: {len(seeded)} of {len(runs)} runs used {SEEDED_NOTE}.**\n\n")

    tuned = tuning_table([dict(r["summary"], label=r["label"]) for r in runs])
    div = [(f"{r['label'] or r['config']['strategy']} {_level(r)} seed "
            f"{r['config'].get('seed')}", why) for r in runs if (why := diverged(r))]
    div_md = ("**Diverged runs** (flagged `(diverged)` in the table):\n\n"
              + "\n".join(f"- {who}: {why}" for who, why in div) + "\n\n") if div else ""
    md = (header + _markdown_table(levels, rows) + "\n\n" + div_md
          + "## Settings and cost per strategy\n\n"
          + settings_table(runs) + "\n" + "\n".join(tuned) + "\n\n")
    md += "\n".join(f"![{t}]({p.name})" for t, p in plots) + "\n"
    audit_fig = audit_plot(audits, out / f"{experiment}_audit.png") if audits else None
    if audits:
        md += "\n" + _audit_markdown(audits)
        if audit_fig is not None:
            md += (f"\n**{audit_fig[1]}**\n\n![claimed epsilon vs lower bound]"
                   f"({audit_fig[0].name})\n")
    md_path = out / f"{experiment}.md"
    md_path.write_text(md)

    def img(p: Path) -> str:
        return base64.b64encode(p.read_bytes()).decode()

    trs = _html_rows(levels, rows)
    ths = "".join(f"<th>{html.escape(lev)}</th>" for lev in levels)
    figs = "\n".join(
        f'<figure><img alt="{html.escape(t)}" src="data:image/png;base64,{img(p)}"/>'
        f"<figcaption>{html.escape(t)}</figcaption></figure>" for t, p in plots)
    page = (
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"/>"
        f"<title>dpclip report: {html.escape(experiment)}</title>{_STYLE}</head><body>"
        f"<h1>Experiment {html.escape(experiment)}</h1>"
        f"<p>{html.escape(header.splitlines()[2])}</p>"
        + (f"<p><b>Warning: {len(seeded)} of {len(runs)} runs used "
           f"{html.escape(SEEDED_NOTE)}.</b></p>" if seeded else "") +
        f"<table><tr><th>strategy</th>{ths}</tr>{''.join(trs)}</table>"
        + ("<p class=\"warn\">Diverged runs:</p><ul>" + "".join(
            f"<li>{html.escape(who)}: {html.escape(why)}</li>" for who, why in div) + "</ul>"
           if div else "")
        + f"<h2>Settings and cost per strategy</h2>{md_table_html(settings_table(runs))}"
        + (md_table_html(chr(10).join(tuned)) if tuned else "") +
        f"{figs}{_audit_html(audits, audit_fig)}<script type=\"application/json\" "
        f"id=\"table\">{script_json(rows)}</script></body></html>\n"
    )
    html_path = out / f"{experiment}.html"
    html_path.write_text(page)
    return Report(md_path, html_path, [p for _, p in plots]
                  + ([audit_fig[0]] if audit_fig is not None else []), rows)
