"""A private preprocessing release made by the run itself, before its first step.

:class:`PreprocessRelease` holds a pending release (``preprocess``: a
:class:`dpclip.data.private_centre.PrivateCentre`, the library's own, with ``event()``,
``release(x, n_public, generator)``, ``apply(x, out)`` and ``describe(dim, n_public)``) and, once
made, its output. The release:

* is refused where its accounting would not hold: one process only (a distributed run would need
  a global sum), Poisson sampling only (its sensitivity is stated under add/remove-one), and the
  training inputs one tensor of records;
* draws its noise from the run's secret noise generator (``PrivateRandomness.noise``), after
  every input has been checked and before the first step, and records its event first in the
  ledger (the plan's ``prior_events``: calibration and budget count it with the steps);
* divides by the public number ``N`` of private examples the sampler's rate uses;
* is kept (a DP output, public) in the run's checkpoint, so a resumed run reuses it instead of
  drawing (and spending) a second one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dpclip._checks import library_object
from dpclip.training.release import Releaser

__all__ = ["PreprocessRelease"]


class PreprocessRelease:
    """The pending release ``preprocess`` of a private run and, once made, its output."""

    def __init__(self, preprocess: Any, *, inputs: Any, sampling: str, distributed: bool) -> None:
        from dpclip.data.private_centre import PrivateCentre

        # dpclip's own release only, as a fresh copy: its apply() runs on every private record
        # before the first step, outside every check; an object with the right method names
        # whose apply() added the raw training sum to every record moved the release by 22.4 C
        # (hundred-and-thirty-ninth hostile review)
        if type(preprocess) is not PrivateCentre:
            raise TypeError(
                "preprocess= must be a dpclip.data.private_centre.PrivateCentre (the private "
                "preprocessing release the library states the sensitivity of and tests), got "
                f"{type(preprocess).__name__}: its apply() would run on every private record "
                "before the first step, where no check sees it. Put other per-example transforms "
                "in the model")
        preprocess = library_object(preprocess, PrivateCentre, "preprocess=")
        name = preprocess.name
        if distributed:
            raise ValueError(f"preprocess {name!r} (e.g. the dataset option centre='private') "
                             "runs in one process only: a distributed run would need the global "
                             "sum; drop the option or train in one process")
        if sampling != "poisson":
            raise ValueError(f"preprocess {name!r} (e.g. the dataset option centre='private') "
                             "states its sensitivity under add/remove-one (Poisson sampling); "
                             f"got sampling={sampling!r}: use sampling='poisson'")
        if not isinstance(inputs, Tensor) or inputs.ndim < 2:
            raise ValueError(f"preprocess {name!r} needs the training inputs as one tensor of "
                             f"records, got {type(inputs).__name__}")
        self.preprocess = preprocess
        self.raw = inputs  # the private inputs before the release is applied
        self.output: Tensor | None = None  # the DP output (public), once released

    @property
    def events(self) -> tuple[Any, ...]:
        """The release's events, planned before any data is read (public)."""
        return (self.preprocess.event(),)

    def make(self, generator: torch.Generator) -> Tensor:
        """PRIVATE: draw the release from the secret ``generator``; returns the transformed
        training inputs. Called once per run (a resumed run :meth:`restore`\\ s instead)."""
        if self.output is not None:
            raise RuntimeError("privacy bug: the preprocessing release was already made")
        # through the release door (its sampler, add/remove: sensitivity factor 1)
        self.output = self.preprocess.release(self.raw, len(self.raw), Releaser(generator, 1))
        return self.preprocess.apply(self.raw, self.output)

    def restore(self, output: Tensor) -> Tensor:
        """The checkpoint's output (made before the interruption) replaces this run's draw;
        returns the training inputs transformed with it."""
        self.output = torch.as_tensor(output, dtype=torch.float64)
        return self.preprocess.apply(self.raw, self.output)

    def apply(self, x: Tensor) -> Tensor:
        """Post-processing of other inputs (test, evaluation) with the released output."""
        if self.output is None:
            raise RuntimeError("the preprocessing release is not made yet")
        return self.preprocess.apply(x, self.output)

    def describe(self) -> dict[str, Any]:
        """Public facts for the run summary (the output is a DP release: its norm is public)."""
        dim = int(self.raw[0].numel())
        out = dict(self.preprocess.describe(dim, len(self.raw)))
        if self.output is not None:
            out["output_norm"] = float(self.output.norm())
        return out
