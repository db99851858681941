"""Run an experiment grid: skip finished runs, resume interrupted ones, optionally in parallel.

Each run checkpoints into ``<out>-private/checkpoints/<fingerprint>`` (private files, beside the
published ``<out>``: ``dpclip.training.checkpoint.private_root``); a finished run is recognised by its
config fingerprint in the SQLite store. Killing the runner and starting it again therefore loses
nothing: finished runs are skipped, the interrupted ones resume from their last checkpoint (same
ledger, same result as an uninterrupted run), the rest start. Before that, strategy parameters
that name stored data (``transfer``'s ``schedule``, ``lin-decay``'s ``c0_from = "greedy"``) are
resolved from the store (``dpclip.search.resolve_strategy_params``; the greedy searches for ``C0``
checkpoint into ``<out>/search`` and are stored, so they run once). A spec with ``[tuning]`` then
runs its trials (``dpclip.harness.tuning``: stored under ``<name>:tuning``, checkpointed under
``<out>-private/tuning``, never repeated) and its runs use each cell's chosen setting.

With ``workers > 1`` the runs go to a pool of processes: forked, or spawned when this process has
already initialised CUDA (the trials or searches ran on the GPU here), since a forked child cannot
use a CUDA context it inherited.

Federated grids (``[federated]`` specs, user-level DP-FedAvg) go through the same loop, store and
resume; their runs are short and keep no checkpoint: an interrupted federated run starts again
from round 0 (with fresh secret randomness; nothing of the interrupted run was released).
"""

from __future__ import annotations

import contextlib

import fcntl
import multiprocessing
import os
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from dpclip.harness.spec import ExperimentSpec, RunSpec
from dpclip.store import ResultsStore
from dpclip.federated.spec import run_from_config
from dpclip.harness.tuning import tune_runs
from dpclip.interrupts import TrainingInterrupted
from dpclip.search.resolve import resolve_strategy_params
from dpclip.training.checkpoint import private_root
# looked up at call time: tests wrap trainer.train and stub distributed.init_from_env
from dpclip.training import distributed, trainer

__all__ = ["RunnerReport", "run_experiment"]


@dataclass
class RunnerReport:
    total: int
    skipped: int
    finished: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(
                f"another `dpclip run` holds {lock_path}; wait for it or stop it first"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run_one(run: RunSpec, db: str, ck_root: str, progress: bool, threads: int,
             checkpoint_interval_s: float, is_main: bool = True) -> tuple[str, str | None]:
    """Execute one run (in this process or a worker); returns (fingerprint, error or None).

    Under torchrun every rank trains the run together (``dpclip.training.distributed``); only rank 0
    (``is_main``) writes the store."""
    import torch

    torch.set_num_threads(threads)
    federated = getattr(run.config, "kind", None) == "federated"
    if not is_main:
        try:
            trainer.train(run.config, checkpoint_dir=Path(ck_root) / run.fingerprint,
                          checkpoint_interval_s=checkpoint_interval_s, progress=False)
            return run.fingerprint, None
        except Exception as exc:  # noqa: BLE001 - rank 0 records the failure
            return run.fingerprint, "".join(traceback.format_exception_only(type(exc), exc))
    store = ResultsStore(db)
    rid = store.start_run(run.fingerprint, run.config.to_dict(), experiment=run.experiment,
                          label=run.label)
    try:
        if federated:
            fed, summary, history = run_from_config(run.config)
            ledger = fed.ledger
        else:
            result = trainer.train(run.config, checkpoint_dir=Path(ck_root) / run.fingerprint,
                                   checkpoint_interval_s=checkpoint_interval_s, progress=progress)
            summary, history, ledger = result.summary, result.history, result.ledger
        for row in history:  # the full history, including epochs before a resume
            store.log_epoch(rid, row["epoch"], row)
        summary = dict(summary, label=run.label, experiment=run.experiment)
        if run.tuning is not None:  # the budget, the trials and the choice of the tuning
            summary["tuning"] = run.tuning
        store.finish_run(rid, summary, ledger.to_dict())
        return run.fingerprint, None
    except KeyboardInterrupt as exc:  # Ctrl-C: 'interrupted', resumed by the same command
        store.interrupt_run(rid, exc.message("run the same command")
                            if isinstance(exc, TrainingInterrupted) else "interrupted (Ctrl-C)")
        raise
    except Exception as exc:  # noqa: BLE001 - recorded, the grid goes on
        msg = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        store.fail_run(rid, msg)
        return run.fingerprint, msg
    finally:
        store.close()


def _pool_context() -> Any:
    """``None`` (the platform's default start method), or ``spawn`` once this process holds a CUDA
    context: CUDA cannot be re-initialised in a forked child ("Cannot re-initialize CUDA in forked
    subprocess"), and the trials and searches before the final runs put one here on a GPU."""
    import torch

    return multiprocessing.get_context("spawn") if torch.cuda.is_initialized() else None


def _resolve_runs(runs: list[RunSpec], store: ResultsStore, search_root: Path,
                  progress: bool) -> list[RunSpec]:
    """Resolve ``transfer`` schedule=NAME and ``lin-decay`` c0_from="greedy" from the store
    (running and storing the greedy searches the latter needs, once, resumably)."""
    out = []
    for r in runs:
        cfg = resolve_strategy_params(r.config, store, checkpoint_root=search_root,
                                      progress=progress)
        out.append(r if cfg is r.config else RunSpec(r.experiment, r.label, cfg))
    return out


def run_experiment(
    spec: ExperimentSpec,
    *,
    db: str | os.PathLike,
    out_dir: str | os.PathLike,
    workers: int = 1,
    progress: bool = True,
    checkpoint_interval_s: float = 60.0,
    threads: int | None = None,
) -> RunnerReport:
    """Execute every run of ``spec`` that is not finished in ``db``.

    Under ``torchrun`` (``WORLD_SIZE`` > 1) each run is one private run across the ranks: rank 0
    plans the grid (the lock, the store, resolved schedules) and sends the list of runs to the
    other ranks; every rank then trains each run together, and only rank 0 writes results and
    checkpoints. ``workers`` must be 1 there. ``threads``: torch threads per worker (default: the
    CPU count divided by ``workers``)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    dist_ctx = distributed.init_from_env()
    if dist_ctx is not None and workers != 1:
        raise ValueError("under torchrun the ranks train each run together: use --workers 1 "
                         "(the processes are the ranks)")
    if dist_ctx is not None and spec.kind == "federated":
        raise ValueError(f"{spec.name} is a federated grid (user-level DP-FedAvg): it runs in one "
                         "process; start it without torchrun (use --workers for parallel runs)")
    is_main = dist_ctx is None or dist_ctx.is_main
    if dist_ctx is not None and spec.tuning is not None:
        raise ValueError(f"spec {spec.name!r} has a [tuning] section: run it once without "
                         "torchrun first (the trials and choices are stored), or remove [tuning]")
    out = Path(out_dir)

    ck_root = private_root(out) / "checkpoints"  # private: beside the reports, not inside
    runs = spec.runs()
    todo: list[RunSpec] = []
    with _exclusive(out / f".{spec.name}.lock") if is_main else contextlib.nullcontext():
        if is_main:
            store = ResultsStore(db)
            try:
                runs = _resolve_runs(runs, store, out / "search", progress)
                if spec.tuning is not None:  # the tuning protocol: trials, then the choices

                    store.mark_interrupted(f"{spec.name}:tuning")  # trials of a killed run

                    runs = tune_runs(spec, runs, store, out, progress=progress)
            except Exception:
                store.close()
                raise
            store.mark_interrupted(spec.name)
            done = store.finished_fingerprints(spec.name)
            store.close()
            todo = [r for r in runs if r.fingerprint not in done]
        if dist_ctx is not None:  # the same plan on every rank
            import torch.distributed as dist

            plan = [(runs, todo) if is_main else None]
            dist.broadcast_object_list(plan, src=0)
            runs, todo = plan[0]  # type: ignore[misc]
        report = RunnerReport(total=len(runs), skipped=len(runs) - len(todo))
        bar: Any = None
        if progress and is_main:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(runs), initial=report.skipped, desc=f"{spec.name} runs",
                       unit="run", position=0, dynamic_ncols=True)
        if threads is None:
            threads = max(1, (os.cpu_count() or 1) // workers)
        elif threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        args = dict(db=str(db), ck_root=str(ck_root), threads=threads,
                    checkpoint_interval_s=checkpoint_interval_s)
        results: list[tuple[str, str | None]] = []
        labels = {r.fingerprint: r.label for r in todo}
        if workers == 1:
            for r in todo:
                if bar is not None:
                    bar.set_postfix_str(f"{r.label} seed={r.config.seed}")
                results.append(_run_one(r, progress=progress and is_main, is_main=is_main,
                                        **args))
                if bar is not None:
                    bar.update(1)
        else:
            with ProcessPoolExecutor(max_workers=workers, mp_context=_pool_context()) as pool:
                futures = [pool.submit(_run_one, r, progress=False, **args) for r in todo]
                for fut in as_completed(futures):
                    results.append(fut.result())
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
    for fp, err in results:
        if err is None:
            report.finished.append(fp)
        else:
            report.failed.append((f"{labels[fp]} ({fp})", err))
    return report
