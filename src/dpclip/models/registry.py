"""Registry of models: typed entries; names (strings) only at the CLI/config boundary."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from dpclip._checks import positive_ints
from dpclip.registry import OptionsEntry, Registry
from dpclip.models import architectures as arch
from dpclip.models import nguyen

__all__ = ["MODELS", "ModelBuilder", "ModelEntry", "build_model", "list_models", "register_model"]

#: ``builder(input_shape, num_classes, **options) -> nn.Module``; options are keyword-only.
ModelBuilder = Callable[..., nn.Module]


@dataclass(frozen=True)
class ModelEntry(OptionsEntry):
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

    kind: ClassVar[str] = "model"

    def factory(self) -> ModelBuilder:
        return self.builder


#: Registered models by name (``dpclip.lipschitz`` registers the Lipschitz networks).
MODELS: Registry[ModelEntry] = Registry("model")


def register_model(entry: ModelEntry) -> ModelEntry:
    """Add ``entry`` to :data:`MODELS`; a name can be registered once."""
    return MODELS.register(entry)


def list_models() -> list[ModelEntry]:
    """All registered models, sorted by name."""
    return MODELS.entries()


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
    entry = MODELS.lookup(name)
    shape = tuple(input_shape)
    if not positive_ints(shape):
        raise ValueError(
            f"input_shape must be a non-empty tuple of positive integers (one example, without "
            f"the batch dimension), got {input_shape!r}"
        )
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
    kwargs = entry.coerce_options(options)
    return entry.builder(shape, num_classes, **kwargs)


#: The input description shared by the 28x28 grey-image and 32x32 colour-image models.
_MNIST_IMAGES: dict[str, Any] = {"input_notes": "1x28x28 images (MNIST, Fashion-MNIST)",
                                 "intended_input_shape": (1, 28, 28)}
_CIFAR_IMAGES: dict[str, Any] = {"input_notes": "3x32x32 images (CIFAR-10/100)",
                                 "intended_input_shape": (3, 32, 32)}
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
        builder=arch.papernot_cnn,
        paper=_PAPERNOT,
        input_notes="1x28x28 images (MNIST, Fashion-MNIST); other square sizes adapt the flatten",
        intended_input_shape=(1, 28, 28),
    ),
    ModelEntry(
        name="papernot-cifar-cnn",
        description="A2: Papernot et al. CIFAR-10 CNN (= Lin B2), tanh",
        builder=arch.papernot_cifar_cnn,
        paper=_PAPERNOT,
        **_CIFAR_IMAGES,
    ),
    ModelEntry(
        name="lin-b2",
        description="Lin et al. Table B2 CIFAR CNN (= A2, papernot-cifar-cnn), tanh",
        builder=arch.papernot_cifar_cnn,
        paper=_LIN + " Table B2",
        **_CIFAR_IMAGES,
    ),
    ModelEntry(
        name="lin-b1",
        description="A3: Lin et al. Table B1 as printed (last layer = num_classes), tanh",
        builder=arch.lin_b1,
        paper=_LIN + " Table B1",
        **_MNIST_IMAGES,
    ),
    ModelEntry(
        name="lin-b3",
        description="A4: Lin et al. Table B3 smaller MNIST/FMNIST CNN (avg-pool), tanh",
        builder=arch.lin_b3,
        paper=_LIN + " Table B3",
        **_MNIST_IMAGES,
    ),
    ModelEntry(
        name="lin-b4",
        description="A5: Lin et al. Table B4 smaller CIFAR CNN, tanh",
        builder=arch.lin_b4,
        paper=_LIN + " Table B4",
        **_CIFAR_IMAGES,
    ),
    ModelEntry(
        name="mlp",
        description="fully connected net on flattened inputs, hidden=(64, 64), tanh",
        builder=arch.mlp,
        paper="tabular baseline (e.g. Barczewski & Ramon, DP-SGD with weight clipping, Table 4)",
        input_notes="any input shape (flattened); e.g. 30 features of breast-cancer",
        intended_input_shape=(30,),
        intended_num_classes=2,
    ),
    ModelEntry(
        name="transformer",
        description="small transformer encoder for text classification (token ids in, 2 layers, "
        "d_model 128)",
        builder=arch.transformer,
        paper="benchmark model for the per-example engines (pre-LN encoder, Vaswani et al. 2017; "
        "Xiong et al. 2020)",
        input_notes="token-id sequences (B, seq_len) of a LongTensor; input_shape=(seq_len,)",
        intended_input_shape=(64,),
        intended_num_classes=2,
    ),
    ModelEntry(
        name="lenet5",
        description="LeNet-5 without BatchNorm (tanh, avg-pool; L = 5 clipping blocks)",
        builder=nguyen.lenet5,
        paper=_NGUYEN,
        input_notes="1x28x28 (padded to 32x32 by conv1) or 32x32 images",
        intended_input_shape=(1, 28, 28),
    ),
    ModelEntry(
        name="bn-lenet5",
        description="BN-LeNet-5: LeNet-5 with BatchNorm after each conv (L = 8); batch clipping only",
        builder=nguyen.bn_lenet5,
        paper=_NGUYEN,
        input_notes="1x28x28 (padded to 32x32 by conv1) or 32x32 images; --param unit=bc|gbc",
        intended_input_shape=(1, 28, 28),
    ),
    ModelEntry(
        name="nguyen-convnet",
        description="Nguyen et al. CIFAR convnet: 4 x (Conv-ReLU-BN-AvgPool) + FC; norm=bn|gn|none",
        builder=nguyen.nguyen_convnet,
        paper=_NGUYEN,
        input_notes="3x32x32 images; norm=bn needs --param unit=bc|gbc",
        intended_input_shape=(3, 32, 32),
    ),
    ModelEntry(
        name="resnet18",
        description="CIFAR ResNet-18 (11.2M params); norm=bn (batch clipping only) | gn | none",
        builder=nguyen.resnet18,
        paper=_NGUYEN + "; He et al., CVPR 2016",
        input_notes="3x32x32 images",
        intended_input_shape=(3, 32, 32),
    ),
    ModelEntry(
        name="scatter-linear",
        description="Tramer & Boneh ScatterNet+linear: GroupNorm(27) + Linear on scattering "
        "coefficients (dataset option features=scattering)",
        builder=arch.scatter_linear,
        paper="Tramer & Boneh, Differentially private learning needs better features (or much "
        "more data), ICLR 2021",
        input_notes="scattering coefficients (C, H, W), e.g. 81x7x7 from 28x28 images "
        "(--dataset-option features=scattering)",
        intended_input_shape=(81, 7, 7),
    ),
    ModelEntry(
        name="logreg",
        description="multinomial logistic regression (one Linear on flattened inputs)",
        builder=arch.logreg,
        paper="convex baseline (Abadi et al., CCS 2016; Chaudhuri et al., JMLR 2011)",
        input_notes="any input shape (flattened)",
        intended_input_shape=(20,),
        intended_num_classes=4,
    ),
):
    register_model(_entry)
del _entry
