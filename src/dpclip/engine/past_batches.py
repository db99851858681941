"""The registry of past batches: tensors that depended on a batch in an earlier traced call (or
the caller's own batch tensors, which the engine ran copies of) and are still alive, held weakly;
every later trace reads them as MIXED (:mod:`dpclip.engine.separable`). Its own module, below
:mod:`~dpclip.engine.batch_symbol` (whose proof runs with the registry empty:
:func:`past_batches_hidden`) and :mod:`~dpclip.engine.separable`."""

from __future__ import annotations

import weakref
from typing import Any, Iterator

from torch import Tensor

from dpclip._ident import ident
from dpclip.engine import _cm

__all__ = ["mark_past_batch", "past_batches_hidden"]

_MISSING = object()


class _IdMap:
    """A map keyed by tensor identity that does not keep its keys alive (the tracer's layouts must
    not hold a forward's activations): entries are ``ident(t) -> (weakref to t, value)``, and a
    lookup counts only when the weak reference still points to ``t`` itself, so that an id reused
    by a new tensor after the old one died never inherits the old entry. The same contract as
    :class:`torch.utils.weak.WeakIdKeyDictionary`, without building a key object per lookup (the
    tracer does several lookups per traced operation)."""

    __slots__ = ("d",)

    def __init__(self) -> None:
        self.d: dict[int, tuple[Any, Any]] = {}

    def get(self, t: Any, default: Any = None) -> Any:
        e = self.d.get(ident(t))
        return e[1] if e is not None and e[0]() is t else default

    def __contains__(self, t: Any) -> bool:
        e = self.d.get(ident(t))
        return e is not None and e[0]() is t

    def __getitem__(self, t: Any) -> Any:
        e = self.d.get(ident(t))
        if e is None or e[0]() is not t:
            raise KeyError(t)
        return e[1]

    def __setitem__(self, t: Any, value: Any) -> None:
        self.d[ident(t)] = (weakref.ref(t), value)

    def __delitem__(self, t: Any) -> None:
        if self.pop(t, _MISSING) is _MISSING:
            raise KeyError(t)

    def pop(self, t: Any, default: Any = None) -> Any:
        e = self.d.get(ident(t))
        if e is None or e[0]() is not t:
            return default
        del self.d[ident(t)]
        return e[1]

    def __len__(self) -> int:
        return len(self.d)

    def items(self) -> list[tuple[Any, Any]]:
        """The live entries (dead ones are dropped)."""
        got = []
        for k, (ref, v) in list(self.d.items()):
            t = ref()
            if t is None:
                del self.d[k]
            else:
                got.append((t, v))
        return got


#: tensors that depended on the batch in an earlier traced call and are still alive (weakly held)
_STALE = _IdMap()


def mark_past_batch(tensors: Any) -> None:
    """Remember ``tensors`` (weakly) as data of a past batch, MIXED in every later trace, as the
    tracer does with what a traced call's batch touched: the caller's own tensors when the engine
    ran copies of them (a chunk padded to the row block, ``dpclip.engine.batch.pad_rows``)."""
    for t in tensors:
        if isinstance(t, Tensor):
            _STALE[t] = True


@_cm.contextmanager
def past_batches_hidden() -> Iterator[None]:
    """Around the batch-size proof's run of the user's forward (``torch.export``, on a public
    stand-in, with no tracer watching what it reads): the registry of past and current batches
    (:data:`_STALE`) is empty, its entries kept in this frame and put back after. A forward that
    walked the registry read the step's own batch there (a value taken with torch's dispatch
    switched off) and made it a literal of the proved program, which the real run then matched:
    3.5-6.0 C under compiled, ghost, auto and make_private (hundred-and-seventieth hostile
    review)."""
    kept = dict(_STALE.d)
    _STALE.d.clear()
    try:
        yield
    finally:
        made = _STALE.d.copy()  # (registered during the proof: kept too)
        _STALE.d.clear()
        _STALE.d.update(kept)
        _STALE.d.update(made)
