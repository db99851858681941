"""Step-time and memory benchmark: dpclip's engines and Opacus versus a non-private step.

Methods (one optimizer step each, on one fixed batch):

* ``nonprivate``   - mean loss, ``backward()``, SGD step;
* ``dpclip-vmap``, ``dpclip-ghost``, ``dpclip-auto``, ``dpclip-compiled`` - :func:`dpclip.training.step.dp_step`
  with that engine, fixed flat clipping (C = 1), noise multiplier 1, then the SGD step (``auto`` and
  ``compiled`` are not timed by default);
* ``opacus-hooks``, ``opacus-ghost`` - Opacus ``PrivacyEngine.make_private(...,
  grad_sample_mode="hooks" | "ghost", poisson_sampling=False)``, noise multiplier 1, C = 1 (Opacus
  is imported only for these methods; it is a benchmark extra, not a dependency).

Times are medians of repeated steps taken in ONE process, methods interleaved step by step, so
ratios are robust to the machine's noise (performance.md); the interquartile range is reported.
On ``device="cuda"`` the model and batch live on the GPU and every timed step ends with
``torch.cuda.synchronize()``.

Memory is measured for each method in a fresh child process (:func:`_memory_child`): the method
first takes two steps at a tiny batch (this loads the code pages, lazy imports and library
workspaces a first step touches, which would otherwise dominate small models), then the real
step is built and the baseline is read right before its first step; after a few steps the probe
reports

* ``peak_mem_mb`` - the absolute peak: on CPU the peak resident set (``VmHWM`` of
  ``/proc/self/status``, reset to the baseline through ``/proc/self/clear_refs`` where the kernel
  allows), which includes the interpreter, torch and the model; on CUDA
  ``torch.cuda.max_memory_allocated()`` after ``torch.cuda.reset_peak_memory_stats()``;
* ``extra_mem_mb`` - the peak minus the baseline: the memory the training step itself needs
  (activations, gradients, per-example quantities), which is what a DP method adds to.

(``ru_maxrss`` is NOT used for the child: Linux carries the parent's peak over ``fork``/``exec``,
so every child reported the benchmark process's own peak.) The allocator in force is reported
(``glibc``, or ``jemalloc`` when preloaded; ``cuda-caching`` on a GPU) with the ``device`` (``cpu``
or the GPU's name). Threads: ``$DPCLIP_BENCH_THREADS`` (default 2).
"""

from __future__ import annotations

import gc
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
from dpclip.clipping import FixedClip, StepContext
from dpclip.engine import ParamGroups, get_engine, ghost_support
from dpclip.engine.known_losses import cross_entropy_per_example
from dpclip.models import build_model
from dpclip.noise import make_generator
from dpclip.training.sampling import PoissonSampler
from dpclip.training.step import dp_step

__all__ = ["ALL_METHODS", "BENCH_MODELS", "DEFAULT_METHODS", "MEM_RESOLUTION_MB", "BenchModel",
           "bench_threads", "run_bench"]


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
DPCLIP_METHODS = ("dpclip-vmap", "dpclip-ghost", "dpclip-auto", "dpclip-compiled")
OPACUS_METHODS = ("opacus-hooks", "opacus-ghost")
ALL_METHODS = ("nonprivate",) + DPCLIP_METHODS + OPACUS_METHODS
#: ``dpclip-auto`` runs the ghost engine on every benchmark model, so it is not timed by default;
#: ``dpclip-compiled`` neither (the explicit compiled engine: ``--methods`` names it)
DEFAULT_METHODS = ("nonprivate", "dpclip-vmap", "dpclip-ghost") + OPACUS_METHODS

CLIP_NORM = 1.0
NOISE_MULTIPLIER = 1.0
#: below this extra memory (MB) of the non-private step, ratios to it are not reported (``None``):
#: the step's own memory is then lost in page granularity and allocator noise
MEM_RESOLUTION_MB = 1.0
#: batch of the warm-up steps a memory probe takes before its baseline
_PROBE_WARMUP_BATCH = 2
_MB = 1024.0 * 1024.0


def _allocator(device: torch.device) -> str:
    if device.type == "cuda":
        return "cuda-caching"
    return "jemalloc" if "jemalloc" in os.environ.get("LD_PRELOAD", "") else "glibc"


def _device_label(device: torch.device) -> str:
    """``cpu``, or the GPU's name (``torch.cuda.get_device_name``)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _resolve_device(device: str | torch.device) -> torch.device:
    """``cpu`` or ``cuda[:N]`` as a :class:`torch.device`; a clear ValueError otherwise, or when
    CUDA is asked for and this torch / machine has none."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown bench device {device!r}; valid: cpu, cuda (or cuda:N)") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unknown bench device {device!r}; valid: cpu, cuda (or cuda:N)")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            built = (f"built with CUDA {torch.version.cuda}" if torch.version.cuda
                     else "a CPU-only build")
            raise ValueError(
                f"device={str(device)!r} but CUDA is not available (torch {torch.__version__}, "
                f"{built}, {torch.cuda.device_count()} GPU(s) visible): run on a machine with an "
                "NVIDIA GPU and a CUDA build of PyTorch, or use device='cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={str(device)!r} but only {torch.cuda.device_count()} "
                             "GPU(s) are visible; use cuda or cuda:0")
    return dev


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_threads() -> int:
    """Intra-op threads for the benchmark: ``$DPCLIP_BENCH_THREADS``, default ``min(2, cpus)``."""
    env = os.environ.get("DPCLIP_BENCH_THREADS", "").strip()
    return int(env) if env else min(2, os.cpu_count() or 1)


#: the per-example cross-entropy that ``make_private`` and ``dpclip train`` use by default (a known
#: loss: the ghost engine proves it separable by its semantics, dpclip.engine.known_losses)
_loss_fn = cross_entropy_per_example


def _make_step(method: str, model_name: str, batch_size: int, seed: int = 0,
               device: str | torch.device = "cpu") -> Callable[[], None]:
    if model_name not in BENCH_MODELS:
        raise ValueError(f"unknown bench model {model_name!r}; valid: {', '.join(BENCH_MODELS)}")
    if method not in ALL_METHODS:
        raise ValueError(f"unknown bench method {method!r}; valid: {', '.join(ALL_METHODS)}")
    dev = torch.device(device)
    spec = BENCH_MODELS[model_name]
    torch.manual_seed(seed)
    model = build_model(spec.registry, spec.input_shape, spec.classes, **spec.options).to(dev)
    if spec.vocab is None:
        x = torch.randn(batch_size, *spec.input_shape)
    else:
        x = torch.randint(0, spec.vocab, (batch_size, *spec.input_shape))
    y = torch.randint(0, spec.classes, (batch_size,))
    x, y = x.to(dev), y.to(dev)
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
    engine = get_engine(engine_name)
    strategy = FixedClip(CLIP_NORM)
    sampler = PoissonSampler(60_000, float(batch_size))
    groups = ParamGroups.flat(model)
    gen = make_generator(seed, device=x.device)  # noise drawn where the gradient is
    ctx = StepContext.at(0, steps_per_epoch=sampler.steps_per_epoch, total_steps=1,
                         expected_batch_size=float(batch_size),
                         base_noise_multiplier=NOISE_MULTIPLIER)
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
    # make_private only reads the loader's length and batch size: CPU copies suffice on any device
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.cpu(), y.cpu()),
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


def _proc_status_mb(*keys: str) -> dict[str, float]:
    """Fields of ``/proc/self/status`` in MB (empty where there is no procfs)."""
    out: dict[str, float] = {}
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in keys:
                    out[k] = int(v.split()[0]) / 1024.0  # kB
    except OSError:
        pass
    return out


def _reset_peak_rss() -> bool:
    """Reset this process's ``VmHWM`` to its current RSS (``echo 5 > /proc/self/clear_refs``,
    Linux >= 4.0); False where the kernel or sandbox does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _memory_child(method: str, model: str, batch_size: int, steps: int,
                  device: str = "cpu") -> dict[str, float]:
    """Run in a fresh process by :func:`_memory_probe`: ``{peak_mem_mb, base_mem_mb,
    extra_mem_mb}`` of ``steps`` steps of ``method`` (see the module docstring); prints them as
    one JSON line."""
    torch.set_num_threads(bench_threads())
    dev = _resolve_device(device)
    # two steps at a tiny batch first: code pages, lazy imports, cuBLAS/cuDNN workspaces are then
    # in the baseline instead of being counted as the step's memory
    warm = _make_step(method, model, min(_PROBE_WARMUP_BATCH, batch_size), seed=1, device=dev)
    warm()
    warm()
    del warm
    step = _make_step(method, model, batch_size, device=dev)
    gc.collect()
    if dev.type == "cuda":
        _synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev) / _MB
        for _ in range(steps):
            step()
        _synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) / _MB
    else:
        _reset_peak_rss()  # without it VmHWM is the peak since exec: never below the steps' peak
        base = _proc_status_mb("VmRSS").get("VmRSS", float("nan"))
        for _ in range(steps):
            step()
        peak = _proc_status_mb("VmHWM").get("VmHWM", float("nan"))
        if peak != peak:  # no procfs (not Linux): the process's peak, without a baseline
            import resource

            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            peak = rss / (_MB if sys.platform == "darwin" else 1024.0)
    res = {"peak_mem_mb": peak, "base_mem_mb": base, "extra_mem_mb": peak - base}
    print(json.dumps(res))
    return res


def _memory_probe(method: str, model: str, batch_size: int, steps: int,
                  device: torch.device) -> dict[str, float]:
    """:func:`_memory_child` in a fresh interpreter (a process's peak only grows, and Linux's
    ``ru_maxrss`` would even carry over this process's peak into the child)."""
    code = ("from dpclip.bench import _memory_child;"
            f"_memory_child({method!r}, {model!r}, {batch_size}, {steps}, {str(device)!r})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=os.environ.copy(), timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"memory probe for {method} on {model} B={batch_size} failed:\n"
                           f"{out.stderr[-2000:]}")
    return {k: float(v) for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def _opacus_missing() -> str | None:
    """Why Opacus cannot be imported, or None when it can."""
    try:
        import opacus  # noqa: F401
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _engine_ran(method: str, model_name: str) -> str | None:
    """Which engine a dpclip method runs on the model (``auto`` resolves to ghost or vmap)."""
    if not method.startswith("dpclip-"):
        return None
    name = method.removeprefix("dpclip-")
    if name != "auto":
        return name

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
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """Benchmark rows ``{model, batch_size, method, engine, device, allocator, ms_per_step, ms_iqr,
    ratio_to_nonprivate, cpu_ms_per_step, cpu_ratio_to_nonprivate, peak_mem_mb,
    mem_ratio_to_nonprivate, base_mem_mb, extra_mem_mb, extra_mem_ratio_to_nonprivate, threads,
    ...}``: the non-private step and each requested method (default :data:`DEFAULT_METHODS`).

    ``ms`` are wall-clock medians; ``cpu_ms`` the process CPU time (all threads), less sensitive to
    other processes on a shared machine. ``device``: ``"cpu"`` or ``"cuda"`` (model and batch on
    the GPU, each step synchronized before the clock is read); on CUDA the Opacus methods are left
    out, with a note on stderr, when Opacus is not installed. Memory: see the module docstring;
    ``extra_mem_ratio_to_nonprivate`` is None when the non-private step's extra memory is below
    :data:`MEM_RESOLUTION_MB`, and every memory field is NaN with ``measure_memory=False``.
    """
    methods = list(methods or DEFAULT_METHODS)
    if "nonprivate" not in methods:
        methods.insert(0, "nonprivate")
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown:
        raise ValueError(f"unknown bench method(s) {unknown}; valid: {', '.join(ALL_METHODS)}")
    if model not in BENCH_MODELS:
        raise ValueError(f"unknown bench model {model!r}; valid: {', '.join(BENCH_MODELS)}")
    if batch_size < 1 or steps < 1 or warmup < 0:
        raise ValueError(f"batch_size ({batch_size}) and steps ({steps}) must be >= 1 and warmup "
                         f"({warmup}) >= 0")
    dev = _resolve_device(device)
    torch.set_num_threads(bench_threads())
    if dev.type == "cuda" and any(m in OPACUS_METHODS for m in methods):
        why = _opacus_missing()
        if why is not None:
            skipped = [m for m in methods if m in OPACUS_METHODS]
            print(f"dpclip bench: Opacus is not importable ({why}); leaving out "
                  f"{', '.join(skipped)} on {dev} (pip install -c constraints.txt "
                  "'dpclip[bench]' to include them)", file=sys.stderr, flush=True)
            methods = [m for m in methods if m not in OPACUS_METHODS]
    fns = {m: _make_step(m, model, batch_size, device=dev) for m in methods}
    for _ in range(warmup):
        for f in fns.values():
            f()
    _synchronize(dev)
    times: dict[str, list[float]] = {m: [] for m in methods}
    cpu: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(steps):
        for m, f in fns.items():
            c0, t0 = time.process_time(), time.perf_counter()
            f()
            _synchronize(dev)
            times[m].append((time.perf_counter() - t0) * 1000.0)
            cpu[m].append((time.process_time() - c0) * 1000.0)
    del fns
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the probes' processes share the GPU with this one
    base = statistics.median(times["nonprivate"])
    cpu_base = statistics.median(cpu["nonprivate"])
    nan = float("nan")
    mem = {m: _memory_probe(m, model, batch_size, min(steps, 3), dev) if measure_memory
           else {"peak_mem_mb": nan, "base_mem_mb": nan, "extra_mem_mb": nan} for m in methods}
    extra_np = mem["nonprivate"]["extra_mem_mb"]
    label, alloc = _device_label(dev), _allocator(dev)
    rows = []
    for m in methods:
        med = statistics.median(times[m])
        q = statistics.quantiles(times[m], n=4) if len(times[m]) >= 4 else [med, med, med]
        rows.append({
            "model": model,
            "batch_size": batch_size,
            "method": m,
            "engine": _engine_ran(m, model),
            "device": label,
            "allocator": alloc,
            "ms_per_step": med,
            "ms_iqr": [q[0], q[2]],
            "ratio_to_nonprivate": med / base,
            "cpu_ms_per_step": statistics.median(cpu[m]),
            "cpu_ratio_to_nonprivate": statistics.median(cpu[m]) / cpu_base if cpu_base else nan,
            "peak_mem_mb": mem[m]["peak_mem_mb"],
            "mem_ratio_to_nonprivate": mem[m]["peak_mem_mb"] / mem["nonprivate"]["peak_mem_mb"],
            "base_mem_mb": mem[m]["base_mem_mb"],
            "extra_mem_mb": mem[m]["extra_mem_mb"],
            "extra_mem_ratio_to_nonprivate": (mem[m]["extra_mem_mb"] / extra_np
                                              if extra_np >= MEM_RESOLUTION_MB else None),
            "steps": steps,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        })
    return rows


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(run_bench(sys.argv[1], int(sys.argv[2]))))
