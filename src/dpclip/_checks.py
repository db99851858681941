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


def library_object(value: Any, cls: type, where: str) -> Any:
    """A fresh ``cls`` built from the fields of ``value``, which must be exactly a ``cls`` (a
    frozen dataclass of the library's) holding nothing but its fields.

    Such objects (an :class:`~dpclip.data.augment.Augmentation`, a
    :class:`~dpclip.data.features.Scattering`) run on the whole drawn batch before any engine sees
    it, so only the library's own tested per-example maps are accepted: not a subclass
    (forty-third hostile review), and not an instance whose ``__dict__`` holds a function that
    hides a method (``object.__setattr__(aug, "apply", f)``: the type check passed and
    ``x + 50 x.sum(0)`` moved the release by 20.2 C under every engine, hundred-and-thirty-ninth
    hostile review). ``TypeError`` naming ``where`` otherwise."""
    import dataclasses

    if type(value) is not cls:
        raise TypeError(
            f"{where}: {type(value).__name__} is not dpclip's own {cls.__name__} (a subclass's "
            "methods would run on the whole drawn batch before any engine checks them); put "
            "other transforms in the model, where the engines check them")
    names = [f.name for f in dataclasses.fields(cls)]
    extra = sorted(set(vars(value)) - set(names)) if hasattr(value, "__dict__") else []
    if extra or type(vars(value)) is not dict:
        raise TypeError(
            f"{where}: this {cls.__name__} carries attributes of its own ({', '.join(extra)}): "
            "one set on the instance hides the library's method of the same name, which runs on "
            f"the whole drawn batch. Pass a {cls.__name__} built by its constructor (or its "
            "text form) unchanged")
    # every field a plain value of Python's own types (not a subclass: a `flip` whose __bool__
    # ran inside Augmentation.apply, or a float subclass whose __float__ ran inside
    # PrivateCentre.release, reached the private batch through the caller's frame: 15.2 C and
    # 20.2 C, hundred-and-forty-second hostile review)
    for n in names:
        v = vars(value)[n]
        if type(v) not in (bool, int, float, str, type(None)):
            raise TypeError(
                f"{where}: {cls.__name__}.{n} is a {type(v).__name__}, not a plain bool, int, "
                f"float or str: the library's code reads it on the private data. Build the "
                f"{cls.__name__} from plain values")
    return cls(**{n: vars(value)[n] for n in names})
