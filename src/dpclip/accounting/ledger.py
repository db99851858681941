"""The privacy ledger: an append-only, run-length compressed record of per-step DP events.

A training run records one ``dpclip.events`` event per optimizer step (``Ledger.record``); the
accountant (``dpclip.accounting.compute_epsilon``) is a pure function of the ledger. Consecutive
identical events are stored once with a count, so a 100k-step run with a constant mechanism is a
single entry, and the ledger is small enough to live in checkpoints and in the SQLite store
(``to_dict`` / ``from_dict``, JSON friendly).

``len(ledger)`` and ``ledger.steps`` are the number of recorded *steps*, never the number of
distinct groups (the Opacus ``len(accountant)`` confusion, anchors P10). A release made before the
first step (a private preprocessing statistic, e.g. the centre of the dataset option
``centre="private"``) is recorded first and counts as one entry: such a run's ledger holds
``optimizer steps + 1``.
"""

from __future__ import annotations

import typing
from typing import Any

from dpclip.events import ComposedEvent, DpEvent, SelfComposedEvent, event_from_dict

__all__ = ["Ledger", "is_dp_event"]

_EVENT_TYPES = typing.get_args(DpEvent)  # every event type, as dpclip.events declares them

#: Version tag written by ``Ledger.to_dict`` (bump on an incompatible change of the format).
LEDGER_FORMAT = 1


def is_dp_event(obj: object) -> bool:
    """True when ``obj`` is one of the ``dpclip.events`` event types."""
    return isinstance(obj, _EVENT_TYPES)


def _check_count(count: object, where: str) -> int:
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"{where}: count must be an int >= 0, got {count!r}")
    return count


class Ledger:
    """Append-only record of the DP events released by a run, one (or ``count``) step at a time.

    Usage::

        ledger = Ledger()
        ledger.record(PoissonSampledEvent(q, GaussianEvent(sigma)))   # once per optimizer step
        epsilon(ledger, delta=1e-5)                                    # dpclip.accounting.epsilon

    Privacy: the ledger only stores the events; the events say everything the accountant needs
    (sampling scheme and rate, noise multipliers, auxiliary Gaussian queries), so the epsilon of a
    run is reproducible from its stored ledger alone.

    Edge cases: ``record(event, 0)`` records nothing; a non-event or a negative / non-int count
    raises ``TypeError`` / ``ValueError``. Equality compares the run-length entries, which are
    canonical (two ledgers recording the same sequence of steps compare equal however the steps
    were batched into ``record`` calls).
    """

    __slots__ = ("_entries", "_steps")

    def __init__(self) -> None:
        self._entries: list[list[Any]] = []  # [event, count] pairs; counts >= 1
        self._steps = 0

    # -- recording ---------------------------------------------------------------------------
    def record(self, event: DpEvent, count: int = 1) -> None:
        """Append ``count`` steps that each released ``event``.

        Raises ``TypeError`` if ``event`` is not a ``dpclip.events`` event and ``ValueError``
        if ``count`` is not an int >= 0.
        """
        if not is_dp_event(event):
            raise TypeError(
                f"Ledger.record: event must be a dpclip.events event (GaussianEvent, "
                f"PoissonSampledEvent, ...), got {type(event).__name__}: {event!r}"
            )
        count = _check_count(count, "Ledger.record")
        if count == 0:
            return
        if self._entries and self._entries[-1][0] == event:
            self._entries[-1][1] += count
        else:
            self._entries.append([event, count])
        self._steps += count

    # -- views -------------------------------------------------------------------------------
    @property
    def entries(self) -> tuple[tuple[DpEvent, int], ...]:
        """The run-length compressed history: ``((event, count), ...)`` in recording order."""
        return tuple((e, c) for e, c in self._entries)

    @property
    def steps(self) -> int:
        """Total number of recorded steps (the sum of all counts)."""
        return self._steps

    def __len__(self) -> int:
        """Number of recorded steps (NOT the number of distinct entries)."""
        return self._steps

    def __bool__(self) -> bool:
        return self._steps > 0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Ledger):
            return NotImplemented
        return self._entries == other._entries

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"Ledger(steps={self._steps}, entries={self.entries!r})"

    def copy(self) -> "Ledger":
        """An independent copy (events are immutable, so this is cheap)."""
        new = Ledger()
        new._entries = [[e, c] for e, c in self._entries]
        new._steps = self._steps
        return new

    def to_dp_event(self) -> ComposedEvent:
        """The whole run as one event: ``ComposedEvent(SelfComposedEvent(event, count), ...)``.

        An empty ledger gives ``ComposedEvent(())``, which costs no privacy.
        """
        return ComposedEvent(tuple(SelfComposedEvent(e, c) for e, c in self._entries))

    # -- serialization -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (for checkpoints and the results store); inverse of ``from_dict``."""
        return {
            "format": LEDGER_FORMAT,
            "steps": self._steps,
            "entries": [{"event": e.to_dict(), "count": c} for e, c in self._entries],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Ledger":
        """Rebuild a ledger written by ``to_dict``.

        Raises ``ValueError`` on an unknown format version, a malformed entry, or a ``steps``
        field that disagrees with the entries (a corrupted checkpoint must not be trusted).
        """
        if not isinstance(d, dict) or "entries" not in d:
            raise ValueError(
                "Ledger.from_dict: expected a dict with an 'entries' list (as written by "
                f"Ledger.to_dict), got {type(d).__name__}"
            )
        fmt = d.get("format", LEDGER_FORMAT)
        if fmt != LEDGER_FORMAT:
            raise ValueError(
                f"Ledger.from_dict: unsupported ledger format {fmt!r}; this dpclip reads format "
                f"{LEDGER_FORMAT}"
            )
        ledger = cls()
        for i, entry in enumerate(d["entries"]):
            try:
                event = event_from_dict(entry["event"])
                count = _check_count(entry["count"], f"Ledger.from_dict entry {i}")
            except (KeyError, TypeError) as err:
                raise ValueError(f"Ledger.from_dict: malformed entry {i}: {entry!r}") from err
            ledger.record(event, count)
        if "steps" in d and d["steps"] != ledger.steps:
            raise ValueError(
                f"Ledger.from_dict: 'steps' is {d['steps']!r} but the entries add up to "
                f"{ledger.steps} steps; the ledger is corrupted"
            )
        return ledger
