"""Feature scaling of tabular data without private statistics.

Standardising with the mean and standard deviation of the private training split makes every
record's features depend on every other record: adding, removing or changing one training record
moves all the others, so the released model's sensitivity to one record is no longer the one the
DP mechanism accounts for. The default here is data-independent: each numeric feature ``j`` has a
DECLARED range ``[lo_j, hi_j]`` (a constant in code, from the dataset's public codebook where it
gives one, otherwise a stated generous bound), the value is clipped into it and mapped linearly to
``[-1, 1]``. That is a per-record map: one record never changes another record's features.

The old behaviour (train-split mean and std, without noise) stays available as an explicit
option, ``scaling="train-statistics"``, labelled NON-PRIVATE in :attr:`DatasetBundle.preprocessing`
(``"nonprivate": True``); it is never the default. One DP statistic is offered, with its own ledger
event: the private centre (dataset option ``centre="private"``, :mod:`dpclip.data.private_centre`),
a Gaussian estimate of the training mean subtracted after the declared-range map; a noisy std is
not offered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "SCALINGS",
    "FeatureRange",
    "check_scaling",
    "declared_range_scale",
    "preprocessing_record",
    "train_statistics_scale",
]

#: ``declared-ranges`` (default, data-independent) or ``train-statistics`` (NON-PRIVATE)
SCALINGS: tuple[str, ...] = ("declared-ranges", "train-statistics")


@dataclass(frozen=True)
class FeatureRange:
    """The declared domain ``[lo, hi]`` of one numeric feature and where it comes from.

    ``provenance`` says whether the range is the feature's documented domain (a codebook) or a
    bound we declared (values outside are clipped). ``lo < hi``, both finite.
    """

    lo: float
    hi: float
    provenance: str = "declared"

    def __post_init__(self) -> None:
        if not (np.isfinite(self.lo) and np.isfinite(self.hi) and self.lo < self.hi):
            raise ValueError(
                f"FeatureRange needs finite lo < hi, got [{self.lo}, {self.hi}]"
            )


def check_scaling(scaling: str, dataset: str) -> str:
    """Validate the ``scaling`` option of a tabular loader (error names it and the choices)."""
    if scaling not in SCALINGS:
        raise ValueError(
            f"dataset {dataset!r}: scaling must be one of {', '.join(SCALINGS)} (default "
            f"'declared-ranges': data-independent; 'train-statistics' is NON-PRIVATE), got "
            f"{scaling!r}"
        )
    return scaling


def declared_range_scale(x: np.ndarray, ranges: Sequence[FeatureRange | None]) -> np.ndarray:
    """Per record and feature: ``2 (clip(x, lo, hi) - lo) / (hi - lo) - 1`` for a feature with a
    range; a feature whose range is ``None`` (one-hot columns, already in {0, 1}) is kept.

    Privacy: a fixed map applied to each record separately (no statistic of the data), so one
    record's change changes only its own row. Edge cases: NaN stays NaN (the bundle refuses it).
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != len(ranges):
        raise ValueError(
            f"declared_range_scale: x has shape {x.shape}, expected (N, {len(ranges)}) (one range "
            "per column, None for columns kept as they are)"
        )
    out = x.copy()
    for j, r in enumerate(ranges):
        if r is None:
            continue
        out[:, j] = 2.0 * (np.clip(x[:, j], r.lo, r.hi) - r.lo) / (r.hi - r.lo) - 1.0
    return out


def train_statistics_scale(
    x: np.ndarray, numeric: np.ndarray, train_idx: np.ndarray
) -> np.ndarray:
    """NON-PRIVATE: standardise the ``numeric`` columns with the mean and population std of the
    rows ``train_idx`` (no noise). Every record's features then depend on every training record;
    use only where the training data is public or for comparison with the old pipeline."""
    x = np.asarray(x, dtype=np.float64)
    mean = np.where(numeric, x[train_idx].mean(axis=0), 0.0)
    std = np.where(numeric, x[train_idx].std(axis=0), 1.0)
    std = np.where(std > 0, std, 1.0)
    return (x - mean) / std


def preprocessing_record(scaling: str, detail: str) -> dict[str, Any]:
    """The description of the preprocessing a bundle carries (``DatasetBundle.preprocessing``),
    for the run summary: ``scaling``, ``nonprivate`` (True when a statistic of the private data
    was used without noise) and ``detail``."""
    nonprivate = scaling == "train-statistics"
    label = ("NON-PRIVATE: features standardised with the noiseless mean/std of the training "
             "split; " if nonprivate else "data-independent: ")
    return {"scaling": scaling, "nonprivate": nonprivate, "detail": label + detail}
