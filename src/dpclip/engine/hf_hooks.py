"""Hugging Face ``transformers`` models inside a private step: what transformers changes on a
model at its first use with some options is installed before the step's snapshot (the state
guard and the step's isolation refuse any change of the model made in the step).

Privacy: none (the hooks depend on the model's classes only, not on data).
"""

from __future__ import annotations

import sys
import weakref

from torch import nn

__all__ = ["prime"]

_PRIMED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def prime(model: nn.Module) -> None:
    """Install now what transformers (>= 5) installs on a model's first call with
    ``output_hidden_states`` / ``output_attentions``: the forward hooks that capture those outputs
    (``transformers.utils.output_capturing``; inactive unless a call asks for them). Installed
    inside a private step they are a change of the model that the state guard and the step's
    isolation refuse (docs/errors.md entry 79), so such a call failed on its first private step
    under every engine. The hooks depend on the model's classes only (no data): installing them
    before the step's snapshot is what the model's first public call would do. A no-op for a model
    without transformers parts (transformers is not imported for it), once per model."""
    if model in _PRIMED or "transformers" not in sys.modules:
        return
    capture = sys.modules.get("transformers.utils.output_capturing")
    pretrained = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    install = getattr(capture, "maybe_install_capturing_hooks", None)
    registry = getattr(capture, "_CAN_RECORD_REGISTRY", None)
    if install is not None and pretrained is not None and registry is not None:
        for m in model.modules():
            if isinstance(m, pretrained) and registry.get(m) and \
                    not getattr(m, "_output_capturing_hooks_installed", False):
                install(m)
    _PRIMED.add(model)
