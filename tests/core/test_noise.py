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


def _extreme_generator() -> torch.Generator:
    """A CPU generator whose next 623 raw 32-bit outputs are all 0xFFFFFFFF: every uniform it
    gives is the largest its resolution allows, so ``1 - u`` is the smallest nonzero value and
    Box-Muller's radius is the largest the sampler can ever output (its exact support bound).
    Test only: the MT state is written directly (layout of torch's CPUGeneratorImplState:
    ``left`` (int32) 16 bytes and ``next`` (uint64) 8 bytes before the 624 state words)."""
    import numpy as np

    from dpclip.randomness import _mt_state_offset

    off = _mt_state_offset()
    g = torch.Generator()
    g.manual_seed(1)
    raw = bytearray(g.get_state().numpy().tobytes())
    assert np.frombuffer(bytes(raw), dtype=np.int32, count=1, offset=off - 16)[0] == 1  # left
    raw[off - 16:off - 12] = np.int32(624).tobytes()  # 623 outputs before the next twist
    raw[off - 8:off] = np.uint64(0).tobytes()  # next = 0
    raw[off:off + 8 * 624] = np.full(624, _untemper(0xFFFFFFFF), dtype=np.uint64).tobytes()
    g.set_state(torch.frombuffer(raw, dtype=torch.uint8).clone())
    return g


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


def test_float32_noise_is_a_float64_draw_cast():
    """The construction: float64 standard normals, cast to the gradient's dtype, then scaled."""
    vals = {"a": torch.zeros(3, 4), "b": torch.zeros(37)}
    out = add_gaussian_noise_all(vals, 1.0, make_generator(11))
    z = torch.randn(49, generator=make_generator(11), dtype=torch.float64).float()
    assert torch.equal(out["a"].reshape(-1), z[:12]) and torch.equal(out["b"], z[12:])
    per = add_gaussian_noise_all(vals, {"a": 1.0, "b": 1.0}, make_generator(11))
    assert torch.equal(per["a"].reshape(-1), z[:12]) and torch.equal(per["b"], z[12:])
