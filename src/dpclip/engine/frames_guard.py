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

Allowed inside, by the identity of the code that asks (a code object; not a file name, which
``code.replace(co_filename=...)`` forges: forty-seventh review): functions of the standard library
and of torch that read a frame and hand out only names and line numbers: ``typing`` /
``typing_extensions`` / ``enum`` / ``collections.namedtuple`` reading the caller's module name,
``torch.library.Library`` recording where it was made, the symbolic-shape guards of
``torch.export`` (``expect_true``; ``ShapeEnv._get_user_frame`` only when ``_get_stack_summary`` or
``_is_python_assert`` called it), ``logging``'s caller lookup (its ``currentframe`` only when
``Logger.findCaller`` called it, not with ``stack_info``), ``traceback.extract_stack`` /
``format_stack`` (a summary, text: ``FakeTensorMode`` records where it was made,
``torch.manual_seed`` where a lazy CUDA call was queued), and a traceback's frames read by
``traceback``'s summaries without ``capture_locals`` (formatting an error: an unraisable hook). The
last two pass a frame or a frame's globals to module globals (``traceback.linecache``,
``itertools.islice``, ...) that a model could rebind: allowed only while every such global is the
object it was when the hook was installed. The modules whose first import reads frames, and which
torch imports lazily inside the proof's first trace, are imported when the hook is installed,
outside every step. Everything else in the window is refused, however harmless (``inspect.stack()``
in a forward, ``traceback.print_stack()`` inside a step).

**Not closed: a frame taken before the step.** The hook sees how a frame is *obtained*; a frame's
``f_back`` and ``f_locals`` raise no event. A suspended generator's (or coroutine's) frame, read
outside every step, has for ``f_back`` whoever resumes it: resumed inside the step, it reaches the
engine's live frames (forty-seventh review: LOO 50 C under ghost and auto, the noise cancelled
through ``make_private``). This guard is therefore a barrier against the direct routes, not a
proof: docs/engines.md ("Frames and finalizers") states the trust boundary that results.

Out of reach, as before (docs/engines.md, the trust boundary): ctypes (``PyEval_GetFrame``), C
extensions, other threads, and code that runs between steps (a finalizer collected in the user's
own loop can find the run's objects; see docs/privacy.md on the noise generator's state).
"""

from __future__ import annotations

import _lsprof
from dpclip.engine import _cm
import importlib
import sys
import threading
from typing import Any, Iterator

__all__ = ["FrameAccessRefused", "callbacks_off", "guarded", "put_back_callbacks"]

#: events that hand out a frame or arbitrary objects, or install a callback that receives frames
_EVENTS = frozenset({"sys._getframe", "sys._current_frames", "sys._current_exceptions",
                     "sys._getframemodulename", "gc.get_objects", "gc.get_referrers",
                     "gc.get_referents", "sys.settrace", "sys.setprofile"})
#: a function's part whose replacement (event ``object.__setattr__``) changes what the function
#: does while it stays the same object (its defaults: the library functions a window runs take
#: none, and torch's symbolic tracing sets some inside a step)
_FUNCTION_PARTS = frozenset({"__code__"})
#: attribute reads (event ``object.__getattr__``) that hand out a frame
_FRAME_ATTRS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
#: events refused whoever asks (the collector's objects) / allowed to the engine's own code only
_OBJECTS = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents"})
_CALLBACKS = frozenset({"sys.settrace", "sys.setprofile"})
#: the engine's own functions that set interpreter callbacks (:func:`callbacks_off` and
#: :func:`put_back_callbacks`, filled where they are defined; nothing else can be added)
_OWN: set[Any] = set()


class FrameAccessRefused(RuntimeError):
    """Raised where code running inside a private step asks for a frame or for the process's
    objects (module docstring)."""


class _State(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        self.why: str | None = None
        self.busy = False
        #: the trace and profile callbacks found when the outermost window was entered (the
        #: caller's): the only ones :func:`put_back_callbacks` installs inside it
        self.entry: tuple[Any, Any] = (None, None)


_STATE = _State()
_INSTALLED = False
_LOCK = threading.Lock()
#: code objects allowed to ask for a frame -> the code objects one of which must be their caller,
#: or None
_ALLOWED: dict[Any, Any] = {}
#: ``inspect.currentframe``'s code: judged by its caller (it returns the frame it takes)
_CURRENTFRAME: list[Any] = []
#: ``traceback``'s generators over a traceback's frames -> the summaries allowed to consume them
#: (names and line numbers; not with ``capture_locals``)
_TB_WALKERS: dict[Any, frozenset] = {}


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


#: modules whose first import runs code that reads the importing module's name from a frame
#: (``typing.TypeVar``, ``enum``'s functional API, ``torch.fx.wrap``, ``torch.library``): torch
#: imports them lazily, inside the proof's first trace; imported when the hook is installed, outside
#: every step
_PRELOAD = ("torch.export", "torch._dynamo", "torch._dynamo.utils", "torch._functorch.aot_autograd",
            "torch._export.non_strict_utils", "torch._export.passes", "torch._export.pass_base",
            "torch._functorch._aot_autograd.schemas", "torch._decomp.decompositions_for_rng",
            "torch.fx.experimental.symbolic_shapes", "torch._subclasses.fake_tensor",
            "torch.fx.experimental.proxy_tensor")
#: (module, name) globals that the allowed frame readers pass frames or a frame's globals to:
#: each must still be the object it was at installation (a model that rebound
#: ``traceback.linecache`` or ``itertools.islice`` received the frames, forty-seventh review)
_PASSED_TO = (("traceback", "linecache"), ("traceback", "itertools"),
              ("traceback", "collections"), ("traceback", "FrameSummary"),
              ("traceback", "_get_code_position"), ("traceback", "walk_tb"),
              ("traceback", "_walk_tb_with_full_positions"), ("linecache", "lazycache"),
              ("linecache", "checkcache"), ("itertools", "islice"), ("collections", "deque"),
              ("logging", "currentframe"), ("logging", "_is_internal_frame"),
              ("traceback", "walk_stack"), ("traceback", "StackSummary"), ("traceback", "sys"),
              ("traceback", "extract_stack"), ("traceback", "format_list"))
#: the class attributes of ``traceback.StackSummary`` that receive the frames
_SUMMARY_ATTRS = ("extract", "_extract_from_extended_frame_gen")
_SNAPSHOT: list[tuple[Any, str, Any]] = []


def _allow() -> None:
    """Fill :data:`_ALLOWED` (module docstring: functions that read a frame and hand out none),
    import :data:`_PRELOAD` and take :data:`_SNAPSHOT`."""
    for mod in _PRELOAD:
        try:
            importlib.import_module(mod)
        except Exception:  # noqa: BLE001 - another torch: refused later, where it is used
            pass
    for mod, name in _PASSED_TO:
        d = importlib.import_module(mod).__dict__
        _SNAPSHOT.append((d, name, d.get(name)))
    summary_cls = importlib.import_module("traceback").StackSummary
    for name in _SUMMARY_ATTRS:
        _SNAPSHOT.append((summary_cls.__dict__, name, summary_cls.__dict__.get(name)))
    # read a frame's module name or file and line only (each function's own lookups checked)
    plain = ["typing:_caller", "typing_extensions:_caller",
             "typing_extensions:_has_generic_or_protocol_as_origin", "collections:namedtuple",
             "enum:EnumType._create_", "torch.library:Library.__init__",
             "traceback:extract_stack", "traceback:format_stack",
             "torch.fx.experimental.symbolic_shapes:expect_true"]
    for path in plain:
        c = _code(path)
        if c is not None:
            _ALLOWED[c] = None
    find_caller = _code("logging:Logger.findCaller")
    current = _lambda_code("logging", "currentframe")
    if find_caller is not None and current is not None:
        # (the lambda alone would hand out the caller's frame; findCaller with stack_info passes
        # the frame to traceback.print_stack: refused)
        _ALLOWED[current] = frozenset({find_caller})
    # (_get_user_frame returns the frame it finds: allowed to its two callers in torch, which keep
    # a file name and line, or read the line's bytecode)
    user = _code("torch.fx.experimental.symbolic_shapes:ShapeEnv._get_user_frame")
    callers = frozenset({_code("torch.fx.experimental.symbolic_shapes:ShapeEnv._get_stack_summary"),
                         _code("torch.fx.experimental.symbolic_shapes:ShapeEnv._is_python_assert")}
                        - {None})
    if user is not None and callers:
        _ALLOWED[user] = callers
    consumers = {_code("traceback:StackSummary._extract_from_extended_frame_gen"),
                 _code("traceback:StackSummary.extract")} - {None}
    for path in ("traceback:walk_tb", "traceback:_walk_tb_with_full_positions"):
        c = _code(path)
        if c is not None:
            _TB_WALKERS[c] = frozenset(consumers)
    c = _code("inspect:currentframe")
    if c is not None:
        _CURRENTFRAME.append(c)


def _unpatched() -> bool:
    return all(d.get(name) is was for d, name, was in _SNAPSHOT)


def _allowed(frame: Any) -> bool:
    """Whether the Python code that raised the event (``frame``: the frame that called the
    auditing function or read the attribute) may have the frame: its code is allowed, with the
    caller it requires (and, for those that pass frames on, the module globals they call are still
    the ones they had when the hook was installed)."""
    if frame is None:
        return False
    walker = _TB_WALKERS.get(frame.f_code)
    if walker is not None:  # a traceback formatted (Python's or pytest's unraisable hook)
        up = frame.f_back
        return up is not None and up.f_code in walker and \
            not up.f_locals.get("capture_locals", True) and _unpatched()
    code = frame.f_code
    if _CURRENTFRAME and code is _CURRENTFRAME[0]:  # judged by who asked inspect for the frame
        frame = frame.f_back
        if frame is None:
            return False
        code = frame.f_code
    if code not in _ALLOWED:
        return False
    need = _ALLOWED[code]
    if need is None:
        return _unpatched()
    up = frame.f_back
    if up is None or up.f_code not in need:
        return False
    # logging's findCaller: not with stack_info (it passes the frame on), its helpers unpatched
    return not up.f_locals.get("stack_info", False) and _unpatched()


def _hook(event: str, args: tuple) -> None:
    st = _STATE
    if not st.depth or st.busy:
        return
    if event not in _EVENTS:
        if event == "object.__setattr__" and len(args) >= 2 and args[1] in _FUNCTION_PARTS:
            # a function's code or defaults replaced in place: the object the names' watch
            # compares by identity stays the same (ninety-second review); nothing dpclip or
            # torch runs inside a step does it
            _refuse(st, f"setting a function's {args[1]}")
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
    _refuse(st, what)


def _refuse(st: Any, what: str) -> None:
    if st.why is None:
        st.why = what
    raise FrameAccessRefused(
        f"{what} inside a private step: code the step runs (the forward, the loss, or a "
        "finalizer the engine's own code set off) may not reach the engine's frames, callbacks "
        "or the process's objects, nor change a function's code in place (it could rewrite the "
        "step's result or read the secret noise generator); the step is refused")


def _install() -> None:
    global _INSTALLED
    with _LOCK:
        if not _INSTALLED:
            _allow()
            sys.addaudithook(_hook)
            _INSTALLED = True


def _removable(callback: Any) -> bool:
    """Whether an interpreter callback (what ``sys.gettrace()`` / ``sys.getprofile()`` return)
    can be switched off here and put back exactly: one set from Python (``sys.settrace`` /
    ``sys.setprofile``: a callable, put back by the same call) or ``cProfile``'s profiler (set
    from C, put back by its own C ``enable``). Any other object there was set from C by an
    extension (``torch.profiler``'s Python stack tracer, ``with_stack=True``): Python cannot put
    it back once switched off (``sys.setprofile`` of it installs a call of an object that is not
    callable: the next Python call raises ``TypeError``), and it runs that extension's C code,
    which is inside the trust boundary (module docstring): it stays on."""
    return callback is None or callable(callback) or isinstance(callback, _lsprof.Profiler)


def callbacks_off() -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    """Switch off this thread's trace and profile callbacks where :func:`_removable`; returns
    ``(found, left)``: the callbacks found, and those left on (``None`` where switched off). Put
    ``found`` back with :func:`put_back_callbacks`."""
    found = (sys.gettrace(), sys.getprofile())
    left = tuple(c if not _removable(c) else None for c in found)
    if found[0] is not left[0]:
        sys.settrace(None)
    if found[1] is not left[1]:
        sys.setprofile(None)
    return found, left  # type: ignore[return-value]


def put_back_callbacks(trace: Any, profile: Any) -> None:
    """Make this thread's trace and profile callbacks ``trace`` and ``profile`` again (as read
    from ``sys.gettrace()`` / ``sys.getprofile()`` before): a Python callable with
    ``sys.settrace`` / ``sys.setprofile``; ``cProfile``'s profiler by its C ``enable`` (the
    class's own method: a subclass's override is not called; its flags are kept); an object set
    from C that is not callable cannot be put back from Python: it is left off (a tool that
    :func:`callbacks_off` never switches off).

    Inside a private step it installs nothing but ``None`` and the callbacks found when the step's
    outermost window was entered (the caller's own): model code calling it (it is a plain
    function, and the audit hook lets it set callbacks) installed its own profile function, which
    then scaled the engine's result by 50 on a return outside the reductions (eighty-fifth hostile
    review: LOO 110.9 C under ghost, vmap and auto's first step); such a call is refused here and
    the step refused at its end."""
    st = _STATE
    if st.depth:
        for got, was, kind in ((trace, st.entry[0], "trace"), (profile, st.entry[1], "profile")):
            if got is not None and got is not was:
                why = (f"dpclip.engine.frames_guard.put_back_callbacks, asked to install a {kind} "
                       "function the step did not begin with,")
                if st.why is None:
                    st.why = why
                raise FrameAccessRefused(f"{why} {_REFUSAL}")
    if sys.gettrace() is not trace and (trace is None or callable(trace)):
        sys.settrace(trace)
    if sys.getprofile() is not profile:
        if isinstance(profile, _lsprof.Profiler):
            _lsprof.Profiler.enable(profile)
        elif profile is None or callable(profile):
            sys.setprofile(profile)


_OWN.update((callbacks_off.__code__, put_back_callbacks.__code__))


_REFUSAL = ("was called inside the private step (by the forward, the loss, or a finalizer that "
            "ran inside the engine): such code could reach the engine's frames and rewrite its "
            "result or read the secret noise generator (forty-sixth hostile review); the step is "
            "refused. Do not inspect frames, tracebacks or the garbage collector's objects, or "
            "set interpreter callbacks, in code a private step runs")


@_cm.contextmanager
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
        st.entry = (sys.gettrace(), sys.getprofile())
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
