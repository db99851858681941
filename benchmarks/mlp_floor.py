"""How close can any ghost step get to a non-private step on the benchmark MLP? (issue 8, MLP row)

Three methods, interleaved in one process, on the MLP 14-64-64-2 of `dpclip bench` (same model,
data, loss, SGD and noise multiplier 1, clip 1):

* ``nonprivate``: forward, batched backward, SGD step;
* ``dpclip-ghost``: exactly the step of ``dpclip bench --method dpclip-ghost`` (``dp_step`` with
  the ghost engine and ``FixedClip``, then SGD);
* ``handwritten-ghost``: the least a ghost step of this one model can do, written out by hand: the
  chain loop keeping each Linear's input, one ``autograd.grad`` to the layer outputs, per-example
  norms ``||b||^2 (||a||^2 + 1)`` (4 operations per layer), clip weights, ``(w b)^T a`` and
  ``w^T b``, one flat Gaussian draw, SGD. No model scan, no parameter-use check, no finite or
  weight checks, no strategy, state or ledger objects: it is a floor for the engine, not a DP
  implementation anyone should use.

    .venv/bin/python benchmarks/mlp_floor.py [--steps 400] [--batch-sizes 256,1024]

writes benchmarks/results/mlp_floor.json (rows: model, batch_size, method, allocator,
ms_per_step, ratio_to_nonprivate, peak_mem_mb; peak_mem_mb is the process's peak RSS so far, CPU
has no per-method allocator statistics) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from dpclip.bench import BENCH_MODELS, CLIP_NORM, NOISE_MULTIPLIER, _allocator, _loss_fn, _make_step
from dpclip.bench import bench_threads
from dpclip.models import build_model

OUT = Path(__file__).parent / "results" / "mlp_floor.json"


def handwritten_step(batch: int):
    spec = BENCH_MODELS["mlp"]
    torch.manual_seed(0)
    model = build_model(spec.registry, spec.input_shape, spec.classes, **spec.options)
    x = torch.randn(batch, *spec.input_shape)
    y = torch.randint(0, spec.classes, (batch,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    mods = list(model)
    params = [p for m in mods if isinstance(m, nn.Linear) for p in (m.weight, m.bias)]
    sizes = [p.numel() for p in params]
    std = NOISE_MULTIPLIER * CLIP_NORM

    def step() -> None:
        h, acts, outs = x, [], []
        for m in mods:
            if isinstance(m, nn.Linear):
                acts.append(h)
                h = m(h)
                outs.append(h)
            else:
                h = m(h)
        bs = torch.autograd.grad(_loss_fn(h, y).sum(), outs)
        with torch.no_grad():
            sq = None
            for a, b in zip(acts, bs):
                b2 = torch.linalg.vecdot(b, b)
                s = torch.addcmul(b2, torch.linalg.vecdot(a, a), b2)
                sq = s if sq is None else sq.add_(s)
            w = (sq.sqrt_() + 1e-6).reciprocal_().mul_(CLIP_NORM).clamp_(max=1.0)
            grads = []
            for a, b in zip(acts, bs):
                bw = b * w[:, None]
                grads += [torch.mm(bw.t(), a), bw.sum(0)]
            flat = torch.cat([g.reshape(-1) for g in grads])
            flat.add_(torch.randn(flat.numel(), generator=gen), alpha=std).div_(batch)
            for p, c in zip(params, flat.split_with_sizes(sizes)):
                p.grad = c.view(p.shape)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-sizes", default="256,1024")
    args = ap.parse_args()
    torch.set_num_threads(bench_threads())
    device = torch.device("cpu")
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        steps = {"nonprivate": _make_step("nonprivate", "mlp", batch),
                 "dpclip-ghost": _make_step("dpclip-ghost", "mlp", batch),
                 "handwritten-ghost": handwritten_step(batch)}
        times: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(30):
            for f in steps.values():
                f()
        for _ in range(args.steps):
            for k, f in steps.items():
                t = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t)
        base = statistics.median(times["nonprivate"])
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        for k, ts in times.items():
            med = statistics.median(ts)
            rows.append({"model": "mlp", "batch_size": batch, "method": k,
                         "allocator": _allocator(device), "threads": torch.get_num_threads(),
                         "steps": args.steps, "ms_per_step": round(med * 1e3, 4),
                         "ratio_to_nonprivate": round(med / base, 4),
                         "peak_mem_mb": round(peak, 1)})
    old = json.loads(OUT.read_text()) if OUT.exists() else []
    keys = {(r["batch_size"], r["method"], r["allocator"]) for r in rows}
    rows = [r for r in old if (r["batch_size"], r["method"], r["allocator"]) not in keys] + rows
    OUT.write_text(json.dumps(rows, indent=1) + "\n")
    print("| batch | method | allocator | ms/step | x non-private |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch_size']} | {r['method']} | {r['allocator']} | {r['ms_per_step']:.3f} | "
              f"{r['ratio_to_nonprivate']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
