"""Ninety-second hostile review: library Python code that ran inside the engine's windows (the
reductions under ``exact_float32``, the release under ``collector_paused``) after the names'
check, which a forward could replace without being seen: ``typing``'s and ``abc``'s subclass
checks behind ``isinstance(x, Mapping)`` in the release (the noise zeroed, or the sum released
at 50x, through ``make_private``), ``torch.no_grad()``'s Python (``is_scripting`` rebound:
10.7 C under ghost), ``F.layer_norm`` reading ``torch.backends.cudnn.enabled`` through a Python
descriptor (10.7 C under ghost, auto, compiled), and the globals behind ``Tensor.__rdiv__``'s
wrapper (``C / n`` in a strategy's weights: 50 C under vmap); and, found beside them, a closure
cell of a watched function set in place (50 C on every engine) and a function's ``__code__``
replaced in place.

The tripwire: a profile function (the engine's switch-off of callbacks made a no-op for this test
only) lists every Python function outside dpclip that runs inside a window after its check, for
ghost on a small attention model, vmap with a ``C / n`` weight, and ``make_private`` with several
strategies; only the ones the names' watch covers are allowed (below). A new library call in a
window fails here, to be removed from the window or watched."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

import dpclip
from dpclip.engine import ParamGroups, frames_guard, get_engine, torch_names
from dpclip.engine import _common, isolation
from dpclip.engine.errors import UnsupportedModelError

_DPCLIP = os.path.dirname(os.path.abspath(dpclip.__file__))
_HERE = os.path.abspath(__file__)
#: (file suffix, qualified name) of the library functions a window may run: each is watched
ALLOWED = {
    ("torch/autograd/graph.py", "increment_version"),  # (its lookups: the names' scan)
    ("torch/nn/modules/module.py", "Module.__getattr__"),  # (nn.Module's dict: watched whole)
    ("torch/_tensor.py", "Tensor.__rdiv__"),  # (Tensor's dict, torch._tensor's, the cells)
    ("torch/_tensor.py",
     "_handle_torch_function_and_wrap_type_error_to_not_implemented.<locals>.wrapped"),
    ("<string>", "__create_fn__.<locals>.__init__"),  # (dpclip's own events' dataclass init)
}


class Tiny(nn.Module):
    def __init__(self, v: int = 11, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(v, d)
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, 16), nn.GELU(), nn.Linear(16, d))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.emb(x)
        a, _ = self.attn(self.ln(h), self.ln(h), self.ln(h), need_weights=False)
        h = h + a
        h = h + self.ff(self.ln(h))
        return self.head(h.mean(1))


@pytest.fixture
def library_calls(monkeypatch):
    """The (file, qualified name) of every non-dpclip Python function called inside a window."""
    inside: list[bool] = [False]
    seen: set[tuple[str, str]] = set()
    real_check = torch_names.check
    ends = {_common._exact_inside.__wrapped__.__code__,
            isolation.collector_paused.__wrapped__.__code__}

    def check(where: str) -> None:
        real_check(where)
        if where in ("at a reduction", "at the release"):
            inside[0] = True

    def prof(frame, event, arg):
        if not inside[0] or event != "call":
            return
        co = frame.f_code
        if co in ends:
            inside[0] = False
            return
        path = os.path.abspath(co.co_filename)
        if not path.startswith(_DPCLIP) and path != _HERE:  # (the caller's own weight function)
            seen.add((co.co_filename.split("site-packages/")[-1], co.co_qualname))

    monkeypatch.setattr(torch_names, "check", check)
    monkeypatch.setattr(frames_guard, "callbacks_off",
                        lambda: ((sys.gettrace(), sys.getprofile()),) * 2)
    sys.setprofile(prof)
    try:
        yield seen
    finally:
        sys.setprofile(None)


class ConvNorm(nn.Module):
    """Ninety-third hostile review: a convolution (F.pad, torch.ops.aten.convolution_backward's
    packet reading its instance attribute _op: 26.6 C), GroupNorm and eval BatchNorm (F.group_norm
    / F.batch_norm reading torch.backends.cudnn.enabled through a replaceable getter: 10.4 /
    11.3 C) inside the reduction."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 32, 3, padding=1, padding_mode="reflect")
        self.gn = nn.GroupNorm(4, 32)
        self.conv1 = nn.Conv1d(32, 4, 3)
        self.bn = nn.BatchNorm1d(4).eval()
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.gn(self.conv(x)).flatten(2)  # (B, 32, 16)
        h = self.bn(self.conv1(h))  # (B, 4, 14)
        return self.head(h.mean(2))


def _unexpected(seen):
    return sorted(k for k in seen if k not in ALLOWED)


@pytest.mark.parametrize("engine,kind", [("ghost", "tiny"), ("vmap", "tiny"),
                                         ("ghost", "conv"), ("auto", "conv"),
                                         ("ghost-gram", "conv")])
def test_the_engines_windows_run_no_other_library_python(library_calls, engine, kind):
    torch.manual_seed(0)
    if kind == "tiny":
        model = Tiny()
        x, y = torch.randint(0, 11, (6, 5)), torch.randint(0, 3, (6,))
    else:
        model = ConvNorm()
        x, y = torch.randn(6, 2, 4, 4), torch.randint(0, 3, (6,))
    loss = nn.CrossEntropyLoss(reduction="none")
    wf = lambda n: 1.0 / torch.clamp(n, min=1.0)  # noqa: E731 - (a scalar / tensor)
    eng = get_engine("ghost", norm_mode="ghost") if engine == "ghost-gram" else get_engine(engine)
    for _ in range(2):
        eng.compute(model, loss, x, y, wf, ParamGroups.flat(model))
    assert _unexpected(library_calls) == []


@pytest.mark.parametrize("strategy,engine", [("fixed", "auto"), ("auto-s", "ghost"),
                                             ("psac", "vmap"), ("adaclip", "vmap")])
def test_the_private_steps_windows_run_no_other_library_python(library_calls, strategy,
                                                               engine):
    torch.manual_seed(0)
    model = Tiny()
    x, y = torch.randint(0, 11, (24, 5)), torch.randint(0, 3, (24,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp = dpclip.make_private(model, opt, (x, y), noise_multiplier=1.0, steps=2, batch_size=6,
                             strategy=strategy, engine=engine, verbose=False)
    for i, (xb, yb) in enumerate(dp.loader):
        dp.backward(xb, yb)
        opt.step()
        if i >= 1:
            break
    assert _unexpected(library_calls) == []


def test_a_closure_cell_of_a_watched_function_set_from_the_forward_is_refused():
    cells = vars(torch.Tensor)["__rdiv__"].__closure__
    orig = cells[0].cell_contents

    def evil(self, other):
        return orig(self, other) * 50

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            cells[0].cell_contents = evil
            return self.fc(x)

    torch.manual_seed(0)
    model = M()
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    wf = lambda n: 1.0 / torch.clamp(n, min=1.0)  # noqa: E731
    try:
        for engine in ("vmap", "auto"):
            with pytest.raises(UnsupportedModelError, match="closure cell"):
                get_engine(engine).compute(model, lambda o, t: ((o - t) ** 2).sum(1), x, y, wf,
                                           ParamGroups.flat(model))  # (50 C before)
            assert cells[0].cell_contents is orig  # put back
    finally:
        cells[0].cell_contents = orig


def test_a_functions_code_replaced_in_place_inside_the_step_is_refused():
    import torch.autograd.graph as graph

    fn = graph.increment_version
    code = fn.__code__

    def other(tensor):  # (a stand-in body)
        return None

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            fn.__code__ = other.__code__
            return self.fc(x)

    torch.manual_seed(0)
    model = M()
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    try:
        with pytest.raises((UnsupportedModelError, frames_guard.FrameAccessRefused),
                           match="__code__"):
            get_engine("ghost").compute(model, lambda o, t: ((o - t) ** 2).sum(1), x, y,
                                        lambda n: torch.clamp(1.0 / n, max=1.0),
                                        ParamGroups.flat(model))
    finally:
        fn.__code__ = code
