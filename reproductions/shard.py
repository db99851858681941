"""Run one spec as parallel shards (one per strategy x privacy level), for a many-core GPU machine.

``dpclip run --workers N`` parallelises the final runs only: a tuned spec's trials, and the
greedy searches of Transfer / Decay, run one after the other before them. On a GPU with many CPU
cores the whole cell (search, trials, then every seed) is the natural unit of work, so this script
starts one process per cell (``strategy label x epsilon / noise multiplier``), each with its own
results database and output folder, at most ``--jobs`` at a time, and merges the finished runs,
trials and schedules into ``--db`` at the end (or at ``--deadline-s``, after stopping the cells
still running: they resume from their checkpoints on the next call with the same ``--work``).

The runs are exactly those of ``dpclip run SPEC`` (same fingerprints, experiment names and
choices), so ``dpclip reproductions`` and ``dpclip report`` read the merged database as usual.

    python reproductions/shard.py reproductions/lin_table2_fmnist.toml --db out.db \
        --work /tmp/shards --jobs 12 --set train.device=cuda --deadline-s 540
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path


def merge(src: str | os.PathLike, dst: str | os.PathLike, experiments: list[str]) -> int:
    """Copy the finished runs (with their epochs) of ``experiments`` and every schedule that
    ``dst`` lacks from ``src`` into ``dst``; returns the number of runs copied."""
    from dpclip.store import ResultsStore

    ResultsStore(dst).close()  # creates the schema when dst is new
    s, d = sqlite3.connect(src), sqlite3.connect(dst)
    try:
        cols = [r[1] for r in s.execute("PRAGMA table_info(runs)") if r[1] != "id"]
        n = 0
        for exp in experiments:
            rows = s.execute(f"SELECT id, {','.join(cols)} FROM runs WHERE experiment=? AND "
                             "status='finished'", (exp,)).fetchall()
            for old, *vals in rows:
                rec = dict(zip(cols, vals))
                if d.execute("SELECT 1 FROM runs WHERE fingerprint=? AND experiment=? AND "
                             "status='finished'", (rec["fingerprint"], exp)).fetchone():
                    continue
                new = d.execute(f"INSERT INTO runs ({','.join(rec)}) VALUES "
                                f"({','.join('?' * len(rec))})", tuple(rec.values())).lastrowid
                d.executemany("INSERT INTO epochs (run_id, epoch, metrics) VALUES (?,?,?)",
                              [(new, e, m) for e, m in s.execute(
                                  "SELECT epoch, metrics FROM epochs WHERE run_id=?", (old,))])
                n += 1
        scols = [r[1] for r in s.execute("PRAGMA table_info(schedules)")]
        for row in s.execute(f"SELECT {','.join(scols)} FROM schedules"):
            d.execute(f"INSERT OR IGNORE INTO schedules ({','.join(scols)}) VALUES "
                      f"({','.join('?' * len(scols))})", row)
        d.commit()
        return n
    finally:
        s.close()
        d.close()


def _copy_db(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """A consistent copy of a (possibly WAL-mode, possibly open) SQLite database."""
    s, d = sqlite3.connect(src), sqlite3.connect(dst)
    try:
        s.backup(d)
    finally:
        s.close()
        d.close()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _stop_cells(running: dict) -> None:
    """SIGINT to every running cell's process group (the cell and its final-run workers: each run
    is marked interrupted and resumes from its checkpoint), SIGKILL after 15 s of grace."""
    for proc, cdir in running.values():
        _signal_group(proc, signal.SIGINT)
    grace = time.monotonic() + 15
    for proc, cdir in running.values():
        try:
            proc.wait(timeout=max(0.1, grace - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        _signal_group(proc, signal.SIGKILL)  # workers the cell left behind
        print(f"deadline: stopped {cdir.name}", flush=True)
    running.clear()


def _cells(spec) -> list[tuple[str, str, float]]:
    levels = [("epsilon", e) for e in spec.epsilons] + [
        ("noise_multiplier", z) for z in spec.noise_multipliers]
    return [(st.label, k, v) for st in spec.strategies for k, v in levels]


def _one_cell(args: argparse.Namespace) -> int:
    from dpclip.harness.runner import run_experiment
    from dpclip.harness.spec import load_spec

    import torch

    # a cell started from a background job inherits SIGINT ignored; the deadline stops it with
    # SIGINT (KeyboardInterrupt: the run is marked interrupted and resumes from its checkpoint)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.threads:  # the trials and searches run in this process too
        torch.set_num_threads(args.threads)
    spec = load_spec(args.spec, args.set)
    st = [s for s in spec.strategies if s.label == args.label]
    level = {"epsilons": (), "noise_multipliers": ()}
    level[args.level] = (args.value,)
    cell = dataclasses.replace(spec, strategies=tuple(st), **level)
    rep = run_experiment(cell, db=args.db, out_dir=args.work, workers=args.workers,
                         progress=False, threads=args.threads)
    for name, err in rep.failed:
        print(f"FAILED {name}: {err}", file=sys.stderr)
    return 1 if rep.failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("spec")
    p.add_argument("--db", required=True, help="merged results database (created or extended)")
    p.add_argument("--work", required=True, help="folder for the cells' databases and checkpoints")
    p.add_argument("--jobs", type=int, default=4, help="cells at a time")
    p.add_argument("--workers", type=int, default=1, help="final-run workers inside a cell")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per run (default: CPU count / (jobs x workers))")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="stop the cells still running after this many seconds, then merge")
    p.add_argument("--only", action="append", default=[], metavar="LABEL",
                   help="run only these strategy labels (repeatable)")
    p.add_argument("--cell", nargs=3, metavar=("LABEL", "LEVEL", "VALUE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cell:
        args.label, level, value = args.cell
        args.level, args.value = level, float(value)
        return _one_cell(args)

    from dpclip.harness.spec import load_spec

    spec = load_spec(args.spec, args.set)
    exps = [spec.name, f"{spec.name}:tuning"]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    cells = [c for c in _cells(spec) if not args.only or c[0] in args.only]
    threads = args.threads or max(1, (os.cpu_count() or 1) // (args.jobs * args.workers))
    t0 = time.monotonic()
    pending = list(enumerate(cells))
    running: dict[int, tuple[subprocess.Popen, Path]] = {}
    done: list[tuple[str, int]] = []
    while pending or running:
        while pending and len(running) < args.jobs:
            i, (label, key, value) = pending.pop(0)
            cdir = work / ("cell-" + re.sub(r"[^A-Za-z0-9.]+", "_", f"{label}-{key}-{value}"))
            cdir.mkdir(exist_ok=True)
            cdb = cdir / "cell.db"
            if not cdb.exists() and Path(args.db).exists():
                _copy_db(args.db, cdb)  # finished runs / trials / schedules are skipped
            level = "epsilons" if key == "epsilon" else "noise_multipliers"
            cmd = [sys.executable, __file__, args.spec, "--db", str(cdb), "--work", str(cdir),
                   "--workers", str(args.workers), "--threads", str(threads),
                   "--cell", label, level, repr(value)]
            for s in args.set:
                cmd += ["--set", s]
            log = open(cdir / "log.txt", "a")
            print(f"[{time.monotonic() - t0:6.0f}s] start {label} {key}={value} (cell{i:02d})",
                  flush=True)
            env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
            # its own process group: the deadline's SIGINT reaches the cell's final-run workers
            running[i] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True), cdir)
        for i, (proc, cdir) in list(running.items()):
            if proc.poll() is not None:
                done.append((cdir.name, proc.returncode))
                print(f"[{time.monotonic() - t0:6.0f}s] end {cdir.name} rc={proc.returncode}",
                      flush=True)
                del running[i]
        stop = args.deadline_s is not None and time.monotonic() - t0 > args.deadline_s
        if not stop:
            try:
                time.sleep(1.0)
            except KeyboardInterrupt:  # Ctrl-C: stop the cells as at the deadline, then merge
                stop = True
        if stop:
            _stop_cells(running)
            break
    n = 0
    for cdb in sorted(work.glob("cell*/cell.db")):
        n += merge(cdb, args.db, exps)
    print(f"merged {n} new runs into {args.db}; cells ended: {done}; "
          f"not started: {[c for _, c in pending]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
