"""The ghost engine's step time before / after the batch-independent book-keeping bounds (blocks
of 64 examples, cancelling examples formed directly; merge of branch fixghost), measured with
`dpclip bench` on the same machine, rounds interleaved (before, after, before, after, ...).

    python benchmarks/ghost_bk_blocks.py --before /path/to/checkout-before [--rounds 3]

`--before` is a checkout of the code before the change (its `src` is put first on PYTHONPATH);
the "after" runs use this checkout. Rows (the `dpclip bench --json` fields plus `variant`, `round`)
go to benchmarks/results/ghost_bk_blocks_cpu.json, the table to ghost_bk_blocks_cpu.md."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results"


def bench(src: Path, model: str, batch: int, steps: int) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(src))
    cmd = [sys.executable, "-m", "dpclip", "bench", "--model", model, "--batch-size", str(batch),
           "--method", "nonprivate", "--method", "dpclip-ghost", "--steps", str(steps), "--json"]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    out = ["# Ghost engine before / after batch-independent book-keeping bounds "
           "(generated from ghost_bk_blocks_cpu.json by benchmarks/ghost_bk_blocks.py)", "",
           "| model | batch | allocator | variant | rounds | ghost ms/step (median of rounds) | "
           "ratio to non-private (median) | ratios per round | peak mem MB |",
           "|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["model"], r["batch_size"], r["allocator"], r["variant"]) for r in rows
                   if r["method"] == "dpclip-ghost"}, key=lambda k: (k[0], k[1], k[3] != "before"))
    for m, b, a, v in keys:
        rs = [r for r in rows if (r["model"], r["batch_size"], r["allocator"], r["variant"],
                                  r["method"]) == (m, b, a, v, "dpclip-ghost")]
        ratios = [r["ratio_to_nonprivate"] for r in rs]
        out.append(f"| {m} | {b} | {a} | {v} | {len(rs)} | "
                   f"{statistics.median(r['ms_per_step'] for r in rs):.2f} | "
                   f"{statistics.median(ratios):.2f} | {', '.join(f'{x:.2f}' for x in ratios)} | "
                   f"{max(r['peak_mem_mb'] for r in rs):.0f} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--models", default="mlp,papernot-cnn")
    ap.add_argument("--batch-size", type=int, default=256)
    a = ap.parse_args()
    rows = []
    for rnd in range(1, a.rounds + 1):
        for model in a.models.split(","):
            for variant, src in (("before", a.before / "src"), ("after", ROOT / "src")):
                for r in bench(src, model, a.batch_size, a.steps):
                    rows.append(dict(r, variant=variant, round=rnd))
                print(f"round {rnd} {model} {variant} done", file=sys.stderr)
    (OUT / "ghost_bk_blocks_cpu.json").write_text(json.dumps(rows, indent=1) + "\n")
    md = table(rows)
    (OUT / "ghost_bk_blocks_cpu.md").write_text(md)
    sys.stdout.write(md)


if __name__ == "__main__":
    main()
