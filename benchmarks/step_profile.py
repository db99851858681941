"""Where a private training step spends its time, on any device: `make_private` on the Papernot
CNN (the Tramer-Boneh Fashion-MNIST cell: B 2048, random 28x28 data of the dataset's size, SGD
momentum) against the same model's non-private step, then a `torch.profiler` table of a few
private steps (self CPU time per operator, the synchronisations, device-to-host copies).

    python benchmarks/step_profile.py [--device cuda] [--batch 2048] [--steps 20] [--out DIR]

On a GPU the step is bound by the host when the Python per step outweighs the kernels: the table's
self CPU column and the count of ``cudaStreamSynchronize`` / ``aten::_local_scalar_dense`` show
where. Writes ``step_profile_<device>.json`` (times, device, torch version) and
``step_profile_<device>.txt`` (the profiler tables) to ``--out`` (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(step, dev: torch.device, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        _sync(dev)
        t = time.perf_counter()
        step()
        _sync(dev)
        out.append(1000 * (time.perf_counter() - t))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--examples", type=int, default=60000)
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args()
    dev = torch.device(args.device)
    from dpclip.models import papernot_cnn
    from dpclip.training.private import make_private

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.examples, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (args.examples,), generator=g)

    torch.manual_seed(0)
    plain = papernot_cnn((1, 28, 28), 10).to(dev)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    xb, yb = x[:args.batch].to(dev), y[:args.batch].to(dev)

    def nonprivate():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(plain(xb), yb).backward()
        opt.step()

    torch.manual_seed(0)
    model = papernot_cnn((1, 28, 28), 10).to(dev)
    popt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dp = make_private(model, popt, (x, y), noise_multiplier=1.0, steps=100000,
                      batch_size=args.batch, strategy="fixed",
                      strategy_params={"clip_norm": 0.1}, device=dev, verbose=False)
    loader = iter(dp.loader)

    sampled: list[float] = []

    def private():
        t = time.perf_counter()
        xs, ys = next(loader)
        _sync(dev)
        sampled.append(1000 * (time.perf_counter() - t))
        dp.step(xs, ys)

    for f in (nonprivate, private):
        _timed(f, dev, 3)
    rounds = {"nonprivate": [], "private": []}
    sampled.clear()
    for _ in range(args.steps):  # interleaved
        rounds["nonprivate"] += _timed(nonprivate, dev, 1)
        rounds["private"] += _timed(private, dev, 1)
    rounds["sample"] = sampled[:]
    med = {k: statistics.median(v) for k, v in rounds.items()}
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    row = {"device": name, "torch": torch.__version__, "batch": args.batch,
           "threads": torch.get_num_threads(), "ms_nonprivate": med["nonprivate"],
           "ms_private_step_with_sampling": med["private"], "ms_sampling_only": med["sample"],
           "ratio": med["private"] / med["nonprivate"], "steps": args.steps,
           "engine": (dp.engine_info or {}).get("engine") if hasattr(dp, "engine_info") else None}
    print(json.dumps(row), flush=True)

    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(5):
            private()
        _sync(dev)
    ka = prof.key_averages()
    tables = ["# self CPU time, 5 private steps\n",
              ka.table(sort_by="self_cpu_time_total", row_limit=30)]
    if dev.type == "cuda":
        tables += ["\n# device time\n", ka.table(sort_by="self_cuda_time_total", row_limit=20)]
    counts = {e.key: e.count for e in ka if any(s in e.key for s in (
        "Synchronize", "_local_scalar_dense", "Memcpy", "aten::item", "aten::to", "nonzero"))}
    tables.append("\n# synchronising / copying operators (count over 5 steps)\n"
                  + json.dumps(counts, indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    row["sync_counts_5_steps"] = counts
    (out / f"step_profile_{dev.type}.json").write_text(json.dumps(row, indent=1) + "\n")
    (out / f"step_profile_{dev.type}.txt").write_text("\n".join(tables))
    print("\n".join(tables)[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
