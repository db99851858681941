"""CIFAR-10 / CIFAR-100 loaders on files written in the official python-version layout (pickled
dicts of uint8 rows and label lists), extracted and as the original .tar.gz archive."""

from __future__ import annotations

import io
import pickle
import tarfile

import numpy as np
import pytest
import torch

from dpclip.data import DATASETS, DatasetNotFoundError, is_public_proxy, load_dataset
from dpclip.data.cifar import CifarFormatError, load_cifar10


def _batch(n: int, classes: int, key: bytes, seed: int) -> tuple[dict, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
    labels = rng.integers(0, classes, size=n)
    return {b"batch_label": b"x", key: [int(v) for v in labels], b"data": data}, data, labels


def _write_cifar10(folder, n=4):
    folder.mkdir(parents=True, exist_ok=True)
    parts = []
    for i, f in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
        d, data, labels = _batch(n + i, 10, b"labels", i)
        (folder / f).write_bytes(pickle.dumps(d, protocol=2))
        parts.append((data, labels))
    return parts


def test_cifar10_extracted_folder_values_and_layout(tmp_path):
    parts = _write_cifar10(tmp_path / "cifar-10-batches-py")
    bundle = load_dataset("cifar10", tmp_path)  # finds <dir>/cifar-10-batches-py
    assert bundle.input_shape == (3, 32, 32) and bundle.num_classes == 10
    assert len(bundle.train) == sum(len(p[1]) for p in parts[:5]) and len(bundle.test) == 9
    # example 0 of the first batch: CHW rows (1024 R, then G, then B), per-channel normalised
    raw = torch.from_numpy(parts[0][0][0].astype(np.float64)).view(3, 32, 32) / 255.0
    mean = torch.tensor([0.4914, 0.4822, 0.4465], dtype=torch.float64).view(3, 1, 1)
    std = torch.tensor([0.2470, 0.2435, 0.2616], dtype=torch.float64).view(3, 1, 1)
    torch.testing.assert_close(bundle.train.inputs[0].double(), (raw - mean) / std,
                               rtol=0, atol=1e-5)
    assert bundle.train.targets.dtype == torch.int64
    assert bundle.train.targets[:4].tolist() == parts[0][1].tolist()
    assert bundle.test.targets.tolist() == parts[5][1].tolist()
    assert not bundle.is_public and not DATASETS["cifar10"].is_public


def test_cifar100_from_the_archive_fine_labels(tmp_path):
    buf = {}
    for f, n in (("train", 6), ("test", 3)):
        d, _, labels = _batch(n, 100, b"fine_labels", n)
        d[b"coarse_labels"] = [0] * n
        buf[f] = (pickle.dumps(d, protocol=2), labels)
    archive = tmp_path / "cifar-100-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for f, (data, _) in buf.items():
            info = tarfile.TarInfo(f"cifar-100-python/{f}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    bundle = load_dataset("cifar100", tmp_path)
    assert bundle.num_classes == 100 and len(bundle.train) == 6 and len(bundle.test) == 3
    assert bundle.train.targets.tolist() == buf["train"][1].tolist()
    assert bundle.source.endswith("cifar-100-python.tar.gz")
    # the declared pair: CIFAR-100 is public as the proxy of CIFAR-10 (Lin et al.)
    assert is_public_proxy("cifar100", "cifar10") and not is_public_proxy("cifar100", None)


def test_missing_files_name_what_to_fetch(tmp_path, monkeypatch):
    monkeypatch.delenv("DPCLIP_DATA", raising=False)
    with pytest.raises(DatasetNotFoundError) as info:
        load_cifar10(tmp_path)
    msg = str(info.value)
    assert str(tmp_path) in msg and "cifar-10-python.tar.gz" in msg and "data_batch_1" in msg
    assert "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz" in msg
    with pytest.raises(ValueError, match="never downloads"):
        load_cifar10(tmp_path, download=True)


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_untrusted_pickle_content_is_refused(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    _write_cifar10(folder)
    (folder / "data_batch_3").write_bytes(pickle.dumps({b"data": _Evil()}, protocol=2))
    with pytest.raises(CifarFormatError, match=r"refusing to load (__builtin__|builtins)\.print"):
        load_cifar10(tmp_path)


def test_wrong_layout_is_a_format_error(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    _write_cifar10(folder)
    d, _, _ = _batch(4, 10, b"labels", 0)
    d[b"labels"] = [11, 0, 0, 0]
    (folder / "test_batch").write_bytes(pickle.dumps(d, protocol=2))
    with pytest.raises(CifarFormatError, match=r"labels outside \[0, 10\)"):
        load_cifar10(tmp_path)
