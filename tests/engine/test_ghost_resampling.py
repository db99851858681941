"""Upsampling (``nn.Upsample`` / ``F.interpolate``) and ``PixelShuffle`` / ``PixelUnshuffle`` on ghost.

Before: every model with an upsampling (a U-Net, a decoder) was refused by ghost as "the batch
size is used as a Python value" and sent to whole-model vmap by ``auto``: the C++ composite kernel
of the ``.vec`` upsamplings reads all input sizes as plain integers, which specialised the proof's
symbolic batch size (``batch_symbol._upsample_as_eager`` now emits the eager kernel's operations
with symbolic sizes). The 1-D, 3-D, bicubic and antialiased upsamplings and the pixel shuffles had
no separability rule. Oracle: the float64 per-example loop.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from dpclip.engine import AutoEngine, GhostEngine, ParamGroups, UnsupportedModelError
from dpclip.engine.batch import padded_rows
from tests.engine.helpers import DT, assert_equal_to_the_loop, ce, clip_weights

B = 5


class Interp(nn.Module):
    def __init__(self, dims: int, **kw) -> None:
        super().__init__()
        conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
        self.conv = conv(2, 3, 2)
        self.kw = kw
        self.fc = nn.LazyLinear(3)

    def forward(self, x: Tensor) -> Tensor:
        h = F.interpolate(torch.tanh(self.conv(x)), **self.kw)
        return self.fc(h.flatten(1))


CASES = [
    (1, dict(scale_factor=2)),
    (1, dict(size=7, mode="linear", align_corners=True)),
    (1, dict(scale_factor=1.5, mode="nearest-exact")),
    (2, dict(scale_factor=2)),
    (2, dict(size=(7, 6), mode="bilinear")),
    (2, dict(scale_factor=1.7, mode="bicubic", align_corners=False)),
    (2, dict(scale_factor=0.6, mode="bilinear", antialias=True)),
    (2, dict(scale_factor=2.5, mode="nearest", recompute_scale_factor=True)),
    (3, dict(scale_factor=(1, 2, 2))),
    (3, dict(size=(3, 4, 5), mode="trilinear")),
]


def _data(dims: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, 2, *([5] * dims), generator=g, dtype=DT)
    return x, torch.randint(0, 3, (B,), generator=g)


@pytest.mark.parametrize("dims, kw", CASES, ids=[f"{d}d-{sorted(k.items())}" for d, k in CASES])
def test_interpolate_runs_on_ghost_equal_to_the_loop(dims, kw):
    x, y = _data(dims)
    torch.manual_seed(0)
    model = Interp(dims, **kw).to(DT)
    model(x)  # (the lazy layer's size)
    for groups in (ParamGroups.flat(model), ParamGroups.per_parameter(model)):
        for engine in (AutoEngine(), GhostEngine(max_physical_batch=2)):
            res = engine.compute(model, ce, x, y, clip_weights(0.3), groups)
            assert res.engine_info["engine"] == "ghost" and res.engine_info["fallback"] is None
            assert_equal_to_the_loop(res, model, ce, x, y, groups)


def test_upsample_module_and_pixel_shuffles():
    x, y = _data(2)
    x = F.pad(x, (0, 1, 0, 1))  # 6 x 6
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 8, 3, padding=1), nn.PixelShuffle(2),  # (2, 12, 12)
                          nn.PixelUnshuffle(3),  # (18, 4, 4)
                          nn.Upsample(scale_factor=2, mode="bilinear"), nn.Flatten(),
                          nn.Linear(18 * 8 * 8, 3)).to(DT)
    groups = ParamGroups.per_parameter(model)
    res = AutoEngine().compute(model, ce, x, y, clip_weights(0.3), groups)
    assert res.engine_info["engine"] == "ghost" and res.engine_info["fallback"] is None
    assert_equal_to_the_loop(res, model, ce, x, y, groups)


class _Across(nn.Module):
    """The batch moved into a dimension the operation mixes: an upsampling along the batch (the
    batch as a spatial dimension), a pixel shuffle with the batch among the channels."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 1)
        self.kind = kind
        self.fc = nn.Linear(4 * 4 * 4 if kind == "shuffle" else 4 * 6 * 6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv(x)  # (B, 4, 6, 6) with x (B, 2, 6, 6)
        if self.kind == "upsample":  # batch as the height: interpolation mixes neighbours
            h = F.interpolate(h.permute(1, 2, 0, 3), size=(padded_rows(2) + 4, 6),
                              mode="bilinear")  # (more rows than the engine runs: mixes them)
            h = h.permute(2, 0, 1, 3)[: x.shape[0]]
        else:  # (1, B 4, 6, 6): a channel of the output interleaves examples' channels
            h = F.pixel_unshuffle(h.reshape(1, -1, 6, 6)[:, :, :4, :4], 2)
            h = h.reshape(x.shape[0], 4, 4, 4)
        return self.fc(h.flatten(1))


@pytest.mark.parametrize("kind", ["upsample", "shuffle"])
def test_resampling_across_the_batch_stays_refused(kind):
    x, y = _data(2)
    x = F.pad(x, (0, 1, 0, 1))
    torch.manual_seed(0)
    model = _Across(kind).to(DT)
    with pytest.raises(UnsupportedModelError):
        GhostEngine().compute(model, ce, x, y, clip_weights(0.3), ParamGroups.flat(model))
