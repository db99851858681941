"""Hundred-and-seventy-fourth hostile review: an ``nn.Embedding`` subclass whose mixin (a base
AFTER ``nn.Module`` in the MRO) defines a ``num_embeddings`` property: its setter kept the true
count in the instance's dictionary (what the checks read), its getter answered the reduction's two
reads differently once armed between steps (V - 1 in the norms, V in the weighted sum), so one
example's rows were keyed into the next example's norm and released with the first's weight:
42 C under compiled, auto, ghost and make_private. The checks scanned only the classes below
``nn.Embedding``. Now any class of the MRO but ``nn.Embedding``, ``nn.Module`` and ``object`` that
defines what the Embedding rule reads sends the layer off the rule
(``per_layer.embedding_class_defines``): refused by compiled and ghost's rule, replayed per
layer under auto."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dpclip.engine import ParamGroups, get_engine
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import DT, clip_weights

V, T, B, C = 10, 129, 4, 0.01
_STATE = {"armed": False, "reads": 0}


class _Mixin:
    def _get(self):
        n = self.__dict__["num_embeddings"]
        if not _STATE["armed"]:
            return n
        _STATE["reads"] += 1
        return n - 1 if _STATE["reads"] % 2 == 1 else n

    def _set(self, v):
        self.__dict__["num_embeddings"] = v

    num_embeddings = property(_get, _set)


class _OwnForward(nn.Embedding, _Mixin):
    def forward(self, ids):
        return super().forward(ids) * 2.0


class _Plain(nn.Embedding, _Mixin):
    pass


class _Model(nn.Module):
    def __init__(self, cls):
        super().__init__()
        torch.manual_seed(0)
        self.e = cls(V, 4).to(DT)
        self.head = nn.Linear(4, 3).to(DT)
        self.head.requires_grad_(False)

    def forward(self, ids):
        return self.head(self.e(ids).sum(1))


def _ce(o, y):
    return F.cross_entropy(o, y, reduction="none")


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V - 1, (B, T), generator=g)
    ids[2, :] = V - 1  # (the direct choice, T > 128; example 2's rows keyed into example 3's)
    ids[2, :3] = 1
    return ids, torch.randint(0, 3, (B,), generator=g)


def _flat(res):
    return torch.cat([g.double().reshape(-1) for g in res.grads.values()])


@pytest.mark.parametrize("cls", [_OwnForward, _Plain], ids=["own-forward", "plain"])
@pytest.mark.parametrize("engine", ["compiled", "auto", "ghost"])
def test_a_mixin_property_over_num_embeddings_is_refused_or_bounded(engine, cls):
    ids, y = _batch()
    model = _Model(cls)
    groups = ParamGroups.flat(model)
    eng = get_engine(engine)
    try:
        _STATE["armed"] = False
        eng.compute(model, _ce, ids, y, clip_weights(C), groups)  # (adopts a graph)
        _STATE["armed"], _STATE["reads"] = True, 0
        full = _flat(eng.compute(model, _ce, ids, y, clip_weights(C), groups))
        worst = 0.0
        for j in range(B):
            keep = [i for i in range(B) if i != j]
            rest = _flat(eng.compute(model, _ce, ids[keep], y[keep], clip_weights(C), groups))
            worst = max(worst, float((full - rest).norm()) / C)
    except UnsupportedModelError as e:
        assert "defines num_embeddings" in str(e) or "per-layer path" in str(e), e
        return
    finally:
        _STATE["armed"] = False
    assert worst <= 1 + 1e-6, worst
