"""Tabular UCI datasets of Lip-DP-SGD (Barczewski & Ramon, S2 Table 1) from their standard files.

Nothing is downloaded. Each loader reads the file(s) the UCI repository distributes, searched in
``data_dir/<name>``, ``data_dir``, ``$DPCLIP_DATA/<name>``, ``$DPCLIP_DATA`` (in that order; Android
and Dropout both ship as ``data.csv``, so keep them in their own sub-directories); a
missing file raises :class:`DatasetNotFoundError` naming the file, the directories searched and
the download page.

Encoding (the same for every dataset): numeric columns are clipped into a DECLARED range and
mapped to ``[-1, 1]`` (``scaling="declared-ranges"``, the default; :class:`TabularSpec.ranges`
states every range and its provenance: the UCI codebook where it documents the domain, otherwise
a generous bound declared by us, values outside clipped), a per-record map that uses no statistic
of the data. ``scaling="train-statistics"`` is the old NON-PRIVATE pipeline (noiseless mean and
population std of the TRAIN split), recorded as such in ``DatasetBundle.preprocessing``.
Categorical columns are one-hot encoded over DECLARED category lists (:class:`CategoryList`, from
each dataset's codebook, with provenance), plus one ``other`` column for every undeclared value
(a missing ``?``, an undocumented code): never over the values present in the private file. Splits: the official train/test files for Adult, a stratified
``1 - test_fraction`` / ``test_fraction`` split from ``seed`` otherwise.
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
from dpclip.data.scaling import (
    FeatureRange,
    check_scaling,
    declared_range_scale,
    preprocessing_record,
    train_statistics_scale,
)
from dpclip.data.splits import stratified_split_indices

__all__ = [
    "TABULAR_SPECS",
    "CategoryList",
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
    found); ``url``: the download page; ``ranges``: the declared range of each numeric column
    (index or name -> :class:`FeatureRange`); ``default_range``: the range of numeric columns not
    listed (``None``: every numeric column must be listed, else loading fails naming it);
    ``categories``: the declared values of each categorical column (index or name ->
    :class:`CategoryList`; every categorical column must be listed, else loading fails naming it).
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
    ranges: tuple[tuple[int | str, FeatureRange], ...] = ()
    default_range: FeatureRange | None = None
    categories: tuple[tuple[int | str, "CategoryList"], ...] = ()


@dataclass(frozen=True)
class CategoryList:
    """The DECLARED values of one categorical column, in one-hot order, and where they come from
    (the dataset's codebook). The one-hot block is ``values`` plus one last ``other`` column, for
    every value not declared (missing ``?``, undocumented codes): the encoding of a record depends
    on that record alone, and the input width on the declaration alone, never on which values
    the private file happens to hold (one record with a unique value would otherwise add a
    column and shift every other record's columns)."""

    values: tuple[str, ...]
    provenance: str

    def __post_init__(self) -> None:
        if not self.values or len(set(self.values)) != len(self.values):
            raise ValueError(f"CategoryList: values must be non-empty and distinct, got "
                             f"{self.values!r}")

    @property
    def width(self) -> int:
        return len(self.values) + 1  # + "other"


_UCI = "https://archive.ics.uci.edu/dataset"


def _r(lo: float, hi: float, provenance: str = "declared generous bound") -> FeatureRange:
    return FeatureRange(float(lo), float(hi), provenance)


_BIN = _r(0, 1, "codebook: binary 0/1")
_ADULT_RANGES = (
    (0, _r(0, 100)),  # age (years)
    (2, _r(0, 1.5e6)),  # fnlwgt (census sampling weight)
    (4, _r(1, 16, "codebook: the 16 education levels of adult.names, coded 1..16")),
    (10, _r(0, 99999, "declared: the census top code 99999")),  # capital-gain
    (11, _r(0, 5000)),  # capital-loss
    (12, _r(0, 99, "declared: the census top code 99")),  # hours-per-week
)
_GERMAN_RANGES = (
    (1, _r(0, 120)),  # duration in months
    (4, _r(0, 25000)),  # credit amount (DM)
    (7, _r(0, 4)),  # installment rate in percentage of disposable income (coded)
    (10, _r(0, 4)),  # present residence since (coded)
    (12, _r(0, 100)),  # age in years
    (15, _r(0, 4)),  # number of existing credits at this bank
    (17, _r(0, 2)),  # number of people being liable to provide maintenance for
)
_PAY_STATUS = _r(-2, 9, "codebook (Yeh & Lien 2009): -1 paid duly, 1..9 months of delay; "
                 "declared down to -2")
_DEFAULT_RANGES = (
    ("LIMIT_BAL", _r(0, 1e6)),  # NT dollars
    ("AGE", _r(0, 100)),
    *((f"PAY_{k}", _PAY_STATUS) for k in (0, 2, 3, 4, 5, 6)),
    *((f"BILL_AMT{k}", _r(-1e6, 1e6)) for k in range(1, 7)),
    *((f"PAY_AMT{k}", _r(0, 1e6)) for k in range(1, 7)),
)
_CODES = "codebook: the code list of the UCI variable table"
_SEM = (_r(0, 40), _r(0, 40), _r(0, 60), _r(0, 40),  # credited, enrolled, evaluations, approved
        _r(0, 20, "codebook: grades 0..20"), _r(0, 40))  # grade, without evaluations
_DROPOUT_RANGES = tuple(enumerate((
    _r(1, 6, _CODES),  # marital status
    _r(1, 57, _CODES),  # application mode
    _r(0, 9, "codebook: 0 first choice .. 9 last choice"),  # application order
    _r(33, 9991, _CODES),  # course
    _BIN,  # daytime/evening attendance
    _r(1, 43, _CODES),  # previous qualification
    _r(0, 200, "codebook: grade between 0 and 200"),  # previous qualification (grade)
    _r(1, 109, _CODES),  # nacionality
    _r(1, 44, _CODES), _r(1, 44, _CODES),  # mother's, father's qualification
    _r(0, 194, _CODES), _r(0, 195, _CODES),  # mother's, father's occupation
    _r(0, 200, "codebook: grade between 0 and 200"),  # admission grade
    _BIN, _BIN, _BIN, _BIN, _BIN, _BIN,  # displaced, special needs, debtor, fees, gender, schol.
    _r(0, 100),  # age at enrollment
    _BIN,  # international
    *_SEM, *_SEM,  # curricular units 1st and 2nd semester
    _r(0, 30),  # unemployment rate (%)
    _r(-10, 10),  # inflation rate (%)
    _r(-10, 10),  # GDP growth (%)
)))


def _c(values: str, provenance: str) -> CategoryList:
    return CategoryList(tuple(values.split()), provenance)


_ADULT_NAMES = "codebook: adult.names (UCI Adult)"
_ADULT_CATEGORIES = (
    (1, _c("Private Self-emp-not-inc Self-emp-inc Federal-gov Local-gov State-gov Without-pay "
           "Never-worked", _ADULT_NAMES)),  # workclass
    (3, _c("Bachelors Some-college 11th HS-grad Prof-school Assoc-acdm Assoc-voc 9th 7th-8th 12th "
           "Masters 1st-4th 10th Doctorate 5th-6th Preschool", _ADULT_NAMES)),  # education
    (5, _c("Married-civ-spouse Divorced Never-married Separated Widowed Married-spouse-absent "
           "Married-AF-spouse", _ADULT_NAMES)),  # marital-status
    (6, _c("Tech-support Craft-repair Other-service Sales Exec-managerial Prof-specialty "
           "Handlers-cleaners Machine-op-inspct Adm-clerical Farming-fishing Transport-moving "
           "Priv-house-serv Protective-serv Armed-Forces", _ADULT_NAMES)),  # occupation
    (7, _c("Wife Own-child Husband Not-in-family Other-relative Unmarried",
           _ADULT_NAMES)),  # relationship
    (8, _c("White Asian-Pac-Islander Amer-Indian-Eskimo Other Black", _ADULT_NAMES)),  # race
    (9, _c("Female Male", _ADULT_NAMES)),  # sex
    (13, _c("United-States Cambodia England Puerto-Rico Canada Germany Outlying-US(Guam-USVI-etc) "
            "India Japan Greece South China Cuba Iran Honduras Philippines Italy Poland Jamaica "
            "Vietnam Mexico Portugal Ireland France Dominican-Republic Laos Ecuador Taiwan Haiti "
            "Columbia Hungary Guatemala Nicaragua Scotland Thailand Yugoslavia El-Salvador "
            "Trinadad&Tobago Peru Hong Holand-Netherlands", _ADULT_NAMES)),  # native-country
)
_GERMAN_DOC = "codebook: german.doc (UCI Statlog German Credit), attribute "
_GERMAN_CATEGORIES = tuple(
    (col, _c(" ".join(f"A{attr}{k}" for k in codes), f"{_GERMAN_DOC}{attr}"))
    for col, attr, codes in (
        (0, 1, range(1, 5)), (2, 3, range(0, 5)), (3, 4, range(0, 11)), (5, 6, range(1, 6)),
        (6, 7, range(1, 6)), (8, 9, range(1, 6)), (9, 10, range(1, 4)), (11, 12, range(1, 5)),
        (13, 14, range(1, 4)), (14, 15, range(1, 4)), (16, 17, range(1, 5)),
        (18, 19, range(1, 3)), (19, 20, range(1, 3)),
    )
)
_YEH = "codebook: Yeh & Lien 2009 / the UCI variable table"
_DEFAULT_CATEGORIES = (
    ("SEX", _c("1 2", f"{_YEH} (1 male, 2 female)")),
    ("EDUCATION", _c("1 2 3 4", f"{_YEH} (1 graduate school, 2 university, 3 high school, "
                                "4 others; the undocumented 0, 5, 6 go to 'other')")),
    ("MARRIAGE", _c("1 2 3", f"{_YEH} (1 married, 2 single, 3 others; the undocumented 0 goes "
                             "to 'other')")),
)
_NURSERY_NAMES = "codebook: nursery.names (UCI Nursery)"
_NURSERY_CATEGORIES = tuple(enumerate(_c(v, _NURSERY_NAMES) for v in (
    "usual pretentious great_pret",  # parents
    "proper less_proper improper critical very_crit",  # has_nurs
    "complete completed incomplete foster",  # form
    "1 2 3 more",  # children
    "convenient less_conv critical",  # housing
    "convenient inconv",  # finance
    "nonprob slightly_prob problematic",  # social
    "recommended priority not_recom",  # health
)))

TABULAR_SPECS: dict[str, TabularSpec] = {
    "adult": TabularSpec(
        "adult", ("adult.data",), ",", False, 14, (1, 3, 5, 6, 7, 8, 9, 13),
        f"{_UCI}/2/adult (files adult.data and adult.test)", classes=("<=50K", ">50K"),
        ranges=_ADULT_RANGES,
        categories=_ADULT_CATEGORIES,
    ),
    "german-credit": TabularSpec(
        "german-credit", ("german.data",), " ", False, 20,
        (0, 2, 3, 5, 6, 8, 9, 11, 13, 14, 16, 18, 19),
        f"{_UCI}/144/statlog+german+credit+data (file german.data)", classes=("1", "2"),
        ranges=_GERMAN_RANGES,
        categories=_GERMAN_CATEGORIES,
    ),
    "default-credit": TabularSpec(
        "default-credit",
        ("default_of_credit_card_clients.csv", "default of credit card clients.csv",
         "UCI_Credit_Card.csv"),
        ",", True, "default payment next month", ("SEX", "EDUCATION", "MARRIAGE"),
        f"{_UCI}/350/default+of+credit+card+clients (the .xls saved as CSV, "
        "default_of_credit_card_clients.csv)", drop=("ID",), classes=("0", "1"),
        ranges=_DEFAULT_RANGES,
        categories=_DEFAULT_CATEGORIES,
    ),
    "nursery": TabularSpec(
        "nursery", ("nursery.data",), ",", False, 8, (0, 1, 2, 3, 4, 5, 6, 7),
        f"{_UCI}/76/nursery (file nursery.data)",
        classes=("not_recom", "recommend", "very_recom", "priority", "spec_prior"),
        categories=_NURSERY_CATEGORIES,
    ),
    "android-permissions": TabularSpec(
        "android-permissions", ("NATICUSdroid.csv", "android_permissions.csv", "data.csv"),
        ",", True, "Class", (),
        f"{_UCI}/722/naticusdroid+android+permissions+dataset (file data.csv; 86 permission "
        "columns and Class)", classes=("0", "1"),
        default_range=_r(0, 1, "codebook: binary permission flags"),
    ),
    "dropout": TabularSpec(
        "dropout", ("dropout.csv", "data.csv"), ";", True, "Target",
        (),
        f"{_UCI}/697/predict+students+dropout+and+academic+success (file data.csv, ';'-separated)",
        classes=("Dropout", "Enrolled", "Graduate"),
        ranges=_DROPOUT_RANGES,
    ),
}


def _candidate_dirs(name: str, data_dir: str | os.PathLike[str] | None) -> list[Path]:
    out: list[Path] = []
    if data_dir is not None:  # a directory given explicitly is the only place searched
        out += [Path(data_dir) / name, Path(data_dir)]
    else:
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
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[FeatureRange | None]]:
    """(features float64 (N, D) with one-hot categoricals, labels int64, numeric-column mask,
    the declared range of each feature: ``None`` for one-hot columns)."""
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
    if unknown:  # (the values are private records' labels: not quoted, fifty-first review)
        raise ValueError(f"{path}: {len(unknown)} label value(s) not among the declared classes "
                         f"{list(classes)}; check the file is the dataset's standard one")
    y = np.array([lookup[v] for v in raw_labels], dtype=np.int64)
    declared = {_index(c, header, path): r for c, r in spec.ranges}
    categories = {_index(c, header, path): v for c, v in spec.categories}
    blocks: list[np.ndarray] = []
    numeric: list[bool] = []
    ranges: list[FeatureRange | None] = []
    for j in range(width):
        if j == label or j in drop:
            continue
        col = [r[j] for r in rows]
        name = header[j] if header is not None else j  # for messages
        if j in cats:
            declared_cats = categories.get(j)
            if declared_cats is None:
                raise ValueError(
                    f"{path}: categorical column {name!r} of {spec.name!r} has no declared "
                    "category list; add it to TABULAR_SPECS[...].categories (a CategoryList "
                    "from the codebook: one-hot columns must not be read off the private file, "
                    "where one record with a unique value adds a column)")
            pos = {v: k for k, v in enumerate(declared_cats.values)}
            other = len(declared_cats.values)  # every undeclared value (and "?")
            onehot = np.zeros((len(rows), declared_cats.width))
            onehot[np.arange(len(rows)), [pos.get(v, other) for v in col]] = 1.0
            blocks.append(onehot)
            numeric += [False] * declared_cats.width
            ranges += [None] * declared_cats.width
        else:
            try:
                blocks.append(np.array([float(v) for v in col])[:, None])
            except ValueError:  # (float's message quotes the cell: a private value, not quoted)
                raise ValueError(f"{path}: column {j} should be numeric (a value in it is not a "
                                 "number); declare it categorical or fix the file") from None
            numeric.append(True)
            r = declared.get(j, spec.default_range)
            if r is None:
                raise ValueError(
                    f"{path}: numeric column {name!r} of {spec.name!r} has no declared range; "
                    "add it to TABULAR_SPECS[...].ranges (scaling must not use statistics of "
                    "the private data)"
                )
            ranges.append(r)
    return np.concatenate(blocks, axis=1), y, np.array(numeric), ranges


def _bundle(
    name: str, x: np.ndarray, y: np.ndarray, numeric: np.ndarray, train_idx: np.ndarray,
    test_idx: np.ndarray, source: str, num_classes: int, ranges: list[FeatureRange | None],
    scaling: str,
) -> DatasetBundle:
    if scaling == "declared-ranges":
        scaled = declared_range_scale(x, ranges)
        detail = (f"{int(numeric.sum())} numeric column(s) clipped into their declared ranges "
                  f"(dpclip.data.tabular.TABULAR_SPECS[{name!r}]) and mapped to [-1, 1]; "
                  "categorical columns one-hot over declared category lists (+ 'other')")
    else:
        scaled = train_statistics_scale(x, numeric, train_idx)
        detail = (f"{int(numeric.sum())} numeric column(s); categorical columns one-hot over "
                  "declared category lists (+ 'other')")
    xs = torch.from_numpy(scaled.astype(np.float32))
    yt = torch.from_numpy(y)
    tr, te = torch.as_tensor(train_idx), torch.as_tensor(test_idx)
    return DatasetBundle(
        name, TensorSplit(xs[tr], yt[tr]), TensorSplit(xs[te], yt[te]), num_classes,
        (int(x.shape[1]),), source=source, derived_from=(name,),
        preprocessing=preprocessing_record(scaling, detail),
    )


def _load(
    name: str, data_dir: str | os.PathLike[str] | None, seed: int, test_fraction: float,
    scaling: str,
) -> DatasetBundle:
    check_scaling(scaling, name)
    spec = TABULAR_SPECS[name]
    path = _find(spec, data_dir, spec.files)
    header, rows = _read_rows(path, spec)
    if not rows:
        raise ValueError(f"{path}: no data rows")
    x, y, numeric, ranges = _encode(spec, path, header, rows)
    test_idx, train_idx = stratified_split_indices(
        torch.from_numpy(y), test_fraction, seed, argument="test_fraction"
    )
    num_classes = len(spec.classes) if spec.classes else int(y.max()) + 1
    return _bundle(name, x, y, numeric, np.asarray(train_idx), np.asarray(test_idx),
                   str(path), num_classes, ranges, scaling)


def load_adult(
    data_dir: str | os.PathLike[str] | None = None, seed: int = 0, *,
    scaling: str = "declared-ranges",
) -> DatasetBundle:
    """UCI Adult (census income): ``adult.data`` (32,561) and ``adult.test`` (16,281; its first
    line ``|1x3 Cross validator`` and the labels' trailing ``.`` are handled), 14 attributes
    (6 numeric, 8 categorical one-hot over the categories of adult.names, each + ``other``, where
    ``?`` goes) -> 113 features;
    label ``>50K``. The official split (``seed`` unused)."""
    del seed
    check_scaling(scaling, "adult")
    spec = TABULAR_SPECS["adult"]
    train_path = _find(spec, data_dir, ("adult.data",))
    test_path = _find(spec, data_dir, ("adult.test",))
    _, train_rows = _read_rows(train_path, spec)
    _, test_rows = _read_rows(test_path, spec)
    test_rows = [r for r in test_rows if not r[0].startswith("|")]
    x, y, numeric, ranges = _encode(spec, train_path, None, train_rows + test_rows)
    n = len(train_rows)
    return _bundle("adult", x, y, numeric, np.arange(n), np.arange(n, len(y)),
                   f"{train_path} + {test_path}", 2, ranges, scaling)


def load_german_credit(
    data_dir: str | os.PathLike[str] | None = None, seed: int = 0, *, test_fraction: float = 0.2,
    scaling: str = "declared-ranges",
) -> DatasetBundle:
    """UCI Statlog German Credit ``german.data`` (1,000 x 20, space separated; 7 numeric, 13
    categorical one-hot); label 1 good -> class 0, 2 bad -> class 1. Stratified split."""
    return _load("german-credit", data_dir, seed, test_fraction, scaling)


def load_default_credit(
    data_dir: str | os.PathLike[str] | None = None, seed: int = 0, *, test_fraction: float = 0.2,
    scaling: str = "declared-ranges",
) -> DatasetBundle:
    """UCI default of credit card clients (30,000 x 23) as CSV: the UCI ``.xls`` saved as
    ``default_of_credit_card_clients.csv`` (its extra ``X1..X23, Y`` row is skipped) or the
    common ``UCI_Credit_Card.csv``; ``ID`` dropped; SEX, EDUCATION, MARRIAGE one-hot; label
    ``default payment next month``. Stratified split."""
    return _load("default-credit", data_dir, seed, test_fraction, scaling)


def load_nursery(
    data_dir: str | os.PathLike[str] | None = None, seed: int = 0, *, test_fraction: float = 0.2,
    scaling: str = "declared-ranges",
) -> DatasetBundle:
    """UCI Nursery ``nursery.data`` (12,960 x 8 categorical, one-hot over the
    values of nursery.names, each + ``other`` -> 35 features), 5 classes
    (not_recom, recommend, very_recom, priority, spec_prior). Stratified split (``recommend``
    has 2 examples)."""
    return _load("nursery", data_dir, seed, test_fraction, scaling)


def load_android_permissions(
    data_dir: str | os.PathLike[str] | None = None, seed: int = 0, *, test_fraction: float = 0.2,
    scaling: str = "declared-ranges",
) -> DatasetBundle:
    """UCI NATICUSdroid (Android permissions): ``data.csv`` (29,333 x 86 binary permissions and
    ``Class`` 0 benign / 1 malware; also accepted as ``NATICUSdroid.csv``). Stratified split."""
    return _load("android-permissions", data_dir, seed, test_fraction, scaling)


def load_dropout(
    data_dir: str | os.PathLike[str] | None = None, seed: int = 0, *, test_fraction: float = 0.2,
    scaling: str = "declared-ranges",
) -> DatasetBundle:
    """UCI Predict Students' Dropout and Academic Success: ``data.csv`` (4,424 x 36, ``;``
    separated, header; also accepted as ``dropout.csv``); every column is used as distributed
    (integer codes scaled as numbers within their codebook ranges: 36 features, as in S2 Table 1; one-hot encoding of the
    10 coded columns would give ~250 features, beyond the paper's MLP sizes); ``Target`` Dropout / Enrolled / Graduate (3 classes). Stratified split."""
    return _load("dropout", data_dir, seed, test_fraction, scaling)
