"""One noise draw per coordinate in a distributed run: each rank draws only its shard (issue 32).

With ``W`` ranks, the Gaussian noise of a release is split by coordinates, not by variance:

    flat      <- the release's tensors concatenated in their (public, identical) order: T numbers
    shard r   <- [lo_r, hi_r) = noise_bounds(T, W, r): W contiguous blocks, the first T % W of
                 size ceil(T / W), the others floor(T / W) (empty when W > T); disjoint, covering
    rank r    <- its LOCAL clipped sum, plus z S * N(0, 1) on [lo_r, hi_r) only, drawn from its
                 own stream (PrivateRandomness.rank_noise: derived from a secret and (step, r, W))
    released  <- all-reduce(SUM) over the ranks, then divided once by the public constant

Every coordinate ``i`` lies in exactly one shard, so the all-reduced value there is
``sum_r local_r[i] + z S g_i`` with ONE standard normal ``g_i`` (the other ranks add nothing to
it): the global clipped sum plus ``N(0, (z S)^2)`` per coordinate, independent across coordinates
(the ranks' streams are independent), exactly the one-process mechanism. No rank draws more than
``ceil(T / W)`` normals, and the noise rides the all-reduce the clipped sums needed anyway: no
extra collective for the gradient. Statistics released by strategies (``Releaser``: a quantile
count, a mean norm) are global values already identical on every rank; their noise is drawn the
same way, each rank writing its shard into a zero vector, all-reduced (``x + 0 = x`` exactly), and
added on every rank: one small collective per statistic.

The partition depends only on ``(T, W, r)`` (the parameter shapes and the world), never on data.
The ledger is unchanged: one release per step with std ``z S``.

Trust boundary: as before, the ranks and their interconnect see unnoised or partly noised local
sums; every rank holds the one secret the streams derive from (rank 0's, broadcast once), so rank
0's checkpoint resumes every rank's stream (docs/distributed.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dpclip.randomness import PrivateRandomness
from dpclip.training.distributed import DistributedContext, DistributedEngine, _dist, shard_bounds
from dpclip.engine.base import Engine

__all__ = ["NoiseShard", "ShardNoiseEngine", "noise_bounds", "noise_partition"]


def noise_bounds(total: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[lo, hi)``: the coordinates of a ``total``-coordinate release whose noise ``rank`` draws
    (contiguous; the first ``total % world_size`` ranks get one more; empty when the rank is past
    the last coordinate). Raises ``ValueError`` for a negative total or a rank outside the world.
    """
    total, world_size, rank = int(total), int(world_size), int(rank)
    if total < 0 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"noise_bounds: need total >= 0 and 0 <= rank < world_size, got "
                         f"total={total}, rank={rank}, world_size={world_size}")
    return shard_bounds(total, world_size, rank)


def noise_partition(total: int, world_size: int) -> list[tuple[int, int]]:
    """Every rank's :func:`noise_bounds`, in rank order (a partition of ``range(total)``)."""
    return [noise_bounds(total, world_size, r) for r in range(int(world_size))]


class NoiseShard:
    """This rank's part of every release of a distributed run (the module docstring).

    :meth:`generator` gives this rank's stream for a step (PRIVATE); :func:`~dpclip.training.
    release.release` asks :meth:`draws` which coordinates to noise from which generator and
    :meth:`all_reduce_` to sum the ranks' contributions. Only the generator issued by
    :meth:`generator` is accepted: a generator shared by every rank (``PrivateRandomness.noise``)
    would give every shard the same numbers, so that coordinates ``i`` and ``i + T / W`` would
    carry identical noise, and their difference would be noise-free.
    """

    def __init__(self, ctx: DistributedContext, rng: PrivateRandomness) -> None:
        self.ctx, self.rng = ctx, rng
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self._issued: torch.Generator | None = None

    def generator(self, step: int) -> torch.Generator:
        """PRIVATE: this rank's noise stream for release ``step`` (fresh for every step)."""
        self._issued = self.rng.rank_noise(step, self.rank, self.world_size)
        return self._issued

    def draws(self, total: int, generator: torch.Generator
              ) -> list[tuple[int, int, torch.Generator]]:
        """``[(lo, hi, generator)]``: the coordinates of a ``total``-coordinate release this rank
        noises, and the stream it draws them from (``generator``, checked to be this rank's)."""
        if generator is not self._issued:
            raise ValueError(
                "distributed release: the noise generator must be this rank's own stream "
                "(NoiseShard.generator(step)); a generator shared by the ranks would repeat the "
                "same noise on every shard (docs/errors.md entry 93)")
        lo, hi = noise_bounds(total, self.world_size, self.rank)
        return [(lo, hi, generator)]

    def all_reduce_(self, t: Tensor) -> None:
        """In-place SUM of ``t`` (contiguous) over the ranks, through the group's device."""
        ctx = self.ctx
        buf = t if t.device == ctx.device and t.is_contiguous() else t.contiguous().to(ctx.device)
        dist = _dist()
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=ctx.group)
        if buf is not t:
            t.copy_(buf)

    def __repr__(self) -> str:
        return f"NoiseShard(rank={self.rank}, world_size={self.world_size})"


class ShardNoiseEngine(DistributedEngine):
    """:class:`~dpclip.training.distributed.DistributedEngine` whose clipped sums stay LOCAL: the
    all-reduce of the gradient is made by the release, after this rank has added its noise shard
    (:class:`NoiseShard`, exposed as ``noise_shard``; ``dp_step`` hands it to the release). Norms,
    weights, sizes and the loss sum are assembled globally as in the parent. One process
    (``world_size == 1``): no shard, the plain one-process release (bit for bit).
    """

    def __init__(self, inner: Engine, ctx: DistributedContext, rng: PrivateRandomness) -> None:
        super().__init__(inner, ctx)
        #: the release's shard mode (None in one process)
        self.noise_shard: NoiseShard | None = NoiseShard(ctx, rng) if ctx.world_size > 1 \
            else None

    def _all_reduce_grads(self, grads: dict[str, Tensor]) -> dict[str, Tensor]:
        # the local partial sums: release() adds this rank's noise shard, then all-reduces
        return dict(grads)

    def __repr__(self) -> str:
        return f"ShardNoiseEngine({self.inner!r}, world_size={self.ctx.world_size})"

