"""One noise draw per coordinate in distributed runs (issue 32 item 5; dpclip.training.noise_shard).

Each rank draws the noise of its own block of coordinates only, from its own stream, adds it to
its LOCAL clipped sum, and the release all-reduces. The checks:

* the partition: disjoint contiguous blocks covering every coordinate, sizes within one, empty
  blocks when the world is larger than the release (pure function of (T, W, r));
* the streams: derived from (key, step, rank, world), reproducible from the seed only in
  reproducible mode, never from a seed in secure mode; a generator shared by the ranks is refused;
* the release in one process playing W ranks equals the concatenation of each rank's own draw
  (the oracle draws each rank's block with dpclip.noise.standard_normal from that rank's stream:
  the sampler itself is checked in tests/core/test_noise.py), for the step's sums and for a
  strategy's statistic;
* on 1, 2 and 4 gloo ranks with zero gradients (2e5 coordinates): the all-reduced noise has std
  ``z C / B`` on every rank's block (mean of squares within a 5-sigma chi-square band: two draws
  on a coordinate would double it, none would zero it), the blocks are uncorrelated (a shared
  stream would repeat them), the reproducible release is exactly the concatenation of every
  rank's own draw, and a 2-rank resume continues every rank's stream.
"""

from __future__ import annotations

import math

import pytest
import torch

from dpclip.clipping import FixedClip
from dpclip.clipping.base import StepContext
from dpclip.noise import standard_normal
from dpclip.randomness import PrivateRandomness, rank_noise_generator
from dpclip.training.distributed import DistributedContext
from dpclip.training.noise_shard import NoiseShard, noise_bounds, noise_partition
from dpclip.training.release import Releaser, release
from dpclip.training.sampling import PoissonSampler
from tests.distributed import _scenarios as S
from tests.distributed._launch import launch

gloo = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is not available")


# ------------------------------------------------------------------------------- the partition

@pytest.mark.parametrize("total", [0, 1, 2, 5, 7, 16, 1001, 200_003])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8, 17])
def test_blocks_are_disjoint_contiguous_and_cover_every_coordinate(total, world):
    blocks = noise_partition(total, world)
    assert len(blocks) == world
    assert blocks[0][0] == 0 and blocks[-1][1] == total
    for (lo, hi), (lo2, _) in zip(blocks, blocks[1:]):
        assert lo <= hi == lo2  # contiguous, in rank order: disjoint and covering
    sizes = [hi - lo for lo, hi in blocks]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == total
    assert sizes == sorted(sizes, reverse=True)  # the first total % world ranks get one more
    if world > total:
        assert sizes.count(0) == world - total  # W > T: the last ranks draw nothing


def test_partition_refuses_a_rank_outside_the_world():
    for args in [(10, 2, 2), (10, 2, -1), (-1, 2, 0), (10, 0, 0)]:
        with pytest.raises(ValueError, match="noise_bounds"):
            noise_bounds(*args)


# --------------------------------------------------------------------------------- the streams

def _draw(g: torch.Generator, n: int = 64) -> torch.Tensor:
    return torch.randn(n, generator=g, dtype=torch.float64)


def test_rank_streams_are_functions_of_key_step_rank_and_world():
    key = bytes(range(32))
    ref = _draw(rank_noise_generator(key, 5, 1, 4))
    assert torch.equal(ref, _draw(rank_noise_generator(key, 5, 1, 4)))  # a resume re-derives it
    others = [rank_noise_generator(key, 5, 0, 4), rank_noise_generator(key, 6, 1, 4),
              rank_noise_generator(key, 5, 1, 2), rank_noise_generator(bytes(32), 5, 1, 4)]
    for g in others:
        assert not torch.equal(ref, _draw(g))
    with pytest.raises(ValueError, match="32 bytes"):
        rank_noise_generator(b"short", 0, 0, 1)
    with pytest.raises(ValueError, match="rank < world_size"):
        rank_noise_generator(key, 0, 2, 2)


def test_reproducible_key_follows_the_seed_and_secure_key_does_not():
    a, b = PrivateRandomness.reproducible(11), PrivateRandomness.reproducible(11)
    assert a.noise_key() == b.noise_key()  # replayable from the seed (labelled, NOT private)
    assert a.noise_key() != PrivateRandomness.reproducible(12).noise_key()
    s1, s2 = PrivateRandomness.secure(), PrivateRandomness.secure()
    assert s1.noise_key() != s2.noise_key()  # os.urandom: no seed can give it
    assert s1.noise_key() not in {PrivateRandomness.reproducible(k).noise_key() for k in range(8)}
    # a one-process run never creates the key: its checkpoint layout is unchanged
    assert "noise_key" not in PrivateRandomness.secure().state_dict()
    state = s1.state_dict()
    fresh = PrivateRandomness.secure()
    fresh.load_state_dict(state)
    assert fresh.noise_key() == s1.noise_key()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rank_streams_on_cuda_are_philox_from_the_key():  # pragma: no cover - GPU machines
    key = bytes(range(32))
    g = rank_noise_generator(key, 3, 1, 2, "cuda")
    assert g.device.type == "cuda"
    a = torch.randn(16, generator=g, device="cuda", dtype=torch.float64)
    b = torch.randn(16, generator=rank_noise_generator(key, 3, 1, 2, "cuda"), device="cuda",
                    dtype=torch.float64)
    c = torch.randn(16, generator=rank_noise_generator(key, 3, 0, 2, "cuda"), device="cuda",
                    dtype=torch.float64)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_a_generator_shared_by_the_ranks_is_refused():
    """Error 201: the shared ``rng.noise`` would give every block the same numbers (coordinates
    i and i + T/W with identical noise: their difference is noise-free)."""
    rng = PrivateRandomness.reproducible(3)
    shard = NoiseShard(DistributedContext(rank=1, world_size=2, backend="gloo"), rng)
    with pytest.raises(ValueError, match="this rank's own stream.*entry 93"):
        shard.draws(10, rng.noise)
    g = shard.generator(0)
    assert shard.draws(10, g) == [(5, 10, g)]
    with pytest.raises(ValueError, match="entry 93"):  # last step's stream: refused as well
        shard.draws(10, rng.rank_noise(0, 1, 2))


# ------------------------------------------------------- the release, one process playing W ranks

def _expected_noise(rng: PrivateRandomness, step: int, world: int, sizes: list[int],
                    stds: list[float], dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """Oracle: rank r's block of the concatenation, drawn by ``standard_normal`` from rank r's
    stream (in the tensors' dtype; float64 when they differ), scaled by each coordinate's tensor
    std."""
    total = sum(sizes)
    draw = dtypes[0] if len(set(dtypes)) == 1 else torch.float64
    z = torch.cat([standard_normal(hi - lo, rng.rank_noise(step, r, world), draw, "cpu")
                   for r, (lo, hi) in enumerate(noise_partition(total, world))])
    out, offset = [], 0
    for n, sd, dt in zip(sizes, stds, dtypes):
        out.append(torch.zeros(n, dtype=dt).add_(z[offset:offset + n].to(dt), alpha=sd))
        offset += n
    return out


@pytest.mark.parametrize("world", [2, 3, 7])
@pytest.mark.parametrize("mixed", [False, True], ids=["one-dtype", "mixed-dtypes"])
def test_sharded_release_is_the_concatenation_of_each_ranks_draw(world, mixed):
    rng = PrivateRandomness.reproducible(5)
    shard = S.EmulatedShards(rng, world)
    shapes = {"w": (3, 4), "b": (4,), "c": (1,)}
    dtypes = [torch.float32, torch.float64 if mixed else torch.float32, torch.float32]
    sums = {n: torch.zeros(s, dtype=dt) for (n, s), dt in zip(shapes.items(), dtypes)}
    sens = {"w": 1.0, "b": 2.0, "c": 0.5}
    out = release(sums, noise_multiplier=1.3, sensitivity=sens, divisor=4.0,
                  generator=shard.generator(9), strategy=FixedClip(1.0),
                  state=FixedClip(1.0).init_state(), norms=torch.empty(0),
                  ctx=StepContext.at(9, steps_per_epoch=10, total_steps=10,
                                     expected_batch_size=4.0, base_noise_multiplier=1.3),
                  sampler=PoissonSampler(100, 4.0),
                  sensitivity_factor=1, shard=shard)
    exp = _expected_noise(rng, 9, world, [12, 4, 1], [1.3 * sens[n] for n in shapes], dtypes)
    for (n, v), e in zip(out.values.items(), exp):
        assert v.dtype == e.dtype
        assert torch.equal(v.reshape(-1), e / 4.0), n
    assert out.std == {n: 1.3 * s for n, s in sens.items()}


def test_sharded_statistic_release_is_the_concatenation_of_each_ranks_draw():
    rng = PrivateRandomness.reproducible(6)
    shard = S.EmulatedShards(rng, 3)
    value = torch.tensor([10.0, 20.0, 30.0, 40.0], dtype=torch.float64)
    noisy, event = Releaser(shard.generator(2), 2, shard)(value, 0.5, 1.1)
    exp = _expected_noise(rng, 2, 3, [4], [1.1 * 0.5 * 2], [torch.float64])[0]
    assert torch.equal(noisy, value + exp) and event.noise_multiplier == 1.1


# ------------------------------------------------------------------------ gloo: 1, 2 and 4 ranks

WIDTH, STEPS, Z, CLIP, B = 50_000, 3, 1.3, 1.0, 10.0  # 2e5 coordinates per step


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda w: f"{w}proc")
def noise_runs(request, tmp_path_factory):
    world = request.param
    workdir = tmp_path_factory.mktemp(f"shard{world}")
    resume = str(workdir) if world == 2 else None
    out = launch(S.sharded_noise, world, workdir, WIDTH, STEPS, Z, CLIP, B, resume,
                 timeout=55.0)
    return world, out


@gloo
def test_every_coordinate_gets_one_draw_of_std_z_c_over_b(noise_runs):
    world, out = noise_runs
    for res in out[1:]:  # the same release on every rank, bit for bit
        assert torch.equal(res["secure"], out[0]["secure"])
    noise = out[0]["secure"].double()
    target = Z * CLIP / B
    assert noise.shape == (STEPS, 4 * WIDTH)
    assert [r["bounds"] for r in out] == noise_partition(4 * WIDTH, world)
    for lo, hi in noise_partition(4 * WIDTH, world):
        block = noise[:, lo:hi]
        n = block.numel()
        # sum of squares / target^2 ~ chi-square(n): 5-sigma band (two draws: 2x; none: 0)
        chi2 = (block.square().sum() / target ** 2).item()
        assert abs(chi2 - n) < 5 * math.sqrt(2 * n), (world, lo, hi, chi2 / n)
        assert abs(block.mean().item()) < 5 * target / math.sqrt(n)
        assert block.abs().max().item() < 8.6 * target  # the float64 sampler's support
    if world > 1:  # independent blocks: a stream shared by two ranks would repeat its numbers
        (lo0, hi0), (lo1, hi1) = noise_partition(4 * WIDTH, world)[:2]
        m = min(hi0 - lo0, hi1 - lo1)
        a, b = noise[:, lo0:lo0 + m].reshape(-1), noise[:, lo1:lo1 + m].reshape(-1)
        corr = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
        assert abs(corr) < 5 / math.sqrt(a.numel())


@gloo
def test_reproducible_release_is_the_concatenation_of_every_ranks_own_draw(noise_runs):
    world, out = noise_runs
    rng = PrivateRandomness.reproducible(11)  # the run's seed: its streams are replayable
    parts = []
    for r, (lo, hi) in enumerate(noise_partition(4 * WIDTH, world)):
        # one rank: the one-process stream, bit for bit; W ranks: rank r's own stream of step 0
        g = rng.noise if world == 1 else rng.rank_noise(0, r, world)
        z = standard_normal(hi - lo, g, torch.float32, "cpu")
        # (float32 draws added to the float64 sum, divided, then cast: the release's order)
        parts.append(torch.zeros(hi - lo, dtype=torch.float64).add_(z, alpha=Z * CLIP).div_(B))
    expected = torch.cat(parts).float()
    for res in out:
        assert torch.equal(res["reproducible"][0], expected)


@gloo
def test_resume_continues_every_ranks_stream(noise_runs):
    world, out = noise_runs
    if world != 2:
        pytest.skip("the resume is checked on 2 ranks")
    for res in out:
        assert "noise_key" in res["checkpoint_keys"]  # the secret every rank's stream derives from
        assert torch.equal(res["resumed"], res["run_on"])  # both ranks' blocks continue exactly
        assert torch.equal(res["run_on"], out[0]["run_on"])
        assert not torch.equal(res["run_on"], res["before"])  # no step repeats another's noise


@pytest.mark.parametrize("case", ["bc-unit", "p-grad"])
def test_a_sharded_engine_outside_the_engine_path_is_refused(case):
    """Error 202: batch-clipping units and P-GRAD strategies sum outside the engine, so their sums
    would never be all-reduced; dp_step refuses the sharded engine there (make_private refuses
    both distributed before any step)."""
    from torch import nn

    from dpclip.clipping import make_strategy
    from dpclip.engine import ParamGroups, get_engine
    from dpclip.training.step import dp_step
    from dpclip.training.units import UnitConfig

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    rng = PrivateRandomness.reproducible(0)
    shard = S.EmulatedShards(rng, 2)
    strat = make_strategy("fixed" if case == "bc-unit" else "adaclip",
                          {"clip_norm": 1.0} if case == "bc-unit" else {})
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    unit = UnitConfig("bc") if case == "bc-unit" else None
    if unit is not None:
        x, y = x.view(2, 4, 4), y.view(2, 4)
    ctx = StepContext.at(0, steps_per_epoch=1, total_steps=1, expected_batch_size=8.0,
                         base_noise_multiplier=1.0)
    with pytest.raises(ValueError, match="sharded distributed engine runs only.*entry 94"):
        dp_step(model, x, y, loss_fn=lambda o, t: nn.functional.cross_entropy(
                    o, t, reduction="none"), strategy=strat, state=strat.init_state(),
                engine=S.EmulatingEngine(get_engine("vmap"), shard),
                groups=ParamGroups.flat(model), sampler=PoissonSampler(100, 8.0),
                base_noise_multiplier=1.0, ctx=ctx, generator=shard.generator(0), unit=unit)
