"""Session 27's compiled rule for a batch-less lookup (``_LookupThrough``): an ``nn.Embedding`` looked
up at constant ids with no batch dimension (T5's and MPNet's relative position buckets, ``(T, T)``)
whose output meets the examples only through broadcast uses of it or of a chain from it: T5
permutes it to ``(1, H, T, T)`` and masks it with ``where`` (the bias where the mask holds, or
where it does not), MPNet expands it to the batch. Against the float64 per-example loop, with the
adversarial twins beside them: a mask computed across the batch, the masked bias flipped over the
batch, ids computed from the batch, the lookup's output used outside a broadcast."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dpclip.engine import ParamGroups, get_engine
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import (DT, assert_equal_to_the_loop, assert_refused_or_bounded,
                                  clip_weights, loo_distance)

T, D, H, NB = 5, 4, 2, 6


def _ce(o, y):
    return F.cross_entropy(o, y, reduction="none")


class RelativeBias(nn.Module):
    """Attention scores ``(B, H, T, T)`` plus a relative position bias looked up at constant
    ``(T, T)`` buckets, used as ``how`` says; then softmax, values, mean over positions, logits."""

    def __init__(self, how: str, padding_idx: int | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.q = nn.Linear(D, D).to(DT)
        self.k = nn.Linear(D, D).to(DT)
        self.v = nn.Linear(D, D).to(DT)
        self.rel = nn.Embedding(NB, H, padding_idx=padding_idx).to(DT)
        with torch.no_grad():
            self.rel.weight.normal_()
            if padding_idx is not None:
                self.rel.weight[padding_idx] = 0
        self.out = nn.Linear(D, 3).to(DT)
        pos = torch.arange(T)
        self.register_buffer("buckets", (pos[None, :] - pos[:, None]).clamp(-2, 3) + 2,
                             persistent=False)

    def heads(self, t):
        return t.view(t.shape[0], T, H, -1).transpose(1, 2)

    def bias(self, x):
        if self.how == "ids-from-batch":  # (twin) the ids depend on the batch
            ids = (self.buckets + (x[:, :, 0].sum(0) > 0).long()[None, :]).clamp(max=NB - 1)
            return self.rel(ids).permute(2, 0, 1).unsqueeze(0)
        return self.rel(self.buckets).permute(2, 0, 1).unsqueeze(0)  # (1, H, T, T)

    def forward(self, x):
        q, k, v = self.heads(self.q(x)), self.heads(self.k(x)), self.heads(self.v(x))
        s = q @ k.transpose(-1, -2)
        bias = self.bias(x)
        keep = (x[:, :, 0] > -1.0)[:, None, None, :]  # (B, 1, 1, T): a padding mask
        if self.how in ("add", "ids-from-batch"):
            s = s + bias
        elif self.how == "where":
            s = s + torch.where(keep, bias, -30.0)
        elif self.how == "where-tensor":
            s = s + torch.where(keep, bias, s.detach() * 0 - 30.0)
        elif self.how == "where-negated":
            s = s + torch.where(~keep, -30.0, bias)
        elif self.how == "twice":  # (two layers' scores, each with the bias: two uses)
            s = (s + bias) + ((q * 0.5) @ k.transpose(-1, -2) + bias)
        elif self.how == "twice-where":
            s = (s + bias) + torch.where(keep, bias, -30.0)
        elif self.how == "expand":
            s = s + bias.expand(x.shape[0], -1, -1, -1).contiguous()
        elif self.how == "mask-across-batch":  # (twin) whether a key is kept: the batch's mean
            mixed = (x[:, :, 0] > x[:, :, 0].mean(0))[:, None, None, :]
            s = s + torch.where(mixed, bias, -30.0)
        elif self.how == "other-across-batch":  # (twin) the masked positions get the batch's mean
            s = s + torch.where(keep, bias, s.mean(0, keepdim=True).detach() * 0 + s.mean(0))
        elif self.how == "other-by-position":  # (twin) a constant that depends on the row
            pos = (torch.arange(x.shape[0]) % 2).to(s.dtype)[:, None, None, None] * 5.0
            first = (torch.arange(T) > 0)[None, None, None, :]
            s = s + torch.where(first, bias, pos.expand(x.shape[0], H, T, T))
        elif self.how == "flipped":  # (twin) example i gets example B-1-i's masked bias
            s = s + torch.where(keep, bias, -30.0).flip(0)
        elif self.how == "used-elsewhere":  # (twin) the lookup's output also summed
            s = s + bias + bias.sum() * s.mean((1, 2, 3), keepdim=True)
        else:
            raise ValueError(self.how)
        o = (s.softmax(-1) @ v).transpose(1, 2).reshape(x.shape)
        return self.out(o.mean(1))


def _batch(b=7, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, T, D, generator=g, dtype=DT), torch.randint(0, 3, (b,), generator=g)


_HONEST = ["add", "where", "where-tensor", "where-negated", "expand", "twice", "twice-where"]


@pytest.mark.parametrize("how", _HONEST)
@pytest.mark.parametrize("padding_idx", [None, 2])
def test_a_batchless_lookup_used_through_broadcasts_runs_on_the_graph_exactly(how, padding_idx):
    model = RelativeBias(how, padding_idx)
    x, y = _batch()
    groups = ParamGroups.flat(model)
    eng = get_engine("compiled")
    for _ in range(2):  # (the first step adopts the graph, the second runs it alone)
        res = eng.compute(model, _ce, x, y, clip_weights(0.05), groups)
    assert res.engine_info.get("program") == "compiled", res.engine_info
    assert_equal_to_the_loop(res, model, _ce, x, y, groups, engine=None)
    if padding_idx is not None:  # (the padding row is looked up and gets no gradient)
        assert res.grads["rel.weight"][padding_idx].abs().max() == 0


@pytest.mark.parametrize("how", ["where", "expand", "twice"])
def test_a_batchless_lookup_used_through_broadcasts_is_bounded(how):
    x, y = _batch(b=10, seed=5)
    assert loo_distance(lambda: get_engine("compiled"), lambda: RelativeBias(how), x, y, 0.01,
                        loss=_ce) <= 1 + 1e-6


@pytest.mark.parametrize("how, why", [
    ("mask-across-batch", "mixes the examples"),
    ("flipped", "not proved|separable|mixes"),
    ("other-across-batch", "mixes"),
    ("other-by-position", "not make the same for every example"),
    ("ids-from-batch", "depend on the batch"),
    ("used-elsewhere", "mixes|separable|not proved"),
])
def test_the_batchless_lookup_twins_are_refused_by_compiled_and_bounded_under_auto(how, why):
    x, y = _batch()
    model = RelativeBias(how)
    with pytest.raises(UnsupportedModelError, match=why):
        get_engine("compiled").compute(model, _ce, x, y, clip_weights(0.05),
                                       ParamGroups.flat(model))
    assert_refused_or_bounded("auto", lambda: RelativeBias(how), x, y, 0.01, _ce,
                              refusal=("",))


class Positions(nn.Module):
    """GPT-2-like, with the positions' Embedding on a 1-D ``arange(T)``: its ``(T, d)`` output
    added to the token embeddings, no chain between (the lookup's rule reads the use in the
    output's shape, not the table's: failed to reshape before, CI rehearsal of session 27)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(7, D).to(DT)
        self.pos = nn.Embedding(9, D).to(DT)  # (more rows than positions)
        self.fc = nn.Linear(D, 3).to(DT)

    def forward(self, ids):
        return self.fc(torch.tanh(self.tok(ids) + self.pos(torch.arange(ids.shape[1])))).mean(1)


@pytest.mark.parametrize("batch", [4, 5, 6])
def test_an_embedding_on_a_1d_arange_runs_on_the_graph_exactly(batch):
    model = Positions()
    g = torch.Generator().manual_seed(batch)
    x, y = torch.randint(0, 7, (batch, 5), generator=g), torch.randint(0, 3, (batch,), generator=g)
    groups = ParamGroups.flat(model)
    eng = get_engine("compiled")
    for _ in range(2):
        res = eng.compute(model, _ce, x, y, clip_weights(0.05), groups)
    assert res.engine_info.get("program") == "compiled", res.engine_info
    assert_equal_to_the_loop(res, model, _ce, x, y, groups, engine=None)

