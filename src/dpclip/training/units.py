"""Clipping units (Nguyen et al.): individual (IC), batch (BC) and general batch clipping (GBC).

The *clipping unit* is what one clipped vector summarizes (algorithms.md M11):

* ``ic`` (the default): one example; the clipped sum has sensitivity ``C`` under add/remove-one
  (Poisson) and ``2 C`` under replace-one (fixed-size), exactly as before.
* ``bc``: the whole batch. One gradient of the batch's MEAN loss, clipped once:
  ``U = [mean_i grad_i]_C + N(0, (2 C z)^2)`` and the update uses ``U`` (divided by the number of
  units, 1). Layers that mix the examples of a batch (BatchNorm) are legitimate: the batch is the
  unit.
* ``gbc``: the training set is cut once, before training, into ``N // s`` disjoint *mini-sets* of
  exactly ``s`` examples (a permutation drawn from a public seed; the ``N mod s`` left-over
  examples are never used). Each step draws ``k = m / s`` mini-sets uniformly without replacement;
  each mini-set's mean gradient is clipped; ``U = sum_j [g(S_j)]_C + N(0, (2 C z)^2)``, divided by
  ``k``. ``s = m`` (``k = 1``) is BC with fixed-size sampling; ``s = 1`` is IC.

Privacy (the example stays the privacy unit). Changing one example changes the content of ONE unit,
and two clipped vectors differ by at most ``2 C`` whatever their content, so the released sum has
sensitivity ``2 C`` for BC and GBC under both relations below; the noise is ``z * 2 C``:

* fixed-size sampling (Nguyen's argument): replace-one adjacency; BC draws ``m`` of ``N`` examples
  (``SampledWithoutReplacement(N, m, Gaussian(z))``, the same event as IC), GBC ``k`` of ``N // s``
  mini-sets (``SampledWithoutReplacement(N // s, k, Gaussian(z))``; ``k / (N/s) = m / N``).
* Poisson sampling, BC only: every example joins the batch independently with rate ``q``; adding
  one example changes nothing with probability ``1 - q`` and moves the one clipped vector by at
  most ``2 C`` otherwise, so for every fixed rest of the batch the pair of outputs is a
  Poisson-subsampled Gaussian pair with shift ``<= 2 C``; by joint convexity the step is
  ``PoissonSampled(q, Gaussian(z))`` under add/remove-one with sensitivity ``2 C``.
  Poisson sampling of whole mini-sets (GBC) is refused: one example changes a sampled mini-set's
  content, a *substitution* at the mini-set level, which dp-accounting's Poisson accountants do
  not cover (they are add/remove only).

BatchNorm running statistics: a training-mode forward over a unit would fold private batch
statistics into the running mean/variance without noise, and they are released with the model.
dpclip restores every BatchNorm buffer after each private forward (they never see private data)
and evaluates with ``bn_stats = "batch"`` (test-batch statistics) or ``"public"`` (running
statistics recomputed on the public split before each evaluation).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Mapping

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from dpclip.clipping.capabilities import capabilities_of, strategy_name
from dpclip.engine._common import ChunkReducer, trainable_params
from dpclip.engine.base import EngineResult, LossFn, ParamGroups, WeightFn
from dpclip.engine.isolation import Isolated
from dpclip.engine.op_entry import no_compiled_autograd
from dpclip.engine.unit_guard import UnitGuard
from dpclip.errors import DeprecatedSpellingWarning
from dpclip.events import REPLACE_ONE, DpEvent, SampledWithoutReplacementEvent
from dpclip.engine import _cm

__all__ = [
    "UNITS",
    "BN_STATS",
    "MiniSetSampler",
    "UnitConfig",
    "batchnorm_layers",
    "bn_eval",
    "check_batchnorm",
    "check_unit_sampling",
    "expected_units",
    "frozen_bn_buffers",
    "public_fraction_of",
    "public_unit_norms",
    "recompute_bn_stats",
    "resolve_unit",
    "unit_sum",
]

UNITS = ("ic", "bc", "gbc")
BN_STATS = ("auto", "batch", "public")
#: strategy parameters that configure the unit and the public split (popped before the strategy)
UNIT_PARAMS = ("unit", "miniset_size", "bn_stats", "public_fraction")


@dataclass(frozen=True)
class UnitConfig:
    """How examples are grouped into clipped units, and how BatchNorm is evaluated.

    ``unit``: ``ic`` | ``bc`` | ``gbc``. ``miniset_size`` (GBC only): ``s``; the batch size must be a
    multiple of it. ``bn_stats``: evaluation statistics of BatchNorm layers, ``batch`` (test-batch
    statistics), ``public`` (recomputed on the public split) or ``auto`` (``public`` when the run has
    a public split, else ``batch``). ``public_fraction``: the share of the training set carved out as
    public data (never trained on privately, never accounted); ``None`` = 0.1 when something needs
    public data (adaptive layerwise clipping, ``bn_stats=public``), else 0.
    """

    unit: str = "ic"
    miniset_size: int | None = None
    bn_stats: str = "auto"
    public_fraction: float | None = None

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise ValueError(
                f"unit={self.unit!r} is not a clipping unit; valid: ic (per example), bc (batch "
                "clipping), gbc (general batch clipping over mini-sets of miniset_size examples)"
            )
        if self.miniset_size is not None:
            if self.unit != "gbc":
                raise ValueError(
                    f"miniset_size is a parameter of unit=gbc, not unit={self.unit}; drop it or "
                    "use unit=gbc (unit='gbc'; CLI --unit gbc)"
                )
            if not (isinstance(self.miniset_size, int) and self.miniset_size >= 1):
                raise ValueError(f"miniset_size must be an int >= 1, got {self.miniset_size!r}")
        elif self.unit == "gbc":
            raise ValueError("unit=gbc needs miniset_size=S, the examples per mini-set "
                             "(miniset_size=S; CLI --miniset-size S)")
        if self.bn_stats not in BN_STATS:
            raise ValueError(f"bn_stats={self.bn_stats!r}; valid: {', '.join(BN_STATS)}")
        if self.public_fraction is not None and not (0.0 <= self.public_fraction < 1.0):
            raise ValueError(
                f"public_fraction must be in [0, 1), got {self.public_fraction!r}"
            )

    @staticmethod
    def pop_from(params: Mapping[str, Any]) -> tuple["UnitConfig", dict[str, Any]]:
        """Split parameters into the unit config and the rest (no deprecation note: callers that
        read the OLD spelling inside a strategy's parameters use :func:`resolve_unit`)."""
        kw, rest = _take_unit_keys(params)
        return UnitConfig(**kw), rest

    @staticmethod
    def coerce(key: str, value: Any) -> Any:
        """A unit setting from a CLI string, TOML or JSON value: ``unit``/``bn_stats`` lowered,
        ``miniset_size`` an int, ``public_fraction`` a float (``None`` stays ``None``)."""
        if value is None:
            return None
        if key in ("unit", "bn_stats"):
            return str(value).strip().lower()
        if key == "miniset_size":
            try:
                return int(value) if float(value) == int(float(value)) else float(value)
            except (TypeError, ValueError):
                raise ValueError(f"miniset_size must be an integer, got {value!r}") from None
        if key == "public_fraction":
            try:
                return float(value)
            except (TypeError, ValueError):
                raise ValueError(f"public_fraction must be a number, got {value!r}") from None
        raise KeyError(key)

    def settings(self) -> dict[str, Any]:
        """The four settings as keyword arguments (``UnitConfig(**unit.settings()) == unit``)."""
        return {"unit": self.unit, "miniset_size": self.miniset_size,
                "bn_stats": self.bn_stats, "public_fraction": self.public_fraction}

    @property
    def is_individual(self) -> bool:
        return self.unit == "ic"

    @property
    def sensitivity_factor(self) -> int:
        """Multiplier of the strategy's bound for one changed unit: 2 for BC/GBC (any relation)."""
        return 2

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"unit": self.unit}
        if self.miniset_size is not None:
            d["miniset_size"] = self.miniset_size
        return d


#: the defaults of the unit settings (an argument at its default was not given)
UNIT_DEFAULTS: dict[str, Any] = {"unit": "ic", "miniset_size": None, "bn_stats": "auto",
                                 "public_fraction": None}


def _take_unit_keys(params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(the unit settings found in params, coerced; the other parameters)``."""
    rest = dict(params)
    found = {k: UnitConfig.coerce(k, rest.pop(k)) for k in UNIT_PARAMS if k in rest}
    return found, rest


def new_spelling(key: str, value: Any, front: str) -> str:
    """How a unit setting is written as its own argument, for messages: ``front`` is
    ``"make_private"`` (``unit='bc'``), ``"TrainConfig"`` (the field, the CLI flag and the spec key)
    or ``"--unit"`` (the CLI flag)."""
    flag = f"--{key.replace('_', '-')} {value}"
    if front == "make_private":
        return f"{key}={value!r}"
    if front.startswith("--"):
        return flag
    toml = f'"{value}"' if isinstance(value, str) else value
    return f"{key}={value!r} (CLI {flag}; spec [train] {key} = {toml})"


def resolve_unit(
    given: Mapping[str, Any],
    params: Mapping[str, Any] | None,
    *,
    where: str,
    front: str = "make_private",
) -> tuple[UnitConfig, dict[str, Any]]:
    """The clipping unit of a run and the strategy's own parameters: the ONE place where the
    unit settings are read.

    ``given``: the unit settings passed as their own arguments (``unit=``, ``miniset_size=``,
    ``bn_stats=``, ``public_fraction=``; a value equal to its default counts as not given).
    ``params``: the strategy's parameters, where the settings used to travel (the OLD spelling:
    ``strategy_params={'unit': 'bc'}``, ``--param unit=bc``, ``[[strategies]] params.unit``); they
    are still read, with a ``DeprecatedSpellingWarning`` naming the new spelling (:func:`new_spelling`
    for ``front``), and a setting given both ways with two different values is refused.
    """
    old, rest = _take_unit_keys(params or {})
    kw = {k: UnitConfig.coerce(k, v) for k, v in given.items() if k in UNIT_DEFAULTS}
    for key, value in old.items():
        new = new_spelling(key, value, front)
        if kw.get(key, UNIT_DEFAULTS[key]) not in (UNIT_DEFAULTS[key], value):
            raise ValueError(
                f"{where}: {key} is given twice, {kw[key]!r} as its own argument "
                f"({new_spelling(key, kw[key], front)}) and {value!r} inside the strategy's "
                "parameters (the old spelling); remove it from the strategy's parameters")
        warnings.warn(DeprecatedSpellingWarning(
            f"{where}: the clipping unit setting {key}={value!r} inside the strategy's "
            f"parameters is deprecated; give it as its own argument: {new}"), stacklevel=3)
        kw[key] = value
    return UnitConfig(**kw), rest


@dataclass(frozen=True)
class MiniSetSampler:
    """GBC sampling: a fixed partition into ``N // s`` mini-sets, ``k`` drawn without replacement.

    The partition is a permutation drawn from ``partition_seed`` (public; independent of the data).
    ``sample`` returns a ``(k, s)`` tensor of example indices (row ``j`` is mini-set ``j``'s
    members). Adjacency replace-one; event ``SampledWithoutReplacement(N // s, k, inner)``.
    """

    name: ClassVar[str] = "minisets"
    adjacency: ClassVar[str] = REPLACE_ONE
    sensitivity_factor: ClassVar[int] = 2

    dataset_size: int
    miniset_size: int
    minisets_per_step: int
    partition_seed: int = 0

    def __post_init__(self) -> None:
        n, s, k = self.dataset_size, self.miniset_size, self.minisets_per_step
        if not (isinstance(s, int) and s >= 1 and isinstance(k, int) and k >= 1):
            raise ValueError(f"MiniSetSampler: miniset_size and minisets_per_step must be ints >= 1")
        if n // s < k:
            raise ValueError(
                f"MiniSetSampler: {n} examples make {n // s} mini-sets of {s}, fewer than the {k} "
                "drawn per step; lower batch_size (CLI --batch-size) or miniset_size"
            )
        g = torch.Generator().manual_seed(int(self.partition_seed))
        perm = torch.randperm(n, generator=g)[: self.num_minisets * s]
        object.__setattr__(self, "_partition", perm.view(self.num_minisets, s))

    @property
    def num_minisets(self) -> int:
        return self.dataset_size // self.miniset_size

    @property
    def partition(self) -> Tensor:
        """``(N // s, s)`` member indices of every mini-set (public)."""
        return self._partition  # type: ignore[attr-defined]

    @property
    def expected_batch_size(self) -> float:
        """Examples per step ``m = k s`` (the step divides by the number of units ``k``)."""
        return float(self.minisets_per_step * self.miniset_size)

    @property
    def expected_units(self) -> float:
        return float(self.minisets_per_step)

    @property
    def sample_rate(self) -> float:
        return self.minisets_per_step / self.num_minisets

    @property
    def steps_per_epoch(self) -> int:
        return max(1, round(self.num_minisets / self.minisets_per_step))

    def sample(self, generator: torch.Generator) -> Tensor:
        chosen = torch.randperm(self.num_minisets, generator=generator,
                                device=generator.device)[: self.minisets_per_step]
        return self._partition_on(chosen.device)[chosen.sort().values]

    def _partition_on(self, device: torch.device) -> Tensor:
        """The (public) partition on ``device``, copied there once (no per-step host copy)."""
        cache = self.__dict__.setdefault("_partition_by_device", {})
        if device not in cache:
            cache[device] = self.partition.to(device)
        return cache[device]

    def step_event(self, inner: DpEvent) -> DpEvent:
        return SampledWithoutReplacementEvent(self.num_minisets, self.minisets_per_step, inner)


def batchnorm_layers(model: nn.Module) -> list[tuple[str, _BatchNorm]]:
    return [(n or "<root>", m) for n, m in model.named_modules() if isinstance(m, _BatchNorm)]


@contextlib.contextmanager
def frozen_bn_buffers(model: nn.Module) -> Iterator[None]:
    """Restore every BatchNorm buffer on exit: private forwards never reach the running stats."""
    saved = [
        (m, {k: b.detach().clone() for k, b in m.named_buffers(recurse=False) if b is not None})
        for _, m in batchnorm_layers(model)
    ]
    try:
        yield
    finally:
        with _cm.no_grad():
            for m, bufs in saved:
                for k, b in bufs.items():
                    getattr(m, k).copy_(b)


def unit_sum(
    model: nn.Module,
    loss_fn: LossFn,
    inputs: Tensor,
    targets: Tensor,
    weight_fn: WeightFn,
    groups: ParamGroups,
) -> EngineResult:
    """``sum_j w_j g(S_j)`` over units: ``inputs`` is ``(k, s, *example)``, ``targets`` ``(k, s)``.

    ``g(S_j)`` is the gradient of unit ``j``'s MEAN loss, from one batched forward/backward of the
    unit (training-mode BatchNorm uses the unit's statistics; its buffers are restored). Norms are
    per unit, flat ``(k,)`` or per group ``(k, G)``; non-finite unit gradients get norm ``+inf``
    (weight 0). An empty unit (a Poisson BC batch with no example) contributes a zero vector.
    """
    groups.validate(model)
    params = trainable_params(model)
    names = list(params)
    k = int(inputs.shape[0])
    reducer = ChunkReducer(
        {n: p.detach() for n, p in params.items()}, groups, weight_fn, "unit", inputs
    )
    per_unit: dict[str, list[Tensor]] = {n: [] for n in names}
    losses = torch.zeros(k, dtype=torch.float64)
    wrt = [params[n] for n in names]

    def one_unit(x: Tensor, y: Tensor) -> tuple[Tensor, tuple]:
        loss_vec = loss_fn(model(x), y)
        with no_compiled_autograd():
            return loss_vec.detach(), torch.autograd.grad(loss_vec.mean(), wrt,
                                                          allow_unused=True)

    with frozen_bn_buffers(model), UnitGuard(model) as guard:
        for j in range(k):
            if inputs[j].shape[0] == 0:
                for n in names:
                    per_unit[n].append(torch.zeros_like(params[n]))
                continue
            # nothing a unit leaves in process state reaches the next unit or call: the model's
            # state (dpclip.engine.isolation; tenth hostile review: a float attribute carried
            # between units moved a GBC release 2.90 C against the declared 2 C, a BC step 2.00 C)
            # and every tensor or Python value computed from the unit's examples (UnitGuard;
            # ninety-fourth: a module-level global, 3.99 C through make_private)
            # (batch norm's running statistics put back after EACH unit: the next unit's
            # forward may read them, hundred-and-fifth hostile review: 4.0 C)
            with frozen_bn_buffers(model), Isolated(model) as iso:
                guard.gens = iso.gens  # (reseeded after each random draw on the unit's values)
                loss_vec, gs = guard.run(inputs[j], targets[j], one_unit)
            for n, g in zip(names, gs):
                per_unit[n].append(torch.zeros_like(params[n]) if g is None else g.detach())
            losses[j] = float(loss_vec.sum())
    if k:
        reducer.add_chunk({n: torch.stack(v) for n, v in per_unit.items()},
                          losses.to(inputs.device))
    grads, norms, weights, loss_sum = reducer.result()
    return EngineResult(grads=grads, norms=norms, weights=weights, loss_sum=loss_sum,
                        engine_info={"engine": "unit"})


@contextlib.contextmanager
def bn_eval(model: nn.Module, mode: str) -> Iterator[None]:
    """Evaluation context for BatchNorm: ``batch`` statistics (buffers untouched) or ``running``."""
    layers = batchnorm_layers(model)
    if mode == "running" or not layers:
        yield
        return
    if mode != "batch":
        raise ValueError(f"bn_eval: mode must be 'batch' or 'running', got {mode!r}")
    with frozen_bn_buffers(model):
        flags = [(m, m.training) for _, m in layers]
        for m, _ in flags:
            m.train()
        try:
            yield
        finally:
            for m, was in flags:
                m.train(was)


@torch.no_grad()
def recompute_bn_stats(model: nn.Module, inputs: Tensor, chunk: int = 256) -> None:
    """Reset BatchNorm running statistics and recompute them on (public) ``inputs``.

    Cumulative averages (``momentum=None``) over chunks of ``chunk`` examples; other layers see a
    plain forward under ``no_grad``; training flags are restored.
    """
    layers = batchnorm_layers(model)
    if not layers or inputs.shape[0] == 0:
        return
    was = model.training
    saved_momentum = [(m, m.momentum) for _, m in layers]
    for m, _ in saved_momentum:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    try:
        for i in range(0, int(inputs.shape[0]), chunk):
            part = inputs[i : i + chunk]
            if part.shape[0] > 1:
                model(part)
    finally:
        for m, mom in saved_momentum:
            m.momentum = mom
        model.train(was)


def check_batchnorm(model: nn.Module, unit: UnitConfig, *, cli: bool = False) -> None:
    """Refuse BatchNorm under per-example clipping (the one check, for ``make_private`` and
    ``dpclip train``): BatchNorm mixes the examples of a batch, so one example's influence on the
    clipped gradient is not bounded. ``cli``: name the command-line flags in the fix."""
    bn = batchnorm_layers(model)
    if not (unit.is_individual and bn):
        return
    fix = ("--unit bc (or --unit gbc --miniset-size S with --sampling fixed-size); registry "
           "models: lenet5, or --model-option norm=gn for resnet18") if cli else \
        "unit='bc' (or unit='gbc' with miniset_size=S and sampling='fixed-size')"
    raise ValueError(
        f"the model has BatchNorm layer {bn[0][0]!r}: BatchNorm mixes the examples of a batch, "
        "so per-example clipping (unit=ic) cannot bound one example's influence. Use GroupNorm "
        f"or LayerNorm instead, or batch clipping (unit=bc): {fix}")


def check_instance_norm_stats(model: nn.Module, unit: UnitConfig) -> None:
    """Refuse an InstanceNorm with ``track_running_stats=True`` under per-example clipping: its
    training-mode forward normalises each example by its own statistics (per example) but
    averages them over the batch into ``running_mean`` / ``running_var``, buffers that would
    leave the run unnoised (before, the refusal came later, from the engine's proof, as "the step
    does not run the program that the batch-size proof traced", which named no cause)."""
    if not unit.is_individual:
        return
    found = [n or "<root>" for n, m in model.named_modules()
             if isinstance(m, _InstanceNorm) and m.track_running_stats]
    if found:
        raise ValueError(
            f"the model has InstanceNorm layer {found[0]!r} with track_running_stats=True: in "
            "training mode it averages the batch's instance statistics into its running_mean / "
            "running_var buffers, which would leave the run without noise. Build it with "
            "track_running_stats=False (instance statistics at evaluation too: the default), or "
            "use batch clipping (unit='bc'), under which the unit's statistics are discarded")


def public_fraction_of(unit: UnitConfig, strategy: Any, *, where: str = "") -> float:
    """The share of the training set carved out as PUBLIC data: ``unit.public_fraction``, or
    0.1 when something needs public data (a strategy with public norms, ``bn_stats=public``),
    else 0. Refuses 0 when public data is needed. The one place this is decided."""
    needs = capabilities_of(strategy).public_norms or unit.bn_stats == "public"
    fraction = unit.public_fraction if unit.public_fraction is not None else (
        0.1 if needs else 0.0)
    if needs and fraction <= 0:
        raise ValueError(
            f"{where}strategy {strategy_name(strategy)!r} / bn_stats={unit.bn_stats!r} needs a "
            "public split; set public_fraction=F with F > 0 (default 0.1; CLI "
            "--public-fraction F)")
    return fraction


def check_unit_sampling(unit: UnitConfig, sampling: str) -> None:
    """Refuse the unit/sampling pairs whose accounting dpclip cannot certify (module docstring)."""
    if unit.unit == "gbc" and sampling != "fixed-size":
        raise ValueError(
            "unit=gbc needs sampling='fixed-size' (CLI --sampling fixed-size): a Poisson draw of whole mini-sets changes a "
            "sampled mini-set's content when one example changes (a substitution), which the "
            "Poisson accountants (add/remove-one) do not cover. Use sampling='fixed-size' "
            "(Nguyen's argument), or unit=bc with Poisson sampling."
        )


def expected_units(unit: UnitConfig, sampler: Any) -> float:
    """The public number of clipped units per step (the step's divisor)."""
    if unit.unit == "ic":
        return float(sampler.expected_batch_size)
    if unit.unit == "bc":
        return 1.0
    return float(sampler.expected_units)


def public_unit_norms(
    model: nn.Module,
    loss_fn: LossFn,
    inputs: Tensor,
    targets: Tensor,
    groups: ParamGroups,
    unit: UnitConfig,
    unit_size: int,
    chunk: int = 256,
) -> Tensor:
    """Per-unit (per-group) gradient norms on PUBLIC data at the current weights.

    IC: per-example norms (vmap engine, chunks of ``chunk``); BC/GBC: norms of the mean gradients
    of consecutive public mini-sets of ``unit_size`` examples (the unit the run clips). BatchNorm
    buffers are restored. Used by adaptive layerwise clipping; no privacy cost (public data and
    released weights).
    """
    zero = lambda n: torch.zeros_like(n)  # noqa: E731 - weights are irrelevant here
    if unit.is_individual:
        from dpclip.engine.vmap import VmapEngine

        engine = VmapEngine(max_physical_batch=chunk)
        res = engine.compute(model, loss_fn, inputs, targets, zero, groups)
        norms = res.norms
    else:
        s = max(1, int(unit_size))
        n_units = int(inputs.shape[0]) // s
        if n_units == 0:
            raise ValueError(
                f"the public split has {int(inputs.shape[0])} examples, fewer than one unit of "
                f"{s}; raise public_fraction or lower the batch/miniset size"
            )
        x = inputs[: n_units * s].reshape(n_units, s, *inputs.shape[1:])
        y = targets[: n_units * s].reshape(n_units, s)
        norms = unit_sum(model, loss_fn, x, y, zero, groups).norms
    assert norms is not None
    return norms if norms.dim() == 2 else norms[:, None]
