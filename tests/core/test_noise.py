"""``dpclip.noise``: the one place where a noise std meets random numbers."""

from __future__ import annotations

import pytest
import torch

from dpclip.noise import add_gaussian_noise_all, make_generator


def _values():
    return {"a": torch.randn(3, 4, dtype=torch.float64), "b": torch.randn(5, dtype=torch.float64),
            "c": torch.zeros(0, dtype=torch.float64)}


def test_one_draw_split_in_order_then_divided():
    vals = _values()
    out = add_gaussian_noise_all(vals, 0.7, make_generator(3), divide_by=4.0)
    z = torch.randn(17, generator=make_generator(3), dtype=torch.float64)
    assert list(out) == ["a", "b", "c"]
    assert torch.allclose(out["a"], (vals["a"] + 0.7 * z[:12].view(3, 4)) / 4.0, rtol=0, atol=1e-15)
    assert torch.allclose(out["b"], (vals["b"] + 0.7 * z[12:]) / 4.0, rtol=0, atol=1e-15)
    assert out["c"].shape == (0,)
    for k in vals:  # inputs untouched
        assert out[k] is not vals[k]


def test_noise_has_the_requested_std_and_zero_std_is_a_copy():
    vals = {"w": torch.zeros(200_000, dtype=torch.float64)}
    noisy = add_gaussian_noise_all(vals, 2.5, make_generator(0))["w"]
    assert noisy.std().item() == pytest.approx(2.5, rel=0.01)
    assert abs(noisy.mean().item()) < 0.02
    same = add_gaussian_noise_all(vals, 0.0, make_generator(0), divide_by=2.0)["w"]
    assert torch.equal(same, vals["w"]) and same is not vals["w"]


def test_mixed_dtypes_fall_back_per_tensor_and_bad_divisor_is_refused():
    vals = {"a": torch.zeros(4), "b": torch.zeros(3, dtype=torch.float64)}
    out = add_gaussian_noise_all(vals, 1.0, make_generator(1))
    assert out["a"].dtype == torch.float32 and out["b"].dtype == torch.float64
    assert add_gaussian_noise_all({}, 1.0, make_generator(1)) == {}
    with pytest.raises(ValueError, match="divide_by"):
        add_gaussian_noise_all(vals, 1.0, make_generator(1), divide_by=0.0)


# ------------------------------------------------------------------------- no float32 tail cap

def _untemper(y: int) -> int:
    """The Mersenne Twister state word whose tempered output is ``y`` (inverse tempering)."""
    def undo_right(v: int, shift: int) -> int:
        out = v
        for _ in range(32 // shift + 1):
            out = v ^ (out >> shift)
        return out & 0xFFFFFFFF

    def undo_left(v: int, shift: int, mask: int) -> int:
        out = v
        for _ in range(32 // shift + 1):
            out = v ^ ((out << shift) & mask)
        return out & 0xFFFFFFFF

    y = undo_right(y, 18)
    y = undo_left(y, 15, 0xEFC60000)
    y = undo_left(y, 7, 0x9D2C5680)
    return undo_right(y, 11)


def _generator_with_outputs(words: list[int]) -> torch.Generator:
    """A CPU generator whose next raw 32-bit outputs are ``words`` (at most 623), then
    0xFFFFFFFF. Test only: the MT state is written directly (layout of torch's
    CPUGeneratorImplState: ``left`` (int32) 16 bytes and ``next`` (uint64) 8 bytes before the
    624 state words; with ``left = 624`` and ``next = 0`` the next 623 outputs are the tempered
    state words 0..622)."""
    import numpy as np

    from dpclip.randomness import _mt_state_offset

    assert len(words) <= 623
    words = list(words) + [0xFFFFFFFF] * (624 - len(words))
    off = _mt_state_offset()
    g = torch.Generator()
    g.manual_seed(1)
    raw = bytearray(g.get_state().numpy().tobytes())
    assert np.frombuffer(bytes(raw), dtype=np.int32, count=1, offset=off - 16)[0] == 1  # left
    raw[off - 16:off - 12] = np.int32(624).tobytes()  # 623 outputs before the next twist
    raw[off - 8:off] = np.uint64(0).tobytes()  # next = 0
    raw[off:off + 8 * 624] = np.array([_untemper(w) for w in words], dtype=np.uint64).tobytes()
    g.set_state(torch.frombuffer(raw, dtype=torch.uint8).clone())
    return g


def _extreme_generator() -> torch.Generator:
    """A CPU generator whose next 623 raw 32-bit outputs are all 0xFFFFFFFF: every uniform it
    gives is the largest its resolution allows, so ``1 - u`` is the smallest nonzero value and
    Box-Muller's radius is the largest the sampler can ever output (its exact support bound)."""
    return _generator_with_outputs([])


def test_extreme_generator_shows_the_float32_cap():
    """The float32 sampler torch uses on the CPU cannot exceed sqrt(2 * 24 ln 2) = 5.77: at its
    most extreme uniforms it gives exactly that radius (the cap the noise draw must not have)."""
    import math

    z32 = torch.randn(16, generator=_extreme_generator(), dtype=torch.float32)
    assert z32.abs().max().item() == pytest.approx(math.sqrt(2 * 24 * math.log(2)), rel=1e-5)
    assert z32.abs().max().item() < 5.8


def test_noise_tails_are_not_cut_at_float32_resolution():
    """dpclip's float32 noise reaches beyond 5.8 sigma: at the sampler's most extreme uniforms it
    outputs the float64 bound sqrt(2 * 53 ln 2) = 8.57 (fails on the old float32 draw: 5.77)."""
    import math

    from dpclip.noise import add_gaussian_noise

    bound = math.sqrt(2 * 53 * math.log(2))
    vals = {"w": torch.zeros(16, dtype=torch.float32)}
    z = add_gaussian_noise_all(vals, 1.0, _extreme_generator())["w"]
    assert z.dtype == torch.float32
    assert z.abs().max().item() > 8.5
    assert z.abs().max().item() == pytest.approx(bound, rel=1e-5)
    # the single-tensor release (strategy statistics) has the same support
    one = add_gaussian_noise(torch.zeros(16), 1.0, _extreme_generator())
    assert one.abs().max().item() == pytest.approx(bound, rel=1e-5)


def test_float32_noise_is_dpclips_sampler_and_float64_noise_a_float64_draw():
    """The construction: float32 noise is :func:`standard_normal`'s draw (the CPU Box-Muller),
    scaled; float64 noise is torch's float64 draw; mixed dtypes with per-tensor stds: one float64
    draw, cast per tensor."""
    from dpclip.noise import standard_normal

    from dpclip.noise import _SMALL_DRAW, _box_muller_cpu

    vals = {"a": torch.zeros(30, 40), "b": torch.zeros(3007)}  # 4207 >= _SMALL_DRAW
    out = add_gaussian_noise_all(vals, 1.0, make_generator(11))
    z = _box_muller_cpu(4207, make_generator(11))
    assert torch.equal(standard_normal(4207, make_generator(11), torch.float32, "cpu"), z)
    assert torch.equal(out["a"].reshape(-1), z[:1200]) and torch.equal(out["b"], z[1200:])
    per = add_gaussian_noise_all(vals, {"a": 1.0, "b": 1.0}, make_generator(11))
    assert torch.equal(per["a"].reshape(-1), z[:1200]) and torch.equal(per["b"], z[1200:])
    # a small draw (a bias, a strategy's statistic): torch's float64 draw, cast (same 53-bit tail)
    small = torch.randn(_SMALL_DRAW - 1, generator=make_generator(11), dtype=torch.float64)
    assert torch.equal(standard_normal(_SMALL_DRAW - 1, make_generator(11), torch.float32, "cpu"),
                       small.float())
    z64 = torch.randn(49, generator=make_generator(11), dtype=torch.float64)
    assert torch.equal(standard_normal(49, make_generator(11), torch.float64, "cpu"), z64)
    mixed_vals = {"a": torch.zeros(12), "b": torch.zeros(37, dtype=torch.float64)}
    mixed = add_gaussian_noise_all(mixed_vals, {"a": 1.0, "b": 1.0}, make_generator(11))
    assert torch.equal(mixed["a"], z64[:12].float()) and torch.equal(mixed["b"], z64[12:])


# ------------------------------------------------ the CPU sampler (float64 radius, float32 angle)

def _radius_generator(j: int, angle_bits: int = 0) -> torch.Generator:
    """A generator whose first pair has ``1 - w = j 2**-53`` (53-bit uniform ``w = k 2**-53``,
    ``k = 2**53 - j``: torch's float64 uniform is the low 53 bits of ``(first << 32) | second``)
    and the 24-bit angle uniform ``angle_bits 2**-24``."""
    k = 2 ** 53 - j
    return _generator_with_outputs([k >> 32, k & 0xFFFFFFFF, angle_bits])


def test_sampler_support_is_exactly_the_53_bit_bound(monkeypatch):
    """The largest |z| the sampler can output is TAIL_BOUND = sqrt(-2 ln 2**-53) (smallest
    uniform, angle 0), for every output dtype but float64's own path; nothing larger exists."""
    from dpclip import noise
    from dpclip.noise import TAIL_BOUND, _box_muller_cpu, standard_normal

    monkeypatch.setattr(noise, "_SMALL_DRAW", 0)  # the sampler even for 64 normals (the
    # extreme generator's 623 words cover 32 pairs' radii and angles)

    z = _box_muller_cpu(2, _radius_generator(1))
    assert z[0].item() == pytest.approx(TAIL_BOUND, rel=2 ** -22) and z[1].item() == 0.0
    assert abs(z[0].item()) <= TAIL_BOUND * (1 + 2 ** -22)
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        big = standard_normal(64, _extreme_generator(), dt, "cpu")
        assert big.dtype == dt
        assert big.abs().max().item() == pytest.approx(TAIL_BOUND, rel=1e-2 if dt != torch.float32
                                                       else 2 ** -22)


@pytest.mark.parametrize("j", [1, 3, 2 ** 10, 2 ** 20, 2 ** 28])
def test_radius_is_exact_beyond_float32_resolution(j):
    """The radius at uniforms float32 cannot hold (``1 - w < 2**-24``: radius > 5.77):
    ``z = sqrt(-2 ln(j 2**-53))`` at angle 0, and ``z = r sin`` at a quarter turn."""
    import math

    from dpclip.noise import _box_muller_cpu

    r = math.sqrt(-2.0 * math.log(j * 2.0 ** -53))
    assert r > 5.8
    z = _box_muller_cpu(2, _radius_generator(j))
    assert z[0].item() == pytest.approx(r, rel=2 ** -22)
    quarter = _box_muller_cpu(2, _radius_generator(j, angle_bits=1 << 22))  # v = 1/4
    assert quarter[1].item() == pytest.approx(r, rel=2 ** -22)
    assert abs(quarter[0].item()) < 1e-5 * r


def test_sampler_matches_the_standard_normal():
    """2e6 draws (fixed seed): KS test against N(0,1) (p > 1e-4), mean and variance within 5
    standard errors, and the tail weight P(|z| > 4) within 5 Poisson standard errors."""
    import math

    from scipy import stats

    from dpclip.noise import standard_normal

    n = 2_000_000
    z = standard_normal(n, make_generator(2024), torch.float32, "cpu").double()
    assert z.shape == (n,) and torch.isfinite(z).all()
    assert stats.kstest(z.numpy(), stats.norm.cdf).pvalue > 1e-4
    assert abs(z.mean().item()) < 5 / math.sqrt(n)
    assert abs(z.var().item() - 1.0) < 5 * math.sqrt(2.0 / n)
    expected = n * 2 * stats.norm.sf(4.0)  # about 127
    count = (z.abs() > 4.0).sum().item()
    assert abs(count - expected) < 5 * math.sqrt(expected), (count, expected)


def test_pairs_are_independent():
    """The cosine and sine halves of each block (the two outputs of every pair, which share a
    radius): uncorrelated, and so are their squares (both 0 for an exact Box-Muller)."""
    import math

    from dpclip.noise import _PAIRS_PER_BLOCK, standard_normal

    k = _PAIRS_PER_BLOCK
    z = standard_normal(4 * k, make_generator(7), torch.float32, "cpu").double().view(2, 2, k)
    c, s = z[:, 0].reshape(-1), z[:, 1].reshape(-1)  # block b: cos = z[b, 0], sin = z[b, 1]
    bound = 5 / math.sqrt(c.numel())
    assert abs(torch.corrcoef(torch.stack([c, s]))[0, 1].item()) < bound
    assert abs(torch.corrcoef(torch.stack([c * c, s * s]))[0, 1].item()) < bound
    # the sine half alone is N(0, 1) too (a wrong angle range would make it one-sided)
    assert abs(s.mean().item()) < bound and abs(s.var().item() - 1) < 5 * math.sqrt(2 / s.numel())


@pytest.mark.parametrize("n", [0, 1, 2, 5, 2048, 2 * 65536 - 1, 2 * 65536 + 3])
def test_sampler_sizes_reproducibility_and_generator_use(n):
    """Every size (odd ends, block ends), reproducible from a seed, a different seed gives other
    values, and the generator advances (two draws differ)."""
    from dpclip.noise import _box_muller_cpu

    a = _box_muller_cpu(n, make_generator(5))
    assert a.shape == (n,) and a.dtype == torch.float32 and torch.isfinite(a).all()
    assert torch.equal(a, _box_muller_cpu(n, make_generator(5)))
    if n >= 2:
        assert not torch.equal(a, _box_muller_cpu(n, make_generator(6)))
        g = make_generator(5)
        _box_muller_cpu(n, g)
        assert not torch.equal(a, _box_muller_cpu(n, g))


def test_low_precision_outputs_are_the_float32_draw_cast():
    from dpclip.noise import standard_normal

    z = standard_normal(5001, make_generator(3), torch.float32, "cpu")
    for dt in (torch.float16, torch.bfloat16):
        assert torch.equal(standard_normal(5001, make_generator(3), dt, "cpu"), z.to(dt))
