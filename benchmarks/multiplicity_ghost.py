"""Step time of augmentation multiplicity (issue 36) on the ghost engine against vmap, on the CPU:
the Papernot CNN on Fashion-MNIST-shaped random data (1 x 28 x 28, 10 classes, float32), B
examples with K copies each (the K-copy view and mean loss of dpclip.training.multiplicity), fixed
clipping; one engine call per step (forward, backward, norms, clipped sum), 1 thread. Cases: ghost
K, vmap K (what auto ran before issue 36), ghost and vmap with K = 1 (the plain model). Steps of the cases
are interleaved (one of each per round) after warm-up steps; min and median over the rounds.

    PYTHONPATH=src python benchmarks/multiplicity_ghost.py [--batch 256] [--k 8] [--rounds 10]

Rows go to benchmarks/results/multiplicity_ghost_cpu.json, the table to multiplicity_ghost_cpu.md
(generated from the json by this script)."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results"
CLIP = 1.0


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y, reduction="none")


def _cases(batch: int, k: int) -> dict:
    """``{name: (engine, model, loss, x, y, groups)}``; one model for all (same parameters)."""
    from dpclip.engine import GhostEngine, ParamGroups, VmapEngine
    from dpclip.models import build_model
    from dpclip.training.multiplicity import KCopyModel, k_copy_loss

    torch.manual_seed(0)
    model = build_model("papernot-cnn", (1, 28, 28), 10)
    g = torch.Generator().manual_seed(1)
    xk = torch.rand(batch, k, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    groups = ParamGroups.flat(model)
    view, loss = KCopyModel(model, k), k_copy_loss(_ce, k)
    return {
        f"ghost K{k}": (GhostEngine(), view, loss, xk, y, groups),
        f"vmap K{k}": (VmapEngine(), view, loss, xk, y, groups),
        "ghost K1": (GhostEngine(), model, _ce, xk[:, 0].contiguous(), y, groups),
        "vmap K1": (VmapEngine(), model, _ce, xk[:, 0].contiguous(), y, groups),
    }


def _step(case) -> tuple[float, dict]:
    engine, model, loss, x, y, groups = case
    t0 = time.perf_counter()
    res = engine.compute(model, loss, x, y, lambda n: (CLIP / (n + 1e-6)).clamp(max=1.0), groups)
    return (time.perf_counter() - t0) * 1e3, \
        res.engine_info or {"engine": engine.name, "fallback": None}


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=ROOT, check=True,
                               capture_output=True, text=True).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def table(rows: list[dict]) -> str:
    r0 = rows[0]
    out = ["# Augmentation multiplicity on the ghost engine, CPU step time (generated from "
           "multiplicity_ghost_cpu.json by benchmarks/multiplicity_ghost.py)", "",
           f"Papernot CNN, Fashion-MNIST-shaped random data (1x28x28, 10 classes, float32), "
           f"B {r0['batch']}, fixed clipping; one engine call per step (forward, backward, norms, "
           f"clipped sum); {r0['rounds']} interleaved rounds after {r0['warmup']} warm-up steps. "
           f"Device: {r0['device']}, torch {r0['torch']}, commit {r0['commit']}, measured "
           f"{r0['measured']}.", "",
           "| case | engine ran | K | ms/step (min) | ms/step (median) | median vs ghost K1 | "
           "median vs vmap K (K > 1) |", "|---|---|---|---|---|---|---|"]
    base = {r["case"]: r for r in rows}
    one = next(r for n, r in base.items() if n == "ghost K1")
    vm = next(r for n, r in base.items() if n.startswith("vmap") and n != "vmap K1")
    for r in rows:
        out.append(f"| {r['case']} | {r['engine_ran']} | {r['k']} | {r['ms_min']:.1f} | "
                   f"{r['ms_median']:.1f} | {r['ms_median'] / one['ms_median']:.2f} | "
                   f"{r['ms_median'] / vm['ms_median']:.3f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=str(OUT / "multiplicity_ghost_cpu.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    cases = _cases(a.batch, a.k)
    for case in cases.values():
        for _ in range(a.warmup):
            _step(case)
    times: dict[str, list[float]] = {n: [] for n in cases}
    ran: dict[str, str] = {}
    for rnd in range(a.rounds):
        for name, case in cases.items():
            ms, info = _step(case)
            times[name].append(ms)
            ran[name] = info["engine"] if info["fallback"] is None else \
                f"{info['engine']} (fallback)"
        print(f"round {rnd + 1}: " + ", ".join(f"{n} {t[-1]:.0f} ms" for n, t in times.items()),
              flush=True)
    meta = dict(batch=a.batch, rounds=a.rounds, warmup=a.warmup, model="papernot-cnn",
                data="random 1x28x28 float32, 10 classes", threads=1,
                device=f"cpu ({platform.machine()}, shared 2-core machine, 1 thread)",
                torch=torch.__version__, commit=_commit(),
                measured=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    rows = [dict(meta, case=n, k=int(n.split("K")[-1]), engine_ran=ran[n],
                 ms_min=round(min(t), 2), ms_median=round(statistics.median(t), 2),
                 ms_all=[round(x, 2) for x in t]) for n, t in times.items()]
    path = Path(a.out)
    path.write_text(json.dumps(rows, indent=1) + "\n")
    md = table(rows)
    path.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
