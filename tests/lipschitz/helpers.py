"""Brute-force oracles for the Lipschitz-bound tests (float64, independent of the analysis code)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, jacrev, vmap

DT = torch.float64


def jacobian_norm(f: Callable[[Tensor], Tensor], x: Tensor) -> float:
    """Spectral norm of the Jacobian of ``f`` at ``x`` (``f`` maps an example to an output)."""
    j = jacrev(f)(x)
    j = j.detach().reshape(-1, x.numel())
    return float(torch.linalg.svdvals(j)[0]) if j.numel() else 0.0


def explicit_matrix(linear_map: Callable[[Tensor], Tensor], shape: tuple[int, ...]) -> Tensor:
    """The matrix of a LINEAR map on inputs of ``shape`` (its Jacobian at 0)."""
    x = torch.zeros(shape, dtype=DT)
    j = jacrev(linear_map)(x)
    return j.reshape(-1, x.numel())


def random_ball(shape: tuple[int, ...], radius: float, n: int, gen: torch.Generator) -> Tensor:
    """``n`` points: random directions, norms spread over ``(0, radius]`` (half on the sphere)."""
    x = torch.randn((n, *shape), generator=gen, dtype=DT)
    norms = x.flatten(1).norm(dim=1).view(-1, *([1] * len(shape)))
    r = torch.rand((n, *([1] * len(shape))), generator=gen, dtype=DT)
    r[: n // 2] = 1.0
    return x / norms * radius * r


def project_ball(x: Tensor, radius: float) -> Tensor:
    norms = x.flatten(1).norm(dim=1).clamp_min(1e-300).view(-1, *([1] * (x.dim() - 1)))
    return x * torch.clamp(radius / norms, max=1.0)


def max_lipschitz_ratio(
    f: Callable[[Tensor], Tensor],
    shape: tuple[int, ...],
    scale: float,
    gen: torch.Generator,
    n: int = 16,
    steps: int = 40,
) -> float:
    """Adversarial lower bound of Lip(f): gradient ascent on ``||f(x+d) - f(x)|| / ||d||``."""
    x = (torch.randn((n, *shape), generator=gen, dtype=DT) * scale).requires_grad_(True)
    d = (torch.randn((n, *shape), generator=gen, dtype=DT) * 0.1 * scale).requires_grad_(True)
    opt = torch.optim.Adam([x, d], lr=0.05 * scale)
    best = 0.0
    for _ in range(steps):
        fx, fy = f(x), f(x + d)
        ratio = (fy - fx).flatten(1).norm(dim=1) / d.flatten(1).norm(dim=1).clamp_min(1e-12)
        best = max(best, float(ratio.detach().max()))
        opt.zero_grad()
        (-ratio.sum()).backward()
        opt.step()
    return best


def max_output_norm(
    f: Callable[[Tensor], Tensor],
    shape: tuple[int, ...],
    radius: float,
    gen: torch.Generator,
    n: int = 16,
    steps: int = 40,
) -> float:
    """Adversarial lower bound of ``sup_{||x|| <= radius} ||f(x)||`` (projected gradient ascent)."""
    x = random_ball(shape, radius, n, gen).requires_grad_(True)
    opt = torch.optim.Adam([x], lr=0.05 * radius)
    best = 0.0
    for _ in range(steps):
        out = f(x).flatten(1).norm(dim=1)
        best = max(best, float(out.detach().max()))
        opt.zero_grad()
        (-out.sum()).backward()
        opt.step()
        with torch.no_grad():
            x.copy_(project_ball(x, radius))
    with torch.no_grad():
        best = max(best, float(f(x).flatten(1).norm(dim=1).max()))
    return best


def per_example_grad_norms(
    model: nn.Module, loss_fn: nn.Module, x: Tensor, y: Tensor
) -> dict[str, Tensor]:
    """``{parameter name: (B,) per-example gradient norms}`` via ``vmap(grad)`` (differentiable
    in ``x``)."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}

    def one(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        out = functional_call(model, p, (xi[None],))
        return loss_fn(out, yi[None]).sum()

    grads = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    return {k: g.flatten(1).norm(dim=1) for k, g in grads.items()}
