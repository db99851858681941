"""What a clipping strategy can do, declared once as a frozen value on the strategy.

The training loop, the step, the audits and the federated aggregator ask a strategy the same
questions: is its sensitivity certified from the weights (bound-based, Lip-DP-SGD)? does it need
materialized per-example gradients (P-GRAD, AdaClip)? does it estimate thresholds on public data?
does it clip per group (per-layer)? Each strategy answers them in ONE place, its class attribute
``capabilities``, and every caller reads them through :func:`capabilities_of`, instead of probing
optional attributes with ``getattr``/``hasattr`` (a misspelt probe silently answers "no").

Privacy: the capabilities decide which step runs (bound-based: certified sensitivity; P-GRAD:
noise in the transformed space; per-group: one noise std per group). A strategy that declares a
capability must provide its hooks; the clipping contract test checks both directions for every
registered strategy (:func:`check_capabilities`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

__all__ = ["Capabilities", "capabilities_of", "check_capabilities", "strategy_name"]

#: the hooks each capability promises (checked by ``check_capabilities``)
HOOKS: dict[str, tuple[str, ...]] = {
    "bound_based": ("bind", "loss", "certify", "scale_inputs", "post_step", "gradient_context"),
    "per_example_grads": ("transform", "noise_scale", "untransform"),
    "public_norms": ("public_refresh",),
    "per_group": ("bind_groups", "group_noise", "grouping"),
}


@dataclass(frozen=True)
class Capabilities:
    """The optional features of a clipping strategy (all ``False``: a plain norm-based one).

    ``bound_based``: the sensitivity is certified from the weights (``kind = "bound"``; hooks
    ``bind``, ``loss``, ``certify``, ``scale_inputs``, ``post_step``, ``gradient_context``); runs with
    per-example clipping units only, one plain batched backward.
    ``per_example_grads``: clips transformed per-example gradients (P-GRAD: ``transform``,
    ``noise_scale``, ``untransform``); needs the vmap or naive engine, one process, ``unit=ic``.
    ``public_norms``: refreshes its thresholds from norms on PUBLIC data at each epoch start
    (``public_refresh``); the run needs a public split.
    ``per_group``: clips per parameter group (``norm_kind = "group"``; ``bind_groups``,
    ``group_noise`` (per-group noise factors or ``None``), ``grouping``).
    """

    bound_based: bool = False
    per_example_grads: bool = False
    public_norms: bool = False
    per_group: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            if not isinstance(getattr(self, f.name), bool):
                raise TypeError(f"Capabilities: {f.name} must be a bool, got "
                                f"{getattr(self, f.name)!r}")
        if self.bound_based and (self.per_example_grads or self.public_norms or self.per_group):
            raise ValueError("Capabilities: a bound-based strategy certifies its sensitivity from "
                             "the weights; it cannot also clip per example, per group or on "
                             "public norms")


def capabilities_of(strategy: Any) -> Capabilities:
    """The declared :class:`Capabilities` of ``strategy`` (an instance or a class).

    A strategy written before capabilities existed (a user's own class without a ``capabilities``
    attribute) is read from the attributes it used to set (``kind``, ``norm_kind``,
    ``needs_per_example_grads``, ``needs_public_norms``): this is the only place they are probed.
    """
    caps = getattr(strategy, "capabilities", None)
    if isinstance(strategy, type) and isinstance(caps, property):
        # a class whose capabilities depend on the instance (a schedule wrapper forwards its
        # inner strategy's): the class itself fixes only its kind
        return Capabilities(bound_based=getattr(strategy, "kind", "norm") == "bound")
    if isinstance(caps, Capabilities):
        # a subclass that sets ``kind = "bound"`` / ``norm_kind = "group"`` but inherits a plain
        # declaration is read as what its step needs (the safe side: a bound-based strategy is
        # never run as a norm-based one); the contract test refuses such registered strategies
        bound = caps.bound_based or getattr(strategy, "kind", "norm") == "bound"
        group = caps.per_group or getattr(strategy, "norm_kind", "flat") == "group"
        if (bound, group) == (caps.bound_based, caps.per_group):
            return caps
        return replace(caps, bound_based=bound, per_group=group)
    if caps is not None:
        raise TypeError(f"strategy {strategy_name(strategy)!r}: capabilities must be a "
                        f"dpclip.clipping.Capabilities, got {type(caps).__name__}")
    return Capabilities(
        bound_based=getattr(strategy, "kind", "norm") == "bound",
        per_example_grads=bool(getattr(strategy, "needs_per_example_grads", False)),
        public_norms=bool(getattr(strategy, "needs_public_norms", False)),
        per_group=getattr(strategy, "norm_kind", "flat") == "group",
    )


def strategy_name(strategy: Any) -> str:
    """The registry name of a strategy (instance or class), or its class name."""
    name = getattr(strategy, "name", None)
    if isinstance(name, str) and name:
        return name
    return strategy.__name__ if isinstance(strategy, type) else type(strategy).__name__


def check_capabilities(strategy: Any) -> list[str]:
    """The problems of a strategy's declaration (empty when it is consistent): it declares a
    ``Capabilities`` value, provides the hooks of every capability it declares, and its
    ``kind`` / ``norm_kind`` agree with ``bound_based`` / ``per_group``."""
    caps = getattr(strategy, "capabilities", None)
    if not isinstance(caps, Capabilities):
        return [f"declares no Capabilities value (got {caps!r})"]
    problems = []
    for cap, hooks in HOOKS.items():
        if getattr(caps, cap):
            problems += [f"declares {cap} but has no {h!r}" for h in hooks
                         if not hasattr(strategy, h)]
    if caps.bound_based != (getattr(strategy, "kind", "norm") == "bound"):
        problems.append(f"bound_based={caps.bound_based} but kind="
                        f"{getattr(strategy, 'kind', 'norm')!r}")
    if caps.per_group != (getattr(strategy, "norm_kind", "flat") == "group"):
        problems.append(f"per_group={caps.per_group} but norm_kind="
                        f"{getattr(strategy, 'norm_kind', 'flat')!r}")
    return problems
