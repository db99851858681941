"""Small argument predicates and checks shared across rooms (a leaf: imports nothing from
dpclip). The ``check_*`` functions raise ``ValueError`` naming the argument."""

from __future__ import annotations

import math
from typing import Any


def is_positive_int(value: Any, minimum: int = 1) -> bool:
    """``value`` is an ``int`` (not a ``bool``) and ``>= minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def positive_ints(values: Any) -> bool:
    """``values`` is a non-empty sequence of ints ``>= 1`` (no bools)."""
    values = tuple(values)
    return bool(values) and all(is_positive_int(v) for v in values)


def check_integer(name: str, value: Any, minimum: int, owner: str = "") -> None:
    """Raise ``ValueError("{owner}{name} must be an integer >= {minimum}, got ...")`` unless
    ``value`` is an integral number ``>= minimum`` (``8`` or ``8.0``; never a ``bool``)."""
    try:
        ok = not isinstance(value, bool) and int(value) == value and value >= minimum
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise ValueError(f"{owner}{name} must be an integer >= {minimum}, got {value!r}")


def check_nonnegative(name: str, value: Any, owner: str = "") -> None:
    """Raise ``ValueError("{owner}{name} must be finite and >= 0, got ...")`` unless ``value`` is a
    finite number ``>= 0``."""
    try:
        ok = math.isfinite(value) and value >= 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{owner}{name} must be finite and >= 0, got {value!r}")


def check_open_unit(name: str, value: Any, owner: str = "") -> None:
    """Raise ``ValueError("{owner}{name} must be in (0, 1), got ...")`` unless ``0 < value < 1``."""
    try:
        ok = 0.0 < value < 1.0
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"{owner}{name} must be in (0, 1), got {value!r}")
