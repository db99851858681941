"""Distributed DP-SGD on CPU with gloo (issue 19): 1, 2 and 4 ranks release what one process does.

Each launch forks the ranks (``_launch``), which run the scenarios of ``_scenarios`` and return
their ledgers, parameters and clip trajectories; the oracle is the same scenario run in this
process without ``torch.distributed``, its noise drawn as W ranks draw it (every rank's block of
coordinates from that rank's own stream: ``S.EmulatedShards``; the plain run for one rank).
Reproducible-noise runs share the seed, so the released gradients must match that oracle to
float64 rounding (only the order of the all-reduced additions differs): a rank drawing a block
that is not its own, or two ranks drawing one coordinate, would move them. The ledgers must be
equal to the one-process ledger.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import _scenarios as S
from tests.distributed._launch import launch

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is not available")

QUANTILE = dict(strategy="quantile", steps=8,
                strategy_params={"initial_clip_norm": 0.3, "target_quantile": 0.6,
                                 "clip_lr": 0.5})
VDV = dict(strategy="vdv", steps=6, strategy_params={"initial_clip_norm": 0.3})


def _empty(world: int) -> dict:
    """q = 1 over ``world - 1`` examples: the last rank's shard is empty at every step."""
    return dict(n=world - 1, batch_size=float(world - 1), steps=4)


SPARSE = dict(n=24, batch_size=1.0, steps=8)  # many empty GLOBAL batches


def _scenarios(world: int, workdir: str) -> dict[str, dict]:
    out = {
        "fixed": {},
        "vmap-layer": dict(engine="vmap", strategy="per-layer",
                           strategy_params={"clip_norm": 0.7}),
        "quantile": QUANTILE,
        "empty": _empty(world) if world > 1 else None,
        "sparse": SPARSE,
    }
    if world == 2:
        out.update({
            "vdv": VDV,
            "fixed-size-rdp": dict(sampling="fixed-size", accountant="rdp"),
            "resume": dict(resume_dir=workdir, resume_at=3),
            # bound-based (certified sensitivity, plain batched backward: no per-example norms)
            "lip-dp-sgd": dict(strategy="lip-dp-sgd", strategy_params={}, steps=4,
                               input_shape=(5,), engine="auto"),
            # per-example augmentation: the GLOBAL batch's parameters from the shared generator
            "augment": dict(image=True, augment="crop:1,flip"),
        })
    return {k: v for k, v in out.items() if v is not None}


def _run_all(ctx, workdir: str) -> dict[str, dict]:
    return {name: S.train(ctx, **cfg) for name, cfg in _scenarios(ctx.world_size, workdir).items()}


_REF: dict[str, dict] = {}


def _reference(name: str, cfg: dict, world: int = 1) -> dict:
    """The single-process run of a scenario (cached; the resume scenario's oracle is the
    uninterrupted run), its noise drawn as ``world`` ranks draw it: every rank's block of
    coordinates from that rank's own stream (``S.EmulatedShards``; one process: the plain run)."""
    cfg = {k: v for k, v in cfg.items() if k not in ("resume_dir", "resume_at")}
    key = repr((world, sorted(cfg.items())))
    if key not in _REF:
        _REF[key] = S.train(None, world=world, **cfg)
    return _REF[key]


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda w: f"{w}proc")
def world_runs(request, tmp_path_factory):
    world = request.param
    workdir = tmp_path_factory.mktemp(f"gloo{world}")
    results = launch(_run_all, world, workdir, str(workdir), timeout=180.0)
    return world, str(workdir), results


def test_same_ledger_and_parameters_as_one_process(world_runs):
    world, workdir, results = world_runs
    for name, cfg in _scenarios(world, workdir).items():
        ref = _reference(name, cfg, world)
        for rank, res in enumerate(results):
            got = res[name]
            assert got["ledger"] == ref["ledger"], (name, rank)
            assert got["epsilon"] == ref["epsilon"], (name, rank)
            assert got["steps"] == ref["steps"], (name, rank)
            assert got["global_sizes"] == ref["global_sizes"], (name, rank)
            for k, v in ref["params"].items():
                torch.testing.assert_close(got["params"][k], v, rtol=1e-10, atol=1e-12,
                                           msg=lambda m: f"{name} rank {rank} {k}: {m}")
            # the NON-PRIVATE mean loss is the global batch's on every rank
            assert got["losses"] == pytest.approx(ref["losses"], rel=1e-10, abs=1e-12)
            # every rank ends bitwise identical (assert_synchronized ran inside the scenario)
            for k, v in results[0][name]["params"].items():
                assert torch.equal(got["params"][k], v)


def test_shards_partition_the_global_batch(world_runs):
    world, workdir, results = world_runs
    for name in _scenarios(world, workdir):
        per_rank = [r[name]["shard_sizes"] for r in results]
        totals = [sum(col) for col in zip(*per_rank)]
        assert totals == results[0][name]["global_sizes"], name
    if world > 1:  # the forced-empty rank took part in every step and changed no step count
        assert all(s == 0 for s in results[-1]["empty"]["shard_sizes"])
        assert results[-1]["empty"]["steps"] == 4
        assert 0 in results[0]["sparse"]["global_sizes"]  # whole empty batches, too
        d = results[0]["fixed"]["describe"]
        assert d["distributed"] == {"world_size": world, "backend": "gloo"}
        assert d["engine_requested"] == "ghost" and d["engine"] == "ghost"


def test_adaptive_release_is_counted_once(world_runs):
    """The quantile count and the mean norm are summed over ranks before their noise: the clip
    trajectory is the single-process one, and the ledger holds one count release per step."""
    world, workdir, results = world_runs
    names = ["quantile"] + (["vdv"] if world == 2 else [])
    for name in names:
        ref = _reference(name, _scenarios(world, workdir)[name], world)
        assert len(set(ref["clips"])) > 3  # the threshold did move
        for res in results:
            assert res[name]["clips"] == pytest.approx(ref["clips"], rel=1e-10)
            assert res[name]["ledger"] == ref["ledger"]


@pytest.mark.slow
def test_zero_gradients_give_noise_std_z_c_over_b(tmp_path):
    """2,000 steps on 2 ranks with zero gradients and SECURE randomness: the released gradient
    is pure noise of std ``z C / B`` (B the global expected batch size), each coordinate drawn
    by one rank (its block); a rank noising every coordinate would give sqrt(2) times that, a
    local divisor twice. The 1/2/4-rank std test per block: tests/distributed/test_noise_shard.py."""
    z, clip, b = 1.3, 1.0, 10.0
    out = launch(S.zero_grad_noise, 2, tmp_path, 2000, z, clip, b, timeout=180.0)
    assert torch.equal(out[0], out[1])  # one draw, the same on every rank
    noise = out[0]
    target = z * clip / b
    assert abs(noise.std().item() / target - 1) < 0.05
    assert abs(noise.mean().item()) < 5 * target / math.sqrt(noise.numel())
    assert noise.std(0).min().item() > 0.9 * target  # every coordinate is noised


@pytest.mark.slow
def test_torchrun_launch_gives_the_single_process_epsilon(tmp_path):
    """``torchrun --standalone --nproc_per_node 2``: the group comes from torchrun's environment
    (dpclip.training.distributed.init_from_env), and the run has the one-process ledger and epsilon."""
    out = tmp_path / "out.json"
    script = Path(__file__).with_name("_torchrun_script.py")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]),
                                          os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(script), str(out)],
        env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    ref = S.train(None)
    assert got["world_size"] == 2 and got["steps"] == ref["steps"]
    assert got["ledger"] == json.loads(json.dumps(ref["ledger"]))
    assert got["epsilon"] == ref["epsilon"]


def test_ranks_that_disagree_are_refused(tmp_path):
    """A rank with another batch size, or one that loaded another checkpoint, stops every rank
    (digests compared; no secret is shown in the message)."""
    out = launch(S.mismatches, 2, tmp_path, timeout=180.0)
    for res in out:
        assert "ranks [1] disagree with rank 0 on the run's configuration" in res["config"]
        assert "ranks [1] disagree with rank 0 on the private generator states" in res["resume"]


@pytest.mark.slow
def test_torchrun_dpclip_train_cli_matches_one_process(tmp_path):
    """``torchrun --nproc_per_node 2 -m dpclip train ...``: rank 0 stores and prints one run whose
    ledger, epsilon and step count are those of the same command in one process."""
    args = ["train", "--dataset", "synthetic", "--model", "mlp", "--noise-multiplier", "1.0",
            "--epochs", "1", "--batch-size", "64", "--lr", "0.5", "--delta", "1e-5",
            "--no-progress", "--json"]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "DPCLIP_ALLOCATOR": "system",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"),
                                          os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "dpclip", *args, "--db", str(tmp_path / "two.db")],
        env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1  # rank 0 only
    two = rows[0]
    one = subprocess.run([sys.executable, "-m", "dpclip", *args, "--db", str(tmp_path / "one.db")],
                         env=env, capture_output=True, text=True, timeout=110)
    assert one.returncode == 0, one.stderr[-3000:]
    one_row = json.loads(one.stdout.strip().splitlines()[-1])
    assert two["distributed"] == {"world_size": 2, "backend": "gloo"}
    assert two["steps"] == one_row["steps"] and two["epsilon"] == one_row["epsilon"]
    assert two["noise_multiplier"] == one_row["noise_multiplier"]


GRID = """
name = "tinydist"
[train]
dataset = "synthetic"
model = "mlp"
epochs = 1
batch_size = 64
lr = 0.5
delta = 1e-5
[grid]
epsilons = [2.0]
seeds = [0, 1]
[[strategies]]
name = "quantile"
params = { initial_clip_norm = 0.5 }
"""


@pytest.mark.slow
def test_torchrun_dpclip_run_grid_is_stored_once_with_the_one_process_ledger(tmp_path):
    """``torchrun --nproc_per_node 2 -m dpclip run spec.toml``: rank 0 plans the grid and writes
    the store; every run is trained by both ranks and recorded once, with the epsilon and noise
    of the same grid run in one process."""
    import sqlite3

    spec = tmp_path / "grid.toml"
    spec.write_text(GRID)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "DPCLIP_ALLOCATOR": "system",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"),
                                          os.environ.get("PYTHONPATH", "")])}
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "dpclip", "run", str(spec), "--db", str(tmp_path / "two.db"), "--out",
         str(tmp_path / "out2"), "--no-progress"],
        env=env, capture_output=True, text=True, timeout=110)
    assert two.returncode == 0, two.stderr[-3000:]
    one = subprocess.run(
        [sys.executable, "-m", "dpclip", "run", str(spec), "--db", str(tmp_path / "one.db"),
         "--out", str(tmp_path / "out1"), "--no-progress"],
        env=env, capture_output=True, text=True, timeout=110)
    assert one.returncode == 0, one.stderr[-3000:]

    def rows(db):
        con = sqlite3.connect(db)
        out = [json.loads(s) for (s,) in con.execute(
            "SELECT summary FROM runs WHERE status='finished' ORDER BY id")]
        assert con.execute("SELECT count(*) FROM runs").fetchone()[0] == len(out)
        return out

    a, b = rows(tmp_path / "two.db"), rows(tmp_path / "one.db")
    assert len(a) == len(b) == 2
    for x, y in zip(a, b):
        assert x["distributed"] == {"world_size": 2, "backend": "gloo"}
        assert x["epsilon"] == y["epsilon"] and x["noise_multiplier"] == y["noise_multiplier"]
        assert x["steps"] == y["steps"]
