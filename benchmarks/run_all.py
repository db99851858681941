"""`make bench`: the step-time and memory table of dpclip's engines and Opacus, under glibc and
(when installed) jemalloc without purging; with `--device cuda`, on the GPU.

Each (model, batch) cell runs in a fresh `dpclip bench --json` process per allocator; methods are
interleaved inside that process, so each ratio compares steps taken side by side (the machine is
shared: absolute times are noisy, ratios much less). Memory is measured per method in a fresh
child process: the absolute peak and the step's extra memory over the baseline right before its
first step (see dpclip.bench). Rows go to benchmarks/results/<name>.json and a Markdown table
generated from them to benchmarks/results/<name>.md.

    python benchmarks/run_all.py [--name cpu_engines] [--models mlp,transformer] [--large]
                                 [--methods nonprivate,dpclip-ghost] [--steps N] [--threads 1]
                                 [--allocators glibc,jemalloc] [--append]
    python benchmarks/run_all.py --device cuda     # -> gpu_engines.json / .md, every cell

On CUDA there is one allocator (PyTorch's caching allocator), so each cell runs once; all cells,
the large ones included, run with more timed steps. Opacus methods are left out (with a note on
stderr) where Opacus is not installed. The default name was `cpu_vmap` before the ghost engine;
`--name cpu_vmap` still works (any name).
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
#: on a GPU every step is fast: all cells, with more timed steps
GPU_CELLS = [
    ("mlp", 256, 300), ("mlp", 1024, 300),
    ("papernot-cnn", 256, 200), ("papernot-cnn", 1024, 200),
    ("cifar-cnn", 256, 100), ("transformer", 256, 100),
    ("cifar-cnn", 1024, 50), ("transformer", 1024, 50),
]
DEFAULT_NAME = {"cpu": "cpu_engines", "cuda": "gpu_engines"}


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


def _num(v: object, fmt: str) -> str:
    """``v`` formatted, or ``-`` when it is missing, None or NaN (older rows, small steps)."""
    if v is None or not isinstance(v, (int, float)) or v != v:
        return "-"
    return format(v, fmt)


def markdown(rows: list[dict]) -> str:
    """One table per (device, allocator): rows (model, batch, method) with time ratios to the
    non-private step, the absolute peak memory and the step's extra memory over its baseline with
    its ratio to the non-private step's (``-`` where that is below the measurement's resolution,
    or for rows written before it was measured). The CPU-time ratio is shown on CPU only."""
    out = []
    groups = sorted({(r.get("device", "cpu"), r["allocator"]) for r in rows},
                    key=lambda g: (g[0] != "cpu", g[1] != "glibc", g))
    for dev, alloc in groups:
        on_cpu = dev == "cpu"
        head = ["model", "batch", "method", "ms/step", "IQR %", "x non-private"]
        head += ["x non-private (CPU time)"] if on_cpu else []
        head += ["peak MB", "step extra MB", "x non-private extra mem"]
        out += [f"### {alloc}" if on_cpu else f"### {dev} ({alloc})", "",
                "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            if (r.get("device", "cpu"), r["allocator"]) != (dev, alloc):
                continue
            method = r["method"] + (f" ({r['engine']})" if r.get("engine") and
                                    r["method"] == "dpclip-auto" else "")
            cells = [r["model"], str(r["batch_size"]), method, _num(r["ms_per_step"], ".2f"),
                     _num(_iqr_pct(r), ".0f"), _num(r["ratio_to_nonprivate"], ".2f")]
            if on_cpu:
                cells.append(_num(r.get("cpu_ratio_to_nonprivate"), ".2f"))
            cells += [_num(r["peak_mem_mb"], ".0f"), _num(r.get("extra_mem_mb"), ".1f"),
                      _num(r.get("extra_mem_ratio_to_nonprivate"), ".2f")]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def header(name: str, rows: list[dict]) -> str:
    """The title and method note of the generated Markdown file."""
    on_gpu = any(r.get("device", "cpu") != "cpu" for r in rows)
    mem = ("peak memory allocated by tensors (torch.cuda.max_memory_allocated, model and batch "
           "included)" if on_gpu else "peak RSS (interpreter, torch and model included)")
    return (f"# Step time and peak memory, `{name}` (generated by benchmarks/run_all.py)\n\n"
            "Median of interleaved steps in one process (IQR in % of the median). One optimizer "
            "step per timed step, noise multiplier 1, clip 1. Memory, per method in a fresh "
            f"process after two warm-up steps at batch 2: *peak MB* is the {mem}; *step extra "
            "MB* is that peak minus the memory right before the first full-batch step, i.e. what "
            "the training step itself needs; its ratio to the non-private step's is the number "
            "to compare (`-` when the non-private step needs under 1 MB).\n\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu (default; glibc and jemalloc tables) or cuda (one table, all cells)")
    ap.add_argument("--name", default=None,
                    help="results file name (default cpu_engines, or gpu_engines with cuda)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per cell (default: "
                    "per cell, 5 to 200 on CPU, 50 to 300 on CUDA)")
    ap.add_argument("--models", default=None, help="comma list (default: all cells)")
    ap.add_argument("--methods", default=None, help="comma list (default: dpclip.bench "
                    "DEFAULT_METHODS)")
    ap.add_argument("--large", action="store_true", help="also CIFAR CNN and transformer at 1024 "
                    "(always on with --device cuda)")
    ap.add_argument("--allocators", default=None, help="comma list of glibc,jemalloc (CPU only)")
    ap.add_argument("--append", action="store_true",
                    help="merge into the existing <name>.json (rows of re-run cells are replaced)")
    ap.add_argument("--threads", type=int, default=None,
                    help="intra-op threads (default 2; 1 on a machine shared with other jobs)")
    args = ap.parse_args()
    name = args.name or DEFAULT_NAME[args.device]
    if args.device == "cuda":
        if args.allocators:
            ap.error("--allocators is for --device cpu: on CUDA the caching allocator is the one")
        cells = list(GPU_CELLS)
        envs = {"cuda-caching": {"DPCLIP_ALLOCATOR": "system"}}
    else:
        cells = CELLS + (LARGE if args.large else [])
        envs = allocators()
        if args.allocators:
            envs = {k: v for k, v in envs.items() if k in args.allocators.split(",")}
    cells = [c for c in cells if args.models is None or c[0] in args.models.split(",")]
    rows: list[dict] = []
    for alloc, extra in envs.items():
        for model, b, steps in cells:
            cmd = [sys.executable, "-m", "dpclip.cli", "bench", "--model", model,
                   "--batch-size", str(b), "--steps", str(args.steps or steps), "--warmup",
                   "2" if args.device == "cpu" else "5", "--device", args.device, "--json"]
            for m in (args.methods.split(",") if args.methods else []):
                cmd += ["--method", m]
            print(f"[{alloc}] {model} B={b} ...", file=sys.stderr, flush=True)
            env = {**os.environ, **extra}
            if args.threads:
                env["DPCLIP_BENCH_THREADS"] = str(args.threads)
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if out.stderr.strip() and out.returncode == 0:
                notes = [ln for ln in out.stderr.splitlines() if ln.startswith("dpclip bench:")]
                if notes:
                    print("\n".join(notes), file=sys.stderr)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"bench failed for {model} B={b} ({alloc})")
            rows.extend(json.loads(out.stdout.strip().splitlines()[-1]))
    out_dir = ROOT / "results"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / f"{name}.json"
    if args.append and path.exists():
        def key(r: dict) -> tuple:
            return r["model"], r["batch_size"], r.get("device", "cpu"), r["allocator"]

        new_cells = {key(r) for r in rows}
        old = [r for r in json.loads(path.read_text()) if key(r) not in new_cells]
        order = {m: i for i, (m, _, _) in enumerate(CELLS + LARGE)}
        rows = sorted(old + rows, key=lambda r: (r["allocator"] != "glibc",
                                                  order.get(r["model"], 99), r["batch_size"]))
    path.write_text(json.dumps(rows, indent=1) + "\n")
    (out_dir / f"{name}.md").write_text(header(name, rows) + markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
