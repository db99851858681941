"""dpclip.training.distributed without processes: shard arithmetic, the sharded sampler, the refusals."""

import pytest
import torch
from torch import nn

from dpclip.training.distributed import DistributedContext, ShardedSampler, resolve_distributed, shard_bounds
from dpclip.training.private import make_private
from dpclip.training.sampling import FixedSizeSampler, PoissonSampler
from dpclip.training.units import MiniSetSampler


def _ctx(rank: int, world: int) -> DistributedContext:
    # a context without a live group: enough for everything that runs before a collective
    return DistributedContext(rank=rank, world_size=world, backend="gloo")


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_shard_bounds_tile_the_batch_contiguously(world):
    for b in range(0, 23):
        bounds = [shard_bounds(b, world, r) for r in range(world)]
        expected = torch.tensor_split(torch.arange(b), world)
        assert [list(range(*bd)) for bd in bounds] == [e.tolist() for e in expected]
        sizes = [stop - start for start, stop in bounds]
        assert sum(sizes) == b and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("inner", [PoissonSampler(50, 9.0), FixedSizeSampler(50, 9)])
def test_every_rank_draws_the_global_batch_and_keeps_its_slice(inner):
    world = 3
    samplers = [ShardedSampler(inner, _ctx(r, world)) for r in range(world)]
    for s in samplers:  # the public description is the GLOBAL mechanism's
        assert (s.name, s.adjacency, s.sensitivity_factor, s.dataset_size) == \
            (inner.name, inner.adjacency, inner.sensitivity_factor, inner.dataset_size)
        assert (s.expected_batch_size, s.sample_rate, s.steps_per_epoch) == \
            (inner.expected_batch_size, inner.sample_rate, inner.steps_per_epoch)
        from dpclip.events import GaussianEvent

        assert s.step_event(GaussianEvent(1.0)) == inner.step_event(GaussianEvent(1.0))
    base = torch.Generator().manual_seed(11)
    for _ in range(20):
        state = base.get_state()
        shards = []
        for s in samplers:  # the same (shared) generator state on every rank
            g = torch.Generator()
            g.set_state(state)
            shards.append(s.sample(g))
        want = inner.sample(base)
        assert torch.equal(torch.cat(shards), want)
        assert all(s.last_global_batch_size == want.numel() for s in samplers)
        assert [s.last_shard_size for s in samplers] == [t.numel() for t in shards]


def test_sharded_sampler_refuses_other_schemes():
    with pytest.raises(ValueError, match="Poisson or fixed-size"):
        ShardedSampler(MiniSetSampler(40, 4, 2, partition_seed=0), _ctx(0, 2))


def test_resolve_distributed():
    assert resolve_distributed(False) is None
    assert resolve_distributed(None) is None  # no group initialised in this process
    ctx = _ctx(0, 1)
    assert resolve_distributed(ctx) is ctx  # one process: no group needed
    with pytest.raises(ValueError, match="names 2 ranks but no torch.distributed process group"):
        resolve_distributed(_ctx(1, 2))
    with pytest.raises(TypeError, match="distributed must be"):
        resolve_distributed("yes")


def test_a_context_that_does_not_match_its_group_is_refused(tmp_path):
    """Review 94: a hand-made context claiming 2 ranks on a group of 1 would draw half the noise
    (its shard) and the all-reduce would add no other: half the coordinates without noise."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        for bad in (_ctx(0, 2), DistributedContext(rank=0, world_size=1, backend="nccl")):
            with pytest.raises(ValueError, match="does not match its process group|backend"):
                resolve_distributed(bad)
            with pytest.raises(ValueError, match="does not match its process group|backend"):
                _make(distributed=bad)
        good = _ctx(0, 1)
        assert resolve_distributed(good) is good
    finally:
        dist.destroy_process_group()


def test_distributed_true_without_a_group_fails_clearly(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="torchrun"):
        resolve_distributed(True)


def _make(**kw):
    x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2))
    args = dict(noise_multiplier=1.0, steps=3, batch_size=8, delta=1e-5, verbose=False,
                distributed=_ctx(0, 2))
    args.update(kw)
    return make_private(model, None, (x, y), **args)


@pytest.mark.parametrize("kw, match", [
    (dict(strategy="adaclip"), "P-GRAD"),
    (dict(strategy="fixed", strategy_params={"unit": "bc"}), "unit=bc"),
    (dict(strategy="fixed", sampling="fixed-size"), "PLD accountant"),
])
def test_make_private_refuses_what_it_cannot_distribute(kw, match, monkeypatch):
    import dpclip.training.distributed as d

    monkeypatch.setattr(d, "check_context", lambda ctx, owner: None)  # (no group of 2 here)
    with pytest.raises(ValueError, match=match):
        _make(**kw)
