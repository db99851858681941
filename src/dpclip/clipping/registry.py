"""Registry of clipping strategies: typed entries, strings only at the CLI/config boundary."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Mapping

from dpclip.clipping.base import ClippingStrategy
from dpclip.clipping.fixed import FixedClip

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


STRATEGIES: dict[str, StrategyEntry] = {}


def register(entry: StrategyEntry) -> StrategyEntry:
    if entry.name in STRATEGIES:
        raise ValueError(f"strategy {entry.name!r} is already registered")
    STRATEGIES[entry.name] = entry
    return entry


register(
    StrategyEntry(
        name="fixed",
        cls=FixedClip,
        paper="Abadi et al., Deep learning with differential privacy, CCS 2016",
        summary="flat per-example clipping at a fixed threshold clip_norm",
    )
)


def list_strategies() -> list[StrategyEntry]:
    return [STRATEGIES[k] for k in sorted(STRATEGIES)]


def _convert(value: Any, annotation: Any, name: str, strategy: str) -> Any:
    """Convert a CLI/config string to the field's declared type."""
    if not isinstance(value, str):
        return value
    ann = annotation if not isinstance(annotation, str) else annotation
    text = value.strip()
    try:
        if ann in (float, "float"):
            return float(text)
        if ann in (int, "int"):
            return int(text)
        if ann in (bool, "bool"):
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if ann in (str, "str"):
            return text
    except ValueError:
        raise ValueError(
            f"strategy {strategy!r}: parameter {name}={value!r} is not a valid {ann}"
        ) from None
    # composite annotations (e.g. "float | None", tuples): try float, then leave the string
    if text.lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        return text


def make_strategy(name: str, params: Mapping[str, Any] | None = None) -> ClippingStrategy:
    """Build a registered strategy from its name and (possibly string-valued) parameters.

    Unknown names and unknown parameters fail with the list of valid choices.
    """
    params = dict(params or {})
    if name not in STRATEGIES:
        from dpclip.errors import unknown_name

        raise ValueError(unknown_name("strategy", name, STRATEGIES))
    entry = STRATEGIES[name]
    if hasattr(entry.cls, "from_params"):  # wrappers (schedules) parse their own parameters
        return entry.cls.from_params(params)
    fields = {f.name: f for f in dataclasses.fields(entry.cls)}
    hints = typing.get_type_hints(entry.cls)
    unknown = sorted(set(params) - set(fields))
    if unknown:
        raise ValueError(
            f"strategy {name!r} has no parameter(s) {unknown}; valid parameters: "
            f"{', '.join(sorted(fields)) or '(none)'}"
        )
    kwargs = {k: _convert(v, hints.get(k, fields[k].type), k, name) for k, v in params.items()}
    return entry.cls(**kwargs)


def _load_builtin_strategies() -> None:
    """Import the modules whose import registers the built-in strategies."""
    import importlib

    for module in ("normalize", "layerwise", "schedules", "quantile", "vdv", "adaclip"):
        importlib.import_module(f"dpclip.clipping.{module}")
    # bound-based strategies live with the Lipschitz analysis they need (they use torch.nn)
    importlib.import_module("dpclip.lipschitz.strategy")


_load_builtin_strategies()
