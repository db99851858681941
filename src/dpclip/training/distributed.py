"""Multi-process DP-SGD on ``torch.distributed`` (issue 19): one private mechanism, many ranks.

A distributed run must release exactly what the single-process run releases, so that the
single-process ledger is the distributed ledger. Every step:

    shared secret  <- rank 0's secure generator states, broadcast once (shared_randomness)
    global batch   <- the sampler's GLOBAL Poisson (or fixed-size) mask, drawn by every rank from
                      the shared sampling generator: the same mask everywhere (ShardedSampler)
    shard          <- this rank's contiguous slice of the global batch (may be empty)
    local sums     <- the inner engine on the shard: sum_i w_i g_i, per-example norms
    global sums    <- all-reduce(SUM) of the clipped sums (with the noise: see below); the norms
                      are placed at their global
                      positions and all-reduced too, so every rank holds the global norms in the
                      single-process order (DistributedEngine). An empty shard takes part with
                      zero sums and no norms: no rank skips a collective, nothing hangs.
    noise          <- dp_step's release (dpclip.training.release) draws N(0, (z S)^2) ONCE per
                      coordinate: rank r draws only its block of coordinates, from its own
                      stream, adds it to its LOCAL clipped sum, and the all-reduce of those sums
                      gives every rank the same noisy global sum (dpclip.training.noise_shard:
                      ShardNoiseEngine leaves the sums local, the release reduces them)
    releases       <- strategy.update sees the GLOBAL norms: a quantile count or a mean norm is
                      summed over all ranks before its noise, released once, counted once
    ledger         <- the planned events of the global mechanism (identical on every rank; rank
                      0 writes it)

Privacy argument. The released gradient of a step is ``(sum over the global batch of w_i g_i +
N(0, (z S)^2 I)) / B`` with ``B`` the public expected GLOBAL batch size, and the global batch is
one Poisson draw of rate ``q`` over the whole dataset: exactly the single-process mechanism, so
the single-process event ``PoissonSampled(q, Gaussian(z) [+ strategy events])`` accounts for it.
Which rank computed which term of the sum is invisible in the release. The shared generator
states, the unnoised sums and the per-example norms travel only between the ranks of the process
group: every rank and the interconnect are inside the trust boundary, as they are for the data
itself (docs/distributed.md). The generator states are never printed, logged or stored outside the
private checkpoint.

What is refused (each with the fix): P-GRAD strategies (AdaClip: per-example gradients are
transformed before clipping outside the engine), batch-clipping units (BC/GBC clip a unit's mean
gradient outside the engine), and any sampler other than the two global ones (a per-rank batch
scheme is a different mechanism from the one the accountant covers). Fixed-size sampling is the
GLOBAL fixed-size draw, accounted as sampling without replacement under replace-one adjacency:
the PLD (Poisson) accountant refuses it, as in one process (use ``accountant="rdp"``).

Launch: ``torchrun --nproc_per_node N -m dpclip train ...`` (the trainer calls
:func:`init_from_env`), or in your own script ``make_private(..., distributed=True)`` after
``torch.distributed.init_process_group`` (or with torchrun's environment: it is initialised for
you).
"""

from __future__ import annotations

import datetime
import hashlib
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dpclip.engine.base import Engine, EngineResult, LossFn, ParamGroups, WeightFn
from dpclip.engine.batch import check_batch
from dpclip.events import DpEvent
from dpclip.randomness import PrivateRandomness
from dpclip.training.sampling import FixedSizeSampler, PoissonSampler

__all__ = [
    "DistributedContext",
    "DistributedEngine",
    "ShardedSampler",
    "assert_synchronized",
    "barrier",
    "check_context",
    "broadcast_module",
    "data_digest",
    "broadcast_tensor_",
    "check_randomness",
    "check_same",
    "init_from_env",
    "resolve_distributed",
    "shard_bounds",
    "shared_randomness",
]


def _dist():
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed; install a torch with "
                           "distributed support or train in one process")
    return dist


@dataclass(frozen=True)
class DistributedContext:
    """The process group a private run spans (public facts only).

    ``rank`` and ``world_size`` are within ``group`` (``None``: the default group); ``backend`` is
    the group's backend (``gloo`` for CPU, ``nccl`` for CUDA). Collectives on an ``nccl`` group use
    tensors on the current CUDA device; on ``gloo``, CPU tensors.
    """

    rank: int
    world_size: int
    backend: str
    group: Any = None

    def __post_init__(self) -> None:
        if not (isinstance(self.world_size, int) and self.world_size >= 1):
            raise ValueError(f"DistributedContext: world_size must be an int >= 1, got "
                             f"{self.world_size!r}")
        if not (isinstance(self.rank, int) and 0 <= self.rank < self.world_size):
            raise ValueError(f"DistributedContext: rank must be in [0, {self.world_size}), got "
                             f"{self.rank!r}")

    @property
    def is_main(self) -> bool:
        """Rank 0: the one rank that writes the ledger, results and checkpoints."""
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        """Where this group's collectives take their tensors."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @classmethod
    def current(cls, group: Any = None) -> "DistributedContext":
        """The context of an initialised process group (``group=None``: the default group)."""
        dist = _dist()
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: launch with torchrun (dpclip initialises "
                "the group from its environment) or call torch.distributed.init_process_group "
                "first")
        return cls(rank=dist.get_rank(group), world_size=dist.get_world_size(group),
                   backend=str(dist.get_backend(group)), group=group)

    def describe(self) -> dict[str, Any]:
        """Public facts for run summaries."""
        return {"world_size": self.world_size, "backend": self.backend}


def init_from_env(backend: str | None = None,
                  timeout_s: float = 600.0) -> DistributedContext | None:
    """The process group of a ``torchrun`` launch, initialised from its environment.

    Returns ``None`` when ``WORLD_SIZE`` is unset or 1 and no group is initialised (a plain
    one-process run). Otherwise initialises the default group (``env://``: ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) unless it already is, and returns its
    context. ``backend`` defaults to ``nccl`` when CUDA is available (each rank then uses
    ``cuda:LOCAL_RANK``) and ``gloo`` otherwise."""
    dist = _dist()
    if dist.is_initialized():
        return DistributedContext.current()
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return None
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, init_method="env://",
                            timeout=datetime.timedelta(seconds=timeout_s))
    return DistributedContext.current()


def resolve_distributed(distributed: Any, owner: str = "make_private") -> DistributedContext | None:
    """``distributed=`` of :func:`dpclip.make_private` to a context or ``None``.

    ``True``: the default group (initialised from torchrun's environment if needed); a
    :class:`DistributedContext`: that one; ``False``: one process. ``None`` (the default) is one
    process unless a process group with more than one rank is initialised: then it raises, because
    N independent runs over the same data are not the distributed mechanism and the choice must be
    explicit."""
    if isinstance(distributed, DistributedContext):
        check_context(distributed, owner)
        return distributed
    if distributed is True:
        ctx = init_from_env()
        if ctx is None:
            raise ValueError(
                f"{owner}: distributed=True but no process group is initialised and WORLD_SIZE "
                "is not set; launch with torchrun --nproc_per_node N, call "
                "torch.distributed.init_process_group first, or pass distributed=False")
        return ctx
    if distributed is False:
        return None
    if distributed is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                f"{owner}: a torch.distributed group with {dist.get_world_size()} ranks is "
                "initialised; pass distributed=True to train one private run across the ranks "
                "(global Poisson batch, all-reduced clipped sums, noise once), or "
                "distributed=False for an independent run per rank")
        return None
    raise TypeError(f"{owner}: distributed must be None, True, False or a DistributedContext, "
                    f"got {type(distributed).__name__}")


def check_context(ctx: DistributedContext, owner: str = "make_private") -> None:
    """A context given by hand must be the process group it names: its rank, world size and
    backend as torch.distributed reports them for its group. A context claiming more ranks than
    the group has drew only its shard of the noise while the all-reduce added no other shard
    (ninety-fourth hostile review: ``DistributedContext(rank=0, world_size=2)`` on a group of one
    would release half the coordinates without noise; only gloo's allgather stopped it, by
    accident)."""
    import torch.distributed as dist

    live = dist.is_available() and dist.is_initialized()
    if not live:
        if ctx.world_size > 1 or ctx.group is not None:
            raise ValueError(
                f"{owner}: distributed={ctx!r} names {ctx.world_size} ranks but no torch."
                "distributed process group is initialised; call torch.distributed."
                "init_process_group first (or pass distributed=True under torchrun)")
        return
    try:
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        backend = str(dist.get_backend(ctx.group))
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"{owner}: distributed={ctx!r}: its group is not usable from this "
                         f"process ({exc})") from None
    if (size, rank) != (ctx.world_size, ctx.rank):
        raise ValueError(
            f"{owner}: distributed={ctx!r} does not match its process group: torch.distributed "
            f"reports rank {rank} of {size}; build the context with dpclip.training.distributed."
            "init_from_env() or pass distributed=True")
    if backend.lower() != str(ctx.backend).lower():
        raise ValueError(f"{owner}: distributed={ctx!r}: the group's backend is {backend!r}, "
                         f"not {ctx.backend!r}")


# --------------------------------------------------------------------------------- collectives

def barrier(ctx: DistributedContext | None) -> None:
    """Wait for every rank (no-op for ``None``). Use between rank 0 writing a checkpoint and the
    other ranks reading it."""
    if ctx is not None and ctx.world_size > 1:
        dist = _dist()
        if ctx.backend == "nccl":
            dist.barrier(group=ctx.group, device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier(group=ctx.group)


def _src(ctx: DistributedContext) -> int:
    """The global rank of the group's rank 0 (broadcast takes global ranks)."""
    if ctx.group is None:
        return 0
    return _dist().get_global_rank(ctx.group, 0)


def broadcast_tensor_(t: Tensor, ctx: DistributedContext | None) -> None:
    """In-place broadcast of ``t`` (contiguous) from rank 0 (no-op for one process). For values
    that are PUBLIC or shared inside the trust boundary (public-data norms, generator states)."""
    if ctx is None or ctx.world_size == 1:
        return
    _broadcast_(t, ctx)


def _broadcast_(t: Tensor, ctx: DistributedContext) -> None:
    """In-place broadcast of ``t`` from rank 0 (through the collective device)."""
    buf = t if t.device == ctx.device and t.is_contiguous() else t.contiguous().to(ctx.device)
    _dist().broadcast(buf, src=_src(ctx), group=ctx.group)
    if buf is not t:
        t.copy_(buf)


def _gather_bytes(data: bytes, ctx: DistributedContext) -> list[bytes]:
    """Every rank's ``data`` (all of the same length), in rank order."""
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(ctx.device)
    out = [torch.empty_like(t) for _ in range(ctx.world_size)]
    _dist().all_gather(out, t, group=ctx.group)
    return [bytes(o.cpu().numpy().tobytes()) for o in out]


def check_same(ctx: DistributedContext | None, value: str, what: str) -> None:
    """Raise on every rank unless all ranks passed the same ``value``.

    Only a SHA-256 digest travels and nothing is printed, so ``value`` may be secret (a generator
    state); ``what`` names it in the error."""
    if ctx is None or ctx.world_size == 1:
        return
    digests = _gather_bytes(hashlib.sha256(value.encode()).digest(), ctx)
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise RuntimeError(
            f"distributed: ranks {differ} disagree with rank 0 on {what}; every rank must run the "
            "same configuration (same arguments, data and checkpoint)")


def data_digest(*data: Any) -> str:
    """SHA-256 (hex) of training data: every tensor leaf of ``data`` (tensors, tuples / dicts of
    tensors), with its dtype and shape, or every example of a map-style ``Dataset`` (one pass
    over it). For :func:`check_same` only: the digest never leaves the process group."""
    from torch.utils import _pytree as pytree
    from torch.utils.data import Dataset, TensorDataset

    h = hashlib.sha256()

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            t = t.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(t).encode())

    for item in data:
        if item is None:
            continue
        if isinstance(item, Dataset) and not isinstance(item, TensorDataset):
            for i in range(len(item)):  # type: ignore[arg-type]
                for leaf in pytree.tree_leaves(item[i]):
                    add(leaf)
        elif isinstance(item, TensorDataset):
            for leaf in item.tensors:
                add(leaf)
        else:
            for leaf in pytree.tree_leaves(item):
                add(leaf)
    return h.hexdigest()


def shared_randomness(rng: PrivateRandomness, ctx: DistributedContext | None) -> None:
    """Give every rank rank 0's sampling and noise generators and noise key (in place; the secret
    is agreed once).

    The full generator states (``torch.Generator.get_state()``: on the CPU 5056 bytes, the
    19,968-bit Mersenne Twister state; on CUDA 16 bytes, the Philox key and offset; drawn from OS
    entropy in secure mode) are broadcast from rank 0, so every rank draws the same global batch
    mask; so is the 32-byte noise key (:meth:`PrivateRandomness.noise_key`) from which each rank
    derives its OWN noise stream per step (``rank_noise``: rank and step in the derivation), so
    the ranks draw independent noise on disjoint coordinates (dpclip.training.noise_shard) and
    rank 0's checkpoint resumes all of them. The secrets travel only inside the process group and
    are never printed or logged. All ranks must use the same mode (secure or reproducible):
    checked first."""
    if ctx is None or ctx.world_size == 1:
        return
    check_same(ctx, rng.mode, "the randomness mode (reproducible_noise)")
    for gen in (rng.sampling, rng.noise):
        state = gen.get_state()
        _broadcast_(state, ctx)
        gen.set_state(state)
    key = torch.frombuffer(bytearray(rng.noise_key()), dtype=torch.uint8).clone()
    _broadcast_(key, ctx)
    rng.set_noise_key(bytes(key.cpu().numpy().tobytes()))
    key = torch.frombuffer(bytearray(rng.model_key()), dtype=torch.uint8).clone()
    _broadcast_(key, ctx)  # (the model's own randomness: one key for every rank)
    rng.set_model_key(bytes(key.cpu().numpy().tobytes()),
                      salt=f"rank {ctx.rank} of {ctx.world_size}".encode())
    check_same(ctx, _rng_digest(rng), "the private generator states")


def _rng_digest(rng: PrivateRandomness) -> str:
    """A digest of the (secret) generator states and noise key; compared between ranks, never
    shown."""
    h = hashlib.sha256()
    for gen in (rng.sampling, rng.noise):
        h.update(gen.get_state().numpy().tobytes())
    h.update(rng.noise_key())
    return h.hexdigest()


def check_randomness(rng: PrivateRandomness, ctx: DistributedContext | None) -> None:
    """Raise unless every rank holds the same generator states (after a resume: every rank must
    have loaded the same checkpoint)."""
    check_same(ctx, _rng_digest(rng), "the private generator states (load the same checkpoint "
                                      "on every rank)")


def broadcast_module(model: nn.Module, ctx: DistributedContext | None) -> None:
    """Copy rank 0's parameters and buffers to every rank (in place), as DDP does at start.

    The initial model is public (it follows the public seed or a public checkpoint); afterwards
    every rank applies the same privatized gradient, so the replicas stay identical."""
    if ctx is None or ctx.world_size == 1:
        return
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            _broadcast_(t.data, ctx)


def _module_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                 if t.numel() else b"")
    return h.hexdigest()


def assert_synchronized(model: nn.Module, ctx: DistributedContext | None) -> None:
    """Raise unless the model's parameters and buffers are bitwise identical on every rank (a
    cheap check: one 32-byte digest per rank)."""
    check_same(ctx, _module_digest(model), "the model parameters (replicas diverged)")


# ------------------------------------------------------------------------------------- sampling

def shard_bounds(batch_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of ``rank``'s contiguous slice of a global batch of ``batch_size``
    (``torch.tensor_split``: the first ``batch_size % world_size`` ranks get one more)."""
    base, extra = divmod(int(batch_size), int(world_size))
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class ShardedSampler:
    """This rank's shard of a GLOBAL batch, drawn from the shared sampling generator.

    Every rank calls :meth:`sample` with the same (shared) generator, so every rank draws the same
    global batch; each keeps its contiguous slice (:func:`shard_bounds`; empty when the global
    batch is smaller than the world). The public description is the inner sampler's: ``name``,
    ``adjacency``, ``sensitivity_factor``, ``dataset_size``, ``expected_batch_size`` (the GLOBAL
    one: the step's public divisor), ``sample_rate``, ``steps_per_epoch`` and ``step_event``, so
    the accountant sees the global mechanism. Only the two global samplers are accepted
    (Poisson; fixed-size, accounted as sampling without replacement): any other scheme, e.g. a
    fixed batch per rank, is a different mechanism and is refused.
    """

    def __init__(self, inner: Any, ctx: DistributedContext) -> None:
        if not isinstance(inner, (PoissonSampler, FixedSizeSampler)):
            raise ValueError(
                f"distributed training shards the global batch of a Poisson or fixed-size "
                f"sampler; got {type(inner).__name__} ({getattr(inner, 'name', '?')!r}). Use "
                "sampling='poisson' (or 'fixed-size' with accountant='rdp'); per-rank batches and "
                "mini-set samplers are not offered distributed")
        self.inner, self.ctx = inner, ctx
        self.name = inner.name
        self.adjacency = inner.adjacency
        self.sensitivity_factor = inner.sensitivity_factor
        self.dataset_size = inner.dataset_size
        #: NON-PRIVATE diagnostics of the last draw (sizes of the global batch and of this shard)
        self.last_global_batch_size: int | None = None
        self.last_shard_size: int | None = None
        #: ``[start, stop)`` of this rank's slice of the last global batch (positions in it)
        self.last_shard_bounds: tuple[int, int] = (0, 0)

    @property
    def expected_batch_size(self) -> float:
        return self.inner.expected_batch_size

    @property
    def sample_rate(self) -> float:
        return self.inner.sample_rate

    @property
    def steps_per_epoch(self) -> int:
        return self.inner.steps_per_epoch

    def __getattr__(self, item: str) -> Any:  # public extras of the inner sampler
        if item.startswith("_") or item in ("inner", "ctx"):
            raise AttributeError(item)
        return getattr(self.inner, item)

    def sample(self, generator: torch.Generator) -> Tensor:
        """This rank's slice of the global batch (sorted global indices; may be empty)."""
        idx = self.inner.sample(generator)
        start, stop = shard_bounds(int(idx.numel()), self.ctx.world_size, self.ctx.rank)
        self.last_global_batch_size, self.last_shard_size = int(idx.numel()), stop - start
        self.last_shard_bounds = (start, stop)
        return idx[start:stop]

    def step_event(self, inner: DpEvent) -> DpEvent:
        return self.inner.step_event(inner)

    def __repr__(self) -> str:
        return (f"ShardedSampler({self.inner!r}, rank={self.ctx.rank}, "
                f"world_size={self.ctx.world_size})")


# --------------------------------------------------------------------------------------- engine

class DistributedEngine:
    """An engine whose result is the GLOBAL one: the inner engine on this rank's shard, then the
    clipped sums all-reduced (SUM) and the per-example norms and weights assembled in global order.

    Every rank receives the same :class:`EngineResult`, bit for bit: ``grads`` = the clipped sum
    over the global batch (still unnoised: ``dp_step`` adds the noise once, from the shared
    generator), ``norms``/``weights`` = the global per-example values in the single-process order
    (the shards are contiguous slices), ``loss_sum`` = the global sum. The weights were computed on
    each rank from its examples' own norms (strategies' weights are row-wise), so the sensitivity
    of the global sum is the single-process one. An empty shard contributes zeros and takes part
    in every collective. Three collectives per step: the shard sizes and loss sums (all-gather),
    the flat gradient sum (all-reduce) and, for per-example engines, the norms and weights placed
    at their global offsets (all-reduce of exact zeros elsewhere).

    The name differs from the inner engine's on purpose: code that special-cases an engine by name
    (the P-GRAD path of ``dp_step``) must not bypass the all-reduce; it fails instead.
    """

    def __init__(self, inner: Engine, ctx: DistributedContext) -> None:
        if isinstance(inner, DistributedEngine):
            raise ValueError("DistributedEngine: the inner engine is already distributed")
        self.inner, self.ctx = inner, ctx
        self.name = f"distributed-{getattr(inner, 'name', type(inner).__name__)}"
        self.per_example = bool(getattr(inner, "per_example", False))
        self.max_physical_batch = getattr(inner, "max_physical_batch", None)

    def compute(self, model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor,
                weight_fn: WeightFn | None, groups: ParamGroups) -> EngineResult:
        ctx = self.ctx
        local = self.inner.compute(model, loss_fn, inputs, targets, weight_fn, groups)
        info = dict(local.engine_info or {})
        inner_name = getattr(self.inner, "name", type(self.inner).__name__)
        info.setdefault("engine", inner_name)
        info.setdefault("requested", inner_name)
        info.setdefault("fallback", None)
        if ctx.world_size == 1:
            return EngineResult(local.grads, local.norms, local.weights, local.loss_sum, info)
        dist = _dist()
        n_local = check_batch(inputs, targets, self.name)
        has_norms = local.norms is not None
        has_weights = local.weights is not None
        meta = torch.tensor([float(n_local), float(local.loss_sum), float(has_norms),
                             float(has_weights)], dtype=torch.float64, device=ctx.device)
        metas = [torch.empty_like(meta) for _ in range(ctx.world_size)]
        dist.all_gather(metas, meta, group=ctx.group)
        table = torch.stack(metas).cpu()
        if not (torch.all(table[:, 2] == table[0, 2]) and torch.all(table[:, 3] == table[0, 3])):
            raise RuntimeError("DistributedEngine: the ranks' engines disagree on returning "
                               "per-example norms; every rank must use the same engine")
        sizes = [int(v) for v in table[:, 0].tolist()]
        loss_sum = math.fsum(table[:, 1].tolist())
        grads = self._all_reduce_grads(local.grads)
        norms = weights = None
        if has_norms or has_weights:
            norms, weights = self._assemble(local, sizes, groups)
        return EngineResult(grads=grads, norms=norms, weights=weights, loss_sum=loss_sum,
                            engine_info=info)

    def _all_reduce_grads(self, grads: dict[str, Tensor]) -> dict[str, Tensor]:
        dist, ctx = _dist(), self.ctx
        names = list(grads)
        tensors = [grads[n] for n in names]
        if not tensors:
            return {}
        dtype, device = tensors[0].dtype, tensors[0].device
        if all(t.dtype == dtype and t.device == device for t in tensors):
            flat = torch.cat([t.reshape(-1) for t in tensors]).to(ctx.device)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=ctx.group)
            flat = flat.to(device)
            return {n: c.view(tuple(t.shape)) for n, c, t in
                    zip(names, flat.split_with_sizes([t.numel() for t in tensors]), tensors)}
        out = {}
        for n, t in zip(names, tensors):  # mixed dtypes/devices: one all-reduce per tensor
            buf = t.detach().clone().to(ctx.device)
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=ctx.group)
            out[n] = buf.to(t.device)
        return out

    def _assemble(self, local: EngineResult, sizes: list[int],
                  groups: ParamGroups) -> tuple[Tensor | None, Tensor | None]:
        """Global norms/weights: each rank writes its rows at its global offset, zeros elsewhere;
        the all-reduce (x + 0 = x exactly, inf and NaN included) leaves every row as computed."""
        dist, ctx = _dist(), self.ctx
        total = sum(sizes)
        start = sum(sizes[: ctx.rank])
        n_local = sizes[ctx.rank]
        tail = () if groups.is_flat else (len(groups),)
        parts = [t for t in (local.norms, local.weights) if t is not None]
        ref = parts[0]
        bufs = []
        for t in parts:
            full = torch.zeros((total, *tail), dtype=t.dtype, device=ctx.device)
            if n_local:
                full[start:start + n_local] = t.detach().reshape(n_local, *tail).to(ctx.device)
            bufs.append(full)
        if len(bufs) == 2 and bufs[0].dtype == bufs[1].dtype:
            both = torch.stack(bufs)
            dist.all_reduce(both, op=dist.ReduceOp.SUM, group=ctx.group)
            bufs = [both[0], both[1]]
        else:
            for b in bufs:
                dist.all_reduce(b, op=dist.ReduceOp.SUM, group=ctx.group)
        bufs = [b.to(ref.device) for b in bufs]
        it = iter(bufs)
        norms = next(it) if local.norms is not None else None
        weights = next(it) if local.weights is not None else None
        return norms, weights

    def __repr__(self) -> str:
        return f"DistributedEngine({self.inner!r}, world_size={self.ctx.world_size})"
