"""Noise draw per step per rank in a distributed run: every rank draws everything (before) versus
each rank its own block (issue 32 item 5), at 1, 2 and 4 gloo processes on the CPU.

The release of a ~1e7-coordinate model (``--tensors`` float32 tensors of ``--numel`` elements in
all; zero clipped sums: the arithmetic is the same for any values) through
``dpclip.training.release.release`` with a fixed clip strategy. Two figures per world size:

* ``draw_ms``: one rank's Gaussian draw of one step (float64 draw then cast, as the release
  does), timed rank after rank (the other ranks wait at a barrier, so the draw is not slowed by
  them). Method ``shard``: this rank's block, ``ceil(T / W)`` normals at most (its own stream,
  ``PrivateRandomness.rank_noise``). Method ``full`` (the code before): the whole vector, ``T``
  normals, on every rank (the shared generator).
* ``derive_stream_ms`` (``shard``): deriving the rank's stream of the step (SHAKE-256 of the
  noise key and (step, rank, W) into the 624 Mersenne Twister words), not part of ``draw_ms``.
* ``release_ms``: the whole release of one step with all ranks running at once: ``shard``:
  concatenate the local sums, add this rank's block, all-reduce, divide (the noise rides the
  gradient's all-reduce); ``full``: concatenate, all-reduce, add the whole draw, divide. With more
  ranks than idle cores the ranks share the cores: read it beside the load average.

Rows go to ``benchmarks/results/distributed_noise_cpu.json`` (world, method, numel, tensors,
draw_ms and release_ms medians and every repeat, normals_per_rank) and a Markdown table to
``distributed_noise_cpu.md``.

    .venv/bin/python benchmarks/distributed_noise.py [--worlds 1,2,4] [--numel 10000000]
        [--tensors 10] [--repeats 5]
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import pickle
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

OUT = Path(__file__).parent / "results" / "distributed_noise_cpu.json"
Z, CLIP, B = 1.0, 1.0, 256.0


def _sums(numel: int, tensors: int) -> dict[str, torch.Tensor]:
    sizes = [numel // tensors + (1 if i < numel % tensors else 0) for i in range(tensors)]
    return {f"p{i}": torch.zeros(n) for i, n in enumerate(sizes)}


def _rank(rank: int, world: int, store: str, numel: int, tensors: int, repeats: int,
          out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    from dpclip.clipping import FixedClip
    from dpclip.clipping.base import StepContext
    from dpclip.noise import add_gaussian_noise_all, standard_normal
    from dpclip.randomness import PrivateRandomness
    from dpclip.training.distributed import DistributedContext, shared_randomness
    from dpclip.training.noise_shard import NoiseShard, noise_bounds
    from dpclip.training.release import release
    from dpclip.training.sampling import PoissonSampler

    ctx = DistributedContext.current()
    rng = PrivateRandomness.secure()
    shared_randomness(rng, ctx)
    shard = NoiseShard(ctx, rng)
    sums = _sums(numel, tensors)
    lo, hi = noise_bounds(numel, world, rank)
    strat = FixedClip(CLIP)
    sampler = PoissonSampler(100_000, B)
    res: dict[str, Any] = {"draw": {"shard": [], "full": []},
                           "release": {"shard": [], "full": []}, "normals": hi - lo,
                           "derive": []}

    def step_ctx(t: int) -> StepContext:
        return StepContext.at(t, steps_per_epoch=1000, total_steps=1000, expected_batch_size=B,
                              base_noise_multiplier=Z)

    for t in range(repeats + 1):  # the first round warms up (allocator, pages)
        for r in range(world):  # draws, rank after rank
            dist.barrier()
            if r == rank:
                t0 = time.perf_counter()
                g = shard.generator(t)  # the step's stream: SHAKE-256 -> 624 MT words
                d_derive = time.perf_counter() - t0
                t0 = time.perf_counter()
                standard_normal(hi - lo, g, torch.float32, "cpu")
                d_shard = time.perf_counter() - t0
                t0 = time.perf_counter()
                standard_normal(numel, rng.noise, torch.float32, "cpu")
                d_full = time.perf_counter() - t0
                if t:
                    res["derive"].append(1000 * d_derive)
                    res["draw"]["shard"].append(1000 * d_shard)
                    res["draw"]["full"].append(1000 * d_full)
        dist.barrier()  # releases, all ranks at once
        t0 = time.perf_counter()
        release(sums, noise_multiplier=Z, sensitivity=CLIP, divisor=B,
                generator=shard.generator(t), strategy=strat, state=strat.init_state(),
                norms=torch.empty(0), ctx=step_ctx(t), sampler=sampler, sensitivity_factor=1,
                shard=shard if world > 1 else None)
        r_shard = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        flat = torch.cat([v.reshape(-1) for v in sums.values()])
        dist.all_reduce(flat)
        add_gaussian_noise_all({"flat": flat}, Z * CLIP, rng.noise, divide_by=B)
        r_full = time.perf_counter() - t0
        if t:
            res["release"]["shard"].append(1000 * r_shard)
            res["release"]["full"].append(1000 * r_full)
    Path(f"{out}.{rank}").write_bytes(pickle.dumps(res))
    dist.destroy_process_group()


def run(world: int, numel: int, tensors: int, repeats: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res")
        ctx = mp.get_context("fork")
        procs = [ctx.Process(target=_rank, args=(r, world, os.path.join(tmp, "store"), numel,
                                                 tensors, repeats, out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(900)
            if p.exitcode != 0:
                raise RuntimeError(f"a rank exited with code {p.exitcode}")
        return [pickle.loads(Path(f"{out}.{r}").read_bytes()) for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--numel", type=int, default=10_000_000)
    ap.add_argument("--tensors", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    rows = []
    for world in [int(w) for w in a.worlds.split(",")]:
        per_rank = run(world, a.numel, a.tensors, a.repeats)
        for method in ("full", "shard"):
            draws = [v for r in per_rank for v in r["draw"][method]]
            rels = [v for r in per_rank for v in r["release"][method]]
            rows.append({
                "world": world, "method": method, "numel": a.numel, "tensors": a.tensors,
                "normals_per_rank": a.numel if method == "full"
                else max(r["normals"] for r in per_rank),
                "draw_ms": round(statistics.median(draws), 2),
                "draw_ms_max_rank": round(max(statistics.median(r["draw"][method])
                                              for r in per_rank), 2),
                "release_ms": round(statistics.median(rels), 2),
                # deriving the rank's stream of the step (shard only; not in draw_ms)
                "derive_stream_ms": round(statistics.median(
                    [v for r in per_rank for v in r["derive"]]), 3) if method == "shard"
                else None,
                "draw_ms_runs": [round(v, 2) for v in draws],
                "release_ms_runs": [round(v, 2) for v in rels],
            })
            print(json.dumps({k: v for k, v in rows[-1].items() if not k.endswith("runs")}),
                  flush=True)
    meta = {"machine": f"{platform.machine()} {os.cpu_count()} logical CPUs",
            "cpus": os.cpu_count(), "device": "cpu", "load_average_at_end": os.getloadavg(),
            "torch": torch.__version__, "backend": "gloo (loopback)", "threads_per_rank": 1,
            "repeats": a.repeats, "date": datetime.date.today().isoformat()}
    print(write_outputs(rows, meta, a.out))


def write_outputs(rows: list[dict], meta: dict, out: Path) -> str:
    """The JSON rows and the Markdown table generated from them; returns the table."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = ["| ranks | method | normals per rank | draw ms/step/rank (median) | "
             "slowest rank's median | stream derivation ms/step | "
             "release ms/step (median, all ranks at once) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        derive = "-" if r.get("derive_stream_ms") is None else f"{r['derive_stream_ms']:.3f}"
        lines.append(f"| {r['world']} | {r['method']} | {r['normals_per_rank']:,} | "
                     f"{r['draw_ms']:.1f} | {r['draw_ms_max_rank']:.1f} | {derive} | "
                     f"{r['release_ms']:.1f} |")
    table = "\n".join(lines)
    load = tuple(round(v, 1) for v in meta["load_average_at_end"])
    out.with_suffix(".md").write_text(
        "# Distributed noise on CPU: every rank draws all (`full`, before) vs its block "
        "(`shard`)\n\n"
        f"`benchmarks/distributed_noise.py`; {meta['machine']}, load average at the end {load}, "
        f"torch {meta['torch']}, {meta['backend']}, 1 thread per rank, {meta['repeats']} repeats "
        f"(medians). The release is of {rows[0]['numel']:,} float32 coordinates in "
        f"{rows[0]['tensors']} tensors. draw: one rank's float64 Gaussian draw (then cast), "
        "timed rank after rank; release: noise, all-reduce and division, all ranks at once "
        "(with more ranks than idle cores they share the cores).\n\n" + table + "\n" + (
            "\nReading: the machine was loaded (load average at or above its "
            f"{meta['cpus']} logical CPUs, shared with other work): the two methods of one "
            "world size ran interleaved, step by step, so compare them with each other; the "
            "1-rank rows (the same draw under two names) show the spread. The release column "
            "at 4 ranks runs 4 processes on the cores there are.\n"
            if load[0] >= meta["cpus"] else ""))
    return table


if __name__ == "__main__":
    main()
