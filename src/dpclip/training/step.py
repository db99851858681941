"""One differentially private step, the whole of it (design.md, "What one DP step is").

    norms, sum  <- engine(model, batch, weight_fn = strategy.weights(., state))
    S           <- sampler.sensitivity_factor * strategy.sensitivity(state)
    z           <- strategy.noise_multiplier(state, base)
    noisy       <- sum + N(0, (z S)^2)                 (dpclip.training.release, the one door)
    grad        <- noisy / expected_batch_size         (public constant, never len(batch))
    state', ev  <- strategy.update(state, norms, ctx, Releaser)
    event       <- sampler.step_event(compose(Gaussian(z), *ev))

``dp_step`` = engine + :func:`dpclip.training.release.release` (the last three lines).

A strategy of class P-GRAD (AdaClip; ``Capabilities(per_example_grads=True)``, see
:class:`GradientTransform`) replaces the engine call by ``transformed_sum``: per-example gradients
are materialized (vmap or naive engine), mapped by ``strategy.transform`` and clipped there; the
noisy sum is divided by the expected batch size as always and mapped back by
``strategy.untransform``. Every other strategy takes exactly the path above.
"""

from __future__ import annotations

from dpclip.engine import _cm
import hashlib
import math
import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, ClassVar, ContextManager, Mapping, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from dpclip import blas_mode
from dpclip.engine.conv_backends import fixed_conv_backends, warn_if_capped
from dpclip.clipping.base import ClippingStrategy, State, StepContext
from dpclip.clipping.capabilities import Capabilities, capabilities_of, strategy_name
from dpclip.clipping.fixed import FixedClip
from dpclip.engine._common import (BoundedChunkReducer, StepWeights, check_per_example_model,
                                   exact_float32, trainable_params, wide_sums)
from dpclip.engine.ghost import AutoEngine, GhostEngine
from dpclip.engine.base import Engine, EngineResult, LossFn, ParamGroups
from dpclip.engine.errors import UnsupportedModelError
from dpclip.engine.batch import call_model, check_batch, first_tensor, owned_slice
from dpclip.engine.errors import PrivateBufferError  # defined below the engine (state_guard)
from dpclip.engine.naive import NaiveEngine, naive_per_example_grads
from dpclip.engine.summed import SummedEngine
from dpclip.engine.op_entry import no_compiled_autograd
from dpclip.engine.state_guard import state_guard
from dpclip.engine.generators import current_seed_source, seed_source
from dpclip.engine.isolation import (Isolated, check_structure, engine_only,
                                     structure_checked)
from dpclip.engine.plain_module import global_hooks_clear, instance_code, plain_instance
from dpclip.engine.vmap import VmapEngine, vmap_per_example_grads
from dpclip.events import DpEvent
from dpclip.training.release import Released, release
from dpclip.training.sampling import Sampler
from dpclip.training.units import UnitConfig, expected_units, unit_sum

__all__ = [
    "GradientTransform",
    "PrivateBufferError",
    "StepOutput",
    "bound_step",
    "dp_step",
    "nonprivate_step_grads",
    "private_buffer_guard",
    "transformed_sum",
]


def private_buffer_guard(model: nn.Module, where: str = "dp_step") -> ContextManager[None]:
    """Refuse any change of the model's state made while private data flows through ``model``:
    every buffer (running statistics of InstanceNorm / BatchNorm with ``track_running_stats=True``,
    counters, caches), every parameter's data (trainable or not: a ``nn.Parameter(requires_grad=
    False)`` updated in forward, a write through ``p.data``, NumPy or raw storage, which no version
    counter sees), every tensor kept in a module attribute (a tensor stored in ``self.cache`` and
    read by the next call) and the module tree itself (parameters, buffers, attributes or
    submodules added in the call), compared bitwise and restored
    (:func:`dpclip.engine.state_guard.state_guard`, docs/errors.md entry 79). Buffers that a
    context inside the block restores itself (``units.frozen_bn_buffers`` under batch clipping)
    pass. Nothing leaves: the model is as it was before the block."""
    return state_guard(model, where)


#: the engines (exact classes) that enter the state guard themselves when dp_step hands them a
#: :class:`~dpclip.engine._common.StepWeights`
_SELF_GUARDING = (GhostEngine, AutoEngine)
_FIXED_WEIGHTS = FixedClip.weights


def _closed_weights(strategy: ClippingStrategy) -> bool:
    """Whether ``strategy.weights`` runs no user code: exactly dpclip's ``FixedClip`` with its own
    ``weights`` (it reads only ``clip_norm``) and a plain ``clip_norm``; nothing else on the
    instance. Other strategies keep the state guard (a subclass, a patched method, or a value
    whose type has user methods could run user code with the norms)."""
    return (type(strategy) is FixedClip and FixedClip.weights is _FIXED_WEIGHTS
            and type(vars(strategy)) is dict and set(vars(strategy)) == {"clip_norm"}
            and type(strategy.clip_norm) in (float, int))


@dataclass
class StepOutput:
    """The privatized gradient (already divided by the expected batch size) and bookkeeping."""

    grads: dict[str, Tensor]
    state: State
    event: DpEvent
    noise_multiplier: float
    sensitivity: float
    batch_size: int  #: realised batch size (NON-PRIVATE, diagnostics only)
    loss_sum: float  #: NON-PRIVATE diagnostic
    norms: Tensor | None  #: NON-PRIVATE diagnostic
    #: public facts about the engine that ran (``{"engine", "requested", "fallback"}``)
    engine_info: dict[str, Any] | None = None
    #: the parameters ``grads`` belong to, when the engine reported them (``EngineResult.params``)
    params: dict[str, Tensor] | None = None


def dp_step(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    *,
    loss_fn: LossFn,
    strategy: ClippingStrategy,
    state: State,
    engine: Engine,
    groups: ParamGroups,
    sampler: Sampler,
    base_noise_multiplier: float,
    ctx: StepContext,
    generator: torch.Generator,
    unit: UnitConfig | None = None,
) -> StepOutput:
    """Compute one privatized gradient; does not touch the optimizer or ``p.grad``.

    ``inputs``/``targets``: tensors, or tuples/dicts of tensors with the batch in dimension 0 of
    every leaf (:mod:`dpclip.engine.batch`: the model is called as ``model(*inputs)`` or
    ``model(**inputs)``).
    ``unit`` (``dpclip.training.units``): ``None`` or IC clips per example; BC/GBC take ``inputs`` of shape
    ``(units, examples per unit, ...)``, clip each unit's mean gradient, use sensitivity ``2 S``
    and divide by the public number of units per step.
    """
    blas_mode.warn_if_off()  # (MKL without its alignment-independent mode: dpclip.blas_mode)
    warn_if_capped()  # (the engines run torch at <= 2 threads: dpclip.engine.conv_backends)
    # the chunks' own generators (dropout masks) seeded from the caller's noise generator (secret
    # in a secure run), never from torch's public default generator, unless the caller set a
    # source (make_private: its private key; dpclip.engine.generators.seed_source; eleventh
    # hostile review). The structure is checked before any of the model's methods runs: user code
    # in them is outside every check (the engine this step calls does not check again)
    check_structure(model, "dp_step")
    seeds = seed_source(_SeedsOf(generator)) if current_seed_source() is None \
        else _cm.nullcontext()
    # no user code runs between the engine's reduction and the release (a signal handler or a
    # Python kernel the model installed rewrote the clipped sum before the noise: fortieth and
    # forty-first reviews)
    # the engines' float64 sums reach the release uncast: the noise is added before the cast
    # (dpclip.engine._common.wide_sums; hundred-and-forty-sixth hostile review)
    with seeds, structure_checked(model), engine_only(), wide_sums():
        return _dp_step(model, inputs, targets, loss_fn=loss_fn, strategy=strategy, state=state,
                        engine=engine, groups=groups, sampler=sampler,
                        base_noise_multiplier=base_noise_multiplier, ctx=ctx,
                        generator=generator, unit=unit)


def _dp_step(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    *,
    loss_fn: LossFn,
    strategy: ClippingStrategy,
    state: State,
    engine: Engine,
    groups: ParamGroups,
    sampler: Sampler,
    base_noise_multiplier: float,
    ctx: StepContext,
    generator: torch.Generator,
    unit: UnitConfig | None = None,
) -> StepOutput:
    if not capabilities_of(strategy).per_group and not groups.is_flat:
        # a flat strategy's weights act elementwise: with per-group norms (B, G) each group would
        # be clipped to C while the sensitivity stays C (tenth hostile review: sqrt(G) C)
        raise ValueError(
            f"dp_step: strategy {strategy_name(strategy)!r} clips the whole gradient (one norm "
            f"per example) but groups has {len(groups)} parameter groups; pass "
            "ParamGroups.flat(model), or use a per-group strategy (e.g. 'per-layer') bound to "
            "these groups")
    if capabilities_of(strategy).bound_based:  # Lip-DP-SGD: sensitivity from the weights
        return bound_step(
            model, inputs, targets, loss_fn=loss_fn, strategy=strategy, state=state,
            engine=engine, groups=groups, sampler=sampler,
            base_noise_multiplier=base_noise_multiplier, ctx=ctx, generator=generator,
        )
    state = strategy.begin_step(state, ctx)
    frozen_state = state

    def weight_fn(norms: Tensor) -> Tensor:
        return strategy.weights(norms, frozen_state)

    per_example = capabilities_of(strategy).per_example_grads
    individual = unit is None or unit.is_individual
    # a distributed engine whose sums are LOCAL (noise_shard): the release noises this rank's
    # coordinates and all-reduces (dpclip.training.noise_shard); only the engine path makes them
    shard = getattr(engine, "noise_shard", None)
    if shard is not None and (per_example or not individual):
        raise ValueError("dp_step: a sharded distributed engine runs only the engine's own sum "
                         "(unit=ic, a strategy that is not P-GRAD); train batch clipping units "
                         "and P-GRAD strategies in one process (docs/errors.md entry 94)")
    if not individual:  # BC / GBC: inputs are (units, examples per unit, ...)
        if not isinstance(inputs, Tensor) or not isinstance(targets, Tensor):
            name = getattr(unit, "unit", unit)
            raise ValueError(
                f"unit={name} (batch clipping) takes inputs and targets as single tensors of "
                "shape (units, examples per unit, ...); tuple or dict inputs run with unit=ic")
        if per_example:
            raise ValueError(
                f"strategy {strategy_name(strategy)!r} clips transformed per-example "
                "gradients and cannot run on batch units; use unit=ic, or a norm-based strategy"
            )
        with private_buffer_guard(model):
            result = unit_sum(model, loss_fn, inputs, targets, weight_fn, groups)
        factor = unit.sensitivity_factor  # type: ignore[union-attr]
        denom = expected_units(unit, sampler)  # type: ignore[arg-type]
        n_examples = int(inputs.shape[0] * inputs.shape[1]) if inputs.dim() > 1 else 0
    else:
        if not per_example and type(engine) in _SELF_GUARDING:
            # the engine enters the state guard itself (it skips it for a closed program: no
            # user code in the step; dpclip.engine.ghost)
            result = engine.compute(model, loss_fn, inputs, targets,
                                    StepWeights(weight_fn, _closed_weights(strategy)), groups)
        else:
            with private_buffer_guard(model):
                if per_example:  # P-GRAD (AdaClip): clip transformed per-example gradients
                    result = transformed_sum(
                        engine, strategy, state, model, loss_fn, inputs, targets, groups)
                else:
                    result = engine.compute(model, loss_fn, inputs, targets, weight_fn, groups)
        factor = sampler.sensitivity_factor
        denom = sampler.expected_batch_size
        n_examples = check_batch(inputs, targets, "dp_step")
    _check_wide(result, model, engine)
    sensitivity = factor * strategy.sensitivity(state)
    z = strategy.noise_multiplier(state, base_noise_multiplier)
    factors = strategy.group_noise(state) if capabilities_of(strategy).per_group else None
    block: float | dict[str, float] = sensitivity
    if factors is not None:  # per-layer noise: block h gets z * k * f_h (strategy's docstring)
        if per_example:
            raise ValueError("per-group noise is not supported with P-GRAD strategies")
        if len(factors) != len(groups):
            raise ValueError(
                f"strategy {strategy_name(strategy)!r} gives {len(factors)} per-group "
                f"noise factors for {len(groups)} parameter groups"
            )
        block = {n: factor * f for f, members in zip(factors, groups.members) for n in members}
    norms = result.norms if result.norms is not None else torch.empty(0)
    out = release(
        result.grads, noise_multiplier=z, sensitivity=block, divisor=denom, generator=generator,
        strategy=strategy, state=state, norms=norms, ctx=ctx, sampler=sampler,
        sensitivity_factor=factor, untransform=per_example,
        noise_scale=_noise_scale(strategy, ctx) if per_example else 1.0, shard=shard,
        out_dtypes=_param_dtypes(result, model))
    return _output(out, result, engine, z, sensitivity, n_examples, model)


def _check_wide(result: EngineResult, model: nn.Module, engine: Any) -> None:
    """The engine's sums of float32 and half parameters came back in float64 (``wide_sums``):
    a model whose code switched the setting off (auto's public probe runs the forward inside the
    step, before the ghost pass reads it) had its sum cast before the noise, rounded on the grid
    of the batch's sum (1.0073 C at B = 2^16; hundred-and-fifty-fourth hostile review)."""
    params = result.params if result.params is not None else trainable_params(model)
    for n, g in result.grads.items():
        p = params.get(n)
        if p is not None and p.dtype in _NARROW and g.dtype != torch.float64:
            raise UnsupportedModelError(
                f"dp_step: engine {getattr(engine, 'name', type(engine).__name__)!r} returned "
                f"the clipped sum of parameter {n!r} in {g.dtype}, rounded before the noise "
                "(dpclip sums float32 and half parameters in float64 and casts the noisy "
                "value): the model's code changed dpclip's own settings "
                "(dpclip.engine._common._WIDE), or the engine does not honour "
                "dpclip.engine._common.wide_sums. Leave dpclip's internals alone in the forward; "
                "an engine of your own must return float64 sums inside wide_sums")


#: parameter dtypes whose sums reach the release in float64 (``_common.wide_sums``)
_NARROW = (torch.float32, torch.float16, torch.bfloat16)


def _param_dtypes(result: EngineResult, model: nn.Module) -> dict[str, torch.dtype]:
    """The dtype each released value is cast to after the noise: its parameter's. Under
    ``wide_sums`` the engines return float64 sums of float32 parameters (and every engine sums
    float16 / bfloat16 parameters in float32 at least, ``dpclip.engine._common.HALF``): a sum
    rounded to the parameter's dtype BEFORE the noise moves by an error relative to the whole
    batch's sum; the cast of the noisy value is post-processing."""
    params = result.params if result.params is not None else trainable_params(model)
    return {n: params[n].dtype for n in result.grads if n in params}


def _output(out: Released, result: EngineResult, engine: Engine, z: float, sensitivity: float,
            batch_size: int, model: nn.Module) -> StepOutput:
    """The step's output: the release (in the parameters' dtypes, cast by the release) and the
    engine's NON-PRIVATE diagnostics."""
    return StepOutput(grads=out.values, state=out.state,
                      event=out.event, noise_multiplier=z,
                      sensitivity=sensitivity, batch_size=batch_size, loss_sum=result.loss_sum,
                      norms=result.norms, engine_info=_engine_info(result, engine),
                      params=result.params)


def _engine_info(result: EngineResult, engine: Engine) -> dict[str, Any]:
    info = dict(result.engine_info or {})
    info.setdefault("engine", getattr(engine, "name", type(engine).__name__))
    info.setdefault("requested", getattr(engine, "name", type(engine).__name__))
    info.setdefault("fallback", None)
    return info


def _check_lipschitz_layers(model: nn.Module, loss_fn: Any = None) -> None:
    """The certificate is proven for what each layer's class computes: a module hook, an instance
    attribute that replaces its code, or a global module hook changes the function that is
    differentiated (tenth hostile review: a forward pre-hook x50 gave 9.3 times the certified
    sensitivity, an instance forward 37 times). Checked before every bound-based step."""
    from dpclip.lipschitz.bounds import UnsupportedLayerError

    if not global_hooks_clear():
        raise UnsupportedLayerError(
            "a global module hook is registered (torch.nn.modules.module."
            "register_module_forward_hook / _pre_hook / backward_hook): it runs in every layer's "
            "call, so the model may compute another function than the one the Lipschitz bound is "
            "proven for; remove it while training with a bound-based strategy")
    for name, p in model.named_parameters():
        # a gradient hook on a parameter scales the summed gradient the bound is proven for
        # (forty-third hostile review: `weight.register_hook(lambda g: 50 * g)`, 16.9 times the
        # certified sensitivity under the summed and naive engines)
        if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None):
            raise UnsupportedLayerError(
                f"parameter {name!r} has a gradient hook (Tensor.register_hook / "
                "register_post_accumulate_grad_hook): it changes the gradient the Lipschitz bound "
                "is proven for; remove it while training with a bound-based strategy")
    mods = list(model.named_modules())
    if isinstance(loss_fn, nn.Module):
        # (the certified loss is a module too: a forward hook, a pre-hook or an instance
        # forward on it scaled every example's gradient past the certificate, 490 to 780 times
        # through dp_step and make_private's dp.loss_fn; hundred-and-sixty-fourth hostile review)
        mods += [(f"loss_fn{'.' + n if n else ''}", m) for n, m in loss_fn.named_modules()]
    elif loss_fn is not None:
        raise UnsupportedLayerError(
            f"loss_fn is a {type(loss_fn).__name__}, not the strategy's Lipschitz loss module: "
            "a bound-based strategy certifies the loss it built (strategy.loss()); pass that")
    for name, m in mods:
        if not plain_instance(m):
            why = instance_code(m)
            raise UnsupportedLayerError(
                f"layer {name or '<root>'!r} ({type(m).__name__}) is not supported by the "
                "Lipschitz bound analysis: " + (
                    f"its instance attribute {why!r} replaces code of its class" if why else
                    "it has a module hook, a table of another type, a parameter or buffer of a "
                    "tensor subclass or an attribute that is not plain data: its call may compute "
                    "another function than the one the bound is proven for; remove the hook or "
                    "attribute"))


def bound_step(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    *,
    loss_fn: LossFn,
    strategy: Any,
    state: State,
    engine: Engine,
    groups: ParamGroups,
    sampler: Sampler,
    base_noise_multiplier: float,
    ctx: StepContext,
    generator: torch.Generator,
) -> StepOutput:
    """One step of a bound-based strategy (``kind = "bound"``: Lip-DP-SGD, Fix-Lip-DP-SGD).

        cert    <- strategy.certify(model, loss_fn, input_shape)   # weights + public X_0 only
        x       <- strategy.scale_inputs(x)                        # per example, ||x|| <= X_0
        sum     <- engine(model, x)                                # no clipping (weights 1)
        noisy_p <- sum_p * scale_p + N(0, (z k S_p)^2)             # S_p: Delta, or Delta_k per layer
        grad    <- noisy / expected_batch_size
        event   <- sampler.step_event(strategy.step_event(z))

    The certificate is computed before the batch is read, from parameters already released, so
    it is a public constant, as the Gaussian mechanism requires. ``loss_fn`` must be the
    strategy's Lipschitz loss (``strategy.loss()``): the one certified is the one differentiated.
    With the ``summed`` engine the sum is one plain batched backward; a per-example engine gives
    the same sum (unit weights) plus NON-PRIVATE per-example norms of the unscaled gradients.
    """
    if not isinstance(inputs, Tensor):
        raise ValueError(
            f"strategy {strategy_name(strategy)!r} certifies its sensitivity from a "
            "bound on each input tensor's norm and takes a single input tensor; tuple or dict "
            "inputs need a norm-based strategy")
    _check_lipschitz_layers(model, loss_fn)
    state = strategy.begin_step(state, ctx)
    state, cert = strategy.certify(model, loss_fn, tuple(inputs.shape[1:]), state)
    x = strategy.scale_inputs(inputs)
    frozen_state = state
    weight_fn = (lambda n: strategy.weights(n, frozen_state)) \
        if getattr(engine, "per_example", False) else None
    if getattr(strategy, "scaling", None) == "r1" and getattr(engine, "per_example", False):
        raise ValueError(
            f"strategy {strategy_name(strategy)!r} with scaling='r1' normalises each "
            "example's layer inputs inside a batched backward; use the summed engine "
            "(--engine summed or auto)"
        )
    if isinstance(engine, SummedEngine) and not engine.float64:
        # the sum over the examples in float64 (SummedEngine.float64: a float32 backward's sum
        # was steered to 31.7 times the certified sensitivity; hundred-and-forty-sixth review)
        engine = dataclasses.replace(engine, float64=True)
    with private_buffer_guard(model, "bound_step"), wide_sums(), \
            strategy.gradient_context(model):  # declared by every bound-based strategy
        result = engine.compute(model, loss_fn, x, targets, weight_fn, groups)
    _check_wide(result, model, engine)
    z = strategy.noise_multiplier(state, base_noise_multiplier)
    k = sampler.sensitivity_factor
    norms = result.norms if result.norms is not None else torch.empty(0)
    out = release(
        {name: g * cert.scales[name] for name, g in result.grads.items()},
        noise_multiplier=z,
        sensitivity={name: k * cert.param_sensitivity[name] for name in result.grads},
        divisor=sampler.expected_batch_size, generator=generator, strategy=strategy,
        state=state, norms=norms, ctx=ctx, sampler=sampler, sensitivity_factor=k,
        mechanism=strategy.step_event(z), per_tensor=True,
        shard=getattr(engine, "noise_shard", None),  # distributed: local sums (noise_shard)
        out_dtypes=_param_dtypes(result, model))
    return _output(out, result, engine, z, k * cert.sensitivity, int(inputs.shape[0]), model)


@runtime_checkable
class GradientTransform(Protocol):
    """The extra hooks of a strategy that clips TRANSFORMED per-example gradients (class P-GRAD).

    ``transform`` maps materialized per-example gradients ``{name: (b, *shape)}`` to the space
    where ``weights``/``sensitivity`` hold (AdaClip: whitening); it must be row-wise (example
    ``i``'s output depends on ``g_i`` and the public state only), or the bound is void.
    ``noise_scale(ctx) >= 1`` multiplies the step's noise std ``z S`` (public; the event stays
    ``Gaussian(z)``, a conservative bound). ``untransform(mean, state, noise_std)`` maps the noisy
    mean (already divided by the expected batch size; ``noise_std`` is its per-coordinate noise
    std) back to parameter space and returns ``(grads, state)``: pure post-processing.
    """

    capabilities: ClassVar[Capabilities]  #: declares per_example_grads=True

    def transform(self, grads: Mapping[str, Tensor], state: State) -> dict[str, Tensor]:
        ...

    def noise_scale(self, ctx: StepContext) -> float:
        ...

    def untransform(
        self, mean: Mapping[str, Tensor], state: State, noise_std: float
    ) -> tuple[dict[str, Tensor], State]:
        ...


def _noise_scale(strategy: Any, ctx: StepContext) -> float:
    """``strategy.noise_scale(ctx)``, refused unless finite and >= 1 (the event assumes >= z S)."""
    scale = float(strategy.noise_scale(ctx))
    if not (math.isfinite(scale) and scale >= 1.0):
        raise ValueError(
            f"strategy {strategy_name(strategy)!r}: noise_scale must be finite and "
            f">= 1 (the step's event Gaussian(z) assumes at least z * S noise), got {scale!r}"
        )
    return scale


class _SeedsOf:
    """A direct ``dp_step``'s chunk seeds: a hash of its noise generator's state (secret when the
    generator is) and a counter. Nothing is drawn from the generator: the noise stays the stream
    the caller gave (``make_private`` passes its own key instead: PrivateRandomness.chunk_seed)."""

    __slots__ = ("_key", "_k")

    def __init__(self, generator: torch.Generator) -> None:
        # (the key taken now, the generator not kept: this object sits in a context variable any
        # code can read, and through it the forward read the noise generator's state before the
        # step's draw, hundred-and-seventy-third hostile review)
        state = generator.get_state()
        self._key = hashlib.blake2b(state.numpy().tobytes(), digest_size=32).digest()
        self._k = 0

    def __call__(self) -> int:
        k, self._k = self._k, self._k + 1
        digest = hashlib.blake2b(self._key + k.to_bytes(8, "little"), digest_size=8).digest()
        return int.from_bytes(digest, "little") & ((1 << 62) - 1)


def transformed_sum(
    engine: Engine,
    strategy: Any,
    state: State,
    model: nn.Module,
    loss_fn: LossFn,
    inputs: Any,
    targets: Any,
    groups: ParamGroups,
) -> EngineResult:
    """``sum_i w_i T(g_i)``: ``T = strategy.transform``, ``w = strategy.weights(norms of T(g))``.

    Per-example gradients come from the engine's materializing function (``vmap``:
    ``vmap_per_example_grads``; ``naive``: its loop), one physical chunk of
    ``engine.max_physical_batch`` at a time; norms, non-finite handling (weight 0, zero vector) and
    the weighted sum are the vmap engine's (``BoundedChunkReducer``: the norms bound the vectors
    actually summed, rounding included). ``loss_sum`` is NaN (not computed on this path; a
    non-private diagnostic only). Raises ``ValueError`` for an engine that
    materializes no per-example gradients (``summed``).
    """
    per_example: Callable[..., dict[str, Tensor]]
    if isinstance(engine, VmapEngine):
        per_example = partial(vmap_per_example_grads, max_physical_batch=engine.max_physical_batch)
    elif getattr(engine, "name", None) == "auto":
        # "auto" picks the fastest correct engine for the model AND the strategy: a P-GRAD
        # strategy needs materialized per-example gradients, which only vmap provides quickly
        chunk = getattr(engine, "max_physical_batch", None) or VmapEngine.max_physical_batch
        per_example = partial(vmap_per_example_grads, max_physical_batch=chunk)
    elif isinstance(engine, NaiveEngine):
        per_example = naive_per_example_grads
    else:
        raise ValueError(
            f"strategy {strategy_name(strategy)!r} needs materialized per-example "
            f"gradients (class P-GRAD), which engine {getattr(engine, 'name', engine)!r} does not "
            "provide; use the 'vmap' or 'auto' engine (--engine vmap) or the 'naive' oracle"
        )
    check_per_example_model(model, engine.name)
    groups.validate(model)
    params = {n: p.detach() for n, p in trainable_params(model).items()}
    chunk = getattr(engine, "max_physical_batch", None) or VmapEngine.max_physical_batch
    # norms: upper bounds of the norms of the vectors actually summed, rounding included
    reducer = BoundedChunkReducer(
        params, groups, lambda norms: strategy.weights(norms, state), engine.name, inputs,
        chunk=chunk)
    batch = check_batch(inputs, targets, engine.name)
    device = first_tensor(inputs).device
    # the engines' fixed backends and thread count (at more intra-op threads MKL splits a product
    # of 33 rows otherwise than one of 32: removing one example changed the others' gradients,
    # 7.9 times AdaClip's sensitivity at 8 threads), and their exact float32 for the transform
    # and the sum (under autocast the sum was taken in bfloat16: 1.11 times; hundred-and-twenty-
    # fifth hostile review)
    with fixed_conv_backends():
        for start in range(0, batch, chunk):
            stop = min(start + chunk, batch)
            # each chunk isolated as the engines' own (tenth hostile review: a float attribute
            # carried to the next call moved an AdaClip release 1.92 against sensitivity 1)
            with Isolated(model):
                # (the engine's own copies, dropped as the call returns, inside the isolation)
                raw = per_example(model, loss_fn, owned_slice(inputs, start, stop),
                                  owned_slice(targets, start, stop))
            with exact_float32():
                grads = strategy.transform(raw, state)
                reducer.add_chunk(grads, torch.full((stop - start,), math.nan, device=device))
        grads, norms, weights, _ = reducer.result()
    info = {"engine": "naive" if isinstance(engine, NaiveEngine) else "vmap",
            "requested": engine.name,
            "fallback": None if engine.name in ("vmap", "naive") else
            "P-GRAD strategy: per-example gradients are materialized (vmap)"}
    return EngineResult(grads=grads, norms=norms, weights=weights, loss_sum=math.nan,
                        engine_info=info)


def nonprivate_step_grads(
    model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn
) -> dict[str, Any]:
    """Mean-loss gradients of an ordinary (non-private) step, for baselines and benchmarks."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    loss = loss_fn(call_model(model, inputs), targets).mean()
    with no_compiled_autograd():
        gs = torch.autograd.grad(loss, list(params.values()))
    return dict(zip(params, gs))
