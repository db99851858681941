"""Cost of closing issue 31's fourth-pass holes: the hook-free backward
(``dpclip.engine.hook_free``: the engine calls each node of the graph itself) against
``torch.autograd.grad`` on the same step, and the watch of a chunk of one example
(``dpclip.engine.one_example``) against an untraced chunk of one, ``max_physical_batch=1``.

Per case, ``--steady`` later steps (the proof cached), the two variants alternating, medians. The
"before" variants are the same code with the new piece swapped out in the process (the backward
through ``torch.autograd.grad``; a no-op watch). Models: the bench's MLP (B 256; for the chunks of
one B 16) and the small Hugging Face configs of benchmarks/hf_models.py.

    PYTHONPATH=src:. python benchmarks/hook_free_cost.py [--steady 10] [--out PATH]

Rows go to benchmarks/results/hook_free_cost_cpu.json (+ .md)."""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent / "results"


class _NoWatch:
    """The chunk-of-one watch swapped out (the code before: a chunk of one untraced)."""

    def __init__(self, *args) -> None:
        pass

    def __enter__(self) -> "_NoWatch":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def verdict(self) -> None:
        return None


def _autograd_grad(total, edges):
    return list(torch.autograd.grad(total, list(edges), allow_unused=True))


def _time(step, steady: int, variants: dict) -> dict:
    """Median ms of ``step()`` under each variant (a context manager factory), alternating."""
    for v in variants.values():  # warm: the proof and caches
        with v():
            step()
    got: dict = {k: [] for k in variants}
    for r in range(steady):
        for k in (list(variants) if r % 2 else list(variants)[::-1]):
            with variants[k]():
                t0 = time.perf_counter()
                step()
                got[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in got.items()}


def main(argv: list[str] | None = None) -> None:
    import sys
    from unittest import mock

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import hf_models as hf
    from auto_probe_cost import _mlp_case  # (the bench MLP, a user loss)
    from memory_watch_cost import _commit
    from dpclip.engine import GhostEngine, ParamGroups, ghost, ghost_forward

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steady", type=int, default=10)
    ap.add_argument("--out", default=str(OUT / "hook_free_cost_cpu.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    wf = lambda n: 1.0 / n.clamp(min=1.0)  # noqa: E731
    s = hf.sizes("small")
    cases = {"mlp B256": _mlp_case(256)}
    for name in ("bert", "llama"):
        cases[f"{name} small B16"] = hf.build(name, s, "eager")
    backward = {"hook_free": contextlib.nullcontext,
                "autograd_grad": lambda: mock.patch.object(ghost, "hook_free_grad",
                                                           _autograd_grad)}
    chunk = {"watched": contextlib.nullcontext,
             "untraced": lambda: mock.patch.object(ghost_forward, "OneExampleWatch", _NoWatch)}
    rows = []
    for label, (model, x, y, loss) in cases.items():
        groups = ParamGroups.flat(model)
        for what, variants, eng, xs, ys in (
                ("backward", backward, GhostEngine(), x, y),
                ("chunks of one (16 examples)", chunk, GhostEngine(max_physical_batch=1),
                 x[:16] if not isinstance(x, dict) else {k: v[:16] for k, v in x.items()},
                 y[:16])):
            med = _time(lambda: eng.compute(model, loss, xs, ys, wf, groups), args.steady,
                        variants)
            new, old = list(variants)
            row = {"case": label, "what": what, f"{new}_ms_median": round(med[new], 2),
                   f"{old}_ms_median": round(med[old], 2),
                   "ratio_median": round(med[new] / med[old], 3), "steady_rounds": args.steady,
                   "device": "cpu (shared 2-core machine, 1 thread)",
                   "cpu": platform.processor() or platform.machine(),
                   "torch": torch.__version__, "commit": _commit(),
                   "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            print(row, flush=True)
            rows.append(row)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    md = ["# Cost of the hook-free backward and of the chunk-of-one watch "
          "(benchmarks/hook_free_cost.py)", "",
          f"Later steps of GhostEngine, medians of {args.steady} alternating rounds; shared 2-core "
          f"CPU (other jobs running), 1 thread, torch {torch.__version__}, commit "
          f"{rows[0]['commit'] if rows else ''}. `backward`: the hook-free walk against "
          "`torch.autograd.grad` (same ATen operations: tests/engine/test_hook_free.py; a node's "
          "saved tensors are let go once it ran, as autograd does; peak memory not measured "
          "here: a GPU run). `chunks of one`: `max_physical_batch=1` on 16 examples, the chunk traced for "
          "what crosses calls against untraced.", "",
          "| case | what | new ms | before ms | new / before |", "|---|---|---|---|---|"]
    for r in rows:
        vals = [v for k, v in r.items() if k.endswith("_ms_median")]
        md.append(f"| {r['case']} | {r['what']} | {vals[0]} | {vals[1]} | {r['ratio_median']} |")
    Path(args.out).with_suffix(".md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
