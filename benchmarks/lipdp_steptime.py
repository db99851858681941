"""Step time of Lip-DP-SGD vs non-private training vs DP-SGD (fixed clipping, vmap engine).

Same model, same batch, one process, CPU. A step is everything the trainer does per batch:
non-private = forward + batched backward + Adam; DP-SGD = dp_step (vmap per-example gradients,
clipping, noise) + Adam; Lip-DP-SGD = dp_step (certificate from the weights, input clipping, one
batched backward, noise; summed engine) + Adam + ClipWeights (post_step).

    .venv/bin/python benchmarks/lipdp_steptime.py [--steps 10] [--threads 2]

writes benchmarks/results/lipdp_steptime.json (rows: model, batch_size, method, allocator,
ms_per_step, ratio_to_nonprivate, peak_mem_mb). peak_mem_mb is the process's peak RSS after the
method ran (monotone over the methods of one model; CPU has no per-method allocator statistics).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import time
from pathlib import Path

import torch
from torch import nn

from dpclip.clipping import StepContext, make_strategy
from dpclip.engine import ParamGroups, get_engine
from dpclip.models import build_model
from dpclip.training.sampling import make_sampler
from dpclip.training.step import dp_step

OUT = Path(__file__).parent / "results" / "lipdp_steptime.json"


def ce(out, y):
    return nn.functional.cross_entropy(out, y, reduction="none")


def run(model_name, shape, classes, batch, steps):
    torch.manual_seed(0)
    x = torch.randn(batch, *shape)
    y = torch.randint(0, classes, (batch,))
    sampler = make_sampler("poisson", 100 * batch, batch)
    ctx = StepContext(step=0, epoch=0, steps_per_epoch=100, total_steps=100,
                      expected_batch_size=float(batch), base_noise_multiplier=1.0)
    rows = []
    for method in ("nonprivate", "dp-sgd", "lip-dp-sgd"):
        torch.manual_seed(0)
        model = build_model(model_name, shape, classes)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(0)
        if method == "dp-sgd":
            strategy, engine = make_strategy("fixed", {"clip_norm": 1.0}), get_engine("vmap")
        elif method == "lip-dp-sgd":
            strategy = make_strategy("lip-dp-sgd", {"input_norm": 10.0}).bind(model, shape)
            engine = get_engine("summed")
        groups = ParamGroups.flat(model)

        def step():
            if method == "nonprivate":
                opt.zero_grad(set_to_none=True)
                ce(model(x), y).mean().backward()
                opt.step()
                return
            loss = strategy.loss() if method == "lip-dp-sgd" else ce
            out = dp_step(model, x, y, loss_fn=loss, strategy=strategy,
                          state=strategy.init_state(), engine=engine, groups=groups,
                          sampler=sampler, base_noise_multiplier=1.0, ctx=ctx, generator=gen)
            for n, p in model.named_parameters():
                p.grad = out.grads[n]
            opt.step()
            opt.zero_grad(set_to_none=True)
            if method == "lip-dp-sgd":
                strategy.post_step(model, out.state, input_shape=shape)

        for _ in range(2):
            step()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        ms = 1000 * (time.perf_counter() - t0) / steps
        rows.append({"model": model_name, "batch_size": batch, "method": method,
                     "allocator": "cpu (torch default)", "ms_per_step": round(ms, 3),
                     "peak_mem_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)})
        print(rows[-1], flush=True)
    base = rows[0]["ms_per_step"]
    for r in rows:
        r["ratio_to_nonprivate"] = round(r["ms_per_step"] / base, 3)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    rows += run("tabular-mlp", (30,), 2, 64, args.steps * 5)
    rows += run("tabular-mlp", (30,), 2, 512, args.steps * 5)
    rows += run("lip-convnet", (1, 28, 28), 10, 64, args.steps)
    for r in rows:
        dp = next(q for q in rows if q["model"] == r["model"] and q["batch_size"] == r["batch_size"]
                  and q["method"] == "dp-sgd")
        r["ratio_to_dpsgd"] = round(r["ms_per_step"] / dp["ms_per_step"], 3)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"device": "cpu", "threads": args.threads,
                               "torch": torch.__version__, "machine": platform.processor() or
                               platform.machine(), "rows": rows}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
