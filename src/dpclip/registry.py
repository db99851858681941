"""One registry helper for every name-to-object table: strategies, models, datasets, engines.

Strings exist only at the CLI/config boundary (design rule 8): a :class:`Registry` maps a name to
a typed entry, refuses a second entry under the same name, lists its entries, and fails on an
unknown name with the argument it came from, the closest names (difflib) and every valid name.
:func:`coerce` is the one converter from CLI/TOML values (strings, lists) to the type a
parameter declares (``float``, ``int``, ``bool``, ``str``, ``tuple[int, ...]``, ``X | None``).

Privacy: none of this touches data; the names and parameters are public configuration.

This module imports nothing from dpclip but :mod:`dpclip.errors` (every room may use it).
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar, Generic, TypeVar, Union

from dpclip.errors import did_you_mean, unknown_name

__all__ = ["KNOWN_PROGRAMS", "OptionsEntry", "Registry", "coerce", "coerce_all",
           "keyword_options", "unknown_options"]

#: dpclip's own model classes whose ``forward`` the ghost engine proves by its code (a "known
#: tree", docs/engines.md), each with that forward function: filled by :mod:`dpclip.models` when it
#: is imported, read by the engine. Trust is by identity (the class object and its function),
#: never by a name or a file (a user class can claim dpclip's file name: twenty-ninth hostile
#: review). Not an extension point.
KNOWN_PROGRAMS: dict[type, Any] = {}

E = TypeVar("E")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class Registry(Mapping[str, E], Generic[E]):
    """Named entries of one kind, in registration order (a read-only ``Mapping``).

    Args:
        kind: the singular noun used in messages (``"strategy"``, ``"model"``, ...).

    Edge cases: registering a name twice raises ``ValueError`` (two entries under one name would
    make a config mean two things); :meth:`get` on an unknown name raises ``ValueError`` with
    "did you mean" and the sorted valid names; ``None`` and non-strings are unknown names.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, E] = {}

    def register(self, entry: E, name: str | None = None) -> E:
        """Add ``entry`` under ``name`` (default: ``entry.name``) and return it."""
        key = name if name is not None else getattr(entry, "name")
        if key in self._entries:
            raise ValueError(f"{self.kind} {key!r} is already registered")
        self._entries[key] = entry
        return entry

    def get(self, name: Any, default: Any = None) -> E | Any:  # type: ignore[override]
        """``Mapping.get``: the entry, or ``default`` for an unknown name (no error)."""
        return self._entries.get(name, default) if isinstance(name, str) else default

    def lookup(self, name: Any, where: str = "") -> E:
        """The entry registered as ``name``; ``ValueError`` naming ``where`` (e.g.
        ``"TrainConfig: "``), the closest names and the valid ones when there is none."""
        if not isinstance(name, str) or name not in self._entries:
            raise ValueError(f"{where}{unknown_name(self.kind, name, self._entries)}")
        return self._entries[name]

    def entries(self) -> list[E]:
        """All entries, sorted by name."""
        return [self._entries[k] for k in sorted(self._entries)]

    def __getitem__(self, name: str) -> E:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._entries)})"


class OptionsEntry:
    """Mixin of a registry entry built by a function whose keyword-only parameters are its
    options (a model builder, a dataset loader). Subclasses set ``kind`` and ``name`` and
    return the function from :meth:`factory`."""

    kind: ClassVar[str] = "entry"
    name: str

    def factory(self) -> Callable[..., Any]:
        raise NotImplementedError

    def options(self) -> dict[str, Any]:
        """The options (keyword-only parameters) with their defaults."""
        return keyword_options(self.factory())

    def coerce_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """``options`` checked against :meth:`options` (an unknown name fails, with the closest
        and the valid ones) and converted to the declared types (:func:`coerce`)."""
        owner = f"{self.kind} {self.name!r}"
        unknown_options(owner, options, self.options())
        return coerce_all(options, typing.get_type_hints(self.factory()), owner)


def keyword_options(fn: Callable[..., Any]) -> dict[str, Any]:
    """A builder's options: its keyword-only parameters with their defaults."""
    return {p.name: p.default for p in inspect.signature(fn).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}


def unknown_options(owner: str, given: Iterable[str], valid: Iterable[str],
                    label: str = "option") -> None:
    """Raise ``ValueError`` when ``given`` names a parameter not in ``valid``: ``model 'mlp' has
    no option(s) hiden (did you mean 'hidden'?); valid options: activation, hidden, ...``."""
    valid = sorted(valid)
    unknown = sorted(set(given) - set(valid))
    if unknown:
        raise ValueError(
            f"{owner} has no {label}(s) {', '.join(unknown)}{did_you_mean(unknown[0], valid)}; "
            f"valid {label}s: {', '.join(valid) or '(none)'}")


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", str(hint))


def _a(hint: Any) -> str:
    name = _type_name(hint)
    return ("an " if name[:1] in "aeiou" else "a ") + name


def coerce(value: Any, hint: Any, name: str, owner: str, label: str = "option") -> Any:
    """Convert a CLI/config ``value`` to the declared type ``hint`` of parameter ``name``.

    Strings become ``int``, ``float`` or ``bool`` (``true/false/yes/no/on/off/1/0``); ``"none"``
    or ``None`` is ``None`` for an optional (``X | None``) parameter; a comma-separated string or
    a list becomes a tuple for a ``tuple[...]`` parameter, item by item; an ``int`` becomes a
    ``float`` for a ``float`` parameter. Composite or unannotated parameters keep the value.

    Raises ``ValueError`` naming ``owner`` (e.g. ``"model 'mlp'"``), the ``label`` and ``name``
    and the expected type when the value does not convert.
    """
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
            return None
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else Any
        origin = typing.get_origin(hint)
    if origin is tuple:
        (item,) = typing.get_args(hint)[:1] or (Any,)
        if isinstance(value, str):
            value = [p for p in value.strip().strip("()[]").split(",") if p.strip()]
        if not isinstance(value, (list, tuple)):
            raise ValueError(
                f"{owner}: {label} {name} must be a tuple, got {value!r} (e.g. {name}=(64, 64) "
                f"or, on the command line, {name}=64,64)")
        return tuple(coerce(v, item, name, owner, label) for v in value)
    if isinstance(value, str) and hint in (int, float, bool):
        text = value.strip()
        try:
            if hint is bool:
                if text.lower() in _TRUE + _FALSE:
                    return text.lower() in _TRUE
                raise ValueError(text)
            return hint(text)
        except ValueError:
            raise ValueError(f"{owner}: {label} {name}={value!r} is not a valid "
                             f"{_type_name(hint)}") from None
    if isinstance(value, str) and hint is str:
        return value.strip()
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float) and (isinstance(value, bool) or not isinstance(value, hint)):
        raise ValueError(f"{owner}: {label} {name}={value!r} must be {_a(hint)}")
    return value


def coerce_all(values: Mapping[str, Any], hints: Mapping[str, Any], owner: str,
               label: str = "option") -> dict[str, Any]:
    """:func:`coerce` every item of ``values`` with its hint (``Any`` when undeclared)."""
    return {k: coerce(v, hints.get(k, Any), k, owner, label) for k, v in values.items()}
