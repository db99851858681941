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
import hashlib
import os
import struct
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["MODES", "NOISE_KEY_BYTES", "PrivateRandomness", "philox_state", "rank_noise_generator",
           "read_philox_state", "secure_cuda_generator", "secure_generator", "seeded_generator"]

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
    return _mt_generator(os.urandom(4 * _MT_WORDS))


def _mt_generator(material: bytes) -> torch.Generator:
    """A CPU ``torch.Generator`` whose 624 Mersenne Twister words are ``material`` (2496 bytes:
    OS entropy, or the output of :func:`rank_noise_generator`'s key derivation)."""
    off = _mt_state_offset()
    g = torch.Generator()
    g.manual_seed(0)  # a valid state to start from (left = 1: the next draw twists the new words)
    state = bytearray(g.get_state().numpy().tobytes())
    words = np.frombuffer(material, dtype=np.uint32, count=_MT_WORDS).astype(np.uint64)
    if not words.any():  # the one degenerate MT state (probability 2**-19968)
        words[0] = 1
    state[off:off + 8 * _MT_WORDS] = words.tobytes()
    g.set_state(torch.frombuffer(state, dtype=torch.uint8).clone())
    check = np.frombuffer(g.get_state().numpy().tobytes(), dtype=np.uint64, count=_MT_WORDS,
                          offset=off)
    if not np.array_equal(check, words):
        raise RuntimeError("dpclip: torch rejected the OS-entropy generator state")
    return g


def seeded_generator(seed: int, device: "torch.device | str" = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` from a (public) seed: reproducible, NOT secret."""
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(int(seed))
    return g


# ------------------------------------------------------------------------------------ CUDA: Philox

#: bytes of torch's CUDA generator state: the 64-bit seed (the Philox key), then the 64-bit
#: Philox offset (``CUDAGeneratorImpl::get_state``: ``seed_size + offset_size``, little-endian)
PHILOX_STATE_BYTES = 16
#: the offset is where a generator's counter starts; torch requires a multiple of 4
#: (``set_philox_offset_per_thread``). A fresh secure generator starts below 2**62, so at least
#: 2**62 further offsets remain; :meth:`PrivateRandomness.before_release` re-keys from OS entropy
#: long before the 64-bit offset could wrap (REKEY_OFFSET).
_OFFSET_RANGE = 2**62
REKEY_OFFSET = 2**63 - 2**48


def philox_state(seed: int, offset: int) -> Tensor:
    """The 16-byte CUDA generator state ``(seed, offset)`` as a CPU uint8 tensor."""
    if not (0 <= seed < 2**64 and 0 <= offset < 2**63 and offset % 4 == 0):
        raise ValueError(f"philox_state: seed must be a 64-bit unsigned integer and offset a "
                         f"multiple of 4 below 2**63, got offset {offset}")
    raw = int(seed).to_bytes(8, "little") + int(offset).to_bytes(8, "little")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def read_philox_state(state: Tensor) -> tuple[int, int]:
    """``(seed, offset)`` of a 16-byte CUDA generator state; raises on any other layout."""
    if state.dtype != torch.uint8 or state.numel() != PHILOX_STATE_BYTES:
        raise RuntimeError(
            f"dpclip cannot read torch {torch.__version__}'s CUDA generator state (expected "
            f"{PHILOX_STATE_BYTES} bytes: 64-bit seed and 64-bit Philox offset, got "
            f"{state.numel()} {state.dtype}); use the torch version pinned in constraints.txt")
    raw = state.cpu().numpy().tobytes()
    return int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:], "little")


@functools.lru_cache(maxsize=None)
def _check_cuda_layout(device: str) -> None:
    """Verify on this torch build that a CUDA generator's state is ``(seed, offset)`` as
    :func:`philox_state` writes it, and that ``set_state`` takes the whole of it (a torch
    upgrade must not silently drop the secret key or offset). Raises otherwise."""
    g = torch.Generator(device=device)
    seed, offset = 0x0123456789ABCDEF, 4 * 0x0102030405
    g.set_state(philox_state(seed, offset))
    got = read_philox_state(g.get_state())
    if got != (seed, offset) or g.initial_seed() != seed or g.get_offset() != offset:
        raise RuntimeError(
            f"dpclip cannot seed torch {torch.__version__}'s CUDA generator from OS entropy "
            f"(unknown generator state layout: wrote seed/offset {seed:#x}/{offset:#x}, read "
            f"{got[0]:#x}/{got[1]:#x}); use the torch version pinned in constraints.txt")


def _urandom_philox() -> tuple[int, int]:
    """A 64-bit key and an offset (multiple of 4, below 2**62) from ``os.urandom``."""
    return _philox_from(os.urandom(16))


def _philox_from(raw: bytes) -> tuple[int, int]:
    """A 64-bit key and an offset (multiple of 4, below 2**62) from 16 secret bytes."""
    key = int.from_bytes(raw[:8], "little")
    offset = (int.from_bytes(raw[8:], "little") % _OFFSET_RANGE) & ~3
    return key, offset


def secure_cuda_generator(device: "torch.device | str" = "cuda") -> torch.Generator:
    """A CUDA ``torch.Generator`` (Philox4x32-10) whose whole state, the 64-bit key and the
    starting offset, comes from ``os.urandom`` (``manual_seed`` would do the key too, but not the
    offset, and would not let us verify the layout)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"secure_cuda_generator: device must be a CUDA device, got {dev}")
    return _philox_generator(dev, *_urandom_philox())


def _philox_generator(dev: torch.device, key: int, offset: int) -> torch.Generator:
    """A CUDA generator on ``dev`` with Philox state ``(key, offset)``, the layout verified."""
    _check_cuda_layout(str(dev))
    g = torch.Generator(device=dev)
    g.set_state(philox_state(key, offset))
    if read_philox_state(g.get_state()) != (key, offset):
        raise RuntimeError("dpclip: torch rejected the OS-entropy CUDA generator state")
    return g


# ------------------------------------------------------------- distributed: one stream per rank

#: bytes of the secret from which every rank's per-step noise generator is derived
NOISE_KEY_BYTES = 32
_RANK_NOISE_DOMAIN = b"dpclip/rank-noise/v1"


def rank_noise_generator(key: bytes, step: int, rank: int, world_size: int,
                         device: "torch.device | str" = "cpu") -> torch.Generator:
    """PRIVATE: the noise generator of ``rank`` (of ``world_size``) for release ``step``.

    Its whole state is SHAKE-256 (a cryptographic extendable-output function) of the secret
    ``key`` and the public ``(step, rank, world_size)``: on the CPU the 624 Mersenne Twister words,
    on CUDA the Philox key and offset. Distinct ``(step, rank, world_size)`` give computationally
    independent streams, so the ranks of a distributed run draw independent noise and a step
    never repeats another's; and a resumed run re-derives every rank's stream from ``key`` and
    the step count alone (rank 0's checkpoint holds ``key``: docs/distributed.md). ``key`` is
    from ``os.urandom`` in secure mode (:meth:`PrivateRandomness.noise_key`), from the public seed
    only in reproducible mode.
    """
    if not (isinstance(key, (bytes, bytearray)) and len(key) == NOISE_KEY_BYTES):
        raise ValueError(f"rank_noise_generator: key must be {NOISE_KEY_BYTES} bytes")
    if not (0 <= int(rank) < int(world_size)) or int(step) < 0:
        raise ValueError(f"rank_noise_generator: need 0 <= rank < world_size and step >= 0, got "
                         f"step={step}, rank={rank}, world_size={world_size}")
    dev = _device_of(device)
    xof = hashlib.shake_256(_RANK_NOISE_DOMAIN + bytes(key)
                            + struct.pack("<QQQ", int(step), int(rank), int(world_size)))
    if dev.type == "cuda":
        return _philox_generator(dev, *_philox_from(xof.digest(16)))
    return _mt_generator(xof.digest(4 * _MT_WORDS))


def _secure_on(device: torch.device) -> torch.Generator:
    return secure_cuda_generator(device) if device.type == "cuda" else secure_generator()


def _device_of(device: "torch.device | str | None") -> torch.device:
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"PrivateRandomness: device must be cpu or cuda, got {dev}")
    return dev


class _StepSeeds:
    """A step's chunk seeds (:meth:`PrivateRandomness.step_seeds`): ``blake2b(key, step, k)``."""

    __slots__ = ("_key", "_step", "_k")

    def __init__(self, key: bytes, step: int) -> None:
        self._key, self._step, self._k = key, step, 0

    def __call__(self) -> int:
        k, self._k = self._k, self._k + 1
        where = struct.pack("<qQ", self._step, k)
        digest = hashlib.blake2b(self._key + where, digest_size=8).digest()
        return int.from_bytes(digest, "little") & ((1 << 62) - 1)


class PrivateRandomness:
    """The sampling and noise generators of one private run (see the module docstring).

    Build with :meth:`secure` (default everywhere) or :meth:`reproducible`. ``sampling`` draws the
    batches (handed to the sampler), ``noise`` every Gaussian release (handed to ``dp_step``);
    nothing else may draw private randomness. The ``repr`` shows the mode only.
    """

    __slots__ = ("_model_count", "_model_key", "_model_salt", "_model_step", "_noise_key", "mode",
                 "noise", "sampling", "seed")

    def __init__(self, mode: str, sampling: torch.Generator, noise: torch.Generator,
                 seed: int | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"PrivateRandomness: mode must be one of {MODES}, got {mode!r}")
        if sampling.device != noise.device:
            raise ValueError(f"PrivateRandomness: the sampling and noise generators must be on "
                             f"one device, got {sampling.device} and {noise.device}")
        self.mode, self.sampling, self.noise, self.seed = mode, sampling, noise, seed
        #: PRIVATE: the secret of the per-rank noise streams of a distributed run (None until
        #: :meth:`noise_key` is first asked: one-process runs never create it)
        self._noise_key: bytes | None = None
        #: PRIVATE: the key of the model's own randomness (dropout masks, ``randn`` in a forward):
        #: every chunk of user code is seeded from it (:meth:`chunk_seed`); from ``os.urandom`` in
        #: secure mode, from the seed in reproducible mode; and how many seeds were drawn
        self._model_key: bytes = os.urandom(32) if mode == "secure" else hashlib.sha256(
            f"dpclip model randomness {seed}".encode()).digest()
        self._model_count = 0
        self._model_step: int | None = None
        #: public: what makes a rank's seeds its own in a distributed run (rank and world size)
        self._model_salt = b""

    def set_model_key(self, key: bytes, salt: bytes = b"") -> None:
        """Take ``key`` (32 bytes) as the model randomness' key (a distributed run: rank 0's) and
        ``salt`` (public: the rank and world size) into every seed derived from it, so that two
        ranks never draw the same masks (twelfth hostile review: ranks sharing the key gave the
        examples at one local position the same mask: a one-step delta of 0.19 at z 2, eps 3)."""
        if len(key) != 32:
            raise ValueError("PrivateRandomness: the model key must be 32 bytes")
        self._model_key, self._model_salt = bytes(key), bytes(salt)

    def model_key(self) -> bytes:
        """PRIVATE: the key :meth:`chunk_seed` derives from (for the process group only)."""
        return self._model_key

    def chunk_seed(self, step: int | None = None) -> int:
        """PRIVATE: the next 62-bit seed of a chunk's own generators
        (:class:`dpclip.engine.generators.OwnGenerators`): a hash of the model key and a counter.
        Secret in secure mode, so the masks a chunk draws are secret and independent of the data
        whichever rows the examples take (the public default generator gave every chunk its seed:
        an example's dropout mask depended on its position in the batch, LOO 3.1-3.3 C with the
        seed known, and the number of chunks, hence the realised batch sizes, could be read off
        the generator's state: eleventh hostile review)."""
        if step is not None and step != self._model_step:  # a step's seeds: (step, k)
            self._model_step, self._model_count = int(step), 0
        k = self._model_count
        self._model_count = k + 1
        where = struct.pack("<qQ", -1 if step is None else int(step), k)
        digest = hashlib.blake2b(self._model_key + self._model_salt + where,
                                 digest_size=8).digest()
        return int.from_bytes(digest, "little") & ((1 << 62) - 1)

    def step_seeds(self, step: int) -> "_StepSeeds":
        """PRIVATE: :meth:`chunk_seed` for ``step`` as an object that holds the model key alone,
        not this object: what ``seed_source`` hands the step's chunks sits in a context variable
        any code can read, and through a bound method of this object the forward reached the
        noise generator and read its state before the step's draw (hundred-and-seventy-third
        hostile review). The seeds are :meth:`chunk_seed`'s, counted from 0 for the step."""
        return _StepSeeds(self._model_key + self._model_salt, int(step))

    @property
    def device(self) -> torch.device:
        """Where both generators draw (the device of the gradient: no host round trip)."""
        return self.noise.device

    @property
    def generator_kind(self) -> str:
        """Public: ``"mt19937"`` (CPU) or ``"philox4x32-10"`` (CUDA)."""
        return "philox4x32-10" if self.device.type == "cuda" else "mt19937"

    @classmethod
    def secure(cls, device: "torch.device | str | None" = None) -> "PrivateRandomness":
        """Both generators from OS entropy (the default), on ``device`` (default the CPU): the
        CPU's Mersenne Twister with all 624 words from ``os.urandom``, or CUDA's Philox with its
        64-bit key and its offset from ``os.urandom``."""
        dev = _device_of(device)
        return cls("secure", _secure_on(dev), _secure_on(dev))

    @classmethod
    def reproducible(cls, seed: int, device: "torch.device | str | None" = None
                     ) -> "PrivateRandomness":
        """Both generators from the public ``seed`` (research only; NOT private against anyone who
        knows the seed). The seeds are derived as dpclip derived them before 0.2 (when every run
        was seeded), so a run is replayed exactly by the same dpclip version on the same kind of
        device (CPU and CUDA generators give different streams from one seed)."""
        seed, dev = int(seed), _device_of(device)
        return cls("reproducible", seeded_generator(2 * seed + 1, dev),
                   seeded_generator(2 * seed + 2, dev), seed)

    @classmethod
    def for_run(cls, reproducible_noise: bool, seed: int,
                device: "torch.device | str | None" = None) -> "PrivateRandomness":
        return cls.reproducible(seed, device) if reproducible_noise else cls.secure(device)

    def before_release(self) -> None:
        """Re-key a CUDA generator from OS entropy before its 64-bit Philox offset could wrap
        (a wrapped counter would repeat noise). The offset lives on the host: no synchronisation.
        No-op on the CPU and in reproducible mode (which must stay a function of the seed)."""
        if not self.is_private or self.device.type != "cuda":
            return
        for name in ("sampling", "noise"):
            g = getattr(self, name)
            if g.get_offset() >= REKEY_OFFSET:
                setattr(self, name, secure_cuda_generator(g.device))

    def noise_key(self) -> bytes:
        """PRIVATE: the 32-byte secret from which a distributed run derives every rank's noise
        stream (:func:`rank_noise_generator`); created on first use: from ``os.urandom`` in secure
        mode, from the public seed in reproducible mode (NOT private). A distributed run agrees on
        rank 0's key once (``dpclip.training.distributed.shared_randomness``) and keeps it in the
        private checkpoint (:meth:`state_dict`)."""
        if self._noise_key is None:
            if self.is_private:
                self._noise_key = os.urandom(NOISE_KEY_BYTES)
            else:
                seed = int(self.seed or 0)  # any int (decimal text: no width limit)
                self._noise_key = hashlib.sha256(
                    b"dpclip/reproducible-rank-noise/v1:" + str(seed).encode()).digest()
        return self._noise_key

    def set_noise_key(self, key: bytes) -> None:
        """Adopt ``key`` (rank 0's, broadcast) as the per-rank noise secret."""
        if not (isinstance(key, (bytes, bytearray)) and len(key) == NOISE_KEY_BYTES):
            raise ValueError(f"PrivateRandomness: a noise key is {NOISE_KEY_BYTES} bytes")
        self._noise_key = bytes(key)

    def rank_noise(self, step: int, rank: int, world_size: int) -> torch.Generator:
        """PRIVATE: ``rank``'s noise generator for release ``step`` of a distributed run, on this
        object's device (:func:`rank_noise_generator` of :meth:`noise_key`)."""
        return rank_noise_generator(self.noise_key(), step, rank, world_size, self.device)

    @property
    def is_private(self) -> bool:
        """False in reproducible mode: the noise is a function of a public seed."""
        return self.mode == "secure"

    def describe(self) -> dict[str, Any]:
        """Public facts for run summaries (never the seed material or state)."""
        if self.is_private:
            return {"randomness": "secure", "private_against_seed": True,
                    "generator": self.generator_kind}
        return {
            "randomness": "reproducible",
            "private_against_seed": False,
            "generator": self.generator_kind,
            "randomness_warning": "noise and batch sampling were derived from the published seed: "
                                  "NOT private against anyone who knows the seed",
        }

    def state_dict(self) -> dict[str, Any]:
        """PRIVATE: the generators' full state, for the run's checkpoint only."""
        out = {"mode": self.mode, "device": self.device.type,
               "sampling": self.sampling.get_state(), "noise": self.noise.get_state()}
        if self._noise_key is not None:  # a distributed run: every rank's noise derives from it
            out["noise_key"] = torch.frombuffer(bytearray(self._noise_key), dtype=torch.uint8)
        out["model_key"] = torch.frombuffer(bytearray(self._model_key), dtype=torch.uint8)
        out["model_count"] = self._model_count
        out["model_step"] = -1 if self._model_step is None else self._model_step
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("mode") != self.mode:
            raise ValueError(
                f"checkpoint randomness mode {state.get('mode')!r} does not match this run's "
                f"{self.mode!r}"
            )
        saved = state.get("device", "cpu")  # checkpoints before 0.4 hold CPU generators
        if saved != self.device.type:
            raise ValueError(
                f"checkpoint randomness was drawn by the {saved} generator but this run's "
                f"generators are on {self.device.type}: the secret stream cannot continue on "
                f"another kind of device; resume with device={saved!r} (--device {saved})")
        if "noise_key" in state:  # written by a distributed run (absent: keep this run's key)
            key = state["noise_key"]
            self.set_noise_key(bytes(key.numpy().tobytes()) if isinstance(key, Tensor) else key)
        if "model_key" in state:  # (absent, a checkpoint before it: this run's fresh key)
            key = state["model_key"]
            key = bytes(key.numpy().tobytes()) if isinstance(key, Tensor) else bytes(key)
            if len(key) != 32:
                raise ValueError("checkpoint randomness: the model key must be 32 bytes")
            self._model_key, self._model_count = key, int(state.get("model_count", 0))
            step = int(state.get("model_step", -1))
            self._model_step = None if step < 0 else step
        if self.device.type == "cuda":
            # torch also accepts an 8-byte state (seed only) and silently restarts the offset at
            # 0: a resume must continue the stream exactly, so only the full 16 bytes are taken
            for name in ("sampling", "noise"):
                want = read_philox_state(state[name])
                getattr(self, name).set_state(state[name])
                if read_philox_state(getattr(self, name).get_state()) != want:
                    raise RuntimeError("dpclip: torch did not restore the CUDA generator state "
                                       "of the checkpoint")
            return
        self.sampling.set_state(state["sampling"])
        self.noise.set_state(state["noise"])

    def __repr__(self) -> str:
        return f"PrivateRandomness(mode={self.mode!r})"
