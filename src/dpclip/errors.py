"""Shared error and warning helpers: "did you mean" suggestions and dpclip's warning categories.

Every bad input the library can detect fails with a message that names the argument and the fix
(``docs/errors.md`` lists them, each with its test). Inputs that are legal but almost certainly
not what the user meant (a privacy budget that ends training early, a noise multiplier so large
that the model cannot learn) raise a :class:`DpclipWarning` subclass instead; the CLI prints them
as ``dpclip <command>: warning: ...`` lines on stderr.

This module imports nothing from dpclip (every layer may use it).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "BudgetWarning",
    "DeprecatedSpellingWarning",
    "DpclipWarning",
    "EngineFallbackWarning",
    "NoiseWarning",
    "did_you_mean",
    "unknown_name",
]


class DpclipWarning(UserWarning):
    """Base class of dpclip's warnings (filter them with ``warnings.simplefilter``)."""


class BudgetWarning(DpclipWarning):
    """The epsilon cap stops training before the planned number of steps."""


class EngineFallbackWarning(DpclipWarning):
    """``engine="auto"`` ran a step on a slower engine (vmap) than asked for; said once per
    reason, naming the layers (no privacy issue: the same clipping, slower and with more memory)."""


class NoiseWarning(DpclipWarning):
    """The noise multiplier is so large that the model will not learn (no privacy issue)."""


class DeprecatedSpellingWarning(DpclipWarning, FutureWarning):
    """An old spelling that is still read (e.g. the clipping unit inside a strategy's
    parameters); the message names the new one. A ``FutureWarning``: shown by default to users of
    the API, the CLI and specs alike."""


def did_you_mean(name: object, valid: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the closest valid names (difflib), else ``""``."""
    choices = sorted({str(v) for v in valid})
    close = difflib.get_close_matches(str(name), choices, n=2, cutoff=0.6)
    if not close:
        lowered = {c.lower(): c for c in choices}
        hit = lowered.get(str(name).lower().replace("_", "-"))
        close = [hit] if hit else []
    if not close:
        return ""
    return " (did you mean " + " or ".join(repr(c) for c in close) + "?)"


def unknown_name(kind: str, name: object, valid: Iterable[str]) -> str:
    """The message for an unknown registry name: ``unknown model 'mpl' (did you mean 'mlp'?);
    valid models: ...``; ``kind`` is the singular noun (``model``, ``strategy``, ...)."""
    choices = sorted({str(v) for v in valid})
    plural = kind[:-1] + "ies" if kind.endswith("y") else kind + "s"
    return (f"unknown {kind} {name!r}{did_you_mean(name, choices)}; valid {plural}: "
            f"{', '.join(choices)}")
