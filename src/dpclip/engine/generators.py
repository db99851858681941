"""The model's random generators: the engine's own for each chunk that runs user code (issue 31).

A forward or loss can write its examples into torch's global generators, with torch functions and
Python dispatch off so that no trace sees it: ``torch.manual_seed(int(x[0].sum() * 1e6))``, or
``set_rng_state`` with an example's value in the CPU generator's cached normal sample. The next
call's draws (dropout masks, ``randn``) are then a function of the previous call's examples. The
proved-program match checks a draw's generator against the state the same call started from, so
it cannot see a state planted by the call before. Measured on 25003bb (hostile review of the chunk
of one): LOO 1.63 C (dropout, seeded from the example) and 2.51 C (the example's value planted in
the cached normal) under ghost and ``auto``, at ``max_physical_batch=1`` and over steps of one;
2.66 C against the bound 2 C for a replaced example between steps of two; after each
``make_private`` step the default generator held a training example's value verbatim (and the
trainer's checkpoint keeps that state).

:class:`OwnGenerators` runs a chunk under generators of its own. On entry it draws ONE 62-bit
seed ``s`` from the caller's default CPU generator (the one draw a chunk takes from that stream),
keeps the state of every default generator (CPU; each CUDA device once CUDA is initialised) and
seeds each from ``s``. On exit it puts every kept state back: whatever the chunk wrote into a
generator ends with it, and the next chunk starts from a seed drawn before any of its user code
ran. :meth:`OwnGenerators.adopt` does the same for the explicit generators that the proved
program draws from (a ``torch.Generator`` the model holds); :meth:`OwnGenerators.reseed` starts
every kept generator again from another seed derived from ``s`` (before the engine's own draws
that follow user code: the per-layer recomputation's dropout masks). Derived seeds are
``s`` mixed with a public counter (a 64-bit LCG step), so they are data-independent as ``s`` is.

Reproducibility: a seeded run stays reproducible (``s`` comes from the caller's default
generator); its draws inside the engine differ from an unguarded call's. The randomness of the
model's draws is not secret (DP-SGD's analysis does not need dropout masks to be secret, only
independent of the data); the noise of a release comes from :mod:`dpclip.randomness`, never
from these generators.

Not covered: generators the engine does not know (a generator held by the model whose draws the
proof did not record: its draws then do not match the proof and the step is refused), Python's
``random`` and NumPy's generators (their values reach the computation as Python numbers or
constants, which the proved-program match compares with the proof's), and the ``vmap`` engine's
explicit generators.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

__all__ = ["OwnGenerators"]

_MASK = (1 << 62) - 1


def _derived(seed: int, k: int) -> int:
    """The ``k``-th seed derived from ``seed`` (Knuth's MMIX LCG constants; public counter)."""
    return (seed * 6364136223846793005 + (2 * k + 1) * 1442695040888963407) & _MASK


def _defaults() -> list[torch.Generator]:
    gens = [torch.default_generator]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gens += list(torch.cuda.default_generators)
    return gens


class OwnGenerators:
    """Context manager: the chunk's own generators (module docstring)."""

    __slots__ = ("_kept", "_seed", "_k")

    def __init__(self) -> None:
        self._kept: list[tuple[torch.Generator, Any]] = []
        self._seed = 0
        self._k = 0

    def __enter__(self) -> "OwnGenerators":
        # the one draw from the caller's stream, before its state is kept (so that the next chunk
        # draws another seed)
        self._seed = int(torch.randint(0, _MASK, (), dtype=torch.int64,
                                       generator=torch.default_generator))
        self._kept = []
        self._k = 0
        self.adopt(_defaults())
        return self

    def adopt(self, gens: Iterable[torch.Generator]) -> None:
        """Keep the state of each generator of ``gens`` not kept yet, and seed it."""
        for g in gens:
            if any(g is h for h, _ in self._kept):
                continue
            self._kept.append((g, g.get_state()))
            g.manual_seed(self._next())

    def reseed(self) -> None:
        """Every kept generator started again from a fresh derived seed."""
        for g, _ in self._kept:
            g.manual_seed(self._next())

    def _next(self) -> int:
        self._k += 1
        return _derived(self._seed, self._k)

    def __exit__(self, *exc: Any) -> None:
        for g, state in reversed(self._kept):
            g.set_state(state)
        self._kept = []
