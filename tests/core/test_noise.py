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
