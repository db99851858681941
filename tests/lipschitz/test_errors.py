"""Unsupported layers, losses and arguments fail loudly, naming the layer / argument and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpclip.lipschitz import (
    SUPPORTED_LAYERS,
    LipGroupNorm,
    LipResidual,
    TemperedCrossEntropy,
    UnsupportedLayerError,
    lipschitz_bounds,
    module_lipschitz,
)

CE = TemperedCrossEntropy()


class MyLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 10 * super().forward(x)


@pytest.mark.parametrize(
    ("layer", "shape", "needle"),
    [
        (nn.BatchNorm1d(4), (4,), "no proven Lipschitz rule"),
        (nn.Softmax(dim=1), (4,), "no proven Lipschitz rule"),
        (nn.Dropout(0.5), (4,), "no proven Lipschitz rule"),
        (MyLinear(4, 4), (4,), "subclass of a supported layer"),
        (nn.GroupNorm(2, 4), (4, 3), "affine=False"),
        (nn.Conv2d(1, 1, 3, padding=1, padding_mode="reflect"), (1, 4, 4), "padding_mode='zeros'"),
        (nn.MaxPool2d(2, return_indices=True), (1, 4, 4), "return_indices=False"),
        (nn.Flatten(0), (4,), "batch dimension"),
        (LipResidual(nn.Linear(4, 3)), (4,), "preserve the shape"),
    ],
)
def test_unsupported_layers_are_named_with_the_supported_list(
    layer: nn.Module, shape: tuple[int, ...], needle: str
) -> None:
    model = nn.Sequential(nn.Identity(), nn.Sequential(layer))
    with pytest.raises(UnsupportedLayerError) as info:
        module_lipschitz(model, shape)
    msg = str(info.value)
    assert needle in msg
    assert "'1.0'" in msg or "'1'" in msg  # the layer's qualified name
    assert type(layer).__name__ in msg
    assert "nn.Linear" in msg and "LipResidual" in msg  # the supported list


def test_supported_list_is_complete() -> None:
    for name in (
        "nn.Linear",
        "nn.Conv2d",
        "nn.ReLU",
        "nn.Tanh",
        "nn.Sigmoid",
        "TemperedSigmoid",
        "GroupSort",
        "nn.MaxPool2d",
        "nn.AvgPool2d",
        "nn.GroupNorm",
        "LipGroupNorm",
        "nn.Flatten",
    ):
        assert name in SUPPORTED_LAYERS


def test_unsupported_loss_and_outputs() -> None:
    model = nn.Sequential(nn.Linear(4, 3))
    with pytest.raises(UnsupportedLayerError, match="TemperedCrossEntropy"):
        lipschitz_bounds(
            model,
            nn.CrossEntropyLoss(),  # type: ignore[arg-type]
            input_shape=(4,),
            input_norm_bound=1.0,
        )
    with pytest.raises(ValueError, match="logits of shape"):
        lipschitz_bounds(nn.Sequential(nn.Linear(4, 1)), CE, input_shape=(4,), input_norm_bound=1.0)
    with pytest.raises(ValueError, match="logits of shape"):
        lipschitz_bounds(
            nn.Sequential(nn.Conv2d(1, 2, 1)), CE, input_shape=(1, 2, 2), input_norm_bound=1.0
        )


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "1"])
def test_bad_input_norm_bound(bad: object) -> None:
    with pytest.raises(ValueError, match="input_norm_bound"):
        lipschitz_bounds(
            nn.Sequential(nn.Linear(4, 3)),
            CE,
            input_shape=(4,),
            input_norm_bound=bad,  # type: ignore[arg-type]
        )


def test_bad_input_shape() -> None:
    with pytest.raises(ValueError, match="input_shape"):
        lipschitz_bounds(nn.Sequential(nn.Linear(4, 3)), CE, input_shape=(), input_norm_bound=1.0)
    with pytest.raises(ValueError, match="check input_shape"):
        lipschitz_bounds(nn.Sequential(nn.Linear(4, 3)), CE, input_shape=(5,), input_norm_bound=1.0)


def test_weight_sharing_and_stray_parameters_are_refused() -> None:
    shared = nn.Linear(4, 4)
    with pytest.raises(UnsupportedLayerError, match="weight sharing"):
        lipschitz_bounds(
            nn.Sequential(shared, nn.ReLU(), shared, nn.Linear(4, 3)),
            CE,
            input_shape=(4,),
            input_norm_bound=1.0,
        )
    model = nn.Sequential(nn.Linear(4, 3))
    model.register_parameter("stray", nn.Parameter(torch.zeros(2)))
    with pytest.raises(UnsupportedLayerError, match="stray"):
        lipschitz_bounds(model, CE, input_shape=(4,), input_norm_bound=1.0)


def test_layer_constructors_validate_arguments() -> None:
    with pytest.raises(ValueError, match="lipschitz"):
        LipGroupNorm(2, 0.0)
    with pytest.raises(ValueError, match="num_groups"):
        LipGroupNorm(0, 1.0)
    with pytest.raises(ValueError, match="multiple of num_groups"):
        LipGroupNorm(3, 1.0)(torch.zeros(2, 4))
    with pytest.raises(TypeError, match="nn.Module"):
        LipResidual("not a module")  # type: ignore[arg-type]


def test_conv_norm_option() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 3))
    kw = {"input_shape": (1, 4, 4), "input_norm_bound": 1.0}
    with pytest.raises(ValueError, match="conv_norm"):
        lipschitz_bounds(model, CE, conv_norm="power", **kw)  # type: ignore[arg-type]
    reshape = lipschitz_bounds(model, CE, conv_norm="reshape", **kw).layer("0")
    fft = lipschitz_bounds(model, CE, conv_norm="fft", **kw).layer("0")
    assert reshape.operator_norm_method.startswith("conv-reshape")
    assert fft.operator_norm <= reshape.operator_norm
