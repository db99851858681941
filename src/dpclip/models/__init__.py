"""Models by registry name: the papers' networks and simple baselines, without BatchNorm.

``build_model(name, input_shape, num_classes, **options)`` returns an ``nn.Module``
(an ``nn.Sequential`` with named children). Registered names: ``papernot-cnn`` (A1),
``papernot-cifar-cnn`` (A2), ``lin-b1`` (A3), ``lin-b3`` (A4), ``lin-b4`` (A5), ``mlp``,
``logreg``; see algorithms.md M2. :class:`TemperedSigmoid` is Papernot et al.'s activation.
"""

from dpclip.models.activations import (
    ACTIVATIONS,
    ActivationEntry,
    TemperedSigmoid,
    make_activation,
)
from dpclip.models.architectures import (
    lin_b1,
    lin_b3,
    lin_b4,
    logreg,
    mlp,
    papernot_cifar_cnn,
    papernot_cnn,
)
from dpclip.models.registry import MODELS, ModelEntry, build_model, list_models, register_model

__all__ = [
    "ACTIVATIONS",
    "MODELS",
    "ActivationEntry",
    "ModelEntry",
    "TemperedSigmoid",
    "build_model",
    "lin_b1",
    "lin_b3",
    "lin_b4",
    "list_models",
    "logreg",
    "make_activation",
    "mlp",
    "papernot_cifar_cnn",
    "papernot_cnn",
    "register_model",
]
