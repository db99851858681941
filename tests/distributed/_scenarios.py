"""Training scenarios run identically in one process (``ctx=None``) and on every gloo rank.

Each returns plain data (ledger dict, epsilon, parameters, clip trajectory, batch sizes) so that
the tests can compare a distributed run with the single-process run of the same configuration.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpclip.training.private import make_private
from dpclip.training.distributed import DistributedContext, assert_synchronized, barrier


def data(n: int, d: int = 5, k: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = (x @ torch.randn(d, k, generator=g, dtype=torch.float64)).argmax(1)
    return x, y


def model(ctx: DistributedContext | None, d: int = 5, k: int = 3,
          image: bool = False) -> nn.Module:
    """The same float64 MLP on rank 0 and in one process; a DIFFERENT initialisation on the other
    ranks, so the tests see that make_private copies rank 0's model to every rank. ``image``: the
    inputs are ``(1, 4, 4)`` images (flattened first)."""
    torch.manual_seed(0 if ctx is None or ctx.rank == 0 else 1000 + ctx.rank)
    head = [nn.Flatten(), nn.Linear(16, 8)] if image else [nn.Linear(d, 8)]
    return nn.Sequential(*head, nn.Tanh(), nn.Linear(8, k)).double()


class EmulatedShards:
    """Test oracle: ONE process plays the noise of ``world`` ranks. It has the interface of
    :class:`dpclip.training.noise_shard.NoiseShard`, but draws every rank's block of coordinates
    from that rank's own stream (``rng.rank_noise(step, r, world)``) and reduces nothing (the
    one-process sums are already global), so that a one-process run releases what a
    ``world``-rank run releases, up to the order of the float additions."""

    def __init__(self, rng: Any, world: int) -> None:
        self.rng, self.world = rng, world
        self._gens: list[torch.Generator] = []

    def generator(self, step: int) -> torch.Generator:
        self._gens = [self.rng.rank_noise(step, r, self.world) for r in range(self.world)]
        return self._gens[0]

    def draws(self, total: int, generator: torch.Generator) -> list:
        from dpclip.training.noise_shard import noise_partition

        assert generator is self._gens[0]
        return [(lo, hi, g) for (lo, hi), g in zip(noise_partition(total, self.world),
                                                   self._gens)]

    def all_reduce_(self, t: torch.Tensor) -> None:
        return None


class EmulatingEngine:
    """``inner`` with an :class:`EmulatedShards` as its ``noise_shard`` (what dp_step hands to
    the release); everything else is the inner engine's."""

    def __init__(self, inner: Any, shard: EmulatedShards) -> None:
        self.inner, self.noise_shard = inner, shard

    def compute(self, *args: Any) -> Any:
        return self.inner.compute(*args)

    def __getattr__(self, item: str) -> Any:
        if item in ("inner", "noise_shard"):
            raise AttributeError(item)
        return getattr(self.inner, item)


def emulate_world(dp: Any, world: int) -> None:
    """Make the one-process run ``dp`` draw its noise as ``world`` ranks would (a test oracle)."""
    if world > 1:
        dp._step_engine = EmulatingEngine(dp._step_engine, EmulatedShards(dp.rng, world))


def train(ctx: DistributedContext | None, *, strategy: str = "fixed",
          strategy_params: dict[str, Any] | None = None, n: int = 48, batch_size: float = 12,
          steps: int = 6, engine: str = "ghost", sampling: str = "poisson",
          accountant: str = "pld", resume_dir: str | None = None, resume_at: int = 0,
          noise_multiplier: float = 1.1, image: bool = False, world: int = 1,
          **extra: Any) -> dict[str, Any]:
    """``steps`` SGD steps of make_private on ``data(n)`` with reproducible noise (seed 7).
    ``image``: 16 features seen as ``(1, 4, 4)`` images (for ``augment=``). ``world`` (one
    process only): draw the noise as ``world`` ranks do (:class:`EmulatedShards`).

    With ``resume_dir``: stop after ``resume_at`` steps, rank 0 saves the state dict, every rank
    builds a fresh model and run, loads the same file and finishes."""
    x, y = data(n, d=16) if image else data(n)
    if image:
        x = x.view(n, 1, 4, 4)
    params = strategy_params if strategy_params is not None else {"clip_norm": 0.7}

    def build(m: nn.Module):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        return make_private(
            m, opt, (x, y), strategy=strategy, strategy_params=params,
            noise_multiplier=noise_multiplier, steps=steps, batch_size=batch_size, delta=1e-5,
            engine=engine, sampling=sampling, accountant=accountant, reproducible_noise=True,
            seed=7, verbose=False, distributed=ctx if ctx is not None else False, **extra)

    m = model(ctx, image=image)
    dp = build(m)
    if ctx is None:
        emulate_world(dp, world)
    clips, global_sizes, shard_sizes, losses = [], [], [], []
    while not dp.exhausted:
        if resume_dir is not None and dp.steps == resume_at:
            path = Path(resume_dir) / "ckpt.pt"
            if dp.is_main_process:
                torch.save(dp.state_dict(), path)
            barrier(ctx)
            m = model(ctx, image=image)
            dp = build(m)
            dp.load_state_dict(torch.load(path, weights_only=False))
            resume_dir = None
        xb, yb = dp.sample()
        clips.append(dp.clip_threshold)
        if ctx is None:
            global_sizes.append(int(xb.shape[0]))
        else:
            global_sizes.append(dp.sampler.last_global_batch_size)
        shard_sizes.append(int(xb.shape[0]))
        losses.append(dp.step(xb, yb))
    assert_synchronized(m, ctx)
    return {
        "ledger": dp.ledger.to_dict(),
        "epsilon": dp.epsilon(),
        "steps": dp.steps,
        "params": {k: v.detach().clone() for k, v in m.state_dict().items()},
        "clips": clips + [dp.clip_threshold],
        "global_sizes": global_sizes,
        "shard_sizes": shard_sizes,
        "losses": losses,
        "describe": dp.describe(),
    }


def zero_grad_noise(ctx: DistributedContext | None, steps: int, z: float, clip: float,
                    batch_size: float) -> torch.Tensor:
    """The released gradients of ``steps`` steps on a model whose loss (hence every gradient) is
    zero, with SECURE randomness: pure noise, which must have std ``z * clip / batch_size``."""
    x = torch.randn(40, 3)
    y = torch.zeros(40, dtype=torch.long)
    torch.manual_seed(0)
    m = nn.Linear(3, 4)  # 16 coordinates

    def zero_loss(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return (out * 0.0).sum(1)

    dp = make_private(m, None, (x, y), loss_fn=zero_loss, strategy="fixed",
                             strategy_params={"clip_norm": clip}, noise_multiplier=z,
                             steps=steps, batch_size=batch_size, delta=1e-5, engine="ghost",
                             verbose=False, distributed=ctx if ctx is not None else False)
    out = torch.empty(steps, 16, dtype=torch.float64)
    for t in range(steps):
        xb, yb = dp.sample()
        dp.backward(xb, yb)
        out[t] = torch.cat([p.grad.reshape(-1) for p in m.parameters()]).double()
    assert dp.steps == steps and dp.ledger.steps == steps
    return out


def rank_env(ctx: DistributedContext) -> dict[str, Any]:  # pragma: no cover - debugging aid
    return {"rank": ctx.rank, "pid": os.getpid()}


def mismatches(ctx: DistributedContext) -> dict[str, str]:
    """Configurations and checkpoints that differ between ranks are refused on every rank."""
    x, y = data(32)
    out: dict[str, str] = {}

    def build(batch_size: float):
        return make_private(model(ctx), None, (x, y), noise_multiplier=1.0, steps=4,
                            batch_size=batch_size, delta=1e-5, reproducible_noise=True, seed=1,
                            verbose=False, distributed=ctx)

    try:
        build(8.0 if ctx.rank == 0 else 9.0)
    except RuntimeError as err:
        out["config"] = str(err)
    dp = build(8.0)
    states = []
    for _ in range(2):
        xb, yb = dp.sample()
        dp.backward(xb, yb)
        states.append(dp.state_dict())
    fresh = build(8.0)
    try:  # rank r loads the checkpoint of step r + 1
        fresh.load_state_dict(states[ctx.rank])
    except RuntimeError as err:
        out["resume"] = str(err)
    return out


def data_mismatch(ctx: DistributedContext) -> dict[str, str]:
    """Ranks holding different data of the same size are refused on every rank (issue 33: only
    the configuration used to be compared)."""
    x, y = data(32)
    if ctx.rank == 1:
        x = x.clone()
        x[3, 0] += 1.0  # one feature of one example differs
    try:
        make_private(model(ctx), None, (x, y), noise_multiplier=1.0, steps=4, batch_size=8.0,
                     delta=1e-5, reproducible_noise=True, seed=1, verbose=False,
                     distributed=ctx)
    except RuntimeError as err:
        return {"data": str(err)}
    return {"data": ""}


def sharded_noise(ctx: DistributedContext | None, width: int, steps: int, z: float, clip: float,
                  batch_size: float, resume_dir: str | None = None) -> dict[str, Any]:
    """Zero gradients on ``nn.Linear(3, width)`` (``4 * width`` coordinates): the release is pure
    noise. Returns the released gradients of ``steps`` SECURE steps (``secure``), of one
    REPRODUCIBLE step (seed 11, ``reproducible``) and the rank's shard bounds. With
    ``resume_dir`` (secure, 2 + 2 steps on ``nn.Linear(3, 8)``): the noise of steps 3-4 run on,
    and the same two steps after a fresh run loads the step-2 checkpoint written by rank 0."""
    from dpclip.training.noise_shard import noise_bounds

    x = torch.randn(40, 3)
    y = torch.zeros(40, dtype=torch.long)

    def zero_loss(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return (out * 0.0).sum(1)

    def build(m: nn.Module, total_steps: int, **kw: Any):
        return make_private(m, None, (x, y), loss_fn=zero_loss, strategy="fixed",
                            strategy_params={"clip_norm": clip}, noise_multiplier=z,
                            steps=total_steps, batch_size=batch_size, delta=1e-5,
                            engine="ghost", verbose=False,
                            distributed=ctx if ctx is not None else False, **kw)

    def released(dp, m: nn.Module, k: int) -> torch.Tensor:
        rows = []
        for _ in range(k):
            xb, yb = dp.sample()
            dp.backward(xb, yb)
            rows.append(torch.cat([p.grad.reshape(-1) for p in m.parameters()]).clone())
        return torch.stack(rows)

    torch.manual_seed(0)
    out: dict[str, Any] = {}
    world = ctx.world_size if ctx is not None else 1
    rank = ctx.rank if ctx is not None else 0
    out["bounds"] = noise_bounds(4 * width, world, rank)
    m = nn.Linear(3, width)
    out["secure"] = released(build(m, steps), m, steps)
    m = nn.Linear(3, width)
    out["reproducible"] = released(build(m, 1, reproducible_noise=True, seed=11), m, 1)
    if resume_dir is not None:
        m = nn.Linear(3, 2)
        dp = build(m, 4)
        before = released(dp, m, 2)
        path = Path(resume_dir) / "noise-ckpt.pt"
        if dp.is_main_process:
            torch.save(dp.state_dict(), path)
        barrier(ctx)
        out["before"] = before
        out["run_on"] = released(dp, m, 2)
        m = nn.Linear(3, 2)
        dp = build(m, 4)
        dp.load_state_dict(torch.load(path, weights_only=False))
        out["resumed"] = released(dp, m, 2)
        out["checkpoint_keys"] = sorted(torch.load(path, weights_only=False)["randomness"])
    return out
