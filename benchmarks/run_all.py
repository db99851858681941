"""`make bench`: the step-time and memory table of dpclip's engines and Opacus, under glibc and
(when installed) jemalloc without purging.

Each (model, batch) cell runs in a fresh `dpclip bench --json` process per allocator; methods are
interleaved inside that process, so each ratio compares steps taken side by side (the machine is
shared: absolute times are noisy, ratios much less). Peak memory is measured per method in a fresh
child process. Rows go to benchmarks/results/<name>.json and a Markdown table generated from them to
benchmarks/results/<name>.md.

    python benchmarks/run_all.py [--name cpu_engines] [--models mlp,transformer] [--large]
                                 [--methods nonprivate,dpclip-ghost] [--steps N] [--threads 1]
                                 [--allocators glibc,jemalloc] [--append]

The default name was `cpu_vmap` before the ghost engine; `--name cpu_vmap` still works (any name).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
#: (model, batch, timed steps); the cells marked large run with --large only
CELLS = [
    ("mlp", 256, 200), ("mlp", 1024, 200),
    ("papernot-cnn", 256, 30), ("papernot-cnn", 1024, 12),
    ("cifar-cnn", 256, 8), ("transformer", 256, 8),
]
LARGE = [("cifar-cnn", 1024, 5), ("transformer", 1024, 5)]


def allocators() -> dict[str, dict[str, str]]:
    # DPCLIP_ALLOCATOR=system: the CLI must not switch allocators by itself (dpclip.runtime)
    envs = {"glibc": {"DPCLIP_ALLOCATOR": "system"}}
    if os.path.exists(JEMALLOC):
        envs["jemalloc"] = {"LD_PRELOAD": JEMALLOC, "MALLOC_CONF": JEMALLOC_CONF,
                            "DPCLIP_ALLOCATOR": "system"}
    else:
        print(f"note: {JEMALLOC} not found (Debian package libjemalloc2); glibc only",
              file=sys.stderr)
    return envs


def _iqr_pct(r: dict) -> float:
    lo, hi = r["ms_iqr"]
    return 100.0 * (hi - lo) / r["ms_per_step"] if r["ms_per_step"] else float("nan")


def markdown(rows: list[dict]) -> str:
    """One table per allocator: rows (model, batch, method), with ratios to non-private."""
    out = []
    for alloc in sorted({r["allocator"] for r in rows}, key=lambda a: a != "glibc"):
        out += [f"### {alloc}", "",
                "| model | batch | method | ms/step | IQR % | x non-private | x non-private (CPU "
                "time) | peak MB | x non-private mem |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r["allocator"] != alloc:
                continue
            method = r["method"] + (f" ({r['engine']})" if r.get("engine") and
                                    r["method"] == "dpclip-auto" else "")
            out.append(
                f"| {r['model']} | {r['batch_size']} | {method} | {r['ms_per_step']:.2f} | "
                f"{_iqr_pct(r):.0f} | {r['ratio_to_nonprivate']:.2f} | "
                f"{r.get('cpu_ratio_to_nonprivate', float('nan')):.2f} | {r['peak_mem_mb']:.0f} | "
                f"{r.get('mem_ratio_to_nonprivate', float('nan')):.2f} |")
        out.append("")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", default="cpu_engines")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per cell (default: "
                    "per cell, 5 to 200)")
    ap.add_argument("--models", default=None, help="comma list (default: all cells)")
    ap.add_argument("--methods", default=None, help="comma list (default: dpclip.bench "
                    "DEFAULT_METHODS)")
    ap.add_argument("--large", action="store_true", help="also CIFAR CNN and transformer at 1024")
    ap.add_argument("--allocators", default=None, help="comma list of glibc,jemalloc")
    ap.add_argument("--append", action="store_true",
                    help="merge into the existing <name>.json (rows of re-run cells are replaced)")
    ap.add_argument("--threads", type=int, default=None,
                    help="intra-op threads (default 2; 1 on a machine shared with other jobs)")
    args = ap.parse_args()
    cells = CELLS + (LARGE if args.large else [])
    cells = [c for c in cells if args.models is None or c[0] in args.models.split(",")]
    envs = allocators()
    if args.allocators:
        envs = {k: v for k, v in envs.items() if k in args.allocators.split(",")}
    rows: list[dict] = []
    for alloc, extra in envs.items():
        for model, b, steps in cells:
            cmd = [sys.executable, "-m", "dpclip.cli", "bench", "--model", model,
                   "--batch-size", str(b), "--steps", str(args.steps or steps), "--warmup", "2",
                   "--json"]
            for m in (args.methods.split(",") if args.methods else []):
                cmd += ["--method", m]
            print(f"[{alloc}] {model} B={b} ...", file=sys.stderr, flush=True)
            env = {**os.environ, **extra}
            if args.threads:
                env["DPCLIP_BENCH_THREADS"] = str(args.threads)
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"bench failed for {model} B={b} ({alloc})")
            rows.extend(json.loads(out.stdout.strip().splitlines()[-1]))
    out_dir = ROOT / "results"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / f"{args.name}.json"
    if args.append and path.exists():
        new_cells = {(r["model"], r["batch_size"], r["allocator"]) for r in rows}
        old = [r for r in json.loads(path.read_text())
               if (r["model"], r["batch_size"], r["allocator"]) not in new_cells]
        order = {m: i for i, (m, _, _) in enumerate(CELLS + LARGE)}
        rows = sorted(old + rows, key=lambda r: (r["allocator"] != "glibc",
                                                  order.get(r["model"], 99), r["batch_size"]))
    path.write_text(json.dumps(rows, indent=1) + "\n")
    (out_dir / f"{args.name}.md").write_text(
        f"# Step time and peak memory, `{args.name}` (generated by benchmarks/run_all.py)\n\n"
        "Median of interleaved steps in one process (IQR in % of the median); peak RSS of a fresh "
        "process per method. One optimizer step per timed step, noise multiplier 1, clip 1.\n\n"
        + markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
