"""Ruled layers on sequence-first tensors ``(T, B, ...)``: ``nn.Transformer*`` layers' default
``batch_first=False``.

A Linear (or transformers' Conv1D), an Embedding and a LayerNorm / RMSNorm over trailing dimensions
act on each column of a ``(T, B, ...)`` input alone; their rules read example ``i`` from index ``i``
of dimension 0, so such calls were refused ("has the batch in dimension 1"), and the default
sequence-first Transformer layers ran on whole-model vmap under ``auto``. Now a call whose input
the trace shows with the examples in dimension 1 (layout ``(1, k)``, never decided on sizes: T == B
reads the same) moves that dimension to the front before the rule reads ``a`` and ``b``, and its
output is marked ``(1, k)``. Layers that act on dimension 1 (convolutions, group and batch norms)
stay refused. Oracle: the float64 per-example loop.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dpclip.engine import AutoEngine, GhostEngine, ParamGroups, UnsupportedModelError
from dpclip.engine.batch import padded_rows
from tests.engine.helpers import DT, assert_equal_to_the_loop, ce, clip_weights

T, E = 6, 8


class SequenceFirst(nn.Module):
    """Transposes the batch-first input to ``(T, B, E)`` and runs ``core`` on it."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        if kind == "linear-layernorm":
            self.core = nn.Sequential(nn.Linear(E, E), nn.LayerNorm(E), nn.GELU(),
                                      nn.Linear(E, E), nn.RMSNorm(E))
        elif kind == "encoder-layer":
            self.core = nn.TransformerEncoderLayer(E, 2, 16, dropout=0.0)
        elif kind == "encoder":
            self.core = nn.TransformerEncoder(
                nn.TransformerEncoderLayer(E, 2, 16, dropout=0.0, norm_first=True), 2,
                enable_nested_tensor=False)
        else:
            self.core = nn.TransformerDecoderLayer(E, 2, 16, dropout=0.0)
        self.head = nn.Linear(E, 3)
        self.to(DT)

    def forward(self, x: Tensor) -> Tensor:
        s = x.transpose(0, 1)
        out = self.core(s, s) if self.kind == "decoder-layer" else self.core(s)
        return self.head(out.mean(0))


def _data(b: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(b)
    return torch.randn(b, T, E, generator=g, dtype=DT), torch.randint(0, 3, (b,), generator=g)


@pytest.mark.parametrize("b", [5, T])  # (T == B: the same path, decided on the layouts)
@pytest.mark.parametrize("kind", ["linear-layernorm", "encoder-layer", "encoder",
                                  "decoder-layer"])
def test_sequence_first_layers_run_on_ghost_equal_to_the_loop(kind, b):
    x, y = _data(b)
    model = SequenceFirst(kind)
    for groups in (ParamGroups.flat(model), ParamGroups.per_parameter(model)):
        for engine in (AutoEngine(), GhostEngine(max_physical_batch=2)):
            res = engine.compute(model, ce, x, y, clip_weights(0.3), groups)
            assert res.engine_info["engine"] == "ghost" and res.engine_info["fallback"] is None
            assert_equal_to_the_loop(res, model, ce, x, y, groups)


class _Tokens(nn.Module):
    """An Embedding on ``(T, B)`` ids and a Linear on its ``(T, B, d)`` output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 4)
        self.fc = nn.Linear(4, 3)
        self.to(DT)

    def forward(self, ids: Tensor) -> Tensor:
        return self.fc(torch.tanh(self.emb(ids.t())).mean(0))


def test_an_embedding_on_sequence_first_ids():
    g = torch.Generator().manual_seed(0)
    ids, y = torch.randint(0, 11, (5, 7), generator=g), torch.randint(0, 3, (5,), generator=g)
    model = _Tokens()
    groups = ParamGroups.per_parameter(model)
    res = AutoEngine().compute(model, ce, ids, y, clip_weights(0.3), groups)
    assert res.engine_info["engine"] == "ghost"
    assert_equal_to_the_loop(res, model, ce, ids, y, groups)


class _Refused(nn.Module):
    """A layer that acts on dimension 1, or a norm over the examples' dimension, or a mix over the
    examples after a sequence-first Linear."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.fc = nn.Linear(E, E)
        rows = padded_rows(5)  # (the rows the engine runs for the test's 5 examples)
        self.conv = nn.Conv1d(rows, rows, 1)  # (channels = the examples)
        self.norm = nn.LayerNorm([rows, E])  # (normalised over the examples and features)
        self.head = nn.Linear(E, 3)
        self.to(DT)

    def forward(self, x: Tensor) -> Tensor:
        s = self.fc(x.transpose(0, 1))  # (T, B, E)
        if self.kind == "conv":
            s = self.conv(s)  # channels = the examples
        elif self.kind == "norm":
            s = self.norm(s)
        else:
            s = s - s.mean(1, keepdim=True)
        return self.head(s.mean(0))


@pytest.mark.parametrize("kind", ["conv", "norm", "mix"])
def test_what_acts_across_the_examples_stays_refused(kind):
    x, y = _data(5)
    model = _Refused(kind)
    with pytest.raises(UnsupportedModelError):
        GhostEngine().compute(model, ce, x, y, clip_weights(0.3), ParamGroups.flat(model))


def test_a_two_dimensional_input_is_not_sequence_first_for_a_product():
    """Fifty-ninth hostile review: on a 2-D ``(E, B)`` input dimension 1 is the one a Linear
    sums over (it mixes the examples); only the batch-size proof stopped it (Linear(B, B)). And
    the trace's own layout of the output must be the input's."""
    from types import SimpleNamespace

    from dpclip.engine.ghost_rules import _RULES, _sequence_first

    lin = nn.Linear(5, 5)
    owner = SimpleNamespace(rule=_RULES[nn.Linear], module=lin)
    a2, a3 = torch.randn(5, 5), torch.randn(4, 5, 5)
    assert not _sequence_first(owner, a2, lin(a2), (1, 1), (1, 1))
    assert _sequence_first(owner, a3, lin(a3), (1, 1), (1, 1))
    assert not _sequence_first(owner, a3, lin(a3), (1, 1), "mixed")
