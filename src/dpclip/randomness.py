"""Private randomness: the one object that owns the batch-sampling and noise generators.

The privacy of DP-SGD rests on two secrets: which examples were sampled at each step, and the
Gaussian noise added to each release. Whoever can replay them can subtract the noise and read off
the clipped gradient sum, so the real epsilon is infinite. :class:`PrivateRandomness` therefore

* draws the full state of both generators from the operating system's CSPRNG (``os.urandom``) in
  the default ``"secure"`` mode. (torch's ``Generator.manual_seed`` keeps only the low 32 bits of
  a seed, so ``manual_seed(secrets.randbits(64))`` would give only 2**32 possible noise streams: an
  attacker could enumerate them. We write all 624 words of the Mersenne Twister state instead:
  19,968 bits of OS entropy per generator.)
* never prints, logs or stores its seeds or state anywhere but the private checkpoint
  (:meth:`state_dict`), which lets a killed run resume with the exact same continuation;
* offers ``"reproducible"`` mode only on explicit request (``TrainConfig(reproducible_noise=True)``,
  ``--reproducible-noise``): both generators are derived from the public seed, as dpclip did for
  every run before 0.2 (``2 seed + 1`` for sampling, ``2 seed + 2`` for noise), so research runs
  can be replayed.
  Such runs are NOT private against anyone who knows the seed, and every summary, database row,
  report and evidence table says so (:meth:`describe`).

What secure mode does not cover (documented in docs/privacy.md): torch's CPU generator is a
Mersenne Twister, not a cryptographic generator (its state could in principle be recovered from
624 consecutive raw outputs, which an attacker never observes here: only sums of Gaussian noise
with gradients); and Gaussian samples are floating-point numbers, whose low-order bits can leak
(the floating-point attacks of Mironov 2012 and Jin et al. 2022 on Laplace and Gaussian
samplers). dpclip does not implement a discrete Gaussian: see docs/privacy.md for why.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np
import torch

__all__ = ["MODES", "PrivateRandomness", "secure_generator", "seeded_generator"]

#: ``secure``: OS entropy (the default); ``reproducible``: derived from the public seed (NOT private)
MODES = ("secure", "reproducible")

_MT_WORDS = 624  # words of the Mersenne Twister state (32 bits each)


@functools.lru_cache(maxsize=1)
def _mt_state_offset() -> int:
    """Byte offset of the 624 MT words (stored as uint64) in ``torch.Generator.get_state()``.

    Found and verified on this torch build: seed a generator and look for the MT initialisation
    sequence. Raises if the layout is not the one expected (a torch upgrade must not silently
    weaken the seeding)."""
    seed = 0x9E3779B9
    words = [seed]
    for j in range(1, 4):
        prev = words[-1]
        words.append((1812433253 * (prev ^ (prev >> 30)) + j) & 0xFFFFFFFF)
    g = torch.Generator()
    g.manual_seed(seed)
    raw = g.get_state().numpy().tobytes()
    for off in range(0, 64, 8):
        head = np.frombuffer(raw, dtype=np.uint64, count=4, offset=off)
        if [int(v) for v in head] == words and off + 8 * _MT_WORDS <= len(raw):
            return off
    raise RuntimeError(
        f"dpclip cannot seed torch {torch.__version__}'s CPU generator from OS entropy (unknown "
        "generator state layout); use the torch version pinned in constraints.txt"
    )


def secure_generator() -> torch.Generator:
    """A CPU ``torch.Generator`` whose whole Mersenne Twister state comes from ``os.urandom``."""
    off = _mt_state_offset()
    g = torch.Generator()
    g.manual_seed(0)  # a valid state to start from (left = 1: the next draw twists the new words)
    state = bytearray(g.get_state().numpy().tobytes())
    words = np.frombuffer(os.urandom(4 * _MT_WORDS), dtype=np.uint32).astype(np.uint64)
    if not words.any():  # the one degenerate MT state (probability 2**-19968)
        words[0] = 1
    state[off:off + 8 * _MT_WORDS] = words.tobytes()
    g.set_state(torch.frombuffer(state, dtype=torch.uint8).clone())
    check = np.frombuffer(g.get_state().numpy().tobytes(), dtype=np.uint64, count=_MT_WORDS,
                          offset=off)
    if not np.array_equal(check, words):
        raise RuntimeError("dpclip: torch rejected the OS-entropy generator state")
    return g


def seeded_generator(seed: int) -> torch.Generator:
    """A CPU ``torch.Generator`` from a (public) seed: reproducible, NOT secret."""
    g = torch.Generator()
    g.manual_seed(int(seed))
    return g


class PrivateRandomness:
    """The sampling and noise generators of one private run (see the module docstring).

    Build with :meth:`secure` (default everywhere) or :meth:`reproducible`. ``sampling`` draws the
    batches (handed to the sampler), ``noise`` every Gaussian release (handed to ``dp_step``);
    nothing else may draw private randomness. The ``repr`` shows the mode only.
    """

    __slots__ = ("mode", "noise", "sampling", "seed")

    def __init__(self, mode: str, sampling: torch.Generator, noise: torch.Generator,
                 seed: int | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"PrivateRandomness: mode must be one of {MODES}, got {mode!r}")
        self.mode, self.sampling, self.noise, self.seed = mode, sampling, noise, seed

    @classmethod
    def secure(cls) -> "PrivateRandomness":
        """Both generators from OS entropy (the default)."""
        return cls("secure", secure_generator(), secure_generator())

    @classmethod
    def reproducible(cls, seed: int) -> "PrivateRandomness":
        """Both generators from the public ``seed`` (research only; NOT private against anyone who
        knows the seed). The seeds are derived as dpclip derived them before 0.2 (when every run
        was seeded), so a run is replayed exactly by the same dpclip version."""
        seed = int(seed)
        return cls("reproducible", seeded_generator(2 * seed + 1), seeded_generator(2 * seed + 2),
                   seed)

    @classmethod
    def for_run(cls, reproducible_noise: bool, seed: int) -> "PrivateRandomness":
        return cls.reproducible(seed) if reproducible_noise else cls.secure()

    @property
    def is_private(self) -> bool:
        """False in reproducible mode: the noise is a function of a public seed."""
        return self.mode == "secure"

    def describe(self) -> dict[str, Any]:
        """Public facts for run summaries (never the seed material or state)."""
        if self.is_private:
            return {"randomness": "secure", "private_against_seed": True}
        return {
            "randomness": "reproducible",
            "private_against_seed": False,
            "randomness_warning": "noise and batch sampling were derived from the published seed: "
                                  "NOT private against anyone who knows the seed",
        }

    def state_dict(self) -> dict[str, Any]:
        """PRIVATE: the generators' full state, for the run's checkpoint only."""
        return {"mode": self.mode, "sampling": self.sampling.get_state(),
                "noise": self.noise.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("mode") != self.mode:
            raise ValueError(
                f"checkpoint randomness mode {state.get('mode')!r} does not match this run's "
                f"{self.mode!r}"
            )
        self.sampling.set_state(state["sampling"])
        self.noise.set_state(state["noise"])

    def __repr__(self) -> str:
        return f"PrivateRandomness(mode={self.mode!r})"
