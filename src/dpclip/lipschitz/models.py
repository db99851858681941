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

from dpclip._checks import positive_ints
from dpclip.lipschitz.layers import GroupSort
from dpclip.lipschitz.orthogonal import OrthConv2d, OrthLinear
from dpclip.models.activations import make_activation
from dpclip.models.registry import ModelEntry, register_model

__all__ = ["lip_mnist_convnet", "lip_orth_convnet", "lip_small_convnet", "tabular_mlp"]


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


def _pooled_convnet_args(owner: str, input_shape: Sequence[int], channels: Sequence[int],
                         hidden: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The checked ``(input_shape, channels)`` of a convnet with one 2x2 pool per block."""
    shape, chans = tuple(input_shape), tuple(channels)
    if not positive_ints(chans):
        raise ValueError(f"{owner}: channels must be a non-empty sequence of positive integers, "
                         f"got {channels!r}")
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 0:
        raise ValueError(f"{owner}: hidden must be an integer >= 0, got {hidden!r}")
    blocks = len(chans)
    if len(shape) != 3 or shape[1] % (2**blocks) or shape[2] % (2**blocks):
        raise ValueError(
            f"{owner}: input_shape must be (channels, height, width) with height and width "
            f"divisible by 2**{blocks} (one 2x2 pool per block), got {shape}")
    return shape, chans


def lip_small_convnet(
    input_shape: Sequence[int] = (1, 28, 28),
    num_classes: int = 10,
    *,
    channels: tuple[int, ...] = (16, 32),
    hidden: int = 0,
    activation: str = "relu",
    bias: bool = True,
) -> nn.Sequential:
    """A small Lipschitz CNN for 28x28 images (ours, not from S2): per entry of ``channels`` a
    ``Conv c 3x3 SAME -> act -> AvgPool 2x2 (stride 2)`` block, then ``Flatten -> [Dense hidden ->
    act ->] Dense num_classes``. With the defaults (16, 32 channels, no hidden layer) it has 20,490
    parameters for 1x28x28 inputs, 80 times fewer than :func:`lip_mnist_convnet`: Lip-DP-SGD adds
    noise to every coordinate at the scale of a worst-case bound, so the noise norm grows with
    sqrt(#params) while the signal does not. Non-overlapping average pools are 1/2-Lipschitz (Schur
    test), which the bound propagation uses."""
    (c, h, w), chans = _pooled_convnet_args("lip_small_convnet", input_shape, channels, hidden)
    blocks = len(chans)
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    for i, k in enumerate(chans, 1):
        layers[f"conv{i}"] = nn.Conv2d(c, k, 3, padding=1, bias=bias)
        layers[f"act{i}"] = _activation(activation)
        layers[f"pool{i}"] = nn.AvgPool2d(2, 2)
        c, h, w = k, h // 2, w // 2
    layers["flatten"] = nn.Flatten()
    width = c * h * w
    if hidden:
        layers["fc1"] = nn.Linear(width, hidden, bias=bias)
        layers[f"act{blocks + 1}"] = _activation(activation)
        width = hidden
    layers["fc"] = nn.Linear(width, num_classes, bias=bias)
    return nn.Sequential(layers)


POOLS = ("scaled-avg", "avg")


def lip_orth_convnet(
    input_shape: Sequence[int] = (1, 28, 28),
    num_classes: int = 10,
    *,
    channels: tuple[int, ...] = (16, 32),
    hidden: int = 0,
    activation: str = "groupsort",
    pool: str = "scaled-avg",
    bias: bool = False,
    freeze_convs: bool = False,
) -> nn.Sequential:
    """A small orthogonal Lipschitz CNN for 28x28 images (ours, after Bethune et al.'s lip-dp
    recipe: orthogonal layers, GroupSort, norm-preserving pooling, no biases): per entry of
    ``channels`` an ``OrthConv2d c 3x3 SAME -> act -> pool 2x2 (stride 2)`` block, then ``Flatten
    -> [OrthLinear hidden -> act ->] OrthLinear num_classes``. Same shape and parameter count as
    :func:`lip_small_convnet` (20,432 without biases for the defaults).

    ``pool="scaled-avg"`` is ``AvgPool2d(2, 2, divisor_override=2)``, i.e. twice the average
    (the sum over the window divided by 2): exactly 1-Lipschitz (Schur test: row sums 2, column
    sums 1/2) and norm preserving on locally constant images, where ``"avg"`` (the plain average,
    1/2-Lipschitz) halves the signal and the back-propagated gradient at every block.
    ``bias=False`` (default): every layer maps 0 to 0, and the certificate has no bias terms
    (a convolution bias is used at every position and its bound carries ``sqrt(H W)``).
    ``freeze_convs=True`` keeps the convolutions at their random orthogonal initialisation
    (public, data-independent features; ``requires_grad=False``): only the dense layers are
    trained, so only they enter the certificate (their bound is nearly tight, the convolutions'
    is loose by 10-50x: docs/lipschitz.md)."""
    if pool not in POOLS:
        raise ValueError(f"lip_orth_convnet: pool must be one of {POOLS}, got {pool!r}")
    (c, h, w), chans = _pooled_convnet_args("lip_orth_convnet", input_shape, channels, hidden)
    blocks = len(chans)
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    for i, k in enumerate(chans, 1):
        layers[f"conv{i}"] = OrthConv2d(c, k, 3, padding=1, bias=bias)
        layers[f"act{i}"] = _activation(activation)
        layers[f"pool{i}"] = (nn.AvgPool2d(2, 2, divisor_override=2) if pool == "scaled-avg"
                              else nn.AvgPool2d(2, 2))
        c, h, w = k, h // 2, w // 2
    layers["flatten"] = nn.Flatten()
    width = c * h * w
    if hidden:
        layers["fc1"] = OrthLinear(width, hidden, bias=bias)
        layers[f"act{blocks + 1}"] = _activation(activation)
        width = hidden
    layers["fc"] = OrthLinear(width, num_classes, bias=bias)
    if freeze_convs:
        for i in range(1, blocks + 1):
            layers[f"conv{i}"].requires_grad_(False)
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
    adult 1,858, android-permissions 1,426, default-credit 562, dropout 643, german-credit 1,266,
    nursery 661; declared category lists, each + "other"). Activations as
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


_BARCZEWSKI = "Barczewski & Ramon, DP-SGD with weight clipping, arXiv 2310.18001, Table 4"
_LIP_ONLY = "for lip-dp-sgd / fix-lip-dp-sgd"
for _entry in (
    ModelEntry(
        name="lip-convnet",
        description="Lip-DP-SGD MNIST/FMNIST ConvNet (T13, 1,625,866 params), Lipschitz layers "
        "only",
        builder=lip_mnist_convnet,
        paper=_BARCZEWSKI,
        input_notes=f"1x28x28 images (even height/width); {_LIP_ONLY}",
        intended_input_shape=(1, 28, 28),
    ),
    ModelEntry(
        name="lip-small-cnn",
        description="small Lipschitz CNN (Conv16-AvgPool-Conv32-AvgPool-Dense, 20,490 params), "
        "Lipschitz layers only",
        builder=lip_small_convnet,
        paper="ours: a small model for Lip-DP-SGD on 28x28 images (noise grows with sqrt(#params))",
        input_notes=f"1x28x28 images (height/width divisible by 4); {_LIP_ONLY}",
        intended_input_shape=(1, 28, 28),
    ),
    ModelEntry(
        name="lip-orth-cnn",
        description="small orthogonal Lipschitz CNN (OrthConv16-GroupSort-SumPool/2-OrthConv32-"
        "GroupSort-SumPool/2-OrthDense, 20,432 params, no biases)",
        builder=lip_orth_convnet,
        paper="ours, after Bethune et al., DP-SGD without clipping: the Lipschitz neural network "
        "way (2023): orthogonal (Bjorck-projected) layers and GroupSort",
        input_notes=f"1x28x28 images (height/width divisible by 4); {_LIP_ONLY}",
        intended_input_shape=(1, 28, 28),
    ),
    ModelEntry(
        name="tabular-mlp",
        description="Lip-DP-SGD 2-layer tabular MLP (Dense hidden=16 -> ReLU -> Dense)",
        builder=tabular_mlp,
        paper=_BARCZEWSKI,
        input_notes="feature vectors (breast-cancer, adult, german-credit, ...)",
        intended_input_shape=(30,),
        intended_num_classes=2,
    ),
):
    register_model(_entry)  # the model registry lists the Lipschitz networks under their names
del _entry
