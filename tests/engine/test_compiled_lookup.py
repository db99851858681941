"""The compiled engine's lookups of ``nn.Embedding`` subclasses (BART's and Gemma's scaled word
embeddings, OPT's learned positions: a forward of their own around ``F.embedding``): each
canonical lookup of the table in the graph takes the Embedding rule, the scale and the ids are
graph code like any other (``compiled._embedding_subclass``). Against the float64 per-example loop,
and the adversarial twins: a table used other than by a lookup, a class property the rule would
read, ids that mix the examples."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dpclip.engine import ParamGroups, get_engine
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import DT, assert_equal_to_the_loop, clip_weights, loo_distance


def _ce(o, y):
    return F.cross_entropy(o, y, reduction="none")


class Scaled(nn.Embedding):
    """BART's ``BartScaledWordEmbedding``: the lookup times a constant."""

    def __init__(self, n, d, pad=None, scale=3.0):
        super().__init__(n, d, pad)
        self.embed_scale = scale

    def forward(self, ids):
        return super().forward(ids) * self.embed_scale


class Positions(nn.Embedding):
    """OPT's ``OPTLearnedPositionalEmbedding``: positions from the attention mask, offset by 2."""

    def __init__(self, n, d):
        self.offset = 2
        super().__init__(n + 2, d)

    def forward(self, mask):
        pos = (torch.cumsum(mask, dim=1) * mask - 1).long()
        return super().forward(pos + self.offset)


class Model(nn.Module):
    def __init__(self, emb: type, tied: bool = False, positions: bool = False, **kw):
        super().__init__()
        torch.manual_seed(0)  # (the same weights for every model built: the LOO compares two)
        self.e = emb(10, 4, **kw).to(DT)
        self.pos = Positions(6, 4).to(DT) if positions else None
        self.head = nn.Linear(4, 10, bias=False).to(DT)
        if tied:
            self.head.weight = self.e.weight
        self.out = nn.Linear(10, 3).to(DT)

    def forward(self, ids):
        h = self.e(ids)
        if self.pos is not None:
            h = h + self.pos((ids != 0).long())
        return self.out(torch.tanh(self.head(torch.tanh(h))).mean(1))


def _batch(b=7, t=5, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 10, (b, t), generator=g)
    ids[1, 3:] = 0  # (padding rows: no gradient for the padding index)
    return ids, torch.randint(0, 3, (b,), generator=g)


_CASES = {
    "scaled": lambda: Model(Scaled, pad=0),
    "scaled-tied": lambda: Model(Scaled, tied=True, pad=0),
    "positions": lambda: Model(nn.Embedding, positions=True),
}


@pytest.mark.parametrize("case", sorted(_CASES))
@pytest.mark.parametrize("engine", ["compiled", "auto"])
def test_a_lookup_of_an_embedding_subclass_runs_on_the_graph_exactly(case, engine):
    model = _CASES[case]()
    ids, y = _batch()
    groups = ParamGroups.flat(model)
    eng = get_engine(engine)
    for _ in range(2):  # (the first step adopts the graph, the second runs it alone)
        res = eng.compute(model, _ce, ids, y, clip_weights(0.05), groups)
    assert res.engine_info.get("program") == "compiled", res.engine_info
    assert_equal_to_the_loop(res, model, _ce, ids, y, groups)


@pytest.mark.parametrize("case", sorted(_CASES))
def test_a_lookup_of_an_embedding_subclass_is_bounded(case):
    ids, y = _batch(b=12, seed=5)
    assert loo_distance(lambda: get_engine("compiled"), _CASES[case], ids, y, 0.01,
                        loss=_ce) <= 1 + 1e-9


class TableUsedOtherwise(nn.Embedding):
    """The table read outside the lookup too (every example sees the table's sum)."""

    def forward(self, ids):
        return super().forward(ids) + self.weight.sum(0)


class PaddingProperty(nn.Embedding):
    """A class property over what the rule reads: its code would run in the reduction."""

    @property
    def padding_idx(self):  # noqa: D401
        return None

    @padding_idx.setter
    def padding_idx(self, v):
        pass


class FlippedIds(Scaled):
    """The lookup of another example's ids: mixing."""

    def forward(self, ids):
        return super().forward(ids.flip(0))


@pytest.mark.parametrize("cls, why", [
    (TableUsedOtherwise, "used outside its layer's call"),
    (PaddingProperty, "needs the per-layer path"),
    (FlippedIds, "mixes the examples|not proved|separable"),
])
def test_the_adversarial_twins_are_refused_by_compiled_and_bounded_under_auto(cls, why):
    ids, y = _batch()
    model = Model(cls)
    with pytest.raises(UnsupportedModelError, match=why):
        get_engine("compiled").compute(model, _ce, ids, y, clip_weights(0.05),
                                       ParamGroups.flat(model))
    try:
        d = loo_distance(lambda: get_engine("auto"), lambda: Model(cls), ids, y, 0.01,
                         loss=_ce)
    except UnsupportedModelError:
        return
    assert d <= 1 + 1e-9
