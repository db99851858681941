"""How much of the ghost engine's step time on the ``dpclip bench`` MLP (model ``mlp``) goes to the
soundness checks, and could the step-time ratio to the non-private step reach v0.2.0's
(``results/cpu_engines_v02.json``, glibc rows) with them?

MEASUREMENT ONLY. Three variants of the ``dpclip-ghost`` step (``dpclip.bench._make_step``), each
made by monkeypatching module attributes in this benchmark's process (the library's source is never
changed); the patched variants REMOVE PRIVACY CHECKS and are never a configuration:

* ``as shipped`` - nothing patched;
* ``static checks removed`` - ``dpclip.training.step.check_structure`` a no-op (the engine's own
  call is skipped inside ``dp_step`` anyway: ``isolation.structure_checked``);
  ``dpclip.engine.ghost.exact_float32`` and ``dpclip.engine.ghost.engine_only``
  ``contextlib.nullcontext``; ``dpclip.engine.ghost._scan`` walked once per model and cached, with
  only each ruled owner's ``config`` (``ghost_rules.layer_config``: it holds the parameters'
  version counters, which every ``opt.step`` moves) taken again per call, exactly as the unpatched
  scan takes it (a cache of the whole scan makes the engine refuse the second step);
  ``dpclip.engine.ghost._closed_chain`` computed once per model and cached;
* ``static checks and underflow flush removed`` - the above, and ``dpclip.engine.ghost._flush_tiny``
  and ``dpclip.engine.ghost._refuse_rewritten_inputs`` no-ops.

Each variant's step is run once first with its released gradient recorded (``dpclip.bench.dp_step``
wrapped for that one call) and checked: the model's trainable parameter names and shapes, finite
values; the patched functions are checked to be called (or, for the cached ones, hit).

Timing: one process per thread setting (this script re-invokes itself with ``--child THREADS``, so
torch's thread pool is fresh; ``torch.set_num_threads`` and ``OMP_NUM_THREADS``), the non-private
step and the three variants interleaved block by block (``--steps`` steps per block, timed with
``time.perf_counter``; the order rotated every round), after a warm-up round. ``ms`` are medians
over ``--rounds`` rounds of the per-step time of a block; ``ratio`` is the median over rounds of the
ghost block's time over the same round's non-private block.

    python benchmarks/mlp_check_budget.py [--rounds 15] [--steps 40] [--threads 1,2] \
        [--batches 256,1024]
    python benchmarks/mlp_check_budget.py --table   # only regenerate the .md from the .json

Rows (model, batch, variant, threads, ms ghost / non-private, ratio, rounds, device, allocator,
torch version, revision, date; ``load_1min``: the 1-minute load average when the child started and
when the row was taken, since another busy process slows a 2-thread step many times over) go to
``benchmarks/results/mlp_check_budget_cpu.json``; the table beside it (``.md``) adds v0.2.0's
ratio (cpu_engines_v02.json, model mlp, same batch, glibc allocator, 2 threads) and the 5 %
criterion (v0.2 ratio x 1.05).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
V02 = RESULTS / "cpu_engines_v02.json"
MODEL = "mlp"
VARIANTS = ("as shipped", "static checks removed", "static checks and underflow flush removed")
_MARK = "MLP_CHECK_BUDGET_ROWS "


# ------------------------------------------------------------------------------ the patches


def _replacements(variant: str) -> list[tuple[Any, str, Any]]:
    """``(module, attribute, replacement)`` for ``variant`` (fresh caches each call)."""
    import dpclip.engine.ghost as ghost
    import dpclip.training.step as step_mod
    from dpclip.engine.ghost_rules import layer_config

    if variant == "as shipped":
        return []
    orig_scan, orig_chain = ghost._scan, ghost._closed_chain
    scans: dict[int, tuple[Any, Any]] = {}
    chains: dict[int, tuple[Any, Any]] = {}

    def cached_scan(model):
        got = scans.get(id(model))
        if got is None or got[0]() is not model:
            scan = orig_scan(model)
            scans[id(model)] = (weakref.ref(model), scan)
            return scan
        scan = got[1]
        for o in scan.owners:  # (what _Owner.__init__ takes per step: versions move with opt.step)
            if o.config is not None:
                o.config = layer_config(o.module)
            o.starts.clear()
        return scan

    def cached_chain(model, scan, loss_fn, xs, ys):
        got = chains.get(id(model))
        if got is None or got[0]() is not model:
            chain = orig_chain(model, scan, loss_fn, xs, ys)
            chains[id(model)] = (weakref.ref(model), chain)
            return chain
        return got[1]

    out = [(step_mod, "check_structure", lambda model, owner: None),
           (ghost, "exact_float32", contextlib.nullcontext),
           (ghost, "engine_only", contextlib.nullcontext),
           (ghost, "_scan", cached_scan),
           (ghost, "_closed_chain", cached_chain)]
    if variant == "static checks and underflow flush removed":
        out += [(ghost, "_flush_tiny", lambda c: None),
                (ghost, "_refuse_rewritten_inputs", lambda live: None)]
    return out


@contextlib.contextmanager
def _patched(repl: list[tuple[Any, str, Any]]):
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in repl]
    try:
        for mod, name, new in repl:
            setattr(mod, name, new)
        yield
    finally:
        for mod, name, old in reversed(saved):
            setattr(mod, name, old)


def _check(variant: str, step: Callable[[], None], repl: list[tuple[Any, str, Any]]) -> None:
    """One step of ``variant`` with its released gradient recorded and checked, and every patched
    function seen called."""
    import torch
    import dpclip.bench as bench

    calls = {f"{getattr(m, '__name__', m)}.{n}": 0 for m, n, _ in repl}

    def counted(key, f):
        def g(*a, **k):
            calls[key] += 1
            return f(*a, **k)
        return g

    counting = [(m, n, counted(f"{getattr(m, '__name__', m)}.{n}", f)) for m, n, f in repl]
    got: dict[str, Any] = {}
    real = bench.dp_step

    def recorder(model, *a, **k):
        out = real(model, *a, **k)
        got["model"], got["out"] = model, out
        return out

    bench.dp_step = recorder
    try:
        with _patched(counting):
            step()
    finally:
        bench.dp_step = real
    want = {n: tuple(p.shape) for n, p in got["model"].named_parameters() if p.requires_grad}
    have = {n: tuple(g.shape) for n, g in got["out"].grads.items()}
    if have != want or list(have) != list(want):
        raise RuntimeError(f"{variant}: released gradient {have} != parameters {want}")
    if not all(bool(torch.isfinite(g).all()) for g in got["out"].grads.values()):
        raise RuntimeError(f"{variant}: released gradient not finite")
    missed = [k for k, v in calls.items() if v == 0]
    if missed:
        raise RuntimeError(f"{variant}: patched functions never called: {missed}")


# --------------------------------------------------------------------------------- the child


def child(threads: int, batches: list[int], rounds: int, steps: int) -> list[dict]:
    import torch
    import dpclip.bench as bench

    torch.set_num_threads(threads)
    load0 = os.getloadavg()[0]  # (another process on the 2 cores slows a 2-thread step a lot)
    rows = []
    for batch in batches:
        np_step = bench._make_step("nonprivate", MODEL, batch)
        ghost = {v: bench._make_step("dpclip-ghost", MODEL, batch) for v in VARIANTS}
        repl = {v: _replacements(v) for v in VARIANTS}
        for v in VARIANTS:
            _check(v, ghost[v], repl[v])
            with _patched(repl[v]):  # (a second step: the cached scan and chain are reused)
                ghost[v]()
                ghost[v]()
        names = ("nonprivate",) + VARIANTS

        def block(name: str) -> float:
            fn = np_step if name == "nonprivate" else ghost[name]
            with _patched([] if name == "nonprivate" else repl[name]):
                t0 = time.perf_counter()
                for _ in range(steps):
                    fn()
                return (time.perf_counter() - t0) * 1000.0 / steps

        for name in names:  # warm-up round
            block(name)
        ms: dict[str, list[float]] = {n: [] for n in names}
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                ms[name].append(block(name))
        for v in VARIANTS:
            ratios = [g / n for g, n in zip(ms[v], ms["nonprivate"])]
            rows.append({"model": MODEL, "batch_size": batch, "variant": v, "threads": threads,
                         "ms_per_step": statistics.median(ms[v]),
                         "ms_nonprivate": statistics.median(ms["nonprivate"]),
                         "ratio": statistics.median(ratios),
                         "ratio_iqr": [q for q in statistics.quantiles(ratios, n=4)[::2]],
                         "rounds": rounds, "steps_per_round": steps, "device": "cpu",
                         "allocator": "jemalloc" if "jemalloc" in os.environ.get("LD_PRELOAD", "")
                         else "glibc", "torch": torch.__version__,
                         "load_1min": [round(load0, 2), round(os.getloadavg()[0], 2)]})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


# --------------------------------------------------------------------------------- the table


def _v02_ratio(batch: int) -> float | None:
    for r in json.loads(V02.read_text()):
        if (r.get("model") == MODEL and r.get("batch_size") == batch and
                r.get("method") == "dpclip-ghost" and r.get("allocator") == "glibc"):
            return r["ratio_to_nonprivate"]
    return None


def table(rows: list[dict]) -> str:
    r0 = rows[0]
    lines = [
        "# Soundness checks' share of the ghost step on the bench MLP (generated by "
        "benchmarks/mlp_check_budget.py)", "",
        "**Measurement only.** The patched variants remove privacy checks (structure check, "
        "isolation and exact-arithmetic guards, per-step scan and closed-chain checks, the "
        "underflow flush, the rewritten-input check) by monkeypatching inside the benchmark "
        "process; they are never a configuration and must not be used to train. They bound how "
        "much of the step time those checks cost.", "",
        f"Model `mlp`, CPU ({r0['allocator']} allocator), torch {r0['torch']}, revision "
        f"{r0['revision']}, {r0['date']}; `time.perf_counter` over blocks of "
        f"{r0['steps_per_round']} steps, non-private and the variants interleaved in one process "
        f"per thread setting, medians over {r0['rounds']} rounds (ratio: median of the per-round "
        "ratios). v0.2 ratio: cpu_engines_v02.json, `dpclip-ghost`, glibc rows (measured at 2 "
        "threads); criterion: v0.2 ratio x 1.05; load 1 min: the machine's load average when the "
        "thread setting's process started / when the row was taken (2 cores).", "",
        "| batch | threads | variant | ghost ms | non-private ms | ratio | ratio IQR | v0.2 ratio "
        "| criterion (x1.05) | meets | load 1 min |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["batch_size"], r["threads"],
                                         VARIANTS.index(r["variant"]))):
        v02 = _v02_ratio(r["batch_size"])
        crit = v02 * 1.05 if v02 is not None else None
        lo, hi = r["ratio_iqr"]
        lines.append(
            f"| {r['batch_size']} | {r['threads']} | {r['variant']} | {r['ms_per_step']:.3f} | "
            f"{r['ms_nonprivate']:.3f} | {r['ratio']:.2f} | {lo:.2f}-{hi:.2f} | "
            f"{'-' if v02 is None else f'{v02:.2f}'} | {'-' if crit is None else f'{crit:.2f}'} | "
            f"{'-' if crit is None else ('yes' if r['ratio'] <= crit else 'no')} | "
            f"{'/'.join(str(x) for x in r.get('load_1min', ())) or '-'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=40, help="steps per timed block")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batches", default="256,1024")
    ap.add_argument("--name", default="mlp_check_budget_cpu")
    ap.add_argument("--table", action="store_true", help="only regenerate the .md from the .json")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = RESULTS / args.name
    batches = [int(b) for b in args.batches.split(",")]
    if args.child is not None:
        rows = child(args.child, batches, args.rounds, args.steps)
        print(_MARK + json.dumps(rows), flush=True)
        return 0
    if not args.table:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=ROOT).stdout.strip()
        date = time.strftime("%Y-%m-%d")
        rows = []
        for t in (int(x) for x in args.threads.split(",")):
            env = {**os.environ, "OMP_NUM_THREADS": str(t), "MKL_NUM_THREADS": str(t)}
            proc = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--child", str(t), "--rounds",
                 str(args.rounds), "--steps", str(args.steps), "--batches", args.batches],
                env=env, stdout=subprocess.PIPE, text=True, check=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith(_MARK)][-1]
            rows += [{**r, "revision": rev, "date": date} for r in json.loads(line[len(_MARK):])]
        out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    rows = json.loads(out.with_suffix(".json").read_text())
    md = table(rows)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
