"""IDX loading (fashion-mnist, mnist): search order, decoding, normalisation, clear errors."""

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from dpclip.data import (
    FASHION_MNIST_MEAN,
    FASHION_MNIST_STD,
    MNIST_MEAN,
    MNIST_STD,
    DatasetNotFoundError,
    IdxFormatError,
    load_dataset,
    read_idx,
)
from dpclip.data import idx as idx_module

STEMS = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
SYSTEM_FMNIST = Path("/usr/share/datasets/fashion-mnist")


def write_idx(path: Path, array: np.ndarray, gz: bool) -> Path:
    """Independent IDX writer (the oracle): magic 00 00 <code> <ndim>, big-endian dims, data."""
    codes = {np.dtype(np.uint8): 0x08, np.dtype(">i4"): 0x0C}
    header = bytes([0, 0, codes[array.dtype], array.ndim]) + struct.pack(
        f">{array.ndim}I", *array.shape
    )
    payload = header + array.tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(payload))
    else:
        path.write_bytes(payload)
    return path


def make_idx_dir(directory: Path, gz: bool, n_train: int = 5, n_test: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {
        "train_images": rng.integers(0, 256, size=(n_train, 28, 28), dtype=np.uint8),
        "train_labels": rng.integers(0, 10, size=n_train, dtype=np.uint8),
        "test_images": rng.integers(0, 256, size=(n_test, 28, 28), dtype=np.uint8),
        "test_labels": rng.integers(0, 10, size=n_test, dtype=np.uint8),
    }
    arrays["train_images"][0, 0, 0] = 0
    arrays["train_images"][0, 0, 1] = 255
    for role, array in arrays.items():
        write_idx(directory / STEMS[role], array, gz)
    return arrays


@pytest.fixture
def isolated(monkeypatch):
    """No $DPCLIP_DATA and no system data roots: only what a test sets up is found."""
    monkeypatch.delenv("DPCLIP_DATA", raising=False)
    monkeypatch.setattr(idx_module, "SYSTEM_DATA_ROOTS", ())


def expected_inputs(images: np.ndarray, mean: float, std: float) -> torch.Tensor:
    x = torch.from_numpy(images.astype(np.float64) / 255.0)
    return ((x - mean) / std).to(torch.float32).unsqueeze(1)


@pytest.mark.parametrize("gz", [False, True])
def test_load_via_data_dir(tmp_path, isolated, gz):
    arrays = make_idx_dir(tmp_path / "d", gz)
    bundle = load_dataset("mnist", data_dir=tmp_path / "d")
    assert bundle.name == "mnist"
    assert bundle.source == str(tmp_path / "d")
    assert bundle.input_shape == (1, 28, 28) and bundle.num_classes == 10
    assert not bundle.is_public
    assert bundle.train.inputs.shape == (5, 1, 28, 28) and bundle.test.inputs.shape == (
        3,
        1,
        28,
        28,
    )
    assert bundle.train.inputs.dtype == torch.float32 and bundle.train.targets.dtype == torch.int64
    torch.testing.assert_close(
        bundle.train.inputs, expected_inputs(arrays["train_images"], MNIST_MEAN, MNIST_STD)
    )
    torch.testing.assert_close(
        bundle.test.inputs, expected_inputs(arrays["test_images"], MNIST_MEAN, MNIST_STD)
    )
    assert bundle.train.targets.tolist() == arrays["train_labels"].tolist()
    assert bundle.test.targets.tolist() == arrays["test_labels"].tolist()
    # pixel 0 and 255 map to the normalised ends of [0, 1]
    assert bundle.train.inputs[0, 0, 0, 0].item() == pytest.approx(
        -MNIST_MEAN / MNIST_STD, abs=1e-6
    )
    assert bundle.train.inputs[0, 0, 0, 1].item() == pytest.approx(
        (1 - MNIST_MEAN) / MNIST_STD, abs=1e-6
    )


def test_fashion_mnist_uses_its_own_constants(tmp_path, isolated):
    arrays = make_idx_dir(tmp_path, gz=True)
    bundle = load_dataset("fashion-mnist", data_dir=tmp_path)
    torch.testing.assert_close(
        bundle.train.inputs,
        expected_inputs(arrays["train_images"], FASHION_MNIST_MEAN, FASHION_MNIST_STD),
    )
    assert (FASHION_MNIST_MEAN, FASHION_MNIST_STD) == (0.2860, 0.3530)
    assert (MNIST_MEAN, MNIST_STD) == (0.1307, 0.3081)


def test_load_via_env_named_subdir(tmp_path, isolated, monkeypatch):
    arrays = make_idx_dir(tmp_path / "fashion-mnist", gz=True)
    monkeypatch.setenv("DPCLIP_DATA", str(tmp_path))
    bundle = load_dataset("fashion-mnist")
    assert bundle.source == str(tmp_path / "fashion-mnist")
    assert bundle.train.targets.tolist() == arrays["train_labels"].tolist()


def test_load_via_env_root_itself(tmp_path, isolated, monkeypatch):
    arrays = make_idx_dir(tmp_path, gz=False)
    monkeypatch.setenv("DPCLIP_DATA", str(tmp_path))
    bundle = load_dataset("mnist")
    assert bundle.source == str(tmp_path)
    assert bundle.test.targets.tolist() == arrays["test_labels"].tolist()


def test_data_dir_wins_over_env_and_named_subdir_of_data_dir(tmp_path, isolated, monkeypatch):
    make_idx_dir(tmp_path / "env", gz=False, n_train=4, seed=1)
    make_idx_dir(tmp_path / "arg" / "mnist", gz=False, n_train=6, seed=2)
    monkeypatch.setenv("DPCLIP_DATA", str(tmp_path / "env"))
    bundle = load_dataset("mnist", data_dir=tmp_path / "arg")
    assert bundle.source == str(tmp_path / "arg" / "mnist")
    assert len(bundle.train) == 6
    # without data_dir the environment is used
    assert len(load_dataset("mnist").train) == 4


def test_system_root_is_searched_last(tmp_path, isolated, monkeypatch):
    make_idx_dir(tmp_path / "sys" / "mnist", gz=True, n_train=7)
    monkeypatch.setattr(idx_module, "SYSTEM_DATA_ROOTS", (tmp_path / "sys",))
    assert len(load_dataset("mnist").train) == 7
    make_idx_dir(tmp_path / "env", gz=True, n_train=2)
    monkeypatch.setenv("DPCLIP_DATA", str(tmp_path / "env"))
    assert len(load_dataset("mnist").train) == 2


def test_returned_tensors_do_not_alias_the_cache(tmp_path, isolated):
    make_idx_dir(tmp_path, gz=False)
    first = load_dataset("mnist", data_dir=tmp_path)
    reference = first.train.inputs.clone()
    first.train.inputs.fill_(123.0)
    second = load_dataset("mnist", data_dir=tmp_path)
    torch.testing.assert_close(second.train.inputs, reference)


def test_read_idx_other_dtypes_and_gzip_detection(tmp_path):
    array = (np.arange(24).reshape(2, 3, 4) - 5).astype(">i4")
    path = write_idx(tmp_path / "x.idx", array, gz=True)
    plain_named = tmp_path / "gz-without-suffix"
    plain_named.write_bytes(path.read_bytes())  # gzip detected by content, not by name
    for p in (path, plain_named):
        out = read_idx(p)
        assert out.shape == (2, 3, 4)
        assert out.tolist() == array.tolist()


def test_corrupted_magic_is_a_clear_error(tmp_path, isolated):
    make_idx_dir(tmp_path, gz=False)
    bad = tmp_path / STEMS["train_images"]
    raw = bytearray(bad.read_bytes())
    raw[0:4] = b"\x12\x34\x08\x03"
    bad.write_bytes(bytes(raw))
    with pytest.raises(IdxFormatError, match="magic number") as info:
        load_dataset("mnist", data_dir=tmp_path)
    assert str(bad) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_truncated_payload_is_a_clear_error(tmp_path):
    path = write_idx(tmp_path / "x", np.zeros((4, 28, 28), dtype=np.uint8), gz=False)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(IdxFormatError, match="truncated or corrupted"):
        read_idx(path)


def test_corrupted_gzip_is_a_clear_error(tmp_path):
    path = write_idx(tmp_path / "x", np.zeros((4, 28, 28), dtype=np.uint8), gz=True)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(IdxFormatError, match="gzip"):
        read_idx(path)


def test_wrong_image_size_and_mismatched_counts(tmp_path, isolated):
    make_idx_dir(tmp_path, gz=False)
    write_idx(tmp_path / STEMS["test_images"], np.zeros((3, 8, 8), dtype=np.uint8), gz=False)
    with pytest.raises(IdxFormatError, match=r"\(N, 28, 28\)"):
        load_dataset("mnist", data_dir=tmp_path)
    make_idx_dir(tmp_path, gz=False)
    write_idx(tmp_path / STEMS["test_labels"], np.zeros(2, dtype=np.uint8), gz=False)
    with pytest.raises(IdxFormatError, match="do not belong together"):
        load_dataset("mnist", data_dir=tmp_path)


def test_missing_fashion_mnist_message(tmp_path, isolated, monkeypatch):
    monkeypatch.setenv("DPCLIP_DATA", str(tmp_path / "env"))
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset("fashion-mnist", data_dir=tmp_path / "nowhere")
    assert isinstance(info.value, FileNotFoundError)
    message = str(info.value)
    for stem in STEMS.values():
        assert stem in message
    for searched in (tmp_path / "nowhere", tmp_path / "nowhere" / "fashion-mnist"):
        assert str(searched) in message
    # an explicit data_dir is the only place searched: no fallback to $DPCLIP_DATA (issue 15)
    assert str(tmp_path / "env") not in message
    assert "given explicitly, so $DPCLIP_DATA and the system directories were not searched" \
        in message
    assert "apt-get install dataset-fashion-mnist" in message
    assert "zalandoresearch/fashion-mnist" in message
    assert "--data-dir" in message
    # without data_dir, the environment's directories are searched and listed
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset("fashion-mnist")
    for searched in (tmp_path / "env" / "fashion-mnist", tmp_path / "env"):
        assert str(searched) in str(info.value)


def test_missing_mnist_message_and_partial_directory(tmp_path, isolated):
    make_idx_dir(tmp_path, gz=True)
    (tmp_path / (STEMS["test_labels"] + ".gz")).unlink()
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset("mnist", data_dir=tmp_path)
    message = str(info.value)
    assert f"missing: {STEMS['test_labels']}[.gz]" in message
    assert "yann.lecun.com/exdb/mnist" in message
    assert "--data-dir" in message


def test_download_is_refused_offline(tmp_path, isolated):
    make_idx_dir(tmp_path, gz=False)
    with pytest.raises(ValueError, match="offline"):
        load_dataset("fashion-mnist", data_dir=tmp_path, download=True)
    assert len(load_dataset("fashion-mnist", data_dir=tmp_path, download=False).train) == 5


@pytest.mark.skipif(not SYSTEM_FMNIST.is_dir(), reason="system Fashion-MNIST not installed")
def test_system_fashion_mnist(monkeypatch):
    monkeypatch.delenv("DPCLIP_DATA", raising=False)
    bundle = load_dataset("fashion-mnist")
    assert bundle.source == str(SYSTEM_FMNIST)
    assert bundle.train.inputs.shape == (60000, 1, 28, 28)
    assert bundle.test.inputs.shape == (10000, 1, 28, 28)
    assert torch.bincount(bundle.train.targets).tolist() == [6000] * 10
    assert torch.bincount(bundle.test.targets).tolist() == [1000] * 10
    # the documented constants are the training-set statistics
    assert abs(bundle.train.inputs.mean().item()) < 1e-3
    assert abs(bundle.train.inputs.std().item() - 1.0) < 1e-3
