"""Constants shaped by the batch size that are the same in every row, and embedding gradients that
vmap batches at batch-less indices (issue 31, the Hugging Face zoo: BART, mBART, Marian, Pegasus).

* transformers' decoders build their causal mask, when no decoder mask is given, from
  ``torch.ones(B, T)`` read at ``padding_mask[arange(B)[:, None, None, None], kv_idx]`` and joined
  to the causal part with ``&``. The batch-size proof refused the read ("a constant whose shape is
  the batch size is used by index"), so every encoder-decoder model ran on whole-model vmap. A
  UNIFORM constant (a fill with a B-free value, an expand of a B-free tensor, kept so by copies,
  elementwise operations with B-free operands and such reads) has the same values in every row,
  free of ``B``; read at ``arange(B)`` (in range by construction) along the batch dimension and at
  B-free indices elsewhere, it stays uniform (``batch_symbol._uniform_index``). Every other read
  of a B-shaped constant stays refused, with attacks below.
* an ``nn.Embedding`` subclass on the per-layer path called on 1-D positions (BART's learned
  position embedding, ``(1, T, d)`` out): ``vmap`` batches its gradient by folding the examples
  into the features of ONE ``embedding_dense_backward`` and moves them back with a permute issued
  below the dispatch mode. The tracer took that permute for a tensor "computed outside the
  dispatch trace" and the backward for mixing, and refused the step outright (not even a vmap
  fallback). The permute is now judged by the handler that issued it, and the backward has a rule:
  constant indices, the examples in the gradient's last dimension, the output's last dimension
  the same way.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dpclip.engine import AutoEngine, GhostEngine, ParamGroups
from dpclip.engine.batch_symbol import batch_size_uses
from dpclip.engine.errors import UnsupportedModelError
from dpclip.engine.separable import MIXED, _embedding_dense_backward
from tests.engine.helpers import DT, assert_equal_to_the_loop, clip_weights

B, T, D = 4, 5, 6


def ce(o, y):
    return F.cross_entropy(o, y, reduction="none")


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, D, generator=g, dtype=DT), torch.randint(0, 3, (B,), generator=g)


class DecoderMask(nn.Module):
    """A causal self-attention whose mask is built as transformers' ``sdpa_mask`` builds it when no
    decoder attention mask is given: ``torch.ones(B, T)`` read at ``(arange(B), kv)`` and ``&``-ed
    with the causal part."""

    def __init__(self, how: str = "transformers") -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, 3)
        self.how = how

    def mask(self, x):
        b, t = x.shape[0], x.shape[1]
        pad = torch.ones(b, t, device=x.device).to(torch.bool)
        rows = torch.arange(b)[:, None, None, None]
        kv = torch.arange(t)[None, None, None, :]
        q = torch.arange(t)[None, None, :, None]
        return pad[rows, kv] & (kv <= q)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        att = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None],
                                             attn_mask=self.mask(x))
        return self.out(att[:, 0].tanh()).mean(1)


def test_the_decoder_mask_from_ones_is_proved_and_runs_on_ghost():
    torch.manual_seed(0)
    model = DecoderMask().to(DT)
    x, y = _data()
    assert batch_size_uses(model, ce, x, y) is None
    res = AutoEngine().compute(model, ce, x, y, clip_weights(0.4), ParamGroups.flat(model))
    assert_equal_to_the_loop(res, model, ce, x, y, ParamGroups.flat(model))


class Attack(DecoderMask):
    """A constant shaped by the batch size read in ways whose values can depend on it."""

    def mask(self, x):
        b, t = x.shape[0], x.shape[1]
        kv = torch.arange(t)[None, None, None, :]
        q = torch.arange(t)[None, None, :, None]
        causal = kv <= q
        if self.how == "fixed row index":  # ones(B)[5]: in range only for B > 5
            c = torch.ones(b, t).to(torch.bool)[torch.full((b,), 5)[:, None, None, None], kv]
        elif self.how == "last row of arange":  # arange(B)[-1] = B - 1 in every row
            c = torch.arange(b)[torch.zeros(b, dtype=torch.long) - 1][:, None, None, None] \
                > t + 2 + kv * 0
        elif self.how == "positions by a B-shaped index":  # ones(B, T) at (arange(B) % T)
            c = torch.ones(b, t).to(torch.bool)[:, torch.arange(b) % t][:, None, None, :t]
        elif self.how == "cumsum of ones":  # cumsum(ones(B)) = 1..B: not uniform
            c = torch.ones(b, t).cumsum(0).to(torch.bool)[torch.arange(b)[:, None, None, None],
                                                          kv]
        elif self.how == "row index of another size":  # arange(B - 1) at a dimension of B
            c = torch.ones(b, t).to(torch.bool)[torch.arange(b - 1)[:, None, None, None], kv]
        else:
            raise KeyError(self.how)
        return c & causal


ATTACKS = ["fixed row index", "last row of arange", "positions by a B-shaped index",
           "cumsum of ones", "row index of another size"]


@pytest.mark.parametrize("how", ATTACKS)
def test_other_reads_of_batch_shaped_constants_stay_refused(how):
    torch.manual_seed(0)
    model = Attack(how).to(DT)
    x, y = _data()
    reason = batch_size_uses(model, ce, x, y)
    assert reason is not None and "batch size" in reason, reason
    with pytest.raises((UnsupportedModelError, RuntimeError, IndexError)):
        GhostEngine().compute(model, ce, x, y, clip_weights(0.4), ParamGroups.flat(model))


def test_ones_sum_is_still_refused():
    """The uniform rule admits reads, not reductions: ``ones(B).sum()`` is ``B``."""

    class Sum(DecoderMask):
        def forward(self, x):
            return super().forward(x) / torch.ones(x.shape[0], T).sum()

    model = Sum().to(DT)
    x, y = _data()
    assert batch_size_uses(model, ce, x, y) is not None


class LearnedPositions(nn.Embedding):
    """BART's learned position embedding: an ``nn.Embedding`` subclass (the per-layer path) called
    with the batch's ids and 1-D positions, returning ``(1, T, d)``."""

    def __init__(self, n: int, d: int) -> None:
        super().__init__(n + 2, d)
        self.offset = 2

    def forward(self, input_ids, past=0, position_ids=None):
        return super().forward(position_ids.unsqueeze(0) + self.offset)


class WithPositions(nn.Module):
    def __init__(self, scale_grad: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(20, D)
        self.pos = LearnedPositions(8, D)
        self.pos.scale_grad_by_freq = scale_grad
        self.out = nn.Linear(D, 3)

    def forward(self, ids):
        h = self.tok(ids) + self.pos(ids, 0, position_ids=torch.arange(ids.shape[1]))
        return self.out(h.tanh()).mean(1)


@pytest.mark.parametrize("scale_grad", [False, True])
def test_embedding_subclass_on_positions_runs_on_ghost(scale_grad):
    torch.manual_seed(0)
    model = WithPositions(scale_grad).to(DT)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 20, (B, T), generator=g), torch.randint(0, 3, (B,), generator=g)
    res = AutoEngine().compute(model, ce, x, y, clip_weights(0.3), ParamGroups.flat(model))
    assert res.engine_info.get("per_layer") == ("pos",)
    assert_equal_to_the_loop(res, model, ce, x, y, ParamGroups.flat(model))


class _Layouts:
    def __init__(self, **lay):
        self.lay = lay

    def layout(self, t):
        return self.lay.get(getattr(t, "tag", None))


def _tagged(t, tag):
    t.tag = tag
    return t


def test_embedding_backward_rule():
    """Examples in the gradient's last dimension at constant indices: the output's last dimension
    the same way; examples in the positions (summed by the backward) or in the indices: MIXED."""
    op = torch.ops.aten.embedding_dense_backward.default
    grad = _tagged(torch.randn(1, T, B * D), "g")
    idx = _tagged(torch.arange(T)[None], "i")
    out = op(grad, idx, 10, -1, False)
    assert _embedding_dense_backward(_Layouts(g=(2, D)), op, (grad, idx, 10, -1, False), {},
                                     out) == (1, D)
    # the examples along the positions: the backward sums positions with equal indices
    grad2 = _tagged(torch.randn(B * T, D), "g")
    idx2 = _tagged(torch.arange(T).repeat(B), "i")
    out2 = op(grad2, idx2, 10, -1, False)
    assert _embedding_dense_backward(_Layouts(g=(0, T)), op, (grad2, idx2, 10, -1, False), {},
                                     out2) is MIXED
    # indices that depend on the batch
    assert _embedding_dense_backward(_Layouts(g=(2, D), i=(0, 1)), op,
                                     (grad, idx, 10, -1, False), {}, out) is MIXED
    # nothing from the batch: constant
    assert _embedding_dense_backward(_Layouts(), op, (grad, idx, 10, -1, False), {}, out) is None
