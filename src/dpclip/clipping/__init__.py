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
