"""Small argument predicates shared by the model and data builders (their errors name the
argument themselves)."""

from __future__ import annotations

from typing import Any


def is_positive_int(value: Any, minimum: int = 1) -> bool:
    """``value`` is an ``int`` (not a ``bool``) and ``>= minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def positive_ints(values: Any) -> bool:
    """``values`` is a non-empty sequence of ints ``>= 1`` (no bools)."""
    values = tuple(values)
    return bool(values) and all(is_positive_int(v) for v in values)
