"""Lip-DP-SGD and Fix-Lip-DP-SGD: private training by weight clipping and Lipschitz sensitivity.

Bound-based strategies (``kind = "bound"``, algorithms.md M15; Barczewski & Ramon, "DP-SGD with
weight clipping", arXiv 2310.18001). No per-example gradient is clipped. One step
(:func:`dpclip.training.step.bound_step`) is::

    state, cert <- strategy.certify(model, loss, input_shape, state)   # from the CURRENT weights
    x           <- strategy.scale_inputs(x)                             # x * min(1, X_0 / ||x||)
    sum         <- d/dtheta sum_i loss_i                                # one plain batched backward
    sum_k       <- sum_k * cert.scales[k]                               # reading R2: / X_{k-1}
    noisy       <- sum + N(0, (z * k_s * Delta)^2)                      # Delta = cert.sensitivity
    grad        <- noisy / expected_batch_size
    optimizer.step(grad); strategy.post_step(model, state, input_shape) # ClipWeights

Privacy, by construction: ``cert`` depends only on the weights (released by earlier private
steps, hence public), the public ``X_0``, the public input shape and the loss; it is computed
BEFORE the batch is read. For every example with ``||x|| <= X_0`` (enforced by ``scale_inputs``,
a per-example map) and every label, layer ``k``'s scaled gradient has norm ``<= Delta_k``
(:func:`dpclip.lipschitz.lipschitz_bounds`, proven upper bounds only), so the scaled summed
gradient has l2 sensitivity ``Delta = sqrt(sum_k Delta_k^2)`` under add/remove-one (``2 Delta``
replace-one, through the sampler's factor). The step is therefore the same sampled Gaussian
mechanism as DP-SGD: ``Gaussian(z)``. Per-layer noise (``noise = "per-layer"``) adds
``N(0, (z Delta_k)^2)`` to layer ``k``: ``L`` Gaussian mechanisms on the same batch, recorded as
``ComposedEvent((Gaussian(z),) * L)`` (equivalent to one ``Gaussian(z / sqrt(L))``).

Weight clipping (``post_step``) is NOT needed for soundness (the certificate is recomputed from
whatever the weights are); it keeps the sensitivity small. Lip-DP-SGD rescales a layer's weight
only when its proven operator-norm bound exceeds ``weight_bound``; Fix-Lip-DP-SGD always
normalises it to ``weight_bound``. Biases are not clipped: they enter the certificate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Sequence

import torch
from torch import Tensor, nn

from dpclip._ident import ident
from dpclip.clipping.base import State, StepContext, StrategyBase, set_positive_finite
from dpclip.clipping.capabilities import Capabilities
from dpclip.clipping.registry import StrategyEntry, register
from dpclip.events import ComposedEvent, DpEvent, GaussianEvent
from dpclip.lipschitz.bounds import NetworkBound, lipschitz_bounds, rescale_weight_
from dpclip.lipschitz.losses import LipschitzLoss, TemperedCrossEntropy
from dpclip.lipschitz.orthogonal import project_orthogonal_layers_

__all__ = ["FixLipDpSgd", "LipCertificate", "LipDpSgd", "clip_inputs"]

_PAPER = (
    "A. Barczewski & J. Ramon, DP-SGD with weight clipping, arXiv 2310.18001 (2023); "
    "algorithms.md M15"
)
SCALINGS = ("r2", "r1", "none")
NOISE_MODES = ("global", "per-layer")


def clip_inputs(inputs: Tensor, input_norm: float) -> Tensor:
    """Per example ``x * min(1, X_0 / ||x||)`` (l2 norm of the whole flattened example).

    A row-wise map: example ``i``'s output depends on ``x_i`` only, so adjacency is preserved.
    Examples with a non-finite entry become zeros (norm 0 <= X_0) instead of poisoning the sum.
    The norm, factor and product are computed in float64 and the result cast to the inputs'
    dtype; a row whose cast values have a norm above ``X_0`` (the cast rounded up: a bfloat16
    factor 1 + 2^-7, or a subnormal ``X_0`` between two of the dtype's subnormals, where the
    clipped example came out at 1.99 ``X_0``: hundred-and-fifty-first hostile review) is scaled
    down again, and a row that cannot be brought under ``X_0`` in the dtype becomes zeros. So
    every returned example has norm at most ``X_0`` as it is (the float64 norm's own rounding is
    covered by the analysis' ``NUMERICAL_SLACK``).
    """
    if inputs.shape[0] == 0:
        return inputs
    flat = inputs.reshape(inputs.shape[0], -1)
    finite = torch.isfinite(flat).all(dim=1)
    safe = torch.where(finite[:, None], flat, torch.zeros_like(flat)).double()
    norms = safe.norm(dim=1)
    factor = torch.clamp(input_norm / norms, max=1.0)  # 0-norm rows: inf -> 1
    out = (safe * factor[:, None]).to(flat.dtype)
    for _ in range(4):
        got = out.double().norm(dim=1)
        over = got > input_norm
        if not bool(over.any()):
            break
        # (the cast rounded the row up: scale it by X_0 / its norm and a margin of a few units
        # of the dtype, again from the float64 values)
        margin = 1.0 - 4.0 * torch.finfo(flat.dtype).eps
        shrink = torch.where(over, input_norm / got * margin, torch.ones_like(got))
        factor = factor * shrink
        out = (safe * factor[:, None]).to(flat.dtype)
    else:
        over = out.double().norm(dim=1) > input_norm
        if bool(over.any()):  # (nothing but zeros fits under X_0 in this dtype)
            out = torch.where(over[:, None], torch.zeros_like(out), out)
    return out.reshape(inputs.shape)


@dataclass(frozen=True)
class LipCertificate:
    """What one step's sensitivity is, computed from the weights and public constants only.

    ``sensitivity``: global ``Delta`` (before the sampler's factor); ``layer_sensitivities``: layer
    name -> ``Delta_k`` (layers that share a tied parameter form one noise block, named
    ``"a+b"``); ``scales``: trainable parameter name -> the public multiplier of its summed
    gradient (``1 / X_{k-1}`` under reading R2, ``1 / max_k X_{k-1}`` over the uses of a tied
    parameter, ``1`` without scaling or when ``X_{k-1} = 0``); ``param_sensitivity``: parameter
    name -> the sensitivity its noise is calibrated to (``Delta`` with global noise, ``Delta_k`` of
    its block with per-layer noise); ``bound``: the full analysis. A tied parameter's bound is the
    SUM of its per-use bounds (its gradient is the sum of the per-use contributions).
    """

    sensitivity: float
    layer_sensitivities: dict[str, float]
    scales: dict[str, float]
    param_sensitivity: dict[str, float]
    bound: NetworkBound = field(repr=False)


def _per_example_unit(x: Tensor) -> Tensor:
    """``x_i / ||x_i||`` per example (norm over all non-batch dimensions; 0 for a zero row)."""
    norms = torch.linalg.vector_norm(x.flatten(1), dim=1)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    unit = x / safe.view(-1, *([1] * (x.dim() - 1)))
    return torch.where((norms > 0).view(-1, *([1] * (x.dim() - 1))), unit, torch.zeros_like(x))


@contextlib.contextmanager
def _normalised_weight_grads(model: nn.Module) -> Iterator[None]:
    """Forward hooks for reading R1 (see ``gradient_context``): the output is recomputed as
    ``f(x, W.detach(), b) + f(x_hat, W) - f(x_hat, W).detach()``: the same value and the same
    gradient for ``x`` and ``b``, and ``dL/dW = sum_i dL/dy_i x_hat_i^T``."""

    def hook(mod: nn.Module, inputs: tuple, output: Tensor) -> Tensor:
        x = inputs[0]
        if x.dim() < 2:
            raise ValueError("scaling='r1' needs batched inputs (use the summed engine)")
        x_hat = _per_example_unit(x.detach())
        w = mod.weight
        if isinstance(mod, nn.Linear):
            base = nn.functional.linear(x, w.detach(), mod.bias)
            grad_path = nn.functional.linear(x_hat, w)
        else:
            base = mod._conv_forward(x, w.detach(), mod.bias)
            grad_path = mod._conv_forward(x_hat, w, None)
        return base + (grad_path - grad_path.detach())

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if isinstance(m, (nn.Linear, nn.Conv2d)) and m.weight.requires_grad]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@dataclass(frozen=True)
class _LipBase(StrategyBase):
    """Shared implementation and parameters of the two final strategies below (not
    registered)."""

    kind: ClassVar[str] = "bound"
    capabilities: ClassVar[Capabilities] = Capabilities(bound_based=True)
    norm_kind: ClassVar[str] = "flat"
    #: Fix-Lip-DP-SGD: always normalise weights to ``weight_bound`` (else only when above it)
    normalize_weights: ClassVar[bool] = False

    input_norm: float = 1.0
    weight_bound: float = 1.0
    temperature: float = 1.0
    scaling: str = "r2"
    noise: str = "global"
    conv_norm: str = "auto"
    num_layers: int | None = None

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        owner = type(self).__name__
        set_positive_finite(self, owner, "input_norm", "weight_bound", "temperature")
        if self.scaling not in SCALINGS:
            raise ValueError(f"{owner}: scaling must be one of {SCALINGS}, got {self.scaling!r}")
        if self.noise not in NOISE_MODES:
            raise ValueError(f"{owner}: noise must be one of {NOISE_MODES}, got {self.noise!r}")
        if self.conv_norm not in ("auto", "reshape", "fft"):
            raise ValueError(
                f"{owner}: conv_norm must be 'auto', 'reshape' or 'fft', got {self.conv_norm!r}"
            )
        if self.num_layers is not None:
            n = float(self.num_layers)
            if not (n.is_integer() and n >= 1):
                raise ValueError(f"{owner}: num_layers must be an integer >= 1, got "
                                 f"{self.num_layers!r}")
            object.__setattr__(self, "num_layers", int(n))

    # ----------------------------------------------------------------- model-side hooks
    def loss(self) -> LipschitzLoss:
        """The loss the step differentiates and the certificate covers: ``CE(z / temperature)``."""
        return TemperedCrossEntropy(self.temperature)

    def bind(self, model: nn.Module, input_shape: Sequence[int]) -> "_LipBase":
        """Check that ``model`` is analysable (an unsupported layer raises
        ``UnsupportedLayerError`` naming it) and return a copy with ``num_layers`` set (needed to
        plan the per-layer-noise event before training). The layer count is public (architecture)."""
        cert = self.certify(model, self.loss(), input_shape, self.init_state())[1]
        n = len(cert.layer_sensitivities)
        if self.num_layers is not None and self.num_layers != n:
            raise ValueError(
                f"{self.name}: num_layers={self.num_layers} but the model has {n} parametrised "
                "layers (noise blocks: layers sharing a tied parameter count once); omit "
                "num_layers (it is set from the model)"
            )
        return dataclasses.replace(self, num_layers=n)  # type: ignore[type-var]

    def certify(
        self, model: nn.Module, loss: Any, input_shape: Sequence[int], state: State
    ) -> tuple[State, LipCertificate]:
        """The step's sensitivity from the CURRENT weights and the public ``X_0`` (never the batch).

        Raises ``UnsupportedLayerError`` for a layer or loss without a proven bound (e.g. the
        trainer's plain cross-entropy function: use ``strategy.loss()``).
        """
        if not isinstance(loss, LipschitzLoss):
            raise ValueError(
                f"{self.name}: the loss must be a dpclip.lipschitz LipschitzLoss (its Lipschitz "
                f"constant enters the sensitivity), got {loss!r}; use strategy.loss()"
            )
        bound = lipschitz_bounds(
            model, loss, input_shape=tuple(input_shape), input_norm_bound=self.input_norm,
            conv_norm=self.conv_norm,  # type: ignore[arg-type]
            reuse_norms=True,  # the norms ClipWeights just computed (and rescaled) are reused
        )
        # one public multiplier per PARAMETER (its summed gradient is one tensor): 1 / X_{k-1} of
        # its layer under R2 (1 / max_k X_{k-1} for a parameter tied to several layers)
        r2_scales = bound.parameter_scales
        scales: dict[str, float] = {}
        param_bound: dict[str, float] = {}
        for pname, uses in bound.parameter_uses.items():
            scale = r2_scales[pname] if self.scaling in ("r2", "r1") else 1.0
            as_weight = [layer.weight_name == pname for layer in uses]
            if self.scaling == "r1" and any(as_weight) and not all(as_weight):
                raise ValueError(
                    f"{self.name}: parameter {pname!r} is a weight in one layer and a bias in "
                    "another; scaling='r1' cannot bound it. Untie it or use scaling='r2'"
                )
            if self.scaling == "r1" and all(as_weight):
                # R1: the weight gradient is formed with the layer input normalised per example
                # (gradient_context), so each use contributes ||dW_i|| <= lambda_k G_k, no
                # X_{k-1} and no further scaling
                scales[pname] = 1.0
                per_use = [layer.weight_factor * layer.output_grad_bound for layer in uses]
            else:
                scales[pname] = scale
                per_use = [scale * layer.parameter_grad_bounds[pname] for layer in uses]
            # a tied parameter's gradient is the plain SUM of its per-use contributions, so its
            # bound is the sum of the per-use bounds (triangle inequality), never a root sum of
            # squares
            param_bound[pname] = math.fsum(per_use)
        # noise blocks: the layers, merged where they share a parameter (a partition of the
        # parameters, as the per-block Gaussian events need)
        layer_sens: dict[str, float] = {}
        owner: dict[str, str] = {}
        for block in bound.tied_blocks:
            block_name = "+".join(block)
            sq = 0.0
            for pname, uses in bound.parameter_uses.items():
                if uses[0].name in block:
                    sq += param_bound[pname] ** 2
                    owner[pname] = block_name
            layer_sens[block_name] = math.sqrt(sq)
        total = math.sqrt(math.fsum(b * b for b in param_bound.values()))
        if self.noise == "global":
            param_sens = {p: total for p in scales}
        else:
            param_sens = {p: layer_sens[owner[p]] for p in scales}
        if self.noise == "per-layer" and self.num_layers is not None and \
                len(layer_sens) != self.num_layers:
            # the event is num_layers Gaussians (step_event), one per block noised: a model that
            # certifies another number of blocks (num_layers passed too small, or a tie undone
            # between steps) released more Gaussians than the ledger counts (2.83 times the
            # recorded sensitivity, epsilon 21.0 spent against 2.23 recorded over 10 steps;
            # hundred-and-forty-fourth hostile review)
            raise ValueError(
                f"{self.name}: per-layer noise is planned for num_layers={self.num_layers} noise "
                f"blocks but the model now certifies {len(layer_sens)} (its parametrised layers, "
                "merged where they share a parameter): the ledger would count fewer Gaussians "
                "than are released. Leave num_layers unset (strategy.bind(model, input_shape) "
                "sets it from the model) and keep the model's layers and ties as they were when "
                "the run was planned")
        new_state = {**state, "sensitivity": total, "num_noise_blocks": self._blocks(len(layer_sens))}
        cert = LipCertificate(total, layer_sens, scales, param_sens, bound)
        return new_state, cert

    def gradient_context(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Reading R1: while active, every ``Linear``/``Conv2d`` forms its WEIGHT gradient from
        its input divided by the example's own norm ``||x_{k-1}^{(i)}||`` (0 for a zero input);
        outputs, input gradients and bias gradients are unchanged. Needs a batched backward (the
        per-example norm is over all non-batch dimensions). Other readings: a no-op."""
        if self.scaling != "r1":
            return contextlib.nullcontext()
        return _normalised_weight_grads(model)

    def scale_inputs(self, inputs: Tensor) -> Tensor:
        """Clip every example to ``||x|| <= input_norm`` (:func:`clip_inputs`)."""
        return clip_inputs(inputs, self.input_norm)

    def post_step(
        self, model: nn.Module, state: State, *, input_shape: Sequence[int]
    ) -> dict[str, float]:
        """ClipWeights after the optimizer step, in place; returns layer name -> factor applied.

        Each ``Linear``/``Conv2d`` weight is multiplied by ``weight_bound / rho`` where ``rho`` is
        the same proven operator-norm upper bound the certificate uses (so afterwards
        ``rho <= weight_bound`` up to float rounding): Lip-DP-SGD only when ``rho > weight_bound``,
        Fix-Lip-DP-SGD always. Post-processing of released weights: no privacy cost. Soundness
        does not rely on it (the next certificate is computed from whatever the weights are).

        Orthogonal layers (``OrthLinear`` / ``OrthConv2d``) are first projected onto the
        orthogonal matrices (Bjorck / polar factor, Bethune et al.); the rescaling above then uses
        the proven norm of the PROJECTED weight (an orthogonal convolution kernel's operator norm
        is up to ``sqrt(k_h k_w)``, and is scaled to ``weight_bound`` like any other).
        """
        project_orthogonal_layers_(model)
        bound = lipschitz_bounds(
            model, self.loss(), input_shape=tuple(input_shape), input_norm_bound=self.input_norm,
            conv_norm=self.conv_norm,  # type: ignore[arg-type]
        )
        factors: dict[str, float] = {}
        # a weight tied to several layers is rescaled ONCE, by its largest operator norm over its
        # uses (rescaling it once per use would shrink it twice)
        by_weight: dict[int, tuple[Tensor, float, list[str]]] = {}
        for layer in bound.layers:
            module = model.get_submodule("" if layer.name == "<model>" else layer.name)
            w = module.weight
            _, rho_max, names = by_weight.get(ident(w), (w, 0.0, []))
            by_weight[ident(w)] = (w, max(rho_max, layer.operator_norm), [*names, layer.name])
        for weight, rho, names in by_weight.values():
            if rho <= 0.0 or not math.isfinite(rho):
                continue
            if self.normalize_weights or rho > self.weight_bound:
                factor = self.weight_bound / rho
                # in place, carrying the proven norm over (x factor, with slack): the next
                # certificate reuses it instead of recomputing (bounds.rescale_weight_)
                rescale_weight_(weight, factor)
                for name in names:
                    factors[name] = factor
        return factors

    # ----------------------------------------------------------------- strategy protocol
    def _blocks(self, layers: int) -> int:
        return layers if self.noise == "per-layer" else 1

    def init_state(self) -> State:
        return {"sensitivity": None, "num_noise_blocks": None}

    def weights(self, norms: Tensor, state: State) -> Tensor:
        """No clipping: weight 1 (used only when a per-example engine computes the sum; a
        non-finite per-example gradient gets 0, as for every strategy)."""
        return torch.where(torch.isfinite(norms), torch.ones_like(norms), torch.zeros_like(norms))

    def sensitivity(self, state: State) -> float:
        """The last certified global ``Delta`` (set by :meth:`certify`, i.e. by every step); NaN
        before the first certificate. A report only: the step calibrates its noise to the
        certificate it computes itself (:func:`dpclip.training.step.bound_step`), never to this value."""
        s = state.get("sensitivity")
        return math.nan if s is None else float(s)

    def step_event(self, noise_multiplier: float) -> DpEvent:
        """``Gaussian(z)`` (global noise) or ``L`` composed ``Gaussian(z)`` (per-layer noise)."""
        if self.noise == "global":
            return GaussianEvent(noise_multiplier)
        if self.num_layers is None:
            raise ValueError(
                f"{self.name}: per-layer noise needs the number of layers to plan its event; "
                "call strategy.bind(model, input_shape) first (the trainer does)"
            )
        return ComposedEvent((GaussianEvent(noise_multiplier),) * self.num_layers)

    def planned_event(self, base: float, ctx: StepContext) -> DpEvent:
        return self.step_event(base)


@dataclass(frozen=True)
class LipDpSgd(_LipBase):
    """Lip-DP-SGD (reading R2): input clipping to ``input_norm`` (X_0), sensitivity certified from
    the current weights, one batched backward, layer ``k``'s sum divided by the public ``X_{k-1}``,
    Gaussian noise ``z * Delta`` (or per layer ``z * Delta_k``), any optimizer, then ClipWeights:
    a weight whose proven operator-norm bound exceeds ``weight_bound`` is rescaled to it.

    Privacy: see the module docstring (same event as DP-SGD with global noise). Edge cases: a
    layer whose input is always 0 (``X_{k-1} = 0``) is not scaled; non-finite inputs become 0.
    Paper: Barczewski & Ramon, arXiv 2310.18001 (algorithms.md M15 (ii)).
    """

    name: ClassVar[str] = "lip-dp-sgd"
    normalize_weights: ClassVar[bool] = False


@dataclass(frozen=True)
class FixLipDpSgd(_LipBase):
    """Fix-Lip-DP-SGD: Lip-DP-SGD whose ClipWeights always normalises every weight's proven
    operator-norm bound to exactly ``weight_bound`` (a Lipschitz network with fixed constants,
    close to Bethune et al.'s Clipless DP-SGD, M16). Privacy and sensitivity as :class:`LipDpSgd`
    (the certificate uses the current norms, which equal ``weight_bound`` after normalisation).
    Paper: Barczewski & Ramon, arXiv 2310.18001 (algorithms.md M15, "Fix-Lip-DP-SGD").
    """

    name: ClassVar[str] = "fix-lip-dp-sgd"
    normalize_weights: ClassVar[bool] = True


register(
    StrategyEntry(
        name="lip-dp-sgd",
        cls=LipDpSgd,
        paper=_PAPER,
        summary="no gradient clipping: input clipping to X_0, sensitivity certified from the "
        "current weights (Lipschitz bounds), weight clipping after each step",
        kind="bound",
    )
)
register(
    StrategyEntry(
        name="fix-lip-dp-sgd",
        cls=FixLipDpSgd,
        paper=_PAPER,
        summary="Lip-DP-SGD with every weight normalised to the bound after each step",
        kind="bound",
    )
)
