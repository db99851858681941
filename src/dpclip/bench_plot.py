"""``dpclip bench --plot FILE.html``: the benchmark as a picture, in one self-contained HTML file.

A bar per method (ms per step, the non-private step included), each labelled with its ratio to
the non-private step and its peak memory; the PNG is written beside the HTML and embedded in it
as base64, with the rows as an HTML table. Privacy: none (timings of synthetic batches).
"""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

__all__ = ["bench_report"]


def bench_report(rows: list[dict[str, Any]], path: str | Path) -> tuple[Path, Path]:
    """Write ``path`` (HTML) and ``path`` with ``.png``; return both paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        raise ValueError("bench_report: no benchmark rows to plot")
    html_path = Path(path)
    if html_path.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"--plot {str(path)!r}: give an .html file (the PNG is written beside it)")
    html_path.parent.mkdir(parents=True, exist_ok=True)
    png = html_path.with_suffix(".png")
    labels = [f"{r['method']}\nB={r['batch_size']}" for r in rows]
    ms = [float(r["ms_per_step"]) for r in rows]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(rows) + 2), 4.2), dpi=110)
    bars = ax.bar(range(len(rows)), ms, color="tab:blue")
    for bar, r in zip(bars, rows):
        ratio = r.get("ratio_to_nonprivate")
        peak = r.get("peak_mem_mb")
        text = (f"x{ratio:.2f}" if isinstance(ratio, (int, float)) else "") + (
            f"\n{peak:.0f} MB" if isinstance(peak, (int, float)) else "")
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                    textcoords="offset points")
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("ms per step (median)")
    first = rows[0]
    ax.set_title(f"{first['model']} on {first.get('device', 'cpu')}: step time per method "
                 "(x = ratio to the non-private step)", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    cols = [c for c in ("model", "batch_size", "method", "engine", "device", "ms_per_step",
                        "ratio_to_nonprivate", "peak_mem_mb", "extra_mem_mb", "threads")
            if any(c in r for r in rows)]

    def cell(v: Any) -> str:
        return html.escape(f"{v:.4g}" if isinstance(v, float) else str(v))

    table = ("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in cols) + "</tr>"
             + "".join("<tr>" + "".join(f"<td>{cell(r.get(c, '-'))}</td>" for c in cols)
                       + "</tr>" for r in rows) + "</table>")
    img = base64.b64encode(png.read_bytes()).decode()
    html_path.write_text(
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"/><title>dpclip bench</title>"
        "<style>body{font-family:sans-serif;max-width:1000px;margin:2em auto}table{border-"
        "collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px}</style></head><body>"
        f"<h1>dpclip bench: {html.escape(str(first['model']))}</h1>"
        f'<figure><img alt="step time per method" src="data:image/png;base64,{img}"/>'
        f"</figure>{table}</body></html>\n")
    return html_path, png
