"""Steps per second of distributed DP-SGD: 1 process versus 2 gloo processes on CPU (issue 19).

One private run (``make_private``, ghost engine, fixed clip 1, noise multiplier 1, Poisson batches
of the given EXPECTED global size, SGD) on synthetic data for a benchmark model of ``dpclip
bench``, timed as the user's loop runs it: ``dp.sample()`` then ``dp.step(x, y)``. Methods:

* ``dpclip-ghost-1proc``: one process, no ``torch.distributed``, ``--threads`` intra-op threads;
* ``dpclip-ghost-2proc``: two ranks on one machine (gloo over loopback, forked processes), each
  with ``--threads`` threads and half of the global batch; every step all-gathers the shard sizes,
  all-reduces the clipped sums and the per-example norms (``dpclip.training.distributed``).

The 2-process run uses twice the cores of the 1-process run (2 x threads); on a machine with only
``2 x threads`` cores that others are using too, the ratio says how much a second process buys
under that load, not a clean scaling figure. Rows go to
``benchmarks/results/distributed_cpu.json`` (model, batch_size, method, allocator, threads per
rank, processes, steps, ms_per_step, steps_per_s, ratio_to_1proc = ms_per_step of this method /
ms_per_step of 1proc: below 1 is faster; peak_mem_mb = peak RSS of rank 0, MB) and a Markdown
table to ``distributed_cpu.md``.

    .venv/bin/python benchmarks/distributed_scaling.py [--models mlp,papernot-cnn]
        [--batch-sizes 256,1024] [--steps 60] [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import pickle
import platform
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpclip.bench import BENCH_MODELS, CLIP_NORM, NOISE_MULTIPLIER, _allocator
from dpclip.models import build_model
from dpclip.training.private import make_private

OUT = Path(__file__).parent / "results" / "distributed_cpu.json"
DATASET = 8192


def _timed_run(ctx: Any, model_name: str, batch: int, steps: int, warmup: int) -> dict:
    spec = BENCH_MODELS[model_name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(DATASET, *spec.input_shape, generator=g)
    y = torch.randint(0, spec.classes, (DATASET,), generator=g)
    torch.manual_seed(0)
    model = build_model(spec.registry, spec.input_shape, spec.classes, **spec.options)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dp = make_private(model, opt, (x, y), strategy="fixed",
                      strategy_params={"clip_norm": CLIP_NORM}, noise_multiplier=NOISE_MULTIPLIER,
                      steps=warmup + steps, batch_size=float(batch), engine="ghost",
                      delta=1e-5, verbose=False,
                      distributed=ctx if ctx is not None else False,
                      loss_fn=lambda o, t: nn.functional.cross_entropy(o, t, reduction="none"))
    for _ in range(warmup):
        xb, yb = dp.sample()
        dp.step(xb, yb)
    if ctx is not None:
        from dpclip.training.distributed import barrier

        barrier(ctx)
    t0 = time.perf_counter()
    for _ in range(steps):
        xb, yb = dp.sample()
        dp.step(xb, yb)
    elapsed = time.perf_counter() - t0
    return {"ms_per_step": 1000 * elapsed / steps,
            "peak_mem_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}


def _rank_main(rank: int, world: int, store: str, threads: int, args: tuple, out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    from dpclip.training.distributed import DistributedContext

    try:
        res = _timed_run(DistributedContext.current(), *args)
        if rank == 0:
            Path(out).write_bytes(pickle.dumps(res))
    finally:
        dist.destroy_process_group()


def run_2proc(threads: int, *args: Any) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res.pkl")
        ctx = mp.get_context("fork")
        procs = [ctx.Process(target=_rank_main,
                             args=(r, 2, os.path.join(tmp, "store"), threads, args, out))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(900)
            if p.exitcode != 0:
                raise RuntimeError(f"a rank exited with code {p.exitcode}")
        return pickle.loads(Path(out).read_bytes())


def run_1proc(threads: int, *args: Any) -> dict:
    # in a forked child too, so both methods start from the same process state
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res.pkl")

        def target() -> None:
            torch.set_num_threads(threads)
            Path(out).write_bytes(pickle.dumps(_timed_run(None, *args)))

        p = mp.get_context("fork").Process(target=target)
        p.start()
        p.join(900)
        if p.exitcode != 0:
            raise RuntimeError(f"the 1-process run exited with code {p.exitcode}")
        return pickle.loads(Path(out).read_bytes())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="mlp,papernot-cnn")
    ap.add_argument("--batch-sizes", default="256,1024")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats; median kept")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    rows = []
    for model_name in a.models.split(","):
        for batch in [int(b) for b in a.batch_sizes.split(",")]:
            times: dict[str, list[dict]] = {"dpclip-ghost-1proc": [], "dpclip-ghost-2proc": []}
            for _ in range(a.repeats):  # interleaved, so that a burst of load hits both
                args = (model_name, batch, a.steps, a.warmup)
                times["dpclip-ghost-1proc"].append(run_1proc(a.threads, *args))
                times["dpclip-ghost-2proc"].append(run_2proc(a.threads, *args))
            base = statistics.median(r["ms_per_step"] for r in times["dpclip-ghost-1proc"])
            for method, runs in times.items():
                ms = statistics.median(r["ms_per_step"] for r in runs)
                rows.append({
                    "model": model_name, "batch_size": batch, "method": method,
                    "allocator": _allocator(torch.device("cpu")), "threads": a.threads,
                    "processes": 2 if method.endswith("2proc") else 1, "steps": a.steps,
                    "repeats": a.repeats, "ms_per_step": round(ms, 3),
                    "ms_per_step_runs": [round(r["ms_per_step"], 3) for r in runs],
                    "steps_per_s": round(1000.0 / ms, 2),
                    "ratio_to_1proc": round(ms / base, 4),
                    "peak_mem_mb": round(max(r["peak_mem_mb"] for r in runs), 1),
                })
                print(json.dumps(rows[-1]), flush=True)
    meta = {"machine": f"{platform.machine()} {os.cpu_count()} logical CPUs",
            "cpus": os.cpu_count(),
            "load_average_at_end": os.getloadavg(), "torch": torch.__version__,
            "backend": "gloo (loopback)"}
    print(write_outputs(rows, meta, a.out))


def write_outputs(rows: list[dict], meta: dict, out: Path) -> str:
    """The JSON rows and the Markdown table (with every repeat's ms/step: the spread is the
    measurement's uncertainty on a shared machine); returns the table."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = ["| model | batch | method | threads/proc | ms/step (median) | repeats (ms/step) | "
             "steps/s | ratio to 1 proc | peak MB (rank 0) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        runs = ", ".join(f"{v:.1f}" for v in r["ms_per_step_runs"])
        lines.append(f"| {r['model']} | {r['batch_size']} | {r['method']} | {r['threads']} | "
                     f"{r['ms_per_step']:.2f} | {runs} | {r['steps_per_s']:.1f} | "
                     f"{r['ratio_to_1proc']:.3f} | {r['peak_mem_mb']:.0f} |")
    table = "\n".join(lines)
    load = tuple(round(v, 1) for v in meta["load_average_at_end"])
    out.with_suffix(".md").write_text(
        "# Distributed DP-SGD on CPU: 1 vs 2 gloo processes\n\n"
        f"`benchmarks/distributed_scaling.py`; {meta['machine']}, load average at the end "
        f"{load}, torch {meta['torch']}, {meta['backend']}. ratio_to_1proc = median ms/step over "
        "the 1-process median ms/step (below 1: faster). The two methods were interleaved, "
        "repeat by repeat.\n\n" + table + "\n" + (
            "\nReading: the machine was overloaded (load average above its "
            f"{meta['cpus']} logical CPUs): compare the spread between repeats of the SAME method "
            "with the difference between the methods before reading a scaling figure off this "
            "table. A clean figure needs at least 2 x threads idle cores.\n"
            if load[0] >= meta["cpus"] else ""))
    return table


if __name__ == "__main__":
    main()
