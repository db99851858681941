"""The dataset option ``features`` (dpclip.data.features): a fixed per-example scattering
transform (Tramer & Boneh 2021), its wiring into the image datasets, the scatter-linear model and
the refusal of augmentation on coefficients."""

from __future__ import annotations

import pytest
import torch

from dpclip.data import load_dataset
from dpclip.data.features import (Scattering, apply_features, check_features_augment,
                                  parse_features)
from dpclip.data.registry import DATASETS
from dpclip.models import build_model

pytest.importorskip("kymatio")

IMAGE_DATASETS = ("fashion-mnist", "mnist", "mnist-5k", "cifar10", "cifar100")


def _images(n: int = 6, c: int = 1, size: int = 28, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, c, size, size, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ grammar and shapes
@pytest.mark.parametrize("text, expected", [
    ("none", None), ("None", None), (None, None), ("scattering", Scattering(2, 8)),
    ("scattering:3", Scattering(3, 8)), ("scattering:1:4", Scattering(1, 4)),
])
def test_parse_features(text, expected):
    assert parse_features(text) == expected
    if expected is not None:
        assert parse_features(expected.spec) == expected


@pytest.mark.parametrize("text", ["wavelets", "scattering:x", "scattering:0", "scattering:2:0",
                                  "scattering:1:2:3", 3])
def test_parse_features_refuses_with_the_valid_forms(text):
    with pytest.raises(ValueError, match="valid: 'none', 'scattering'"):
        parse_features(text)


def test_output_shapes_follow_the_scattering_formula():
    assert Scattering().channels_per_input_channel == 81  # 1 + 8*2 + 64*2*1/2
    assert Scattering().output_shape((1, 28, 28)) == (81, 7, 7)
    assert Scattering().output_shape((3, 32, 32)) == (243, 8, 8)
    assert Scattering(3, 6).output_shape((1, 32, 32)) == (1 + 18 + 36 * 3, 4, 4)
    with pytest.raises(ValueError, match=r"image inputs \(C, H, W\)"):
        Scattering().output_shape((28, 28))
    with pytest.raises(ValueError, match="multiple of 2\\^J = 4"):
        Scattering().output_shape((1, 30, 30))


# ------------------------------------------------------------------ the map is per example
def test_each_output_depends_on_its_own_image_only():
    x = _images()
    y = Scattering().transform(x)
    x2 = x.clone()
    x2[2] = _images(1, seed=1)[0]
    y2 = Scattering().transform(x2)
    changed = (y2 - y).flatten(1).abs().amax(1)
    assert changed[2] > 0
    assert torch.equal(torch.cat([y2[:2], y2[3:]]), torch.cat([y[:2], y[3:]]))


def test_an_image_alone_equals_the_image_in_a_batch():
    x = _images(5)
    batched = Scattering().transform(x)
    for i in range(5):
        torch.testing.assert_close(Scattering().transform(x[i:i + 1])[0], batched[i],
                                   rtol=1e-5, atol=1e-6)


def test_positively_homogeneous():
    """Orders 0-2 are moduli of linear maps: S(a x) = a S(x) for a > 0 (a squared modulus or a
    bias would fail this)."""
    x = _images(3)
    torch.testing.assert_close(Scattering().transform(3.0 * x), 3.0 * Scattering().transform(x),
                               rtol=1e-4, atol=1e-5)


def test_constant_image_oracle():
    """The low-pass filter has unit DC gain and the wavelets zero mean: a constant image c gives
    c on the order-0 channel and 0 on every other channel."""
    x = torch.full((2, 1, 28, 28), 0.7)
    y = Scattering().transform(x)
    torch.testing.assert_close(y[:, 0], torch.full((2, 7, 7), 0.7), rtol=0, atol=1e-4)
    assert y[:, 1:].abs().max() < 1e-4


# ------------------------------------------------------------------ datasets
@pytest.mark.parametrize("name", IMAGE_DATASETS)
def test_image_datasets_declare_the_option(name):
    assert DATASETS[name].options()["features"] == "none"


def test_dataset_option_transforms_both_splits_and_is_recorded():
    plain = load_dataset("mnist-5k")
    feats = load_dataset("mnist-5k", features="scattering")
    assert feats.input_shape == (81, 7, 7)
    assert feats.train.inputs.shape == (len(plain.train), 81, 7, 7)
    assert feats.test.inputs.shape == (len(plain.test), 81, 7, 7)
    assert torch.equal(feats.train.targets, plain.train.targets)
    assert feats.is_public == plain.is_public
    assert "scattering transform J=2, L=8" in feats.preprocessing["features"]
    torch.testing.assert_close(feats.test.inputs[:3],
                               Scattering().transform(plain.test.inputs[:3]), rtol=1e-5, atol=1e-6)
    # a second load (the in-process memo) gives equal, independent tensors
    again = load_dataset("mnist-5k", features="scattering")
    assert torch.equal(again.train.inputs, feats.train.inputs)
    again.train.inputs.zero_()
    assert feats.train.inputs.abs().sum() > 0


def test_bad_option_is_refused_before_loading():
    with pytest.raises(ValueError, match="unknown feature map 'wavelets'"):
        load_dataset("mnist-5k", features="wavelets")


def test_apply_features_none_is_the_bundle_itself():
    b = load_dataset("digits")
    assert apply_features(b, "none") is b
    with pytest.raises(ValueError, match="multiple of 2\\^J"):
        apply_features(b, "scattering:4")  # 8x8 images, 2^4 = 16


# ------------------------------------------------------------------ the model
def test_scatter_linear_is_groupnorm_then_linear():
    m = build_model("scatter-linear", (81, 7, 7), 10)
    assert [type(c).__name__ for c in m] == ["GroupNorm", "Flatten", "Linear"]
    assert m.norm.num_groups == 27 and m.fc1.in_features == 81 * 49
    assert build_model("scatter-linear", (81, 7, 7), 10, groups=81).norm.num_groups == 81
    with pytest.raises(ValueError, match="groups must be a positive integer dividing the 81"):
        build_model("scatter-linear", (81, 7, 7), 10, groups=10)
    with pytest.raises(ValueError, match="features='scattering'"):
        build_model("scatter-linear", (30,), 2)


# ------------------------------------------------------------------ augmentation is refused
def test_augmenting_a_coefficient_dataset_is_refused():
    check_features_augment({"features": "x"}, None)
    check_features_augment({"features": "x"}, "none")
    check_features_augment({}, "flip")
    with pytest.raises(ValueError, match="augment='crop:2,flip' crops and flips IMAGES"):
        check_features_augment({"features": "scattering transform"}, "crop:2,flip")


def test_a_private_run_on_coefficients(tmp_path):
    """End to end: mnist-5k coefficients, scatter-linear on the ghost engine (GroupNorm and
    Linear have rules), the map in the summary; and a run asking for augmentation refused."""
    from dpclip.training.config import TrainConfig
    from dpclip.training.trainer import train

    base = dict(dataset="mnist-5k", dataset_options={"features": "scattering"},
                model="scatter-linear", strategy="fixed", strategy_params={"clip_norm": 0.1},
                epsilon=3.0, delta=1e-5, epochs=1, batch_size=512, lr=4.0, optimizer="momentum")
    res = train(TrainConfig(**base), progress=False)
    s = res.summary
    assert s["engine"] == "ghost" and not s["engine_fallback"]
    assert "scattering" in s["preprocessing"]["features"]
    assert s["epsilon"] == pytest.approx(3.0, rel=1e-3)
    assert s["test_accuracy"] > 0.5  # 10 classes: far above chance after one private epoch
    # a bundle that already holds coefficients is never augmented
    coefficients = load_dataset("mnist-5k", features="scattering")
    with pytest.raises(ValueError, match="crops and flips IMAGES"):
        train(TrainConfig(**base, augment="flip"), data=coefficients, progress=False)


def test_augmented_run_maps_each_drawn_batch_after_augmentation():
    """With an augmentation, `dpclip train` keeps the images and maps each drawn batch (its K
    copies each) after augmenting it; the summary says so."""
    from dpclip.training.config import TrainConfig
    from dpclip.training.trainer import train

    cfg = TrainConfig(dataset="mnist-5k", dataset_options={"features": "scattering"},
                      model="scatter-linear", strategy="fixed", strategy_params={"clip_norm": 0.1},
                      epsilon=3.0, delta=1e-5, epochs=1, batch_size=1000, lr=4.0,
                      optimizer="momentum", augment="flip", augment_multiplicity=2)
    res = train(cfg, progress=False)
    s = res.summary
    assert "after its augmentation" in s["preprocessing"]["features"]
    assert s["augment_multiplicity"] == 2 and s["engine"] == "ghost"
    assert s["epsilon"] == pytest.approx(3.0, rel=1e-3)


def test_sampled_rows_are_coefficients_of_augmented_images():
    """Oracle: with a flip-only augmentation every drawn row equals the transform of one training
    image or of its mirror image (a map applied BEFORE the augmentation would flip coefficient
    maps instead, which matches neither)."""
    from dpclip.training.private import PrivateTraining

    images = load_dataset("mnist-5k").train.inputs[:48]
    y = torch.arange(48) % 10
    model = build_model("scatter-linear", (81, 7, 7), 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp = PrivateTraining(model, opt, (images, y), noise_multiplier=1.0, epochs=1,
                         batch_size=24, strategy="fixed", strategy_params={"clip_norm": 1.0},
                         delta=1e-5, augment="flip", features=Scattering(), verbose=False)
    x, _ = dp.sample()
    assert x.shape[1:] == (81, 7, 7) and len(x) > 0
    candidates = torch.cat([Scattering().transform(images),
                            Scattering().transform(images.flip(-1))]).flatten(1)
    exact = "donot_use_mm_for_euclid_dist"  # (the matmul form loses ~1e-2 to cancellation)
    gaps = torch.cdist(x.flatten(1), candidates, compute_mode=exact).amin(1)
    assert gaps.max() < 1e-3
    wrong_order = Scattering().transform(images).flip(-1).flatten(1)  # flipped coefficient maps
    assert torch.cdist(wrong_order, candidates[48:], compute_mode=exact).amin(1).min() > 1e-2
    with pytest.raises(TypeError, match="features= must be .scattering. or a dpclip.data.features.Scattering"):
        PrivateTraining(model, opt, (images, y), noise_multiplier=1.0, epochs=1, batch_size=24,
                        strategy="fixed", strategy_params={"clip_norm": 1.0}, delta=1e-5,
                        features=lambda t: t, verbose=False)
