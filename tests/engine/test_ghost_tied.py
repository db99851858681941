"""Tied parameters above the forming budget (issue 31, item 5; :mod:`dpclip.engine.tied`): the
per-example norm of the sum of the uses' gradients is exact (cross terms by ghost inner products),
not the triangle bound, for every pair of use kinds (Embedding + 2-D Linear, Embedding + Linear on
sequences, a Linear called twice, an Embedding called twice, GPT-2's ``wte``/``lm_head`` with
``transformers`` Conv1D elsewhere), and bounds the vector actually summed in float32 where the uses
cancel. Uses without a cross-term rule (a convolution called twice) keep the triangle bound.

Oracle: the float64 per-example loop (:func:`naive_per_example_grads`)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

import dpclip.engine.ghost as ghost_mod
from dpclip.engine import GhostEngine, ParamGroups, naive_per_example_grads
from tests.engine.helpers import (
    DT,
    TiedNet,
    assert_grads_close,
    ce,
    clip_weights,
    oracle_norms,
    oracle_sum,
)

B, T, V, D = 5, 6, 9, 4


class SeqTied(nn.Module):
    """Embedding tied to an output Linear applied to every position (a language-model head)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.mix = nn.Linear(D, D)
        self.out = nn.Linear(D, V, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.mix(self.emb(x)))).mean(1)


class LinearTwice(nn.Module):
    """One Linear applied twice on a sequence (weight and bias both used twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.fc = nn.Linear(D, D)
        self.head = nn.Linear(D, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x)
        return self.head(self.fc(torch.tanh(self.fc(h))).mean(1))


class EmbeddingTwice(nn.Module):
    """One Embedding looked up at the tokens and at the reversed tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.head = nn.Linear(D, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x) * torch.tanh(self.emb(x.flip(1)))
        return self.head(h.mean(1))


class ConvTwice(nn.Module):
    """A Conv1d called twice: no cross-term rule, the triangle bound stays."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.conv = nn.Conv1d(D, D, 3, padding=1)
        self.head = nn.Linear(D, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x).transpose(1, 2)
        return self.head(self.conv(torch.tanh(self.conv(h))).mean(2))


def _data(classes: int):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, classes, (B,), generator=g)


MODELS = {"embedding+2d-linear": (TiedNet, 7), "embedding+seq-linear": (SeqTied, V),
          "linear-twice": (LinearTwice, 3), "embedding-twice": (EmbeddingTwice, 3)}


@pytest.mark.parametrize("mode", ["mixed", "ghost", "direct"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_tied_norms_are_exact_above_the_forming_budget(name, mode, monkeypatch):
    """``_TIED_FORM_MAX_NUMEL = 0``: nothing is formed, yet the norms equal the float64 loop's
    (upper bounds within rounding; the triangle bound was strictly above) and the sum is the
    exactly weighted sum, flat and per parameter."""
    build, classes = MODELS[name]
    torch.manual_seed(0)
    model = build().to(DT)
    x, y = _data(classes)
    if name == "embedding+2d-linear":
        x = x % 7
    monkeypatch.setattr(ghost_mod, "_TIED_FORM_MAX_NUMEL", 0)
    per_ex = naive_per_example_grads(model, ce, x, y)
    for groups in (ParamGroups.flat(model), ParamGroups.per_parameter(model)):
        expected = oracle_norms(per_ex, groups, B)
        res = GhostEngine(norm_mode=mode).compute(model, ce, x, y, clip_weights(0.05), groups)
        assert bool((res.norms >= expected * (1 - 1e-12)).all())
        torch.testing.assert_close(res.norms, expected, rtol=1e-9, atol=1e-12)
        assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, B))


def test_uses_without_a_cross_term_rule_keep_the_triangle_bound(monkeypatch):
    torch.manual_seed(0)
    model = ConvTwice().to(DT)
    x, y = _data(3)
    monkeypatch.setattr(ghost_mod, "_TIED_FORM_MAX_NUMEL", 0)
    per_ex = naive_per_example_grads(model, ce, x, y)
    groups = ParamGroups.per_parameter(model)
    expected = oracle_norms(per_ex, groups, B)
    res = GhostEngine().compute(model, ce, x, y, clip_weights(0.05), groups)
    assert bool((res.norms >= expected * (1 - 1e-12)).all())
    assert bool((res.norms > expected * (1 + 1e-6)).any())  # the conv weight: triangle
    assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, B))


class Cancel(nn.Module):
    """One Linear applied to a sequence and, subtracted, to a slightly perturbed copy: the two
    uses' gradients cancel to ~1e-5 of each term (the exact norm is tiny, the rounding of each
    use's book-keeping is not)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return (self.fc(x) - self.fc(x + 1e-5 * x.flip(1))).flatten(1)


def _norm(grads: dict[str, Tensor]) -> float:
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))


@pytest.mark.parametrize("mode", ["mixed", "ghost", "direct"])
def test_exact_tied_norm_bounds_the_vector_summed_in_float32(mode, monkeypatch):
    """Float32, uses that cancel: for every example, the reported norm is at least the norm of
    the vector actually summed for it (weights one-hot on that example), rounding included."""
    monkeypatch.setattr(ghost_mod, "_TIED_FORM_MAX_NUMEL", 0)
    torch.manual_seed(0)
    model = Cancel()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, 16, 8, generator=g) * 100
    y = torch.randint(0, 128, (B,), generator=g)
    groups = ParamGroups.flat(model)
    engine = GhostEngine(norm_mode=mode)
    for i in range(B):
        res = engine.compute(model, ce, x, y,
                             lambda n, i=i: torch.zeros_like(n).index_fill(0, torch.tensor([i]),
                                                                            1.0), groups)
        assert _norm(res.grads) <= float(res.norms[i]), (i, _norm(res.grads), res.norms[i])


def test_exact_tied_norm_does_not_depend_on_the_batch_size(monkeypatch):
    """The cross-term norm of an example is the same in a batch of 2 and of 5 (the realised batch
    size is private: one example added or removed must not move the others' weights)."""
    monkeypatch.setattr(ghost_mod, "_TIED_FORM_MAX_NUMEL", 0)
    torch.manual_seed(0)
    model = SeqTied().to(DT)
    x, y = _data(V)
    groups = ParamGroups.flat(model)
    small = GhostEngine().compute(model, ce, x[:2], y[:2], clip_weights(0.05), groups)
    big = GhostEngine().compute(model, ce, x, y, clip_weights(0.05), groups)
    torch.testing.assert_close(big.norms[:2], small.norms, rtol=1e-12, atol=0)
