"""``nn.MultiheadAttention`` (and the ``nn.Transformer*`` layers built on it) on the ghost engine.

``F.multi_head_attention_forward`` works sequence-first: a batch-first ``(B, T, E)`` input is
transposed to ``(T, B, E)`` and ``F.linear`` flattens that to ``(T B, E)``, where example ``i``
owns rows ``t B + i``, not a block of consecutive rows. The separability tracer had no layout for
that and called the attention's input projection a mix of the examples, so ``auto`` fell back to
whole-model ``vmap``. It now tracks such a dimension as ``Folded(d, k, outer)`` through the
operations that keep it exactly (views and reshapes, a matrix product with a constant factor,
copies, elementwise operations with constants that are the same for every example); every other
rule, and the engine, reads it as a mix. The attention then runs on the per-layer path: its call
owns ``in_proj_*`` (or ``q/k/v_proj_weight``), ``bias_k``/``bias_v`` and ``out_proj``'s weight and
bias (``out_proj`` is never called as a module: the functional forward applies its parameters),
and the attention weights, when only the output is used, are dead code in the proof and give no
gradient. Oracle: the float64 per-example loop.

``batch_first=False`` layers called on a ``(T, B, E)`` tensor receive the batch in dimension 1:
the per-layer path needs batch-first arguments and refuses them (``auto`` falls back to
``vmap``); ``nn.Transformer*`` layers with ``batch_first=True`` are batch-first throughout.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dpclip.engine import (AutoEngine, GhostEngine, ParamGroups, UnsupportedModelError,
                           naive_per_example_grads)
from dpclip.engine.separable import MIXED, Folded, SeparabilityTracer
from tests.engine.helpers import DT, assert_matches_the_loop, ce, clip_weights

B, T, E, H = 5, 6, 4, 2


def _x(*shape: int, seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _y(seed: int = 1) -> Tensor:
    return torch.randint(0, 3, (B,), generator=torch.Generator().manual_seed(seed))


def _padding(seed: int = 2) -> Tensor:
    """A ``(B, T)`` key padding mask (True: ignored) that never masks position 0."""
    m = torch.rand(B, T, generator=torch.Generator().manual_seed(seed)) < 0.4
    m[:, 0] = False
    return m


class SelfAttention(nn.Module):
    """``MultiheadAttention(batch_first=True)`` on ``(B, T, E)``, mean-pooled into a Linear;
    ``call`` holds the keyword arguments of the attention call, ``use`` which outputs reach the
    loss (``"out"``, ``"weights"`` or ``"both"``)."""

    def __init__(self, use: str = "out", mask: Tensor | None = None, **mha: object) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.MultiheadAttention(E, H, batch_first=True, **mha)
        self.h = nn.Linear(E, 3)
        self.g = nn.Linear(T, 3)
        self.use, self.call = use, {}
        if mask is not None:
            self.register_buffer("mask", mask)
        self.to(DT)

    def forward(self, x: Tensor, pad: Tensor | None = None) -> Tensor:
        kw = dict(self.call)
        if hasattr(self, "mask"):
            kw["attn_mask"] = self.mask
        if pad is not None:
            kw["key_padding_mask"] = pad
        o, w = self.a(x, x, x, **kw)
        if self.use == "out":
            return self.h(o.mean(1))
        w = w.mean(-1) if w.ndim == 3 else w.mean((1, 3))  # averaged or per head: (B, T)
        return self.g(w) if self.use == "weights" else self.h(o.mean(1)) + self.g(w)


def _check(model: nn.Module, x, y: Tensor, per_layer: tuple[str, ...] = ("a",),
           engines=None) -> None:
    """On ghost (``per_layer``: the attention calls), equal to the float64 per-example loop, for
    flat and per-parameter groups, ``auto``, ``ghost`` and ``ghost`` in chunks of 2."""
    per_ex = naive_per_example_grads(model, ce, x, y)
    for groups in (ParamGroups.flat(model), ParamGroups.per_parameter(model)):
        for engine in engines or (AutoEngine(), GhostEngine(), GhostEngine(max_physical_batch=2)):
            res = engine.compute(model, ce, x, y, clip_weights(0.3), groups)
            assert res.engine_info["engine"] == "ghost", res.engine_info
            assert res.engine_info["fallback"] is None
            assert res.engine_info["per_layer"] == per_layer
            assert_matches_the_loop(res, per_ex, groups, B)


def _causal() -> Tensor:
    return nn.Transformer.generate_square_subsequent_mask(T, dtype=DT)


CASES = [
    ("need-weights", lambda: SelfAttention()),
    ("no-weights", lambda: _with(SelfAttention(), need_weights=False)),
    ("weights-used", lambda: SelfAttention("both")),
    ("weights-per-head", lambda: _with(SelfAttention("both"), average_attn_weights=False)),
    ("weights-only", lambda: SelfAttention("weights")),
    ("float-mask", lambda: SelfAttention(mask=_x(T, T, seed=5))),
    ("bool-mask", lambda: SelfAttention(mask=torch.rand(T, T, generator=torch.Generator()
                                                        .manual_seed(6)) < 0.3)),
    ("causal", lambda: _with(SelfAttention(mask=_causal()), is_causal=True)),
    ("causal-no-weights", lambda: _with(SelfAttention(mask=_causal()), is_causal=True,
                                        need_weights=False)),
    ("no-bias", lambda: SelfAttention(bias=False)),
    ("bias-kv", lambda: SelfAttention("both", add_bias_kv=True)),
    ("zero-attn", lambda: SelfAttention(add_zero_attn=True, add_bias_kv=True)),
]


def _with(model: SelfAttention, **call: object) -> SelfAttention:
    model.call = call
    return model


@pytest.mark.parametrize("name, build", CASES, ids=[c[0] for c in CASES])
def test_self_attention_runs_on_ghost_equal_to_the_loop(name, build):
    _check(build(), _x(B, T, E), _y())


@pytest.mark.parametrize("need", [True, False])
def test_key_padding_mask_of_each_example(need):
    """A ``(B, T)`` key padding mask passed with the batch: example data, bool and float."""
    model = _with(SelfAttention("both" if need else "out"), need_weights=need)
    pad = _padding()
    _check(model, (_x(B, T, E), pad), _y())
    _check(model, (_x(B, T, E), torch.zeros(B, T, dtype=DT).masked_fill(pad, -1e4)), _y(),
           engines=(AutoEngine(),))


class CrossAttention(nn.Module):
    """Queries from ``x`` (``(B, T, E)``), keys and values from a memory of other widths
    (``kdim``, ``vdim``: separate ``q/k/v_proj_weight``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.MultiheadAttention(E, H, batch_first=True, kdim=3, vdim=5, add_bias_kv=True)
        self.h = nn.Linear(E, 3)
        self.to(DT)

    def forward(self, x: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return self.h(self.a(x, k, v)[0].mean(1))


def test_cross_attention_with_other_key_and_value_widths():
    model = CrossAttention()
    roles = {n for n, _ in model.named_parameters()}
    assert {"a.q_proj_weight", "a.k_proj_weight", "a.v_proj_weight", "a.bias_k"} <= roles
    _check(model, (_x(B, T, E), _x(B, 7, 3, seed=3), _x(B, 7, 5, seed=4)), _y())


def test_dropout_in_train_mode_runs_on_ghost():
    """Attention dropout in train mode: the forward draws its masks, the per-layer replay draws
    fresh ones (each example's vector a function of that example alone, as under ``vmap``), so
    the result is not the loop's; it runs on ghost, with every norm finite."""
    for need in (True, False):
        model = _with(SelfAttention(dropout=0.3), need_weights=need).train()
        x, y = _x(B, T, E), _y()
        res = AutoEngine().compute(model, ce, x, y, clip_weights(0.3), ParamGroups.flat(model))
        assert res.engine_info["engine"] == "ghost", res.engine_info
        assert res.engine_info["per_layer"] == ("a",)
        assert bool(torch.isfinite(res.norms).all())
    model = SelfAttention(dropout=0.3).eval()  # eval: no dropout, the loop's exactly
    _check(model, _x(B, T, E), _y(), engines=(AutoEngine(),))


def _encoder(norm_first: bool) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=8, dropout=0.0, batch_first=True,
                                       norm_first=norm_first)
    return nn.Sequential(layer, _Pool(), nn.Linear(E, 3)).to(DT)


class _Pool(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.mean(1)


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_layer(norm_first):
    model = _encoder(norm_first)
    per_layer = ("0.self_attn",)
    _check(model, _x(B, T, E), _y(), per_layer=per_layer)


class _Stack(nn.Module):
    """A 2-layer ``nn.TransformerEncoder`` (``enable_nested_tensor=False``) with a per-example
    ``src_key_padding_mask``, or a ``TransformerDecoderLayer`` over a memory."""

    def __init__(self, decoder: bool = False, norm_first: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.decoder = decoder
        if decoder:
            self.t = nn.TransformerDecoderLayer(E, H, dim_feedforward=8, dropout=0.0,
                                                batch_first=True, norm_first=norm_first)
        else:
            layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=8, dropout=0.0,
                                               batch_first=True, norm_first=norm_first)
            self.t = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.h = nn.Linear(E, 3)
        self.to(DT)

    def forward(self, x: Tensor, pad: Tensor) -> Tensor:
        if self.decoder:
            o = self.t(x, x.flip(1), tgt_mask=_causal(), tgt_is_causal=True,
                       memory_key_padding_mask=pad)
        else:
            o = self.t(x, src_key_padding_mask=pad)
        return self.h(o.mean(1))


def test_transformer_encoder_with_padding_mask():
    model = _Stack()
    _check(model, (_x(B, T, E), _padding()), _y(),
           per_layer=("t.layers.0.self_attn", "t.layers.1.self_attn"))


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_decoder_layer(norm_first):
    model = _Stack(decoder=True, norm_first=norm_first)
    _check(model, (_x(B, T, E), _padding()), _y(),
           per_layer=("t.self_attn", "t.multihead_attn"))


# ------------------------------------------------------------------- sequence-first (refused)


class SequenceFirst(nn.Module):
    """``batch_first=False`` on the transposed batch: ``(T, B, E)``, the batch in dimension 1."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.MultiheadAttention(E, H)
        self.h = nn.Linear(E, 3)
        self.to(DT)

    def forward(self, x: Tensor) -> Tensor:
        s = x.transpose(0, 1)
        return self.h(self.a(s, s, s)[0].mean(0))


def test_sequence_first_attention_runs_on_ghost():
    """``batch_first=False`` on ``(T, B, E)``: the attention's arguments and outputs hold the
    examples in dimension 1, which the per-layer path reads there (as for the recurrent layers'
    states, tests/engine/test_ghost_recurrent.py): on ghost, equal to the loop."""
    model = SequenceFirst()
    x, y = _x(B, T, E), _y()
    for engine in (GhostEngine(), AutoEngine(), GhostEngine(max_physical_batch=2)):
        for groups in (ParamGroups.flat(model), ParamGroups.per_parameter(model)):
            res = engine.compute(model, ce, x, y, clip_weights(0.3), groups)
            assert res.engine_info["engine"] == "ghost" and res.engine_info["per_layer"] == ("a",)
            assert_matches_the_loop(res, naive_per_example_grads(model, ce, x, y), groups, B)


# ---------------------------------------------------------------------- adversarial: refused


class AcrossTheBatch(nn.Module):
    """The batch-first tensor given to a ``batch_first=False`` attention: ``(T=B, N=T, E)``, so
    the attention runs over the examples (each position attends to every example)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.MultiheadAttention(E, H)
        self.h = nn.Linear(E, 3)
        self.to(DT)

    def forward(self, x: Tensor) -> Tensor:
        return self.h(self.a(x, x, x)[0].mean(1))


class RolledPadding(SelfAttention):
    """The key padding mask of the NEXT example (rolled over the batch)."""

    def forward(self, x: Tensor, pad: Tensor | None = None) -> Tensor:
        return super().forward(x, pad.roll(1, 0))


class PositionMask(SelfAttention):
    """A ``(B H, T, T)`` float mask, a constant (built from the batch size as a size) whose rows
    differ from one example's position in the batch to the next."""

    def forward(self, x: Tensor, pad: Tensor | None = None) -> Tensor:
        n = x.shape[0] * H
        m = torch.arange(n, dtype=DT).view(n, 1, 1).expand(n, T, T) * 0.1
        return self.h(self.a(x, x, x, attn_mask=m)[0].mean(1))


def _refused(model: nn.Module, x, y: Tensor) -> str:
    with pytest.raises(UnsupportedModelError) as err:
        GhostEngine().compute(model, ce, x, y, clip_weights(0.3), ParamGroups.flat(model))
    res = AutoEngine().compute(model, ce, x, y, clip_weights(0.3), ParamGroups.flat(model))
    assert res.engine_info["engine"] == "vmap", res.engine_info
    return str(err.value)


def test_attention_across_the_batch_is_refused():
    why = _refused(AcrossTheBatch(), _x(B, T, E), _y())
    assert "mix" in why


def test_key_padding_mask_of_another_example_is_refused():
    why = _refused(RolledPadding(), (_x(B, T, E), _padding()), _y())
    assert "mix" in why


def test_mask_that_depends_on_the_position_in_the_batch_is_refused():
    """Refused by the batch-size proof (a constant shaped by the batch size) and, traced alone,
    by the layout rules: the attention's output mixes; the same mask for every example (one
    ``(H, T, T)`` block repeated) is per example."""
    why = _refused(PositionMask(), _x(B, T, E), _y())
    assert "batch size" in why or "mix" in why
    torch.manual_seed(0)
    a = nn.MultiheadAttention(E, H, batch_first=True).to(DT)
    position = torch.arange(B * H, dtype=DT).view(-1, 1, 1).expand(B * H, T, T) * 0.1
    same = torch.linspace(-1, 1, H * T * T, dtype=DT).view(H, T, T).repeat(B, 1, 1)
    for mask, want in ((position, MIXED), (same, (0, 1))):
        for need in (True, False):
            tr, (o, _) = _traced(lambda s: a(s, s, s, attn_mask=mask, need_weights=need),
                                 _x(B, T, E), (0, 1))
            assert tr.layout(o) == want, (need, tr.layout(o))


# ------------------------------------------------------------- the Folded layout, rule by rule


def _traced(f, x: Tensor, layout=(1, 1)):
    """``f(x)`` traced with ``x`` of layout ``layout`` (``(T, B, E)``: the batch in dim 1)."""
    tr = SeparabilityTracer(B)
    tr.mark(x, layout)
    with tr:
        out = f(x)
    return tr, out


def test_folded_layout_through_a_linear_and_back():
    """``(T, B, E) -> (T B, E) -> @ W -> (T, B, E')``: example i's rows ``t B + i``, back to
    batch dimension 1; read as a mix anywhere in between."""
    w = _x(3, E, seed=9)
    x = _x(T, B, E)
    tr, (flat, y, back) = _traced(lambda s: (s.reshape(T * B, E), s.reshape(T * B, E) @ w.t(),
                                             (s.reshape(T * B, E) @ w.t()).view(T, B, 3)), x)
    assert tr.raw_layout(flat) == Folded(0, 1, T) and tr.layout(flat) is MIXED
    assert tr.raw_layout(y) == Folded(0, 1, T)
    assert tr.layout(back) == (1, 1)


@pytest.mark.parametrize("name, f", [
    ("sum-over-all-rows", lambda s: s.reshape(T * B, E).sum(0)),
    ("viewed-batch-major", lambda s: s.reshape(T * B, E).view(B, T, E)),
    ("contracted", lambda s: _x(2, T * B, seed=8) @ s.reshape(T * B, E)),
    ("transposed-product", lambda s: s.reshape(T * B, E).t() @ s.reshape(T * B, E)),
    ("bmm", lambda s: torch.bmm(s.reshape(T * B, E, 1), s.reshape(T * B, 1, E))),
    ("softmax-over-rows", lambda s: s.reshape(T * B, E).softmax(0)),
    ("rolled-rows", lambda s: s.reshape(T * B, E).roll(1, 0).view(T, B, E)),
    ("rows-per-example", lambda s: (s.reshape(T * B, E)
                                    + torch.arange(T * B, dtype=DT).view(-1, 1)).view(T, B, E)),
    ("other-example", lambda s: s.reshape(T * B, E)[1:].sum(0)),
    ("cat-along-rows", lambda s: torch.cat([s.reshape(T * B, E), s.reshape(T * B, E)])
     .view(2 * T, B, E)),
])
def test_folded_layout_refuses_what_mixes(name, f):
    """Adversarial: operations on a folded ``(T B, E)`` tensor that read several examples, or
    pair a row with its position in the batch, stay MIXED (``viewed-batch-major`` reads the rows
    as if example i owned rows ``[i T, (i + 1) T)``)."""
    tr, out = _traced(f, _x(T, B, E))
    assert tr.layout(out) is MIXED, name


def test_folded_layout_keeps_constants_that_differ_by_position_in_the_sequence():
    """A constant that differs from one slab (a sequence position) to the next, the same for
    every example in it, is per example; one that differs inside a slab is not."""
    pos = _x(T, 1, E, seed=7).expand(T, B, E).reshape(T * B, E)
    tr, out = _traced(lambda s: (s.reshape(T * B, E) + pos).view(T, B, E), _x(T, B, E))
    assert tr.layout(out) == (1, 1)
    per_row = _x(T * B, E, seed=7)
    tr, out = _traced(lambda s: (s.reshape(T * B, E) + per_row).view(T, B, E), _x(T, B, E))
    assert tr.layout(out) is MIXED


@pytest.mark.parametrize("name, f, want", [
    ("addmm-rows-differ", lambda s: torch.addmm(_x(B, 3, seed=4), s, _x(E, 3, seed=5)), MIXED),
    ("addmm-rows-same", lambda s: torch.addmm(_x(1, 3, seed=4).expand(B, 3), s,
                                              _x(E, 3, seed=5)), (0, 1)),
    ("baddbmm-blocks-differ", lambda s: torch.baddbmm(_x(B, 1, 1, seed=4), s.unsqueeze(1),
                                                      s.unsqueeze(2)), MIXED),
    ("baddbmm-blocks-same", lambda s: torch.baddbmm(_x(1, 1, 1, seed=4).expand(B, 1, 1),
                                                    s.unsqueeze(1), s.unsqueeze(2)), (0, 1)),
    ("data-plus-constant-product", lambda s: torch.addmm(s, _x(B, 2, seed=4), _x(2, E, seed=5)),
     MIXED),
])
def test_added_term_of_a_product_is_checked_against_the_position(name, f, want):
    """Adversarial: the term ``addmm`` / ``baddbmm`` adds to a product meets its rows one by
    one; a constant that differs from one example's position to the next (``nn.MultiheadAttention``
    given a ``(B H, T, S)`` mask) makes each example's result depend on its position (accepted
    before: the added constant was never compared across the batch), as does a constant product
    added to example data."""
    tr, out = _traced(f, _x(B, E), (0, 1))
    assert tr.layout(out) == want, name


# ----------------------------------------- in-place writes of constants, views made after them


def test_in_place_write_of_a_constant_is_judged_on_its_old_values():
    """``zeros.masked_fill_(pad, -inf)`` (the attention's key padding mask): per example, judged
    on the zeros it overwrote (before, on the written result, which always differs from one row
    to the next). Adversarial: a constant whose rows differ by position, written in place with
    example data, stays MIXED; so does a view of it made BEFORE the write (stale), while one made
    after it reads the write's layout."""
    x = _x(B, T)
    tr, (c, after) = _traced(lambda s: (lambda c: (c, c.view(B, 1, T)))(
        torch.zeros(B, T, dtype=DT).masked_fill_(s > 0, -1e4)), x, (0, 1))
    assert tr.layout(c) == (0, 1) and tr.layout(after) == (0, 1)

    def stale(s):
        c = torch.zeros(B, T, dtype=DT)
        before = c.view(B, 1, T)
        c.add_(s)
        return before, c.view(B, 1, T)

    tr, (before, after) = _traced(stale, x, (0, 1))
    assert tr.layout(before) is MIXED and tr.layout(after) == (0, 1)
    rows = torch.arange(B, dtype=DT).view(B, 1).expand(B, T)
    tr, out = _traced(lambda s: rows.clone().add_(s), x, (0, 1))
    assert tr.layout(out) is MIXED


class WeightsAcrossTheBatch(SelfAttention):
    """The attention weights reach the loss through a mean over the batch."""

    def forward(self, x: Tensor, pad: Tensor | None = None) -> Tensor:
        o, w = self.a(x, x, x)
        return self.h(o.mean(1)) + self.g(w.mean(-1).mean(0, keepdim=True))


class ProjectionElsewhere(SelfAttention):
    """``out_proj`` also called as a module outside the attention's call."""

    def forward(self, x: Tensor, pad: Tensor | None = None) -> Tensor:
        return self.h(self.a(x, x, x)[0].mean(1) + self.a.out_proj(x.mean(1)))


def test_weights_and_out_proj_used_elsewhere_are_refused():
    """Adversarial: attention weights that are used (so not dead code) are proved like any output
    (a mean over the batch mixes); ``out_proj``'s parameters, owned by the attention's calls,
    used outside them are refused by the per-layer windows."""
    assert "mix" in _refused(WeightsAcrossTheBatch(), _x(B, T, E), _y())
    assert "used" in _refused(ProjectionElsewhere(), _x(B, T, E), _y())
