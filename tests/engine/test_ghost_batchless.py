"""Batch-less calls of ruled layers (issue 31: BERT as the tokenizer gives its batch): a layer called
on a tensor without the batch dimension (``(1, T)`` position ids) whose output is broadcast later
runs on ghost with the float64 per-example loop's norms and sums (:mod:`dpclip.engine.batchless`);
each acceptance has an adversarial twin that must be refused (``GhostEngine``) and run soundly on
the ``vmap`` fallback (``AutoEngine``: equal to the loop).

Oracle: :func:`tests.engine.helpers.naive_per_example_grads` (float64, one backward per example on
the user's unchanged program).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dpclip.engine import (
    AutoEngine,
    GhostEngine,
    ParamGroups,
    UnsupportedModelError,
    naive_per_example_grads,
)
from tests.engine.helpers import DT, assert_grads_close, ce, oracle_norms, oracle_sum

B, T, D, V = 4, 5, 6, 13


def wfn(n: Tensor) -> Tensor:
    return (0.05 / n).clamp(max=1.0)


class PosNet(nn.Module):
    """Token embedding plus a position term from a layer called on a ``(1, T)`` constant."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.tok = nn.Embedding(V, D)
        self.pos = nn.Embedding(T, D)
        self.lin = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, 3)
        self.register_buffer("ids", torch.arange(T).unsqueeze(0))
        self.register_buffer("table", torch.randn(1, T, D))

    def forward(self, x: Tensor) -> Tensor:
        h = self.tok(x)
        k = self.kind
        if k == "embedding":  # BERT / GPT-2: the (1, T) position ids of a buffer
            h = h + self.pos(self.ids[:, : x.shape[1]])
        elif k == "linear":  # a Linear on a (1, T, D) constant, then a LayerNorm on its output
            h = h + self.norm(self.lin(self.table))
        elif k == "twice":  # the same position layer called twice (a tied use of its weight)
            h = h + self.pos(self.ids) * self.pos(self.ids).tanh()
        elif k == "pos-used-twice":  # one batch-less output used at two places
            p = self.pos(self.ids)
            h = torch.tanh(h + p) * p
        # ---- twins
        elif k == "twin:ids-from-batch":  # (1, T) ids computed from the batch
            h = h + self.pos(x.sum(0, keepdim=True) % T)
        elif k == "twin:input-from-batch":  # x.mean(0, keepdim=True) fed to a Linear
            h = h + self.lin(h.mean(0, keepdim=True))
        elif k == "twin:row-0":  # the user's program reads row 0 of a (1, T, D) tensor
            h = h + self.pos(self.ids)[0]
        elif k == "twin:sum-0":  # ... or sums it over dimension 0 (no-op in the user's program)
            h = h + self.pos(self.ids).sum(0)
        elif k == "twin:size":  # ... or reads its leading size (1 in the user's program)
            p = self.pos(self.ids)
            h = h + p * p.shape[0]
        elif k == "twin:view":  # a view that the expanded output cannot take
            h = h + self.pos(self.ids).view(1, T, D)
        return self.head(self.norm(h).mean(1))


OK = ["embedding", "linear", "twice", "pos-used-twice"]
TWINS = ["twin:ids-from-batch", "twin:input-from-batch", "twin:row-0", "twin:sum-0",
         "twin:size", "twin:view"]


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, 3, (B,), generator=g)


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return PosNet(kind).to(DT)


@pytest.mark.parametrize("kind", OK)
def test_batchless_calls_run_on_ghost_equal_to_the_loop(kind):
    """Flat and per-layer norms, every norm mode, chunks: ghost (no fallback), the loop's norms
    (upper bounds within rounding) and the exactly weighted sum."""
    model = _model(kind)
    x, y = _data()
    per_ex = naive_per_example_grads(model, ce, x, y)
    for groups in (ParamGroups.flat(model), ParamGroups.per_layer(model)):
        expected = oracle_norms(per_ex, groups, B)
        for engine in (AutoEngine(), GhostEngine(norm_mode="ghost"),
                       GhostEngine(norm_mode="direct"), GhostEngine(max_physical_batch=3)):
            res = engine.compute(model, ce, x, y, wfn, groups)
            assert res.engine_info["engine"] == "ghost", res.engine_info
            assert bool((res.norms >= expected * (1 - 1e-12)).all())
            torch.testing.assert_close(res.norms, expected, rtol=1e-9, atol=1e-12)
            assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, B))


def test_batchless_call_leaves_the_model_unchanged():
    """The expansion lives in the engine's call only: afterwards the model's own forward returns
    what it returned before, and no hook is left on any module."""
    model = _model("embedding")
    x, y = _data()
    before = model(x)
    GhostEngine().compute(model, ce, x, y, wfn, ParamGroups.flat(model))
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks


@pytest.mark.parametrize("kind", TWINS)
def test_batchless_twins_are_refused_and_auto_runs_them_soundly(kind):
    """A (1, T) input computed from the batch, the expanded output used across the batch or its
    size read as a value, a view it cannot take: ghost refuses; auto's vmap fallback runs the
    user's program and equals the loop."""
    model = _model(kind)
    x, y = _data()
    groups = ParamGroups.flat(model)
    with pytest.raises(UnsupportedModelError):
        GhostEngine().compute(model, ce, x, y, wfn, groups)
    if kind in ("twin:ids-from-batch", "twin:input-from-batch"):
        return  # these mix the examples in the user's program too (no per-example loop oracle)
    res = AutoEngine().compute(model, ce, x, y, wfn, groups)
    assert res.engine_info["engine"] == "vmap", res.engine_info
    per_ex = naive_per_example_grads(model, ce, x, y)
    torch.testing.assert_close(res.norms, oracle_norms(per_ex, groups, B), rtol=1e-9,
                               atol=1e-12)
    assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, B))


def test_size_read_of_the_expanded_output_is_refused_by_the_batch_size_proof():
    """``p * p.shape[0]``: the user's program multiplies by 1, the expanded one would multiply by
    B (every example's loss a function of the private batch size). The batch-size proof traces
    the expanded program and refuses it, naming the batch size."""
    model = _model("twin:size")
    x, y = _data()
    with pytest.raises(UnsupportedModelError, match="batch size"):
        GhostEngine().compute(model, ce, x, y, wfn, ParamGroups.flat(model))


def test_batch_of_one_is_an_ordinary_call():
    """One example: nothing to expand, the call is batched as it is (equal to the loop)."""
    model = _model("embedding")
    x, y = _data()
    x, y = x[:1], y[:1]
    per_ex = naive_per_example_grads(model, ce, x, y)
    groups = ParamGroups.flat(model)
    res = GhostEngine().compute(model, ce, x, y, wfn, groups)
    torch.testing.assert_close(res.norms, oracle_norms(per_ex, groups, 1), rtol=1e-9, atol=1e-12)
    assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, 1))


def test_error_85_expanded_output_the_code_cannot_take():
    model = _model("twin:view")
    x, y = _data()
    with pytest.raises(UnsupportedModelError) as info:
        GhostEngine().compute(model, ce, x, y, wfn, ParamGroups.flat(model))
    assert str(info.value).startswith(
        "ghost engine: layer 'pos' was called without the batch dimension (leading dimension 1) "
        "and the forward pass failed on its output expanded to the batch (RuntimeError: shape "
        "'[#, #, #]' is invalid for input of size #); the ghost engine reads per-example "
        "gradients of such a call from the expanded output: let the code after the layer "
        "broadcast it (e.g. x + pos), or use engine 'vmap'. The ghost engine has rules for "
        "Linear, ")  # (the library's numbers masked: a size can be the private batch size's)


#: state outside the model's modules, written during the proof (a fake tensor) and read by the
#: real run: a library's lru_cache does this (transformers' BEiT relative position index)
_KEPT: dict = {}


class _LeftoverAfterExpansion(nn.Module):
    """A position table on a batch-less ``(1, T)`` index (expanded by the engine), then a layer
    fed from a tensor the forward keeps in a global between calls."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(4, 6)
        self.fc = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = x + self.pos(torch.arange(4)[None])
        if "idx" not in _KEPT:
            _KEPT["idx"] = torch.arange(4)
        return self.fc(h[:, _KEPT["idx"]]).mean(1)


@pytest.mark.parametrize("engine", [GhostEngine, AutoEngine])
def test_a_proof_leftover_after_an_expansion_stops_the_run(engine):
    """A layer called on a tensor left over from the proof is never a vmap fallback
    (ghost_forward._refuse_proof_leftovers: vmap would read the forward's state outside its
    modules from one call to the next). After a batch-less call had been expanded, the refusal was
    taken for a failure of the expanded output: its reason lost ("(_NotTheProvedProgram)" only,
    BEiT's whole diagnosis) and, under ``auto``, a vmap fallback reason. Now it stops the run
    with its own message on both engines."""
    from dpclip.engine import batch_symbol

    batch_symbol._CACHE.clear()
    _KEPT.clear()
    torch.manual_seed(0)
    model = _LeftoverAfterExpansion().to(DT)
    x, y = torch.randn(5, 4, 6, dtype=DT), torch.randint(0, 3, (5,))
    with pytest.raises(UnsupportedModelError) as info:
        engine().compute(model, ce, x, y, wfn, ParamGroups.flat(model))
    msg = str(info.value)
    assert "layer 'fc' was called on a tensor left over from the separability proof" in msg
    assert "not turned into a vmap fallback" in msg and "expanded to the batch" not in msg
    _KEPT.clear()


# ------------------------------------------------------- modules on the per-layer path


class Table(nn.Module):
    """A module without a rule returning a learned ``(1, T, D)`` table (called with or without the
    batch as argument), or, twin, a ``(1, T, D)`` tensor computed across the batch."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.table = nn.Parameter(torch.randn(1, T, D))
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, D))

    def forward(self, h: Tensor | None = None) -> Tensor:
        if self.kind == "twin:mean":
            return h.mean(0, keepdim=True) * self.scale
        return self.table * self.scale


class TableNet(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.tok = nn.Embedding(V, D)
        self.pos = Table(kind)
        self.head = nn.Linear(D, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.tok(x)
        p = self.pos() if self.kind == "no-args" else self.pos(h)
        return self.head(torch.tanh(h + p).mean(1))


@pytest.mark.parametrize("kind", ["no-args", "batch-arg"])
def test_per_layer_module_returning_a_table_runs_on_ghost(kind):
    """A per-layer module whose output has a leading 1 (error 93 before): expanded, its
    per-example gradient recomputed per example with that example's output-gradient row; equal to
    the float64 loop."""
    torch.manual_seed(0)
    model = TableNet(kind).to(DT)
    x, y = _data()
    per_ex = naive_per_example_grads(model, ce, x, y)
    for groups in (ParamGroups.flat(model), ParamGroups.per_layer(model)):
        res = AutoEngine().compute(model, ce, x, y, wfn, groups)
        assert res.engine_info["engine"] == "ghost", res.engine_info
        assert res.engine_info["per_layer"] == ("pos",)
        torch.testing.assert_close(res.norms, oracle_norms(per_ex, groups, B), rtol=1e-9,
                                   atol=1e-12)
        assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, B))


def test_per_layer_module_output_across_the_batch_is_refused():
    """Twin: the ``(1, T, D)`` output is computed from every example (``h.mean(0)``): its
    layout is read before the expanded view is marked, so the mixing is seen and refused."""
    torch.manual_seed(0)
    model = TableNet("twin:mean").to(DT)
    x, y = _data()
    with pytest.raises(UnsupportedModelError, match="mix"):
        GhostEngine().compute(model, ce, x, y, wfn, ParamGroups.flat(model))


# ------------------------------------------ calls with no leading 1 (a 1-D arange(T), a (T, D) table)


class FlatPosNet(nn.Module):
    """A position term from a ruled layer called on a constant with NO leading 1 (an Embedding on
    a 1-D ``arange(T)``: output ``(T, D)``), broadcast against ``(B, T, D)`` example data."""

    def __init__(self, kind: str, p: float = 0.0) -> None:
        super().__init__()
        self.kind = kind
        self.tok = nn.Embedding(V, D)
        self.pos = nn.Embedding(T, D)
        self.lin = nn.Linear(D, D)
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(D, 3)
        self.register_buffer("ids", torch.arange(T))
        self.register_buffer("table", torch.randn(T, D))

    def forward(self, x: Tensor) -> Tensor:
        h = self.tok(x)
        k = self.kind
        if k == "arange":  # GPT-2 style without the leading 1
            h = h + self.pos(self.ids[: x.shape[1]])
        elif k == "arange-times":  # arithmetic chains on the output alone, then a product
            h = h * (self.pos(self.ids) * 0.5 + 1.0) - self.pos(self.ids) / 3
        elif k == "linear-table":  # a Linear on a (T, D) constant
            h = h + self.lin(self.table)
        elif k == "dropout":  # dropout on the batch-less output before broadcasting
            h = h + self.drop(self.pos(self.ids))
        elif k == "dropout-1T":  # the same on a (1, T) call (BERT / GPT-2 without position ids)
            h = h + self.drop(self.pos(self.ids.unsqueeze(0)))
        # ---- twins
        elif k == "twin:ids-from-batch":  # (T,) ids computed from the batch
            h = h + self.pos(x.sum(0) % T)
        elif k == "twin:row-0":  # the first position's embedding, added everywhere
            h = h + self.pos(self.ids)[0]
        elif k == "twin:slice":  # column 0 of every position (pe[:, :1]), broadcast over D
            h = h + self.pos(self.ids)[:, :1]
        elif k == "twin:sum-T":  # a reduction over T: separable, but not a broadcast
            h = h + self.pos(self.ids).sum(0)
        elif k == "twin:matmul":  # the output's leading dim contracted (pe @ h^T)
            h = h + (self.pos(self.ids) @ h.transpose(1, 2)).tanh() @ h / T
        elif k == "twin:size":  # reads the leading size (T in the user's program)
            p = self.pos(self.ids)
            h = h + p * p.shape[0]
        elif k == "twin:norm":  # another layer on the output before it is broadcast
            h = h + self.lin(self.pos(self.ids))
        return self.head(torch.tanh(h).mean(1))


FLAT_OK = ["arange", "arange-times", "linear-table"]
FLAT_TWINS = ["twin:ids-from-batch", "twin:row-0", "twin:slice", "twin:sum-T", "twin:matmul",
              "twin:size", "twin:norm"]


def _flat(kind: str, p: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return FlatPosNet(kind, p).to(DT)


@pytest.mark.parametrize("kind", FLAT_OK)
def test_unbatched_calls_without_leading_one_run_on_ghost_equal_to_the_loop(kind):
    """An Embedding on a 1-D arange(T), a Linear on a (T, D) table (refused before: "mixes the
    examples"): ghost, the loop's norms (upper bounds within rounding) and weighted sum."""
    model = _flat(kind)
    x, y = _data()
    per_ex = naive_per_example_grads(model, ce, x, y)
    for groups in (ParamGroups.flat(model), ParamGroups.per_layer(model)):
        expected = oracle_norms(per_ex, groups, B)
        for engine in (AutoEngine(), GhostEngine(norm_mode="ghost"),
                       GhostEngine(norm_mode="direct"), GhostEngine(max_physical_batch=3)):
            res = engine.compute(model, ce, x, y, wfn, groups)
            assert res.engine_info["engine"] == "ghost", res.engine_info
            assert bool((res.norms >= expected * (1 - 1e-12)).all())
            torch.testing.assert_close(res.norms, expected, rtol=1e-9, atol=1e-12)
            assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, B))


@pytest.mark.parametrize("kind", FLAT_TWINS)
def test_unbatched_call_twins_are_refused_and_auto_runs_them_soundly(kind):
    """The output used across its leading dimension (row 0, a column slice, a sum over T, a
    product contracting it, its size, another layer on it) or ids computed from the batch:
    ghost refuses; auto's vmap fallback equals the loop."""
    model = _flat(kind)
    x, y = _data()
    groups = ParamGroups.flat(model)
    with pytest.raises(UnsupportedModelError):
        GhostEngine().compute(model, ce, x, y, wfn, groups)
    if kind == "twin:ids-from-batch":
        return  # mixes the examples in the user's program too (no per-example loop oracle)
    res = AutoEngine().compute(model, ce, x, y, wfn, groups)
    assert res.engine_info["engine"] == "vmap", res.engine_info
    per_ex = naive_per_example_grads(model, ce, x, y)
    torch.testing.assert_close(res.norms, oracle_norms(per_ex, groups, B), rtol=1e-9,
                               atol=1e-12)
    assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, B))


def test_unbatched_output_not_broadcast_names_the_layer():
    model = _flat("twin:row-0")
    x, y = _data()
    with pytest.raises(UnsupportedModelError, match="output of layer 'pos', called without the "
                       "batch dimension .* is used by"):
        GhostEngine().compute(model, ce, x, y, wfn, ParamGroups.flat(model))


@pytest.mark.parametrize("kind", ["dropout", "dropout-1T"])
def test_dropout_on_a_batchless_output_draws_per_example_and_stays_sound(kind):
    """Dropout (training mode) on the batch-less output before broadcasting draws one mask per
    example (the output is expanded first). Sound: with the same random state, changing every
    OTHER example leaves example 0's norm and its gradient unchanged (it depends on itself and
    its own mask only); the run is on ghost."""
    model = _flat(kind, p=0.5).train()
    x, y = _data()
    x2 = x.clone()
    x2[1:] = (x2[1:] + 3) % V
    groups = ParamGroups.flat(model)
    got = []
    for xs in (x, x2):
        with torch.random.fork_rng():
            torch.manual_seed(7)
            res = GhostEngine().compute(model, ce, xs, y, lambda n: torch.nn.functional.one_hot(
                torch.tensor(0), B).to(n.dtype), groups)
        assert res.engine_info["engine"] == "ghost"
        got.append(res)
    torch.testing.assert_close(got[0].norms[0], got[1].norms[0], rtol=1e-12, atol=0)
    assert_grads_close(got[0].grads, got[1].grads)


def test_error_91_unbatched_output_not_broadcast():
    model = _flat("twin:row-0")
    x, y = _data()
    with pytest.raises(UnsupportedModelError) as info:
        GhostEngine().compute(model, ce, x, y, wfn, ParamGroups.flat(model))
    assert str(info.value).startswith(
        "ghost engine: the output of layer 'pos', called without the batch dimension (its first "
        "dimension is not the batch, e.g. an Embedding on a 1-D arange(T)), is used by "
        "__getitem__ (not an elementwise broadcast); the ghost engine runs such a call on its "
        "output expanded to the batch, which gives the user's values only where the output is "
        "broadcast into example data by elementwise arithmetic (x + pe, x * pe; dropout before "
        "it): broadcast it so, or look the positions up with a (1, T) or (B, T) index, or use "
        "engine 'vmap'. The ghost engine has rules for Linear, ")
