"""Clipping strategies: frozen dataclasses with explicit state, registered by name."""

from dpclip.clipping.base import (
    ClippingStrategy,
    Release,
    State,
    StepContext,
    StrategyBase,
    finite_or_inf,
)
from dpclip.clipping.capabilities import Capabilities, capabilities_of
from dpclip.clipping.fixed import FixedClip
from dpclip.clipping.registry import (
    STRATEGIES,
    StrategyEntry,
    list_strategies,
    make_strategy,
    register,
)

# importing the built-in strategy modules registers them (the bound-based ones are registered by
# dpclip.lipschitz, a room above this one, imported by dpclip/__init__.py)
from dpclip.clipping import (  # noqa: E402,F401,I001 - in the order they always registered
    normalize, layerwise, schedules, quantile, vdv, adaclip)

__all__ = [
    "STRATEGIES",
    "Capabilities",
    "ClippingStrategy",
    "FixedClip",
    "Release",
    "State",
    "StepContext",
    "StrategyBase",
    "StrategyEntry",
    "capabilities_of",
    "finite_or_inf",
    "list_strategies",
    "make_strategy",
    "register",
]
