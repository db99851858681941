"""Step-time and memory benchmark: every dpclip engine versus a non-private step of the same model.

Times are medians of repeated steps taken in ONE process, methods interleaved step by step, so
ratios are robust to the machine's noise (performance.md). Peak memory is measured for each method
in a fresh child process (``ru_maxrss`` after the timed steps), because a process's peak only grows.
The allocator in force is reported (``glibc`` or ``jemalloc`` when preloaded).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["BENCH_MODELS", "run_bench"]

#: model name -> (registry model, options, input shape, classes)
BENCH_MODELS: dict[str, tuple[str, dict[str, Any], tuple[int, ...], int]] = {
    "mlp": ("mlp", {"hidden": (64, 64), "activation": "tanh"}, (14,), 2),
    "papernot-cnn": ("papernot-cnn", {}, (1, 28, 28), 10),
}
DPCLIP_METHODS = ("dpclip-vmap",)
ALL_METHODS = ("nonprivate",) + DPCLIP_METHODS


def _allocator() -> str:
    return "jemalloc" if "jemalloc" in os.environ.get("LD_PRELOAD", "") else "glibc"


def _make_step(method: str, model_name: str, batch_size: int, seed: int = 0) -> Callable[[], None]:
    from dpclip.clipping import FixedClip, StepContext
    from dpclip.engine import ParamGroups, get_engine
    from dpclip.models import build_model
    from dpclip.noise import make_generator
    from dpclip.sampling import PoissonSampler
    from dpclip.step import dp_step

    if model_name not in BENCH_MODELS:
        raise ValueError(f"unknown bench model {model_name!r}; valid: {', '.join(BENCH_MODELS)}")
    reg, opts, shape, classes = BENCH_MODELS[model_name]
    torch.manual_seed(seed)
    model = build_model(reg, shape, classes, **opts)
    x = torch.randn(batch_size, *shape)
    y = torch.randint(0, classes, (batch_size,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def loss_fn(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, tgt, reduction="none")

    if method == "nonprivate":

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).mean().backward()
            opt.step()

        return step
    if method.startswith("dpclip-"):
        engine = get_engine(method.removeprefix("dpclip-"))
        strategy = FixedClip(1.0)
        sampler = PoissonSampler(60_000, float(batch_size))
        groups = ParamGroups.flat(model)
        gen = make_generator(seed)
        ctx = StepContext(0, 0, sampler.steps_per_epoch, 1, float(batch_size), 1.0)
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        params = dict(model.named_parameters())

        def step() -> None:
            out = dp_step(model, x, y, loss_fn=loss_fn, strategy=strategy, state={},
                          engine=engine, groups=groups, sampler=sampler,
                          base_noise_multiplier=1.0, ctx=ctx, generator=gen)
            for n in names:
                params[n].grad = out.grads[n]
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step
    raise ValueError(f"unknown bench method {method!r}; valid: {', '.join(ALL_METHODS)}")


def _peak_mem_mb(method: str, model: str, batch_size: int, steps: int) -> float:
    """Peak RSS (MB) of a fresh process that takes ``steps`` steps of ``method``."""
    code = (
        "import sys, resource, torch; torch.set_num_threads(2);"
        "from dpclip.bench import _make_step;"
        f"s = _make_step({method!r}, {model!r}, {batch_size});"
        f"[s() for _ in range({steps})];"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=os.environ.copy(), timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"peak-memory child for {method} failed:\n{out.stderr[-2000:]}")
    return int(out.stdout.strip().splitlines()[-1]) / 1024.0


def run_bench(
    model: str,
    batch_size: int,
    *,
    methods: list[str] | None = None,
    steps: int = 20,
    warmup: int = 3,
    measure_memory: bool = True,
) -> list[dict[str, Any]]:
    """Benchmark rows ``{model, batch_size, method, allocator, ms_per_step, ratio_to_nonprivate,
    peak_mem_mb, ...}`` for the non-private step and each requested method."""
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    methods = list(methods or ALL_METHODS)
    if "nonprivate" not in methods:
        methods.insert(0, "nonprivate")
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown:
        raise ValueError(f"unknown bench method(s) {unknown}; valid: {', '.join(ALL_METHODS)}")
    fns = {m: _make_step(m, model, batch_size) for m in methods}
    for _ in range(warmup):
        for f in fns.values():
            f()
    times: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(steps):
        for m, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[m].append((time.perf_counter() - t0) * 1000.0)
    base = statistics.median(times["nonprivate"])
    rows = []
    for m in methods:
        med = statistics.median(times[m])
        q = statistics.quantiles(times[m], n=4) if len(times[m]) >= 4 else [med, med, med]
        rows.append({
            "model": model,
            "batch_size": batch_size,
            "method": m,
            "allocator": _allocator(),
            "ms_per_step": med,
            "ms_iqr": [q[0], q[2]],
            "ratio_to_nonprivate": med / base,
            "peak_mem_mb": _peak_mem_mb(m, model, batch_size, min(steps, 5))
            if measure_memory else float("nan"),
            "steps": steps,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        })
    return rows


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(run_bench(sys.argv[1], int(sys.argv[2]))))
