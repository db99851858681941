"""Chunks (and steps) of one example cannot read each other (issue 31).

Chunks and steps share Python state. Each attack below keeps something of its example on every
call and adds ``5 *`` what the previous call kept; on main (26a8926) ghost accepted every attack at
``max_physical_batch=1`` and over steps of one example, auto at ``max_physical_batch=1``, with the
LOO in ``ACCEPTED_BEFORE`` (units of C). A chunk of one example now runs as a batch of two (the
example and its copy, weighted 0: ``dpclip.engine.ghost``, module docstring), so the batch path's
proof, proved-program match, memory watch and tracer cover it; ``auto``'s ``vmap`` fallback runs
under the state guard on every call. Each attack is refused; a batch step after a step of one
(how far its release moves when the first step's example is replaced; sound: 0) stays refused; an
honest model runs on ghost at ``max_physical_batch=1`` and equals the per-example loop; a batch
reduction is refused at every chunk size. One strict xfail is the ``vmap`` engine's limit
(``_VMAP_GLOBAL``).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from dpclip.engine import AutoEngine, GhostEngine, NaiveEngine, ParamGroups
from dpclip.engine.batch import padded_rows
from dpclip.engine.errors import PrivateBufferError, UnsupportedModelError
from tests.engine.helpers import DT, clip_weights
from tests.engine.test_separability_attacks import C, ce, clipped_sum, data, loo_distance

_G: dict = {}


class _Carries(nn.Module):
    """``fc1 -> (+ 5 * read()) -> tanh -> fc2``; ``keep(self, x)`` on every call."""

    def __init__(self, keep, read) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)
        self.register_buffer("buf", torch.zeros(5))
        self._keep, self._read = keep, read

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        got = self._read(self, h)
        if got is not None:
            h = h + 5 * got
        self._keep(self, x)
        return self.fc2(torch.tanh(h))


def _keep_attr(m, x: Tensor) -> None:
    m.prev = x.detach().clone()


def _read_attr(m, h: Tensor):
    return m.prev.mean() if getattr(m, "prev", None) is not None else None


def _keep_float(m, x: Tensor) -> None:
    m.prev_f = float(x.sum())


def _read_float(m, h: Tensor):
    return getattr(m, "prev_f", None)


def _keep_numpy(m, x: Tensor) -> None:
    _G["np"] = x.detach().numpy().copy()


def _read_numpy(m, h: Tensor):
    return torch.from_numpy(_G["np"]).mean() if "np" in _G else None


def _keep_buffer(m, x: Tensor) -> None:
    with torch.no_grad():
        m.buf.copy_(x.mean(0))


def _read_buffer(m, h: Tensor):
    return m.buf.mean()


def _keep_global(m, x: Tensor) -> None:
    _G["x"] = x.detach().clone()


def _read_in_backward(m, h: Tensor):
    """A hook (attached with torch functions off) that adds the previous call's mean to the
    gradient: it runs in the backward, after the forward's trace."""
    if "x" in _G and h.requires_grad:
        prev = _G["x"]
        with torch._C.DisableTorchFunction():
            h.register_hook(lambda g: g + 5 * prev.mean())
    return None


ATTACKS = {
    "module-attribute": (_keep_attr, _read_attr),
    "python-float": (_keep_float, _read_float),
    "numpy-copy": (_keep_numpy, _read_numpy),
    "buffer-written-in-place": (_keep_buffer, _read_buffer),
    "hook-reads-the-previous-call": (_keep_global, _read_in_backward),
}

#: on 26a8926, (ghost, auto): LOO at max_physical_batch=1 and LOO over steps of one example (None:
#: refused); a batch step after a step of one was refused by both there (the proved-program match:
#: kept here as a regression test)
ACCEPTED_BEFORE = {
    "module-attribute": ((2.70, 2.70), (2.70, 2.70)),
    "python-float": ((3.32, 3.32), (3.32, None)),
    "numpy-copy": ((2.70, 2.70), (2.70, None)),
    "buffer-written-in-place": ((2.70, 2.70), (2.70, None)),
    "hook-reads-the-previous-call": ((2.31, 2.31), (2.31, None)),
}


def _build(name: str) -> nn.Module:
    _G.clear()
    torch.manual_seed(0)
    return _Carries(*ATTACKS[name]).to(DT)


def _assert_refused_or_within_c(engine, model) -> None:
    """Chunks of one (``max_physical_batch=1``): refused, or LOO <= C."""
    x, y = data()
    try:
        got = loo_distance(engine(max_physical_batch=1), model, ce, x, y)
    except (UnsupportedModelError, PrivateBufferError):
        got = None
    finally:
        _G.clear()
    assert got is None or got <= 1 + 1e-9, got


def steps_of_one_loo(engine, model, x, y) -> float:
    """``max_j ||S(X) - S(X without j)|| / C`` where every example is its own step."""

    def total(idx):
        return sum(clipped_sum(engine, model, ce, x[i:i + 1], y[i:i + 1])[0] for i in idx)

    full = total(range(x.shape[0]))
    return max(float((full - total([i for i in range(x.shape[0]) if i != j])).norm()) / C
               for j in range(x.shape[0]))


def one_then_batch_moved(engine, model, x, y) -> float:
    """How far a batch step's release moves when the step of one before it changes its example."""
    got = []
    for first in (0, 1):
        clipped_sum(engine, model, ce, x[first:first + 1], y[first:first + 1])
        got.append(clipped_sum(engine, model, ce, x[2:], y[2:])[0])
    return float((got[0] - got[1]).norm()) / C


SCENARIOS = {
    "chunks": lambda e, m, x, y: loo_distance(e(max_physical_batch=1), m, ce, x, y),
    "steps": lambda e, m, x, y: steps_of_one_loo(e(), m, x, y),
    "one-then-batch": lambda e, m, x, y: one_then_batch_moved(e(), m, x, y),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("name", list(ATTACKS))
@pytest.mark.parametrize("engine", [GhostEngine, pytest.param(AutoEngine, id="AutoEngine")])
def test_one_example_calls_cannot_carry_data(engine, name, scenario):
    """Refused (an error that stops the run), or within the bound."""
    x, y = data()
    try:
        got = SCENARIOS[scenario](engine, _build(name), x, y)
    except (UnsupportedModelError, PrivateBufferError):
        got = None
    finally:
        _G.clear()
    bound = 1e-9 if scenario == "one-then-batch" else 1 + 1e-9
    assert got is None or got <= bound, got


def test_carrying_refusals_name_the_reason():
    """The batch path's refusals, now that a chunk of one runs as a batch of two: the forward
    reads the tensor the proof left in the attribute (never a vmap fallback: vmap would read the
    attribute from one call to the next); a hook registered with torch functions off is not the
    proved program (never a fallback)."""
    x, y = data()
    for engine in (GhostEngine, AutoEngine):
        with pytest.raises(UnsupportedModelError, match=r"layer 'fc2' was called on a tensor left "
                           r"over from the separability proof .*not turned into a vmap fallback"):
            clipped_sum(engine(max_physical_batch=1), _build("module-attribute"), ce, x, y)
    for engine in (GhostEngine, AutoEngine):
        with pytest.raises(UnsupportedModelError, match="the step does not run the program that "
                           "the batch-size proof traced .a gradient hook .* was registered in "
                           "the call"):
            steps_of_one_loo(engine(), _build("hook-reads-the-previous-call"), x, y)
    _G.clear()


class _UnpackSwap(nn.Module):
    """An unpack hook on the saved result of its tanh, registered with torch functions off: the
    backward reads the previous call's tanh output instead (no hook door of HookWatch; the engine's
    own saved-tensor hooks hold the slot, so the registration raises)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        t = torch.tanh(self.fc1(x))
        prev = _G.get("t")
        if prev is not None and prev.shape == t.shape:
            with torch._C.DisableTorchFunction():
                t.grad_fn._raw_saved_result.register_hooks(lambda _: None, lambda _: prev + 0.5)
        _G["t"] = t.detach().clone()
        return self.fc2(t)


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
def test_unpack_hook_of_a_saved_tensor_cannot_read_the_previous_chunk(engine):
    """Accepted on 26a8926 at max_physical_batch=1: LOO 2.26 C (ghost), 2.52 C (auto). Refused
    now, under auto too (a raw RuntimeError in its probe would have been a vmap verdict, and vmap
    reads the previous call's tensor as well), with the reason."""
    torch.manual_seed(0)
    _assert_refused_or_within_c(engine, _UnpackSwap().to(DT))
    x, y = data()
    with pytest.raises(UnsupportedModelError, match=r"a saved-tensor hook was registered in the "
                       r"call .*This is not turned into a vmap fallback"):
        clipped_sum(engine(max_physical_batch=1), _UnpackSwap().to(DT), ce, x, y)
    _G.clear()


class _Honest(nn.Module):
    """Per example: a constant table (made in ``__init__``; ``lazy``: on the first call, and the
    last output kept for logging, never read by the model); ``centre``: a batch reduction."""

    def __init__(self, centre: bool = False, lazy: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)
        self.table: Tensor | None = None if lazy else torch.linspace(0, 1, 6)
        self.last: Tensor | None = None
        self.centre, self.lazy = centre, lazy

    def forward(self, x: Tensor) -> Tensor:
        if self.table is None:
            self.table = torch.linspace(0, 1, 6, dtype=x.dtype)
        h = torch.tanh(self.fc1(x - x.mean(0) if self.centre else x) + self.table.to(x.dtype))
        out = self.fc2(h)
        if self.lazy:
            self.last = out.detach()
        return out


def test_attributes_set_in_the_call_are_refused_and_put_back():
    """A lazily made table and a kept output change the model's Python attributes (``None`` ->
    a tensor) in the call: the next call's proof is chosen by them, so they are refused (as the
    state guard of ``dp_step`` refused them already) and put back (dpclip.engine.isolation)."""
    torch.manual_seed(0)
    model = _Honest(lazy=True).to(DT)
    x, y = data()
    with pytest.raises(UnsupportedModelError, match="changed the model's Python attribute 'last', "
                       "the model's Python attribute 'table' during a private step"):
        clipped_sum(GhostEngine(), model, ce, x, y)
    assert model.table is None and model.last is None


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
def test_honest_chunks_of_one_still_run_on_ghost(engine):
    """The float64 per-example loop (naive: each example alone) is the oracle, at
    ``max_physical_batch=1`` (each chunk runs as the example and its copy, weighted 0), over steps
    of one example, and for a batch step after them."""
    torch.manual_seed(0)
    model = _Honest().to(DT)
    x, y = data()
    for _ in range(2):
        got, info = clipped_sum(engine(max_physical_batch=1), model, ce, x, y)
        want, _ = clipped_sum(NaiveEngine(), model, ce, x, y)
        assert info["engine"] == "ghost"
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-12)
    for i in range(3):  # steps of one example
        got, info = clipped_sum(engine(), model, ce, x[i:i + 1], y[i:i + 1])
        want, _ = clipped_sum(NaiveEngine(), model, ce, x[i:i + 1], y[i:i + 1])
        assert info["engine"] == "ghost"
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-12)
    got, info = clipped_sum(engine(), model, ce, x, y)
    assert info["engine"] == "ghost"


def test_a_chunk_of_one_reports_its_own_norm_weight_and_loss():
    """The copy is not seen: one norm, one weight, the example's loss (not the pair's), each equal
    to the per-example loop's."""
    torch.manual_seed(0)
    model = _Honest().to(DT)
    x, y = data()
    groups = ParamGroups.flat(model)
    for i in range(2):
        got = GhostEngine().compute(model, ce, x[i:i + 1], y[i:i + 1], clip_weights(C), groups)
        want = NaiveEngine().compute(model, ce, x[i:i + 1], y[i:i + 1], clip_weights(C), groups)
        assert got.norms.shape == got.weights.shape == (1,)
        assert float(got.norms[0]) >= float(want.norms[0]) * (1 - 1e-12)
        assert torch.allclose(got.norms, want.norms, rtol=1e-9)
        assert torch.allclose(got.weights, want.weights, rtol=1e-9)
        assert got.loss_sum == pytest.approx(want.loss_sum, rel=1e-12)


def test_a_batch_reduction_is_refused_at_every_chunk_size():
    """A chunk of one is proved as a batch (of two): ``x - x.mean(0)`` is refused by ghost at
    ``max_physical_batch=1`` and over steps of one as at a batch (it ran before, with the vmap
    semantics of one example alone), so the verdict does not depend on how many examples a chunk
    holds; ``auto`` runs it on ``vmap`` from the probe, recorded."""
    torch.manual_seed(0)
    model = _Honest(centre=True).to(DT)
    x, y = data()
    for engine, xs, ys in ((GhostEngine(max_physical_batch=1), x, y),
                           (GhostEngine(), x[:1], y[:1]), (GhostEngine(), x, y)):
        with pytest.raises(UnsupportedModelError, match="the input of layer 'fc1' .* mixes the "
                           "examples of the batch"):
            clipped_sum(engine, model, ce, xs, ys)
    _, info = clipped_sum(AutoEngine(max_physical_batch=1), model, ce, x, y)
    assert info["engine"] == "vmap" and "mixes the examples" in info["fallback"]


#: the ``vmap`` engine's limit (not a chunk of one's): the proof cannot trace a program run with
#: Python dispatch off (not proven), so ``auto`` runs ``vmap``; vmap evaluates each example alone
#: within a call only, and a Python global written and read with torch functions and Python
#: dispatch off is outside every check (the guard sees the model's own state only)
_VMAP_GLOBAL = ("HOLE (vmap engine): auto runs vmap (the proof cannot trace with dispatch off); "
                "at max_physical_batch=1 vmap reads the previous chunk's input kept in a Python "
                "global with torch functions and dispatch off: LOO 2.70 C")


class _ModesOff(nn.Module):
    """Reads the previous call's input, and keeps its own, with torch functions AND Python
    dispatch switched off: the chunk's tracer sees neither, and the sum arrives as an unknown
    tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            if "x" in _G:
                h = h + 5 * _G["x"].mean()
            _G["x"] = x.detach().clone()
        return self.fc2(torch.tanh(h))


class _BufferWrittenOff(nn.Module):
    """Adds its buffer's mean, then writes the example's mean into the buffer with torch functions
    and Python dispatch off and the version counter set back: the next call reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)
        self.register_buffer("buf", torch.zeros(5))

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x) + 5 * self.buf.mean()
        v = self.buf._version
        with torch.no_grad(), torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            self.buf.copy_(x.mean(0))
        torch._C._autograd._unsafe_set_version_counter((self.buf,), (v,))
        return self.fc2(torch.tanh(h))


@pytest.mark.parametrize("build", [_ModesOff, _BufferWrittenOff])
@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
def test_modes_off_at_a_batch_of_one(engine, build, request):
    """Accepted by ghost and auto at ``max_physical_batch=1`` before (LOO 2.70 C each: a chunk of
    one had no proof); refused now that it runs as a batch of two, except where ``auto`` runs
    ``vmap`` (below)."""
    if engine is AutoEngine and build is _ModesOff:
        request.applymarker(pytest.mark.xfail(strict=True, reason=_VMAP_GLOBAL))
    torch.manual_seed(0)
    _assert_refused_or_within_c(engine, build().to(DT))


_ROWS: list = []


class _DropLog(nn.Module):
    """``h + log|dropout(h)|``: a dropped unit makes its row's loss non-finite; the rows of a
    chunk of one draw different masks, so the copy (row 1) can be non-finite while the example
    (row 0) is not. The rows' finiteness is kept for the test (the real run's, not the proof's)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc1(x))
        h = h + torch.log(nn.functional.dropout(h, 0.2).abs())
        if not is_fake(h):
            _ROWS.append(torch.isfinite(h.detach()).all(1))
        return self.fc2(h)


def test_the_reported_loss_is_the_examples_not_the_copys():
    """Found by the hostile review of the chunk of one: the loss was half the pair's, NaN when
    only the copy was non-finite. Now the example's own: finite whenever the example's row is,
    non-finite (and the norm infinite) when it is not."""
    torch.manual_seed(0)
    model = _DropLog().to(DT)
    x, y = data()
    seen = set()
    for seed in range(40):
        _ROWS.clear()
        torch.manual_seed(seed)
        got = GhostEngine().compute(model, ce, x[:1], y[:1], clip_weights(C),
                                    ParamGroups.flat(model))
        rows = _ROWS[-1].tolist()
        assert len(rows) == padded_rows(1)  # (the example, then the row block's copies)
        seen.add((rows[0], all(rows[1:])))
        assert math.isfinite(got.loss_sum) == rows[0] == math.isfinite(float(got.norms[0]))
    assert (True, False) in seen  # the case the fix is about occurred
