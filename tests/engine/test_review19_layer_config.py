"""Nineteenth hostile review (of 858a6f2), each test failing there: a ruled layer's configuration.

The Conv rule pads the layer's input after the backward as the layer's own forward does, from its
``padding_mode`` and ``_reversed_padding_repeated_twice``. Set after construction to ``"constant"``
and ``(1, 1, 0, 0, 1, -1)``, the layer's ``F.pad`` padded and cropped the BATCH dimension (every
example moved down one row) and the rule agreed with it: accepted by ghost and auto (known chain,
user loss, custom forward alike), LOO 2.20 C, per-example norms [1.20, 2.24, 3.54, 3.30] against
the loop's [1.20, 1.20, 1.10, 1.20]. Now the rule refuses a padding mode torch does not build and a
padding list other than the one ``padding``, ``kernel_size`` and ``dilation`` give; and a ruled
layer whose configuration the forward changed for its call (and put back) is refused at the call.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dpclip.engine import AutoEngine, GhostEngine, ParamGroups, UnsupportedModelError
from tests.engine.helpers import DT, assert_equal_to_the_loop, ce, clip_weights, loo_distance

C = 0.5


def _shifting_conv() -> nn.Conv1d:
    conv = nn.Conv1d(2, 3, 3, padding=1, padding_mode="circular").to(DT)
    conv.padding_mode = "constant"
    conv._reversed_padding_repeated_twice = (1, 1, 0, 0, 1, -1)  # pads/crops the batch
    return conv


def _chain() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(_shifting_conv(), nn.Tanh(), nn.Flatten(), nn.Linear(12, 3).to(DT))


class _Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.fc = _shifting_conv(), nn.Linear(12, 3).to(DT)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


@pytest.mark.parametrize("make", [_chain, _Custom], ids=["chain", "custom-forward"])
@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine], ids=["ghost", "auto"])
def test_a_padding_list_that_shifts_the_batch_is_refused(make, engine):
    """858a6f2: accepted, LOO 2.20 C. Now ghost refuses; auto runs vmap (sound)."""
    g = torch.Generator().manual_seed(4)
    x, y = 3 * torch.randn(4, 2, 4, generator=g, dtype=DT), torch.randint(0, 3, (4,), generator=g)
    if engine is GhostEngine:
        model = make()
        with pytest.raises(UnsupportedModelError, match="padding_mode='constant'"):
            engine().compute(model, ce, x, y, clip_weights(C), ParamGroups.flat(model))
        return
    assert loo_distance(engine, make, x, y, C) <= 1 + 1e-9


@pytest.mark.parametrize("conv", [
    lambda: nn.Conv1d(2, 3, 3, padding=1),
    lambda: nn.Conv1d(2, 3, 3, padding=1, padding_mode="circular"),
    lambda: nn.Conv2d(2, 3, (3, 4), padding="same", dilation=(2, 1), padding_mode="reflect"),
    lambda: nn.Conv2d(2, 3, 3, padding="valid"),
    lambda: nn.Conv2d(2, 3, (3, 3), padding=(1, 2), padding_mode="replicate"),
])
def test_convolutions_as_torch_builds_them_stay_supported(conv):
    from dpclip.engine.ghost_rules import _ConvRule

    assert _ConvRule().unsupported(conv()) is None
    c = conv()
    c._reversed_padding_repeated_twice = list(c._reversed_padding_repeated_twice)[::-1] + [1, 1]
    assert "padding list" in _ConvRule().unsupported(c)


class _SwitchesPadding(nn.Module):
    """A conv built honestly; the forward sets the batch-shifting padding for the conv's call only
    and puts it back: the step starts (and ends) with an honest layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv1d(2, 3, 3, padding=1, padding_mode="circular").to(DT)
        self.fc = nn.Linear(12, 3).to(DT)

    def forward(self, x: Tensor) -> Tensor:
        was = self.conv.padding_mode, self.conv._reversed_padding_repeated_twice
        self.conv.padding_mode = "constant"
        self.conv._reversed_padding_repeated_twice = (1, 1, 0, 0, 1, -1)
        h = self.conv(x)
        self.conv.padding_mode, self.conv._reversed_padding_repeated_twice = was
        return self.fc(torch.tanh(h).flatten(1))


class _SwitchesEps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.norm, self.fc2 = nn.Linear(4, 4).to(DT), nn.LayerNorm(4).to(DT), \
            nn.Linear(4, 3).to(DT)

    def forward(self, x: Tensor) -> Tensor:
        self.norm.eps = 10.0
        h = self.norm(self.fc1(x))
        self.norm.eps = 1e-5
        return self.fc2(h)


@pytest.mark.parametrize("make,shape", [(_SwitchesPadding, (4, 2, 4)), (_SwitchesEps, (4, 4))],
                         ids=["padding", "eps"])
@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine], ids=["ghost", "auto"])
def test_a_layer_configured_for_its_call_only_is_refused(make, shape, engine):
    g = torch.Generator().manual_seed(4)
    x, y = 3 * torch.randn(*shape, generator=g, dtype=DT), torch.randint(0, 3, (4,), generator=g)
    model = make()
    with pytest.raises(UnsupportedModelError, match="another configuration"):
        engine().compute(model, ce, x, y, clip_weights(C), ParamGroups.flat(model))


def test_an_honest_padded_conv_still_runs_on_ghost_equal_to_the_loop():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 3, 3, padding=1, padding_mode="circular"), nn.Tanh(),
                          nn.Flatten(), nn.Linear(12, 3)).to(DT)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(4, 2, 4, generator=g, dtype=DT), torch.randint(0, 3, (4,), generator=g)
    groups = ParamGroups.flat(model)
    res = AutoEngine().compute(model, ce, x, y, clip_weights(C), groups)
    assert_equal_to_the_loop(res, model, ce, x, y, groups)
