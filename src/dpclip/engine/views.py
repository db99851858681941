"""The views the library builds around a model for ONE step (the K-copy view of augmentation
multiplicity, ``dpclip.training.multiplicity.KCopyModel``, registers itself), and the model each
one views. A leaf module: the engines' walks of the module tree (the state guard, the isolation
check, the proof's key) and the ``auto`` verdict's owner read it.

A view shares the model's parameter, buffer and submodule tables but holds the model itself in a
plain attribute, so a walk from the view never reached the model's own ``__dict__``: a tensor the
model's forward kept on its top-level module carried one step's examples into the next under
``vmap`` and ``naive`` (hundred-and-twelfth hostile review: 3.91 C at a step that did not draw
the example, through ``make_private(augment_multiplicity=2)``). Every walk now goes on into the
viewed model (:func:`view_inner`). Exact types only: a user class cannot name itself a view."""

from __future__ import annotations

from typing import Any

__all__ = ["owner", "register_view", "view_inner"]

#: exact view type -> the attribute holding the model it views
_VIEW_TYPES: dict[type, str] = {}


def register_view(cls: type, attr: str) -> None:
    """Declare ``cls`` a per-step view of the model held in its attribute ``attr``."""
    _VIEW_TYPES[cls] = attr


def view_inner(module: Any) -> Any:
    """The model ``module`` views when it is a registered view (exact type), else None."""
    attr = _VIEW_TYPES.get(type(module))
    return None if attr is None else object.__getattribute__(module, attr)


def owner(model: Any) -> Any:
    """``model``, or the model a library view (of a view ...) wraps."""
    for _ in range(8):
        inner = view_inner(model)
        if inner is None:
            break
        model = inner
    return model
