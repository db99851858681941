"""Session 24: a graph's first step releases the GRAPH's sum (issue 31's open item).

The history check of the traced path observes the user's autograd graph, which user code with
torch's dispatch off can rewrite; every review aimed at it found one more property to compare
(152-163). Its last test, "a saved tensor was handed back by the step's watch", counts the watch's
unpacks, which user code can also call: review 159's rewrite (a node of the matched operation's
class rebuilt under the forward's own saved-tensor hooks) with the unpack hook calling the step's
watch's own ``unpack`` moves every example's gradient by 13.3 C on the traced path.

On the compiled path the first step of a graph ran traced and was released from the user's
autograd graph, so the attack reached ``auto`` and ``compiled`` (13.3 C at the session's start).
The first step now runs traced for its checks only: the graph is adopted and the step's sum comes
from it, as on every later step. On the traced path (``engine="ghost"``, and ``auto`` on models its compiled path refuses) each
tensor one of torch's own functions returns is now stamped with its autograd node when the
function returns, before any user code runs, and a matched operation's output must carry that
node: the rebuilt node is refused (docs/engines.md, "Session 24").
"""

from __future__ import annotations

import functools
import sys

import pytest
import torch

from dpclip.engine import AutoEngine, ParamGroups, get_engine
from dpclip.engine import compiled as compiled_mod
from tests.engine.helpers import clip_weights
from tests.engine.test_compiled_engine import Block, _equal_to_the_loop, _seq, graph_runs
from tests.engine.test_review137_neg_bit_dtype import (DT, _data, _real, _RebasedHistory,
                                                       _refused_or_bounded)
from tests.engine.test_review155_saved_hooks_history import _with_own_saved_hooks
from tests.engine.test_separability_attacks import ce

AC = torch._C._autograd


def _forged_rewrite(h):
    """Review 159's same-class rewrite of ``h = c * z`` under the forward's own saved-tensor
    hooks; read by the check, the unpack hands back the matched operation's own arguments
    THROUGH THE STEP'S WATCH'S ``unpack`` (so they count as handed back by the watch); read by the
    backward, example 0's sign times 1000."""
    _with_own_saved_hooks(h, "own-hooks", forge=True)


class ForgedUnpacks(_RebasedHistory):
    def __init__(self):
        super().__init__()
        self.register_buffer("c", torch.ones(6, dtype=DT))

    def forward(self, x):
        z = self.fc1(x)
        h = torch.mul(self.c, z)
        if _real(x):
            h._dpclip_test_z, h._dpclip_test_x, h._dpclip_test_c = z, x, self.c
            _forged_rewrite(h)
        return self.fc(torch.tanh(h))


@pytest.mark.parametrize("name", ["auto", "compiled"])
def test_a_forged_watch_unpack_is_bounded_on_the_graph(name):
    """Every step of ``auto`` and ``compiled`` is released from the graph: at most C (13.3 C at
    the session's start, where the first step was released from the user's autograd graph)."""
    x, y = _data(8, "value")  # (example 0's first feature positive, the others' negative)
    d = _refused_or_bounded(name, ForgedUnpacks, x, y)
    assert d <= 1 + 1e-6, f"{name}: LOO {d:.3f} C"


def test_a_forged_watch_unpack_is_refused_on_the_traced_ghost_engine():
    """The traced path: each tensor one of torch's functions returns is stamped with its
    autograd node when the function returns, before any user code runs; the node rebuilt
    afterwards is refused however like the proof's it is (13.3 C at the session's start)."""
    x, y = _data(8, "value")
    d = _refused_or_bounded("ghost", ForgedUnpacks, x, y)
    assert d <= 1 + 1e-6, f"ghost: LOO {d:.3f} C"


class OutsideFunctions(_RebasedHistory):
    """The matched ``mul`` itself called with torch functions switched off (no stamp: what it
    returns is seen by no function's return), then review 159's rewrite with the forged unpack."""

    def __init__(self):
        super().__init__()
        self.register_buffer("c", torch.ones(6, dtype=DT))

    def forward(self, x):
        z = self.fc1(x)
        if _real(x):
            with torch._C.DisableTorchFunction():
                h = torch.mul(self.c, z)
            h._dpclip_test_z, h._dpclip_test_x, h._dpclip_test_c = z, x, self.c
            _forged_rewrite(h)
        else:
            h = torch.mul(self.c, z)
        return self.fc(torch.tanh(h))


def _user_mul(c, z):
    """A user function that dispatches itself through torch's function protocol: the mode calls
    it (popped), so what runs inside is user code that no function's return covers."""
    from torch.overrides import handle_torch_function, has_torch_function

    if has_torch_function((c, z)):
        return handle_torch_function(_user_mul, (c, z), c, z)
    h = torch.mul(c, z)
    if _real(z):
        h._dpclip_test_z, h._dpclip_test_x, h._dpclip_test_c = z, _user_mul.x, c
        _forged_rewrite(h)
    return h


class OwnDispatch(_RebasedHistory):
    def __init__(self):
        super().__init__()
        self.register_buffer("c", torch.ones(6, dtype=DT))

    def forward(self, x):
        _user_mul.x = x
        return self.fc(torch.tanh(_user_mul(self.c, self.fc1(x))))


class ReturnedAsGiven(ForgedUnpacks):
    """The rewrite, then functions that return the tensor they were given (``contiguous``,
    ``requires_grad_``, ``to`` of its own dtype) before its next use: they must not stamp the
    rebuilt node."""

    def forward(self, x):
        z = self.fc1(x)
        h = torch.mul(self.c, z)
        if _real(x):
            h._dpclip_test_z, h._dpclip_test_x, h._dpclip_test_c = z, x, self.c
            _forged_rewrite(h)
            h = h.contiguous().requires_grad_().to(h.dtype)
        return self.fc(torch.tanh(h))


class _TorchFunctionArg:
    """Hundred-and-sixty-sixth hostile review: a plain object with ``__torch_function__`` given to
    ``torch.add``; torch calls it (user code) inside that function, where the tracer's mode is
    popped: it ran the matched ``mul`` and rebuilt its node, which no stamp covered (13.3 C under
    ghost, auto's traced path and make_private)."""

    body = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.body()
        return args[0]


class _Index:
    """The same through ``__index__`` of a size that ``Tensor.split`` (torch's Python) passes on
    to ``split_with_sizes``: 13.3 C."""

    body = None

    def __index__(self):
        if _Index.body is not None:
            b, _Index.body = _Index.body, None
            b()
        return 3


class InsideATorchFunction(ForgedUnpacks):
    how = "torch-function"

    def forward(self, x):
        z = self.fc1(x)
        box = {}

        def body():
            h = torch.mul(self.c, z)
            if _real(x):
                h._dpclip_test_z, h._dpclip_test_x, h._dpclip_test_c = z, x, self.c
                _forged_rewrite(h)
            box["h"] = h

        if self.how == "torch-function":
            _TorchFunctionArg.body = body
            torch.add(self.c, _TorchFunctionArg())
        elif self.how == "index":
            _Index.body = body
            torch.ones(6, dtype=DT).split([_Index(), 3])
        else:  # a profile function set before the step (test below) ran inside torch's
            # Python functions (13.3 C): here inside the inner __rsub__ of the wrapper the mode
            # runs
            _PROFILED["body"] = body
            _ = 1 - self.c
        # (the profile function is switched off inside torch's functions: body never ran)
        h = box["h"] if "h" in box else torch.mul(self.c, z)
        return self.fc(torch.tanh(h))


_PROFILED: dict = {}


def _profile(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "__rsub__" and "body" in _PROFILED:
        _PROFILED.pop("body")()


def _inside(how):
    cls = type(f"Inside_{how}", (InsideATorchFunction,), {"how": how})
    return cls


@pytest.mark.parametrize("model", [OutsideFunctions, OwnDispatch, ReturnedAsGiven,
                                   _inside("torch-function"), _inside("index"),
                                   _inside("profile")],
                         ids=["torch-functions-off", "own-function-dispatch",
                              "returned-as-given", "argument-torch-function",
                              "argument-index", "profile-function"])
@pytest.mark.parametrize("name", ["ghost", "auto", "compiled"])
def test_operations_outside_torch_s_functions_are_refused_or_bounded(model, name):
    """An operation matched outside every torch function the trace sees return has no stamp:
    refused on the traced path (``ProgramMatch.fn_enter``); on the graph, bounded."""
    x, y = _data(8, "value")
    profiled = model.__name__ == "Inside_profile"
    if profiled:  # (set by the caller's loop, before the step: not refused as one set inside)
        sys.setprofile(_profile)
    try:
        d = _refused_or_bounded(name, model, x, y)
        # (a trace or profile function is switched off inside torch's own functions, and put
        # back after them: it never saw the frame of torch's __rsub__ on a traced step)
        assert not profiled or name == "compiled" or "body" in _PROFILED
        assert sys.getprofile() is (_profile if profiled else None)
    finally:
        sys.setprofile(None)
        _PROFILED.clear()
    assert d <= 1 + 1e-6, f"{name}: LOO {d:.3f} C"


def test_torch_s_own_functions_are_told_from_user_code():
    """What counts as one of torch's own functions (:func:`separable._library`): builtins of
    torch, ATen operations, torch's Python functions as their files define them; not a function
    given torch's code with other globals, a user function, a callback-taking builtin, or a
    custom Function's apply."""
    import types

    import torch.nn.functional as F
    from dpclip.engine.separable import _library

    for f in (torch.tanh, torch.Tensor.add_, torch.Tensor.__setitem__, F.linear, F.layer_norm,
              F.relu, torch.Tensor.split, torch.ops.aten.add.Tensor, torch._C._nn.linear):
        assert _library(f), f
    forged = types.FunctionType(F.relu.__code__, {"torch": torch}, "relu")
    forged.__module__ = "torch.nn.functional"

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    for f in (forged, _user_mul, torch.Tensor.apply_, exec, Fn.apply, print):
        assert not _library(f), f


def test_the_first_step_runs_traced_checks_then_releases_the_graph():
    """The first private step runs the traced pass (its checks, its sum dropped) and then the
    graph, whose sum equals the float64 per-example loop; a refusal of the traced pass stops the
    step before the graph is adopted."""
    from dpclip.engine import GhostEngine
    from dpclip.engine.errors import UnsupportedModelError

    model = Block().to(DT)
    x, y = _seq()
    g = ParamGroups.flat(model)
    compiled_mod.reset(model)
    passes = []
    real = GhostEngine._chunks

    def chunks(self, *a, **k):
        res = real(self, *a, **k)
        passes.append(res.engine_info.get("program", "traced"))
        return res

    GhostEngine._chunks = chunks
    try:
        with graph_runs() as ran:
            res = AutoEngine().compute(model, ce, x, y, clip_weights(0.5), g)
        # (the public probe traced; the first private step traced for its checks, then the graph)
        assert passes == ["traced", "traced", "compiled"] and ran[0] == 1
        assert res.engine_info["program"] == "compiled"
        _equal_to_the_loop(res, model, ce, x, y, g)
        # a model whose first private step the traced checks refuse (a tensor hook, which the
        # graph does not show): no graph is adopted or run
        hooked = TensorHooked().to(DT)
        compiled_mod.reset(hooked)
        passes.clear()
        with graph_runs() as ran, pytest.raises(UnsupportedModelError, match="hook"):
            AutoEngine().compute(hooked, ce, x, y, clip_weights(0.5), ParamGroups.flat(hooked))
        assert ran[0] == 0 and "compiled" not in passes
    finally:
        GhostEngine._chunks = real


class TensorHooked(Block):
    def forward(self, x):
        h = self.inp(x)
        if h.requires_grad:
            h.register_hook(lambda grad: grad * 10)
        return self.head(h.mean(1))


# ------------------------------------------------- review 165: between the two passes


class _Writer:
    def __init__(self, b, value):
        self.b, self.value = b, value

    def __del__(self):
        with torch._C.DisableTorchFunction():
            guard = torch._C._DisableTorchDispatch()
            try:
                self.b.data.fill_(self.value)
            finally:
                del guard


class CacheWritesBetweenPasses(torch.nn.Module):
    """Hundred-and-sixty-fifth hostile review: a memoised method's value, dropped when the
    engine clears the model's method caches at the end of the traced chunk (after that pass's
    last check), wrote example 0's sign times 1000 into a buffer that the graph pass then read;
    the weight function (run in the graph pass's reduction, after the graph read it) put the
    buffer back: 8.0 C under auto and compiled, through make_private too."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc = torch.nn.Linear(4, 6).to(DT), torch.nn.Linear(6, 3).to(DT)
        self.register_buffer("b", torch.zeros(6, dtype=DT))

    @functools.lru_cache(maxsize=None)  # noqa: B019 - the attack's vehicle
    def _mark(self, value):
        return _Writer(self.b, value)

    def forward(self, x):
        if _real(x):
            with torch._C.DisableTorchFunction():
                guard = torch._C._DisableTorchDispatch()
                try:
                    live = bool(x.abs().sum() > 0)  # (not auto's public probe of zeros)
                    s = 1.0 if bool(x[0, 0] > 0) else -1.0
                finally:
                    del guard
            if live:
                self._mark(1000.0 * s)
        return self.fc(torch.tanh(self.fc1(x)) + self.b)


@pytest.mark.parametrize("name", ["auto", "compiled"])
def test_state_written_between_the_two_passes_is_refused(name):
    """The graph pass of a graph's first step must find the parameters, buffers and batch the
    step began with (``ghost._StepState``): refused (8.0 C before)."""
    from dpclip.engine import get_engine
    from dpclip.engine.errors import UnsupportedModelError
    from tests.engine.test_review137_neg_bit_dtype import C, _ce

    def weights(model):
        clip = clip_weights(C)

        def fn(norms):
            model.b.data.zero_()  # (the restore, after the graph read the buffer)
            return clip(norms)
        return fn

    x, y = _data(8, "value")
    sums = []
    try:
        for keep in (slice(None), slice(1, None)):
            model = CacheWritesBetweenPasses()
            compiled_mod.reset(model)
            res = get_engine(name).compute(model, _ce, x[keep], y[keep], weights(model),
                                           ParamGroups.flat(model))
            sums.append(torch.cat([g.reshape(-1) for g in res.grads.values()]))
    except UnsupportedModelError as exc:
        assert "changed while the graph's first step" in str(exc)
        return
    d = float((sums[0] - sums[1]).norm()) / C
    assert d <= 1 + 1e-6, f"{name}: LOO {d:.3f} C"


# ------------------------------------------------- review 167: user code inside F.softmax


class InsideSoftmax(ForgedUnpacks):
    """Hundred-and-sixty-seventh hostile review: user code ran inside ``F.softmax`` (torch's
    Python) with plain tensor arguments, through the tensor's own attribute ``softmax`` (which
    hides the Tensor method F.softmax calls) or a replaced ``warnings.showwarning`` (F.softmax
    without ``dim`` warns): there it ran the matched ``mul`` and rebuilt its node, kept it and
    used it after F.softmax returned: 13.3 C under ghost (13.6 C with an in-place write through
    a view, which sends ``auto`` to the traced path)."""

    how = "attribute"

    def forward(self, x):
        import warnings

        import torch.nn.functional as F

        z = self.fc1(x)
        box = {}

        def body(*args, **kwargs):
            h = torch.mul(self.c, z)
            if _real(x):
                h._dpclip_test_z, h._dpclip_test_x, h._dpclip_test_c = z, x, self.c
                _forged_rewrite(h)
            box["h"] = h
            return torch.ones(6, dtype=DT)

        t = torch.ones(6, dtype=DT)
        if self.how == "attribute":
            t.softmax = body
            F.softmax(t, 0)
        else:
            real = warnings.showwarning
            warnings.showwarning = body
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("always")
                    warnings.showwarning = body
                    F.softmax(t)
            finally:
                warnings.showwarning = real
        h = box["h"] if "h" in box else torch.mul(self.c, z)
        return self.fc(torch.tanh(h))


@pytest.mark.parametrize("how", ["attribute", "showwarning"])
@pytest.mark.parametrize("layer", ["channels", "made-in"])
@pytest.mark.parametrize("name", ["ghost", "auto-traced"])
def test_user_code_inside_a_torch_function_is_refused_or_bounded(name, layer, how, monkeypatch):
    """Two layers (each failed before): a function whose arguments hide Tensor attributes, or
    that would warn through replaced display functions, is not torch's own (its operations are
    outside torch's functions: refused); and, those checks switched off here (``made-in``), a
    tensor made inside a call of torch's functions that returned without returning it is refused
    when used after (``ProgramMatch._made_in``)."""
    from dpclip.engine import separable

    if layer == "made-in":
        monkeypatch.setattr(separable, "_TENSOR_NAMES", frozenset())
        monkeypatch.setattr(separable, "_warnings_own", lambda: True)
    model = type(f"InsideSoftmax_{how}", (InsideSoftmax,), {"how": how})
    x, y = _data(8, "value")
    eng = "ghost" if name == "ghost" else AutoEngine(compiled=False)
    from dpclip.engine.errors import UnsupportedModelError
    from tests.engine.helpers import loo_distance
    from tests.engine.test_review137_neg_bit_dtype import C, _ce

    try:
        d = loo_distance((lambda: get_engine(eng)) if isinstance(eng, str) else (lambda: eng),
                         model, x, y, C, loss=_ce)
    except UnsupportedModelError:
        d = 0.0
    assert d <= 1 + 1e-6, f"{name}: LOO {d:.3f} C"


# ------------------------------------------------- review 168: the graph pass runs the graph


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc = torch.nn.Linear(4, 6).to(DT), torch.nn.Linear(6, 3).to(DT)
        self.scale = 1.0  # (a plain attribute: part of the proof's key)

    def forward(self, x):
        return self.fc(torch.tanh(self.fc1(x)) * self.scale)


@pytest.mark.parametrize("name", ["auto", "compiled"])
def test_the_graph_pass_runs_only_the_adopted_graph(name, monkeypatch):
    """Hundred-and-sixty-eighth hostile review: a collector finalizer between the two passes of
    a graph's first step changed a plain attribute (the proof's key, which ``_StepState`` does not
    compare); the second pass proved another program, ran it TRACED and released that sum (a
    constant baked from example 0: 6.97 C under auto and compiled, make_private too). The graph
    pass now runs only the plans the traced pass adopted; anything else refuses the step. Here
    the attribute is changed between the passes directly."""
    from dpclip.engine import GhostEngine
    from dpclip.engine.errors import UnsupportedModelError
    from tests.engine.test_review137_neg_bit_dtype import C, _ce

    model = _Scaled()
    compiled_mod.reset(model)
    real = GhostEngine._chunks
    calls = []

    def chunks(self, *a, **k):
        res = real(self, *a, **k)
        calls.append(res.engine_info.get("program"))
        if len(calls) == 2:  # (after the public probe and the first private step's traced pass)
            model.scale = 2.0
        return res

    monkeypatch.setattr(GhostEngine, "_chunks", chunks)
    x, y = _data(8, "value")
    eng = get_engine(name)
    if name == "compiled":
        calls.append(None)  # (no public probe)
    with pytest.raises(UnsupportedModelError, match="could not run the graph its traced pass|"
                       "not the graph the traced pass adopted"):
        eng.compute(model, _ce, x, y, clip_weights(C), ParamGroups.flat(model))


# ------------------------------------------------- review 169: what the proof's export is given


_PEEKED: dict = {}


class _ReadsTheExport(torch.nn.Module):
    """Hundred-and-sixty-ninth hostile review (also at the session's start): while the proof's
    export traces it, the forward reads the batch it was given, the padded size through the
    symbolic size's hint (``how="size"``: 25.1 C at B 33 against 32) or the examples' values
    through the fake mode's describer under ``unset_fake_temporarily`` (``how="values"``: the
    parity of the real rows, 2.93 C at B 8, 15.2 C at 24), keeps it in Python and makes a literal
    of it, which the real run makes too: the graph adds a constant computed from the whole
    batch to every example. The export now runs on a public stand-in (zeros, 61 rows)."""

    how = "size"

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(5, 3).to(DT)

    def forward(self, x):
        if isinstance(x.shape[0], torch.SymInt) and "v" not in _PEEKED:
            if self.how == "size":
                _PEEKED["v"] = (float(x.shape[0].node.hint) - 32.0) * 10.0
            else:
                from torch._subclasses.fake_tensor import unset_fake_temporarily

                d = x.fake_mode.fake_tensor_converter.meta_converter.describer
                for r in list(d.lookup_tensor.keys()):
                    if type(r) is torch.Tensor and r.ndim == 2 and r.shape[1] == 5 and \
                            r.shape[0] % 32 == 0:
                        with unset_fake_temporarily():
                            rows = r.tolist()
                        n = len(rows)
                        while n > 1 and rows[n - 1] == rows[0]:  # (the padding copies row 0)
                            n -= 1
                        _PEEKED["v"] = 10.0 * (-1.0) ** n
        c = torch.tensor([_PEEKED.get("v", 0.0), 0, 0, 0, 0], dtype=x.dtype)
        return self.lin(x + c)


@pytest.mark.parametrize("how", ["size", "values"])
@pytest.mark.parametrize("name", ["ghost", "compiled"])
def test_the_proof_s_export_never_sees_the_batch(name, how):
    from tests.engine.helpers import loo_distance
    from tests.engine.test_separability_attacks import ce

    def make():
        _PEEKED.clear()
        compiled_mod.reset()
        return type(f"Reads_{how}", (_ReadsTheExport,), {"how": how})()

    g = torch.Generator().manual_seed(1)
    b = 33 if how == "size" else 8
    x, y = torch.randn(b, 5, generator=g, dtype=DT), torch.randint(0, 3, (b,), generator=g)
    d = loo_distance(lambda: get_engine(name), make, x, y, 1.0, ce)
    assert d <= 1 + 1e-6, f"{name}: LOO {d:.3f} C"
