"""CIFAR-10 and CIFAR-100 (Krizhevsky 2009) from the official "python version" files.

dpclip never downloads: the files are read from the first of these places that has them,

1. ``data_dir``, ``data_dir/<folder>`` and ``data_dir/<name>`` (``--data-dir``); when
   ``data_dir`` is given, ONLY these are searched (no silent fallback to other data);
2. otherwise the same under ``$DPCLIP_DATA``;
3. then ``/usr/share/datasets/<name>``;

where ``<folder>`` is the archive's folder (``cifar-10-batches-py`` / ``cifar-100-python``) and a
place "has them" when it holds the extracted files or the original archive
(``cifar-10-python.tar.gz`` / ``cifar-100-python.tar.gz``, read without extracting). A missing
dataset raises :class:`~dpclip.data.base.DatasetNotFoundError` listing every place searched and
what to fetch.

The files are Python pickles. They are read with a restricted unpickler that only rebuilds the
containers and numpy arrays the format uses, so a tampered file cannot run code.
"""

from __future__ import annotations

import io
import os
import pickle
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpclip.data.base import DatasetBundle, DatasetNotFoundError, TensorSplit
from dpclip.data.features import apply_features, parse_features
from dpclip.data.idx import DATA_ENV_VAR, SYSTEM_DATA_ROOTS

__all__ = ["CifarFormatError", "load_cifar10", "load_cifar100"]


class CifarFormatError(ValueError):
    """A CIFAR file does not have the layout of the official python version."""


@dataclass(frozen=True)
class _CifarSpec:
    name: str
    folder: str  #: the folder inside the archive
    archive: str
    train: tuple[str, ...]
    test: str
    label_key: bytes
    num_classes: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    url: str


_CIFAR10 = _CifarSpec(
    "cifar10", "cifar-10-batches-py", "cifar-10-python.tar.gz",
    tuple(f"data_batch_{i}" for i in range(1, 6)), "test_batch", b"labels", 10,
    (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616),
    "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
)
_CIFAR100 = _CifarSpec(
    "cifar100", "cifar-100-python", "cifar-100-python.tar.gz", ("train",), "test",
    b"fine_labels", 100, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762),
    "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
)

#: what the official pickles (written by Python 2 cPickle with numpy) may reference
_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise CifarFormatError(
            f"refusing to load {module}.{name} from a CIFAR file: the official files hold only "
            "dicts, lists and numpy arrays"
        )


def _unpickle(data: bytes, where: str) -> dict:
    try:
        obj = _SafeUnpickler(io.BytesIO(data), encoding="bytes").load()
    except CifarFormatError:
        raise
    except Exception as exc:  # noqa: BLE001 - any decoding failure is a format error
        raise CifarFormatError(f"{where}: not a CIFAR python-version pickle ({exc})") from exc
    if not isinstance(obj, dict):
        raise CifarFormatError(f"{where}: expected a dict, got {type(obj).__name__}")
    return obj


def _candidates(spec: _CifarSpec, data_dir: str | os.PathLike[str] | None) -> list[Path]:
    roots: list[Path] = []
    if data_dir is not None:  # an explicit directory is the only place searched: no fallback
        roots.append(Path(data_dir))
    else:
        env = os.environ.get(DATA_ENV_VAR)
        if env:
            roots.append(Path(env))
    out: list[Path] = []
    for root in roots:
        out += [root, root / spec.folder, root / spec.name]
    if data_dir is None:
        out += [Path(r) / spec.name for r in SYSTEM_DATA_ROOTS]
    unique: list[Path] = []
    for c in out:
        if c not in unique:
            unique.append(c)
    return unique


def _read_members(spec: _CifarSpec, data_dir: str | os.PathLike[str] | None
                  ) -> tuple[dict[str, bytes], str]:
    """The raw bytes of every needed file, and where they came from."""
    needed = (*spec.train, spec.test)
    report = []
    for d in _candidates(spec, data_dir):
        if not d.is_dir():
            report.append(f"  - {d} (no such directory)")
            continue
        missing = [f for f in needed if not (d / f).is_file()]
        if not missing:
            return {f: (d / f).read_bytes() for f in needed}, str(d)
        archive = d / spec.archive
        if archive.is_file():
            out: dict[str, bytes] = {}
            try:
                with tarfile.open(archive, "r:*") as tar:
                    for f in needed:
                        try:
                            member = tar.extractfile(f"{spec.folder}/{f}")
                        except KeyError:
                            member = None
                        if member is None:
                            raise CifarFormatError(
                                f"{archive}: no member {spec.folder}/{f}; is this the official "
                                f"{spec.archive}?")
                        out[f] = member.read()
            except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
                raise CifarFormatError(
                    f"{archive}: corrupted or truncated archive ({type(exc).__name__}: "
                    f"{' '.join(str(exc).split())}); "
                    f"delete it and download {spec.url} again"
                ) from None
            return out, str(archive)
        report.append(f"  - {d} (missing: {', '.join(missing)}; no {spec.archive})")
    where = (f" in the data directory you gave, {str(data_dir)!r} (--data-dir / data_dir; "
             f"given explicitly, so ${DATA_ENV_VAR} and the system directories were not "
             "searched)" if data_dir is not None else "")
    raise DatasetNotFoundError(
        f"dataset {spec.name!r} not found{where}. Places searched, in order:\n"
        + "\n".join(report)
        + f"\nExpected the python-version files {', '.join(needed)} (the folder {spec.folder} "
        f"of {spec.archive}) or the archive itself.\nTo get them: download {spec.url} and pass "
        f"its directory (extracted or not) as --data-dir (or set ${DATA_ENV_VAR}, or place it in "
        f"/usr/share/datasets/{spec.name})."
    )


def _split(spec: _CifarSpec, raw: dict[str, bytes], files: tuple[str, ...],
           source: str) -> TensorSplit:
    images, labels = [], []
    for f in files:
        where = f"{source}: {f}"
        d = _unpickle(raw[f], where)
        data, lab = d.get(b"data"), d.get(spec.label_key)
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
                or data.shape[1] != 3072:
            got = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else repr(type(data))
            raise CifarFormatError(f"{where}: expected b'data' uint8 of shape (N, 3072), got {got}")
        lab = np.asarray(lab, dtype=np.int64) if lab is not None else None
        if lab is None or lab.shape != (data.shape[0],):
            raise CifarFormatError(
                f"{where}: expected {spec.label_key!r} with one label per image ({data.shape[0]})")
        if lab.size and (lab.min() < 0 or lab.max() >= spec.num_classes):
            raise CifarFormatError(f"{where}: labels outside [0, {spec.num_classes})")
        images.append(data)
        labels.append(lab)
    x = torch.from_numpy(np.concatenate(images)).to(torch.float32).view(-1, 3, 32, 32)
    mean = torch.tensor(spec.mean).view(1, 3, 1, 1)
    std = torch.tensor(spec.std).view(1, 3, 1, 1)
    x.div_(255.0).sub_(mean).div_(std)
    return TensorSplit(x, torch.from_numpy(np.concatenate(labels)))


def _load(spec: _CifarSpec, data_dir: str | os.PathLike[str] | None,
          download: bool) -> DatasetBundle:
    if download:
        raise ValueError(
            f"download=True is not available: dpclip runs offline and never downloads datasets. "
            f"Download {spec.url} yourself and pass its directory as --data-dir")
    raw, source = _read_members(spec, data_dir)
    try:
        train = _split(spec, raw, spec.train, source)
        test = _split(spec, raw, (spec.test,), source)
    except CifarFormatError as exc:  # say what to fetch again
        raise CifarFormatError(
            f"{exc}.\nThe {spec.name} files in {source} cannot be used; get them again: "
            f"download {spec.url} and pass its directory as --data-dir"
        ) from None
    return DatasetBundle(spec.name, train, test, spec.num_classes, (3, 32, 32), is_public=False,
                         source=source)


def load_cifar10(
    data_dir: str | os.PathLike[str] | None = None, seed: int = 0, *, download: bool = False,
    features: str = "none",
) -> DatasetBundle:
    """CIFAR-10: 50,000 / 10,000 colour 32x32 images, 10 classes, official split (``seed`` has
    no effect). Pixels scaled to [0, 1] and normalised per channel with the training-set mean
    (0.4914, 0.4822, 0.4465) and std (0.2470, 0.2435, 0.2616); inputs ``(N, 3, 32, 32)``.
    ``features``: a fixed per-example feature map (:mod:`dpclip.data.features`), ``"none"`` by
    default (``"scattering"``: 243 x 8 x 8 coefficients)."""
    del seed
    features = parse_features(features)
    return apply_features(_load(_CIFAR10, data_dir, download), features)


def load_cifar100(
    data_dir: str | os.PathLike[str] | None = None, seed: int = 0, *, download: bool = False,
    features: str = "none",
) -> DatasetBundle:
    """CIFAR-100: 50,000 / 10,000 colour 32x32 images, the 100 fine labels, official split.
    Normalised per channel with mean (0.5071, 0.4865, 0.4409) and std (0.2673, 0.2564, 0.2762).
    Lin et al.'s public proxy for CIFAR-10 (``PUBLIC_PROXIES``). ``features`` as
    :func:`load_cifar10`."""
    del seed
    features = parse_features(features)
    return apply_features(_load(_CIFAR100, data_dir, download), features)
