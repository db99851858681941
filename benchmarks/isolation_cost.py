"""Cost of a chunk's isolation (dpclip.engine.isolation: own generators, the model's state and
torch's settings taken before and compared after) per ghost step: the same step with it on and
with it replaced by an empty context, interleaved in one process (min and median of ``--rounds``
paired steps). Models: the bench's MLP at B 256 / 1024 with a user loss (a program with user code;
a closed program, dpclip's known loss on a known chain, is never isolated), and the small Hugging
Face configs of benchmarks/hf_models.py.

    PYTHONPATH=src:. python benchmarks/isolation_cost.py [--rounds 30] [--out PATH]

Rows go to benchmarks/results/isolation_cost_cpu.json (+ .md)."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent / "results"


class _Off:
    """The isolation replaced: nothing taken, nothing compared, the caller's generators used."""

    gens = None

    def __init__(self, model: object) -> None:
        pass

    def __enter__(self) -> "_Off":
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def main(argv: list[str] | None = None) -> None:
    import sys

    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    import hf_models as hf
    from memory_watch_cost import _commit, _mlp_case, paired_times

    from dpclip.engine import ghost

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", default=str(OUT / "isolation_cost_cpu.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    real = ghost.Isolated
    cases = {f"mlp B{b} user loss": _mlp_case(b, True) for b in (256, 1024)}
    s = hf.sizes("small")
    for name in ("bert", "llama"):
        cases[f"{name} small"] = hf.build(name, s, "eager")
    rows = []
    dev = torch.device("cpu")
    try:
        for label, (model, x, y, loss) in cases.items():
            step, info = hf.stepper("dpclip-ghost", model, x, y, loss, dev)
            times = paired_times(step, lambda on: setattr(ghost, "Isolated", real if on else _Off),
                                 args.rounds)
            ghost.Isolated = real  # type: ignore[misc]
            on, off = times[True], times[False]
            row = {"case": label, "engine": (info() or {}).get("engine"),
                   "modules": sum(1 for _ in model.modules()),
                   "on_ms_min": round(min(on), 3), "off_ms_min": round(min(off), 3),
                   "on_ms_median": round(statistics.median(on), 3),
                   "off_ms_median": round(statistics.median(off), 3),
                   "extra_us_median": round((statistics.median(on) - statistics.median(off)) * 1e3),
                   "ratio_median": round(statistics.median(on) / statistics.median(off), 4),
                   "rounds": args.rounds, "device": "cpu (shared 2-core machine, 1 thread)",
                   "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                   "commit": _commit(),
                   "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            print(row, flush=True)
            rows.append(row)
    finally:
        ghost.Isolated = real  # type: ignore[misc]
    Path(args.out).write_text(json.dumps(rows, indent=1))
    md = ["# Cost of a chunk's isolation per ghost step (benchmarks/isolation_cost.py)", "",
          "Paired steps, isolation on / off, interleaved in one process; shared 2-core CPU, "
          f"1 thread, torch {torch.__version__}, commit {rows[0]['commit'] if rows else ''}. Off: "
          "an empty context (no own generators, nothing taken or compared). One chunk per step.",
          "", "| case | engine | modules | on ms (median) | off ms (median) | extra us (median) | "
          "x (median) | on ms (min) | off ms (min) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['case']} | {r['engine']} | {r['modules']} | {r['on_ms_median']} | "
                  f"{r['off_ms_median']} | {r['extra_us_median']} | {r['ratio_median']} | "
                  f"{r['on_ms_min']} | {r['off_ms_min']} |")
    Path(args.out).with_suffix(".md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
