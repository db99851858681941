"""Errors raised by the engines."""

from __future__ import annotations

import re

__all__ = ["PerLayerNotProved", "PerLayerUnsupported", "PrivateBufferError", "UnsupportedModelError",
           "loss_shape_error", "quote_error"]


class UnsupportedModelError(ValueError):
    """The model cannot be run by the requested engine (for example a training-mode BatchNorm under a
    per-example engine). The message names the offending layer and the fix."""


class PrivateBufferError(RuntimeError):
    """A module changed a buffer during a private forward pass (the buffer would carry private
    statistics out of the run without noise). Raised by the engines' state guard and by
    :func:`dpclip.training.step.private_buffer_guard` (docs/errors.md, entry 79)."""


def loss_shape_error(ndim: int, prefix: str = "") -> ValueError:
    """The error for a loss that is not one value per example. It quotes the number of
    dimensions only: a shape's dimensions may hold the realised (private) batch size, and the
    message can reach a log or a results store."""
    if ndim == 0:
        got = "a 0-d (scalar) loss: reduced over the batch"
    else:
        got = (f"a {ndim}-d tensor whose first dimension is not the batch (its shape is not "
               "quoted: it may hold the realised batch size, which is private)")
    return ValueError(f"{prefix}loss_fn must return per-example losses of shape (B,) (reduction "
                      f"'none'), got {got}; e.g. nn.CrossEntropyLoss(reduction='none')")


def quote_error(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line`` of an exception raised while running a private batch, with every
    number masked (``#``): a library's text can quote a shape or a size that holds the realised
    batch size (``got sizes [4, 3]``), which is private, and engine messages reach logs, results
    stores and ``engine_info``."""
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - an exception whose __str__ raises: its type alone
        text = ""
    first = (text.strip().splitlines() or [""])[0][:limit] if type(text) is str else ""
    first = re.sub(r"\d+", "#", first)
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


class PerLayerUnsupported(Exception):
    """A module on the per-layer path (:mod:`dpclip.engine.per_layer`) whose per-example gradient
    cannot be read from its call."""


class PerLayerNotProved(PerLayerUnsupported):
    """The per-layer recomputation is not proved to read example ``i`` alone
    (``per_layer.RecomputeTracer``). Never turned into a vmap fallback: the module behaved
    differently when evaluated one example at a time, and ``vmap`` evaluates it the same way, after
    the ghost engine's forward ran it on the whole batch (what it kept from there, ``vmap``
    reads)."""
