"""dpclip's own context-manager helpers, for the code a private step runs between its checks
(ninety-first hostile review).

``contextlib.contextmanager`` builds each context manager through ``contextlib.helper``, which
looks up ``_GeneratorContextManager`` in contextlib's module globals every time it is called; a
forward that set that name to a subclass (never put back) had its own code run inside every one of
the engine's context managers, after their checks: it divided ``torch.Tensor.sqrt`` by 50 inside
``exact_float32`` (the norms 1/50 of the true ones: LOO 50 C under ghost, auto, compiled and vmap)
and made ``torch.randn`` give zeros inside the release (``collector_paused``: the noise gone through
``make_private``). ``contextlib.ExitStack``'s methods (entered in ``_common._precise``, after the
reduction's check) were the same door (50 C). The engine's context managers are now built here, in
dpclip's code (patching dpclip stays outside the trust boundary), with the semantics of contextlib's
for a generator that yields once: the generator's code before ``yield`` runs on entry; an exception
of the block is thrown into it at the ``yield``; it must not yield twice.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Callable, Generator, Iterator, TypeVar

import torch

__all__ = ["ExitStack", "contextmanager", "no_grad", "nullcontext"]

T = TypeVar("T")


class _GeneratorCM:
    __slots__ = ("_gen",)

    def __init__(self, gen: Generator[Any, None, None]) -> None:
        self._gen = gen

    def __enter__(self) -> Any:
        try:
            return next(self._gen)
        except StopIteration:
            raise RuntimeError("generator didn't yield") from None

    def __exit__(self, typ: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if typ is None:
            try:
                next(self._gen)
            except StopIteration:
                return False
            raise RuntimeError("generator didn't stop")
        if value is None:
            value = typ()
        try:
            self._gen.throw(value)
        except StopIteration as exc:
            return exc is not value  # (the generator swallowed the exception)
        except RuntimeError as exc:
            # (an exception the generator let pass, re-raised by PEP 479 as RuntimeError)
            if exc is value:
                exc.__traceback__ = tb
                return False
            if isinstance(value, StopIteration) and exc.__cause__ is value:
                value.__traceback__ = tb
                return False
            raise
        except BaseException as exc:
            if exc is not value:
                raise
            exc.__traceback__ = tb
            return False
        raise RuntimeError("generator didn't stop after throw()")


def contextmanager(func: Callable[..., Iterator[T]]) -> Callable[..., Any]:
    """``contextlib.contextmanager`` for the engine (module docstring): ``with f(...):`` runs the
    generator ``f`` up to its ``yield``, then the block, then the rest (the block's exception
    thrown in at the ``yield``)."""

    def make(*args: Any, **kwargs: Any) -> _GeneratorCM:
        return _GeneratorCM(func(*args, **kwargs))

    make.__name__ = getattr(func, "__name__", "contextmanager")
    make.__qualname__ = getattr(func, "__qualname__", make.__name__)
    make.__doc__ = func.__doc__
    make.__module__ = getattr(func, "__module__", __name__)
    make.__wrapped__ = func  # type: ignore[attr-defined]
    return make


class nullcontext:
    """``contextlib.nullcontext`` (module docstring): enters to ``value``, does nothing."""

    __slots__ = ("_value",)

    def __init__(self, value: Any = None) -> None:
        self._value = value

    def __enter__(self) -> Any:
        return self._value

    def __exit__(self, *exc: Any) -> bool:
        return False


class ExitStack:
    """The part of ``contextlib.ExitStack`` the engine uses (module docstring): context managers
    entered with :meth:`enter_context`, left in reverse order when the stack is left (an
    exception of the block, or of an exit, handed to the exits left), like contextlib's."""

    __slots__ = ("_exits",)

    def __init__(self) -> None:
        self._exits: list[Any] = []

    def enter_context(self, cm: Any) -> Any:
        cls = type(cm)
        enter, leave = cls.__enter__, cls.__exit__
        got = enter(cm)
        self._exits.append((leave, cm))
        return got

    def __enter__(self) -> "ExitStack":
        return self

    def __exit__(self, typ: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> bool:
        pending = value
        suppressed = False
        while self._exits:
            leave, cm = self._exits.pop()
            try:
                if leave(cm, type(pending) if pending is not None else None, pending,
                         pending.__traceback__ if pending is not None else None):
                    pending, suppressed = None, True
            except BaseException as exc:  # noqa: BLE001 - handed to the exits left, then raised
                if pending is not None and exc.__context__ is None:
                    exc.__context__ = pending
                pending, suppressed = exc, False
        if pending is not None and pending is not value:
            raise pending
        return suppressed and pending is None


#: torch's grad-mode switch and reading, C functions bound at import
_SET_GRAD = torch._C._set_grad_enabled
_IS_GRAD = torch._C.is_grad_enabled


class no_grad:
    """``torch.no_grad()`` for the engine's windows (ninety-second hostile review): torch's is a
    Python class whose ``__new__`` / ``__init__`` / ``__enter__`` look up torch's globals
    (``torch._jit_internal.is_scripting``, rebound from the forward: 10.7 C under ghost); this one
    calls torch's C switch, bound at import. Reentrant; restores the mode it found."""

    __slots__ = ("_prev",)

    def __enter__(self) -> None:
        self._prev = _IS_GRAD()
        _SET_GRAD(False)

    def __exit__(self, *exc: Any) -> bool:
        _SET_GRAD(self._prev)
        return False
