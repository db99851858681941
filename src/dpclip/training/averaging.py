"""Weight averaging of the released iterates: EMA and Polyak (De et al. 2022, jax_privacy).

DP-SGD's iterates are noisy; evaluating an average of them instead of the last one is one of the
two tricks that move DP-SGD most in De et al. (2022, "Unlocking high-accuracy differentially
private image classification through scale", Section 3): an exponential moving average (EMA) of
the weights, and Polyak (uniform) averaging.

Grammar (``TrainConfig.averaging``, ``--averaging``, ``make_private(averaging=...)``):

* ``"none"`` (the default): the last iterate.
* ``"ema:D"`` or ``"ema:D:S"``: exponential moving average with decay ``D`` in ``(0, 1)``, started
  after optimizer step ``S`` (default 0), with the warm-up of TensorFlow's
  ``ExponentialMovingAverage(num_updates=...)`` that jax_privacy's ``ema(use_warmup=True)`` and
  De et al. use: at the ``t``-th averaged step (``t = 0, 1, ...``) the decay is
  ``min(D, (1 + t) / (10 + t))``, so the first iterates are not swamped by the initial weights.
* ``"polyak:S"``: the uniform mean of the iterates after optimizer steps ``S+1, S+2, ...``.

Up to step ``S`` the average is the current iterate. With ``n`` optimizer steps done and ``theta_n``
the parameters after step ``n`` (``theta_0`` the initial ones), ``a_n = theta_n`` for ``n <= S``;
for ``n > S``, ``t = n - S - 1`` and

* EMA: ``a_n = mu_t a_{n-1} + (1 - mu_t) theta_n`` with ``mu_t = min(D, (1 + t) / (10 + t))``;
* Polyak: ``a_n = (t a_{n-1} + theta_n) / (t + 1)`` (so ``a_{S+1} = theta_{S+1}``).

Only trainable parameters are averaged (frozen ones do not move). Buffers are NOT averaged: the
averaged model uses the model's current buffers as they are (dpclip never lets private data into a
buffer: ``dpclip.training.step.private_buffer_guard``; BatchNorm statistics are recomputed on public data or
taken from the test batch by the evaluation, whichever the run uses).

Privacy: post-processing. Every iterate ``theta_n`` is a function of the noisy gradients released
so far (and of public initial weights), and the accountant already covers the release of the whole
sequence of iterates (adaptive composition over all steps). The average is a deterministic function
of that sequence, so it costs nothing: no ledger event. It is part of the run's configuration (it
changes the model that is evaluated and released), so it is in the config fingerprint.
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
from torch import Tensor, nn

__all__ = ["AVERAGING_KINDS", "Averaging", "WeightAverager", "parse_averaging"]

AVERAGING_KINDS = ("ema", "polyak")

_GRAMMAR = ("'none', 'ema:D' (exponential moving average with decay D in (0, 1), with the "
            "(1+t)/(10+t) warm-up), 'ema:D:S' (started after optimizer step S) or 'polyak:S' "
            "(uniform mean of the iterates after step S), e.g. 'ema:0.999' or 'polyak:1000'")


@dataclass(frozen=True)
class Averaging:
    """A parsed averaging: ``kind`` ``"ema"`` (``decay``) or ``"polyak"``, from step ``start``."""

    kind: str
    decay: float | None = None
    start: int = 0

    def __post_init__(self) -> None:
        if self.kind not in AVERAGING_KINDS:
            raise ValueError(f"averaging: kind must be one of {AVERAGING_KINDS}, got {self.kind!r}")
        if self.kind == "ema":
            if not (isinstance(self.decay, float) and 0.0 < self.decay < 1.0):
                raise ValueError(f"averaging: the EMA decay must be in (0, 1), got {self.decay!r}")
        elif self.decay is not None:
            raise ValueError("averaging: polyak takes no decay")
        if not (isinstance(self.start, int) and self.start >= 0):
            raise ValueError(f"averaging: the start step must be an integer >= 0, got "
                             f"{self.start!r}")

    @property
    def spec(self) -> str:
        """The canonical text (``parse_averaging(a.spec) == a``)."""
        if self.kind == "ema":
            return f"ema:{self.decay!r}" + (f":{self.start}" if self.start else "")
        return f"polyak:{self.start}"

    def weight_of_new(self, t: int) -> float:
        """The weight of the new iterate at the ``t``-th averaged step (``t >= 0``)."""
        if self.kind == "polyak":
            return 1.0 / (t + 1)
        assert self.decay is not None
        return 1.0 - min(self.decay, (1.0 + t) / (10.0 + t))


def parse_averaging(spec: "str | Averaging | None", where: str = "averaging") -> Averaging | None:
    """``None`` for ``None`` / ``"none"`` / ``""``; otherwise the :class:`Averaging` (clear errors
    naming ``where`` and the grammar)."""
    if spec is None or isinstance(spec, Averaging):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"{where}: must be a string ({_GRAMMAR}), got {type(spec).__name__} "
                         f"{spec!r}")
    text = spec.strip().lower()
    if text in ("", "none"):
        return None
    parts = text.split(":")
    kind = parts[0]
    try:
        if kind == "ema" and len(parts) in (2, 3):
            decay = float(parts[1])
            start = _int(parts[2]) if len(parts) == 3 else 0
            if not (math.isfinite(decay) and 0.0 < decay < 1.0):
                raise ValueError(f"{where}: {spec!r}: the EMA decay must be in (0, 1), e.g. "
                                 "'ema:0.999'")
            return Averaging("ema", decay, start)
        if kind == "polyak" and len(parts) == 2:
            return Averaging("polyak", None, _int(parts[1]))
    except _BadInt:
        raise ValueError(f"{where}: {spec!r}: the start step must be an integer >= 0; "
                         f"expected {_GRAMMAR}") from None
    except ValueError as exc:
        if str(exc).startswith(where):
            raise
    raise ValueError(f"{where}: cannot parse {spec!r}; expected {_GRAMMAR}")


class _BadInt(ValueError):
    pass


def _int(text: str) -> int:
    if not re.fullmatch(r"\d+", text.strip()):
        raise _BadInt(text)
    return int(text)


class WeightAverager:
    """The running average of a model's trainable parameters (module docstring).

    ``update()`` after every optimizer step (``PrivateTraining.step`` does it; with ``backward`` and
    your own ``optimizer.step()`` call ``dp.update_average()``). ``swapped()`` is a context in
    which the model holds the averaged parameters (evaluation); ``averaged_model()`` returns a copy
    of the model with them. The average is kept in float64 on the parameter's device (the sum of
    thousands of small steps loses digits in float32); ``state_dict`` holds it for resume.
    """

    def __init__(self, model: nn.Module, averaging: Averaging) -> None:
        self.model = model
        self.averaging = averaging
        self.updates = 0  #: optimizer steps seen (``n``)
        self.average: dict[str, Tensor] = {
            n: p.detach().to(torch.float64).clone() for n, p in self._params().items()}

    def _params(self) -> dict[str, Tensor]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def update(self) -> None:
        """Fold the model's current parameters (the iterate after one more optimizer step) in."""
        params = self._params()
        if set(params) != set(self.average):
            raise ValueError(
                "averaging: the model's trainable parameters changed since the average was "
                f"started ({sorted(set(params) ^ set(self.average))[:3]}); build a new averager")
        self.updates += 1
        start = self.averaging.start
        if self.updates <= start:
            for n, p in params.items():
                self.average[n].copy_(p.detach())
            return
        w = self.averaging.weight_of_new(self.updates - start - 1)
        for n, p in params.items():
            a = self.average[n]
            a.mul_(1.0 - w).add_(p.detach().to(torch.float64), alpha=w)

    @contextlib.contextmanager
    def swapped(self) -> Iterator[nn.Module]:
        """The model with the averaged parameters for the block (gradients off in it is up to the
        caller); the trained parameters are put back on exit, also on an exception."""
        params = self._params()
        saved = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(self.average[n])
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(saved[n])

    def averaged_model(self) -> nn.Module:
        """A deep copy of the model holding the averaged parameters (and the current buffers)."""
        with self.swapped():
            return copy.deepcopy(self.model)

    def state_dict(self) -> dict[str, Any]:
        return {"spec": self.averaging.spec, "updates": self.updates,
                "average": {n: a.detach().cpu().clone() for n, a in self.average.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("spec") != self.averaging.spec:
            raise ValueError(
                f"averaging: the checkpoint averaged with {state.get('spec')!r}, this run with "
                f"{self.averaging.spec!r}; resume with the same averaging")
        if set(state["average"]) != set(self.average):
            raise ValueError("averaging: the checkpoint's averaged parameters do not match the "
                             "model's trainable parameters")
        self.updates = int(state["updates"])
        for n, a in state["average"].items():
            self.average[n] = a.to(device=self.average[n].device, dtype=torch.float64).clone()
