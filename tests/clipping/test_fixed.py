import math

import pytest
import torch

from dpclip.clipping import FixedClip, list_strategies, make_strategy
from tests.clipping.contract import check_weight_bound


def test_fixed_weights_closed_form():
    s = FixedClip(clip_norm=0.5)
    n = torch.tensor([0.0, 0.25, 0.5, 1.0, 4.0], dtype=torch.float64)
    w = s.weights(n, {})
    expected = torch.tensor([1.0, 1.0, 0.5 / (0.5 + 1e-6), 0.5 / (1 + 1e-6), 0.5 / (4 + 1e-6)],
                            dtype=torch.float64)
    assert torch.allclose(w, expected, rtol=0, atol=1e-15)
    assert s.sensitivity({}) == 0.5


def test_fixed_changes_scaling_vs_unclipped():
    # anchors P13: a strategy must really change per-example scaling
    w = FixedClip(0.1).weights(torch.tensor([1.0]), {})
    assert w.item() < 0.11


@pytest.mark.parametrize("bad", [0, -1, math.inf, math.nan, "abc"])
def test_fixed_rejects_bad_clip(bad):
    with pytest.raises(ValueError, match="clip_norm"):
        FixedClip(clip_norm=bad)


def test_registry_make_and_errors():
    s = make_strategy("fixed", {"clip_norm": "0.25"})
    assert isinstance(s, FixedClip) and s.clip_norm == 0.25
    with pytest.raises(ValueError, match="valid strategies: .*fixed"):
        make_strategy("nope")
    with pytest.raises(ValueError, match="no parameter.*clip_nrom.*valid parameters: clip_norm"):
        make_strategy("fixed", {"clip_nrom": "1"})
    assert "fixed" in [e.name for e in list_strategies()]


def test_weight_bound_check_catches_a_broken_strategy():
    class Broken(FixedClip):
        def weights(self, norms, state):  # forgets the min(1, .)
            return self.clip_norm / (norms + 1e-6) * 1.5

    with pytest.raises(AssertionError):
        check_weight_bound(Broken(1.0))


def test_set_positive_finite_stores_floats_and_leaves_an_optional_none():
    from dpclip.clipping.quantile import QuantileClip

    s = QuantileClip(initial_clip_norm=1, clip_lr=2, count_noise_std=None)
    assert type(s.initial_clip_norm) is float and type(s.clip_lr) is float
    assert s.count_noise_std is None
    assert type(QuantileClip(count_noise_std=3).count_noise_std) is float
    with pytest.raises(ValueError, match="QuantileClip: count_noise_std must be a finite number"):
        QuantileClip(count_noise_std=0.0)
