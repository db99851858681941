"""Lipschitz bound propagation: certified per-example gradient-norm bounds from the weights.

Lip-DP-SGD (Barczewski & Ramon, algorithms.md M15, reading R2) adds Gaussian noise to the plain
batched gradient with a sensitivity certified from the (already public) weights instead of clipping
per-example gradients. For a network ``f = f_K o ... o f_1`` followed by a loss ``l``, an input
clipped to ``||x_0|| <= X_0`` and a parametrised layer ``k`` (``y_k = W_k x_{k-1} + b_k``):

* forward: ``||x_k|| <= X_k`` with ``X_k = ||f_k(0)|| + rho_k X_{k-1}`` (a bias makes
  ``f_k(0) != 0``; bounded activations and normalisations cap it further);
* backward: ``||d l / d y_k|| <= G_k = L_loss * prod_{j > k} rho_j`` where ``rho_j`` bounds the
  operator norm of layer ``j``'s (autograd) Jacobian everywhere;
* per example: ``||grad_{W_k} l|| <= lambda_k X_{k-1} G_k`` (``lambda = 1`` dense,
  ``sqrt(patch multiplicity)`` conv) and ``||grad_{b_k} l|| <= sqrt(P_k) G_k`` (``P_k`` output
  positions sharing the bias).

:func:`lipschitz_bounds` walks an ``nn.Sequential`` (nested, with :class:`LipResidual` blocks) and
returns those numbers per layer (:class:`LayerBound`) and for the whole network
(:class:`NetworkBound`). :func:`module_lipschitz` runs only the forward part on any supported
module.
Every constant is an upper bound (operator norms from :mod:`dpclip.lipschitz.norms`, proofs in
``docs/lipschitz.md``); an unsupported layer is an :class:`UnsupportedLayerError`, never a guess.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from dpclip._ident import ident
from dpclip.lipschitz.layers import GroupSort, LipGroupNorm, LipResidual
from dpclip.lipschitz.orthogonal import OrthConv2d, OrthLinear
from dpclip.lipschitz.losses import (
    CosineSimilarityLoss,
    LipschitzLoss,
    MulticlassHingeLoss,
    TemperedCrossEntropy,
)
from dpclip.lipschitz.norms import (
    NUMERICAL_SLACK,
    ConvNormMethod,
    OperatorNormBound,
    conv2d_operator_norm_bound,
    conv2d_patch_multiplicity,
    linear_operator_norm_bound,
    robust_norm,
)
from dpclip.models.activations import TemperedSigmoid

__all__ = [
    "SUPPORTED_LAYERS",
    "SUPPORTED_LOSSES",
    "LayerBound",
    "ModuleBound",
    "NetworkBound",
    "NodeBound",
    "UnsupportedLayerError",
    "lipschitz_bounds",
    "module_lipschitz",
]


class UnsupportedLayerError(ValueError):
    """A layer (or loss) without a proven Lipschitz rule; the message names it and the fix."""


@dataclass(frozen=True)
class NodeBound:
    """One layer of the forward pass: its Lipschitz constant and the norm bounds around it.

    ``lipschitz`` bounds both the Lipschitz constant of the layer and the operator norm of the
    Jacobian autograd uses (also at kinks); ``input_norm_bound`` / ``output_norm_bound`` bound the
    per-example ``l2`` norm of its input / output over every network input with ``||x_0|| <= X_0``.
    """

    name: str
    kind: str
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    lipschitz: float
    method: str
    input_norm_bound: float
    output_norm_bound: float


@dataclass(frozen=True)
class ModuleBound:
    """Forward analysis of a module: ``||m(x)|| <= output_norm_bound`` whenever
    ``||x|| <= input_norm_bound``, ``lipschitz`` its Lipschitz constant, ``trace`` every layer."""

    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    input_norm_bound: float
    output_norm_bound: float
    lipschitz: float
    trace: tuple[NodeBound, ...]


@dataclass(frozen=True)
class LayerBound:
    """Certified per-example gradient bounds of one parametrised layer (``Linear`` / ``Conv2d``).

    * ``input_norm_bound`` ``X_{k-1}``: ``||x_{k-1}|| <= X_{k-1}`` for every input
      ``||x_0|| <= X_0``.
    * ``output_grad_bound`` ``G_k``: Lipschitz constant of (rest of the network + loss) w.r.t. the
      layer's output, hence ``||d l / d y_k|| <= G_k``.
    * ``operator_norm``: proven upper bound of the layer's input-Lipschitz constant (``rho_k``,
      method ``operator_norm_method``); ``weight_factor`` ``lambda_k``.
    * ``weight_grad_bound = lambda_k X_{k-1} G_k``; ``bias_grad_bound = sqrt(P_k) G_k`` (``None``
      without bias); ``parameter_grad_bounds`` maps the TRAINABLE parameters' names (as in
      ``model.named_parameters()``, i.e. the FIRST name of a parameter tied to several modules) to
      their bounds; ``grad_bound`` is their root sum of squares.
    * ``weight_name`` / ``bias_name``: those names of this layer's weight / bias (``None``:
      no bias), trainable or not.

    Privacy: ``||grad_{theta_k} l(x_i)|| <= grad_bound`` for every example with ``||x_i|| <= X_0``
    and every label, where ``grad_{theta_k}`` is this layer's OWN contribution to the gradient
    (its use of the parameters). For untied parameters that is the whole gradient. A parameter
    tied to several layers receives the plain SUM of its per-use contributions, so its bound is
    the SUM of its per-use bounds (triangle inequality): use
    :attr:`NetworkBound.parameter_grad_bounds`, never a root sum of squares over layers.
    """

    name: str
    kind: str
    input_norm_bound: float
    output_grad_bound: float
    operator_norm: float
    operator_norm_method: str
    weight_factor: float
    weight_grad_bound: float
    bias_grad_bound: float | None
    parameter_grad_bounds: dict[str, float] = field(default_factory=dict)
    weight_name: str | None = None
    bias_name: str | None = None

    @property
    def grad_bound(self) -> float:
        """Bound on the per-example norm of this layer's own contribution to the gradient of its
        trainable parameters (the whole gradient when no parameter is tied to another layer)."""
        return math.sqrt(sum(b * b for b in self.parameter_grad_bounds.values()))

    @property
    def scaled_grad_bound(self) -> float:
        """Reading R2's ``Delta_k``: the bound on ``||grad_{theta_k} l|| / X_{k-1}`` (the layer's
        gradient divided by the public input-norm bound). Needs ``input_norm_bound > 0``."""
        if self.input_norm_bound <= 0.0:
            raise ValueError(
                f"layer {self.name!r}: input_norm_bound is 0 (its input is always zero), so the "
                "R2 scaling by 1/X_{k-1} is undefined; use grad_bound (unscaled) for this layer"
            )
        return self.grad_bound / self.input_norm_bound


@dataclass(frozen=True)
class NetworkBound:
    """Certified per-example gradient bounds of a whole network + loss (:func:`lipschitz_bounds`).

    ``layers``: one :class:`LayerBound` per parametrised layer in forward order; ``trace``: every
    layer's :class:`NodeBound`; ``lipschitz``: the network's (input -> logits) Lipschitz bound;
    ``loss_lipschitz``: the loss's bound w.r.t. the logits; ``output_norm_bound``: bound on the
    logits' norm.

    Privacy: for every example with ``||x|| <= input_norm_bound`` and every label,
    ``||grad_theta l(x, y)|| <= grad_bound`` (all trainable parameters), and per parameter
    ``<= parameter_grad_bounds[name]``: the l2 sensitivity of the summed batch gradient under
    add/remove adjacency (``2 x`` for replace-one). A parameter tied to several layers (one
    ``nn.Parameter`` held by two modules) gets the SUM of its per-use bounds, since its gradient is
    the sum of the per-use contributions. Valid for the weights at analysis time only: re-run
    after every update (the weights are public after each private step).
    """

    input_norm_bound: float
    output_norm_bound: float
    lipschitz: float
    loss_lipschitz: float
    layers: tuple[LayerBound, ...]
    trace: tuple[NodeBound, ...]

    @property
    def parameter_uses(self) -> dict[str, tuple[LayerBound, ...]]:
        """Trainable parameter name -> the layers that use it (more than one: a tied parameter)."""
        out: dict[str, list[LayerBound]] = {}
        for layer in self.layers:
            for name in layer.parameter_grad_bounds:
                out.setdefault(name, []).append(layer)
        return {name: tuple(uses) for name, uses in out.items()}

    @property
    def parameter_grad_bounds(self) -> dict[str, float]:
        """Trainable parameter name -> bound on its per-example gradient norm: the SUM of its
        per-use bounds over the layers that use it (triangle inequality; one term if untied)."""
        out: dict[str, float] = {}
        for layer in self.layers:
            for name, b in layer.parameter_grad_bounds.items():
                out[name] = out.get(name, 0.0) + b
        return out

    @property
    def parameter_scales(self) -> dict[str, float]:
        """Reading R2's public multiplier of each trainable parameter's summed gradient:
        ``1 / X_{k-1}`` of its layer; for a parameter tied to several layers ``1 / max_k X_{k-1}``
        over its uses (one multiplier per parameter, since its gradient is one sum). ``1.0`` when
        that bound is 0 (the parameter's weight gradient is then always zero)."""
        out: dict[str, float] = {}
        for name, uses in self.parameter_uses.items():
            x_max = max(layer.input_norm_bound for layer in uses)
            out[name] = 1.0 / x_max if x_max > 0.0 else 1.0
        return out

    @property
    def grad_bound(self) -> float:
        """``sqrt(sum_p parameter_grad_bounds[p]^2)``: the global per-example gradient-norm bound
        (``sqrt(sum_k grad_bound_k^2)`` when no parameter is tied)."""
        return math.sqrt(sum(b * b for b in self.parameter_grad_bounds.values()))

    @property
    def scaled_grad_bound(self) -> float:
        """Reading R2's global sensitivity ``Delta`` of the gradient whose parameters are
        multiplied by :attr:`parameter_scales` (``sqrt(sum_k Delta_k^2)``, ``Delta_k =
        grad_bound_k / X_{k-1}``, when no parameter is tied). Needs every ``X_{k-1} > 0``."""
        for layer in self.layers:
            layer.scaled_grad_bound  # noqa: B018  (raises for X_{k-1} = 0, naming the layer)
        scales = self.parameter_scales
        return math.sqrt(
            sum((scales[p] * b) ** 2 for p, b in self.parameter_grad_bounds.items())
        )

    @property
    def tied_blocks(self) -> tuple[tuple[str, ...], ...]:
        """The parametrised layers grouped by shared parameters (connected components: two layers
        are in one block when they use a common trainable parameter), in forward order. Without
        tied parameters every block is one layer. Per-layer noise adds one noise draw per block:
        the blocks partition the trainable parameters, which the per-block Gaussian events need."""
        names = [layer.name for layer in self.layers]
        parent = {n: n for n in names}

        def find(n: str) -> str:
            while parent[n] != n:
                parent[n] = parent[parent[n]]
                n = parent[n]
            return n

        for uses in self.parameter_uses.values():
            root = find(uses[0].name)
            for layer in uses[1:]:
                other = find(layer.name)
                if other != root:
                    parent[other] = root
        blocks: dict[str, list[str]] = {}
        for n in names:
            blocks.setdefault(find(n), []).append(n)
        return tuple(tuple(b) for b in blocks.values())

    def layer(self, name: str) -> LayerBound:
        """The :class:`LayerBound` of the layer called ``name``."""
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(
            f"no parametrised layer named {name!r}; layers: {[lb.name for lb in self.layers]}"
        )


# ------------------------------------------------------------------------------ internal tree


@dataclass(frozen=True)
class _Params:
    weight_name: str
    bias_name: str | None
    weight_trainable: bool
    bias_trainable: bool
    weight_factor: float
    bias_positions: int
    operator_norm_method: str


@dataclass(frozen=True)
class _Node:
    bound: NodeBound
    params: _Params | None = None
    children: tuple[_Node, ...] | None = None  # residual blocks


@dataclass(frozen=True)
class _Ctx:
    conv_norm: ConvNormMethod
    seen: set[int]
    #: serve operator norms from the cache when still valid (else compute them fresh, and record)
    reuse_norms: bool = False


@dataclass(frozen=True)
class _Leaf:
    """What a rule returns: the layer's Lipschitz constant and output-norm bound."""

    lipschitz: float
    output_norm_bound: float
    method: str
    params: _Params | None = None


_Rule = Callable[[nn.Module, str, tuple[int, ...], tuple[int, ...], float, _Ctx], _Leaf]


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _display(name: str) -> str:
    return name if name else "<model>"


def _pname(name: str, attr: str) -> str:
    return f"{name}.{attr}" if name else attr


def _tensor_norm(t: Tensor) -> float:
    return robust_norm(t) * (1.0 + NUMERICAL_SLACK)


def _unsupported(name: str, module: nn.Module, reason: str) -> UnsupportedLayerError:
    return UnsupportedLayerError(
        f"layer {_display(name)!r} ({type(module).__name__}) is not supported by the Lipschitz "
        f"bound analysis: {reason}. Supported layers: {', '.join(SUPPORTED_LAYERS)}; containers: "
        "nn.Sequential, LipResidual. Replace the layer or express it with supported ones"
    )


# --------------------------------------------------------------- operator-norm cache (speed only)
#: ``ident(weight) -> (weakref to weight, {(version, data_ptr, dtype, key): (OperatorNormBound,
#: copy of the weight)})``. An entry is used only for the values it was computed (or rescaled)
#: for: the key holds the tensor's version counter (every in-place change through torch moves it)
#: and the entry a copy of the weight, compared before use: a write through ``.data`` or a NumPy
#: view moves no version, and the certificate then took the old norm (weights scaled 30x through
#: ``p.data.mul_`` between two ``make_private`` steps: the noise calibrated to a sensitivity 16.7
#: times too small; hundred-and-twenty-fifth hostile review). The weak reference is checked, so a
#: freed tensor whose id is reused never lends its entries to another.
_NORM_CACHE: dict[int, tuple[weakref.ref, dict[tuple, tuple[OperatorNormBound, Tensor]]]] = {}
_NORM_CACHE_MAX = 4096


def _entries(weight: Tensor) -> dict[tuple, tuple[OperatorNormBound, Tensor]]:
    slot = _NORM_CACHE.get(ident(weight))
    if slot is not None and slot[0]() is weight:
        return slot[1]
    if len(_NORM_CACHE) >= _NORM_CACHE_MAX:  # drop entries of freed tensors
        for k in [k for k, (ref, _) in _NORM_CACHE.items() if ref() is None]:
            del _NORM_CACHE[k]
    entries: dict[tuple, tuple[OperatorNormBound, Tensor]] = {}
    _NORM_CACHE[ident(weight)] = (weakref.ref(weight), entries)
    return entries


#: relative slack of a rescaled bound: ``fl(c W)`` differs from ``c W`` by at most ``u ||c W||_F``
#: (``u`` = 2^-24 in float32), i.e. ``<= u sqrt(rank) ||c W||_2``; 1e-4 covers ranks up to 10^6
RESCALE_SLACK = 1e-4


def _cache_key(weight: Tensor, key: tuple) -> tuple:
    return (weight._version, weight.data_ptr(), weight.dtype, key)


def _cached_operator_norm(
    weight: Tensor, key: tuple, compute: Callable[[], OperatorNormBound], reuse: bool
) -> OperatorNormBound:
    entries = _entries(weight)
    k = _cache_key(weight, key)
    hit = entries.get(k) if reuse else None
    if hit is not None and _same_values(weight, hit[1]):
        return hit[0]
    bound = compute()
    entries.clear()  # older versions can never match again
    entries[k] = (bound, _copy(weight))
    return bound


def _copy(weight: Tensor) -> Tensor:
    with torch.no_grad():
        return weight.detach().clone()


def _same_values(weight: Tensor, copy: Tensor) -> bool:
    """Whether ``weight`` still holds the values of ``copy`` (NaN where it was NaN)."""
    with torch.no_grad():
        w = weight.detach()
        return w.shape == copy.shape and w.dtype == copy.dtype and w.device == copy.device \
            and bool(torch.eq(w, copy).logical_or_(w.isnan() & copy.isnan()).all())


def rescale_weight_(weight: Tensor, factor: float) -> None:
    """``weight *= factor`` in place, carrying its cached operator-norm bounds over as
    ``bound * factor * (1 + RESCALE_SLACK)`` (a proven bound of the rescaled weight: operator
    norms are homogeneous and the rounding of the product is covered by the slack), so the next
    :func:`lipschitz_bounds` need not recompute them. ``factor`` must be finite and > 0."""
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"rescale_weight_: factor must be finite and > 0, got {factor!r}")
    entries = _entries(weight)
    old = dict(entries)
    with torch.no_grad():
        weight.mul_(factor)
    entries.clear()
    now = _copy(weight) if old else None
    for (_, _, _, key), (bound, before) in old.items():
        entries[_cache_key(weight, key)] = (OperatorNormBound(
            bound.value * factor * (1.0 + RESCALE_SLACK), bound.method), now)


def _affine_leaf(
    m: nn.Linear | nn.Conv2d, name: str, op: OperatorNormBound, x: float, positions: int,
    weight_factor: float,
) -> _Leaf:
    """The leaf of an affine layer ``W x + b`` (``nn.Linear``, ``nn.Conv2d``): Lipschitz constant
    ``op.value``; output norm ``sqrt(positions) ||b|| + op.value x`` (the bias is added at each of
    ``positions`` output positions); the weight and bias the strategies clip, with
    ``weight_factor`` (1 for Linear, ``sqrt(patch multiplicity)`` for Conv2d)."""
    bias_norm = _tensor_norm(m.bias) if m.bias is not None else 0.0
    return _Leaf(
        lipschitz=op.value,
        output_norm_bound=math.sqrt(positions) * bias_norm + op.value * x,
        method=op.method,
        params=_Params(
            weight_name=_pname(name, "weight"),
            bias_name=_pname(name, "bias") if m.bias is not None else None,
            weight_trainable=m.weight.requires_grad,
            bias_trainable=m.bias is not None and m.bias.requires_grad,
            weight_factor=weight_factor,
            bias_positions=positions,
            operator_norm_method=op.method,
        ),
    )


def _finite(name: str, m: nn.Module, attr: str, value: Any, positive: bool = True) -> float:
    """A layer's constant as the rule reads it at this certification: a real finite number (and
    > 0 where ``positive``), else ``UnsupportedLayerError``. The constructors check them once;
    the module's attributes can change after (hundred-and-forty-fourth hostile review)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value) and (value > 0 or not positive)
    if not ok:
        raise _unsupported(name, m, f"{attr}={value!r} must be a finite number"
                           + (" > 0" if positive else "")
                           + " (it enters the certified bound; set it at construction and leave "
                           "it)")
    return float(value)


def _rule_linear(
    m: nn.Module, name: str, si: tuple[int, ...], so: tuple[int, ...], x: float, ctx: _Ctx
) -> _Leaf:
    assert isinstance(m, nn.Linear)
    op = _cached_operator_norm(m.weight, ("linear",), lambda: linear_operator_norm_bound(m),
                               ctx.reuse_norms)
    return _affine_leaf(m, name, op, x, _numel(so) // m.out_features, 1.0)


def _rule_conv2d(
    m: nn.Module, name: str, si: tuple[int, ...], so: tuple[int, ...], x: float, ctx: _Ctx
) -> _Leaf:
    assert isinstance(m, nn.Conv2d)
    op = _cached_operator_norm(
        m.weight, ("conv2d", si[1], si[2], ctx.conv_norm, m.stride, m.padding, m.dilation, m.groups),
        lambda: conv2d_operator_norm_bound(m, (si[1], si[2]), ctx.conv_norm), ctx.reuse_norms)
    factor = math.sqrt(conv2d_patch_multiplicity(m.kernel_size, m.stride, m.dilation))
    return _affine_leaf(m, name, op, x, so[1] * so[2], factor)


def _nonexpansive(reason: str) -> _Rule:
    """The rule of a 1-Lipschitz layer whose output norm is at most its input norm (reshapes,
    ReLU, permutations): ``rho = 1``, output bound ``x``; ``reason`` is recorded in the report."""

    def rule(
        m: nn.Module, name: str, si: tuple[int, ...], so: tuple[int, ...], x: float, ctx: _Ctx
    ) -> _Leaf:
        return _Leaf(1.0, x, reason)

    return rule


_rule_identity = _nonexpansive("isometry (reshape)")
_rule_relu = _nonexpansive("|relu'| <= 1, |relu(t)| <= |t|")
_rule_groupsort = _nonexpansive("permutation (norm preserving)")


def _rule_leaky_relu(
    m: nn.Module, name: str, si: tuple[int, ...], so: tuple[int, ...], x: float, ctx: _Ctx
) -> _Leaf:
    assert isinstance(m, nn.LeakyReLU)
    _finite(name, m, "negative_slope", m.negative_slope, positive=False)
    rho = max(1.0, abs(float(m.negative_slope)))
    return _Leaf(rho, rho * x, "max(1, |negative_slope|)")


def _rule_tanh(
    m: nn.Module, name: str, si: tuple[int, ...], so: tuple[int, ...], x: float, ctx: _Ctx
) -> _Leaf:
    return _Leaf(1.0, min(x, math.sqrt(_numel(si))), "|tanh'| <= 1, |tanh| < 1")


def _rule_sigmoid(
    m: nn.Module, name: str, si: tuple[int, ...], so: tuple[int, ...], x: float, ctx: _Ctx
) -> _Leaf:
    n = _numel(si)
    return _Leaf(0.25, min(math.sqrt(n), 0.5 * math.sqrt(n) + 0.25 * x), "sigmoid' <= 1/4")


def _rule_tempered_sigmoid(
    m: nn.Module, name: str, si: tuple[int, ...], so: tuple[int, ...], x: float, ctx: _Ctx
) -> _Leaf:
    assert isinstance(m, TemperedSigmoid)
    # (read every certification: constants made negative after construction certified a negative
    # Lipschitz constant and output bound, 5.24 times the declared sensitivity; hundred-and-
    # forty-fourth hostile review)
    s = _finite(name, m, "scale", m.scale)
    t = _finite(name, m, "inverse_temperature", m.inverse_temperature)
    o = _finite(name, m, "offset", m.offset, positive=False)
    n = _numel(si)
    rho = s * t / 4.0
    cap = max(abs(o), abs(s - o)) * math.sqrt(n)  # range (-o, s - o)
    at_zero = abs(s / 2.0 - o) * math.sqrt(n)
    return _Leaf(rho, min(cap, at_zero + rho * x), "scale * inverse_temperature / 4")


def _rule_maxpool(
    m: nn.Module, name: str, si: tuple[int, ...], so: tuple[int, ...], x: float, ctx: _Ctx
) -> _Leaf:
    assert isinstance(m, nn.MaxPool2d)
    stride = m.stride if m.stride is not None else m.kernel_size
    rho = math.sqrt(conv2d_patch_multiplicity(m.kernel_size, stride, m.dilation))
    return _Leaf(rho, rho * x, "sqrt(max windows per input) (overlap factor)")


def _rule_avgpool(
    m: nn.Module, name: str, si: tuple[int, ...], so: tuple[int, ...], x: float, ctx: _Ctx
) -> _Leaf:
    # a non-negative linear map A: ||A||_2 <= sqrt(max row sum * max column sum) (Schur test),
    # both computed exactly on the actual input shape (covers padding, ceil_mode, divisors)
    ones = torch.ones((1, *si), dtype=torch.float64, requires_grad=True)
    out = m(ones)
    (col,) = torch.autograd.grad(out.sum(), ones)
    if out.numel() and (bool((out.detach() < 0).any()) or bool((col < 0).any())):
        # (a negative divisor_override: a non-positive map, whose clamped maxima certified
        # Lipschitz 0 and released the layers before it without noise: 2.29 times the declared
        # sensitivity; hundred-and-forty-fourth hostile review)
        raise _unsupported(name, m, "divisor_override must be a positive number (a negative "
                           "divisor makes the pool a non-positive map, outside the Schur test's "
                           "proof); use divisor_override=None or > 0")
    row_max = float(out.detach().amax()) if out.numel() else 0.0
    col_max = float(col.amax()) if col.numel() else 0.0
    rho = math.sqrt(max(row_max, 0.0) * max(col_max, 0.0)) * (1.0 + NUMERICAL_SLACK)
    return _Leaf(rho, rho * x, "Schur test (non-negative linear map)")


def _rule_groupnorm(
    m: nn.Module, name: str, si: tuple[int, ...], so: tuple[int, ...], x: float, ctx: _Ctx
) -> _Leaf:
    assert isinstance(m, nn.GroupNorm)
    n = _numel(si)
    rho = 1.0 / math.sqrt(_finite(name, m, "eps", m.eps))
    return _Leaf(rho, min(math.sqrt(n), rho * x), "1/sqrt(eps)")


def _rule_lip_groupnorm(
    m: nn.Module, name: str, si: tuple[int, ...], so: tuple[int, ...], x: float, ctx: _Ctx
) -> _Leaf:
    assert isinstance(m, LipGroupNorm)
    n = _numel(si)
    lip = _finite(name, m, "lipschitz", m.lipschitz)
    return _Leaf(lip, min(math.sqrt(n), lip * x), "floored scale: L")


#: exact type -> rule (exact types: a subclass may override ``forward`` and void the proof)
_RULES: dict[type[nn.Module], _Rule] = {
    nn.Linear: _rule_linear,
    nn.Conv2d: _rule_conv2d,
    # same forward as their bases (not overridden, tested); only post_step projects the weight
    OrthLinear: _rule_linear,
    OrthConv2d: _rule_conv2d,
    nn.ReLU: _rule_relu,
    nn.LeakyReLU: _rule_leaky_relu,
    nn.Tanh: _rule_tanh,
    nn.Sigmoid: _rule_sigmoid,
    TemperedSigmoid: _rule_tempered_sigmoid,
    GroupSort: _rule_groupsort,
    nn.MaxPool2d: _rule_maxpool,
    nn.AvgPool2d: _rule_avgpool,
    nn.AdaptiveAvgPool2d: _rule_avgpool,
    nn.GroupNorm: _rule_groupnorm,
    LipGroupNorm: _rule_lip_groupnorm,
    nn.Flatten: _rule_identity,
    nn.Unflatten: _rule_identity,
    nn.Identity: _rule_identity,
}

#: names of the supported (leaf) layer types, for error messages and docs
SUPPORTED_LAYERS: tuple[str, ...] = tuple(
    ("nn." if cls.__module__.startswith("torch.") else "") + cls.__name__ for cls in _RULES
)

#: the loss classes with a proven logit-gradient bound
SUPPORTED_LOSSES: tuple[str, ...] = (
    TemperedCrossEntropy.__name__,
    CosineSimilarityLoss.__name__,
    MulticlassHingeLoss.__name__,
)


def _param_spec(module: nn.Module) -> tuple[torch.dtype, torch.device]:
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype, p.device
    return torch.get_default_dtype(), torch.device("cpu")


def _precheck(m: nn.Module, name: str, si: tuple[int, ...]) -> None:
    """Configurations of supported types that the proofs do not cover (before the forward)."""
    if isinstance(m, nn.Conv2d):
        if len(si) != 3:
            raise _unsupported(name, m, f"expects a per-example input (C, H, W), got shape {si}")
        if m.padding_mode != "zeros":
            raise _unsupported(
                name, m, f"padding_mode={m.padding_mode!r} copies pixels; use padding_mode='zeros'"
            )
    elif isinstance(m, nn.MaxPool2d) and m.return_indices:
        raise _unsupported(name, m, "return_indices=True returns a tuple; use return_indices=False")
    elif isinstance(m, nn.GroupNorm) and m.affine:
        raise _unsupported(
            name,
            m,
            "affine=True adds trainable scale/shift parameters; use the parameter-free "
            f"nn.GroupNorm({m.num_groups}, {m.num_channels}, affine=False) or LipGroupNorm",
        )
    elif isinstance(m, nn.Flatten) and m.start_dim % (len(si) + 1) == 0:
        raise _unsupported(name, m, "start_dim=0 flattens the batch dimension (mixes examples)")
    elif isinstance(m, nn.Unflatten) and isinstance(m.dim, int) and m.dim % (len(si) + 1) == 0:
        raise _unsupported(name, m, "dim=0 unflattens the batch dimension (mixes examples)")


def _walk(module: nn.Module, name: str, shape: tuple[int, ...], x: float, ctx: _Ctx) -> list[_Node]:
    """Forward pass of the bound analysis over ``module``; one node per layer (flattened
    sequentials), residual blocks as nodes with children."""
    if ident(module) in ctx.seen and any(True for _ in module.parameters()):
        raise _unsupported(
            name,
            module,
            "the same parametrised module is used twice (weight sharing by module reuse); use a "
            "separate module for each use (to share a weight, assign the same nn.Parameter to "
            "both: tied parameters are bounded by the sum of their per-use bounds)",
        )
    ctx.seen.add(ident(module))
    kind = type(module)
    if kind is nn.Sequential:
        nodes: list[_Node] = []
        # _modules, not named_children(): the latter skips a module's repeated uses (and
        # nn.Sequential.forward runs every entry of _modules, repeats included)
        for child_name, child in module._modules.items():
            if child is None:
                continue
            child_nodes = _walk(child, _pname(name, child_name), shape, x, ctx)
            if child_nodes:
                shape = child_nodes[-1].bound.output_shape
                x = child_nodes[-1].bound.output_norm_bound
            nodes.extend(child_nodes)
        return nodes
    if kind is LipResidual:
        assert isinstance(module, LipResidual)
        inner = _walk(module.block, _pname(name, "block"), shape, x, ctx)
        out_shape = inner[-1].bound.output_shape if inner else shape
        if out_shape != shape:
            raise _unsupported(
                name,
                module,
                f"its block maps shape {shape} to {out_shape}; a residual block "
                "must preserve the shape",
            )
        inner_x = inner[-1].bound.output_norm_bound if inner else x
        inner_rho = math.prod(n.bound.lipschitz for n in inner)
        bound = NodeBound(
            name=name,
            kind="LipResidual",
            input_shape=shape,
            output_shape=shape,
            lipschitz=1.0 + inner_rho,
            method="1 + Lip(block)",
            input_norm_bound=x,
            output_norm_bound=x + inner_x,
        )
        return [_Node(bound, None, tuple(inner))]
    rule = _RULES.get(kind)
    if rule is None:
        hint = (
            " (a subclass of a supported layer: only the exact types are trusted, since a subclass "
            "may change forward)"
            if any(issubclass(kind, base) for base in (*_RULES, nn.Sequential, LipResidual))
            else ""
        )
        raise _unsupported(name, module, f"no proven Lipschitz rule for this type{hint}")
    _precheck(module, name, shape)
    dtype, device = _param_spec(module)
    try:
        with torch.no_grad():
            out = module(torch.zeros((1, *shape), dtype=dtype, device=device))
    except Exception as exc:  # the shape does not fit the layer
        raise ValueError(
            f"layer {_display(name)!r} ({kind.__name__}) failed on a per-example input of shape "
            f"{shape}: {exc}; check input_shape (per example, without the batch dimension)"
        ) from exc
    if not isinstance(out, Tensor) or out.dim() < 1 or out.shape[0] != 1:
        raise _unsupported(name, module, "its output is not a batched tensor")
    out_shape = tuple(int(s) for s in out.shape[1:])
    leaf = rule(module, name, shape, out_shape, x, ctx)
    bound = NodeBound(
        name=name,
        kind=kind.__name__,
        input_shape=shape,
        output_shape=out_shape,
        lipschitz=leaf.lipschitz,
        method=leaf.method,
        input_norm_bound=x,
        output_norm_bound=leaf.output_norm_bound,
    )
    return [_Node(bound, leaf.params)]


def _flat_trace(nodes: Sequence[_Node]) -> list[NodeBound]:
    out: list[NodeBound] = []
    for node in nodes:
        if node.children is not None:
            out.extend(_flat_trace(node.children))
        out.append(node.bound)
    return out


def _backward(
    nodes: Sequence[_Node], g: float, out: list[LayerBound], canon: dict[str, str]
) -> float:
    """Backward pass: ``g`` bounds the gradient norm at the output of ``nodes``; appends the
    parametrised layers' bounds (in reverse order) and returns the bound at their input.
    ``canon`` maps a parameter's path to its name in ``model.named_parameters()`` (the first path
    of a tied parameter), so that every use of one tensor is keyed by one name."""
    for node in reversed(nodes):
        if node.children is not None:
            # the skip path does not depend on the block's parameters: they see only g (the
            # gradient at the block's output) back-propagated through the block's later layers
            _backward(node.children, g, out, canon)
        elif node.params is not None:
            p, b = node.params, node.bound
            w_bound = p.weight_factor * b.input_norm_bound * g
            b_bound = math.sqrt(p.bias_positions) * g if p.bias_name is not None else None
            w_name = canon.get(p.weight_name, p.weight_name)
            bias_name = canon.get(p.bias_name, p.bias_name) if p.bias_name is not None else None
            per_param: dict[str, float] = {}
            # += : one tensor used twice in a layer would get both contributions (the sum)
            if p.weight_trainable:
                per_param[w_name] = per_param.get(w_name, 0.0) + w_bound
            if bias_name is not None and p.bias_trainable and b_bound is not None:
                per_param[bias_name] = per_param.get(bias_name, 0.0) + b_bound
            out.append(
                LayerBound(
                    name=b.name,
                    kind=b.kind,
                    input_norm_bound=b.input_norm_bound,
                    output_grad_bound=g,
                    operator_norm=b.lipschitz,
                    operator_norm_method=p.operator_norm_method,
                    weight_factor=p.weight_factor,
                    weight_grad_bound=w_bound,
                    bias_grad_bound=b_bound,
                    parameter_grad_bounds=per_param,
                    weight_name=w_name,
                    bias_name=bias_name,
                )
            )
        g = g * node.bound.lipschitz
    return g


def _check_inputs(
    input_shape: Sequence[int], input_norm_bound: float, conv_norm: str
) -> tuple[int, ...]:
    if conv_norm not in ("auto", "reshape", "fft"):
        raise ValueError(f"conv_norm must be 'auto', 'reshape' or 'fft', got {conv_norm!r}")
    try:
        shape = tuple(int(s) for s in input_shape)
    except TypeError as exc:
        raise ValueError(
            f"input_shape must be a sequence of ints (per example, no batch dimension), got "
            f"{input_shape!r}"
        ) from exc
    if not shape or any(s < 1 for s in shape):
        raise ValueError(
            f"input_shape must be a non-empty per-example shape of positive sizes, got {shape}"
        )
    if not (
        isinstance(input_norm_bound, (int, float))
        and math.isfinite(input_norm_bound)
        and input_norm_bound > 0
    ):
        raise ValueError(
            f"input_norm_bound must be a positive finite number (the public bound X_0 inputs are "
            f"clipped to), got {input_norm_bound!r}"
        )
    return shape


def module_lipschitz(
    module: nn.Module,
    input_shape: Sequence[int],
    input_norm_bound: float = 1.0,
    *,
    conv_norm: ConvNormMethod = "auto",
) -> ModuleBound:
    """Forward bound analysis of ``module`` (a supported layer, an ``nn.Sequential`` of them or a
    :class:`LipResidual`) on per-example inputs of shape ``input_shape`` with
    ``||x|| <= input_norm_bound``: its Lipschitz constant, the bound on its output norm and the
    trace of every layer. Raises :class:`UnsupportedLayerError` on a layer without a proven rule.
    """
    shape = _check_inputs(input_shape, input_norm_bound, conv_norm)
    nodes = _walk(module, "", shape, float(input_norm_bound), _Ctx(conv_norm, set()))
    out_shape = nodes[-1].bound.output_shape if nodes else shape
    out_norm = nodes[-1].bound.output_norm_bound if nodes else float(input_norm_bound)
    return ModuleBound(
        input_shape=shape,
        output_shape=out_shape,
        input_norm_bound=float(input_norm_bound),
        output_norm_bound=out_norm,
        lipschitz=math.prod(n.bound.lipschitz for n in nodes),
        trace=tuple(_flat_trace(nodes)),
    )


def lipschitz_bounds(
    model: nn.Module,
    loss: LipschitzLoss,
    *,
    input_shape: Sequence[int],
    input_norm_bound: float,
    conv_norm: ConvNormMethod = "auto",
    reuse_norms: bool = False,
) -> NetworkBound:
    """Certified per-layer and global per-example gradient-norm bounds of ``loss(model(x), y)``.

    Args:
        model: an ``nn.Sequential`` (nesting and :class:`LipResidual` blocks allowed) of the layers
            in :data:`SUPPORTED_LAYERS`, producing logits of shape ``(B, num_classes)``.
        loss: a :class:`LipschitzLoss` (:data:`SUPPORTED_LOSSES`): the loss differentiated.
        input_shape: per-example input shape, without the batch dimension.
        input_norm_bound: the public bound ``X_0``; inputs must be clipped to ``||x|| <= X_0``
            (l2 norm of the whole flattened example) before the forward pass.
        conv_norm: how convolution operator norms are bounded (:data:`ConvNormMethod`).
        reuse_norms: serve a weight's operator-norm bound from the cache when the weight has not
            changed since it was computed, or since :func:`rescale_weight_` rescaled it (the
            cached value is then the old bound times the factor, with slack: still a proven upper
            bound). Default ``False``: compute every norm (and record it).

    Returns:
        :class:`NetworkBound` with, per parametrised layer, ``X_{k-1}``, ``G_k`` and the per-example
        gradient-norm bounds; ``grad_bound`` (global) and ``scaled_grad_bound`` (reading R2).

    Privacy: every bound holds for every example with ``||x|| <= X_0`` and every label (the
    weights are public: they were released by earlier private steps), so ``grad_bound`` is an l2
    sensitivity of the summed gradient (add/remove one example) that needs no per-example clipping.
    It is computed from the CURRENT weights (Lip-DP-SGD); re-run it after every update. Biases are
    handled soundly (they enter the input-norm bounds and get their own gradient bounds).
    Frozen parameters (``requires_grad=False``) count in the propagation but get no gradient bound.
    A parameter tied to several layers (one ``nn.Parameter`` held by two modules) is keyed by its
    ``named_parameters()`` name in every layer that uses it, and its bound is the SUM of the
    per-use bounds (its gradient is the sum of the per-use contributions). The same module used
    twice is refused (give the second use its own module, tying the parameter if intended).

    Raises:
        UnsupportedLayerError: a layer or loss without a proven rule (named, with the fix).
        ValueError: a bad ``input_shape`` / ``input_norm_bound`` or non-vector logits.
    """
    if type(loss) not in (TemperedCrossEntropy, CosineSimilarityLoss, MulticlassHingeLoss):
        raise UnsupportedLayerError(
            f"loss {type(loss).__name__} has no proven logit-gradient bound; supported losses: "
            f"{', '.join(SUPPORTED_LOSSES)} (from dpclip.lipschitz); e.g. "
            "TemperedCrossEntropy(temperature=1.0) instead of nn.CrossEntropyLoss"
        )
    shape = _check_inputs(input_shape, input_norm_bound, conv_norm)
    x0 = float(input_norm_bound)
    nodes = _walk(model, "", shape, x0, _Ctx(conv_norm, set(), reuse_norms))
    out_shape = nodes[-1].bound.output_shape if nodes else shape
    if len(out_shape) != 1 or out_shape[0] < 2:
        raise ValueError(
            f"the model must output logits of shape (B, num_classes) with num_classes >= 2, got a "
            f"per-example output of shape {out_shape}; end the model with nn.Linear(..., "
            "num_classes) (add nn.Flatten before it for images)"
        )
    loss_lip = float(loss.lipschitz(out_shape[0]))
    collected: list[LayerBound] = []
    # a parameter held by several modules (tied) is named once in named_parameters(): key every
    # use by that name, so its per-use bounds are summed (NetworkBound.parameter_grad_bounds)
    first_name = {ident(p): n for n, p in model.named_parameters()}
    canon = {
        n: first_name.get(ident(p), n) for n, p in model.named_parameters(remove_duplicate=False)
    }
    # the slack covers float rounding of attained constants (e.g. ||e_j - e_y|| = sqrt(2))
    _backward(nodes, loss_lip * (1.0 + NUMERICAL_SLACK), collected, canon)
    layers = tuple(reversed(collected))
    covered = {name for layer in layers for name in layer.parameter_grad_bounds}
    stray = sorted(
        name for name, p in model.named_parameters() if p.requires_grad and name not in covered
    )
    if stray:
        raise UnsupportedLayerError(
            f"trainable parameters {stray} do not belong to any analysed Linear/Conv2d layer; "
            "their gradients would not be bounded. Freeze them (requires_grad_(False)) or remove "
            "them"
        )
    return NetworkBound(
        input_norm_bound=x0,
        output_norm_bound=nodes[-1].bound.output_norm_bound if nodes else x0,
        lipschitz=math.prod(n.bound.lipschitz for n in nodes),
        loss_lipschitz=loss_lip,
        layers=layers,
        trace=tuple(_flat_trace(nodes)),
    )
