"""Run a function on N gloo ranks (CPU, forked processes), with a hard deadline.

``launch(fn, world, workdir, *args)`` forks ``world`` processes; each initialises a gloo process
group through a file store in ``workdir`` (no port to race for; gloo talks over the loopback
interface), runs ``fn(ctx, *args)`` with its :class:`~dpclip.training.distributed.DistributedContext` and
returns the results in rank order. A rank that raises fails the launch with its traceback; a
launch still running at the deadline (a hang) is killed and fails with ``TimeoutError``.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Callable


def _worker(fn: Callable[..., Any], rank: int, world: int, workdir: str, tag: str,
            args: tuple) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(workdir) / f"{tag}.rank{rank}"  # + ".pkl" / ".err"
    try:
        dist.init_process_group("gloo", init_method=f"file://{workdir}/{tag}.store", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=40))
        from dpclip.training.distributed import DistributedContext

        result = fn(DistributedContext.current(), *args)
        Path(f"{out}.pkl").write_bytes(pickle.dumps(result))
    except BaseException:  # noqa: BLE001 - reported to the parent
        Path(f"{out}.err").write_text(traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn: Callable[..., Any], world: int, workdir: Path | str, *args: Any,
           timeout: float = 55.0) -> list[Any]:
    """``[fn(ctx_rank0, *args), ..., fn(ctx_rank{world-1}, *args)]`` (see the module docstring)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    tag = f"w{world}-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_worker, args=(fn, r, world, str(workdir), tag, args),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    errors: dict[int, str] = {}
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        for r in range(world):
            err = workdir / f"{tag}.rank{r}.err"
            if r not in errors and err.exists():
                errors[r] = err.read_text()
        if errors:  # the other ranks may wait forever in a collective: give them a moment
            deadline = min(deadline, time.monotonic() + 3.0)
        time.sleep(0.02)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
    for r in range(world):
        err = workdir / f"{tag}.rank{r}.err"
        if r not in errors and err.exists():
            errors[r] = err.read_text()
    if errors:
        r = min(errors)
        raise RuntimeError(f"rank {r} of {world} failed:\n{errors[r]}")
    if hung:
        raise TimeoutError(f"ranks {hung} of {world} still running after {timeout:.0f} s (hang)")
    results = []
    for r in range(world):
        path = workdir / f"{tag}.rank{r}.pkl"
        if not path.exists():
            raise RuntimeError(f"rank {r} of {world} exited with code {procs[r].exitcode} and no "
                               "result")
        results.append(pickle.loads(path.read_bytes()))
    return results
