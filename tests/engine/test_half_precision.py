"""float16 / bfloat16 models on every per-example engine (dpclip.engine._common.HALF).

Before: bfloat16's unit roundoff (2^-8) made the ghost engine's rounding bound of any reduction
longer than ~128 terms infinite, so a bfloat16 model with a sequence, an embedding or a norm layer
got every norm ``inf``, every weight 0 and an all-zero sum, silently; float16 norms were inflated
by up to ~60 % (float16's roundoff in the bound although the products were float32); and the sums
were rounded to the parameters' dtype before the noise (an error relative to the whole batch's sum:
1.42 C at C = 1.26e-7 in float16, tests/engine/test_review29_half_and_modes.py). Now the engines
compute the norms, weights, products and sums of half parameters in float32 and return float32
sums; ``dp_step`` casts the noisy release to the parameters' dtype.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

import dpclip
from dpclip.engine import (AutoEngine, GhostEngine, NaiveEngine, ParamGroups, VmapEngine,
                           naive_per_example_grads)
from tests.engine.helpers import clip_weights, loo_distance, oracle_norms

HALVES = [torch.bfloat16, torch.float16]
ENGINES = [GhostEngine, AutoEngine, VmapEngine]
B, T, V = 6, 12, 50


class _Seq(nn.Module):
    """Embedding, Linear on a sequence, LayerNorm, mean over positions, Linear head."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.fc = nn.Embedding(V, 16), nn.Linear(16, 16)
        self.norm, self.head = nn.LayerNorm(16), nn.Linear(16, 3)
        self.to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(torch.tanh(self.fc(self.emb(x)))).mean(1))


def _loss(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.float(), y, reduction="none")


def _data() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, 3, (B,), generator=g)


@pytest.mark.parametrize("engine", ENGINES, ids=["ghost", "auto", "vmap"])
@pytest.mark.parametrize("dtype", HALVES, ids=["bf16", "fp16"])
def test_half_models_get_finite_norms_near_the_float64_loop(engine, dtype):
    """Every norm finite and within a few percent of the float64 loop on the same (rounded)
    weights (the model's own half-precision forward differs from float64 by its rounding); the
    sums are float32 and not zero."""
    x, y = _data()
    model = _Seq(dtype)
    groups = ParamGroups.flat(model)
    res = engine().compute(model, _loss, x, y, clip_weights(0.5), groups)
    if engine is not VmapEngine:
        assert res.engine_info["engine"] == "ghost", res.engine_info
    assert bool(torch.isfinite(res.norms).all()), res.norms
    exact = oracle_norms(naive_per_example_grads(_Seq(dtype).double(), _loss, x, y), groups, B)
    torch.testing.assert_close(res.norms.double(), exact, rtol=0.05, atol=0.0)
    assert all(g.dtype == torch.float32 for g in res.grads.values())
    assert sum(float(g.norm()) for g in res.grads.values()) > 0


@pytest.mark.parametrize("engine", ENGINES + [NaiveEngine], ids=["ghost", "auto", "vmap", "naive"])
@pytest.mark.parametrize("dtype", HALVES, ids=["bf16", "fp16"])
def test_half_models_bound_each_example_by_c(engine, dtype):
    """Leave-one-out distance of the (float32) clipped sum <= C, at an ordinary C and at a C in
    float16's subnormal range (where a float16 sum's rounding alone was of the order of C)."""
    x, y = _data()
    for c in (0.05, 1e-7):
        assert loo_distance(engine, lambda: _Seq(dtype), x, y, c, loss=_loss,
                            exact=True) <= 1 + 1e-3


@pytest.mark.parametrize("dtype", HALVES, ids=["bf16", "fp16"])
def test_make_private_releases_in_the_parameters_dtype(dtype):
    """``p.grad`` (the noisy release) is in the parameter's dtype, and the step moves every
    parameter (the noisy sum is not lost to a zero weight or a failed cast)."""
    torch.manual_seed(0)
    model = _Seq(dtype)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, V, (64, T), generator=g), torch.randint(0, 3, (64,), generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp = dpclip.make_private(model, opt, (x, y), noise_multiplier=1.0, delta=1e-5, steps=2,
                             batch_size=16, loss_fn=_loss, verbose=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for xb, yb in dp.loader:
        dp.backward(xb, yb)
        for n, p in model.named_parameters():
            assert p.grad is not None and p.grad.dtype == dtype, n
            assert bool(torch.isfinite(p.grad).all()), n
        opt.step()
        opt.zero_grad()
    assert dp.describe()["engine"] == "ghost"
    for n, p in model.named_parameters():
        assert not torch.equal(p.detach(), before[n]), n


def test_bfloat16_bert_runs_on_ghost_with_finite_norms():
    """The usual way to fine-tune a transformers model on a GPU: bfloat16 BERT as the tokenizer
    gives its batch; auto on ghost, every norm finite and within 10 % of the float64 loop."""
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = T.BertConfig(vocab_size=40, max_position_embeddings=16, num_labels=2, hidden_size=16,
                          intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    model = T.BertForSequenceClassification(config).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 40, (4, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    x, y = {"input_ids": ids, "attention_mask": mask}, torch.tensor([0, 1, 0, 1])

    def loss(out, t):
        return F.cross_entropy(out.logits.float(), t, reduction="none")

    groups = ParamGroups.flat(model)
    res = AutoEngine().compute(model, loss, x, y, clip_weights(0.5), groups)
    assert res.engine_info["engine"] == "ghost", res.engine_info
    assert bool(torch.isfinite(res.norms).all()), res.norms
    exact = oracle_norms(naive_per_example_grads(model.double(), loss, x, y), groups, 4)
    torch.testing.assert_close(res.norms.double(), exact, rtol=0.1, atol=0.0)


class _Mlp(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 16).to(dtype), nn.Linear(16, 3).to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x.to(self.fc1.weight.dtype))))


@pytest.mark.parametrize("dtype", HALVES, ids=["bf16", "fp16"])
def test_naive_half_norms_bound_the_summed_vector(dtype):
    """naive took the norms and weights in the parameters' half dtype with no rounding bound
    (thirty-fourth hostile review: a bfloat16 norm 1.0054 times too small, LOO 1.0056 C; float16
    at C = 1e-7: 1.72 C). Now it reduces like vmap (BoundedChunkReducer): each example's
    clipped vector, alone in the batch, is at most C."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 8, generator=g), torch.randint(0, 3, (24,), generator=g)
    for c in (0.05, 1e-7):
        for j in range(24):
            model = _Mlp(dtype)
            res = NaiveEngine().compute(model, _loss, x[j:j + 1], y[j:j + 1], clip_weights(c),
                                        ParamGroups.flat(model))
            got = torch.cat([v.double().reshape(-1) for v in res.grads.values()]).norm()
            assert float(got) <= c, (c, j, float(got) / c)


class _MixedFirst(nn.Module):
    """A float64 first parameter, bfloat16 ones after it: vmap took its rounding constants
    from the first parameter's dtype (float64) although the half parameters' products and sums are
    float32 (thirty-fourth hostile review: one example's clipped vector 1.000000055 C)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 1, bias=False).double()
        self.b, self.c = nn.Linear(8, 64).to(torch.bfloat16), nn.Linear(64, 3).to(torch.bfloat16)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x.double()) * 1e-6
        return self.c(torch.tanh(self.b(x.to(torch.bfloat16)))).float() + h.float()


@pytest.mark.parametrize("engine", [VmapEngine, NaiveEngine], ids=["vmap", "naive"])
def test_mixed_dtypes_take_the_widest_rounding(engine):
    torch.manual_seed(1)
    x, y = torch.randn(200, 8), torch.randint(0, 3, (200,))
    model = _MixedFirst()
    groups = ParamGroups.flat(model)
    for c in (0.0123456, 0.3):
        for j in range(200):
            res = engine().compute(model, _loss, x[j:j + 1], y[j:j + 1], clip_weights(c), groups)
            got = torch.cat([v.double().reshape(-1) for v in res.grads.values()]).norm()
            assert float(got) <= c, (c, j, float(got) / c)


@pytest.mark.parametrize("engine", [GhostEngine, VmapEngine], ids=["ghost", "vmap"])
def test_a_subnormal_weight_is_zero(engine):
    """C = 1e-44 in float32: the weight C / n is a float32 subnormal, rounded by up to half its
    value (LOO 1.24 C before); weights below the smallest normal are now 0."""
    torch.manual_seed(1)
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

    for c in (1e-43, 1e-44):
        assert loo_distance(engine, make, x, y, c, loss=_loss, exact=True) <= 1.0


class _Fc64(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(5, 3).double()

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x)


@pytest.mark.parametrize("engine", [VmapEngine, NaiveEngine], ids=["vmap", "naive"])
def test_float64_norms_that_underflow_get_the_absolute_term(engine):
    """Per-example gradients of ~1e-170: their squares are below float64's range, the norm was 0,
    the weight 1 and the example summed unclipped (thirty-fifth hostile review: LOO 1.8e31 C at
    C = 1e-200, 280 C at 1e-162 / 1e-164). vmap and naive now add the ghost engine's absolute
    underflow term to every norm."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 5, generator=g, dtype=torch.float64), torch.arange(6) % 3
    for scale, c in ((1e-170, 1e-200), (1e-162, 1e-164)):
        def loss(out, t, scale=scale):
            return F.cross_entropy(out, t, reduction="none") * scale
        assert loo_distance(engine, _Fc64, x, y, c, loss=loss, exact=True) <= 1.0


class _F64ThenF32(nn.Module):
    """A float64 parameter first (the weights come out float64), a float32 Linear after it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(5, 1, bias=False).double()
        self.fc = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x.float()).double() + self.a(x) * 1e-3


@pytest.mark.parametrize("engine", [GhostEngine, VmapEngine, NaiveEngine],
                         ids=["ghost", "vmap", "naive"])
def test_float64_weights_below_float32s_smallest_normal_are_zero(engine):
    """Weights are float64 (the first parameter's dtype) but the float32 parameter's products are
    float32: a weight of ~1e-45 was flushed against float64's smallest normal only and its
    products rounded as float32 subnormals (thirty-fifth hostile review: 2.77 C at
    C = 1.68e-45)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 5, generator=g, dtype=torch.float64), torch.arange(6) % 3
    for c in (1.68e-45, 8.4e-45, 1.4e-44):
        assert loo_distance(engine, _F64ThenF32, x, y, c, loss=_loss, exact=True) <= 1.0
