"""Registry of clipping strategies: typed entries, strings only at the CLI/config boundary."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Mapping

from dpclip.clipping.base import ClippingStrategy
from dpclip.clipping.fixed import FixedClip
from dpclip.registry import Registry, coerce_all, unknown_options

__all__ = ["STRATEGIES", "StrategyEntry", "list_strategies", "make_strategy", "register"]


@dataclass(frozen=True)
class StrategyEntry:
    """A registered strategy: its class, the paper it implements and what it needs."""

    name: str
    cls: type
    paper: str
    summary: str
    #: "norm": per-example-norm based; "bound": sensitivity certified from the weights
    kind: str = "norm"

    def parameters(self) -> dict[str, Any]:
        """Hyper-parameters with their defaults."""
        if hasattr(self.cls, "from_params"):  # wrappers describe themselves in CLI form
            return dict(self.cls().describe())
        return {
            f.name: (f.default if f.default is not dataclasses.MISSING else None)
            for f in dataclasses.fields(self.cls)
        }


#: Registered strategies by name; ``dpclip.lipschitz`` registers the bound-based ones when
#: ``dpclip`` is imported (``dpclip/__init__.py``), so this room never imports the one above it.
STRATEGIES: Registry[StrategyEntry] = Registry("strategy")


def register(entry: StrategyEntry) -> StrategyEntry:
    """Add ``entry`` to :data:`STRATEGIES`; a name can be registered once."""
    return STRATEGIES.register(entry)


register(
    StrategyEntry(
        name="fixed",
        cls=FixedClip,
        paper="Abadi et al., Deep learning with differential privacy, CCS 2016",
        summary="flat per-example clipping at a fixed threshold clip_norm",
    )
)


def list_strategies() -> list[StrategyEntry]:
    """All registered strategies, sorted by name."""
    return STRATEGIES.entries()


def make_strategy(name: str, params: Mapping[str, Any] | None = None) -> ClippingStrategy:
    """Build a registered strategy from its name and (possibly string-valued) parameters.

    Unknown names and unknown parameters fail with the list of valid choices.
    """
    params = dict(params or {})
    entry = STRATEGIES.lookup(name)
    if hasattr(entry.cls, "from_params"):  # wrappers (schedules) parse their own parameters
        return entry.cls.from_params(params)
    fields = {f.name: f for f in dataclasses.fields(entry.cls)}
    hints = typing.get_type_hints(entry.cls)
    unknown_options(f"strategy {name!r}", params, fields, "parameter")
    kwargs = coerce_all(params, {k: hints.get(k, f.type) for k, f in fields.items()},
                        f"strategy {name!r}", "parameter")
    return entry.cls(**kwargs)
