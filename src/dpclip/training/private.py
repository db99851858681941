"""Private training in your own loop: :class:`PrivateTraining` (``dpclip.make_private``).

Bring your model, optimizer and data; get back Poisson batches and a ``backward`` that puts the
clipped, noised gradient in ``p.grad``. Every private release is recorded in the ledger, and
``epsilon()`` can be read at any time::

    dp = dpclip.make_private(model, optimizer, (x_train, y_train), strategy="quantile",
                             epsilon=3.0, epochs=10, batch_size=256)
    for epoch in range(dp.epochs):
        for x, y in dp.loader:          # Poisson batches drawn with secret randomness
            optimizer.zero_grad()
            dp.backward(x, y)           # replaces loss = criterion(model(x), y); loss.backward()
            optimizer.step()
        print(epoch, dp.epsilon())

This is the same step and ledger that ``dpclip train`` uses (``dpclip.training.trainer.train`` drives
this class): ``dpclip.training.step.dp_step`` computes the privatized gradient, the sampler names the
event, and the ledger checks every step against the plan made before training. The plan is public:
the strategy's events per step, the sampler and the number of steps. The noise multiplier is
calibrated from that plan to the target epsilon. The budget stops the loader, and ``backward``
raises :class:`BudgetExhausted` before a release that would exceed the epsilon cap.

Privacy contract:

* Batches must come from ``dp.loader``, which draws them with :class:`~dpclip.randomness.
  PrivateRandomness`. ``backward`` refuses any other batch, because the accountant assumes the
  sampler's subsampling. Each yielded batch may be released once.
* Inputs and targets are tensors, or tuples/dicts of tensors with one row per example in every
  tensor; the model is called as ``model(x)``, ``model(*inputs)`` or ``model(**inputs)``
  (:mod:`dpclip.engine.batch`).
* ``loss_fn(outputs, targets)`` must return one loss per example (shape ``(B,)``): for example
  ``nn.CrossEntropyLoss(reduction="none")``, a masked token loss summed per sequence, or a
  regression loss reduced over all but the batch dimension.
* The model must be per-example separable (no BatchNorm in training mode with per-example
  clipping). The ``auto`` engine proves separability and falls back to ``vmap`` where it cannot;
  the engine that ran is in ``engine_info``.
* ``state_dict()`` holds the secret randomness state: store it like the data (docs/privacy.md).
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
import sys
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from dpclip import blas_mode
from dpclip._checks import library_object
from dpclip.engine.conv_backends import engine_thread_count
from dpclip._ident import ident
from dpclip.accounting import Ledger
from dpclip.accounting import epsilon as ledger_epsilon
from dpclip.accounting.accountants import refuse_unsupported
from dpclip.clipping import ClippingStrategy, make_strategy
from dpclip.clipping.capabilities import capabilities_of, strategy_name
from dpclip.training.distributed import (
    ShardedSampler,
    assert_synchronized,
    broadcast_module,
    broadcast_tensor_,
    check_randomness,
    check_same,
    data_digest,
    resolve_distributed,
    shared_randomness,
)
from dpclip.training.averaging import WeightAverager, parse_averaging
from dpclip.data.augment import parse_augment
from dpclip.devices import data_fits_on_device, resolve_device
from dpclip.engine import ENGINES, ParamGroups, get_engine
from dpclip.engine.batch import check_batch, map_batch
from dpclip.engine.errors import UnsupportedModelError
from dpclip.engine.generators import seed_source
from dpclip.engine.isolation import check_structure, signals_deferred
from dpclip.engine.known_losses import cross_entropy_per_example
from dpclip.events import GaussianEvent
from dpclip.inputs import check_class_targets, convert_arrays
from dpclip.training.loop_guard import LoopGuard
from dpclip.training.multiplicity import KCopyModel, check_multiplicity, expand_copies, k_copy_loss, \
    parse_multiplicity
from dpclip.training.plan import API_FLAGS, NOISE_MATCH_RTOL, Plan as _Plan, budget_steps, resolve_noise
from dpclip.randomness import PrivateRandomness
from dpclip.training.noise_shard import ShardNoiseEngine
from dpclip.training.preprocess import PreprocessRelease
from dpclip.training.sampling import make_sampler
from dpclip.training.step import StepOutput, dp_step, private_buffer_guard
from dpclip.training.units import (
    MiniSetSampler,
    UnitConfig,
    check_batchnorm,
    check_instance_norm_stats,
    check_unit_sampling,
    expected_units,
    public_unit_norms,
    resolve_unit,
)
from dpclip.errors import EngineFallbackWarning

__all__ = ["BudgetExhausted", "PrivateTraining", "default_delta", "make_private",
           "public_reason"]

ENGINE_NAMES = tuple(ENGINES)  # the engine registry's names (one list: dpclip.engine.ENGINES)


def public_reason(reason: str) -> str:
    """An engine's fallback reason without the shapes and sizes it quotes: a shape's first
    dimension is the realised (private) batch size, so only the words may be published."""
    reason = re.sub(r"\(\s*\d+(?:\s*,\s*\d+)*\s*,?\s*\)", "(...)", reason)
    reason = re.sub(r"\[\s*(?:\(\.\.\.\)|None)(?:\s*,\s*(?:\(\.\.\.\)|None))*\s*\]", "[...]",
                    reason)
    return re.sub(r"\b(batch|chunk) of \d+", r"\1 of B", reason)


def _warn_fallback(requested: str, ran: str, reason: str) -> None:
    import warnings

    warnings.warn(EngineFallbackWarning(
        f"engine {requested!r} ran on {ran!r}: {reason} (recorded in engine_info; "
        "dpclip.check_model(model) lists such layers and what they cost)"), stacklevel=3)


class BudgetExhausted(RuntimeError):
    """The next private release would take the ledger past the epsilon cap."""


def default_delta(n: int) -> float:
    """A conventional delta well below ``1/n``: 1e-5, or the power of ten below ``1 / (10 n)``."""
    if n < 1:
        raise ValueError(f"default_delta: n must be >= 1, got {n}")
    if 1e-5 < 0.1 / n:
        return 1e-5
    return 10.0 ** math.floor(math.log10(0.1 / n))


def _as_tensors(data: Any) -> tuple[Any, Any, int]:
    """``(inputs, targets, n)`` from a pair ``(inputs, targets)`` of tensors or of tuples/dicts of
    tensors (one row per example in every leaf), a TensorDataset, a map-style Dataset or a
    DataLoader (its dataset; its own sampler and batch size are replaced by dpclip's)."""
    from torch.utils.data import DataLoader, Dataset, TensorDataset

    if isinstance(data, DataLoader):
        data = data.dataset
    if isinstance(data, TensorDataset) and len(data.tensors) == 2:
        data = tuple(data.tensors)
    if isinstance(data, (tuple, list)) and len(data) == 2 and not isinstance(data, Dataset):
        x, y = data
        try:
            n = check_batch(x, y, "make_private")
        except ValueError as exc:
            raise ValueError(
                f"{exc}. make_private: pass (inputs, targets): tensors, or tuples/dicts of "
                "tensors, with one row per training example in every tensor") from None
        return x, y, n
    if isinstance(data, Dataset) and hasattr(data, "__len__"):
        return data, None, len(data)  # type: ignore[arg-type]
    raise TypeError(
        "make_private: data must be (inputs, targets) (tensors, or tuples/dicts of tensors), a "
        "TensorDataset, a map-style Dataset with __len__ returning (input, target) pairs (the "
        f"input may be a tuple or dict of tensors), or a DataLoader; got {type(data).__name__}"
    )


def bind_clipping_groups(strategy: Any, model: nn.Module) -> tuple[Any, ParamGroups]:
    """The strategy's clipping groups on ``model`` (one flat group, or the groups its
    ``grouping`` names) and the strategy bound to them (a per-group strategy learns ``L``, the
    model's number of groups). Public: the model's structure only."""
    if not capabilities_of(strategy).per_group:
        return strategy, ParamGroups.flat(model)
    groups = ParamGroups.from_spec(model, strategy.grouping)
    return strategy.bind_groups(groups.names), groups


def _same_batch(given: Any, drawn: Any) -> bool:
    """Whether ``given`` holds exactly the tensor objects of the drawn batch, in its structure
    (a tuple or dict unpacked and packed again in the loop is the same batch; a copy is not)."""
    if given is drawn:
        return True
    if isinstance(given, Tensor) or isinstance(drawn, Tensor):
        return False
    a, spec_a = pytree.tree_flatten(given)
    b, spec_b = pytree.tree_flatten(drawn)
    return spec_a == spec_b and all(x is y for x, y in zip(a, b))


def _check_arguments(epsilon: float | None, noise_multiplier: float | None,
                     epochs: int | None, steps: int | None, engine: str) -> None:
    """The arguments ``make_private`` needs before anything is built."""
    if epsilon is None and noise_multiplier is None:
        raise ValueError("make_private: give a target epsilon (epsilon=) or a noise "
                         "multiplier (noise_multiplier=)")
    if (epochs is None) == (steps is None):
        raise ValueError("make_private: give exactly one of epochs= and steps= (the planned "
                         "length of training, which the noise is calibrated for)")
    ENGINES.lookup(engine, "make_private: ")


def resolve_delta(delta: float | None, n: int, *, where: str, verbose: bool, flag: str,
                  detail: str = "") -> float:
    """The run's delta: the given one, or :func:`default_delta` (said on stderr when
    ``verbose``); refused outside ``(0, 1)`` or at ``>= 1/N`` (N private training examples), where
    a mechanism that publishes one random record in the clear meets the guarantee. The one check
    of delta for ``make_private`` and ``dpclip train``. ``detail``: what N counts."""
    if delta is None:
        value = default_delta(n)
        if verbose:
            how = flag if flag.startswith("--") else f"pass {flag}"
            print(f"dpclip: delta = {value:g} (below 1/N = 1/{n}; {how} to choose)",
                  file=sys.stderr)
        return value
    value = float(delta)
    prefix = f"{where}: " if where else ""
    if not (0 < value < 1):
        raise ValueError(f"{prefix}delta must be in (0, 1), got {value}")
    if value >= 1.0 / n:
        raise ValueError(
            f"{prefix}delta={value:g} ({flag}) is >= 1/N = 1/{n}{detail}: a mechanism that "
            "publishes one random record in the clear meets this delta, so the guarantee would "
            f"mean nothing; use delta < 1/N, e.g. {default_delta(n):g}")
    return value


def _check_distributable(strategy: Any, unit: UnitConfig) -> None:
    """Refuse what the distributed step cannot reproduce exactly (``dpclip.training.
    distributed``); before any collective, so every rank fails alike."""
    name = strategy_name(strategy)
    if capabilities_of(strategy).per_example_grads:
        raise ValueError(
            f"distributed: strategy {name!r} clips transformed per-example gradients (P-GRAD) "
            "outside the engine, which the distributed step does not all-reduce; train it in one "
            "process (distributed=False), or use a norm-based strategy")
    if not unit.is_individual:
        raise ValueError(
            f"distributed: unit={unit.unit} clips each unit's mean gradient outside the engine, "
            "which the distributed step does not all-reduce; use unit=ic, or train batch "
            "clipping in one process (distributed=False)")


class PrivateTraining:
    """DP-SGD around a user's model and optimizer (see the module docstring; build it with
    :func:`make_private`).

    Attributes (public): ``strategy``, ``engine``, ``sampler``, ``unit``, ``noise_multiplier``,
    ``total_steps`` (planned), ``max_steps`` (within the epsilon cap), ``steps`` (done),
    ``steps_per_epoch``, ``epochs``, ``ledger``, ``delta``, ``accountant``, ``engine_info``,
    ``distributed`` (the :class:`~dpclip.training.distributed.DistributedContext`, or ``None``).

    ``distributed=True`` (or a ``DistributedContext``) trains ONE private run across the ranks of
    a ``torch.distributed`` group (docs/distributed.md): the secret generators are agreed once
    (rank 0's, broadcast), every rank draws the same global batch and keeps its shard, adds the
    noise of its own block of coordinates to its clipped sum (its own stream), and the sums are
    all-reduced: one draw per coordinate (:mod:`dpclip.training.noise_shard`); ``loader`` yields
    this rank's shard,
    ``sampler`` is a :class:`~dpclip.training.distributed.ShardedSampler` (its public properties are the
    global ones), and the ledger on every rank equals the one-process ledger. Only rank 0 should
    write results and checkpoints (``is_main_process``); every rank loads the same checkpoint.

    ``augment`` (``"crop:4,flip"``, an :class:`~dpclip.data.augment.Augmentation`, or ``None``)
    augments every sampled image on its own, after the secret subsampling, with parameters drawn
    from the secret sampling generator (:mod:`dpclip.data.augment`: the sensitivity is unchanged);
    ``sample`` and ``loader`` yield the augmented batch.

    ``preprocess`` (``None``, or a pending release such as
    :class:`~dpclip.data.private_centre.PrivateCentre`, :mod:`dpclip.training.preprocess`): a
    statistic of the private training inputs released before the first step (noise from the
    secret noise generator), applied to them, recorded first in the ledger and counted by the
    calibration; ``preprocess.apply(x)`` transforms other inputs (test) with the same release.

    ``device`` (``None``, ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:N"``; :mod:`dpclip.devices`)
    is where batches are delivered; ``None`` leaves the data where it is. The secret generators
    live on ``device``, or on the model's device when it is ``None`` (CUDA: Philox keyed from
    ``os.urandom``, :mod:`dpclip.randomness`), so masks, augmentation parameters and noise are
    drawn where the gradient is. ``data_on_device`` (``"auto"``, True, False): copy the training
    tensors to ``device`` once (``"auto"``: when they take at most half of its free memory), so
    no step moves a batch across PCIe; otherwise each drawn batch is copied.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        data: Any,
        *,
        loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
        strategy: str | ClippingStrategy = "fixed",
        strategy_params: Mapping[str, Any] | None = None,
        unit: str | UnitConfig | None = None,
        miniset_size: int | None = None,
        epsilon: float | None = None,
        noise_multiplier: float | None = None,
        delta: float | None = None,
        epochs: int | None = None,
        steps: int | None = None,
        batch_size: float | None = 256,
        sampling: str = "poisson",
        accountant: str = "pld",
        engine: str = "auto",
        max_physical_batch: int | None = None,
        reproducible_noise: bool = False,
        seed: int = 0,
        public_data: tuple[Tensor, Tensor] | None = None,
        input_shape: Sequence[int] | None = None,
        device: str | torch.device | None = None,
        verbose: bool = True,
        flags: Mapping[str, str] = API_FLAGS,
        distributed: Any = None,
        augment: Any = None,
        data_on_device: bool | str = "auto",
        averaging: Any = None,
        augment_multiplicity: int = 1,
        preprocess: Any = None,
        features: Any = None,
    ) -> None:
        # the steps of Opacus' make_private, in order: arguments, data, privacy, the strategy and
        # its unit, the engine and loss, the sampler, the plan, the randomness, the state
        _check_arguments(epsilon, noise_multiplier, epochs, steps, engine)
        self.model, self.optimizer = model, optimizer
        self._flags = flags  # how messages name the arguments (CLI flags for `dpclip train`)
        n = self._prepare_data(data, verbose, device, data_on_device, augment,
                               augment_multiplicity, averaging)
        _check_model_device(model, self.device, flags.get("device", "device"))
        #: a fixed per-example feature map applied to each drawn batch AFTER its augmentation
        #: (dpclip.data.features.Scattering; `dpclip train` with the dataset option features and
        #: an augmentation), or None
        self.features = self._prepare_features(features)
        self.delta = resolve_delta(delta, n, where="make_private", verbose=verbose,
                                   flag=flags.get("delta", "delta="))
        self.accountant = accountant
        self.epsilon_cap = epsilon
        self.seed = int(seed)
        strategy = self._prepare_strategy(strategy, strategy_params, unit, miniset_size,
                                          sampling, loss_fn)
        # None: the engine's own default (ghost / auto: the whole batch in one pass, as a
        # non-private step; vmap / naive: 256 materialised per-example gradients at a time)
        chunk_kw = {} if max_physical_batch is None else {"max_physical_batch": max_physical_batch}
        strategy = self._prepare_engine(strategy, engine, chunk_kw, loss_fn, input_shape)
        self._prepare_public(public_data)
        self._prepare_sampler(n, batch_size, data, verbose, sampling, accountant, distributed)
        #: the private preprocessing release (training.preprocess), made before the first step
        self.preprocess = PreprocessRelease(
            preprocess, inputs=self._x, sampling=sampling,
            distributed=self.distributed is not None) if preprocess is not None else None
        self._prepare_plan(steps, epochs)
        run_config = (
            strategy_name(self.strategy), self.strategy.describe(), self.unit.describe(),
            self.sampler.name, n, float(self._batch_size), self.total_steps, epsilon,
            noise_multiplier, self.delta, accountant, engine, self.seed)
        self._prepare_randomness(reproducible_noise, run_config)
        #: PRIVATE checkpoint field: what defines the released function besides the data and the
        #: model's code (strategy and its parameters, unit, sampler, plan, engine, augmentation,
        #: multiplicity, features, preprocessing, the loss's name; not the weight averaging, which
        #: is post-processing and checked on its own): a resume with
        #: other settings would continue the same noise on another function (eleventh hostile
        #: review: a resume at another clip norm released S_2 - 2 S_1 without noise)
        self._settings_fp = hashlib.sha256(re.sub(r" at 0x[0-9a-fA-F]+", "", repr((
            run_config, repr(augment), int(augment_multiplicity),
            repr(features), repr(preprocess), reproducible_noise,
            getattr(loss_fn, "__qualname__", type(loss_fn).__qualname__),
            _function_fingerprint(model, loss_fn)))).encode()).hexdigest()
        self._prepare_state(engine, noise_multiplier)
        if self.preprocess is not None:  # every input checked: the release, first in the ledger
            for event in self.preprocess.events:
                self.ledger.record(event)
            self._x = self.preprocess.make(self.rng.noise)

    # ------------------------------------------------------------------ construction steps

    def _prepare_data(self, data: Any, verbose: bool, device: Any, data_on_device: bool | str,
                      augment: Any, augment_multiplicity: int, averaging: Any) -> int:
        """The training data as tensors on their device, the augmentation, its multiplicity and
        the weight averaging; returns the number of training examples N."""
        flags = self._flags
        self._x, self._y, n = _as_tensors(convert_arrays(data, self.model, verbose))
        if n < 1:
            raise ValueError("make_private: the training data has no examples")
        #: per-example augmentation after sampling (dpclip.data.augment), or None
        aug_flag = flags.get("augment", "augment=")
        self.augment = parse_augment(augment, aug_flag)
        if self.augment is not None:
            if isinstance(self._x, Tensor):
                self.augment.check_example_shape(self._x.shape[1:], aug_flag)
            elif self._y is not None:  # tuples / dicts of tensors (a Dataset is checked per batch)
                raise ValueError(
                    f"{aug_flag}: augmentation {self.augment.spec!r} needs the inputs to be one "
                    f"tensor of images, got {type(self._x).__name__}; set it to None and augment "
                    "inside your model")
        #: augmentation multiplicity K and weight averaging (training.multiplicity, .averaging)
        self.multiplicity = parse_multiplicity(
            augment_multiplicity, flags.get("augment_multiplicity", "augment_multiplicity"))
        self.averaging = parse_averaging(averaging, flags.get("averaging", "averaging="))
        # None: the data stay where they are and the generators go to the model's device
        self.device = resolve_device(device, flags.get("device", "device")) \
            if device is not None else None
        self._x, self._y = _place_data(self._x, self._y, self.device, data_on_device)
        return n

    def _prepare_strategy(self, strategy: Any, strategy_params: Mapping[str, Any] | None,
                          unit: Any, miniset_size: int | None, sampling: str,
                          loss_fn: Any) -> Any:
        """The clipping unit (its own argument; the old spelling inside ``strategy_params`` is
        read with a deprecation note) and the strategy, built once from its name."""
        given = unit.settings() if isinstance(unit, UnitConfig) else \
            {"unit": unit if unit is not None else "ic", "miniset_size": miniset_size}
        if isinstance(unit, UnitConfig) and miniset_size is not None:
            raise ValueError("make_private: miniset_size= is part of the UnitConfig given as "
                             "unit=; set it there")
        self.unit, params = resolve_unit(given, strategy_params, where="make_private")
        check_unit_sampling(self.unit, sampling)
        if isinstance(strategy, str):
            strategy = make_strategy(strategy, params)
        elif params:
            raise ValueError("make_private: strategy_params are for a strategy given by name; "
                             "configure a strategy instance directly")
        self.bound_based = capabilities_of(strategy).bound_based
        # dpclip's helper: the ghost engine proves it separable without tracing it every step
        self.loss_fn = loss_fn if loss_fn is not None else cross_entropy_per_example
        if loss_fn is None and not self.bound_based:
            check_class_targets(self.model, self._x, self._y, self.device)  # before any step
        return strategy

    def _prepare_engine(self, strategy: Any, engine: str, chunk_kw: dict[str, Any],
                        loss_fn: Any, input_shape: Sequence[int] | None) -> Any:
        """The engine, the bound-based strategy's certified loss, the clipping groups, and the
        refusal of BatchNorm under per-example clipping; sets ``self.strategy``."""
        self.engine = get_engine(engine, **chunk_kw) if engine != "summed" else get_engine(engine)
        if self.bound_based:  # Lip-DP-SGD: certified loss; "auto" = one plain backward
            name = strategy_name(strategy)
            if input_shape is None:
                raise ValueError(f"strategy {name!r} certifies sensitivity from the model: pass "
                                 "input_shape= (one example)")
            if loss_fn is not None:
                raise ValueError(f"strategy {name!r} certifies its own Lipschitz loss; do not "
                                 "pass loss_fn=")
            strategy = strategy.bind(self.model, tuple(input_shape))
            self.loss_fn = strategy.loss()
            if engine == "auto":
                self.engine = get_engine("summed", **chunk_kw)
            if not self.unit.is_individual:
                raise ValueError(f"strategy {name!r} certifies per-example sensitivity from the "
                                 "weights; it runs with unit=ic only")
        self.strategy, self.groups = bind_clipping_groups(strategy, self.model)
        self.input_shape = tuple(input_shape) if input_shape is not None else None
        check_batchnorm(self.model, self.unit,
                        cli=self._flags.get("batch_size", "").startswith("--"))
        check_instance_norm_stats(self.model, self.unit)
        return self.strategy

    def _prepare_public(self, public_data: tuple[Tensor, Tensor] | None) -> None:
        self.public_data = public_data
        if capabilities_of(self.strategy).public_norms and public_data is None:
            raise ValueError(f"strategy {strategy_name(self.strategy)!r} estimates its "
                             "thresholds on public data: pass public_data=(inputs, targets)")

    def _prepare_sampler(self, n: int, batch_size: float | None, data: Any, verbose: bool,
                         sampling: str, accountant: str, distributed: Any) -> None:
        """The sampler of examples (or mini-sets), sharded across ranks when distributed."""
        if batch_size is None:  # make_private without batch_size=: the DataLoader's, or an error
            batch_size = _loader_batch_size(data, verbose)
        elif verbose:
            _say_loader_batch_size_unused(data, batch_size)
        self._batch_size = batch_size
        unit = self.unit
        if unit.unit == "gbc":
            s_size = int(unit.miniset_size or 1)
            if float(batch_size) != int(batch_size) or int(batch_size) % s_size:
                raise ValueError(
                    f"unit=gbc: batch_size ({batch_size}) must be a multiple of miniset_size "
                    f"({s_size}): each step draws batch_size / miniset_size whole mini-sets"
                )
            self.sampler: Any = MiniSetSampler(n, s_size, int(batch_size) // s_size,
                                               partition_seed=self.seed)
        else:
            self.sampler = make_sampler(sampling, n, batch_size)
        # distributed (training.distributed): every rank draws the GLOBAL batch, keeps its shard
        self.distributed = resolve_distributed(distributed)
        if self.distributed is not None:
            # the accountant is checked before any collective, so every rank fails alike
            refuse_unsupported(self.sampler.step_event(GaussianEvent(1.0)), accountant)
            _check_distributable(self.strategy, unit)
            self.sampler = ShardedSampler(self.sampler, self.distributed)
        self.unit_size = int(unit.miniset_size or 1) if unit.unit == "gbc" else (
            int(round(self.sampler.expected_batch_size)) if unit.unit == "bc" else 1)

    def _prepare_plan(self, steps: int | None, epochs: int | None) -> None:
        """The planned length of training and the plan of events (public)."""
        self.steps_per_epoch = int(self.sampler.steps_per_epoch)
        if steps is not None:
            if not (isinstance(steps, int) and steps >= 1):
                raise ValueError(f"make_private: steps must be an int >= 1, got {steps!r}")
            self.total_steps = steps
        else:
            if not (isinstance(epochs, int) and epochs >= 1):
                raise ValueError(f"make_private: epochs must be an int >= 1, got {epochs!r}")
            self.total_steps = epochs * self.steps_per_epoch
        self.epochs = math.ceil(self.total_steps / self.steps_per_epoch)
        self._plan = _Plan(self.strategy, self.sampler, self.total_steps,
                           expected_units(self.unit, self.sampler),
                           prior_events=self.preprocess.events if self.preprocess else ())

    def _prepare_randomness(self, reproducible_noise: bool, run_config: tuple[Any, ...]) -> None:
        """The secret generators (on the gradient's device: CUDA Philox keyed from os.urandom);
        distributed: one secret, one model, one plan and the same data digest on every rank."""
        self.rng = PrivateRandomness.for_run(reproducible_noise, self.seed,
                                             device=self.device or _model_device(self.model))
        #: the engine dp_step runs: ``engine``, or its all-reducing wrapper when distributed
        self._step_engine: Any = self.engine
        if self.distributed is not None:
            check_same(self.distributed, repr(run_config), "the run's configuration")
            # the data each rank holds (docs/distributed.md): a digest, compared across ranks
            check_same(self.distributed, data_digest(self._x, self._y), "the training data")
            shared_randomness(self.rng, self.distributed)
            broadcast_module(self.model, self.distributed)
            # local clipped sums; each rank noises its own coordinates (training.noise_shard)
            self._step_engine = ShardNoiseEngine(self.engine, self.distributed, self.rng)

    def _prepare_state(self, engine: str, noise_multiplier: float | None) -> None:
        """The ledger, the strategy state, the loop guard and the noise multiplier (given, or
        calibrated to the epsilon target), checked against the strategy and the accountant."""
        self.ledger = Ledger()
        self._epsilon_memo: tuple[Any, float] | None = None
        self.state = self.strategy.init_state()
        self.steps = 0
        self.engines_ran: set[str] = set()
        #: NON-PRIVATE: the ghost engine's steps on the proved graph (engine_info["program"]). Not
        #: a public fact: an empty batch runs no program and a graph is adopted on the first
        #: non-empty step, so the count is the number of non-empty batches less one (seventy-
        #: seventh hostile review: it told D from D' without one record at noise multiplier 50);
        #: never in describe(), kept in the private checkpoint
        self.compiled_steps = 0
        self.fallbacks: set[str] = set()
        #: modules that took the ghost engine's per-layer path (public: module names)
        self.per_layer: set[str] = set()
        self._setup_multiplicity_and_averaging(engine)
        self.noise_multiplier = self._resolve_noise(noise_multiplier)
        # the strategy must accept the noise, the accountant the events (clear errors, up front)
        ledger_epsilon(self._plan.ledger(self.noise_multiplier, steps=1), self.delta,
                       accountant=self.accountant)
        self.max_steps = self._budget_steps()
        self._pending: tuple[Any, Any] | None = None
        #: the loop rules (training.loop_guard): every draw released once, unchanged, and only
        #: released gradients applied by the optimizer
        self.loop_guard = LoopGuard(self.optimizer)
        self._post_step_due = self.bound_based  # ClipWeights(theta_0): data-free initial weights
        self.last_output: StepOutput | None = None
        #: the batch of the last release, let go at the next one inside its check (_let_go): the
        #: loss may see the drawn tensors themselves, and a finalizer it attached to their storage
        #: ran when the loop dropped them, after every check (hundred-and-thirtieth hostile
        #: review: the trained weights 6000-18000 apart on neighbouring datasets)
        self._held: Any = None

    # ----------------------------------------------------------------------------- planning

    def _resolve_noise(self, noise_multiplier: float | None) -> float:
        if noise_multiplier is not None and not (math.isfinite(noise_multiplier)
                                                 and noise_multiplier >= 0):
            raise ValueError(f"make_private: noise_multiplier must be >= 0, got "
                             f"{noise_multiplier}")
        return resolve_noise(self._plan, epsilon=self.epsilon_cap,
                             noise_multiplier=noise_multiplier, delta=self.delta,
                             accountant=self.accountant, flags=self._flags)

    def _budget_steps(self) -> int:
        """Largest number of planned steps whose epsilon stays within the cap."""
        return budget_steps(self._plan, self.noise_multiplier, epsilon=self.epsilon_cap,
                            delta=self.delta, accountant=self.accountant, flags=self._flags)

    def planned_epsilon(self, steps: int | None = None) -> float:
        """Epsilon of the plan after ``steps`` steps (default: all planned steps)."""
        return ledger_epsilon(self._plan.ledger(self.noise_multiplier, steps), self.delta,
                              accountant=self.accountant)

    # ----------------------------------------------------------------------------- batches

    @property
    def exhausted(self) -> bool:
        """True when no further step fits the plan or the epsilon cap."""
        return self.steps >= min(self.max_steps, self.total_steps)

    @property
    def stopped_by_budget(self) -> bool:
        return self.max_steps < self.total_steps and self.steps >= self.max_steps

    def _gather(self, idx: Tensor) -> tuple[Any, Any]:
        if self._y is not None:
            # the indices live on the generator's device; data kept elsewhere (on the host when
            # it does not fit the GPU) is indexed there and the batch copied below
            if isinstance(self._x, Tensor) and isinstance(self._y, Tensor):
                x, y = self._x[idx.to(self._x.device)], self._y[idx.to(self._y.device)]
            else:  # tuples / dicts of tensors: the same rows of every leaf
                x, y = (map_batch(lambda t: t[idx.to(t.device)], self._x),
                        map_batch(lambda t: t[idx.to(t.device)], self._y))
        else:  # a map-style Dataset: collate the examples (the shapes of one example are public)
            from torch.utils.data import default_collate

            flat = idx.reshape(-1).tolist()
            if flat:
                x, y = default_collate([self._x[i] for i in flat])
            else:
                x0, y0 = default_collate([self._x[0]])
                x, y = map_batch(lambda t: t[:0], x0), map_batch(lambda t: t[:0], y0)
            if idx.ndim != 1:  # batch clipping units: (units, examples per unit, ...)
                x = map_batch(lambda t: t.reshape(*idx.shape, *t.shape[1:]), x)
                y = map_batch(lambda t: t.reshape(*idx.shape, *t.shape[1:]), y)
            check_batch(x, y, "make_private")  # every leaf a tensor (collate keeps strings)
        if self.device is not None:  # no-op for data already on the device (data_on_device)
            x, y = map_batch(lambda t: t.to(self.device, non_blocking=True), x), map_batch(
                lambda t: t.to(self.device, non_blocking=True), y)
        return x, y

    def sample(self) -> tuple[Any, Any]:
        """Draw the next private batch (secret randomness). Under batch clipping units the inputs
        are ``(units, examples per unit, ...)``."""
        if self.exhausted:
            raise BudgetExhausted(self._exhausted_message())
        self.loop_guard.on_draw()
        self.rng.before_release()  # CUDA: re-key before a Philox offset could wrap
        idx = self.sampler.sample(self.rng.sampling)
        params = self._draw_augmentation(idx) if self.augment is not None else None
        if self.unit.unit == "bc":  # the whole batch is one unit
            idx = idx.unsqueeze(0)
        try:
            batch = self._gather(idx)
            if self.multiplicity > 1:  # K copies of every example, (B, K, ...)
                batch = (expand_copies(batch[0], self.multiplicity), batch[1])
            if params is not None:
                batch = (self.augment.apply(batch[0], params), batch[1])  # type: ignore[union-attr]
            if self.features is not None:  # the fixed per-example map, after the augmentation
                batch = (self.features.transform_images(batch[0]), batch[1])
        except Exception as exc:  # noqa: BLE001 - an error while forming the drawn batch
            # (a malformed record's collate error quoted its private shape and its position in
            # the secret batch: hundred-and-forty-seventh hostile review; as the step's errors,
            # except dpclip's own checks, whose messages name public facts only)
            scrubbed = None if _raised_by_dpclip(exc) else private_step_error(exc)
            if scrubbed is None:
                raise
            raise scrubbed from None
        self._pending = batch
        self.loop_guard.record_draw(batch)
        return batch

    def _prepare_features(self, features: Any) -> Any:
        """Checks of ``features`` (its text, a :class:`dpclip.data.features.Scattering` or None):
        only the library's tested per-example maps are accepted (an arbitrary callable could mix
        the batch), on one tensor of images."""
        from dpclip.data.features import Scattering, parse_features

        if isinstance(features, str):
            features = parse_features(features, self._flags.get("features", "features="))
        if features is None:
            return None
        if type(features) is not Scattering:  # (not a subclass: its map runs on the whole drawn
            # batch before any engine sees it; one that added the batch sum moved the release by
            # 3.66 C, forty-third hostile review)
            raise TypeError(f"features= must be 'scattering' or a dpclip.data.features.Scattering "
                            f"(a fixed per-example map the library tests), got "
                            f"{type(features).__name__}; put other transforms in the model or "
                            "in the data")
        # (and a fresh copy: a function set on the instance hid transform_images, 20.2 C,
        # hundred-and-thirty-ninth hostile review)
        features = library_object(features, Scattering, "features=")
        if not isinstance(self._x, Tensor):
            raise ValueError("features= needs the training inputs as one tensor of images, got "
                             f"{type(self._x).__name__}")
        features.output_shape(tuple(self._x.shape[1:]))  # refuses non-images, bad sizes
        return features

    def _draw_augmentation(self, idx: Tensor) -> Tensor:
        """The augmentation parameters of the drawn examples, from the SECRET sampling generator.
        Distributed: those of the whole global batch are drawn (the same draws on every rank, so
        the shared generator stays in step) and this rank keeps the rows of its shard."""
        assert self.augment is not None
        if self.distributed is None:  # K copies: K independent draws per example
            return self.augment.draw(int(idx.numel()) * self.multiplicity, self.rng.sampling)
        params = self.augment.draw(int(self.sampler.last_global_batch_size or 0),
                                   self.rng.sampling)
        start, stop = self.sampler.last_shard_bounds
        return params[start:stop]

    @property
    def loader(self) -> Iterator[tuple[Any, Any]]:
        """The batches of the current epoch (fewer when the budget ends it), each drawn fresh."""
        return self._epoch_batches()

    def _epoch_batches(self) -> Iterator[tuple[Any, Any]]:
        end = (self.steps // self.steps_per_epoch + 1) * self.steps_per_epoch
        while self.steps < end and not self.exhausted:
            yield self.sample()

    def _exhausted_message(self) -> str:
        if self.stopped_by_budget:
            return (f"privacy budget exhausted: {self.steps} steps spent epsilon "
                    f"{self.epsilon():.4g}; one more would exceed the cap {self.epsilon_cap:g}")
        return f"all {self.total_steps} planned steps are done"

    # ------------------------------------------------------------------------------- steps

    def backward(self, inputs: Any, targets: Any) -> float:
        """Release one privatized gradient for the batch last drawn from ``loader``/``sample``:
        ``p.grad`` of every trainable parameter becomes the noisy clipped sum divided by the
        expected batch size (the optimizer's ``zero_grad`` is not needed: grads are assigned).
        Records the step's event in the ledger. Returns the NON-PRIVATE mean loss of the batch
        (a diagnostic: do not publish it)."""
        # checked before the batch is taken, so the same batch can be released after the fix
        if self._average_due:
            raise ValueError(
                "backward: averaging is on and the last step was not folded into the average; "
                "call dp.update_average() after each optimizer.step() (dp.step() does both)")
        if self._pending is None or not _same_batch(inputs, self._pending[0]) \
                or not _same_batch(targets, self._pending[1]):
            raise ValueError(
                "backward: the batch must be the one just drawn from dp.loader (or dp.sample()), "
                "passed as drawn and used once: the privacy accounting assumes the sampler's "
                "secret subsampling. Move data to a device with make_private(device=...)"
            )
        self.loop_guard.check_batch()
        self.loop_guard.let_go_of_batch()  # (nothing of dpclip's holds the batch in the step)
        self._pending = None
        before = self.steps
        try:
            loss = self._release(inputs, targets)
        except BaseException:
            if self.steps == before:  # (an error after the release was accounted: released)
                self.loop_guard.on_failed_release()
            raise
        return loss

    def _release(self, inputs: Any, targets: Any) -> float:
        """The body of :meth:`backward`, once the batch is checked."""
        if self.exhausted:
            raise BudgetExhausted(self._exhausted_message())
        step = self.steps
        if self._post_step_due:  # weight clipping of the released weights (bound-based)
            self.strategy.post_step(self.model, self.state, input_shape=self.input_shape)
            self._post_step_due = False
        if step % self.steps_per_epoch == 0 and capabilities_of(self.strategy).public_norms:
            x_pub, y_pub = self.public_data  # type: ignore[misc]
            with private_buffer_guard(self.model, "public norms"):
                norms = public_unit_norms(self.model, self.loss_fn, x_pub, y_pub, self.groups,
                                          self.unit, self.unit_size,
                                          chunk=getattr(self.engine, "max_physical_batch", None)
                                          or 256)
            if self.distributed is not None:  # the same public thresholds on every rank
                norms = norms.contiguous()
                broadcast_tensor_(norms, self.distributed)
            self.state = self.strategy.public_refresh(self.state, norms)
        z = self.noise_multiplier
        ctx = self._plan.ctx(step, z)
        # from the step to its accounting in one region without Python signal handlers (a
        # Ctrl-C lands after it), the release accounted before anything of it is handed out, and
        # nothing between that can raise (a warning turned into an error by the user's filter,
        # raised by the fallback notice between the step and the ledger's record, left a noisy
        # release in _release's frame, reachable from the traceback and never counted: ninety-
        # first hostile review)
        # the gradient slots as the step starts (the forward and loss may not fill them:
        # _check_grad_slots)
        slots = [(p, p.grad) for p in self.model.parameters()]
        # (the step's chunk seeds: an object holding the model key alone, never the randomness
        # object whose noise generator a forward could read, hundred-and-seventy-third review)
        seeds = self.rng.step_seeds(step)
        with signals_deferred():
            try:
                # the model's own randomness (dropout) from the run's private key, never from
                # the public default generator (dpclip.engine.generators.seed_source)
                with seed_source(seeds):
                    out = dp_step(
                        self._step_model(), inputs, targets, loss_fn=self._step_loss,
                        strategy=self.strategy, state=self.state, engine=self._step_engine,
                        groups=self.groups, sampler=self.sampler, base_noise_multiplier=z,
                        ctx=ctx, generator=self._noise_generator(step),
                        unit=self.unit,
                    )
            except UnsupportedModelError as exc:  # a transformers model: the recipe, not 1,300
                from dpclip.hf import with_hf_recipe  # chars

                short = with_hf_recipe(exc, self.model)
                if short is None:
                    raise
                raise short from exc
            except Exception as exc:  # noqa: BLE001 - any other error of the private step
                scrubbed = private_step_error(exc)
                if scrubbed is None:
                    raise
                raise scrubbed from None
            try:
                _check_grad_slots(slots)
                self._plan.check_emitted(ctx, z, out.event)  # a privacy bug otherwise: refused
            except BaseException:
                out = None  # (nothing of a refused release stays in this frame)
                raise
            self.ledger.record(out.event)
            self.steps += 1
            # the previous gradients, output, batch and strategy state, let go below where a
            # check follows (their finalizers are user code: nothing is dropped before; the
            # strategy state replaced here was, and an object the loss had put in it wrote the
            # weights: 1000 apart, hundred-and-thirty-second hostile review)
            old: list[Any] = [self.last_output, slots, self._held, self.state]
            slots = []
            self.state = out.state
            params = out.params  # the parameters the engine differentiated, found in this call
            if params is None:
                params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
            self._held = (inputs, targets)
            self.last_output = out
            for name, p in params.items():
                p.grad = out.grads[name]
            self.loop_guard.on_release({name: (p, out.grads[name]) for name, p in params.items()})
            # (the isolation's own generators seeded from the run's private key, as the step's)
            with seed_source(seeds):
                _let_go(old, self.model, [out.grads[n] for n in params], self.optimizer)
        if out.engine_info is not None:
            # public record, from every step: the engine is decided by the requested name or, for
            # auto, on a public probe batch, whatever the step's size (leaving out the steps of
            # fewer than 2 examples made the summary's engine tell whether any batch had 2:
            # eleventh hostile review); the reasons lose every shape (a shape's first dimension
            # is the private realised batch size)
            self.engines_ran.add(str(out.engine_info.get("engine")))
            if out.engine_info.get("program") == "compiled":
                self.compiled_steps += 1
            if out.engine_info.get("fallback"):
                reason = public_reason(str(out.engine_info["fallback"]))
                if reason not in self.fallbacks:  # said once per reason, naming the layers
                    _warn_fallback(self.engine.name, str(out.engine_info.get("engine")), reason)
                self.fallbacks.add(reason)
            self.per_layer.update(out.engine_info.get("per_layer") or ())
        if self.bound_based:
            self._post_step_due = True
        self._average_due = self.averager is not None
        n = max(int(out.batch_size), 1)
        if self.distributed is not None:  # loss_sum is global: divide by the global batch size
            n = max(int(self.sampler.last_global_batch_size or 0), 1)
        return float(out.loss_sum) / n if math.isfinite(out.loss_sum) else math.nan

    def _noise_generator(self, step: int) -> torch.Generator:
        """PRIVATE: the generator of this step's noise: ``rng.noise`` in one process; in a
        distributed run this rank's own stream for ``step`` (training.noise_shard)."""
        shard = getattr(self._step_engine, "noise_shard", None)
        return shard.generator(step) if shard is not None else self.rng.noise

    def step(self, inputs: Any, targets: Any) -> float:
        """``backward`` then ``optimizer.step()``, weight clipping (bound-based strategies) and
        ``optimizer.zero_grad()``. Returns the NON-PRIVATE mean loss."""
        if self.optimizer is None:
            raise ValueError("step: this PrivateTraining has no optimizer; call backward() and "
                             "step your own optimizer")
        loss = self.backward(inputs, targets)
        self.optimizer.step()
        if self.bound_based:
            self.strategy.post_step(self.model, self.state, input_shape=self.input_shape)
            self._post_step_due = False
        if self.averager is not None:
            self.update_average()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    # --------------------------------------------------------------------------- reporting

    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far (the ledger, through dp-accounting). Remembered for the current
        ledger, so asking twice between two steps (history row, summary) accounts once."""
        delta = self.delta if delta is None else delta
        # the ledger only grows (record) or is replaced (load_state_dict, which clears the memo)
        key = (self.ledger.steps, delta, self.accountant)
        memo = self._epsilon_memo
        if memo is not None and memo[0] == key:
            return memo[1]
        value = ledger_epsilon(self.ledger, delta, accountant=self.accountant)
        self._epsilon_memo = (key, value)
        return value

    @property
    def clip_threshold(self) -> float:
        return float(self.strategy.sensitivity(self.state))

    @property
    def engine_info(self) -> dict[str, Any]:
        """The engine(s) that ran, the one requested and every fallback reason (public)."""
        return {"engine": "+".join(sorted(self.engines_ran)) or None,
                "requested": self.engine.name, "fallback": sorted(self.fallbacks) or None}

    def describe(self) -> dict[str, Any]:
        """Public facts for a run summary."""
        return {
            "strategy": strategy_name(self.strategy),
            "params": {**self.strategy.describe(),
                       **({} if self.unit.is_individual else self.unit.describe())},
            "epsilon": self.epsilon(),
            "target_epsilon": self.epsilon_cap,
            "delta": self.delta,
            "accountant": self.accountant,
            "adjacency": self.sampler.adjacency,
            "sampling": self.sampler.name,
            "unit": self.unit.describe(),
            "sensitivity_factor": self.sampler.sensitivity_factor if self.unit.is_individual
            else self.unit.sensitivity_factor,
            "clip_groups": len(self.groups),
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sampler.sample_rate,
            "expected_batch_size": self.sampler.expected_batch_size,
            "steps": self.steps,
            "planned_steps": self.total_steps,
            "stopped_by_budget": self.stopped_by_budget,
            "engine": self.engine_info["engine"] or self.engine.name,
            "engine_requested": self.engine.name,
            "engine_fallback": self.engine_info["fallback"],
            "engine_per_layer": sorted(self.per_layer) or None,
            "cpu_blas_mode": blas_mode.mode(),
            "cpu_kernels": blas_mode.kernels(),
            "engine_threads": engine_thread_count(),
            **self.rng.describe(),
            "distributed": self.distributed.describe() if self.distributed is not None else None,
            "augment": self.augment.spec if self.augment is not None else "none",
            "augment_multiplicity": self.multiplicity,
            "averaging": self.averaging.spec if self.averaging is not None else "none",
            "preprocess_release": self.preprocess.describe() if self.preprocess else None,
        }

    @property
    def is_main_process(self) -> bool:
        """True in one process, and on rank 0 of a distributed run (the rank that writes the
        ledger, results and checkpoints)."""
        return self.distributed is None or self.distributed.is_main

    # -------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Everything to resume (model, optimizer, strategy state, ledger, step, and the PRIVATE
        randomness state: keep it secret). Refused while a drawn batch is unreleased
        (:meth:`LoopGuard.check_checkpoint`)."""
        self.loop_guard.check_checkpoint()
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "strategy_state": self.state,
            "step": self.steps,
            "ledger": self.ledger.to_dict(),
            "randomness": self.rng.state_dict(),
            "noise_multiplier": self.noise_multiplier,
            "engines_ran": sorted(self.engines_ran),
            "engine_compiled_steps": self.compiled_steps,
            "engine_fallbacks": sorted(self.fallbacks),
            "post_step_due": self._post_step_due,
            **({"averaging": self.averager.state_dict()} if self.averager is not None else {}),
            # a DP output (public): a resumed run reuses it, never draws a second one
            **({"preprocess_output": self.preprocess.output} if self.preprocess else {}),
            # PRIVATE (as the randomness): a resume continues the same noise stream, so it must
            # run on the same data (tenth hostile review: the same checkpoint resumed on a
            # neighbouring dataset released the noise-free difference, 0.91 C)
            "data_fingerprint": self._data_fingerprint(),
            "settings_fingerprint": self._settings_fp,
        }

    def _data_fingerprint(self) -> str:
        """SHA-256 of the training data as the steps read it (after any private preprocessing),
        computed once per data object (a map-style dataset is read once, example by example)."""
        key = (ident(self._x), ident(self._y))
        if getattr(self, "_data_fp", None) is None or self._data_fp[0] != key:
            self._data_fp = (key, data_digest(self._x, self._y))
        return self._data_fp[1]

    def load_state_dict(self, ck: Mapping[str, Any]) -> None:
        if self.steps or self.ledger.steps > len(self._plan.prior_events):
            # (thirty-second hostile review: an object that had released 5 steps loaded a
            # 2-step checkpoint; its ledger went back to 2 steps, 23 steps ran, 20 were counted)
            raise RuntimeError(
                f"load_state_dict after {self.steps} private step(s): this object's releases "
                "would leave its privacy ledger. Load a checkpoint into a new PrivateTraining, "
                "before any step")
        finished = bool(ck.get("finished"))  # dpclip.training.checkpoint: no secret state left
        if "randomness" not in ck and not finished:
            raise ValueError("checkpoint has no private randomness state (written by an older "
                             "dpclip?); it cannot be resumed")
        ck_z = float(ck["noise_multiplier"])
        if ck_z != self.noise_multiplier:
            if abs(ck_z - self.noise_multiplier) > NOISE_MATCH_RTOL * self.noise_multiplier:
                raise ValueError(
                    f"checkpoint noise multiplier {ck['noise_multiplier']} differs from this "
                    f"run's {self.noise_multiplier}: the privacy settings changed; resume with "
                    "the same settings")
            # The same calibration made by other numerical libraries (a checkpoint written on a
            # GPU image, resumed here: the last digits differ, 1e-10 relative was seen). Every
            # step keeps the checkpoint's multiplier, the one its ledger holds, and the epsilon
            # cap is re-planned with it: where it is the smaller by round-off and the plan would
            # overspend the cap, the run stops by budget before the step that would.
            self.noise_multiplier = ck_z
            self.max_steps = self._budget_steps()
        if ("preprocess_output" in ck) != (self.preprocess is not None):
            raise ValueError("checkpoint was written " + ("with" if "preprocess_output" in ck
                             else "without") + " a private preprocessing release (the dataset "
                             "option centre='private'); resume with the same dataset options")
        ledger = Ledger.from_dict(ck["ledger"])
        prior = len(self._plan.prior_events)  # the preprocessing release, recorded first
        if ledger.steps != ck["step"] + prior:
            raise RuntimeError(f"corrupt checkpoint: ledger has {ledger.steps} entries, "
                               f"step={ck['step']} (+ {prior} preprocessing release(s))")
        if self.preprocess is not None:
            self._x = self.preprocess.restore(ck["preprocess_output"])
        if not finished and ck.get("settings_fingerprint") != self._settings_fp:
            raise ValueError(
                "checkpoint was written by a run with other settings (strategy or its parameters "
                "such as the clip norm, unit, sampling, steps, epsilon, engine, augmentation, "
                "multiplicity, features, preprocessing, the model's modules or the loss), or by "
                "an older dpclip: "
                "a resumed run continues the checkpoint's secret noise stream, and the same noise "
                "on another function releases the difference without noise. Resume with exactly "
                "the settings it was written with, or start a new run")
        if not finished and ck.get("data_fingerprint") != self._data_fingerprint():
            raise ValueError(
                "checkpoint was written for other training data (or by an older dpclip, without "
                "a data fingerprint): a resumed run continues the checkpoint's secret noise "
                "stream, and the same noise on other data would release the difference of the "
                "two clipped sums without noise. Resume on the exact data it was written with "
                "(same examples, same order), or start a new run")
        self.model.load_state_dict(ck["model"])
        if self.optimizer is not None and ck.get("optimizer") is not None:
            self.optimizer.load_state_dict(ck["optimizer"])
        self.state, self.steps, self.ledger = ck["strategy_state"], int(ck["step"]), ledger
        self._epsilon_memo = None
        if not finished:
            self.rng.load_state_dict(ck["randomness"])
        elif not self.exhausted:
            raise ValueError("checkpoint of a finished run (its secret randomness state was "
                             "removed): it cannot be resumed into more steps; start a new run")
        if self.distributed is not None:  # every rank must have loaded the same checkpoint
            check_randomness(self.rng, self.distributed)
            assert_synchronized(self.model, self.distributed)
        self.engines_ran = set(ck.get("engines_ran", ()))
        self.compiled_steps = int(ck.get("engine_compiled_steps", 0))
        self.fallbacks = set(ck.get("engine_fallbacks", ()))
        self._post_step_due = bool(ck.get("post_step_due", self.bound_based and not self.steps))
        self._pending = None
        self.loop_guard = LoopGuard(self.optimizer)
        if self.averager is not None:
            if "averaging" not in ck:
                raise ValueError("checkpoint was written without weight averaging; resume with "
                                 "the averaging it was written with (none)")
            self.averager.load_state_dict(ck["averaging"])
            self._average_due = False
        elif "averaging" in ck:
            raise ValueError(f"checkpoint was written with averaging "
                             f"{ck['averaging'].get('spec')!r}; resume with the same averaging")

    # --------------------------------------- augmentation multiplicity and weight averaging

    def _setup_multiplicity_and_averaging(self, engine: str) -> None:
        """Checks and engine choice for augmentation multiplicity (``dpclip.training.multiplicity``) and
        the weight averager (``dpclip.training.averaging``); called once from ``__init__``."""
        check_multiplicity(self.multiplicity, augment=self.augment,
                           unit_is_individual=self.unit.is_individual,
                           bound_based=self.bound_based, engine=engine,
                           distributed=self.distributed is not None,
                           where=self._flags.get("augment_multiplicity", "augment_multiplicity"))
        k = self.multiplicity
        # the engines see each example as ONE input (K, *example) with one loss; ghost and auto
        # read example i from the K rows its copies occupy in every layer (layout (0, K))
        self._step_loss = k_copy_loss(self.loss_fn, k) if k > 1 else self.loss_fn
        self.averager = WeightAverager(self.model, self.averaging) \
            if self.averaging is not None else None
        self._average_due = False

    def _step_model(self) -> nn.Module:
        """The model the step differentiates: ``model``, or its K-copy view."""
        return KCopyModel(self.model, self.multiplicity) if self.multiplicity > 1 else self.model

    def update_average(self) -> None:
        """Fold the parameters after ``optimizer.step()`` into the weight average (``dp.step``
        calls it; call it yourself after your own ``optimizer.step()``). Post-processing: no
        privacy cost."""
        if self.averager is None:
            raise ValueError("update_average: averaging is off; pass averaging='ema:0.999' (or "
                             "'polyak:S') to make_private")
        if self._post_step_due:  # the weight projection of the step just taken (bound-based)
            self.strategy.post_step(self.model, self.state, input_shape=self.input_shape)
            self._post_step_due = False
        self.averager.update()
        self._average_due = False

    def averaged_weights(self) -> Any:
        """A context in which the model holds the averaged parameters (evaluation, export);
        without averaging, the model as it is."""
        import contextlib

        return self.averager.swapped() if self.averager is not None \
            else contextlib.nullcontext(self.model)

    def averaged_model(self) -> nn.Module:
        """A copy of the model holding the averaged parameters (post-processing; see
        ``dpclip.training.averaging``). Raises when averaging is off."""
        if self.averager is None:
            raise ValueError("averaged_model: averaging is off; pass averaging='ema:0.999' (or "
                             "'polyak:S') to make_private")
        return self.averager.averaged_model()

    def __repr__(self) -> str:
        return (f"PrivateTraining(strategy={strategy_name(self.strategy)!r}, "
                f"noise_multiplier={self.noise_multiplier:.4g}, steps={self.steps}/"
                f"{self.total_steps}, epsilon={self.epsilon():.4g}, randomness={self.rng.mode!r})")


def _check_model_device(model: Any, device: torch.device | None, flag: str) -> None:
    """A model whose parameters are not on ``device`` is refused before any step: the batches go
    to ``device`` and the first step would fail inside the engine with a dtype / device error
    (make_private does not move the model, as Opacus' does not: the optimizer holds its
    parameters)."""
    if device is None or not isinstance(model, nn.Module):
        return
    for name, p in model.named_parameters():
        if p.device.type != device.type or (device.index is not None
                                            and p.device.index != device.index):
            raise ValueError(
                f"make_private: {flag}={str(device)!r} but the model's parameter {name!r} is on "
                f"{p.device}; move the model first (model.to({str(device)!r})) and build the "
                "optimizer on the moved parameters")


def _model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (the CPU for a model without parameters)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _place_data(x: Any, y: Any, device: torch.device | None, data_on_device: bool | str
                ) -> tuple[Any, Any]:
    """The training tensors, copied once to ``device`` when ``data_on_device`` is True, or
    ``"auto"`` and they take at most half of the device's free memory (then no step moves a batch
    across PCIe); otherwise as given (each drawn batch is copied). Map-style datasets stay where
    they are."""
    if data_on_device not in (True, False, "auto"):
        raise ValueError(f"make_private: data_on_device must be True, False or 'auto', got "
                         f"{data_on_device!r}")
    if device is None and data_on_device is True:
        raise ValueError("make_private: data_on_device=True needs device= (the device to keep "
                         "the data on), e.g. device='cuda'")
    if device is None or y is None or data_on_device is False:
        return x, y

    if data_on_device == "auto" and not data_fits_on_device((x, y), device):
        return x, y
    return map_batch(lambda t: t.to(device), x), map_batch(lambda t: t.to(device), y)


def make_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    data: Any,
    *,
    epsilon: float | None = None,
    noise_multiplier: float | None = None,
    delta: float | None = None,
    epochs: int | None = None,
    steps: int | None = None,
    batch_size: float | None = None,
    strategy: str | ClippingStrategy = "fixed",
    strategy_params: Mapping[str, Any] | None = None,
    unit: str | UnitConfig | None = None,
    miniset_size: int | None = None,
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
    sampling: str = "poisson",
    accountant: str = "pld",
    engine: str = "auto",
    max_physical_batch: int | None = None,
    device: str | torch.device | None = None,
    augment: Any = None,
    public_data: tuple[Tensor, Tensor] | None = None,
    input_shape: Sequence[int] | None = None,
    reproducible_noise: bool = False,
    seed: int = 0,
    distributed: Any = None,
    verbose: bool = True,
    data_on_device: bool | str = "auto",
    averaging: Any = None,
    augment_multiplicity: int = 1,
    preprocess: Any = None,
    features: Any = None,
) -> PrivateTraining:
    """DP-SGD around your own model, optimizer and data.

    Returns a :class:`PrivateTraining`: draw batches from ``dp.loader``, call ``dp.backward(x, y)``
    (or ``dp.step(x, y)``) instead of ``loss.backward()``, read ``dp.epsilon()`` and
    ``dp.describe()``. See the module docstring for the privacy contract.

    Args:
        model: the network; called as ``model(x)``, ``model(*x)`` (tuple) or ``model(**x)``
            (dict). It must be per-example separable: no BatchNorm with per-example clipping
            (``dpclip.check_model`` lists the problems, ``dpclip.fix_model`` fixes BatchNorm).
        optimizer: any ``torch.optim`` optimizer over the model's parameters, or ``None`` when
            you step your own after ``backward``.
        data: ``(inputs, targets)`` (tensors, numpy arrays, or tuples/dicts of tensors, one row
            per example), a ``TensorDataset``, a map-style ``Dataset`` of ``(input, target)``
            pairs, or a ``DataLoader`` (only its dataset and batch size are used: dpclip draws
            its own Poisson batches with secret randomness).
        epsilon: the target epsilon; the noise multiplier is calibrated so that the whole plan
            (``epochs``/``steps``) meets it, and training stops before exceeding it.
        noise_multiplier: sigma, instead of ``epsilon`` (give one of the two).
        delta: the delta of (epsilon, delta)-DP; default: 1e-5, or a power of ten below 1/(10 N)
            (said on stderr when ``verbose``). Must be below 1/N.
        epochs: the planned number of epochs (give exactly one of ``epochs`` and ``steps``).
        steps: the planned number of steps.
        batch_size: the EXPECTED batch size (sample rate ``batch_size / N``; a public constant
            that also divides the noisy sum). When left out it is taken from a ``DataLoader``'s
            ``batch_size`` (said on stderr when ``verbose``); for any other ``data`` it is
            required.
        strategy: a clipping strategy name (``dpclip strategies`` lists them) or an instance.
        strategy_params: the named strategy's parameters, e.g. ``{"clip_norm": 1.0}``. (The
            clipping unit used to travel here, ``{"unit": "bc"}``: still read, with a
            ``DeprecatedSpellingWarning``; pass ``unit=`` instead.)
        unit: the clipping unit (``dpclip.training.units``): ``"ic"`` (default: per example),
            ``"bc"`` (batch clipping: the batch's mean gradient clipped once; BatchNorm allowed),
            ``"gbc"`` (general batch clipping over mini-sets of ``miniset_size`` examples; needs
            ``sampling="fixed-size"``), or a ``UnitConfig``. The example stays the privacy unit.
        miniset_size: examples per mini-set for ``unit="gbc"`` (``batch_size`` a multiple of it).
        loss_fn: ``loss_fn(outputs, targets)`` returning one loss per example, shape ``(B,)``;
            default cross-entropy with ``reduction="none"``.
        sampling: ``"poisson"`` (add/remove adjacency) or ``"fixed-size"`` (replace-one,
            sensitivity doubled).
        accountant: ``"pld"`` or ``"rdp"`` (dp-accounting).
        engine: per-example gradient engine: ``"auto"`` (ghost where it proves separability,
            on the proof's graph where that is proved, else vmap, said once), ``"ghost"``,
            ``"compiled"`` (ghost on the proof's graph, run instead of the model's code:
            :mod:`dpclip.engine.compiled`), ``"vmap"``, ``"naive"``, ``"summed"``.
        max_physical_batch: examples per forward/backward chunk (memory; not privacy).
        device: where the model's batches, the clipped sums and the secret generators live
            (``"auto"``: CUDA when present; ``"cpu"``, ``"cuda"``, a ``torch.device``).
        augment: per-example augmentation after sampling, e.g. ``"crop:4,flip"``.
        public_data: ``(inputs, targets)`` of PUBLIC data for strategies that estimate thresholds
            on it.
        input_shape: one example's shape, for bound-based strategies (Lipschitz certificates).
        reproducible_noise: derive the noise and sampling from ``seed``: NOT private, for tests.
        seed: seeds the public choices (and, only with ``reproducible_noise``, the noise).
        distributed: ``True`` or a ``DistributedContext``: one private run across the ranks of
            a ``torch.distributed`` group (docs/distributed.md).
        verbose: print the defaults dpclip chose (delta, batch size) on stderr.
        data_on_device: copy the training tensors once to ``device`` (``True``), never
            (``False``), or when they take at most half its free memory (``"auto"``).
        averaging: weight averaging of the iterates, ``"ema:D"`` (with warm-up), ``"ema:D:S"``
            or ``"polyak:S"`` (from step S); post-processing, no privacy cost. ``dp.step()``
            updates it (or call ``dp.update_average()`` after your ``optimizer.step()``);
            evaluate with ``dp.averaged_weights()`` or ``dp.averaged_model()``.
        augment_multiplicity: K augmented copies of each sampled example, their gradients
            averaged before clipping (De et al. 2022; needs ``augment``); the sensitivity is
            unchanged.
        preprocess: a private preprocessing release made before the first step, e.g.
            ``dpclip.data.private_centre.PrivateCentre(8.0)`` (a DP estimate of the mean of the
            inputs, clipped into ``[-1, 1]^d``, subtracted from them): its event is recorded first
            in the ledger and counted by the calibration; transform other inputs with
            ``dp.preprocess.apply(x)`` (docs/privacy.md, "Preprocessing").
        features: a fixed per-example feature map applied to every drawn batch after its
            augmentation: ``"scattering"`` (Tramer & Boneh's scattering coefficients, 81 x 7 x 7
            for 28x28 images; ``"scattering:J"``, ``"scattering:J:L"``) or a
            :class:`dpclip.data.features.Scattering`; the inputs stay images, the model receives
            coefficients (map your evaluation data with ``dp.features.transform(x)``). No privacy
            cost (docs/privacy.md). Without augmentation, transform the data once instead
            (``load_dataset(..., features="scattering")``).

    Raises:
        ValueError: an argument is missing, out of range or inconsistent; the message names the
            argument and the fix (docs/errors.md).
    """
    check_structure(model, "make_private")  # (before any of the model's methods runs)
    return PrivateTraining(
        model, optimizer, data, loss_fn=loss_fn, strategy=strategy,
        strategy_params=strategy_params, unit=unit, miniset_size=miniset_size, epsilon=epsilon, noise_multiplier=noise_multiplier,
        delta=delta, epochs=epochs, steps=steps, batch_size=batch_size, sampling=sampling,
        accountant=accountant, engine=engine, max_physical_batch=max_physical_batch,
        reproducible_noise=reproducible_noise, seed=seed, public_data=public_data,
        input_shape=input_shape, device=device, verbose=verbose, distributed=distributed,
        augment=augment, data_on_device=data_on_device, averaging=averaging,
        augment_multiplicity=augment_multiplicity, preprocess=preprocess, features=features)


def _loader_batch_size(data: Any, verbose: bool) -> float:
    """The expected batch size when ``make_private`` was not given one: a DataLoader's own
    ``batch_size`` (said once on stderr), else a ValueError naming ``batch_size=``."""
    from torch.utils.data import DataLoader

    if isinstance(data, DataLoader) and data.batch_size is not None:
        if verbose:
            print(f"dpclip: batch_size = {data.batch_size} (the DataLoader's, as the expected "
                  "size of dpclip's Poisson batches; pass batch_size= to choose)",
                  file=sys.stderr)
        return float(data.batch_size)
    where = ("this DataLoader has no batch_size (it uses a batch_sampler)"
             if isinstance(data, DataLoader) else f"data is {type(data).__name__}")
    raise ValueError(
        f"make_private: batch_size is required ({where}): pass batch_size=, the expected number "
        "of examples per step (the sample rate is batch_size / N), e.g. batch_size=256")


def _say_loader_batch_size_unused(data: Any, batch_size: float) -> None:
    from torch.utils.data import DataLoader

    if isinstance(data, DataLoader) and data.batch_size is not None \
            and float(data.batch_size) != float(batch_size):
        print(f"dpclip: batch_size = {batch_size:g} (given); the DataLoader's batch_size "
              f"{data.batch_size} is not used", file=sys.stderr)


#: set to 1 to see the raw message of an error raised inside a private step (NON-PRIVATE: it can
#: quote a shape whose first dimension is the realised batch size, or a private value)
SHOW_PRIVATE_ERRORS = "DPCLIP_SHOW_PRIVATE_ERRORS"


def _raised_by_dpclip(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by dpclip's own code (the innermost frame of its traceback is
    a dpclip module's): its checks' messages are written without private values."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).startswith(
        "dpclip.")


def private_step_error(exc: BaseException) -> BaseException | None:
    """The error raised inside a private step, with every number of its message replaced by ``#``
    (as :func:`dpclip.store.public_error`): torch's and the model's messages quote shapes
    (``mat1 and mat2 shapes cannot be multiplied (56x8 and 9x2)``: 56 is the realised batch size,
    private under Poisson sampling) and values (fifty-first hostile review). Same type when it
    takes one message (else a RuntimeError naming the type), chained to nothing (the original's
    text would be printed with it). None (re-raise it as it is) when
    ``DPCLIP_SHOW_PRIVATE_ERRORS=1``, or for dpclip's own error types (refusals written to name
    public facts only: a parameter's name, an option)."""
    import os

    if os.environ.get(SHOW_PRIVATE_ERRORS) == "1" or \
            type(exc).__module__.split(".")[0] == "dpclip":
        return None  # (dpclip's own error types are written without private values)
    text = re.sub(r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", "#", str(exc))  # (as dpclip.store's)
    hint = (f" [numbers removed: the message of an error inside a private step may hold the "
            f"realised batch size or a private value; {SHOW_PRIVATE_ERRORS}=1 shows it, "
            f"NON-PRIVATE]")
    try:
        new = type(exc)(text + hint)
    except Exception:  # noqa: BLE001 - another signature: a RuntimeError with the type's name
        new = RuntimeError(f"{type(exc).__name__}: {text}{hint}")
    return new


def _function_fingerprint(model: nn.Module, loss_fn: Any) -> str:
    """What the released function is made of besides the settings: the model's modules (each
    one's class, its configuration ``extra_repr`` and, for a class outside torch, its code) and
    the loss's code (a function's source or bytecode, defaults and closure values; a module's
    class and configuration; a ``functools.partial``'s function and arguments). A checkpoint
    resumed into a run whose function differs would continue the same secret noise on another
    function: a ReLU swapped for a Tanh, or a lambda loss given label smoothing, released the
    noise-free difference of the two clipped sums (eighty-eighth hostile review: the loss was
    fingerprinted by ``__qualname__``, ``"<lambda>"`` for every lambda, the model not at all)."""
    parts: list[str] = []
    for name, mod in model.named_modules():
        cls = type(mod)
        parts.append(f"{name}:{cls.__module__}.{cls.__qualname__}:{mod.extra_repr()}")
        if not cls.__module__.startswith("torch."):
            parts.append(_code_text(cls))
    parts.append(_callable_text(loss_fn, 0))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _code_text(obj: Any) -> str:
    """The source of a function or class where Python can read it, else its code objects'
    instructions, constants and names (a lambda typed in a notebook has no readable file)."""
    import inspect

    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        pass
    codes = [getattr(obj, "__code__", None)] if not isinstance(obj, type) else [
        getattr(v, "__code__", None) for v in vars(obj).values()]
    out = []
    for co in codes:
        if co is not None:
            out.append(repr((co.co_code, co.co_names, [
                c if not hasattr(c, "co_code") else c.co_code for c in co.co_consts])))
    return "\n".join(out)


def _callable_text(fn: Any, depth: int) -> str:
    if fn is None or depth > 3:
        return repr(fn)
    if isinstance(fn, functools.partial):
        return "partial(" + _callable_text(fn.func, depth + 1) + re.sub(
            r" at 0x[0-9a-fA-F]+", "", repr((fn.args, fn.keywords))) + ")"
    if isinstance(fn, nn.Module):
        cls = type(fn)
        config = {k: v for k, v in vars(fn).items()
                  if isinstance(v, (bool, int, float, str, type(None)))}
        text = f"{cls.__module__}.{cls.__qualname__}{sorted(config.items())}"
        return text if cls.__module__.startswith("torch.") else text + _code_text(cls)
    code = getattr(fn, "__code__", None)
    if code is None:
        cls = type(fn)
        return f"{cls.__module__}.{cls.__qualname__}:" + re.sub(r" at 0x[0-9a-fA-F]+", "",
                                                                repr(fn))
    cells = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            v = cell.cell_contents
        except ValueError:
            v = None
        cells.append(_callable_text(v, depth + 1) if callable(v) else
                     re.sub(r" at 0x[0-9a-fA-F]+", "", repr(v)))
    return "\n".join([f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}",
                      _code_text(fn), re.sub(r" at 0x[0-9a-fA-F]+", "", repr(
                          (getattr(fn, "__defaults__", None), getattr(fn, "__kwdefaults__",
                                                                      None)))), *cells])


def _check_grad_slots(slots: list[tuple[Tensor, Any]]) -> None:
    """The forward and loss left every parameter's ``.grad`` as the step found it: a tensor they
    put there, with a ``weakref.finalize`` attached, was dropped when the release replaced it,
    after every check, and the finalizer wrote the released gradient with the step's labels
    (hundred-and-twenty-eighth hostile review: the trained weights 1000 apart on neighbouring
    datasets under ghost, auto and compiled). Refused."""
    if any(p.grad is not g for p, g in slots):
        raise UnsupportedModelError(
            "make_private: the forward or loss set a parameter's .grad during the private step "
            "(the step computes the gradients itself and replaces .grad after it): whatever it "
            "put there would run user code after the step's checks. Leave .grad alone in the "
            "model's code")


def _let_go(old: list[Any], model: nn.Module, released: list[Tensor],
            optimizer: torch.optim.Optimizer | None) -> None:
    """Drop ``old`` (the previous release's gradients, output and batch) where a check follows: a
    finalizer the loss attached to one runs here (user code, after the step's checks), inside a
    chunk isolation (module attributes, torch settings, generators: put back and refused), and a
    write of the parameters, buffers, the gradients just released or the optimizer's state is
    refused (hundred-and-twenty-eighth hostile review: a finalizer on the gradient slot wrote
    1000 x the count of one label into the released gradient, unnoised)."""
    from dpclip.engine.isolation import Isolated
    from dpclip.engine.saved_check import all_still, fingerprints

    state = [t for st in (optimizer.state.values() if optimizer is not None else ())
             for t in st.values() if isinstance(t, Tensor)]
    watched = [*model.parameters(), *model.buffers(), *released, *state]
    versions = [t._version for t in watched]
    prints = fingerprints(watched)
    with Isolated(model):
        old.clear()
    if any(t._version != v for t, v in zip(watched, versions)) or not all_still(watched, prints):
        raise UnsupportedModelError(
            "make_private: code that ran when the previous step's gradients and batch were let "
            "go (a weakref.finalize or __del__ the forward or loss attached to them) wrote the "
            "model's parameters or buffers, the gradients just released or the optimizer's "
            "state: they may now hold private data, unnoised. Discard this model; keep "
            "finalizers out of the model's code")
