"""Cost of the Gaussian noise draw per step: float32 draws (dpclip before issue 32: capped at
5.77 sigma on the CPU), float64-then-cast draws (dpclip from issue 32 to the CPU sampler: capped at
8.57 sigma) and dpclip's draw now (:func:`dpclip.noise.standard_normal`: on the CPU a Box-Muller
with a 53-bit float64 radius and a float32 angle, capped at 8.57 sigma; on a GPU float64-then-cast),
for gradients of 5314 (the MLP cell), 1e5, 1e6 and 109M parameters (109M: BERT-base).

    python benchmarks/gpu_noise.py --device cpu  [--sizes 5314,1e5,1e6,1.09e8] [--repeats 21,21,5,1]
    python benchmarks/gpu_noise.py --device cuda                      # on a GPU machine

Methods, timed interleaved (one round = every method once, in turn):

* ``float32``: ``torch.randn(float32)`` from a generator on the device, added to the flat gradient
  (what a float32 draw costs; the old sampler where the generator is on the device);
* ``float32-cpu-copy`` (CUDA only): the dpclip <= 0.3 path, a CPU Mersenne Twister float32 draw
  copied to the GPU;
* ``float64-cast``: ``torch.randn(float64)`` cast to float32, then added (what every draw cost from
  issue 32 until the CPU sampler);
* ``dpclip-sampler``: :func:`dpclip.noise.standard_normal` in float32, then added (the sampler
  alone, timed as the two rows above);
* ``dpclip``: :func:`dpclip.noise.add_gaussian_noise_all` with the run's secret generator on the
  device (:class:`dpclip.randomness.PrivateRandomness`), the path a step takes now (the sampler
  plus the flat buffer's concatenation, split and views).

Each row gives the median and the minimum over the rounds (``ms``, ``ms_min``) and both ratios to
``float32``: on a shared, noisy machine the minimum is the steadier figure. On CUDA every timing
synchronises before and after. Rows go to ``benchmarks/results/noise_<device>.json`` (device name
and torch version in each row; ``--device-label`` names a machine, e.g. "shared 2-core CPU") and
a Markdown table to the ``.md`` beside it (``--append`` adds rows to an existing file).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

from dpclip.noise import add_gaussian_noise_all, standard_normal  # noqa: E402
from dpclip.randomness import PrivateRandomness  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def measure(n: int, device: torch.device, repeats: int, label: str | None = None) -> list[dict]:
    grads = {"w": torch.zeros(n, dtype=torch.float32, device=device)}
    rng = PrivateRandomness.secure(device)
    cpu_gen = PrivateRandomness.secure("cpu").noise

    def float32() -> None:
        z = torch.randn(n, generator=rng.noise, dtype=torch.float32, device=device)
        grads["w"].clone().add_(z, alpha=1.0)

    def float32_cpu_copy() -> None:
        z = torch.randn(n, generator=cpu_gen, dtype=torch.float32)
        grads["w"].clone().add_(z.to(device), alpha=1.0)

    def float64_cast() -> None:
        z = torch.randn(n, generator=rng.noise, dtype=torch.float64, device=device)
        grads["w"].clone().add_(z.to(torch.float32), alpha=1.0)

    def sampler() -> None:
        z = standard_normal(n, rng.noise, torch.float32, device)
        grads["w"].clone().add_(z, alpha=1.0)

    def dpclip() -> None:
        add_gaussian_noise_all(grads, 1.0, rng.noise, divide_by=1.0)

    methods = {"float32": float32, "float64-cast": float64_cast, "dpclip-sampler": sampler,
               "dpclip": dpclip}
    if device.type == "cuda":
        methods["float32-cpu-copy"] = float32_cpu_copy
    times: dict[str, list[float]] = {m: [] for m in methods}
    for fn in methods.values():  # warm-up
        fn()
    _sync(device)
    for _ in range(repeats):
        for name, fn in methods.items():
            _sync(device)
            t = time.perf_counter()
            fn()
            _sync(device)
            times[name].append((time.perf_counter() - t) * 1e3)
    base, base_min = statistics.median(times["float32"]), min(times["float32"])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({
            "params": n, "method": name, "ms": round(med, 3), "ms_min": round(min(ts), 3),
            "x_float32": round(med / base, 2), "x_float32_min": round(min(ts) / base_min, 2),
            "repeats": repeats,
            "device": label or _device_name(device), "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"),
        })
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "# Gaussian noise per step: float32, float64-then-cast and dpclip's sampler "
        "(generated by benchmarks/gpu_noise.py)",
        "",
        "ms per noise release of one flat float32 gradient (draw + add), methods interleaved; "
        "median and minimum over the rounds (the minimum is the steadier figure on a shared "
        "machine). `dpclip-sampler` is `dpclip.noise.standard_normal` then the add (CPU: "
        "Box-Muller with a 53-bit float64 radius and a float32 angle, tails to 8.57 sigma; "
        "GPU: float64 then cast); `dpclip` is the whole `add_gaussian_noise_all` (the sampler "
        "plus the flat buffer's concatenation and views); `float64-cast` is a float64 draw cast to float32 (dpclip from issue 32 until the "
        "CPU sampler; tails to 8.57 sigma); `float32` is a float32 draw (capped at 5.77 sigma on "
        "the CPU, 6.66 on CUDA); `float32-cpu-copy` is the dpclip <= 0.3 path on a GPU (CPU "
        "draw, then copied).",
        "",
        "| device | threads | torch | params | method | ms median | ms min | x float32 (median) "
        "| x float32 (min) | repeats | date |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms_min = f"{r['ms_min']:.3f}" if "ms_min" in r else "-"
        x_min = f"{r['x_float32_min']:.2f}" if "x_float32_min" in r else "-"
        lines.append(f"| {r['device']} | {r.get('threads', '-')} | {r['torch']} | "
                     f"{r['params']:,} | {r['method']} | {r['ms']:.3f} | {ms_min} | "
                     f"{r['x_float32']:.2f} | {x_min} | {r['repeats']} | {r['date']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sizes", default="5314,1e5,1e6,1.09e8")
    ap.add_argument("--repeats", default="21,21,5,1",
                    help="rounds per size (one value, or one per size)")
    ap.add_argument("--device-label", default=None, help="the machine's name in the rows")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--append", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    out = Path(args.out) if args.out else ROOT / "results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"noise_{device.type}.json"
    rows = json.loads(path.read_text()) if args.append and path.exists() else []
    sizes = args.sizes.split(",")
    repeats = [int(r) for r in str(args.repeats).split(",")]
    if len(repeats) == 1:
        repeats = repeats * len(sizes)
    if len(repeats) != len(sizes):
        ap.error(f"--repeats: give one value or one per size ({len(sizes)}), got {args.repeats!r}")
    for size, reps in zip(sizes, repeats):
        n = int(float(size))
        new = measure(n, device, reps, args.device_label)
        for r in new:
            print(json.dumps(r), flush=True)
        rows.extend(new)
    path.write_text(json.dumps(rows, indent=1) + "\n")
    path.with_suffix(".md").write_text(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
