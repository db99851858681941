"""An embedding lookup inside a module on the per-layer path (no ghost rule: Gemma's scaled word
embedding, a custom wrapper around ``F.embedding``). Its replay under ``torch.func.vmap`` batches
the lookup's gradient by offsetting example ``i``'s indices by ``i V`` and running one
``embedding_dense_backward`` over ``B V`` rows (then, with a ``padding_idx``, zeroing that row of
every example's block). The trace took the offsets for a constant that depends on the position in
the batch and refused every such module ("not proved to read example i alone"), and ``auto``
stopped the run. ``per_layer.RecomputeTracer`` now recognises that batching rule by value
(offsets ``arange(0, B V, V)``, indices of layout ``(0, 1)`` in ``[0, V)``, the backward's output
``V`` rows per example, a constant written into the padding row of every block), and nothing
else: the same steps with anything mixed in stay refused.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from dpclip.engine import AutoEngine, GhostEngine, ParamGroups, naive_per_example_grads
from dpclip.engine import UnsupportedModelError
from tests.engine.helpers import (DT, assert_equal_to_the_loop, assert_grads_close, clip_weights,
                                  oracle_norms, oracle_sum)

V, D = 11, 4


class _Scaled(nn.Module):
    def __init__(self, padding_idx: int | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(V, D, dtype=DT))
        self.padding_idx = padding_idx
        self.register_buffer("scale", torch.tensor(D ** 0.5, dtype=DT))

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight, self.padding_idx) * self.scale


class _Model(nn.Module):
    def __init__(self, padding_idx: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = _Scaled(padding_idx)
        self.fc = nn.Linear(D, 3).to(DT)

    def forward(self, ids: Tensor) -> Tensor:
        return self.fc(torch.tanh(self.emb(ids)).mean(1))


def _ce(o: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(o, y, reduction="none")


@pytest.mark.parametrize("padding_idx", [None, 0, 7])
@pytest.mark.parametrize("chunk", [None, 2, 1])
def test_an_embedding_in_a_per_layer_module_runs_on_ghost_equal_to_the_loop(padding_idx, chunk):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (5, 6), generator=g)
    ids[0, :3] = 0  # padding tokens (when padding_idx is 0)
    ids[1, 2] = 7
    y = torch.randint(0, 3, (5,), generator=g)
    model = _Model(padding_idx)
    groups = ParamGroups.flat(model)
    engine = AutoEngine() if chunk is None else GhostEngine(max_physical_batch=chunk)
    res = engine.compute(model, _ce, ids, y, clip_weights(0.5), groups)
    assert res.engine_info["engine"] == "ghost", res.engine_info
    assert res.engine_info["per_layer"] == ("emb",)
    per_ex = naive_per_example_grads(model, _ce, ids, y)
    torch.testing.assert_close(res.norms, oracle_norms(per_ex, groups, 5), rtol=1e-10, atol=1e-12)
    assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, 5))


class _MixesIds(nn.Module):
    """The same module, its indices shifted by the next example's first index: mixing."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(V, D, dtype=DT))

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding((ids + ids.roll(1, 0)[:, :1]) % V, self.weight)


def test_an_embedding_of_mixed_indices_stays_refused():
    torch.manual_seed(0)
    model = nn.Sequential(_MixesIds(), nn.Flatten(), nn.Linear(6 * D, 3).to(DT))
    ids, y = torch.randint(0, V, (5, 6)), torch.randint(0, 3, (5,))
    with pytest.raises(UnsupportedModelError):
        GhostEngine().compute(model, _ce, ids, y, clip_weights(0.5), ParamGroups.flat(model))


def test_the_offsets_are_recognised_by_value_only():
    from dpclip.engine.per_layer import _block_offsets

    b = 3
    assert _block_offsets(torch.arange(0, 33, 11).view(3, 1, 1), b) == 11
    assert _block_offsets(torch.tensor([0, 11, 23]).view(3, 1), b) is None
    assert _block_offsets(torch.tensor([0, 11, 22, 33]).view(4, 1), b) is None
    assert _block_offsets(torch.arange(0, 33, 11, dtype=torch.float64).view(3, 1), b) is None
    assert _block_offsets(torch.arange(0, 33, 11).view(1, 3), b) is None
    assert _block_offsets(torch.zeros(3, 1, dtype=torch.long), b) is None


class _HasUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(D, dtype=DT))
        self.unused = nn.Parameter(torch.randn(3, dtype=DT))

    def forward(self, h: Tensor) -> Tensor:
        return h * self.a


def test_a_parameter_the_per_layer_call_does_not_use_gets_zero_not_a_refusal():
    """Its replayed per-example gradient is a constant (zero): refused before as "layout None,
    not (0, 1)", and ``auto`` stopped the run. A zero constant is every example's own gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), _HasUnused(), nn.Tanh(), nn.Linear(D, 3)).to(DT)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(5, D, generator=g, dtype=DT), torch.randint(0, 3, (5,), generator=g)
    groups = ParamGroups.flat(model)
    res = AutoEngine().compute(model, _ce, x, y, clip_weights(0.5), groups)
    assert_equal_to_the_loop(res, model, _ce, x, y, groups)
    assert not res.grads["1.unused"].any()


class _Indexes(nn.Module):
    """``weight[ids]`` (advanced indexing): vmap batches its gradient as ``index_put`` into
    ``(B, V, d)`` zeros at ``[arange(B), ids]``; ``roll`` mixes the rows' indices."""

    def __init__(self, roll: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(V, D, dtype=DT))
        self.roll = roll

    def forward(self, ids: Tensor) -> Tensor:
        return self.weight[ids.roll(1, 0) if self.roll else ids] * 2.0


@pytest.mark.parametrize("chunk", [None, 2])
def test_weight_indexed_by_ids_in_a_per_layer_module_runs_on_ghost_equal_to_the_loop(chunk):
    torch.manual_seed(0)
    model = nn.Sequential(_Indexes(False), nn.Tanh(), nn.Flatten(), nn.Linear(6 * D, 3)).to(DT)
    g = torch.Generator().manual_seed(3)
    ids, y = torch.randint(0, V, (5, 6), generator=g), torch.randint(0, 3, (5,), generator=g)
    groups = ParamGroups.flat(model)
    engine = AutoEngine() if chunk is None else GhostEngine(max_physical_batch=chunk)
    res = engine.compute(model, _ce, ids, y, clip_weights(0.5), groups)
    assert res.engine_info["engine"] == "ghost", res.engine_info
    per_ex = naive_per_example_grads(model, _ce, ids, y)
    torch.testing.assert_close(res.norms, oracle_norms(per_ex, groups, 5), rtol=1e-10, atol=1e-12)
    assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, 5))


def test_weight_indexed_by_another_example_s_ids_stays_refused():
    torch.manual_seed(0)
    model = nn.Sequential(_Indexes(True), nn.Flatten(), nn.Linear(6 * D, 3)).to(DT)
    ids, y = torch.randint(0, V, (5, 6)), torch.randint(0, 3, (5,))
    with pytest.raises(UnsupportedModelError):
        GhostEngine().compute(model, _ce, ids, y, clip_weights(0.5), ParamGroups.flat(model))


def test_an_index_put_is_per_example_only_when_each_row_writes_its_own_row():
    from dpclip.engine.per_layer import _rows_put_own
    from dpclip.engine.separable import MIXED, SeparabilityTracer

    b = 3
    tr = SeparabilityTracer(b)
    ids, vals = torch.randint(0, V, (b, 1, 5)), torch.randn(b, 1, 5, D)
    tr.mark(ids, (0, 1))
    tr.mark(vals, (0, 1))
    dest = torch.zeros(b, V, D)
    own = torch.arange(b).view(b, 1, 1).expand(b, 1, 5)
    assert _rows_put_own(tr, (dest, [own, ids], vals, True), b)
    assert not _rows_put_own(tr, (dest, [own.flip(0), ids], vals, True), b)  # other rows
    assert not _rows_put_own(tr, (dest, [torch.zeros_like(own), ids], vals, True), b)
    assert not _rows_put_own(tr, (dest, [ids, own], vals, True), b)  # rows from data
    mixed = torch.randn(b, 1, 5, D)
    tr.mark(mixed, MIXED)
    assert not _rows_put_own(tr, (dest, [own, ids], mixed, True), b)
