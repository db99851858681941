"""A/B step-time check of two source trees, interleaved: ``dpclip bench`` cells run alternately
with the baseline's ``src`` and the candidate's ``src`` on ``PYTHONPATH``, several rounds, so that
both see the same (shared, noisy) machine. The number compared is each cell's ratio to the
non-private step of the same process (``x non-private``), the figure of cpu_engines_v02.

    python benchmarks/ab_steptime.py --base /tmp/base/src --name cpu_engines_issue32 \
        [--cells mlp:256:200,papernot-cnn:256:30] [--rounds 3] [--threads 1] [--no-memory]

Rows (one per round, tree and cell; device and torch version included) go to
``benchmarks/results/<name>.json``; the Markdown beside it gives, per cell, the median ratio of
each tree over the rounds and the candidate's change in percent, next to cpu_engines_v02's ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
DEFAULT_CELLS = "mlp:256:200,mlp:1024:200,papernot-cnn:256:30,papernot-cnn:1024:12"


def run_cell(src: str, model: str, batch: int, steps: int, threads: int,
             memory: bool = True) -> dict:
    env = {**os.environ, "PYTHONPATH": src, "DPCLIP_ALLOCATOR": "system",
           "DPCLIP_BENCH_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "dpclip.cli", "bench", "--model", model, "--batch-size",
           str(batch), "--steps", str(steps), "--warmup", "2", "--method", "nonprivate",
           "--method", "dpclip-ghost", "--json"]
    if not memory:  # the same timed steps (run_bench), without the memory probes' processes
        cmd = [sys.executable, "-c",
               "import json; from dpclip.bench import run_bench; print(json.dumps(run_bench("
               f"{model!r}, {batch}, methods=['nonprivate', 'dpclip-ghost'], steps={steps}, "
               "warmup=2, measure_memory=False)))"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"bench failed ({src}, {model} {batch}):\n{out.stderr[-2000:]}")
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    return {r["method"]: r for r in rows}


def _mem_cells(rows: list[dict], trees: dict, model: str, batch: int) -> str:
    """The median step-extra memory of each tree (non-private, then dpclip-ghost)."""
    cells = []
    for key in ("extra_mem_mb_nonprivate", "extra_mem_mb_dpclip_ghost"):
        vals = []
        for t in trees:
            got = [r[key] for r in rows if r["tree"] == t and r["model"] == model
                   and r["batch_size"] == batch and r.get(key) is not None]
            vals.append(f"{statistics.median(got):.1f}" if got else "-")
        cells.append(" / ".join(vals))
    return " " + " | ".join(cells) + " |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the baseline's src folder")
    ap.add_argument("--candidate", default=str(ROOT.parent / "src"))
    ap.add_argument("--name", default="cpu_engines_ab")
    ap.add_argument("--cells", default=DEFAULT_CELLS, help="model:batch:steps,...")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--revs", default="",
                    help="'BASE_REV,CANDIDATE_REV': the revisions the trees are, written into "
                         "every row and the table (e.g. 'ab7fcbd (0.2.0),<commit>')")
    ap.add_argument("--append", action="store_true",
                    help="add the rows to those already in <name>.json (cells measured in "
                         "separate invocations; the table covers every cell of the file)")
    ap.add_argument("--no-memory", action="store_true",
                    help="skip the memory probes (a child process per method and cell): only "
                         "step times are compared, in a fraction of the time")
    args = ap.parse_args()
    import torch

    cells = [(m, int(b), int(s)) for m, b, s in (c.split(":") for c in args.cells.split(","))]
    trees = {"base": args.base, "candidate": args.candidate}
    given = [r.strip() for r in args.revs.split(",")] if args.revs else []
    revs = dict(zip(trees, given + [""] * (2 - len(given))))
    out = ROOT / "results"
    path = out / f"{args.name}.json"
    rows: list[dict] = json.loads(path.read_text()) if args.append and path.exists() else []
    for rnd in range(args.rounds):
        for model, batch, steps in cells:
            order = list(trees.items()) if rnd % 2 == 0 else list(trees.items())[::-1]
            for tree, src in order:
                res = run_cell(src, model, batch, steps, args.threads, not args.no_memory)
                ghost = res["dpclip-ghost"]
                rows.append({"round": rnd, "tree": tree, "model": model, "batch_size": batch,
                             "ms_nonprivate": res["nonprivate"]["ms_per_step"],
                             "ms_dpclip_ghost": ghost["ms_per_step"],
                             "ratio_to_nonprivate": ghost["ratio_to_nonprivate"],
                             # (the memory probes' figures: None with --no-memory)
                             "extra_mem_mb_nonprivate": res["nonprivate"].get("extra_mem_mb"),
                             "extra_mem_mb_dpclip_ghost": ghost.get("extra_mem_mb"),
                             "peak_mem_mb_dpclip_ghost": ghost.get("peak_mem_mb"),
                             "device": "cpu", "threads": args.threads, "revision": revs[tree],
                             "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")})
                print(json.dumps(rows[-1]), flush=True)
        path.write_text(json.dumps(rows, indent=1) + "\n")  # after every round: a cut run keeps it
    v02 = {}
    ref = out / "cpu_engines_v02.json"
    if ref.exists():
        for r in json.loads(ref.read_text()):
            if r["allocator"] == "glibc" and r["method"] == "dpclip-ghost":
                v02[(r["model"], r["batch_size"])] = r["ratio_to_nonprivate"]
    cell_keys = list(dict.fromkeys((r["model"], r["batch_size"]) for r in rows))
    rounds = ", ".join(
        f"{m} {b}: " + str(sum(r["tree"] == "candidate" and (r["model"], r["batch_size"]) == (m, b)
                               for r in rows)) for m, b in cell_keys)
    # the step's extra memory over its baseline (run_all's probe), where the rows have it
    with_mem = any(r.get("extra_mem_mb_dpclip_ghost") is not None for r in rows)
    mem_head = (" step extra MB non-private, base / candidate | step extra MB dpclip-ghost, "
                "base / candidate |") if with_mem else ""
    lines = [f"# A/B step time, `{args.name}` (generated by benchmarks/ab_steptime.py)", "",
             f"dpclip-ghost step time as a multiple of the non-private step of the same process, "
             f"median over the interleaved rounds (base and candidate alternate; rounds per "
             f"cell: {rounds}), CPU, "
             f"{args.threads} thread(s), glibc, torch {torch.__version__}."
             + (f" Base: {revs['base']}; candidate: {revs['candidate']}." if args.revs else ""),
             "",
             "| model | batch | x non-private, base | x non-private, candidate | change % | "
             "cpu_engines_v02 (glibc) | ms non-private, base / candidate | "
             "ms dpclip-ghost, base / candidate |" + mem_head, "|---|---|---|---|---|---|---|---|"
             + "---|" * mem_head.count("|")]
    for model, batch in cell_keys:
        med = {t: statistics.median(r["ratio_to_nonprivate"] for r in rows
                                    if r["tree"] == t and r["model"] == model
                                    and r["batch_size"] == batch) for t in trees}
        ms = {(t, k): statistics.median(r[k] for r in rows if r["tree"] == t
                                        and r["model"] == model and r["batch_size"] == batch)
              for t in trees for k in ("ms_nonprivate", "ms_dpclip_ghost")}
        change = 100.0 * (med["candidate"] / med["base"] - 1.0)
        ref_v = v02.get((model, batch))
        lines.append(f"| {model} | {batch} | {med['base']:.2f} | {med['candidate']:.2f} | "
                     f"{change:+.1f} | " + (f"{ref_v:.2f}" if ref_v is not None else "-") +
                     f" | {ms['base', 'ms_nonprivate']:.2f} / "
                     f"{ms['candidate', 'ms_nonprivate']:.2f} | "
                     f"{ms['base', 'ms_dpclip_ghost']:.2f} / "
                     f"{ms['candidate', 'ms_dpclip_ghost']:.2f} |" + (_mem_cells(
                         rows, trees, model, batch) if with_mem else ""))
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
