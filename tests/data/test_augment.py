"""Per-example augmentation after private sampling (dpclip.data.augment).

Oracles: a naive per-example loop (``F.pad`` then slicing, ``torch.flip``) in float64 for the
vectorised crop and flip; the run's own sampling generator replayed by hand (reproducible mode) for
where the randomness comes from; a naive float64 loop of per-example clipped gradients over the
AUGMENTED examples for what the noise-free release sums.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpclip.data.augment import Augmentation, parse_augment
from dpclip.training.private import make_private
from dpclip.randomness import seeded_generator
from dpclip.training.sampling import make_sampler
from dpclip.training.trainer import TrainConfig, train


def naive(x: torch.Tensor, params: torch.Tensor, aug: Augmentation) -> torch.Tensor:
    """One example at a time: torchvision's RandomCrop(padding=P) then RandomHorizontalFlip."""
    out = []
    h, w = x.shape[-2:]
    for xi, (dy, dx, fl) in zip(x, params.tolist()):
        if aug.crop_pad:
            p = aug.crop_pad
            mode = "constant" if aug.pad_mode == "zeros" else "reflect"
            xi = F.pad(xi.unsqueeze(0), (p, p, p, p), mode=mode)[0][:, dy:dy + h, dx:dx + w]
        if aug.flip and fl:
            xi = torch.flip(xi, dims=(-1,))
        out.append(xi)
    return torch.stack(out)


# ----------------------------------------------------------------------------------- grammar
@pytest.mark.parametrize("text, want", [
    ("none", None), ("", None), (None, None), (" None ", None),
    ("flip", Augmentation(flip=True)),
    ("crop:4", Augmentation(crop_pad=4)),
    ("flip, crop:4", Augmentation(crop_pad=4, flip=True)),
    ("crop:2:reflect,flip", Augmentation(crop_pad=2, pad_mode="reflect", flip=True)),
    ("crop:3:zeros", Augmentation(crop_pad=3)),
])
def test_parse_and_canonical_text(text, want):
    got = parse_augment(text)
    assert got == want
    if got is not None:
        assert parse_augment(got.spec) == got
        assert got.spec == ",".join(
            (["crop:%d" % got.crop_pad + (":reflect" if got.pad_mode == "reflect" else "")]
             if got.crop_pad else []) + (["flip"] if got.flip else []))


@pytest.mark.parametrize("text, match", [
    ("rotate", "unknown augmentation 'rotate'"),
    ("crop", "must be 'crop:P'"),
    ("crop:0", "must be 'crop:P'"),
    ("crop:-1", "must be 'crop:P'"),
    ("crop:x", "must be 'crop:P'"),
    ("crop:4:wrap", "padding mode 'wrap'"),
    ("flip:1", "'flip' takes no argument"),
    ("flip,flip", "'flip' appears twice"),
    (4, "must be a string"),
])
def test_bad_augment_names_the_argument_and_the_grammar(text, match):
    with pytest.raises(ValueError, match=match) as err:
        parse_augment(text, where="--augment")
    assert "--augment" in str(err.value)


# ------------------------------------------------------------------------ the transformation
@pytest.mark.parametrize("spec", ["crop:2", "crop:3:reflect", "flip", "crop:4,flip",
                                  "crop:1:reflect,flip"])
def test_vectorised_augmentation_equals_the_per_example_loop(spec):
    aug = parse_augment(spec)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 3, 6, 5, dtype=torch.float64, generator=g)
    params = aug.draw(37, g)
    got = aug.apply(x, params)
    assert got.dtype == torch.float64 and got.shape == x.shape
    assert torch.equal(got, naive(x, params, aug))
    # leading unit dimensions (batch clipping: (1, B, ...); mini-sets: (U, S, ...)) keep the order
    assert torch.equal(aug.apply(x[:36].reshape(4, 9, 3, 6, 5), params[:36]),
                       naive(x[:36], params[:36], aug).reshape(4, 9, 3, 6, 5))
    assert aug.apply(x[:0], params[:0]).shape == (0, 3, 6, 5)


def test_each_output_depends_only_on_its_own_example():
    """The per-example map behind the unchanged sensitivity: changing one example changes its
    augmented image only."""
    aug = parse_augment("crop:2,flip")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 1, 5, 5, dtype=torch.float64, generator=g)
    params = aug.draw(8, g)
    y = x.clone()
    y[5] = 100.0
    a, b = aug.apply(x, params), aug.apply(y, params)
    changed = (a != b).flatten(1).any(1)
    assert changed.tolist() == [False] * 5 + [True] + [False] * 2


def test_parameters_are_uniform_offsets_and_fair_flips():
    aug = parse_augment("crop:4,flip")
    n = 45_000
    params = aug.draw(n, torch.Generator().manual_seed(11))
    assert params.dtype == torch.int64 and params.shape == (n, 3)
    for col in (0, 1):  # offsets uniform on {0..8}: each count within 5 sd of n/9
        counts = torch.bincount(params[:, col], minlength=9)
        assert counts.numel() == 9
        sd = (n * (1 / 9) * (8 / 9)) ** 0.5
        assert ((counts - n / 9).abs() < 5 * sd).all(), counts
    assert set(params[:, 2].unique().tolist()) == {0, 1}
    assert abs(params[:, 2].float().mean().item() - 0.5) < 5 * (0.25 / n) ** 0.5
    # the row and column offsets are drawn independently (not one shared shift)
    assert (params[:, 0] != params[:, 1]).float().mean() > 0.8
    # only the drawn operations consume randomness: a flip-only draw has zero offsets
    assert (parse_augment("flip").draw(100, torch.Generator().manual_seed(0))[:, :2] == 0).all()


def test_non_images_and_oversized_reflect_padding_are_refused():
    with pytest.raises(ValueError, match=r"needs image inputs of shape \(C, H, W\)"):
        parse_augment("flip").check_example_shape((20,))
    with pytest.raises(ValueError, match="needs images larger than the padding"):
        parse_augment("crop:4:reflect").check_example_shape((1, 4, 4))
    parse_augment("crop:4").check_example_shape((1, 4, 4))  # zero padding: any size


# ------------------------------------------------------------------------------ make_private
def _images(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 4, 4, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    return x, y


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 3)).double()


def _dp(aug="crop:1,flip", **kw):
    x, y = _images()
    m = _model()
    opts = dict(strategy="fixed", strategy_params={"clip_norm": 0.5}, noise_multiplier=1.0,
                steps=6, batch_size=8.0, delta=1e-5, reproducible_noise=True, seed=5,
                verbose=False, augment=aug)
    opts.update(kw)
    return make_private(m, torch.optim.SGD(m.parameters(), lr=0.1), (x, y), **opts), x, y, m


def test_augmentation_is_drawn_from_the_secret_sampling_generator():
    dp, x, _, _ = _dp()
    aug = parse_augment("crop:1,flip")
    g = seeded_generator(2 * 5 + 1)  # the reproducible sampling generator of seed 5
    sampler = make_sampler("poisson", 40, 8.0)
    for _ in range(4):
        idx = sampler.sample(g)
        want = aug.apply(x[idx], aug.draw(int(idx.numel()), g))
        xb, yb = dp.sample()
        assert torch.equal(xb, want)
        dp.step(xb, yb)
    assert dp.describe()["augment"] == "crop:1,flip"
    # secure mode: the same seed does not replay the batches or their augmentation
    sec, _, _, _ = _dp(reproducible_noise=False)
    g = seeded_generator(2 * 5 + 1)
    idx = make_sampler("poisson", 40, 8.0).sample(g)
    got = sec.sample()[0]
    assert got.shape != x[idx].shape or not torch.equal(got, aug.apply(x[idx], aug.draw(
        int(idx.numel()), g)))


def test_noise_free_release_sums_the_clipped_gradients_of_the_augmented_examples():
    dp, x, y, m = _dp(noise_multiplier=0.0, steps=1)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    xb, yb = dp.sample()
    assert xb.shape[0] >= 2
    dp.backward(xb, yb)
    clip = 0.5
    ref = {n: torch.zeros_like(p) for n, p in before.items()}
    released = {n: p.grad.detach().clone() for n, p in m.named_parameters()}
    for xi, yi in zip(xb, yb):  # the augmented examples, one at a time
        m.zero_grad(set_to_none=True)
        F.cross_entropy(m(xi.unsqueeze(0)), yi.unsqueeze(0)).backward()
        gs = {n: p.grad.detach().clone() for n, p in m.named_parameters()}
        norm = torch.sqrt(sum((g ** 2).sum() for g in gs.values()))
        scale = min(1.0, clip / (norm.item() + 1e-6))  # the Opacus guard of fixed clipping
        for n in gs:
            ref[n] += gs[n] * scale
    for n in ref:
        torch.testing.assert_close(released[n], ref[n] / 8.0, rtol=1e-9, atol=1e-12)


def test_resume_replays_the_augmentation():
    full, _, _, m_full = _dp()
    while not full.exhausted:
        full.step(*full.sample())
    part, _, _, _ = _dp()
    for _ in range(3):
        part.step(*part.sample())
    state = part.state_dict()
    resumed, _, _, m_res = _dp()
    resumed.load_state_dict(state)
    while not resumed.exhausted:
        resumed.step(*resumed.sample())
    assert resumed.ledger == full.ledger
    for (n, a), (_, b) in zip(m_full.state_dict().items(), m_res.state_dict().items()):
        assert torch.equal(a, b), n


def test_batch_clipping_units_are_augmented_per_example():
    dp, x, _, _ = _dp(strategy_params={"clip_norm": 0.5, "unit": "bc"},
                      sampling="fixed-size", accountant="rdp")
    xb, yb = dp.sample()
    assert xb.shape[:1] == (1,) and xb.shape[2:] == (1, 4, 4)
    dp.step(xb, yb)


def test_make_private_refuses_augmenting_non_images():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(30, 5, generator=g), torch.randint(0, 2, (30,), generator=g)
    m = nn.Linear(5, 2)
    with pytest.raises(ValueError, match=r"augment=: augmentation 'flip' needs image inputs"):
        make_private(m, None, (x, y), noise_multiplier=1.0, steps=2, batch_size=5.0,
                     delta=1e-5, augment="flip", verbose=False)
    imgs = x.view(30, 1, 5, 1)
    with pytest.raises(ValueError, match="augment=: augmentation 'flip' needs the inputs to be "
                                         "one tensor of images, got tuple"):
        make_private(m, None, ((imgs, imgs), y), noise_multiplier=1.0, steps=2, batch_size=5.0,
                     delta=1e-5, augment="flip", verbose=False)
    with pytest.raises(ValueError, match="unknown augmentation"):
        make_private(m, None, (x.view(30, 1, 5, 1), y), noise_multiplier=1.0, steps=2,
                     batch_size=5.0, delta=1e-5, augment="mixup", verbose=False)


# ----------------------------------------------------------------------------------- trainer
BASE = dict(dataset="synthetic", model="mlp", strategy="fixed", strategy_params={"clip_norm": 1.0},
            delta=1e-5, epochs=2, batch_size=32, lr=0.5, optimizer="momentum", seed=0,
            noise_multiplier=0.8, dataset_options={"image_shape": [1, 6, 6], "n_train": 256})


def test_trainconfig_canonicalises_augment_and_keeps_old_fingerprints():
    a = TrainConfig(**BASE)
    assert a.augment == "none"
    # a config without augmentation hashes as it did before the field existed
    d = a.to_dict()
    d["max_physical_batch"] = 256  # (the default of older configs: hashed at it)
    for k in ("augment", "data_dir", "device", "eval_every", "lr_schedule", "lr_gamma",
              "lr_step_epochs", "lr_min", "lr_warmup_epochs", "augment_multiplicity",
              "averaging", "unit", "miniset_size", "bn_stats", "public_fraction"):
        d.pop(k)
    old = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
    assert a.fingerprint() == old
    b = TrainConfig(**BASE, augment="flip, crop:2")
    assert b.augment == "crop:2,flip"
    assert b.fingerprint() == TrainConfig(**BASE, augment="crop:2,flip").fingerprint() \
        != a.fingerprint()
    with pytest.raises(ValueError, match=r"augment \(--augment\): unknown augmentation 'cutout'"):
        TrainConfig(**BASE, augment="cutout")


def test_train_with_augmentation_records_it_and_resumes_identically(tmp_path):
    cfg = TrainConfig(**BASE, augment="crop:2,flip", reproducible_noise=True)
    full = train(cfg, progress=False)
    assert full.summary["augment"] == "crop:2,flip"
    train(cfg, checkpoint_dir=tmp_path, progress=False, stop_after_steps=5)
    resumed = train(cfg, checkpoint_dir=tmp_path, progress=False)
    assert resumed.ledger == full.ledger
    for (n, a), (_, b) in zip(full.model.state_dict().items(),
                              resumed.model.state_dict().items()):
        assert torch.equal(a, b), n
    plain = train(TrainConfig(**BASE, reproducible_noise=True), progress=False)
    assert plain.summary["augment"] == "none"
    assert plain.ledger == full.ledger  # augmentation releases nothing: the same events
    assert any(not torch.equal(a, b) for a, b in zip(plain.model.state_dict().values(),
                                                     full.model.state_dict().values()))


def test_train_refuses_augmenting_tabular_data():
    cfg = TrainConfig(**dict(BASE, dataset_options={"num_features": 12}), augment="flip")
    with pytest.raises(ValueError, match=r"--augment: augmentation 'flip' needs image inputs"):
        train(cfg, progress=False)
