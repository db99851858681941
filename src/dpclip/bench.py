"""Step-time and memory benchmark: dpclip's engines and Opacus versus a non-private step.

Methods (one optimizer step each, on one fixed batch):

* ``nonprivate``   - mean loss, ``backward()``, SGD step;
* ``dpclip-vmap``, ``dpclip-ghost``, ``dpclip-auto`` - :func:`dpclip.step.dp_step` with that engine,
  fixed flat clipping (C = 1), noise multiplier 1, then the SGD step;
* ``opacus-hooks``, ``opacus-ghost`` - Opacus ``PrivacyEngine.make_private(...,
  grad_sample_mode="hooks" | "ghost", poisson_sampling=False)``, noise multiplier 1, C = 1 (Opacus
  is imported only for these methods; it is a benchmark extra, not a dependency).

Times are medians of repeated steps taken in ONE process, methods interleaved step by step, so
ratios are robust to the machine's noise (performance.md); the interquartile range is reported.
Peak memory is measured for each method in a fresh child process (``ru_maxrss`` after a few steps),
because a process's peak only grows. The allocator in force is reported (``glibc``, or
``jemalloc`` when preloaded). Threads: ``$DPCLIP_BENCH_THREADS`` (default 2).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["ALL_METHODS", "BENCH_MODELS", "DEFAULT_METHODS", "BenchModel", "bench_threads",
           "run_bench"]


@dataclass(frozen=True)
class BenchModel:
    """A benchmark model: registry name and options, one example's shape and the classes;
    ``vocab``: inputs are token ids in ``[0, vocab)`` instead of Gaussian features."""

    registry: str
    input_shape: tuple[int, ...]
    classes: int
    options: dict[str, Any] = field(default_factory=dict)
    vocab: int | None = None


BENCH_MODELS: dict[str, BenchModel] = {
    "mlp": BenchModel("mlp", (14,), 2, {"hidden": (64, 64), "activation": "tanh"}),
    "papernot-cnn": BenchModel("papernot-cnn", (1, 28, 28), 10),
    "cifar-cnn": BenchModel("papernot-cifar-cnn", (3, 32, 32), 10),
    "transformer": BenchModel("transformer", (64,), 2, {"vocab_size": 10_000}, vocab=10_000),
}
DPCLIP_METHODS = ("dpclip-vmap", "dpclip-ghost", "dpclip-auto")
OPACUS_METHODS = ("opacus-hooks", "opacus-ghost")
ALL_METHODS = ("nonprivate",) + DPCLIP_METHODS + OPACUS_METHODS
#: ``dpclip-auto`` runs the ghost engine on every benchmark model, so it is not timed by default
DEFAULT_METHODS = ("nonprivate", "dpclip-vmap", "dpclip-ghost") + OPACUS_METHODS

CLIP_NORM = 1.0
NOISE_MULTIPLIER = 1.0


def _allocator() -> str:
    return "jemalloc" if "jemalloc" in os.environ.get("LD_PRELOAD", "") else "glibc"


def bench_threads() -> int:
    """Intra-op threads for the benchmark: ``$DPCLIP_BENCH_THREADS``, default ``min(2, cpus)``."""
    env = os.environ.get("DPCLIP_BENCH_THREADS", "").strip()
    return int(env) if env else min(2, os.cpu_count() or 1)


def _loss_fn(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, tgt, reduction="none")


def _make_step(method: str, model_name: str, batch_size: int, seed: int = 0) -> Callable[[], None]:
    from dpclip.models import build_model

    if model_name not in BENCH_MODELS:
        raise ValueError(f"unknown bench model {model_name!r}; valid: {', '.join(BENCH_MODELS)}")
    if method not in ALL_METHODS:
        raise ValueError(f"unknown bench method {method!r}; valid: {', '.join(ALL_METHODS)}")
    spec = BENCH_MODELS[model_name]
    torch.manual_seed(seed)
    model = build_model(spec.registry, spec.input_shape, spec.classes, **spec.options)
    if spec.vocab is None:
        x = torch.randn(batch_size, *spec.input_shape)
    else:
        x = torch.randint(0, spec.vocab, (batch_size, *spec.input_shape))
    y = torch.randint(0, spec.classes, (batch_size,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    if method == "nonprivate":

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            _loss_fn(model(x), y).mean().backward()
            opt.step()

        return step
    if method.startswith("dpclip-"):
        return _dpclip_step(method.removeprefix("dpclip-"), model, opt, x, y, batch_size, seed)
    return _opacus_step(method.removeprefix("opacus-"), model, opt, x, y, batch_size)


def _dpclip_step(engine_name: str, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                 y: torch.Tensor, batch_size: int, seed: int) -> Callable[[], None]:
    from dpclip.clipping import FixedClip, StepContext
    from dpclip.engine import ParamGroups, get_engine
    from dpclip.noise import make_generator
    from dpclip.sampling import PoissonSampler
    from dpclip.step import dp_step

    engine = get_engine(engine_name)
    strategy = FixedClip(CLIP_NORM)
    sampler = PoissonSampler(60_000, float(batch_size))
    groups = ParamGroups.flat(model)
    gen = make_generator(seed)
    ctx = StepContext(0, 0, sampler.steps_per_epoch, 1, float(batch_size), NOISE_MULTIPLIER)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def step() -> None:
        out = dp_step(model, x, y, loss_fn=_loss_fn, strategy=strategy, state={},
                      engine=engine, groups=groups, sampler=sampler,
                      base_noise_multiplier=NOISE_MULTIPLIER, ctx=ctx, generator=gen)
        for n, p in params:
            p.grad = out.grads[n]
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _opacus_step(mode: str, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                 y: torch.Tensor, batch_size: int) -> Callable[[], None]:
    try:
        from opacus import PrivacyEngine
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "the opacus-* benchmark methods need Opacus: pip install -c constraints.txt "
            "'dpclip[bench]'") from exc
    warnings.filterwarnings("ignore", module=r"opacus\..*")
    warnings.filterwarnings("ignore", message=r".*[Ff]ull backward hook.*")
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                         batch_size=batch_size)
    criterion = nn.CrossEntropyLoss()
    made = PrivacyEngine().make_private(
        module=model, optimizer=opt, data_loader=loader, criterion=criterion,
        noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=CLIP_NORM, poisson_sampling=False,
        grad_sample_mode=mode)
    if mode == "ghost":
        private_model, private_opt, private_crit, _ = made
    else:
        private_model, private_opt, _ = made
        private_crit = criterion

    def step() -> None:
        private_opt.zero_grad(set_to_none=True)
        private_crit(private_model(x), y).backward()
        private_opt.step()

    return step


def _peak_mem_mb(method: str, model: str, batch_size: int, steps: int) -> float:
    """Peak RSS (MB) of a fresh process that takes ``steps`` steps of ``method``."""
    code = (
        "import sys, resource, torch; from dpclip.bench import bench_threads;"
        "torch.set_num_threads(bench_threads());"
        "from dpclip.bench import _make_step;"
        f"s = _make_step({method!r}, {model!r}, {batch_size});"
        f"[s() for _ in range({steps})];"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=os.environ.copy(), timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"peak-memory child for {method} failed:\n{out.stderr[-2000:]}")
    return int(out.stdout.strip().splitlines()[-1]) / 1024.0


def _engine_ran(method: str, model_name: str) -> str | None:
    """Which engine a dpclip method runs on the model (``auto`` resolves to ghost or vmap)."""
    if not method.startswith("dpclip-"):
        return None
    name = method.removeprefix("dpclip-")
    if name != "auto":
        return name
    from dpclip.engine import ghost_support
    from dpclip.models import build_model

    spec = BENCH_MODELS[model_name]
    model = build_model(spec.registry, spec.input_shape, spec.classes, **spec.options)
    return "ghost" if ghost_support(model)[0] else "vmap"


def run_bench(
    model: str,
    batch_size: int,
    *,
    methods: list[str] | None = None,
    steps: int = 20,
    warmup: int = 3,
    measure_memory: bool = True,
) -> list[dict[str, Any]]:
    """Benchmark rows ``{model, batch_size, method, allocator, ms_per_step, ms_iqr,
    ratio_to_nonprivate, cpu_ms_per_step, cpu_ratio_to_nonprivate, peak_mem_mb,
    mem_ratio_to_nonprivate, engine, threads, ...}``: the non-private step and each requested
    method (default :data:`DEFAULT_METHODS`). ``ms`` are wall-clock medians; ``cpu_ms`` the
    process CPU time (all threads), less sensitive to other processes on a shared machine."""
    torch.set_num_threads(bench_threads())
    methods = list(methods or DEFAULT_METHODS)
    if "nonprivate" not in methods:
        methods.insert(0, "nonprivate")
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown:
        raise ValueError(f"unknown bench method(s) {unknown}; valid: {', '.join(ALL_METHODS)}")
    if model not in BENCH_MODELS:
        raise ValueError(f"unknown bench model {model!r}; valid: {', '.join(BENCH_MODELS)}")
    fns = {m: _make_step(m, model, batch_size) for m in methods}
    for _ in range(warmup):
        for f in fns.values():
            f()
    times: dict[str, list[float]] = {m: [] for m in methods}
    cpu: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(steps):
        for m, f in fns.items():
            c0, t0 = time.process_time(), time.perf_counter()
            f()
            times[m].append((time.perf_counter() - t0) * 1000.0)
            cpu[m].append((time.process_time() - c0) * 1000.0)
    del fns
    base = statistics.median(times["nonprivate"])
    cpu_base = statistics.median(cpu["nonprivate"])
    peaks = {m: _peak_mem_mb(m, model, batch_size, min(steps, 3)) if measure_memory
             else float("nan") for m in methods}
    rows = []
    for m in methods:
        med = statistics.median(times[m])
        q = statistics.quantiles(times[m], n=4) if len(times[m]) >= 4 else [med, med, med]
        rows.append({
            "model": model,
            "batch_size": batch_size,
            "method": m,
            "engine": _engine_ran(m, model),
            "allocator": _allocator(),
            "ms_per_step": med,
            "ms_iqr": [q[0], q[2]],
            "ratio_to_nonprivate": med / base,
            "cpu_ms_per_step": statistics.median(cpu[m]),
            "cpu_ratio_to_nonprivate": statistics.median(cpu[m]) / cpu_base,
            "peak_mem_mb": peaks[m],
            "mem_ratio_to_nonprivate": peaks[m] / peaks["nonprivate"],
            "steps": steps,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        })
    return rows


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(run_bench(sys.argv[1], int(sys.argv[2]))))
