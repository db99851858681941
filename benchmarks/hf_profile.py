"""Where dpclip's private step on a Hugging Face model spends its time: the step of
``benchmarks/hf_models.py`` (``dp_step`` with the ghost engine, flat clipping, noise 1) timed against
the non-private step, then (1) a sampling profile of the Python stack (a thread reads the main
thread's frames every few milliseconds: which dpclip functions the wall time is in, with their
callers), (2) a ``torch.profiler`` table (self CPU time per operator; on CUDA device time and the
synchronising / copying operators).

    python benchmarks/hf_profile.py [--device cuda] [--model bert] [--size base] [--steps 5]

Made for the GPU machines, where BERT-base on the ghost engine took 1660 ms a step against 58 ms
non-private (benchmarks/results/hf_models_cuda_sdpa.md) while the kernels of a ghost step are a few
times a non-private step's. Prints everything; writes nothing.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))
sys.path.insert(0, str(ROOT))


def _timed(step, dev: torch.device, n: int) -> float:
    """The median of ``n`` synchronised step times (ms)."""
    from step_profile import _timed as times

    return statistics.median(times(step, dev, n))


class Sampler:
    """Samples the main thread's Python stack every ``period`` seconds (self time by innermost
    dpclip / transformers / torch frame, inclusive time by dpclip function)."""

    def __init__(self, period: float = 0.002) -> None:
        self.period, self.stop = period, threading.Event()
        self.main = threading.main_thread().ident
        self.inner: collections.Counter = collections.Counter()
        self.incl: collections.Counter = collections.Counter()
        self.n = 0

    def run(self) -> None:
        while not self.stop.is_set():
            f = sys._current_frames().get(self.main)
            seen, first = set(), None
            while f is not None:
                c = f.f_code
                name = f"{Path(c.co_filename).name}:{c.co_name}"
                if first is None and any(k in c.co_filename for k in ("dpclip", "transformers",
                                                                      "torch")):
                    first = f"{name}:{f.f_lineno}"
                if "dpclip" in c.co_filename and name not in seen:
                    seen.add(name)
                    self.incl[name] += 1
                f = f.f_back
            self.inner[first or "?"] += 1
            self.n += 1
            time.sleep(self.period)

    def report(self, top: int = 40) -> str:
        lines = [f"# {self.n} samples; innermost library frame (self)"]
        lines += [f"{100 * v / self.n:6.1f}%  {k}" for k, v in self.inner.most_common(top)]
        lines += ["", "# dpclip functions on the stack (inclusive)"]
        lines += [f"{100 * v / self.n:6.1f}%  {k}" for k, v in self.incl.most_common(top)]
        return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="bert")
    ap.add_argument("--size", default=None, choices=["small", "base"])
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--method", default="dpclip-ghost")
    args = ap.parse_args()
    import hf_models as H

    dev = torch.device(args.device)
    s = H.sizes(args.size or ("base" if dev.type == "cuda" else "small"))
    print("torch", torch.__version__, "device", dev, args.model, s, flush=True)
    base, x, y, loss_fn = H.build(args.model, s, args.attn)
    x, y = H._to(x, dev), y.to(dev)
    steps = {}
    for m in ("nonprivate", args.method):
        step, info = H.stepper(m, base, x, y, loss_fn, dev)
        steps[m] = (step, info)
        _timed(step, dev, 2)
    for m, (step, info) in steps.items():
        print(f"{m}: {_timed(step, dev, args.steps):.1f} ms/step", info() if info else "",
              flush=True)
    step = steps[args.method][0]
    sampler = Sampler()
    th = threading.Thread(target=sampler.run, daemon=True)
    th.start()
    _timed(step, dev, args.steps)
    sampler.stop.set()
    th.join()
    print(sampler.report(), flush=True)

    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(2):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    ka = prof.key_averages()
    print("# self CPU time, 2 steps\n" + ka.table(sort_by="self_cpu_time_total", row_limit=25))
    if dev.type == "cuda":
        print("# device time\n" + ka.table(sort_by="self_cuda_time_total", row_limit=15))
    print({e.key: e.count for e in ka if any(k in e.key for k in (
        "Synchronize", "_local_scalar_dense", "Memcpy", "aten::item", "nonzero"))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
