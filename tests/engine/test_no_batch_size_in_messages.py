"""The realised batch size is private (issue 31, item 3): no engine message may carry it. Each
refusal below is raised on a batch of B = 37 examples (a number that appears nowhere else in the
models) and its text must not contain 37 (nor B - 1 = 36: a neighbouring batch)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dpclip.engine import GhostEngine, ParamGroups, UnsupportedModelError, VmapEngine, get_engine
from dpclip.engine.errors import quote_error
from tests.engine.helpers import DT, ce, clip_weights

B = 37


def _private(msg: str) -> None:
    assert "37" not in msg and "36" not in msg, msg


def _data(d: int = 3):
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, d, generator=g, dtype=DT), torch.randint(0, 2, (B,), generator=g)


@pytest.mark.parametrize("engine", ["naive", "vmap", "ghost", "summed", "auto", "compiled"])
def test_different_batch_sizes_message_names_leaves_not_sizes(engine):
    model = nn.Linear(3, 2).to(DT)
    x, y = _data()
    eng = get_engine(engine)
    wfn = clip_weights(1.0) if eng.per_example else None
    with pytest.raises(ValueError, match="different batch sizes") as info:
        eng.compute(model, ce, x, y[:-1], wfn, ParamGroups.flat(model))
    _private(str(info.value))
    assert "targets differ(s) from inputs" in str(info.value)


def test_weight_fn_shape_message_quotes_no_batch_size():
    model = nn.Linear(3, 2).to(DT)
    x, y = _data()
    with pytest.raises(ValueError, match=r"norms' shape \(B,\)") as info:
        GhostEngine().compute(model, ce, x, y, lambda n: n[:-1], ParamGroups.flat(model))
    _private(str(info.value))


class _Pos(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(3))

    def forward(self, x: Tensor) -> Tensor:
        return self.pos


class _UsesPos(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = _Pos()
        self.fc = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x + self.p(x))


class _FlatFirst(nn.Module):
    """A Linear called on the batch flattened into its rows: first dimension B * 2. Its rule
    reads example i from its 2 rows (layout (0, 2), issue 36), and so does the module without a
    rule after it (the per-layer path); both were refused here before."""

    def __init__(self, scale: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.s = _Scale() if scale else None

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(torch.cat([x, x], 1).view(-1, 3))
        if self.s is not None:
            h = self.s(h)
        return h.view(x.shape[0], -1)


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.w


class _DeadCall(nn.Module):
    """A Linear also called on a constant table of 5 rows (a call that reaches no loss: the trace
    has nothing to refuse, the batch-first check of the layer rules refuses it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.register_buffer("table", torch.randn(5, 3))

    def forward(self, x: Tensor) -> Tensor:
        self.fc(self.table)
        return self.fc(x)


@pytest.mark.parametrize("make,match", [
    (_UsesPos, "returned a tensor of rank 1 whose first dimension is not the batch")])
def test_ghost_refusals_quote_ranks_not_shapes(make, match):
    model = make().to(DT)
    x, y = _data()
    with pytest.raises(UnsupportedModelError, match=match) as info:
        GhostEngine().compute(model, ce, x, y, clip_weights(1.0), ParamGroups.flat(model))
    _private(str(info.value))


@pytest.mark.parametrize("scale", [False, True])
def test_layers_on_the_batch_flattened_into_their_rows_run_on_ghost(scale):
    """The _FlatFirst refusal of this file before issue 36: a ruled layer (and a module on the
    per-layer path) reads an example that owns k consecutive rows from those rows; ghost equals
    vmap."""
    model = _FlatFirst(scale=scale).to(DT)
    x, y = _data()
    groups = ParamGroups.flat(model)
    res = GhostEngine().compute(model, ce, x, y, clip_weights(1.0), groups)
    ref = VmapEngine().compute(model, ce, x, y, clip_weights(1.0), groups)
    assert res.engine_info["engine"] == "ghost"
    torch.testing.assert_close(res.norms, ref.norms)
    for n in ref.grads:
        torch.testing.assert_close(res.grads[n], ref.grads[n])


def test_a_dead_call_on_a_constant_table_runs_on_ghost():
    """The Linear's extra call on a (5, 3) constant (no batch, no leading 1) is a batch-less call
    since the second batch-less rule (engine/batchless.py); it reaches no loss, and ghost equals
    vmap. (It was a refusal message of this file before.)"""
    model = _DeadCall().to(DT)
    x, y = _data()
    groups = ParamGroups.flat(model)
    res = GhostEngine().compute(model, ce, x, y, clip_weights(1.0), groups)
    ref = VmapEngine().compute(model, ce, x, y, clip_weights(1.0), groups)
    torch.testing.assert_close(res.norms, ref.norms)
    for n in ref.grads:
        torch.testing.assert_close(res.grads[n], ref.grads[n])


def test_quote_error_masks_numbers():
    got = quote_error(RuntimeError("vmap: got sizes [37, 3] in dim 0\nsecond line 37"))
    assert got == "RuntimeError: vmap: got sizes [#, #] in dim #"
    assert quote_error(ValueError()) == "ValueError"


def test_quote_error_survives_an_exception_whose_text_raises():
    """Sixty-fifth hostile review: a user exception whose ``__str__`` raises (or returns a str
    subclass) is quoted by its type alone; the engine's refusal is raised, not that error."""

    class Odd(RuntimeError):
        def __str__(self):
            raise KeyError("no text")

    class Sub(str):
        pass

    class Sly(RuntimeError):
        def __str__(self):
            return Sub("batch 37")

    assert quote_error(Odd()) == "Odd"
    assert quote_error(Sly()) == "Sly"
