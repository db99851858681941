"""A differentially private centre of the training records, subtracted before training.

Declared-range scaling (:mod:`dpclip.data.scaling`) is a per-record map, so it leaves every record
near one common offset (the mean of the declared box's image of the data). The offset carries no
class information, but bound-based strategies (Lip-DP-SGD) certify their sensitivity on the input
norm bound ``X_0``, which the offset fills (reproductions/results/lipdp_breast_cancer_diagnosis.md).
Centring at the noiseless training mean removes it but is NON-PRIVATE (one record moves every other
record). :class:`PrivateCentre` releases the mean with the Gaussian mechanism instead:

1. each record is clipped into the declared box ``[-box, box]^d`` (``box = 1``: the range of
   declared-range scaling, so a no-op on those features);
2. the SUM of the clipped private training records gets Gaussian noise of std
   ``noise_multiplier * sensitivity`` per coordinate, where ``sensitivity = box * sqrt(d)`` is the
   L2 norm bound of one clipped record: adding or removing one record (the add/remove-one
   relation of Poisson-sampled DP-SGD) moves the sum by at most that;
3. the noisy sum is divided once by the PUBLIC number ``N`` of private training examples (the
   same ``N`` the Poisson sampler's rate ``B / N`` treats as public);
4. the estimate is subtracted from every record, training and test (post-processing).

The release is one ``GaussianEvent(noise_multiplier)`` (no sampling) in the run's privacy ledger,
recorded before the first step and composed with the DP-SGD steps by the accountant; the DP-SGD
noise is calibrated so that the TOTAL epsilon meets the target
(:class:`dpclip.training.private.PrivateTraining`, ``preprocess=``). The noise is drawn from the
run's secret noise generator (:mod:`dpclip.randomness`), like every other release.

A bundle loaded with ``centre="private"`` carries a :class:`PrivateCentre` in
``DatasetBundle.private_preprocessing``: it is a PENDING release, made by the private run, never by
the loader (a loader cannot account for it, and a resumed run must reuse, not redraw, it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dpclip.events import GaussianEvent

__all__ = ["CENTRES", "PrivateCentre", "check_centre"]

#: ``none`` (default: no centring) or ``private`` (a DP estimate of the training mean)
CENTRES: tuple[str, ...] = ("none", "private")


@dataclass(frozen=True)
class PrivateCentre:
    """The Gaussian-mechanism estimate of the training mean (see the module docstring).

    ``noise_multiplier`` (> 0, finite): noise std / sensitivity of the sum; ``box`` (> 0): every
    feature is clipped into ``[-box, box]`` before summing.
    """

    noise_multiplier: float
    box: float = 1.0

    def __post_init__(self) -> None:
        z = self.noise_multiplier
        if isinstance(z, bool) or not isinstance(z, (int, float)) or not (
                math.isfinite(z) and z > 0):
            raise ValueError(
                f"centre_noise_multiplier must be a finite number > 0 (the noise std of the "
                f"private centre's sum / its sensitivity; e.g. 8.0), got {z!r}")
        b = self.box
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not (
                math.isfinite(b) and b > 0):
            raise ValueError(f"PrivateCentre: box must be a finite number > 0, got {b!r}")

    name = "private-centre"

    def event(self) -> GaussianEvent:
        """The release's event: one unsampled Gaussian, noise multiplier ``noise_multiplier``."""
        return GaussianEvent(float(self.noise_multiplier))

    def sensitivity(self, dim: int) -> float:
        """L2 sensitivity of the clipped sum under add/remove-one: ``box * sqrt(dim)``."""
        return float(self.box) * math.sqrt(int(dim))

    def clipped_sum(self, x: Tensor) -> Tensor:
        """NON-PRIVATE: the float64 sum of the records clipped into the box (one row each). A
        missing value (NaN) counts as 0 and an infinite one as the box's edge: ``clamp`` keeps NaN,
        so one record with a NaN made the released centre NaN whatever the noise (the neighbour
        told apart with certainty: fiftieth hostile review). Mapped per record, so the clipped
        record's norm stays within ``box * sqrt(d)``; never refused (a refusal that depends on the
        data would publish whether a record has a missing value)."""
        x = _as_rows(x)
        x = torch.nan_to_num(x.to(torch.float64), nan=0.0)
        return x.clamp(-self.box, self.box).sum(dim=0)

    def release(self, x: Tensor, n_public: int, releaser: Any) -> Tensor:
        """PRIVATE input, DP output: ``(clipped sum + N(0, (z * sensitivity)^2 I)) / n_public``.

        ``x``: the private training records (``(N, d)`` or ``(N, *shape)``, flattened per
        record); ``n_public``: the public number of private examples the sum is divided by;
        ``releaser``: the release door's callback, ``releaser(value, sensitivity, z) -> (noisy,
        event)`` (:class:`dpclip.training.release.Releaser` on the run's secret noise generator,
        sensitivity factor 1: add/remove). The noise is drawn there, as every release's
        (``tests/core/test_release.py``). Returns the estimate (float64, shape of one record).
        """
        if isinstance(n_public, bool) or not isinstance(n_public, int) or n_public < 1:
            raise ValueError(f"PrivateCentre.release: n_public must be an int >= 1, got "
                             f"{n_public!r}")
        total = self.clipped_sum(x)
        noisy, _ = releaser(total, self.sensitivity(total.numel()), float(self.noise_multiplier))
        return (noisy / n_public).reshape(tuple(x.shape[1:]))

    @staticmethod
    def apply(x: Tensor, centre: Tensor) -> Tensor:
        """Post-processing: ``x - centre`` (each record), in ``x``'s dtype and device."""
        return x - centre.to(device=x.device, dtype=x.dtype)

    def describe(self, dim: int, n_public: int) -> dict[str, Any]:
        """Public facts for the run summary."""
        sens = self.sensitivity(dim)
        return {"release": "private centre: Gaussian mechanism on the sum of the records clipped "
                           f"into [-{self.box:g}, {self.box:g}]^{dim}, divided by N = {n_public}",
                "noise_multiplier": float(self.noise_multiplier), "sensitivity": sens,
                "noise_std_of_sum": float(self.noise_multiplier) * sens,
                "noise_std_of_mean": float(self.noise_multiplier) * sens / n_public,
                "n_public": int(n_public), "event": self.event().to_dict()}


def _as_rows(x: Tensor) -> Tensor:
    if not isinstance(x, Tensor) or x.ndim < 2:
        raise ValueError("private centre: the training inputs must be one tensor of records "
                         f"(N, ...), got {type(x).__name__}"
                         + (f" of shape {tuple(x.shape)}" if isinstance(x, Tensor) else ""))
    return x.reshape(x.shape[0], -1)


def check_centre(centre: str, noise_multiplier: float | None, scaling: str,
                 dataset: str) -> PrivateCentre | None:
    """The dataset options ``centre`` / ``centre_noise_multiplier`` checked together (errors name
    the option and the fix); returns the pending release or ``None``."""
    if centre not in CENTRES:
        raise ValueError(
            f"dataset {dataset!r}: centre must be one of {', '.join(CENTRES)} ('private': "
            f"subtract a DP estimate of the training mean, with centre_noise_multiplier), got "
            f"{centre!r}")
    if centre == "none":
        if noise_multiplier is not None:
            raise ValueError(
                f"dataset {dataset!r}: centre_noise_multiplier={noise_multiplier!r} is only used "
                "with centre='private'; set centre='private' or drop centre_noise_multiplier")
        return None
    if scaling != "declared-ranges":
        raise ValueError(
            f"dataset {dataset!r}: centre='private' needs scaling='declared-ranges' (the box "
            f"[-1, 1] bounds each record, hence the sensitivity), got scaling={scaling!r}")
    if noise_multiplier is None:
        raise ValueError(
            f"dataset {dataset!r}: centre='private' needs centre_noise_multiplier (the noise std "
            "of the centre's sum / its sensitivity sqrt(d), > 0; e.g. 8.0); its epsilon is "
            "composed with the DP-SGD steps")
    return PrivateCentre(noise_multiplier)
