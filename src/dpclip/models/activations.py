"""Activations: tanh, ReLU and the tempered sigmoid of Papernot et al. (2021).

Reference: N. Papernot, A. Thakurta, S. Song, S. Chien, U. Erlingsson, "Tempered sigmoid
activations for deep learning with differential privacy", AAAI 2021 (arXiv 2007.14191).
Bounded activations keep per-example gradient norms small, so less signal is lost to clipping.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["ACTIVATIONS", "ActivationEntry", "TemperedSigmoid", "make_activation"]


class TemperedSigmoid(nn.Module):
    """``phi(x) = scale * sigmoid(inverse_temperature * x) - offset`` (Papernot et al. 2021).

    Parameter-free. ``(scale, inverse_temperature, offset) = (2, 2, 1)`` (the default) is
    ``tanh(x)`` exactly, since ``2 sigmoid(2x) - 1 = tanh(x)``. Lipschitz constant
    ``scale * inverse_temperature / 4``; range ``(-offset, scale - offset)``.
    """

    def __init__(
        self, scale: float = 2.0, inverse_temperature: float = 2.0, offset: float = 1.0
    ) -> None:
        super().__init__()
        for name, value in (("scale", scale), ("inverse_temperature", inverse_temperature)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(
                    f"TemperedSigmoid: {name} must be a positive number, got {value!r}"
                )
        if not (isinstance(offset, (int, float)) and math.isfinite(offset)):
            raise ValueError(f"TemperedSigmoid: offset must be a finite number, got {offset!r}")
        self.scale = float(scale)
        self.inverse_temperature = float(inverse_temperature)
        self.offset = float(offset)

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * torch.sigmoid(self.inverse_temperature * x) - self.offset

    def extra_repr(self) -> str:
        return (
            f"scale={self.scale}, inverse_temperature={self.inverse_temperature}, "
            f"offset={self.offset}"
        )


@dataclass(frozen=True)
class ActivationEntry:
    """A named activation: a factory of fresh (parameter-free) modules."""

    name: str
    description: str
    factory: Callable[..., nn.Module]
    #: names of the factory's parameters (only the tempered sigmoid has any)
    parameters: tuple[str, ...] = ()


ACTIVATIONS: dict[str, ActivationEntry] = {
    entry.name: entry
    for entry in (
        ActivationEntry("tanh", "hyperbolic tangent (Papernot et al.'s recommendation)", nn.Tanh),
        ActivationEntry("relu", "rectified linear unit (Abadi et al.'s baseline)", nn.ReLU),
        ActivationEntry(
            "tempered-sigmoid",
            "s*sigmoid(T*x)-o, Papernot et al. 2021",
            TemperedSigmoid,
            ("scale", "inverse_temperature", "offset"),
        ),
    )
}


def make_activation(
    name: str,
    *,
    scale: float | None = None,
    inverse_temperature: float | None = None,
    offset: float | None = None,
) -> nn.Module:
    """A fresh activation module by registry name.

    ``scale``, ``inverse_temperature`` and ``offset`` apply to ``"tempered-sigmoid"`` only
    (``None`` keeps its defaults 2, 2, 1); giving one with another activation is an error rather
    than being silently ignored.
    """
    if name not in ACTIVATIONS:
        raise ValueError(
            f"unknown activation {name!r}; valid activations: {', '.join(sorted(ACTIVATIONS))}"
        )
    entry = ACTIVATIONS[name]
    given = {
        k: v
        for k, v in (
            ("scale", scale),
            ("inverse_temperature", inverse_temperature),
            ("offset", offset),
        )
        if v is not None
    }
    stray = sorted(set(given) - set(entry.parameters))
    if stray:
        raise ValueError(
            f"option(s) {', '.join(stray)} only apply to activation='tempered-sigmoid', but "
            f"activation={name!r}; drop them or set activation='tempered-sigmoid'"
        )
    return entry.factory(**given)
