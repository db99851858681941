"""Cost of the memory watch (dpclip.engine.memory_watch) per ghost step: the same step with the
watch on and with it replaced by an empty one, interleaved in one process (min and median of
``--rounds`` paired steps). Models: the bench's MLP (a chain of known modules: the watch starts at
the loss) at B 256 / 1024 with dpclip's known loss and with a user loss, and the small Hugging Face configs of benchmarks/hf_models.py (every
operation matched).

    PYTHONPATH=src:. python benchmarks/memory_watch_cost.py [--rounds 30] [--out PATH]

Rows go to benchmarks/results/memory_watch_cost_cpu.json (+ .md)."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

OUT = Path(__file__).resolve().parent / "results"


def _mlp_case(batch: int, user_loss: bool):
    """The bench's MLP; with dpclip's known loss (no user code in the step: no match, no watch) or
    with the same loss written as a lambda (user code: matched, the watch starts at the loss)."""
    from dpclip.engine.known_losses import cross_entropy_per_example

    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(14, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 2))
    x = torch.randn(batch, 14, generator=g)
    y = torch.randint(0, 2, (batch,), generator=g)
    loss = (lambda o, t: nn.functional.cross_entropy(o, t, reduction="none")) if user_loss \
        else cross_entropy_per_example
    return model, x, y, loss


def paired_times(step, switch, rounds: int) -> dict[bool, list[float]]:
    """Three warm-up steps, then ``rounds`` pairs of steps, on and off in alternating order
    (``switch(on)`` before each): ``{True: [ms, ...], False: [ms, ...]}``."""
    for _ in range(3):
        step()
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for on in ((True, False) if r % 2 else (False, True)):
            switch(on)
            t0 = time.perf_counter()
            step()
            times[on].append((time.perf_counter() - t0) * 1e3)
    return times


def _commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).resolve().parent).stdout.strip()
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import hf_models as hf
    from dpclip.engine import proved_program
    from dpclip.engine.memory_watch import MemoryWatch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", default=str(OUT / "memory_watch_cost_cpu.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    real = proved_program.ProgramMatch._watch
    state = {"on": True}

    class _Blind(MemoryWatch):  # off: no copies, no comparisons (the watch of every tensor the
        def add(self, tensors):  # call computes, since the fourth pass, goes through add too)
            pass

    proved_program.ProgramMatch._watch = lambda self: real(self) if state["on"] else _Blind()
    cases = {f"mlp B{b} {'user' if u else 'known'} loss": _mlp_case(b, u)
             for b in (256, 1024) for u in (False, True)}
    s = hf.sizes("small")
    for name in ("bert", "llama"):
        cases[f"{name} small"] = hf.build(name, s, "eager")
    rows = []
    dev = torch.device("cpu")
    for label, (model, x, y, loss) in cases.items():
        step, info = hf.stepper("dpclip-ghost", model, x, y, loss, dev)
        times = paired_times(step, lambda on: state.update(on=on), args.rounds)
        on, off = times[True], times[False]
        row = {"case": label, "engine": (info() or {}).get("engine"),
               "watch_on_ms_min": round(min(on), 3), "watch_off_ms_min": round(min(off), 3),
               "watch_on_ms_median": round(statistics.median(on), 3),
               "watch_off_ms_median": round(statistics.median(off), 3),
               "ratio_min": round(min(on) / min(off), 4),
               "ratio_median": round(statistics.median(on) / statistics.median(off), 4),
               "rounds": args.rounds, "device": "cpu (shared 2-core machine, 1 thread)",
               "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
               "commit": _commit(),
               "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        print(row, flush=True)
        rows.append(row)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    md = ["# Cost of the memory watch per ghost step (benchmarks/memory_watch_cost.py)", "",
          "Paired steps, watch on / off, interleaved in one process; shared 2-core CPU "
          f"(other jobs running), 1 thread, torch {torch.__version__}, commit "
          f"{rows[0]['commit'] if rows else ''}. Off: the watch takes no copies and makes no "
          "comparisons (the saved-tensor and hook watches stay on).", "",
          "| case | engine | on ms (min) | off ms (min) | x (min) | on ms (median) | "
          "off ms (median) | x (median) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['case']} | {r['engine']} | {r['watch_on_ms_min']} | "
                  f"{r['watch_off_ms_min']} | {r['ratio_min']} | {r['watch_on_ms_median']} | "
                  f"{r['watch_off_ms_median']} | {r['ratio_median']} |")
    Path(args.out).with_suffix(".md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
