"""Where a ghost step on a Hugging Face model spends its time when the forward is traced (user code:
the real-batch separability tracer, the match against the proved program, the memory watch), by
component, against the same model's eager forward + loss and non-private step (issue 31, item 7).

    python benchmarks/traced_step_parts.py [--models bert,gpt2,llama,vit] [--steps 10]
    python benchmarks/traced_step_parts.py --table

The step is ``benchmarks/hf_models.py``'s ``dpclip-ghost`` step (small configs, batch 16, CPU, one
thread). Each component is timed by wrapping its function with ``time.perf_counter`` in this
process (measurement only; the wrappers add a little time to every wrapped call, so the
components are upper bounds and the step is slower than unwrapped). Nested components are
included in their parents (``dispatch`` is inside ``function mode``, which is inside ``traced
forward``). Rows go to ``benchmarks/results/traced_step_parts_cpu.json``, the table beside it.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import json
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "src"))
OUT = ROOT / "results" / "traced_step_parts_cpu.json"

#: (label, module, owner class or None, attribute), in table order
PARTS = [
    ("engine compute", "dpclip.engine.ghost", "GhostEngine", "compute"),
    ("traced forward", "dpclip.engine.ghost_forward", None, "_forward_traced"),
    ("function mode (escape checks)", "dpclip.engine.separable", "_EscapeMode",
     "__torch_function__"),
    ("dispatch mode (per ATen op)", "dpclip.engine.separable", "SeparabilityTracer",
     "__torch_dispatch__"),
    ("program match: step", "dpclip.engine.proved_program", "ProgramMatch", "step"),
    ("program match: before", "dpclip.engine.proved_program", "ProgramMatch", "before"),
    ("layout rules", "dpclip.engine.separable", "SeparabilityTracer", "_dispatch"),
    ("memory watch: add", "dpclip.engine.memory_watch", "MemoryWatch", "_add"),
    ("memory watch: check args", "dpclip.engine.memory_watch", "MemoryWatch", "check_args"),
    ("program match: finish", "dpclip.engine.proved_program", "ProgramMatch", "finish"),
    ("backward (hook-free)", "dpclip.engine.hook_free", None, "hook_free_grad"),
    ("reduction (norms, weights, sums)", "dpclip.engine.ghost", "GhostEngine", "_reduce"),
    ("isolation enter", "dpclip.engine.isolation", "Isolated", "__enter__"),
    ("isolation exit", "dpclip.engine.isolation", "Isolated", "__exit__"),
]


def _install(acc: dict, cnt: collections.Counter) -> None:
    import importlib

    for label, modname, cls, attr in PARTS:
        mod = importlib.import_module(modname)
        owner = getattr(mod, cls) if cls else mod
        f = getattr(owner, attr)

        def make(f=f, label=label):
            @functools.wraps(f)
            def w(*a, **k):
                t = time.perf_counter()
                try:
                    return f(*a, **k)
                finally:
                    acc[label] += time.perf_counter() - t
                    cnt[label] += 1
            return w

        setattr(owner, attr, make())
    # the modules that imported the functions by name
    import dpclip.engine.ghost as G
    import dpclip.engine.hook_free as HF
    G.hook_free_grad = HF.hook_free_grad


def measure(name: str, steps: int) -> dict:
    import hf_models as H

    acc: dict = collections.defaultdict(float)
    cnt: collections.Counter = collections.Counter()
    s = H.sizes("small")
    base, x, y, loss_fn = H.build(name, s, "eager")
    dev = torch.device("cpu")
    nonpriv, _ = H.stepper("nonprivate", base, x, y, loss_fn, dev)
    eager = lambda: loss_fn(H._call(base, x), y)  # noqa: E731
    ghost, info = H.stepper("dpclip-ghost", base, x, y, loss_fn, dev)
    for _ in range(3):
        ghost()
        nonpriv()
        eager()

    def med(fn) -> float:
        ts = []
        for _ in range(steps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e3

    plain = {"ghost step (unwrapped)": med(ghost), "non-private step": med(nonpriv),
             "eager forward + loss": med(eager)}
    _install(acc, cnt)
    ghost()
    acc.clear()
    cnt.clear()
    t = time.perf_counter()
    for _ in range(steps):
        ghost()
    wrapped = (time.perf_counter() - t) / steps * 1e3
    parts = {label: (acc[label] / steps * 1e3, cnt[label] / steps) for label, *_ in PARTS}
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=ROOT).stdout.strip()
    return {"model": name, "batch_size": int(y.shape[0]), "engine": info().get("engine"),
            **{k: round(v, 3) for k, v in plain.items()}, "ghost step (wrapped)": round(wrapped, 3),
            "parts": {k: [round(v, 3), round(c, 1)] for k, (v, c) in parts.items()},
            "device": "cpu", "threads": 1, "torch": torch.__version__, "revision": rev,
            "date": datetime.date.today().isoformat()}


def table(rows: list[dict]) -> str:
    r0 = rows[0]
    head = ["component"] + [f"{r['model']} ms (calls)" for r in rows]
    out = ["# Ghost step on Hugging Face models, traced forward, by component (generated by "
           "benchmarks/traced_step_parts.py)", "",
           f"CPU, 1 thread, torch {r0['torch']}, revision {r0['revision']}, {r0['date']}; small "
           "configs of hf_models.py, batch 16; medians (steps) and per-step means (components, "
           "timed by wrappers: upper bounds, nested ones included in their parents).", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in ("non-private step", "eager forward + loss", "ghost step (unwrapped)",
                "ghost step (wrapped)"):
        out.append(f"| {key} | " + " | ".join(f"{r[key]:.2f}" for r in rows) + " |")
    for label, *_ in PARTS:
        out.append(f"| {label} | " + " | ".join(
            f"{r['parts'][label][0]:.2f} ({r['parts'][label][1]:.0f})" for r in rows) + " |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bert,gpt2,llama,vit")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--table", action="store_true", help="only regenerate the Markdown table")
    args = ap.parse_args()
    if args.child:  # one model per process: the wrappers stay out of the others' runs
        warnings.filterwarnings("ignore")
        torch.set_num_threads(1)
        print(json.dumps(measure(args.child, args.steps)))
        return 0
    if not args.table:
        rows = []
        for name in args.models.split(","):
            got = subprocess.run([sys.executable, __file__, "--child", name, "--steps",
                                  str(args.steps)], capture_output=True, text=True, check=True)
            rows.append(json.loads(got.stdout.strip().splitlines()[-1]))
            print(rows[-1]["model"], rows[-1]["ghost step (unwrapped)"], flush=True)
        OUT.write_text(json.dumps(rows, indent=1) + "\n")
    md = table(json.loads(OUT.read_text()))
    OUT.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
