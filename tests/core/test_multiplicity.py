"""Augmentation multiplicity K (dpclip.training.multiplicity): the release equals a float64 per-example
oracle (mean of the K augmented copies' gradients, clipped), one example moves the noise-free
release by at most C on every per-example engine, the draws come from the secret generator, the
ledger is that of K = 1, and every setting where it cannot hold is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpclip.data.augment import parse_augment
from dpclip.engine import ParamGroups, get_engine
from dpclip.training.multiplicity import KCopyModel, expand_copies, k_copy_loss
from dpclip.training.private import make_private
from dpclip.randomness import seeded_generator
from dpclip.training.sampling import make_sampler
from dpclip.training.trainer import TrainConfig, train

K = 3
CLIP = 0.5


def ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


def _images(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 5, 5, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    return x, y


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(18, 3)).double()


def _dp(k=K, aug="crop:1,flip", **kw):
    x, y = _images()
    m = _model()
    opts = dict(strategy="fixed", strategy_params={"clip_norm": CLIP}, noise_multiplier=1.0,
                steps=6, batch_size=8.0, delta=1e-5, reproducible_noise=True, seed=5,
                verbose=False, augment=aug, augment_multiplicity=k)
    opts.update(kw)
    return make_private(m, torch.optim.SGD(m.parameters(), lr=0.1), (x, y), **opts), x, y, m


def test_each_example_gets_k_independent_draws_from_the_secret_sampling_generator():
    dp, x, _, _ = _dp()
    aug = parse_augment("crop:1,flip")
    g = seeded_generator(2 * 5 + 1)  # the reproducible sampling generator of seed 5
    sampler = make_sampler("poisson", 40, 8.0)
    for _ in range(3):
        idx = sampler.sample(g)
        want = aug.apply(expand_copies(x[idx], K), aug.draw(int(idx.numel()) * K, g))
        xb, yb = dp.sample()
        assert xb.shape == (idx.numel(), K, 1, 5, 5)
        assert torch.equal(xb, want)
        # the K copies of one example differ (independent draws), so K > 1 is not K = 1
        assert any(not torch.equal(xb[i, 0], xb[i, 1]) for i in range(xb.shape[0]))
        dp.step(xb, yb)
    assert dp.describe()["augment_multiplicity"] == K


@pytest.mark.parametrize("engine", ["auto", "ghost", "vmap", "naive"])
def test_noise_free_release_is_the_clipped_mean_of_the_k_copies(engine):
    dp, x, y, m = _dp(noise_multiplier=0.0, steps=1, engine=engine)
    xb, yb = dp.sample()
    assert xb.shape[0] >= 2
    dp.backward(xb, yb)
    released = {n: p.grad.detach().clone() for n, p in m.named_parameters()}
    ref = {n: torch.zeros_like(p) for n, p in m.named_parameters()}
    for xi, yi in zip(xb, yb):  # float64 oracle: one example, its K copies one at a time
        mean = {n: torch.zeros_like(p) for n, p in m.named_parameters()}
        for c in range(K):
            m.zero_grad(set_to_none=True)
            F.cross_entropy(m(xi[c].unsqueeze(0)), yi.unsqueeze(0)).backward()
            for n, p in m.named_parameters():
                mean[n] += p.grad.detach() / K
        norm = torch.sqrt(sum((g ** 2).sum() for g in mean.values()))
        scale = min(1.0, CLIP / (norm.item() + 1e-6))  # the Opacus guard of fixed clipping
        for n in ref:
            ref[n] += mean[n] * scale
    for n in ref:
        torch.testing.assert_close(released[n], ref[n] / 8.0, rtol=1e-9, atol=1e-12)
    info = dp.engine_info
    # auto runs ghost since issue 36 (it ran vmap, recorded as a fallback, before)
    assert info["engine"] == {"auto": "ghost"}.get(engine, engine)
    assert info["fallback"] is None


def _release(engine, x, y, model, k):
    fixed = __import__("dpclip.clipping", fromlist=["make_strategy"]).make_strategy(
        "fixed", {"clip_norm": CLIP})
    state = fixed.init_state()
    res = engine.compute(KCopyModel(model, k), k_copy_loss(ce, k), x, y,
                         lambda n: fixed.weights(n, state), ParamGroups.flat(model))
    return torch.cat([res.grads[n].flatten() for n, _ in model.named_parameters()])


@pytest.mark.parametrize("engine_name", ["vmap", "naive", "ghost", "auto"])
def test_neighbour_removing_one_example_moves_the_release_by_at_most_c(engine_name):
    engine = get_engine(engine_name)
    model = _model()
    aug = parse_augment("crop:1,flip")
    x, y = _images(9, seed=2)
    x[4] *= 1e3  # a huge example: its copies' gradients are far above C
    xk = aug.apply(expand_copies(x, K), aug.draw(9 * K, torch.Generator().manual_seed(1)))
    full = _release(engine, xk, y, model, K)
    worst = 0.0
    for i in range(9):
        keep = [j for j in range(9) if j != i]
        worst = max(worst, (full - _release(engine, xk[keep], y[keep], model, K)).norm().item())
    assert 0.5 * CLIP < worst <= CLIP * (1 + 1e-9)
    # the attack this guards against: clipping the K copies one by one (the copies as separate
    # examples) lets one example move the release by up to K C, which the same check sees
    flat = xk.reshape(9 * K, 1, 5, 5)
    yk = y.repeat_interleave(K)
    per_copy = _release(engine, flat.unsqueeze(1), yk, model, 1)
    keep = [j for j in range(9 * K) if j // K != 4]
    moved = (per_copy - _release(engine, flat[keep].unsqueeze(1), yk[keep], model, 1)).norm()
    assert moved > 1.5 * CLIP


def test_ghost_reads_the_k_copy_rows():
    """Refused before issue 36 (the rows of one example were not (0, 1) separable); now the
    ghost rules read example i from its K rows: equal to vmap, also for a batch of one."""
    model = _model()
    aug = parse_augment("crop:1,flip")
    x, y = _images(6)
    xk = aug.apply(expand_copies(x, K), aug.draw(6 * K, torch.Generator().manual_seed(3)))
    for rows in (slice(None), slice(0, 1)):
        got = _release(get_engine("ghost"), xk[rows], y[rows], model, K)
        want = _release(get_engine("vmap"), xk[rows], y[rows], model, K)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    dp, _, _, _ = _dp(engine="ghost")
    dp.step(*dp.sample())
    assert dp.engine_info["engine"] == "ghost" and dp.engine_info["fallback"] is None


def test_ledger_is_that_of_k_equal_one():
    one, _, _, _ = _dp(k=1)
    three, _, _, _ = _dp(k=K)
    for dp in (one, three):
        while not dp.exhausted:
            dp.step(*dp.sample())
    assert one.ledger == three.ledger
    assert one.noise_multiplier == three.noise_multiplier


def test_resume_replays_the_k_copies():
    full, _, _, m_full = _dp()
    while not full.exhausted:
        full.step(*full.sample())
    part, _, _, _ = _dp()
    for _ in range(3):
        part.step(*part.sample())
    resumed, _, _, m_res = _dp()
    resumed.load_state_dict(part.state_dict())
    while not resumed.exhausted:
        resumed.step(*resumed.sample())
    for (n, a), (_, b) in zip(m_full.state_dict().items(), m_res.state_dict().items()):
        assert torch.equal(a, b), n


def test_adaclip_takes_the_k_copy_mean_too():
    dp, _, _, _ = _dp(strategy="adaclip", strategy_params={})
    xb, yb = dp.sample()
    dp.step(xb, yb)
    assert dp.engine_info["engine"] == "vmap"


@pytest.mark.parametrize("kw,match", [
    (dict(aug=None), r"augment_multiplicity=3 averages the gradients of 3 AUGMENTED copies"),
    (dict(strategy_params={"clip_norm": CLIP, "unit": "bc"}),
     r"augment_multiplicity=3 is defined for per-example clipping \(unit=ic\)"),
    (dict(engine="summed"), "the summed engine does not clip per example"),
    (dict(k=0), "the augmentation multiplicity K must be an integer >= 1"),
    (dict(k=True), "the augmentation multiplicity K must be an integer >= 1"),
    (dict(k=2.0), "the augmentation multiplicity K must be an integer >= 1"),
])
def test_refusals_name_the_argument_and_the_fix(kw, match):
    with pytest.raises(ValueError, match=match):
        _dp(**kw)


def test_bound_based_strategies_are_refused():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 1, 4, 4, generator=g), torch.randint(0, 2, (40,), generator=g)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Flatten(), nn.Linear(16, 2))
    with pytest.raises(ValueError, match=r"augment_multiplicity=2: bound-based strategies "
                                         r"\(Lip-DP-SGD\) certify the sensitivity of ONE input"):
        make_private(m, None, (x, y), strategy="lip-dp-sgd", noise_multiplier=1.0, steps=2,
                     batch_size=8.0, delta=1e-5, augment="flip", augment_multiplicity=2,
                     input_shape=(1, 4, 4), verbose=False)


BASE = dict(dataset="synthetic", model="mlp", strategy="fixed", strategy_params={"clip_norm": 1.0},
            delta=1e-5, epochs=2, batch_size=32, lr=0.5, optimizer="momentum", seed=0,
            noise_multiplier=0.8, dataset_options={"image_shape": [1, 6, 6], "n_train": 256})


def test_trainconfig_and_train_with_multiplicity(tmp_path):
    with pytest.raises(ValueError, match=r"TrainConfig: augment_multiplicity "
                                         r"\(--augment-multiplicity\) = 2 averages the gradients "
                                         r"of K AUGMENTED copies of each example, but augment is "
                                         r"'none'"):
        TrainConfig(**BASE, augment_multiplicity=2)
    with pytest.raises(ValueError, match=r"augment_multiplicity \(--augment-multiplicity\) must "
                                         r"be an integer"):
        TrainConfig(**BASE, augment="flip", augment_multiplicity="2")
    cfg = TrainConfig(**BASE, augment="crop:1,flip", augment_multiplicity=2,
                      reproducible_noise=True)
    assert cfg.fingerprint() != TrainConfig(**BASE, augment="crop:1,flip").fingerprint()
    full = train(cfg, progress=False)
    assert full.summary["augment_multiplicity"] == 2
    assert full.summary["engine_fallback"] is None  # auto runs ghost (issue 36)
    train(cfg, checkpoint_dir=tmp_path, progress=False, stop_after_steps=5)
    resumed = train(cfg, checkpoint_dir=tmp_path, progress=False)
    assert resumed.ledger == full.ledger
    for (n, a), (_, b) in zip(full.model.state_dict().items(),
                              resumed.model.state_dict().items()):
        assert torch.equal(a, b), n
