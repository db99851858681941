"""No code a private step runs can reach the engine's frames or enumerate the process's objects
(forty-sixth hostile review).

A private step runs user code at many points the engine does not choose: the forward and the loss,
and every finalizer (``__del__``, ``weakref.finalize``, a weak reference's callback) of an object
whose last reference the engine drops, anywhere in its own code. Such code that reads the
engine's frames (``sys._getframe(1).f_back ...``) finds every local of the step: the weighted sum
a reduction produced after its checks, the list of chunks the engine will release, and
``dp_step``'s secret noise generator. On 46818f2 a ``weakref.finalize`` attached in the forward to a
Linear layer's input fired when ghost released the last chunk and scaled ghost's sum by 50 (LOO
50 C under ghost and auto, 125.8 C with chunks); one that planted an object in ghost's own list of
chunks had it finalized after every isolation; and through ``make_private`` that object copied the
noise generator's state, drew the very noise the release was about to add and subtracted it from
the sum: the released gradient was the noiseless clipped mean to 1.4e-7.

Python hands out frames and arbitrary objects only through calls that raise *audit events*
(PEP 578): ``sys._getframe`` (and ``inspect.currentframe`` through it), ``sys._current_frames``,
``sys._current_exceptions``, ``sys._getframemodulename``, the ``tb_frame`` / ``gi_frame`` /
``cr_frame`` / ``ag_frame`` attributes (event ``object.__getattr__``), and ``gc.get_objects`` /
``get_referrers`` / ``get_referents``; a frame's ``f_back`` needs a frame first. ``sys.settrace``
and ``sys.setprofile`` (whose callbacks receive every frame) raise events too. :func:`guarded`
(entered by :func:`dpclip.engine.isolation.engine_only`, so around every engine's ``compute`` and
``dp_step``) refuses all of these in the thread that runs the step: the call raises
:class:`FrameAccessRefused` where it is made (the finalizer gets nothing), and the step itself
is refused when it ends (an exception raised in a finalizer is printed and dropped by Python, so
the refusal must not depend on it). The audit hook (``sys.addaudithook``) is installed once, at
the first guarded call, and stays for the life of the process, as every audit hook does; outside
a step it returns at once (about 0.14 us an event; ``id()`` raises one, which is why dpclip keys
its tables with :func:`dpclip._ident.ident`).

Allowed inside, by the identity of the code that asks (a code object, which user code cannot
forge, not a file name): functions of the standard library and of torch that read a frame
and hand out no frame, only names and line numbers: ``typing`` / ``typing_extensions`` reading the
caller's module name, ``collections.namedtuple``, ``torch.library.Library`` and ``get_source``
recording where a registration was made, ``traceback.extract_stack`` / ``format_stack`` /
``print_stack`` (summaries and text), a traceback's frames read by ``traceback``'s summaries
without ``capture_locals`` (formatting an error), ``logging``'s caller lookup (its ``currentframe`` only when
``Logger.findCaller`` called it: the lambda alone returns a frame), and the symbolic-shape guards of
``torch.export`` (``expect_true``; ``ShapeEnv._get_user_frame`` only when ``_get_stack_summary``
called it). Everything else in the window is refused, however harmless (``inspect.stack()`` in a
forward, ``traceback.print_exc()`` inside a step).

Out of reach, as before (docs/engines.md, the trust boundary): ctypes (``PyEval_GetFrame``), C
extensions, other threads, and code that runs between steps (a finalizer collected in the user's
own loop can find the run's objects; see docs/privacy.md on the noise generator's state).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import sysconfig
import threading
from typing import Any, Iterator

__all__ = ["FrameAccessRefused", "guarded", "own_code", "refused"]

#: events that hand out a frame or arbitrary objects, or install a callback that receives frames
_EVENTS = frozenset({"sys._getframe", "sys._current_frames", "sys._current_exceptions",
                     "sys._getframemodulename", "gc.get_objects", "gc.get_referrers",
                     "gc.get_referents", "sys.settrace", "sys.setprofile"})
#: attribute reads (event ``object.__getattr__``) that hand out a frame
_FRAME_ATTRS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
#: events refused whoever asks (the collector's objects) / allowed to the engine's own code only
_OBJECTS = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents"})
_CALLBACKS = frozenset({"sys.settrace", "sys.setprofile"})
#: the engine's own functions that put interpreter callbacks back (filled by :func:`own_code`)
_OWN: set[Any] = set()


class FrameAccessRefused(RuntimeError):
    """Raised where code running inside a private step asks for a frame or for the process's
    objects (module docstring)."""


class _State(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        self.why: str | None = None
        self.busy = False


_STATE = _State()
_INSTALLED = False
_LOCK = threading.Lock()
#: code objects allowed to ask for a frame -> the code object that must be their caller, or None
_ALLOWED: dict[Any, Any] = {}
#: ``inspect.currentframe``'s code: judged by its caller (it returns the frame it takes)
_CURRENTFRAME: list[Any] = []
#: ``traceback``'s generators over a traceback's frames -> the summaries allowed to consume them
#: (names and line numbers; not with ``capture_locals``)
_TB_WALKERS: dict[Any, frozenset] = {}
#: where torch's and the standard library's files are (filled by :func:`_allow`)
_LIBRARY_DIRS: tuple[str, ...] = ()
_TORCH_DIR = "\0"


def _code(path: str) -> Any:
    """The code object of the function at ``module:qualname`` (None where this Python or torch
    has no such function: then nothing is allowed under that name)."""
    mod, _, qual = path.partition(":")
    try:
        obj: Any = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    obj = getattr(obj, "__func__", obj)
    return getattr(obj, "__code__", None)


def _lambda_code(mod: str, name: str) -> Any:
    try:
        fn = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError):
        return None
    return getattr(fn, "__code__", None)


def _allow() -> None:
    """Fill :data:`_ALLOWED` (module docstring: functions that read a frame and hand out none)
    and :data:`_LIBRARY_DIRS`."""
    global _LIBRARY_DIRS, _TORCH_DIR
    import torch

    _TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
    dirs = set()
    for key in ("stdlib", "platstdlib"):
        d = sysconfig.get_paths().get(key)
        if d:
            dirs.add(os.path.join(d, ""))
    dirs.add(os.path.dirname(os.__file__) + os.sep)
    _LIBRARY_DIRS = tuple(sorted(dirs))
    plain = ["typing:_caller", "typing_extensions:_caller",
             "typing_extensions:_has_generic_or_protocol_as_origin", "collections:namedtuple",
             "traceback:extract_stack", "traceback:format_stack", "traceback:print_stack",
             "torch.library:Library.__init__", "torch.library:Library._register_fake",
             "torch._library.utils:get_source",
             "torch.fx.experimental.symbolic_shapes:expect_true", "torch.fx._symbolic_trace:wrap"]
    for path in plain:
        c = _code(path)
        if c is not None:
            _ALLOWED[c] = None
    find_caller = _code("logging:Logger.findCaller")
    current = _lambda_code("logging", "currentframe")
    if find_caller is not None and current is not None:
        _ALLOWED[current] = find_caller  # (the lambda alone would hand out the caller's frame)
    summary = _code("torch.fx.experimental.symbolic_shapes:ShapeEnv._get_stack_summary")
    user = _code("torch.fx.experimental.symbolic_shapes:ShapeEnv._get_user_frame")
    if summary is not None and user is not None:
        _ALLOWED[user] = summary  # (_get_user_frame returns the frame it finds)
    consumers = {_code("traceback:StackSummary._extract_from_extended_frame_gen"),
                 _code("traceback:StackSummary.extract")} - {None}
    for path in ("traceback:walk_tb", "traceback:_walk_tb_with_full_positions"):
        c = _code(path)
        if c is not None:
            _TB_WALKERS[c] = frozenset(consumers)
    c = _code("inspect:currentframe")
    if c is not None:
        _CURRENTFRAME.append(c)


def _library_file(name: str) -> bool:
    """A file of torch or of the standard library (not of a package installed beside it)."""
    if name.startswith(_TORCH_DIR) or name.startswith("<frozen "):
        return True
    return name.startswith(_LIBRARY_DIRS) and "site-packages" not in name and \
        "dist-packages" not in name


def _importing_library(frame: Any) -> bool:
    """Whether ``frame`` runs while torch or the standard library imports one of its own
    modules, with no other code between the module's top level and ``frame`` (``enum``,
    ``typing`` and ``torch.fx.wrap`` read the importing module's name from a frame; torch imports
    parts of itself lazily, inside the proof's first trace)."""
    f, depth = frame, 0
    while f is not None and depth < 64:
        code = f.f_code
        if not _library_file(code.co_filename):
            return False
        if code.co_name == "<module>":
            up = f.f_back
            return up is not None and up.f_code.co_filename.startswith("<frozen importlib")
        f, depth = f.f_back, depth + 1
    return False


def _allowed(frame: Any) -> bool:
    """Whether the Python code that raised the event (``frame``: the frame that called the
    auditing function or read the attribute) may have the frame: its code is allowed, with the
    caller it requires, or it is the import of a module of torch or the standard library."""
    if frame is None:
        return False
    if _importing_library(frame):
        return True
    walker = _TB_WALKERS.get(frame.f_code)
    if walker is not None:  # a traceback formatted (Python's or pytest's unraisable hook)
        up = frame.f_back
        return up is not None and up.f_code in walker and \
            not up.f_locals.get("capture_locals", True)
    code = frame.f_code
    if _CURRENTFRAME and code is _CURRENTFRAME[0]:  # judged by who asked inspect for the frame
        frame = frame.f_back
        if frame is None:
            return False
        code = frame.f_code
    if code not in _ALLOWED:
        return False
    need = _ALLOWED[code]
    return need is None or (frame.f_back is not None and frame.f_back.f_code is need)


def _hook(event: str, args: tuple) -> None:
    st = _STATE
    if not st.depth or st.busy:
        return
    if event not in _EVENTS:
        if event != "object.__getattr__" or len(args) < 2 or args[1] not in _FRAME_ATTRS:
            return
    st.busy = True  # (the lookup below raises the event again)
    try:
        asker = sys._getframe(1)
        if event in _CALLBACKS:  # the engine's own put-backs (isolation, exact_float32) only
            ok = asker is not None and asker.f_code in _OWN
        else:
            ok = event not in _OBJECTS and _allowed(asker)
    finally:
        st.busy = False
        asker = None
    if ok:
        return
    what = f"{event} ({args[1]})" if event == "object.__getattr__" else event
    if st.why is None:
        st.why = what
    raise FrameAccessRefused(
        f"{what} inside a private step: code the step runs (the forward, the loss, or a "
        "finalizer the engine's own code set off) may not reach the engine's frames, callbacks "
        "or the process's objects (it could rewrite the step's result or read the secret noise "
        "generator); the step is refused")


def _install() -> None:
    global _INSTALLED
    with _LOCK:
        if not _INSTALLED:
            _allow()
            sys.addaudithook(_hook)
            _INSTALLED = True


def own_code(*functions: Any) -> None:
    """Register the engine's functions that set interpreter callbacks inside a step (putting
    back what was there: :mod:`dpclip.engine.isolation`, :func:`dpclip.engine._common.exact_float32`);
    a context manager's generator function is given by its ``__wrapped__``."""
    for f in functions:
        f = getattr(f, "__wrapped__", f)
        _OWN.add(f.__code__)


_REFUSAL = ("was called inside the private step (by the forward, the loss, or a finalizer that "
            "ran inside the engine): such code could reach the engine's frames and rewrite its "
            "result or read the secret noise generator (forty-sixth hostile review); the step is "
            "refused. Do not inspect frames, tracebacks or the garbage collector's objects, or "
            "set interpreter callbacks, in code a private step runs")


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """Frame and object introspection refused in this thread inside (module docstring). The exit
    raises :class:`~dpclip.engine.errors.UnsupportedModelError` when anything asked, even if the
    asking code caught the refusal or ran in a finalizer (whose errors Python drops); an error
    that leaves the window after a refusal becomes that refusal."""
    from dpclip.engine.errors import UnsupportedModelError

    if not _INSTALLED:
        _install()
    st = _STATE
    if st.depth == 0:
        st.why = None
    st.depth += 1
    try:
        yield
    except Exception as exc:
        why = st.why
        if why is not None and not isinstance(exc, UnsupportedModelError):
            raise UnsupportedModelError(f"{why} {_REFUSAL}") from exc
        raise
    finally:
        st.depth -= 1
    why = st.why
    if why is not None:
        raise UnsupportedModelError(f"{why} {_REFUSAL}")


def refused() -> str | None:
    """What was refused in the current window of this thread (None: nothing)."""
    return _STATE.why
