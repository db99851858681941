"""Thirteenth hostile review (of ca53ab1): the ghost engine's per-layer path re-ran a module's own
Python ``forward`` (one example at a time, under ``torch.func``) to get per-example gradients of
its parameters. The checks around that recomputation saw tensors only: a plain Python number the
real forward kept (the realised batch size ``x.shape[0]``, in a list attribute put back before the
chunk ended, or in a global) entered the recomputed function unseen. Measured on ca53ab1: LOO
3.13 C under ghost and auto (engine ghost, no fallback); a global carried to the next call moved
its release by 4.23 C.

Fixed: the per-layer path no longer runs the module's Python again. It replays the call's PROVED
operations (the ATen operations the forward ran inside the call, matched against the batch-size
proof, their numbers evaluated for one example: ``proved_program.CallWindow``,
``per_layer.replay``), with the grad mode and the detaches of the real run. Each attack below fails
on ca53ab1 (LOO above C) and is refused or bounded here; the replay equals the float64 per-example
loop for modules that detach, switch gradients off, read another module's parameters or a constant
of the forward; what a replay cannot reproduce soundly is refused with its reason."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dpclip.engine import AutoEngine, GhostEngine, ParamGroups, UnsupportedModelError
from tests.engine.helpers import DT, clip_weights
from tests.engine.test_ghost_per_layer import check_against_oracle
from tests.engine.test_separability_attacks import C, ce, clipped_sum, data, loo_distance

#: where the attacks keep what the real forward saw (a module global: no isolation compares it)
_G: dict = {}


class _KeepsB(nn.Module):
    """Takes the per-layer path (a parameter, no ghost rule, not an elementwise scale). The
    review's model: the real forward keeps the batch size in a list, the re-run reads it and puts
    the list back."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(k))
        self.box = [0]

    def forward(self, x: Tensor) -> Tensor:
        y = x * self.s + 0.1 * self.s
        if isinstance(self.s, nn.Parameter):  # the real forward (and the proof's, on fakes)
            if type(x.shape[0]) is int:  # (not the proof's symbol: it leaves no trace)
                self.box.append(x.shape[0])
            return y
        n = self.box[-1]  # the recomputation: the forward's batch size
        del self.box[1:]  # the list as it was: the chunk's isolation sees no change
        return y * (100.0 * (n - 7)) if isinstance(n, int) else y


class _GlobalB(nn.Module):
    """The same through a module global, which no isolation compares: the real forward writes the
    batch size there, a re-run of the forward (its parameters are functorch's then) reads it."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(k))

    def forward(self, x: Tensor) -> Tensor:
        y = x * self.s + 0.1 * self.s
        if isinstance(self.s, nn.Parameter):
            if type(x.shape[0]) is int:
                _G["n"] = x.shape[0]
            return y
        n = _G.get("n")
        return y * (100.0 * (n - 7)) if isinstance(n, int) else y


class _Counts(nn.Module):
    """Counts the calls of its forward on real tensors (the proof's are on fakes)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, k))

    def forward(self, x: Tensor) -> Tensor:
        from torch._subclasses.fake_tensor import is_fake

        if not is_fake(x):
            _G["calls"] = _G.get("calls", 0) + 1
        return torch.tanh(x * self.s) + self.s


def _model(mid: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Linear(5, 3), mid, nn.Linear(3, 3)).to(DT)


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine], ids=["ghost", "auto"])
def test_the_per_layer_path_cannot_read_the_batch_size_kept_in_an_attribute(engine):
    """ca53ab1: LOO 3.13 C. Now the forward runs once, so the list it grew is what the chunk's
    isolation finds at the end: refused (the kept value is no longer read by anything)."""
    torch.manual_seed(0)
    model = _model(_KeepsB(3))
    x, y = data()
    try:
        got = loo_distance(engine(), model, ce, x, y)
    except UnsupportedModelError as exc:
        assert "'1.box'" in str(exc)
        return
    assert got <= 1.0 + 1e-9, got


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine], ids=["ghost", "auto"])
def test_the_per_layer_path_cannot_read_the_batch_size_kept_in_a_global(engine):
    """A module global holds the real forward's batch size; the per-layer path runs no user code
    after the forward, so it never reaches a gradient: runs on ghost, LOO <= C (ca53ab1: above)."""
    torch.manual_seed(0)
    model = _model(_GlobalB(3))
    x, y = data()
    try:
        got = loo_distance(engine(), model, ce, x, y)
        _, info = clipped_sum(engine(), model, ce, x, y)
    finally:
        _G.clear()
    assert info["engine"] == "ghost" and info["per_layer"] == ("1",)
    assert got <= 1.0 + 1e-9, got


def test_a_global_from_the_previous_call_does_not_move_the_next_release():
    """ca53ab1: 4.23 C. The global written by one call (batch of 8) is still there when a
    neighbouring batch (7) runs; the release of the neighbour must be what it is without it."""
    torch.manual_seed(0)
    model = _model(_GlobalB(3))
    x, y = data()
    try:
        clipped_sum(GhostEngine(), model, ce, x, y)  # leaves _G["n"] = 8
        after, _ = clipped_sum(GhostEngine(), model, ce, x[1:], y[1:])
        _G.clear()
        clean, _ = clipped_sum(GhostEngine(), model, ce, x[1:], y[1:])
    finally:
        _G.clear()
    assert torch.equal(after, clean)


def test_the_module_python_runs_once_per_chunk():
    """The per-layer path evaluates no user code after the forward: the module's forward runs on
    real tensors once per chunk (before: once more per chunk, under vmap)."""
    torch.manual_seed(0)
    model = _model(_Counts(3))
    x, y = data()
    for chunks, engine in ((1, GhostEngine()), (2, GhostEngine(max_physical_batch=4))):
        check_against_oracle(engine, model, x, y, ce, ParamGroups.flat(model), clip_weights(C))
        _G.clear()
        try:
            _, info = clipped_sum(engine, model, ce, x, y)
            assert _G["calls"] == chunks
        finally:
            _G.clear()
        assert info["per_layer"] == ("1",)


class _Detaches(nn.Module):
    """A parameter used twice, once detached: the gradient flows through one use only."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, k))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.s + torch.sin(x * self.s.detach()) * self.s


class _NoGrad(nn.Module):
    """A normaliser computed from the parameter with gradients off."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, k))

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            m = self.s.abs().max() + 1.0
        return torch.tanh(x * self.s) / m


class _ReadsOthers(nn.Module):
    """Reads another module's (trainable, held fixed) weight and a constant made in the forward."""

    def __init__(self, k: int, other: nn.Linear) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, k))
        self.other = [other]  # (not a child: its weight is read, not called)
        self.register_buffer("scale", torch.tensor([2.0, 3.0, 4.0], dtype=DT))

    def forward(self, x: Tensor) -> Tensor:
        w = self.other[0].weight.detach()
        return (x @ w[:, :3].T) * self.s * self.scale + torch.arange(3, dtype=x.dtype) * self.s


class _WithOthers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 3)
        self.side = nn.Linear(5, 3)
        self.mid = _ReadsOthers(3, self.side)
        self.head = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.mid(self.fc(x))) + self.side(x)


@pytest.mark.parametrize("build", [lambda: _model(_Detaches(3)), lambda: _model(_NoGrad(3)),
                                   lambda: _WithOthers().to(DT)],
                         ids=["detach", "no-grad", "reads-others"])
def test_the_replay_equals_the_float64_loop(build):
    """The replay keeps the real run's gradient cuts (``.detach()``, ``torch.no_grad``) and reads
    other modules' parameters and buffers as they were: equal to the float64 per-example loop,
    chunked too."""
    torch.manual_seed(0)
    model = build()
    x, y = data()
    for engine in (GhostEngine(), GhostEngine(max_physical_batch=3)):
        for groups in (ParamGroups.flat(model), ParamGroups.per_parameter(model)):
            res, _ = check_against_oracle(engine, model, x, y, ce, groups, clip_weights(0.3))
            assert res.engine_info["engine"] == "ghost" and res.engine_info["per_layer"]


class _ReadsKept(nn.Module):
    """Reads a tensor of the forward that carries example data and is not its argument (the
    model hands it over in an attribute)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(k))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.s + _G["h"] * self.s


class _HandsOver(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 3)
        self.mid = _ReadsKept(3)
        self.head = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        _G["h"] = h * 2.0  # example data, not an argument of mid
        return self.head(self.mid(h))


class _WritesArg(nn.Module):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(k))

    def forward(self, x: Tensor) -> Tensor:
        x.mul_(1.0)  # (no change of value: the write alone is what a replay must not repeat)
        return torch.tanh(x * self.s)


def test_what_a_replay_cannot_reproduce_is_refused_with_its_reason():
    """Refused under ghost, naming the module and the reason; auto falls back to vmap."""
    torch.manual_seed(0)
    x, y = data()
    cases = [
        (_HandsOver().to(DT), "carries example data and is not one of its arguments"),
        (_model(_WritesArg(3)), "writes in place a tensor it did not make"),
    ]
    try:
        for model, why in cases:
            with pytest.raises(UnsupportedModelError, match=why):
                clipped_sum(GhostEngine(), model, ce, x, y)
            got = loo_distance(AutoEngine(), model, ce, x, y)
            assert got <= 1.0 + 1e-9
            _, info = clipped_sum(AutoEngine(), model, ce, x, y)
            assert info["engine"] == "vmap"
    finally:
        _G.clear()


def test_the_recompute_tracer_refuses_a_tensor_it_did_not_make():
    """docs/errors.md entry 100: the replay runs under the separability tracer, which refuses a
    tensor from outside (defence in depth: the replay itself reads only what settle_call allows)."""
    from torch.func import vmap

    from dpclip.engine.per_layer import RecomputeTracer

    rows = torch.randn(4, 3, dtype=DT)
    mine = torch.ones(3, dtype=DT)
    other = torch.randn(3, dtype=DT)
    for reads, refused in ((mine, False), (other, True)):
        tracer = RecomputeTracer(4, [mine])
        tracer.mark(rows, (0, 1))
        with tracer:
            got = vmap(lambda r, t=reads: r * t)(rows)
        tracer.retire()
        why = tracer.verdict([got])
        assert (why is not None) == refused, why
        if refused:
            assert "did not make and that is not the module's" in why
