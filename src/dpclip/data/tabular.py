"""Tabular UCI datasets of Lip-DP-SGD (Barczewski & Ramon, S2 Table 1) from their standard files.

Nothing is downloaded. Each loader reads the file(s) the UCI repository distributes, searched in
``data_dir/<name>``, ``data_dir``, ``$DPCLIP_DATA/<name>``, ``$DPCLIP_DATA`` (in that order; Android
and Dropout both ship as ``data.csv``, so keep them in their own sub-directories); a
missing file raises :class:`DatasetNotFoundError` naming the file, the directories searched and
the download page.

Encoding (the same for every dataset): numeric columns are standardised with the mean and
population standard deviation of the TRAIN split only; categorical columns are one-hot encoded
over the categories present in the file (a data-independent schema in the UCI documentation; a
missing value ``?`` is its own category). Splits: the official train/test files for Adult, a
stratified ``1 - test_fraction`` / ``test_fraction`` split from ``seed`` otherwise. Privacy
caveat (as for breast-cancer): the standardisation statistics are computed without noise; treat
them as public or privatise them if every training example must be protected.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dpclip.data.base import DatasetBundle, DatasetNotFoundError, TensorSplit
from dpclip.data.idx import DATA_ENV_VAR
from dpclip.data.splits import stratified_split_indices

__all__ = [
    "TABULAR_SPECS",
    "TabularSpec",
    "load_adult",
    "load_android_permissions",
    "load_default_credit",
    "load_dropout",
    "load_german_credit",
    "load_nursery",
]


@dataclass(frozen=True)
class TabularSpec:
    """How one UCI file is laid out.

    ``files``: accepted file names (first found wins); ``delimiter``; ``header``: whether the first
    row names the columns; ``label``: the label column (index, or name with a header);
    ``categorical``: indices/names of categorical feature columns (others numeric); ``drop``:
    columns ignored (ids); ``classes``: label values in class-index order (``None``: sorted values
    found); ``url``: the download page.
    """

    name: str
    files: tuple[str, ...]
    delimiter: str
    header: bool
    label: int | str
    categorical: tuple[int | str, ...]
    url: str
    drop: tuple[int | str, ...] = ()
    classes: tuple[str, ...] | None = None
    skip_rows: int = 0


_UCI = "https://archive.ics.uci.edu/dataset"

TABULAR_SPECS: dict[str, TabularSpec] = {
    "adult": TabularSpec(
        "adult", ("adult.data",), ",", False, 14, (1, 3, 5, 6, 7, 8, 9, 13),
        f"{_UCI}/2/adult (files adult.data and adult.test)", classes=("<=50K", ">50K"),
    ),
    "german-credit": TabularSpec(
        "german-credit", ("german.data",), " ", False, 20,
        (0, 2, 3, 5, 6, 8, 9, 11, 13, 14, 16, 18, 19),
        f"{_UCI}/144/statlog+german+credit+data (file german.data)", classes=("1", "2"),
    ),
    "default-credit": TabularSpec(
        "default-credit",
        ("default_of_credit_card_clients.csv", "default of credit card clients.csv",
         "UCI_Credit_Card.csv"),
        ",", True, "default payment next month", ("SEX", "EDUCATION", "MARRIAGE"),
        f"{_UCI}/350/default+of+credit+card+clients (the .xls saved as CSV, "
        "default_of_credit_card_clients.csv)", drop=("ID",), classes=("0", "1"),
    ),
    "nursery": TabularSpec(
        "nursery", ("nursery.data",), ",", False, 8, (0, 1, 2, 3, 4, 5, 6, 7),
        f"{_UCI}/76/nursery (file nursery.data)",
        classes=("not_recom", "recommend", "very_recom", "priority", "spec_prior"),
    ),
    "android-permissions": TabularSpec(
        "android-permissions", ("NATICUSdroid.csv", "android_permissions.csv", "data.csv"),
        ",", True, "Class", (),
        f"{_UCI}/722/naticusdroid+android+permissions+dataset (file data.csv; 86 permission "
        "columns and Class)", classes=("0", "1"),
    ),
    "dropout": TabularSpec(
        "dropout", ("dropout.csv", "data.csv"), ";", True, "Target",
        (),
        f"{_UCI}/697/predict+students+dropout+and+academic+success (file data.csv, ';'-separated)",
        classes=("Dropout", "Enrolled", "Graduate"),
    ),
}


def _candidate_dirs(name: str, data_dir: str | os.PathLike[str] | None) -> list[Path]:
    out: list[Path] = []
    if data_dir is not None:
        out += [Path(data_dir) / name, Path(data_dir)]
    env = os.environ.get(DATA_ENV_VAR)
    if env:
        out += [Path(env) / name, Path(env)]
    return list(dict.fromkeys(out))


def _find(spec: TabularSpec, data_dir: str | os.PathLike[str] | None, files: Sequence[str]) -> Path:
    dirs = _candidate_dirs(spec.name, data_dir)
    for d in dirs:
        for f in files:
            if (d / f).is_file():
                return d / f
    searched = ", ".join(str(d) for d in dirs) or "(none: give --data-dir or set $DPCLIP_DATA)"
    raise DatasetNotFoundError(
        f"dataset {spec.name!r}: file {' or '.join(repr(f) for f in files)} not found; searched "
        f"{searched}. Download it from {spec.url} and put it in --data-dir DIR (or "
        f"DIR/{spec.name}, or ${DATA_ENV_VAR})"
    )


def _read_rows(path: Path, spec: TabularSpec) -> tuple[list[str] | None, list[list[str]]]:
    with open(path, newline="", encoding="utf-8-sig") as fh:
        lines = fh.read().splitlines()[spec.skip_rows:]
    if spec.delimiter == " ":
        rows = [ln.split() for ln in lines]
    else:
        rows = [[c.strip() for c in r] for r in csv.reader(lines, delimiter=spec.delimiter)]
    rows = [r for r in rows if r and any(c for c in r)]
    header = None
    if spec.header:
        # the UCI .xls of default-credit saved as CSV has an extra first row X1, X2, ..., Y
        if rows and rows[0] and rows[0][-1] == "Y" and len(rows) > 1:
            rows = rows[1:]
        header, rows = rows[0], rows[1:]
    return header, rows


def _index(col: int | str, header: list[str] | None, path: Path) -> int:
    if isinstance(col, int):
        return col
    assert header is not None
    names = [h.strip() for h in header]
    alias = {"default payment next month": ("default.payment.next.month", "Y")}
    for candidate in (col, *alias.get(col, ())):
        if candidate in names:
            return names.index(candidate)
    raise ValueError(f"{path}: no column {col!r}; columns: {names}")


def _encode(
    spec: TabularSpec, path: Path, header: list[str] | None, rows: list[list[str]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features float64 (N, D) with one-hot categoricals, labels int64, numeric-column mask)."""
    width = len(header) if header is not None else len(rows[0])
    bad = [i for i, r in enumerate(rows) if len(r) != width]
    if bad:
        raise ValueError(
            f"{path}: row {bad[0] + 1 + int(spec.header)} has {len(rows[bad[0]])} fields, expected "
            f"{width} (is this the standard UCI file of {spec.name!r}? {spec.url})"
        )
    label = _index(spec.label, header, path)
    cats = {_index(c, header, path) for c in spec.categorical}
    drop = {_index(c, header, path) for c in spec.drop if header is None or
            (isinstance(c, int) or c in header)}
    needed = max([label, *cats, *drop]) + 1
    if width < needed:
        raise ValueError(
            f"{path}: rows have {width} fields, expected at least {needed} (is this the standard "
            f"UCI file of {spec.name!r}? {spec.url})"
        )
    raw_labels = [r[label].rstrip(".") for r in rows]
    classes = spec.classes or tuple(sorted(set(raw_labels)))
    lookup = {c: i for i, c in enumerate(classes)}
    unknown = sorted(set(raw_labels) - set(lookup))
    if unknown:
        raise ValueError(f"{path}: unknown label value(s) {unknown[:5]}; expected {list(classes)}")
    y = np.array([lookup[v] for v in raw_labels], dtype=np.int64)
    blocks: list[np.ndarray] = []
    numeric: list[bool] = []
    for j in range(width):
        if j == label or j in drop:
            continue
        col = [r[j] for r in rows]
        if j in cats:
            values = sorted(set(col))
            onehot = np.zeros((len(rows), len(values)))
            pos = {v: k for k, v in enumerate(values)}
            onehot[np.arange(len(rows)), [pos[v] for v in col]] = 1.0
            blocks.append(onehot)
            numeric += [False] * len(values)
        else:
            try:
                blocks.append(np.array([float(v) for v in col])[:, None])
            except ValueError as exc:
                raise ValueError(f"{path}: column {j} should be numeric ({exc})") from None
            numeric.append(True)
    return np.concatenate(blocks, axis=1), y, np.array(numeric)


def _bundle(
    name: str, x: np.ndarray, y: np.ndarray, numeric: np.ndarray, train_idx: np.ndarray,
    test_idx: np.ndarray, source: str, num_classes: int,
) -> DatasetBundle:
    mean = np.where(numeric, x[train_idx].mean(axis=0), 0.0)
    std = np.where(numeric, x[train_idx].std(axis=0), 1.0)
    std = np.where(std > 0, std, 1.0)
    xs = torch.from_numpy(((x - mean) / std).astype(np.float32))
    yt = torch.from_numpy(y)
    tr, te = torch.as_tensor(train_idx), torch.as_tensor(test_idx)
    return DatasetBundle(
        name, TensorSplit(xs[tr], yt[tr]), TensorSplit(xs[te], yt[te]), num_classes,
        (int(x.shape[1]),), source=source,
    )


def _load(
    name: str, data_dir: str | os.PathLike[str] | None, seed: int, test_fraction: float
) -> DatasetBundle:
    spec = TABULAR_SPECS[name]
    path = _find(spec, data_dir, spec.files)
    header, rows = _read_rows(path, spec)
    if not rows:
        raise ValueError(f"{path}: no data rows")
    x, y, numeric = _encode(spec, path, header, rows)
    test_idx, train_idx = stratified_split_indices(
        torch.from_numpy(y), test_fraction, seed, argument="test_fraction"
    )
    num_classes = len(spec.classes) if spec.classes else int(y.max()) + 1
    return _bundle(name, x, y, numeric, np.asarray(train_idx), np.asarray(test_idx),
                   str(path), num_classes)


def load_adult(
    data_dir: str | os.PathLike[str] | None = None, seed: int = 0
) -> DatasetBundle:
    """UCI Adult (census income): ``adult.data`` (32,561) and ``adult.test`` (16,281; its first
    line ``|1x3 Cross validator`` and the labels' trailing ``.`` are handled), 14 attributes
    (6 numeric, 8 categorical one-hot, ``?`` a category) -> 108 features in the full files;
    label ``>50K``. The official split (``seed`` unused)."""
    del seed
    spec = TABULAR_SPECS["adult"]
    train_path = _find(spec, data_dir, ("adult.data",))
    test_path = _find(spec, data_dir, ("adult.test",))
    _, train_rows = _read_rows(train_path, spec)
    _, test_rows = _read_rows(test_path, spec)
    test_rows = [r for r in test_rows if not r[0].startswith("|")]
    x, y, numeric = _encode(spec, train_path, None, train_rows + test_rows)
    n = len(train_rows)
    return _bundle("adult", x, y, numeric, np.arange(n), np.arange(n, len(y)),
                   f"{train_path} + {test_path}", 2)


def load_german_credit(
    data_dir: str | os.PathLike[str] | None = None, seed: int = 0, *, test_fraction: float = 0.2
) -> DatasetBundle:
    """UCI Statlog German Credit ``german.data`` (1,000 x 20, space separated; 7 numeric, 13
    categorical one-hot); label 1 good -> class 0, 2 bad -> class 1. Stratified split."""
    return _load("german-credit", data_dir, seed, test_fraction)


def load_default_credit(
    data_dir: str | os.PathLike[str] | None = None, seed: int = 0, *, test_fraction: float = 0.2
) -> DatasetBundle:
    """UCI default of credit card clients (30,000 x 23) as CSV: the UCI ``.xls`` saved as
    ``default_of_credit_card_clients.csv`` (its extra ``X1..X23, Y`` row is skipped) or the
    common ``UCI_Credit_Card.csv``; ``ID`` dropped; SEX, EDUCATION, MARRIAGE one-hot; label
    ``default payment next month``. Stratified split."""
    return _load("default-credit", data_dir, seed, test_fraction)


def load_nursery(
    data_dir: str | os.PathLike[str] | None = None, seed: int = 0, *, test_fraction: float = 0.2
) -> DatasetBundle:
    """UCI Nursery ``nursery.data`` (12,960 x 8 categorical, one-hot -> 27 features), 5 classes
    (not_recom, recommend, very_recom, priority, spec_prior). Stratified split (``recommend``
    has 2 examples)."""
    return _load("nursery", data_dir, seed, test_fraction)


def load_android_permissions(
    data_dir: str | os.PathLike[str] | None = None, seed: int = 0, *, test_fraction: float = 0.2
) -> DatasetBundle:
    """UCI NATICUSdroid (Android permissions): ``data.csv`` (29,333 x 86 binary permissions and
    ``Class`` 0 benign / 1 malware; also accepted as ``NATICUSdroid.csv``). Stratified split."""
    return _load("android-permissions", data_dir, seed, test_fraction)


def load_dropout(
    data_dir: str | os.PathLike[str] | None = None, seed: int = 0, *, test_fraction: float = 0.2
) -> DatasetBundle:
    """UCI Predict Students' Dropout and Academic Success: ``data.csv`` (4,424 x 36, ``;``
    separated, header; also accepted as ``dropout.csv``); every column is used as distributed
    (integer codes standardised as numbers: 36 features, as in S2 Table 1; one-hot encoding of the
    10 coded columns would give ~250 features, beyond the paper's MLP sizes); ``Target`` Dropout / Enrolled / Graduate (3 classes). Stratified split."""
    return _load("dropout", data_dir, seed, test_fraction)
