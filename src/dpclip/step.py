"""One differentially private step, the whole of it (design.md, "What one DP step is").

    norms, sum  <- engine(model, batch, weight_fn = strategy.weights(., state))
    S           <- sampler.sensitivity_factor * strategy.sensitivity(state)
    z           <- strategy.noise_multiplier(state, base)
    noisy       <- sum + N(0, (z S)^2)                 (dpclip.noise, the one place)
    grad        <- noisy / expected_batch_size         (public constant, never len(batch))
    state', ev  <- strategy.update(state, norms, ctx, release)
    event       <- sampler.step_event(compose(Gaussian(z), *ev))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dpclip.clipping.base import ClippingStrategy, State, StepContext
from dpclip.engine.base import Engine, LossFn, ParamGroups
from dpclip.events import ComposedEvent, DpEvent, GaussianEvent
from dpclip.noise import add_gaussian_noise, noise_std
from dpclip.sampling import Sampler

__all__ = ["StepOutput", "dp_step", "nonprivate_step_grads"]


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


class _Releaser:
    """The ``Release`` callback handed to strategies: noise from the step's generator, typed event."""

    def __init__(self, generator: torch.Generator, sensitivity_factor: int) -> None:
        self.generator = generator
        self.factor = sensitivity_factor

    def __call__(
        self, value: Tensor, sensitivity: float, noise_multiplier: float
    ) -> tuple[Tensor, DpEvent]:
        if not (sensitivity > 0):
            raise ValueError(f"release: sensitivity must be > 0, got {sensitivity!r}")
        std = noise_std(noise_multiplier, sensitivity * self.factor)
        noisy = add_gaussian_noise(value, std, self.generator)
        return noisy, GaussianEvent(noise_multiplier)


def dp_step(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
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
) -> StepOutput:
    """Compute one privatized gradient; does not touch the optimizer or ``p.grad``."""
    state = strategy.begin_step(state, ctx)
    frozen_state = state

    def weight_fn(norms: Tensor) -> Tensor:
        return strategy.weights(norms, frozen_state)

    result = engine.compute(model, loss_fn, inputs, targets, weight_fn, groups)
    sensitivity = sampler.sensitivity_factor * strategy.sensitivity(state)
    z = strategy.noise_multiplier(state, base_noise_multiplier)
    std = noise_std(z, sensitivity)
    denom = sampler.expected_batch_size
    grads = {
        name: add_gaussian_noise(g, std, generator) / denom for name, g in result.grads.items()
    }
    norms = result.norms if result.norms is not None else torch.empty(0)
    new_state, extra = strategy.update(
        state, norms, ctx, _Releaser(generator, sampler.sensitivity_factor)
    )
    inner: DpEvent = GaussianEvent(z) if not extra else ComposedEvent((GaussianEvent(z), *extra))
    return StepOutput(
        grads=grads,
        state=new_state,
        event=sampler.step_event(inner),
        noise_multiplier=z,
        sensitivity=sensitivity,
        batch_size=int(inputs.shape[0]),
        loss_sum=result.loss_sum,
        norms=result.norms,
    )


def nonprivate_step_grads(
    model: nn.Module, inputs: Tensor, targets: Tensor, loss_fn: LossFn
) -> dict[str, Any]:
    """Mean-loss gradients of an ordinary (non-private) step, for baselines and benchmarks."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    loss = loss_fn(model(inputs), targets).mean()
    gs = torch.autograd.grad(loss, list(params.values()))
    return dict(zip(params, gs))
