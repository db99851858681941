"""Lipschitz sensitivity for Lip-DP-SGD: certified per-example gradient bounds from the weights.

Bound-based private training (algorithms.md M15, Barczewski & Ramon; M16, Bethune et al.) replaces
per-example gradient clipping by a sensitivity certified from the weights: with inputs clipped to
``||x|| <= X_0``, :func:`lipschitz_bounds` propagates input-norm bounds forward and Lipschitz
constants backward and returns, per parametrised layer, a bound on every example's gradient norm.
Operator norms are always proven upper bounds (:mod:`dpclip.lipschitz.norms`); an unsupported layer
is an :class:`UnsupportedLayerError`. See ``docs/lipschitz.md`` for every constant and its proof.

Example::

    from dpclip.lipschitz import TemperedCrossEntropy, lipschitz_bounds
    bounds = lipschitz_bounds(model, TemperedCrossEntropy(1.0), input_shape=(1, 28, 28),
                              input_norm_bound=1.0)
    bounds.grad_bound                  # global per-example gradient-norm bound
    bounds.layer("fc1").grad_bound     # per layer; .scaled_grad_bound is reading R2's Delta_k
"""

from dpclip.lipschitz.bounds import (
    SUPPORTED_LAYERS,
    SUPPORTED_LOSSES,
    LayerBound,
    ModuleBound,
    NetworkBound,
    NodeBound,
    UnsupportedLayerError,
    lipschitz_bounds,
    module_lipschitz,
)
from dpclip.lipschitz.layers import GroupSort, LipGroupNorm, LipResidual
from dpclip.lipschitz.losses import (
    CosineSimilarityLoss,
    LipschitzLoss,
    MulticlassHingeLoss,
    TemperedCrossEntropy,
)
from dpclip.lipschitz.models import (
    lip_mnist_convnet,
    lip_orth_convnet,
    lip_small_convnet,
    tabular_mlp,
)
from dpclip.lipschitz.orthogonal import OrthConv2d, OrthLinear, orthogonalize
from dpclip.lipschitz import strategy  # noqa: F401 - registers lip-dp-sgd and fix-lip-dp-sgd
from dpclip.lipschitz import norms as _norms
from dpclip.lipschitz.norms import (
    NUMERICAL_SLACK,
    ConvNormMethod,
    NormUnderestimateError,
    OperatorNormBound,
    PowerIterationResult,
    check_upper_bound,
    conv2d_fft_bound,
    conv2d_operator_norm_bound,
    conv2d_patch_multiplicity,
    conv2d_reshape_bounds,
    frobenius_norm,
    gram_iteration_bound,
    linear_operator_norm_bound,
    power_iteration,
    robust_norm,
    spectral_norm,
)

__all__ = sorted([
    "SUPPORTED_LAYERS",
    "SUPPORTED_LOSSES",
    "CosineSimilarityLoss",
    "GroupSort",
    "LayerBound",
    "LipGroupNorm",
    "LipResidual",
    "LipschitzLoss",
    "ModuleBound",
    "MulticlassHingeLoss",
    "NetworkBound",
    "NodeBound",
    "OrthConv2d",
    "OrthLinear",
    "TemperedCrossEntropy",
    "UnsupportedLayerError",
    "lip_mnist_convnet",
    "lip_orth_convnet",
    "lip_small_convnet",
    "lipschitz_bounds",
    "module_lipschitz",
    "orthogonalize",
    "tabular_mlp",
    *_norms.__all__,  # the operator-norm bounds, re-exported whole
])
