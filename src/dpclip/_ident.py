"""An object's identity as an int, for dictionaries keyed by object.

``ident(x)`` is ``object.__hash__(x)``: the object's address, rotated (``id(x) >> 4`` for the
16-byte aligned addresses of CPython's allocators), unique among live objects like ``id(x)``. It is
used instead of ``id`` everywhere in dpclip because ``id`` raises an audit event (``builtins.id``)
and dpclip installs an audit hook for its private steps (:mod:`dpclip.engine.frames_guard`): with
the hook in place ``id`` costs ~230 ns a call against ~90 ns here, and a step of a small
transformer makes ~9,000 such calls. Keys made with ``ident`` must be looked up with ``ident``.
"""

from __future__ import annotations

__all__ = ["ident"]

ident = object.__hash__
