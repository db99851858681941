"""Engine interface: how per-example norms and the weighted gradient sum are computed.

An engine turns one batch into ``sum_i w_i * g_i`` where ``g_i`` is example ``i``'s gradient and
``w_i = weight_fn(norms)_i`` comes from the clipping strategy. Engines return SUMS; the step divides
once by the public expected batch size. Engines hold no state between calls and never touch
``p.grad`` or attach attributes to parameters/modules (design rule 2).

Non-finite per-example gradients (NaN/Inf) are replaced by zero vectors and their norm is reported
as ``+inf``: a strategy maps ``+inf`` to weight 0, so one poisoned example cannot corrupt the sum or
exceed the sensitivity (anchors P7).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from torch import Tensor, nn

from dpclip._ident import ident

__all__ = ["Engine", "EngineResult", "LossFn", "ParamGroups", "WeightFn"]

#: ``loss_fn(outputs, targets) -> per-example losses of shape (B,)`` (reduction "none").
LossFn = Callable[[Tensor, Tensor], Tensor]
#: ``weight_fn(norms) -> weights`` with the same shape as ``norms``: ``(B,)`` flat or ``(B, G)``.
WeightFn = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class ParamGroups:
    """A partition of a model's trainable parameters into clipping groups.

    ``names[g]`` is the name of group ``g`` and ``members[g]`` the names (as in
    ``model.named_parameters()``) of the parameters it holds. Every trainable parameter belongs to
    exactly one group. With one group, norms are flat (shape ``(B,)``); with ``G > 1`` groups they are
    per-example per-group (shape ``(B, G)``).
    """

    names: tuple[str, ...]
    members: tuple[tuple[str, ...], ...]

    @property
    def is_flat(self) -> bool:
        return len(self.names) == 1

    def __len__(self) -> int:
        return len(self.names)

    @staticmethod
    def flat(model: nn.Module) -> "ParamGroups":
        """One group holding every trainable parameter (flat clipping)."""
        names = tuple(n for n, p in model.named_parameters() if p.requires_grad)
        return ParamGroups(("all",), (names,))

    @staticmethod
    def per_layer(model: nn.Module) -> "ParamGroups":
        """One group per module that directly owns trainable parameters (weight and bias together).

        A parameter shared by several modules (tied weights) belongs to the first module that owns it.
        """
        # canonical names: a tied parameter is listed once, under its first owner
        canonical = {ident(p): n for n, p in model.named_parameters() if p.requires_grad}
        seen: set[int] = set()
        names: list[str] = []
        members: list[tuple[str, ...]] = []
        for mod_name, mod in model.named_modules():
            own_ids = [
                ident(p)
                for _, p in mod.named_parameters(recurse=False)
                if p.requires_grad and ident(p) in canonical and ident(p) not in seen
            ]
            seen.update(own_ids)
            own = tuple(canonical[i] for i in own_ids)
            if own:
                names.append(mod_name or "<root>")
                members.append(own)
        return ParamGroups(tuple(names), tuple(members))

    @staticmethod
    def per_parameter(model: nn.Module) -> "ParamGroups":
        """One group per trainable parameter tensor."""
        names = tuple(n for n, p in model.named_parameters() if p.requires_grad)
        return ParamGroups(names, tuple((n,) for n in names))

    @staticmethod
    def from_spec(model: nn.Module, spec: str) -> "ParamGroups":
        """Groups from a spec: ``flat``, ``layer`` (one per module), ``parameter`` (one per tensor),
        or ``"a,b;c"``: ``;``-separated groups of ``,``-separated module-name prefixes (a parameter
        ``a.x.weight`` belongs to the group listing ``a`` or ``a.x``; the longest prefix wins).
        Every trainable parameter must land in exactly one group (``validate`` says which not)."""
        text = str(spec).strip()
        if text in ("flat", "all"):
            return ParamGroups.flat(model)
        if text == "layer":
            return ParamGroups.per_layer(model)
        if text == "parameter":
            return ParamGroups.per_parameter(model)
        groups = [[p.strip() for p in g.split(",") if p.strip()] for g in text.split(";")]
        groups = [g for g in groups if g]
        if not groups:
            raise ValueError(
                f"grouping {spec!r}: give 'layer', 'parameter', 'flat' or ';'-separated groups of "
                "module-name prefixes, e.g. 'conv1,conv2;fc1,fc2'"
            )
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        members: list[list[str]] = [[] for _ in groups]
        for name in trainable:
            best, best_len = None, -1
            for gi, prefixes in enumerate(groups):
                for pre in prefixes:
                    if (name == pre or name.startswith(pre + ".")) and len(pre) > best_len:
                        best, best_len = gi, len(pre)
            if best is None:
                raise ValueError(
                    f"grouping {spec!r}: parameter {name!r} matches no group prefix; add its "
                    f"module to a group (modules with parameters: "
                    f"{sorted({n.rsplit('.', 1)[0] for n in trainable})})"
                )
            members[best].append(name)
        empty = [";".join(groups[i]) for i, m in enumerate(members) if not m]
        if empty:
            raise ValueError(f"grouping {spec!r}: group(s) {empty} hold no trainable parameter")
        out = ParamGroups(tuple(",".join(g) for g in groups), tuple(tuple(m) for m in members))
        out.validate(model)
        return out

    def validate(self, model: nn.Module) -> None:
        """Raise ``ValueError`` unless every trainable parameter is in exactly one group."""
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        seen: dict[str, str] = {}
        for g, mem in zip(self.names, self.members):
            for n in mem:
                if n in seen:
                    raise ValueError(
                        f"ParamGroups: parameter {n!r} is in groups {seen[n]!r} and {g!r}; "
                        "each parameter must be in exactly one group"
                    )
                seen[n] = g
        missing = [n for n in trainable if n not in seen]
        unknown = [n for n in seen if n not in trainable]
        if missing or unknown:
            raise ValueError(
                f"ParamGroups: trainable parameters not in any group: {missing}; names that are not "
                f"trainable parameters of the model: {unknown}. Every trainable parameter must "
                "receive a private gradient (freeze it with requires_grad_(False) otherwise)."
            )


@dataclass
class EngineResult:
    """What an engine returns for one batch.

    grads:   ``{param_name: sum_i w_i g_i}`` for every trainable parameter (zeros for an empty batch),
             in the parameter's dtype, except float16 / bfloat16 parameters under the per-example
             engines: float32; and inside ``dpclip.engine._common.wide_sums`` (``dp_step``,
             ``bound_step``) float64 for float32 and half parameters. Those sums are not rounded
             before the noise: the release casts the noisy value to the parameter's dtype
             (``dpclip.engine._common.HALF``, ``dpclip.training.release``).
    norms:   per-example gradient norms before weighting, ``(B,)`` or ``(B, G)``; ``+inf`` marks a
             non-finite example; ``None`` for engines that compute no per-example norms (``summed``).
             NON-PRIVATE: log only under the ``nonprivate/`` prefix.
    weights: the weights that were applied (same shape as ``norms``), or ``None``.
    loss_sum: sum of the per-example losses of the batch (non-private diagnostic).
    engine_info: public facts about how the result was computed, for the run summary; ``None`` for
             engines with nothing to report. The ``ghost`` and ``auto`` engines report
             ``{"engine": <engine that ran>, "requested": <engine asked for>, "fallback": <reason
             or None>}`` so that a fallback to ``vmap`` is recorded, never silent.
    params:  the trainable parameters the sums belong to (``{name: Parameter}``, the model's own
             objects, as found during this call), or ``None``; lets a caller assign ``p.grad``
             without walking the model again.
    """

    grads: dict[str, Tensor]
    norms: Tensor | None
    weights: Tensor | None
    loss_sum: float
    engine_info: dict[str, Any] | None = None
    params: dict[str, Tensor] | None = None


class Engine(Protocol):
    """Protocol implemented by ``vmap``, ``naive``, ``summed``, ``ghost`` and ``auto``."""

    name: str
    #: whether the engine provides per-example norms (and so can run norm-based strategies)
    per_example: bool

    def compute(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        inputs: Tensor,
        targets: Tensor,
        weight_fn: WeightFn | None,
        groups: ParamGroups,
    ) -> EngineResult:
        ...


def zeros_like_params(model: nn.Module) -> dict[str, Tensor]:
    """Zero tensors for every trainable parameter (the weighted sum of an empty batch)."""
    return {n: torch.zeros_like(p) for n, p in model.named_parameters() if p.requires_grad}
