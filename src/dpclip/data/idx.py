"""IDX files (the MNIST / Fashion-MNIST format) and the directory search for them.

IDX format (LeCun & Cortes, http://yann.lecun.com/exdb/mnist/): a 4-byte magic number
``0x00 0x00 <dtype code> <ndim>``, then ``ndim`` big-endian uint32 dimension sizes, then the data in
row-major order. Files may be gzipped (detected from the gzip header, not the file name).

Search order for a dataset ``<name>`` (first directory holding all four files wins):

1. the ``data_dir`` argument, then ``data_dir/<name>``; when ``data_dir`` is given, ONLY these
   two are searched (a directory the user named that does not exist or lacks the files is an
   error listing what was searched, never a silent fallback to other data);
2. otherwise ``$DPCLIP_DATA/<name>``, then ``$DPCLIP_DATA``;
3. then ``<root>/<name>`` for each root in :data:`SYSTEM_DATA_ROOTS` (``/usr/share/datasets``,
   where the Debian package ``dataset-fashion-mnist`` installs Fashion-MNIST).

Nothing is downloaded: this library runs offline.
"""

from __future__ import annotations

import gzip
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dpclip.data.base import DatasetBundle, DatasetNotFoundError, TensorSplit
from dpclip.data.features import apply_features, parse_features

__all__ = [
    "DATA_ENV_VAR",
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_STD",
    "IDX_FILES",
    "MNIST_MEAN",
    "MNIST_STD",
    "SYSTEM_DATA_ROOTS",
    "IdxFormatError",
    "find_idx_dir",
    "load_fashion_mnist",
    "load_mnist",
    "read_idx",
]

#: Environment variable naming a data root (``$DPCLIP_DATA/<name>`` or ``$DPCLIP_DATA`` itself).
DATA_ENV_VAR = "DPCLIP_DATA"

#: System-wide data roots searched last (``<root>/<name>``).
SYSTEM_DATA_ROOTS: tuple[Path, ...] = (Path("/usr/share/datasets"),)

#: The four standard file names (each may carry a ``.gz`` suffix), by role.
IDX_FILES: dict[str, str] = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}

#: Per-pixel mean / std of the Fashion-MNIST training images after scaling to [0, 1]
#: (computed over all 60,000 x 784 training pixels: 0.2860 / 0.3530).
FASHION_MNIST_MEAN = 0.2860
FASHION_MNIST_STD = 0.3530
#: Per-pixel mean / std of the MNIST training images after scaling to [0, 1] (the usual
#: 0.1307 / 0.3081 of the PyTorch MNIST example).
MNIST_MEAN = 0.1307
MNIST_STD = 0.3081

_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


class IdxFormatError(ValueError):
    """An IDX file is corrupted or is not the expected kind of file."""


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX file (gzipped or plain) into a numpy array of its declared dtype and shape.

    Raises:
        IdxFormatError: bad magic number, unknown dtype code, truncated or oversized payload, or
            a corrupted gzip stream; the message names the file and what to do.
    """
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise IdxFormatError(
                f"{path}: corrupted gzip stream ({exc}); delete the file and obtain it again"
            ) from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise IdxFormatError(
            f"{path}: not an IDX file (magic number {raw[:4].hex() or 'missing'}, expected "
            "0000 followed by a dtype code in 08/09/0b/0c/0d/0e and the number of dimensions); "
            "the file is corrupted or not an MNIST-format file: obtain it again"
        )
    dtype = _IDX_DTYPES[raw[2]]
    ndim = raw[3]
    header = 4 + 4 * ndim
    if ndim == 0 or len(raw) < header:
        raise IdxFormatError(f"{path}: truncated IDX header ({ndim} dimensions declared)")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise IdxFormatError(
            f"{path}: payload has {len(raw) - header} bytes but the header declares shape "
            f"{shape} of {dtype} ({expected} bytes); the file is truncated or corrupted: "
            "obtain it again"
        )
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)


@dataclass(frozen=True)
class _IdxSpec:
    name: str
    mean: float
    std: float
    num_classes: int
    image_size: tuple[int, int]
    how_to_get: str


_FASHION_MNIST = _IdxSpec(
    name="fashion-mnist",
    mean=FASHION_MNIST_MEAN,
    std=FASHION_MNIST_STD,
    num_classes=10,
    image_size=(28, 28),
    how_to_get=(
        "on Debian/Ubuntu: `apt-get install dataset-fashion-mnist` (installs them into "
        "/usr/share/datasets/fashion-mnist); otherwise download the four files from the Zalando "
        "fashion-mnist GitHub repository (https://github.com/zalandoresearch/fashion-mnist, "
        "releases / data/fashion) into a directory and pass it as --data-dir "
        f"(or set ${DATA_ENV_VAR})"
    ),
)
_MNIST = _IdxSpec(
    name="mnist",
    mean=MNIST_MEAN,
    std=MNIST_STD,
    num_classes=10,
    image_size=(28, 28),
    how_to_get=(
        "download the four files from the original MNIST site (http://yann.lecun.com/exdb/mnist/) "
        "or a mirror (e.g. https://ossci-datasets.s3.amazonaws.com/mnist/) into a directory and "
        f"pass it as --data-dir (or set ${DATA_ENV_VAR}, or place them in "
        "/usr/share/datasets/mnist)"
    ),
)


def _candidate_dirs(name: str, data_dir: str | os.PathLike[str] | None) -> list[Path]:
    candidates: list[Path] = []
    if data_dir is not None:  # an explicit directory is the only place searched: no fallback
        candidates += [Path(data_dir), Path(data_dir) / name]
    else:
        env = os.environ.get(DATA_ENV_VAR)
        if env:
            candidates += [Path(env) / name, Path(env)]
        candidates += [Path(root) / name for root in SYSTEM_DATA_ROOTS]
    unique: list[Path] = []
    for c in candidates:
        if c not in unique:
            unique.append(c)
    return unique


def _files_in(directory: Path) -> tuple[dict[str, Path], list[str]]:
    """The IDX files present in ``directory`` (plain preferred over .gz) and those missing."""
    found: dict[str, Path] = {}
    missing: list[str] = []
    for role, stem in IDX_FILES.items():
        for candidate in (directory / stem, directory / f"{stem}.gz"):
            if candidate.is_file():
                found[role] = candidate
                break
        else:
            missing.append(f"{stem}[.gz]")
    return found, missing


def find_idx_dir(
    name: str, data_dir: str | os.PathLike[str] | None = None, *, how_to_get: str = ""
) -> dict[str, Path]:
    """Locate the four IDX files of dataset ``name`` following the module's search order.

    Returns:
        The file of each role in :data:`IDX_FILES`, all from the first directory holding all four.

    Raises:
        DatasetNotFoundError: listing each directory searched (and what it lacked), the exact
            files expected and ``how_to_get``.
    """
    report = []
    for directory in _candidate_dirs(name, data_dir):
        if not directory.is_dir():
            report.append(f"  - {directory} (no such directory)")
            continue
        found, missing = _files_in(directory)
        if not missing:
            return found
        report.append(f"  - {directory} (missing: {', '.join(missing)})")
    expected = ", ".join(f"{stem}[.gz]" for stem in IDX_FILES.values())
    where = (f"in the data directory you gave, {str(data_dir)!r} (--data-dir / data_dir; "
             f"given explicitly, so ${DATA_ENV_VAR} and the system directories were not "
             "searched)" if data_dir is not None else "")
    raise DatasetNotFoundError(
        f"dataset {name!r} not found{' ' + where if where else ''}. Directories searched, in "
        "order:\n"
        + "\n".join(report)
        + f"\nExpected in one directory the four IDX files: {expected} "
        "(gzipped or not).\n" + (f"To get them: {how_to_get}." if how_to_get else "")
    )


# decoded uint8 arrays keyed by (path, size, mtime): numpy arrays are read-only views of the
# file bytes, so sharing them across calls is safe; the float tensors are rebuilt on every call.
_CACHE: dict[tuple[str, int, int], np.ndarray] = {}


def _read_cached(path: Path) -> np.ndarray:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _CACHE:
        _CACHE[key] = read_idx(path)
    return _CACHE[key]


def _load_split(spec: _IdxSpec, images_path: Path, labels_path: Path) -> TensorSplit:
    images = _read_cached(images_path)
    labels = _read_cached(labels_path)
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != spec.image_size:
        raise IdxFormatError(
            f"{images_path}: expected uint8 images of shape (N, {spec.image_size[0]}, "
            f"{spec.image_size[1]}), got {images.dtype} {images.shape}; is this the right file?"
        )
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise IdxFormatError(
            f"{labels_path}: expected uint8 labels of shape (N,), got {labels.dtype} "
            f"{labels.shape}; is this the right file?"
        )
    if labels.shape[0] != images.shape[0]:
        raise IdxFormatError(
            f"{images_path} has {images.shape[0]} images but {labels_path} has "
            f"{labels.shape[0]} labels; the files do not belong together"
        )
    if labels.size and int(labels.max()) >= spec.num_classes:
        raise IdxFormatError(
            f"{labels_path}: label {int(labels.max())} outside [0, {spec.num_classes})"
        )
    # (pixel / 255 - mean) / std, in place on one float32 buffer (the full FMNIST is 188 MB)
    x = torch.from_numpy(images.copy()).to(torch.float32).unsqueeze(1)
    x.mul_(1.0 / (255.0 * spec.std)).sub_(spec.mean / spec.std)
    y = torch.from_numpy(labels.astype(np.int64))
    return TensorSplit(x, y)


def _load_idx_dataset(
    spec: _IdxSpec, data_dir: str | os.PathLike[str] | None, download: bool
) -> DatasetBundle:
    if download:
        raise ValueError(
            f"download=True is not available: dpclip runs offline and never downloads datasets. "
            f"Get the {spec.name} files yourself: {spec.how_to_get}; then call with download=False"
        )
    files = find_idx_dir(spec.name, data_dir, how_to_get=spec.how_to_get)
    try:
        train = _load_split(spec, files["train_images"], files["train_labels"])
        test = _load_split(spec, files["test_images"], files["test_labels"])
    except IdxFormatError as exc:  # say which dataset's files to fetch again, and how
        raise IdxFormatError(
            f"{exc}.\nThe {spec.name} files in {files['train_images'].parent} cannot be used; "
            f"get them again: {spec.how_to_get}"
        ) from None
    return DatasetBundle(
        spec.name,
        train,
        test,
        spec.num_classes,
        (1, *spec.image_size),
        is_public=False,
        source=str(files["train_images"].parent),
    )


def load_fashion_mnist(
    data_dir: str | os.PathLike[str] | None = None, seed: int = 0, *, download: bool = False,
    features: str = "none",
) -> DatasetBundle:
    """Fashion-MNIST (Xiao, Rasul & Vollgraf 2017): 60,000 / 10,000 grey 28x28 images, 10 classes.

    Pixels are scaled to [0, 1] and normalised with the training-set mean 0.2860 and std 0.3530;
    inputs have shape ``(N, 1, 28, 28)``. The official train/test split is used, so ``seed`` has
    no effect. ``download=True`` raises (offline library). ``features``: a fixed per-example
    feature map (:mod:`dpclip.data.features`, e.g. ``"scattering"``: Tramer & Boneh's 81 x 7 x 7
    scattering coefficients), ``"none"`` by default.
    """
    del seed  # the official split is fixed
    features = parse_features(features)  # (checked before the files are read)
    return apply_features(_load_idx_dataset(_FASHION_MNIST, data_dir, download), features)


def load_mnist(
    data_dir: str | os.PathLike[str] | None = None, seed: int = 0, *, download: bool = False,
    features: str = "none",
) -> DatasetBundle:
    """MNIST (LeCun et al. 1998): 60,000 / 10,000 grey 28x28 digit images, 10 classes.

    Pixels are scaled to [0, 1] and normalised with mean 0.1307 and std 0.3081; inputs have shape
    ``(N, 1, 28, 28)``. The official split is used, so ``seed`` has no effect.
    ``download=True`` raises (offline library). ``features``: a fixed per-example feature map
    (:mod:`dpclip.data.features`, e.g. ``"scattering"``), ``"none"`` by default.
    """
    del seed
    features = parse_features(features)
    return apply_features(_load_idx_dataset(_MNIST, data_dir, download), features)
