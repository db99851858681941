"""Markdown table of benchmarks/results/ghost_bk_blocks_cpu.json: the ghost engine's step time
before / after the batch-independent book-keeping bounds (blocks of 64 examples, cancelling
examples formed directly), interleaved runs of `dpclip bench --batch-size 256` on a heavily loaded
2-core CPU: indicative only."""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent / "results"


def main() -> None:
    rows = json.loads((HERE / "ghost_bk_blocks_cpu.json").read_text())
    out = ["| model | run | variant | ghost ms/step | non-private ms/step | ratio |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['run']} | {r['variant']} | {r['ghost_ms']:.1f} | "
                   f"{r['nonprivate_ms']:.1f} | {r['ghost_ms'] / r['nonprivate_ms']:.2f} |")
    (HERE / "ghost_bk_blocks_cpu.md").write_text("\n".join(out) + "\n")
    sys.stdout.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
