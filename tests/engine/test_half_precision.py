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
from dpclip.engine import AutoEngine, GhostEngine, ParamGroups, VmapEngine, naive_per_example_grads
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


@pytest.mark.parametrize("engine", ENGINES, ids=["ghost", "auto", "vmap"])
@pytest.mark.parametrize("dtype", HALVES, ids=["bf16", "fp16"])
def test_half_models_bound_each_example_by_c(engine, dtype):
    """Leave-one-out distance of the (float32) clipped sum <= C, at an ordinary C and at a C in
    float16's subnormal range (where a float16 sum's rounding alone was of the order of C)."""
    x, y = _data()
    for c in (0.05, 1e-7):
        assert loo_distance(engine, lambda: _Seq(dtype), x, y, c, loss=_loss) <= 1 + 1e-3


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
