"""Cost of the separability proof on the ghost engine: first call (the symbolic-batch export runs
once per signature) and the median of later calls (the op-by-op trace with its Python-escape mode
runs every call), for the ``transformer`` case of tests/engine/test_ghost.py at B = 64, float64,
one CPU thread. Run it once per code version: ``python benchmarks/separability_overhead.py LABEL
OUT.json`` (PYTHONPATH = the code to measure and the repository root); ``--table OUT.json``.
"""

from __future__ import annotations

import json
import platform
import sys
import time

import torch


def measure(label: str) -> dict:
    from dpclip.engine import GhostEngine, ParamGroups
    from tests.engine.helpers import clip_weights
    from tests.engine.test_ghost import make

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, x, y, loss = make("transformer", 64)
    groups, engine = ParamGroups.flat(model), GhostEngine()
    t = time.perf_counter()
    engine.compute(model, loss, x, y, clip_weights(1.0), groups)
    first = time.perf_counter() - t
    times = []
    for _ in range(31):
        t = time.perf_counter()
        engine.compute(model, loss, x, y, clip_weights(1.0), groups)
        times.append(time.perf_counter() - t)
    times.sort()
    return {"code": label, "model": "tests transformer case", "batch_size": 64, "dtype": "float64",
            "threads": 1, "first_call_s": round(first, 3),
            "median_ms": round(1000 * times[len(times) // 2], 2),
            "p10_ms": round(1000 * times[len(times) // 10], 2), "device": "cpu",
            "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
            "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


if __name__ == "__main__":
    if sys.argv[1] == "--table":
        rows = json.load(open(sys.argv[2]))
        md = ["# Ghost step with the separability proof (benchmarks/separability_overhead.py)", "",
              "The `transformer` case of tests/engine/test_ghost.py, B = 64, float64, 1 thread, "
              "CPU (a shared 2-core machine: p10 is the least disturbed).", "",
              "| code | first call s | median ms | p10 ms | torch |", "|---|---|---|---|---|"]
        md += [f"| {r['code']} | {r['first_call_s']} | {r['median_ms']} | {r['p10_ms']} | "
               f"{r['torch']} |" for r in rows]
        open(sys.argv[2].rsplit(".", 1)[0] + ".md", "w").write("\n".join(md) + "\n")
        print("\n".join(md))
    else:
        label, path = sys.argv[1], sys.argv[2]
        try:
            rows = json.load(open(path))
        except FileNotFoundError:
            rows = []
        rows = [r for r in rows if r["code"] != label] + [measure(label)]
        json.dump(rows, open(path, "w"), indent=1)
