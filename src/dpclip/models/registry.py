"""Registry of models: typed entries; names (strings) only at the CLI/config boundary."""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Union

from torch import nn

from dpclip._checks import positive_ints
from dpclip.models.architectures import (
    lin_b1,
    lin_b3,
    lin_b4,
    logreg,
    mlp,
    papernot_cifar_cnn,
    papernot_cnn,
    transformer,
)
from dpclip.models.nguyen import bn_lenet5, lenet5, nguyen_convnet, resnet18

__all__ = ["MODELS", "ModelBuilder", "ModelEntry", "build_model", "list_models", "register_model"]

#: ``builder(input_shape, num_classes, **options) -> nn.Module``; options are keyword-only.
ModelBuilder = Callable[..., nn.Module]


@dataclass(frozen=True)
class ModelEntry:
    """A registered model.

    Attributes:
        name: registry key, as written in configs and on the command line.
        description: one line for listings.
        builder: ``builder(input_shape, num_classes, **options) -> nn.Module``.
        paper: the paper the architecture comes from.
        input_notes: which inputs the architecture is meant for.
        intended_input_shape: the input shape of the paper's setting (used by tests and docs).
        intended_num_classes: the number of classes of the paper's setting.
    """

    name: str
    description: str
    builder: ModelBuilder
    paper: str
    input_notes: str
    intended_input_shape: tuple[int, ...]
    intended_num_classes: int = 10

    def options(self) -> dict[str, Any]:
        """The builder's options (keyword-only parameters) with their defaults."""
        return {
            p.name: p.default
            for p in inspect.signature(self.builder).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        }


MODELS: dict[str, ModelEntry] = {}


def register_model(entry: ModelEntry) -> ModelEntry:
    """Add ``entry`` to :data:`MODELS`; a name can be registered once."""
    if entry.name in MODELS:
        raise ValueError(f"model {entry.name!r} is already registered")
    MODELS[entry.name] = entry
    return entry


def list_models() -> list[ModelEntry]:
    """All registered models, sorted by name."""
    return [MODELS[k] for k in sorted(MODELS)]


def _coerce(value: Any, hint: Any, option: str, model: str) -> Any:
    """Convert a CLI/config value (string, or list for tuples) to the option's declared type."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
            return None
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else Any
        origin = typing.get_origin(hint)
    if origin is tuple:
        (item,) = typing.get_args(hint)[:1] or (Any,)
        if isinstance(value, str):
            value = [p for p in value.strip().strip("()[]").split(",") if p.strip()]
        if isinstance(value, (list, tuple)):
            value = tuple(_coerce(v, item, option, model) for v in value)
        else:
            raise ValueError(
                f"model {model!r}: option {option} must be a tuple, got {value!r} "
                f"(e.g. {option}=(64, 64) or, on the command line, {option}=64,64)"
            )
        return value
    if isinstance(value, str) and hint in (int, float):
        try:
            return hint(value.strip())
        except ValueError:
            raise ValueError(
                f"model {model!r}: option {option}={value!r} is not a valid {hint.__name__}"
            ) from None
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str) and not isinstance(value, hint):
        raise ValueError(f"model {model!r}: option {option}={value!r} must be a {hint.__name__}")
    return value


def build_model(
    name: str, input_shape: Sequence[int], num_classes: int, **options: Any
) -> nn.Module:
    """Build the registered model ``name`` for inputs of ``input_shape`` and ``num_classes``.

    Parameters are initialised from PyTorch's current global generator: call
    ``torch.manual_seed(seed)`` first for a reproducible model.

    Args:
        name: a key of :data:`MODELS` (see :func:`list_models`).
        input_shape: shape of one example, e.g. ``(1, 28, 28)``.
        num_classes: number of output logits (>= 2).
        **options: model-specific options (``MODELS[name].options()``); string values from the
            command line are converted to the declared types.

    Raises:
        ValueError: unknown ``name`` (lists the valid names), unknown option (lists the valid
            options), invalid option value, or an input shape the architecture cannot take.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(sorted(MODELS))}")
    entry = MODELS[name]
    shape = tuple(input_shape)
    if not positive_ints(shape):
        raise ValueError(
            f"input_shape must be a non-empty tuple of positive integers (one example, without "
            f"the batch dimension), got {input_shape!r}"
        )
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
    valid = entry.options()
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"model {name!r} has no option(s) {', '.join(unknown)}; valid options: "
            f"{', '.join(sorted(valid)) or '(none)'}"
        )
    hints = typing.get_type_hints(entry.builder)
    kwargs = {k: _coerce(v, hints.get(k, Any), k, name) for k, v in options.items()}
    return entry.builder(shape, num_classes, **kwargs)


_BARCZEWSKI = "Barczewski & Ramon, DP-SGD with weight clipping, arXiv 2310.18001, Table 4"


def _lip_convnet(
    input_shape: Sequence[int], num_classes: int, *, activation: str = "relu", bias: bool = True
) -> nn.Module:
    from dpclip.lipschitz.models import lip_mnist_convnet

    return lip_mnist_convnet(input_shape, num_classes, activation=activation, bias=bias)


def _lip_small_cnn(
    input_shape: Sequence[int],
    num_classes: int,
    *,
    channels: tuple[int, ...] = (16, 32),
    hidden: int = 0,
    activation: str = "relu",
    bias: bool = True,
) -> nn.Module:
    from dpclip.lipschitz.models import lip_small_convnet

    return lip_small_convnet(input_shape, num_classes, channels=channels, hidden=hidden,
                             activation=activation, bias=bias)


def _lip_orth_cnn(
    input_shape: Sequence[int],
    num_classes: int,
    *,
    channels: tuple[int, ...] = (16, 32),
    hidden: int = 0,
    activation: str = "groupsort",
    pool: str = "scaled-avg",
    bias: bool = False,
    freeze_convs: bool = False,
) -> nn.Module:
    from dpclip.lipschitz.models import lip_orth_convnet

    return lip_orth_convnet(input_shape, num_classes, channels=channels, hidden=hidden,
                            activation=activation, pool=pool, bias=bias,
                            freeze_convs=freeze_convs)


def _tabular_mlp(
    input_shape: Sequence[int],
    num_classes: int,
    *,
    hidden: int = 16,
    activation: str = "relu",
    bias: bool = True,
) -> nn.Module:
    from dpclip.lipschitz.models import tabular_mlp

    return tabular_mlp(input_shape, num_classes, hidden=hidden, activation=activation, bias=bias)


_NGUYEN = (
    "Nguyen, Nguyen & van Dijk, Batch clipping and adaptive layerwise clipping for differential "
    "private stochastic gradient descent, 2023"
)
_PAPERNOT = (
    "Papernot, Thakurta, Song, Chien & Erlingsson, Tempered sigmoid activations for deep "
    "learning with differential privacy, AAAI 2021"
)
_LIN = (
    "Lin, Yan, Kou, Huang, Peng, Zhang & Dong, Understanding adaptive gradient clipping in "
    "DP-SGD, empirically, Int. J. Intell. Syst. 2022, Appendix B"
)

for _entry in (
    ModelEntry(
        name="papernot-cnn",
        description="A1: Papernot et al. MNIST/FMNIST CNN (26,010 params), tanh",
        builder=papernot_cnn,
        paper=_PAPERNOT,
        input_notes="1x28x28 images (MNIST, Fashion-MNIST); other square sizes adapt the flatten",
        intended_input_shape=(1, 28, 28),
    ),
    ModelEntry(
        name="papernot-cifar-cnn",
        description="A2: Papernot et al. CIFAR-10 CNN (= Lin B2), tanh",
        builder=papernot_cifar_cnn,
        paper=_PAPERNOT,
        input_notes="3x32x32 images (CIFAR-10/100)",
        intended_input_shape=(3, 32, 32),
    ),
    ModelEntry(
        name="lin-b2",
        description="Lin et al. Table B2 CIFAR CNN (= A2, papernot-cifar-cnn), tanh",
        builder=papernot_cifar_cnn,
        paper=_LIN + " Table B2",
        input_notes="3x32x32 images (CIFAR-10/100)",
        intended_input_shape=(3, 32, 32),
    ),
    ModelEntry(
        name="lin-b1",
        description="A3: Lin et al. Table B1 as printed (last layer = num_classes), tanh",
        builder=lin_b1,
        paper=_LIN + " Table B1",
        input_notes="1x28x28 images (MNIST, Fashion-MNIST)",
        intended_input_shape=(1, 28, 28),
    ),
    ModelEntry(
        name="lin-b3",
        description="A4: Lin et al. Table B3 smaller MNIST/FMNIST CNN (avg-pool), tanh",
        builder=lin_b3,
        paper=_LIN + " Table B3",
        input_notes="1x28x28 images (MNIST, Fashion-MNIST)",
        intended_input_shape=(1, 28, 28),
    ),
    ModelEntry(
        name="lin-b4",
        description="A5: Lin et al. Table B4 smaller CIFAR CNN, tanh",
        builder=lin_b4,
        paper=_LIN + " Table B4",
        input_notes="3x32x32 images (CIFAR-10/100)",
        intended_input_shape=(3, 32, 32),
    ),
    ModelEntry(
        name="mlp",
        description="fully connected net on flattened inputs, hidden=(64, 64), tanh",
        builder=mlp,
        paper="tabular baseline (e.g. Barczewski & Ramon, DP-SGD with weight clipping, Table 4)",
        input_notes="any input shape (flattened); e.g. 30 features of breast-cancer",
        intended_input_shape=(30,),
        intended_num_classes=2,
    ),
    ModelEntry(
        name="lip-convnet",
        description="Lip-DP-SGD MNIST/FMNIST ConvNet (T13, 1,625,866 params), Lipschitz layers only",
        builder=_lip_convnet,
        paper=_BARCZEWSKI,
        input_notes="1x28x28 images (even height/width); for lip-dp-sgd / fix-lip-dp-sgd",
        intended_input_shape=(1, 28, 28),
    ),
    ModelEntry(
        name="lip-small-cnn",
        description="small Lipschitz CNN (Conv16-AvgPool-Conv32-AvgPool-Dense, 20,490 params), "
        "Lipschitz layers only",
        builder=_lip_small_cnn,
        paper="ours: a small model for Lip-DP-SGD on 28x28 images (noise grows with sqrt(#params))",
        input_notes="1x28x28 images (height/width divisible by 4); for lip-dp-sgd / fix-lip-dp-sgd",
        intended_input_shape=(1, 28, 28),
    ),
    ModelEntry(
        name="lip-orth-cnn",
        description="small orthogonal Lipschitz CNN (OrthConv16-GroupSort-SumPool/2-OrthConv32-"
        "GroupSort-SumPool/2-OrthDense, 20,432 params, no biases)",
        builder=_lip_orth_cnn,
        paper="ours, after Bethune et al., DP-SGD without clipping: the Lipschitz neural network "
        "way (2023): orthogonal (Bjorck-projected) layers and GroupSort",
        input_notes="1x28x28 images (height/width divisible by 4); for lip-dp-sgd / fix-lip-dp-sgd",
        intended_input_shape=(1, 28, 28),
    ),
    ModelEntry(
        name="tabular-mlp",
        description="Lip-DP-SGD 2-layer tabular MLP (Dense hidden=16 -> ReLU -> Dense)",
        builder=_tabular_mlp,
        paper=_BARCZEWSKI,
        input_notes="feature vectors (breast-cancer, adult, german-credit, ...)",
        intended_input_shape=(30,),
        intended_num_classes=2,
    ),
    ModelEntry(
        name="transformer",
        description="small transformer encoder for text classification (token ids in, 2 layers, "
        "d_model 128)",
        builder=transformer,
        paper="benchmark model for the per-example engines (pre-LN encoder, Vaswani et al. 2017; "
        "Xiong et al. 2020)",
        input_notes="token-id sequences (B, seq_len) of a LongTensor; input_shape=(seq_len,)",
        intended_input_shape=(64,),
        intended_num_classes=2,
    ),
    ModelEntry(
        name="lenet5",
        description="LeNet-5 without BatchNorm (tanh, avg-pool; L = 5 clipping blocks)",
        builder=lenet5,
        paper=_NGUYEN,
        input_notes="1x28x28 (padded to 32x32 by conv1) or 32x32 images",
        intended_input_shape=(1, 28, 28),
    ),
    ModelEntry(
        name="bn-lenet5",
        description="BN-LeNet-5: LeNet-5 with BatchNorm after each conv (L = 8); batch clipping only",
        builder=bn_lenet5,
        paper=_NGUYEN,
        input_notes="1x28x28 (padded to 32x32 by conv1) or 32x32 images; --param unit=bc|gbc",
        intended_input_shape=(1, 28, 28),
    ),
    ModelEntry(
        name="nguyen-convnet",
        description="Nguyen et al. CIFAR convnet: 4 x (Conv-ReLU-BN-AvgPool) + FC; norm=bn|gn|none",
        builder=nguyen_convnet,
        paper=_NGUYEN,
        input_notes="3x32x32 images; norm=bn needs --param unit=bc|gbc",
        intended_input_shape=(3, 32, 32),
    ),
    ModelEntry(
        name="resnet18",
        description="CIFAR ResNet-18 (11.2M params); norm=bn (batch clipping only) | gn | none",
        builder=resnet18,
        paper=_NGUYEN + "; He et al., CVPR 2016",
        input_notes="3x32x32 images",
        intended_input_shape=(3, 32, 32),
    ),
    ModelEntry(
        name="logreg",
        description="multinomial logistic regression (one Linear on flattened inputs)",
        builder=logreg,
        paper="convex baseline (Abadi et al., CCS 2016; Chaudhuri et al., JMLR 2011)",
        input_notes="any input shape (flattened)",
        intended_input_shape=(20,),
        intended_num_classes=4,
    ),
):
    register_model(_entry)
del _entry
