"""Seventy-second and seventy-fourth hostile reviews (auto on the compiled path): state written by a finalizer of a
traced step, read by later graph steps.

1. A module-level tensor the forward reads is a constant of the exported graph; a finalizer of the
   first (traced) private step wrote it with that step's data when the step released its tensors,
   and every later graph step read it live: step 2's release moved by 5.15 C with one example of
   step 1. Now the graph runs on copies of its constants taken when the first chunk of its first
   step read them, and a step whose constant holds other values is refused (``auto``: left to the
   traced path, which refuses it as ever).
2. With ``max_physical_batch``, the graph was adopted after the first chunk of its first step, and
   the second chunk ran the graph while releasing the first chunk's tensors: their finalizer wrote
   a weight through ``.data`` between the graph and its backward (3.10 C). Now a graph is adopted
   only after its whole first step, and a graph chunk never follows a traced chunk in one step.
3. (ghost too) The last release's check compared versions, which a write through ``.data`` does
   not move: a buffer written there reached the next step (5.15 C through ``engine.compute``).
   Now the bytes are compared as well.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from dpclip.engine import AutoEngine, CompiledEngine, GhostEngine, ParamGroups
from dpclip.engine import compiled as compiled_mod
from dpclip.engine.errors import UnsupportedModelError

DT = torch.float64
C = 1.0
G = torch.ones(4, dtype=DT)  # a module-level tensor the forward reads


@pytest.fixture(autouse=True)
def _collected():
    """The attacks leave finalizers in reference cycles: collected between the tests, not inside
    a later test's step (where they would run their torch operations under the proof's export)."""
    gc.collect()
    yield
    gc.collect()
    G.fill_(1.0)


def _real(t) -> bool:
    return type(t) is torch.Tensor and not isinstance(t, torch._subclasses.FakeTensor)


def ce(out, y):
    return nn.functional.cross_entropy(out, y, reduction="none")


def wf(n):
    return torch.clamp(C / n, max=1.0)


def _outlier(d) -> bool:
    return _real(d) and float(d.abs().amax()) > 0.999999  # (the outlier saturates tanh)


def _write_global(d):
    if _outlier(d):
        with torch.no_grad():
            G.mul_(-50.0)


class ReadsGlobal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc0, self.fc1 = nn.Linear(5, 4).to(DT), nn.Linear(4, 3).to(DT)

    def forward(self, x):
        h = torch.tanh(self.fc0(x))
        u = h * G
        weakref.finalize(u, _write_global, h.detach())  # (fc1's input: held until the reads end)
        return self.fc1(u)


def _write_weight(w, d):
    if _outlier(d):
        w.data.mul_(-50.0)  # (no version bump)


class WritesWeight(ReadsGlobal):
    def forward(self, x):
        h = torch.tanh(self.fc0(x))
        weakref.finalize(h, _write_weight, self.fc1.weight, h.detach())
        return self.fc1(h)


def _write_buffer(b, d):
    if _outlier(d):
        b.data.mul_(-50.0)


class WritesBuffer(ReadsGlobal):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(4, dtype=DT))

    def forward(self, x):
        h = torch.tanh(self.fc0(x))
        u = h * self.scale
        weakref.finalize(u, _write_buffer, self.scale, h.detach())
        return self.fc1(u)


def _data():
    g = torch.Generator().manual_seed(0)
    x1, y1 = torch.randn(8, 5, generator=g, dtype=DT), torch.randint(0, 3, (8,), generator=g)
    x1[0] *= 50
    x2, y2 = torch.randn(8, 5, generator=g, dtype=DT), torch.randint(0, 3, (8,), generator=g)
    return x1, y1, x2, y2


def _flat(res):
    return torch.cat([t.reshape(-1) for t in res.grads.values()])


def _second_step_moved(build, make) -> float | None:
    """How far step 2's release (the same batch in both worlds) moves when step 1 holds the
    outlier or not (sound: 0), or None when a step was refused."""
    x1, y1, x2, y2 = _data()
    got = []
    for with_x0 in (True, False):
        G.fill_(1.0)
        model = build()
        compiled_mod.reset(model)
        eng = make()
        a, b = (x1, y1) if with_x0 else (x1[1:], y1[1:])
        try:
            eng.compute(model, ce, a, b, wf, ParamGroups.flat(model))  # step 1 (traced)
            for _ in range(2):  # steps 2 and 3: the graph where it was adopted
                res = eng.compute(model, ce, x2, y2, wf, ParamGroups.flat(model))
        except UnsupportedModelError:
            return None
        got.append(_flat(res))
    return float((got[0] - got[1]).norm()) / C


ENGINES = {"auto": AutoEngine, "compiled": CompiledEngine, "ghost": GhostEngine}


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("build", [ReadsGlobal, WritesBuffer])
def test_a_finalizer_of_the_first_step_moves_no_later_step(build, engine):
    moved = _second_step_moved(build, ENGINES[engine])
    assert moved is None or moved <= 1e-12, moved
    G.fill_(1.0)


@pytest.mark.parametrize("engine", ["auto", "compiled", "ghost"])
def test_a_finalizer_of_a_traced_chunk_reaches_no_graph_chunk(engine):
    """Chunks of 4 of a batch of 8: LOO at most C (or refused) on the first two steps."""
    x, y, _, _ = _data()
    make = lambda: ENGINES[engine](max_physical_batch=4)  # noqa: E731
    for _ in range(2):
        try:
            runs = []
            for keep in (slice(None), slice(1, None)):
                model = WritesWeight()
                compiled_mod.reset(model)
                eng = make()
                res = eng.compute(model, ce, x[keep], y[keep], wf, ParamGroups.flat(model))
                runs.append(_flat(res))
        except UnsupportedModelError:
            continue
        assert float((runs[0] - runs[1]).norm()) <= C * (1 + 1e-9)


def test_a_graph_is_adopted_after_its_whole_first_step():
    """Every chunk of the first step runs traced (its checks) before the graph is adopted; the
    step's sum is then the graph's, every chunk of it (session 24), and so from then on."""
    from tests.engine.test_compiled_engine import Block, _seq, graph_runs
    from tests.engine.helpers import clip_weights

    model = Block().to(DT)
    x, y = _seq(b=6)
    compiled_mod.reset(model)
    eng = CompiledEngine(max_physical_batch=2)
    traced = []
    real = GhostEngine._chunks

    def chunks(self, *a, **k):  # (the step's passes: the traced one adopts, the graph's releases)
        res = real(self, *a, **k)
        traced.append(res.engine_info.get("program"))
        return res

    GhostEngine._chunks = chunks
    try:
        for step in range(2):
            traced.clear()
            with graph_runs() as ran:
                res = eng.compute(model, ce, x, y, clip_weights(C), ParamGroups.flat(model))
            assert ran[0] == 3 and res.engine_info["program"] == "compiled"
            assert traced == ([None, "compiled"] if step == 0 else ["compiled"])
    finally:
        GhostEngine._chunks = real


def test_a_constant_changed_after_adoption_refuses_the_graph():
    """The graph runs on the constants its first step read; a module-level tensor changed since
    refuses the graph step (compiled), or leaves it to the traced path (auto), which refuses a
    value written where no step saw it."""
    x, y, _, _ = _data()
    x = x / 50.0  # (no outlier: the finalizer writes nothing)
    for make in (CompiledEngine, AutoEngine):
        G.fill_(1.0)
        model = ReadsGlobal()
        compiled_mod.reset(model)
        eng = make()
        for _ in range(3):
            res = eng.compute(model, ce, x, y, wf, ParamGroups.flat(model))
        assert res.engine_info["program"] == "compiled"
        G.mul_(2.0)
        with pytest.raises(UnsupportedModelError, match="holds other values"):
            eng.compute(model, ce, x, y, wf, ParamGroups.flat(model))
    G.fill_(1.0)


def test_the_collector_is_paused_in_a_graph_step_and_restored():
    from tests.engine.test_compiled_engine import Block, _seq
    from tests.engine.helpers import clip_weights

    seen = []
    real = compiled_mod.Plan.run

    def run(self, *a, **k):
        seen.append(gc.isenabled())
        return real(self, *a, **k)

    model = Block().to(DT)
    x, y = _seq()
    compiled_mod.reset(model)
    assert gc.isenabled()
    compiled_mod.Plan.run = run
    try:
        for _ in range(3):
            AutoEngine().compute(model, ce, x, y, clip_weights(C), ParamGroups.flat(model))
    finally:
        compiled_mod.Plan.run = real
    assert seen == [False, False, False] and gc.isenabled()


# Seventy-fourth hostile review: a finalizer attached by the forward to its INPUT, which the engine
# itself made (a chunk of one's doubled copy, a chunk's slice), ran when the engine dropped it: after
# the last release's check (4.76 C on the compiled engine through engine.compute). The engine call
# now compares the parameters and buffers once more after it has dropped everything.


def _write_input(w, d):
    if _real(d) and float(d.abs().amax()) > 20:  # (the outlier)
        w.data.mul_(-50.0)


class InputFinalizer(ReadsGlobal):
    def forward(self, x):
        weakref.finalize(x, _write_input, self.fc1.weight, x.detach())
        return self.fc1(torch.tanh(self.fc0(x)))


def _later_moved(make, first: tuple, second: tuple) -> float | None:
    _, _, x2, y2 = _data()
    got = []
    for a, b in (first, second):
        model = InputFinalizer()
        compiled_mod.reset(model)
        eng = make()
        try:
            eng.compute(model, ce, a, b, wf, ParamGroups.flat(model))
            for _ in range(2):
                res = eng.compute(model, ce, x2, y2, wf, ParamGroups.flat(model))
        except UnsupportedModelError:
            return None
        got.append(_flat(res))
    return float((got[0] - got[1]).norm()) / C


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("chunked", [False, True])
def test_a_finalizer_on_an_input_the_engine_made_moves_no_later_step(engine, chunked):
    x1, y1, _, _ = _data()
    if chunked:  # (8 rows in chunks of 4 against 7)
        make = lambda: ENGINES[engine](max_physical_batch=4)  # noqa: E731
        first, second = (x1, y1), (x1[1:], y1[1:])
    else:  # a chunk of one runs as a batch of two: the engine's copy
        make = ENGINES[engine]
        first, second = (x1[:1], y1[:1]), (x1[1:2], y1[1:2])
    moved = _later_moved(make, first, second)
    assert moved is None or moved <= 1e-12, moved


def test_the_collector_runs_in_traced_chunks():
    """Paused for graph chunks only: a traced chunk (the first private step) keeps it, so that
    the cycles its user code leaves are finalized inside its checks."""
    from tests.engine.test_compiled_engine import Block, _seq
    from tests.engine.helpers import clip_weights
    from dpclip.engine import ghost_forward

    seen = []
    real = ghost_forward._forward_traced

    def traced(*a, **k):
        seen.append(gc.isenabled())
        return real(*a, **k)

    model = Block().to(DT)
    x, y = _seq()
    compiled_mod.reset(model)
    ghost_forward._forward_traced = traced
    try:
        AutoEngine().compute(model, ce, x, y, clip_weights(C), ParamGroups.flat(model))
    finally:
        ghost_forward._forward_traced = real
    assert seen and all(seen)
