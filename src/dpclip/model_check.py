"""Will this model train privately, and at what cost? ``check_model`` and ``fix_model``.

:func:`check_model` lists every problem of a model for a clipping strategy before any data is
touched (Opacus' ``ModuleValidator.validate`` answers the same question): BatchNorm layers (they
mix the examples of a batch, so per-example clipping cannot bound one example's influence),
buffers a forward pass may update from the data (released with the model, unnoised), and layers
the ghost engine has no rule for (they take the per-layer path: per-example gradients of their own
parameters, which costs memory in proportion to the batch size times their parameters). :func:`fix_model` fixes the
mechanical ones: BatchNorm becomes GroupNorm, as Opacus' ``ModuleValidator.fix`` does.

Privacy: the checks read the model's structure only, never data. A clean report is not a proof of
separability: the engine's own checks at run time (``dpclip.engine.ghost``) still decide, and a
model they cannot prove runs on ``vmap`` (said once) or is refused.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from dpclip.clipping import make_strategy
from dpclip.engine.ghost import _scan, ghost_support
from dpclip.training.units import UnitConfig, resolve_unit

from dpclip.clipping.capabilities import capabilities_of, strategy_name

__all__ = ["ModelProblem", "ModelReport", "check_model", "fix_model"]


@dataclass(frozen=True)
class ModelProblem:
    """One problem: the layer's name, its kind (``batchnorm``, ``buffer``, ``ghost``, ``strategy``),
    what it means and costs, the fix, and whether :func:`fix_model` applies it."""

    layer: str
    kind: str
    message: str
    fix: str
    fixable: bool = False
    blocking: bool = True  #: training refuses it (False: it runs, at a cost)

    def __str__(self) -> str:
        tag = "error" if self.blocking else "cost" if self.kind in ("ghost", "strategy") \
            else "check"
        return f"[{tag}] {self.layer}: {self.message}; fix: {self.fix}"


@dataclass
class ModelReport:
    """The problems :func:`check_model` found (``ok`` when none blocks training)."""

    strategy: str
    problems: list[ModelProblem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(p.blocking for p in self.problems)

    def __str__(self) -> str:
        if not self.problems:
            return f"check_model: no problem found for strategy {self.strategy!r}"
        lines = [f"check_model: {len(self.problems)} problem(s) for strategy "
                 f"{self.strategy!r}" + ("" if self.ok else " (training refuses this model)")]
        lines += [f"  {p}" for p in self.problems]
        if any(p.fixable for p in self.problems):
            lines.append("  dpclip.fix_model(model) fixes the ones marked fixable (before building "
                         "the optimizer)")
        return "\n".join(lines)

    def __bool__(self) -> bool:
        return self.ok


_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_NORM_BUFFERS = {"running_mean", "running_var", "num_batches_tracked"}


def _n_params(mod: nn.Module) -> int:
    return sum(p.numel() for p in mod.parameters(recurse=False) if p.requires_grad)


def check_model(model: nn.Module, strategy: Any = "fixed", *,
                strategy_params: dict[str, Any] | None = None,
                unit: str = "ic") -> ModelReport:
    """Every problem of ``model`` for private training with ``strategy`` (a name or instance)
    and clipping ``unit``: with ``unit="bc"`` (batch clipping) BatchNorm is allowed (the old
    spelling ``strategy_params={"unit": "bc"}`` is read with a deprecation note). Unknown strategy
    names fail with did-you-mean."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"check_model: model must be a torch.nn.Module, got {type(model).__name__}")
    unit_config, params = resolve_unit({"unit": unit}, strategy_params, where="check_model")
    strat = make_strategy(strategy, params) if isinstance(strategy, str) else strategy
    name = strategy_name(strat)
    report = ModelReport(name)
    add = report.problems.append
    for lname, mod in model.named_modules():
        where = lname or "<root>"
        if isinstance(mod, _BN) and unit_config.is_individual:
            add(ModelProblem(
                where, "batchnorm",
                f"{type(mod).__name__} mixes the examples of a batch (its output for one example "
                "depends on the others), so per-example clipping cannot bound one example's "
                "influence",
                "replace it with GroupNorm (dpclip.fix_model does) or LayerNorm, or use batch "
                "clipping (unit='bc')", fixable=True))
            continue
        for bname, buf in mod.named_buffers(recurse=False):
            if buf is None or (isinstance(mod, _BN) and bname in _NORM_BUFFERS):
                continue
            tracked = isinstance(mod, nn.modules.instancenorm._InstanceNorm) \
                and bname in _NORM_BUFFERS
            add(ModelProblem(
                f"{lname}.{bname}" if lname else bname, "buffer",
                ("running statistics of the training inputs, updated by every forward pass and "
                 "released with the model without noise" if tracked else
                 f"a buffer ({tuple(buf.shape)}); if the forward pass updates it from the data, "
                 "it is released with the model without noise and without accounting"),
                ("construct the layer with track_running_stats=False" if tracked else
                 "keep it constant during training (compute it from public data, or make it a "
                 "parameter)"), blocking=tracked))
    if not capabilities_of(strat).bound_based and unit_config.is_individual:
        _, reasons = ghost_support(model)
        mods = dict(model.named_modules())
        for reason in reasons:
            layer = reason.split("'")[1] if reason.count("'") >= 2 else reason
            p = _n_params(mods[layer]) if layer in mods else 0
            add(ModelProblem(
                layer, "ghost",
                f"the ghost engine refuses it ({reason}); engine='auto' runs the whole model on "
                f"vmap (per-example gradients of every parameter)",
                "change the layer's configuration as the reason says, or accept vmap's cost",
                blocking=False))
        for layer in _scan(model).per_layer:
            p = _n_params(mods[layer]) if layer in mods else 0
            add(ModelProblem(
                layer, "ghost",
                f"the ghost engine has no rule for {type(mods[layer]).__name__}; it takes the "
                f"per-layer path (per-example gradients of its own {p:,} parameters by torch.func "
                f"in the same backward; memory grows as batch size x {p:,} floats)",
                "none needed (it trains, a little slower); a supported layer (Linear, Conv, "
                "Embedding, LayerNorm, RMSNorm, GroupNorm) keeps the pure ghost path",
                blocking=False))
        if capabilities_of(strat).per_example_grads:
            total = sum(p.numel() for p in model.parameters() if p.requires_grad)
            add(ModelProblem(
                "<model>", "strategy",
                f"strategy {name!r} transforms per-example gradients before clipping, so they are "
                f"materialised for all {total:,} trainable parameters (memory grows as batch size "
                f"x {total:,} floats)",
                "lower max_physical_batch= if memory runs out", blocking=False))
    return report


def fix_model(model: nn.Module, *, verbose: bool = True) -> nn.Module:
    """Replace every BatchNorm layer of ``model`` (in place) by a GroupNorm over the same channels
    (``gcd(32, C)`` groups, affine, the same eps), as Opacus' ``ModuleValidator.fix`` does; return
    the model. Call it before building the optimizer (the new layers have new parameters).
    Says on stderr which layers were replaced (``verbose``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fix_model: model must be a torch.nn.Module, got {type(model).__name__}")
    replaced = []

    def fix(parent: nn.Module, prefix: str) -> None:
        for cname, child in parent.named_children():
            full = f"{prefix}{cname}"
            if isinstance(child, _BN):
                c = int(child.num_features)
                new = nn.GroupNorm(math.gcd(32, c), c, eps=child.eps, affine=True)
                p = next(child.parameters(), None)
                if p is not None:
                    new = new.to(device=p.device, dtype=p.dtype)
                setattr(parent, cname, new)
                replaced.append(f"{full} ({type(child).__name__} -> GroupNorm"
                                f"({new.num_groups}, {c}))")
            else:
                fix(child, full + ".")

    if isinstance(model, _BN):
        raise ValueError("fix_model: the model itself is a BatchNorm layer; wrap it in a module "
                         "or build a GroupNorm")
    fix(model, "")
    if verbose and replaced:
        print(f"dpclip.fix_model: replaced {len(replaced)} layer(s): {'; '.join(replaced)}",
              file=sys.stderr)
    return model
