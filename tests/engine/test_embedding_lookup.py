"""Embedding lookups on the per-layer path without forming ``(B, V, d)`` (issue 31, the zoo at real
sizes): an ``nn.Embedding`` subclass whose forward is ``super().forward(ids) * scale`` (BART's,
mBART's and Gemma's scaled word embeddings, a Python number or a 0-dim buffer) is recognised from
its call's autograd graph (``per_layer.embedding_lookup``) and given the Embedding rule (ghost norms
from the ids, ``index_add`` of the weighted output gradients), where the replay under ``vmap``
formed every example's whole table (BART-base: 38.6 M floats an example). ``engine_info`` names
such modules (``embedding_lookup``). Every other form keeps the replay, equal to the loop.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dpclip.engine import AutoEngine, GhostEngine, ParamGroups, naive_per_example_grads
from dpclip.engine.errors import UnsupportedModelError
from tests.engine.helpers import DT, assert_matches_the_loop, clip_weights

B, T, V, D = 4, 7, 20, 6


def ce(o, y):
    return F.cross_entropy(o, y, reduction="none")


class Scaled(nn.Embedding):
    def __init__(self, how: str, padding_idx=None) -> None:
        super().__init__(V, D, padding_idx=padding_idx)
        self.how = how
        self.register_buffer("scale", torch.tensor(2.5), persistent=False)

    def forward(self, ids):
        e = super().forward(ids)
        how = self.how
        if how == "float":  # BART: * embed_scale (a Python float)
            return e * 2.5
        if how == "buffer":  # Gemma: * self.embed_scale.to(self.weight.dtype)
            return e * self.scale.to(self.weight.dtype)
        if how == "left":
            return 0.5 * e
        if how == "plain":
            return e
        if how == "int":  # a Python int scale
            return e * 2
        # --- forms that keep the replay (correct, not recognised)
        if how == "weight used twice":
            return e * 2.5 + self.weight[0]
        if how == "ids made inside":
            return super().forward((ids + 1) % V)
        if how == "cast after":
            return (e * 2.5).float().to(e.dtype)
        if how == "per-position scale":
            return e * torch.linspace(0.5, 1.5, ids.shape[1], dtype=e.dtype)[:, None]
        # --- refused
        if how == "scale from the batch":
            return e * ids.to(e.dtype).mean()
        raise KeyError(how)


class Net(nn.Module):
    def __init__(self, how: str, padding_idx=None, tie: bool = False) -> None:
        super().__init__()
        self.emb = Scaled(how, padding_idx)
        self.fc = nn.Linear(D, 3)
        self.tie = tie
        if tie:  # an output layer tied to the table (GPT-2's wte / lm_head; BART's lm_head)
            self.head = nn.Linear(D, V, bias=False)
            self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids).tanh()
        if self.tie:
            h = h + self.head(h)[..., :D]
        return self.fc(h).mean(1)


def _batch(seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[0, :3] = 1  # padding in one example (the rows of padding_idx get no gradient)
    return ids, torch.randint(0, 3, (B,), generator=g)


@pytest.mark.parametrize("how,pad,tie", [
    ("float", None, False), ("buffer", None, False), ("left", None, False), ("plain", 1, False),
    ("float", 1, False), ("float", None, True), ("int", None, False)])
def test_scaled_embedding_takes_the_embedding_rule(how, pad, tie):
    torch.manual_seed(0)
    model = Net(how, pad, tie).to(DT)
    x, y = _batch()
    groups = ParamGroups.flat(model)
    res = GhostEngine().compute(model, ce, x, y, clip_weights(0.3), groups)
    assert res.engine_info.get("embedding_lookup") == ("emb",), res.engine_info
    assert_matches_the_loop(res, naive_per_example_grads(model, ce, x, y), groups, B)


@pytest.mark.parametrize("how", ["weight used twice", "ids made inside", "cast after",
                                 "per-position scale"])
def test_other_forms_keep_the_replay(how):
    torch.manual_seed(0)
    model = Net(how).to(DT)
    x, y = _batch()
    groups = ParamGroups.flat(model)
    res = GhostEngine().compute(model, ce, x, y, clip_weights(0.3), groups)
    assert "embedding_lookup" not in res.engine_info, res.engine_info
    assert_matches_the_loop(res, naive_per_example_grads(model, ce, x, y), groups, B)


def test_a_scale_computed_from_the_batch_is_refused():
    torch.manual_seed(0)
    model = Net("scale from the batch").to(DT)
    x, y = _batch()
    with pytest.raises(UnsupportedModelError):
        GhostEngine().compute(model, ce, x, y, clip_weights(0.3), ParamGroups.flat(model))
    res = AutoEngine().compute(model, ce, x, y, clip_weights(0.3), ParamGroups.flat(model))
    assert res.engine_info["engine"] == "vmap"


class RewritesIds(nn.Module):
    """The ids the lookup read, rewritten in place after the call (with the version counter
    seen): the rule would read other ids than the lookup's."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = Scaled("float")
        self.fc = nn.Linear(D, 3)

    def forward(self, ids):
        ids = ids.clone()
        h = self.emb(ids)
        ids.add_(1).remainder_(V)
        return self.fc(h.tanh()).mean(1)


def test_ids_rewritten_after_the_lookup_are_refused():
    torch.manual_seed(0)
    model = RewritesIds().to(DT)
    x, y = _batch()
    with pytest.raises(UnsupportedModelError, match="modified in place|rewritten|changed"):
        GhostEngine().compute(model, ce, x, y, clip_weights(0.3), ParamGroups.flat(model))


class NegativePadding(nn.Embedding):
    """The sixty-second hostile review's: ``torch.embedding`` called with the module's negative
    ``padding_idx`` (ATen reads it as no padding, F.embedding as ``V + p``): recognised, the rule
    zeroed row ``V - 3`` (norms 5.5 % off). Now the replay, equal to the loop."""

    def __init__(self) -> None:
        super().__init__(V, D)
        self.padding_idx = -3

    def forward(self, ids):
        return torch.embedding(self.weight, ids, self.padding_idx, False, False) * 2.5


def test_a_negative_padding_index_keeps_the_replay():
    torch.manual_seed(0)
    model = Net("plain").to(DT)
    model.emb = NegativePadding().to(DT)
    x, y = _batch()
    x[1, :2] = V - 3
    groups = ParamGroups.flat(model)
    res = GhostEngine().compute(model, ce, x, y, clip_weights(0.3), groups)
    assert "embedding_lookup" not in res.engine_info, res.engine_info
    assert_matches_the_loop(res, naive_per_example_grads(model, ce, x, y), groups, B)


@pytest.mark.parametrize("count", [5, 1, 10.0])
def test_an_embedding_whose_num_embeddings_is_not_its_table_is_refused(count):
    """The rule keys each (example, token) as ``example * num_embeddings + token``: a count
    smaller than the table's rows made two examples' keys meet (a RuntimeError inside the
    reduction before); a float count is not the table's either. Refused, the layer named."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 3)).to(DT)
    model[0].num_embeddings = count
    x, y = torch.randint(0, 10, (6, 3)), torch.randint(0, 3, (6,))
    with pytest.raises(UnsupportedModelError, match="'0' .*num_embeddings"):
        GhostEngine().compute(model, lambda o, t: F.cross_entropy(o, t, reduction="none"), x, y,
                              clip_weights(1.0), ParamGroups.flat(model))
