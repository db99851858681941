"""Nguyen et al.'s networks (algorithms.md 3.4, A9): (BN-)LeNet-5, their convnet, ResNet-18.

BatchNorm mixes the examples of a batch, so a BatchNorm model trains only with batch clipping
(``--param unit=bc`` or ``gbc``); per-example clipping refuses it (``dpclip.training.units``). Every builder
offers a BatchNorm-free variant (``lenet5``; ``norm="gn"`` or ``"none"`` for the others).

Layer names are stable (``conv1``, ``bn1``, ...): per-layer clipping groups are modules owning
parameters, so BN-LeNet-5 has ``L = 8`` clipping blocks (conv1, bn1, conv2, bn2, conv3, bn3, fc1,
fc2) as in the paper, LeNet-5 ``L = 5``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import Tensor, nn

from dpclip.models.activations import make_activation

__all__ = ["lenet5", "nguyen_convnet", "resnet18"]

NORMS = ("bn", "gn", "none")


def _image(input_shape: Sequence[int], model: str) -> tuple[int, int, int]:
    shape = tuple(input_shape)
    if len(shape) != 3:
        raise ValueError(f"model {model!r} needs input_shape=(channels, height, width), got {shape}")
    return shape  # type: ignore[return-value]


def _norm(kind: str, channels: int, model: str) -> nn.Module:
    if kind == "bn":
        return nn.BatchNorm2d(channels)
    if kind == "gn":
        return nn.GroupNorm(min(32, channels) if channels % min(32, channels) == 0 else 1, channels)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"model {model!r}: norm must be one of {', '.join(NORMS)}, got {kind!r}")


def lenet5(
    input_shape: Sequence[int],
    num_classes: int,
    *,
    batchnorm: bool = False,
    activation: str = "tanh",
) -> nn.Sequential:
    """LeNet-5 (Nguyen et al.'s BN-LeNet-5 with ``batchnorm=True``).

    ``Conv(6, 5x5) -> tanh -> [BN(6)] -> AvgPool(2) -> Conv(16, 5x5) -> tanh -> [BN(16)] ->
    AvgPool(2) -> Conv(120, 5x5) -> tanh -> [BN(120)] -> Flatten -> FC(84) -> tanh -> FC(classes)``.
    Inputs smaller than 32x32 are zero-padded to 32x32 by the first convolution (28x28 MNIST /
    Fashion-MNIST: padding 2, the classic LeNet-5 arrangement; Nguyen crop to 32x32 instead).
    """
    c, h, w = _image(input_shape, "lenet5")
    pad = max(0, (32 - min(h, w) + 1) // 2)
    size = lambda n, k, p=0, s=1: (n + 2 * p - k) // s + 1  # noqa: E731
    hh, ww = size(h, 5, pad), size(w, 5, pad)
    hh, ww = hh // 2, ww // 2
    hh, ww = size(hh, 5) // 2, size(ww, 5) // 2
    hh, ww = size(hh, 5), size(ww, 5)
    if hh < 1 or ww < 1:
        raise ValueError(f"model 'lenet5': input_shape {tuple(input_shape)} is too small")
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    for i, (cin, cout) in enumerate(((c, 6), (6, 16), (16, 120)), start=1):
        layers[f"conv{i}"] = nn.Conv2d(cin, cout, 5, padding=pad if i == 1 else 0)
        layers[f"act{i}"] = make_activation(activation)
        if batchnorm:
            layers[f"bn{i}"] = nn.BatchNorm2d(cout)
        if i < 3:
            layers[f"pool{i}"] = nn.AvgPool2d(2, 2)
    layers["flatten"] = nn.Flatten()
    layers["fc1"] = nn.Linear(120 * hh * ww, 84)
    layers["act4"] = make_activation(activation)
    layers["fc2"] = nn.Linear(84, num_classes)
    return nn.Sequential(layers)


def bn_lenet5(input_shape: Sequence[int], num_classes: int, *, activation: str = "tanh"):
    """BN-LeNet-5: :func:`lenet5` with BatchNorm after every convolution (L = 8 blocks)."""
    return lenet5(input_shape, num_classes, batchnorm=True, activation=activation)


def nguyen_convnet(
    input_shape: Sequence[int], num_classes: int, *, norm: str = "bn"
) -> nn.Sequential:
    """Nguyen et al.'s CIFAR-10 convnet: four ``Conv(3x3, pad 1) -> ReLU -> Norm -> AvgPool``
    blocks (32, 64, 64, 128 filters; the last pool adaptive to 1x1) and a linear layer.

    ``norm``: ``bn`` (the paper), ``gn`` (GroupNorm, per-example clipping works) or ``none``.
    The Conv/ReLU/BN order is ambiguous in the paper [UNVERIFIED]; we use Conv -> ReLU -> BN.
    """
    c, _, _ = _image(input_shape, "nguyen-convnet")
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    for i, cout in enumerate((32, 64, 64, 128), start=1):
        layers[f"conv{i}"] = nn.Conv2d(c, cout, 3, padding=1)
        layers[f"act{i}"] = nn.ReLU()
        layers[f"norm{i}"] = _norm(norm, cout, "nguyen-convnet")
        layers[f"pool{i}"] = nn.AvgPool2d(2, 2) if i < 4 else nn.AdaptiveAvgPool2d(1)
        c = cout
    layers["flatten"] = nn.Flatten()
    layers["fc"] = nn.Linear(128, num_classes)
    return nn.Sequential(layers)


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, norm: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = _norm(norm, cout, "resnet18")
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = _norm(norm, cout, "resnet18")
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(OrderedDict(
                conv=nn.Conv2d(cin, cout, 1, stride, bias=False),
                norm=_norm(norm, cout, "resnet18"),
            ))

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """CIFAR ResNet-18 (3x3 stem, no max-pool, [2, 2, 2, 2] basic blocks, bias-free convs)."""

    def __init__(self, in_channels: int, num_classes: int, norm: str = "bn") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False)
        self.norm1 = _norm(norm, 64, "resnet18")
        self.relu = nn.ReLU()
        blocks: list[nn.Module] = []
        cin = 64
        for i, cout in enumerate((64, 128, 256, 512)):
            for j in range(2):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(_BasicBlock(cin, cout, stride, norm))
                cin = cout
        self.layers = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        out = self.layers(self.relu(self.norm1(self.conv1(x))))
        return self.fc(self.pool(out).flatten(1))


def resnet18(input_shape: Sequence[int], num_classes: int, *, norm: str = "bn") -> ResNet18:
    """ResNet-18 for 32x32 images; ``norm``: ``bn`` (Nguyen et al.; L = 62 parameter tensors),
    ``gn`` (GroupNorm, for per-example clipping; Lin et al. remove BN instead) or ``none``."""
    c, _, _ = _image(input_shape, "resnet18")
    if norm not in NORMS:
        raise ValueError(f"model 'resnet18': norm must be one of {', '.join(NORMS)}, got {norm!r}")
    return ResNet18(c, num_classes, norm)
