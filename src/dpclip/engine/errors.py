"""Errors raised by the engines."""

from __future__ import annotations

__all__ = ["UnsupportedModelError"]


class UnsupportedModelError(ValueError):
    """The model cannot be run by the requested engine (for example a training-mode BatchNorm under a
    per-example engine). The message names the offending layer and the fix."""
