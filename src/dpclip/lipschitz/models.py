"""Networks for Lipschitz (bound-based) private training, built only from supported layers.

:func:`lip_mnist_convnet` is the MNIST ConvNet of Lip-DP-SGD (Barczewski & Ramon, S2 Table 4 as
reconstructed in algorithms.md T13): ``Conv 32 3x3 SAME -> act -> Conv 64 3x3 SAME -> act ->
MaxPool 2x2 (stride 2) -> Flatten -> Dense 128 -> act -> Dense num_classes``; 1,625,866 parameters
for 1x28x28 inputs and 10 classes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import nn

from dpclip.lipschitz.layers import GroupSort
from dpclip.models.activations import make_activation

__all__ = ["lip_mnist_convnet", "tabular_mlp"]


def _activation(name: str) -> nn.Module:
    if name == "groupsort":
        return GroupSort(2)
    if name in ("relu", "tanh"):
        return make_activation(name)
    raise ValueError(
        f"lip_mnist_convnet: activation must be one of 'relu', 'tanh', 'groupsort', got {name!r}"
    )


def lip_mnist_convnet(
    input_shape: Sequence[int] = (1, 28, 28),
    num_classes: int = 10,
    *,
    activation: str = "relu",
    bias: bool = True,
) -> nn.Sequential:
    """The Lip-DP-SGD MNIST ConvNet (T13). ``activation`` in ``relu`` (default), ``tanh``,
    ``groupsort`` (GroupSort(2), norm preserving); ``bias=False`` drops every bias (then each layer
    maps 0 to 0 and the input-norm bounds need no bias terms). The 2x2 pool has stride 2, so it
    is 1-Lipschitz (no overlap factor)."""
    shape = tuple(input_shape)
    if len(shape) != 3 or shape[1] % 2 or shape[2] % 2:
        raise ValueError(
            f"lip_mnist_convnet: input_shape must be (channels, height, width) with even height "
            f"and width, got {shape}"
        )
    c, h, w = shape
    layers: OrderedDict[str, nn.Module] = OrderedDict(
        conv1=nn.Conv2d(c, 32, 3, padding=1, bias=bias),
        act1=_activation(activation),
        conv2=nn.Conv2d(32, 64, 3, padding=1, bias=bias),
        act2=_activation(activation),
        pool=nn.MaxPool2d(2, 2),
        flatten=nn.Flatten(),
        fc1=nn.Linear(64 * (h // 2) * (w // 2), 128, bias=bias),
        act3=_activation(activation),
        fc2=nn.Linear(128, num_classes, bias=bias),
    )
    return nn.Sequential(layers)


def tabular_mlp(
    input_shape: Sequence[int],
    num_classes: int,
    *,
    hidden: int = 16,
    activation: str = "relu",
    bias: bool = True,
) -> nn.Sequential:
    """The 2-layer tabular MLP of Lip-DP-SGD (S2 Table 4: "2 layers", 140-2,120 parameters):
    ``Flatten -> Dense hidden -> act -> Dense num_classes``. With the default ``hidden = 16`` every
    tabular dataset of S2 Table 1 lands in that range (parameters with our encodings: breast-cancer 530,
    adult 1,778, android-permissions 1,426, default-credit 578, dropout 643, german-credit 1,026,
    nursery 533). Activations as
    :func:`lip_mnist_convnet`, all supported by the Lipschitz analysis."""
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
        raise ValueError(f"tabular_mlp: hidden must be a positive integer, got {hidden!r}")
    width = 1
    for s in input_shape:
        width *= int(s)
    return nn.Sequential(
        OrderedDict(
            flatten=nn.Flatten(),
            fc1=nn.Linear(width, hidden, bias=bias),
            act1=_activation(activation),
            fc2=nn.Linear(hidden, num_classes, bias=bias),
        )
    )
