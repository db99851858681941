"""The ghost engine (and ``auto``): float64 parity with the naive per-example loop and with vmap for
every supported layer and norm mode, every norm-based strategy's weights, NaN examples, chunking,
unsupported models (error and vmap fallback), and no hooks or attributes left behind."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings, example
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

from dpclip.clipping.capabilities import capabilities_of
from dpclip.clipping import STRATEGIES
from dpclip.engine import (
    ENGINES,
    AutoEngine,
    GhostEngine,
    ParamGroups,
    UnsupportedModelError,
    VmapEngine,
    get_engine,
    ghost_support,
    naive_per_example_grads,
)
from dpclip.engine.ghost import NORM_MODES, SUPPORTED_LAYERS
import dpclip.engine.ghost_forward as ghost_forward
from dpclip.models import build_model
from tests.clipping.contract import contract_strategy
from tests.engine.helpers import (
    CASES,
    DT,
    GROUPINGS,
    N_CLASSES,
    assert_close,
    assert_grads_close,
    auto_s_weights,
    ce,
    clip_weights,
    oracle_norms,
    oracle_sum,
)

MODES = list(NORM_MODES)
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same':UserWarning")


# ---------------------------------------------------------------------------- fixture models


class ConvVariety(nn.Module):
    """Conv2d with stride / padding / dilation / groups / padding modes, Conv1d, GroupNorm,
    eval-mode BatchNorm, and a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, 3, stride=2, padding=1, padding_mode="reflect")
        self.gn = nn.GroupNorm(2, 4)
        self.c2 = nn.Conv2d(4, 6, 2, groups=2, padding="same", bias=False)
        self.c3 = nn.Conv2d(6, 4, 3, dilation=2, padding=2, padding_mode="circular")
        self.bn = nn.BatchNorm2d(4)
        self.c4 = nn.Conv1d(4, 4, 3, stride=2, padding=1, groups=4, padding_mode="replicate")
        self.head = nn.Linear(4 * 13, N_CLASSES)

    def forward(self, x):
        h = torch.tanh(self.gn(self.c1(x)))
        h = torch.tanh(self.c2(h))
        h = self.bn(self.c3(h))  # (B, 4, 5, 5)
        h = torch.tanh(self.c4(h.flatten(2)))  # Conv1d over the 25 positions -> 13
        return self.head(h.flatten(1))


class NormVariety(nn.Module):
    """Linear on a 4-D input, LayerNorm over 2 trailing dims (with and without bias), RMSNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 4)
        self.ln2d = nn.LayerNorm((2, 4))
        self.ln_nobias = nn.LayerNorm(4, bias=False)
        self.rms = nn.RMSNorm(4)
        self.head = nn.Linear(4, N_CLASSES)

    def forward(self, x):  # x: (B, 3, 2, 3)
        h = self.ln2d(self.proj(x))  # (B, 3, 2, 4)
        h = torch.tanh(self.rms(self.ln_nobias(h)))
        return self.head(h.mean((1, 2)))


class Shared(nn.Module):
    """One Linear called twice (a parameter used by two calls) and an Embedding with padding_idx."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(9, 4, padding_idx=0)
        self.mix = nn.Linear(4, 4)
        self.head = nn.Linear(4, N_CLASSES)

    def forward(self, x):
        h = self.emb(x)
        h = torch.tanh(self.mix(torch.tanh(self.mix(h))))
        return self.head(h.mean(1))


def tiny_transformer():
    return build_model("transformer", (6,), N_CLASSES, vocab_size=13, d_model=8, heads=2, ff=12)


def _bn_eval(model):
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.3, 0.3)
            m.eval()
    return model


EXTRA = {
    "conv_variety": (lambda: _bn_eval(ConvVariety()),
                     lambda b, g: torch.randn(b, 2, 9, 9, generator=g, dtype=DT)),
    "norm_variety": (NormVariety, lambda b, g: torch.randn(b, 3, 2, 3, generator=g, dtype=DT)),
    "shared": (Shared, lambda b, g: torch.randint(0, 9, (b, 5), generator=g)),
    "transformer": (tiny_transformer, lambda b, g: torch.randint(0, 13, (b, 6), generator=g)),
}


def make(case: str, batch: int, seed: int = 0):
    if case in CASES:
        return CASES[case].make(batch, seed) + (CASES[case].loss_fn,)
    build, inputs = EXTRA[case]
    torch.manual_seed(seed)
    model = build().to(DT)
    gen = torch.Generator().manual_seed(seed + 1)
    return model, inputs(batch, gen), torch.randint(0, N_CLASSES, (batch,), generator=gen), ce


ALL_CASES = sorted(CASES) + sorted(EXTRA)


def _check(engine, model, x, y, loss_fn, groups, wfn, per_ex=None):
    batch = x.shape[0]
    per_ex = naive_per_example_grads(model, loss_fn, x, y) if per_ex is None else per_ex
    expected = oracle_norms(per_ex, groups, batch)
    res = engine.compute(model, loss_fn, x, y, wfn, groups)
    # the norms are proven upper bounds (rounding included): never below the float64 oracle, and
    # above it by at most the rounding terms, which are relative to the sum of the terms'
    # magnitudes, so they can exceed 1e-10 relative where terms cancel; bound them by the scale
    fin = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(res.norms), fin)
    assert bool((res.norms[fin] >= expected[fin] * (1 - 1e-12)).all())
    scale = float(expected[fin].abs().max()) if fin.any() else 1.0
    assert bool((res.norms[fin] <= expected[fin] * (1 + 1e-10) + 1e-9 * max(scale, 1e-3)).all())
    # the weights are the strategy's of the engine's norms; the sum is exactly that weighting
    assert_close(res.weights, wfn(res.norms))
    assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, batch))
    return res


# ------------------------------------------------------------------- parity with the oracle


@pytest.mark.parametrize("batch", [0, 1, 7])
@pytest.mark.parametrize("case", ALL_CASES)
def test_matches_naive_oracle_and_vmap(case, batch):
    """Every case x grouping x norm mode x weight function: ghost == naive loop == vmap."""
    model, x, y, loss_fn = make(case, batch, seed=batch)
    per_ex = naive_per_example_grads(model, loss_fn, x, y)
    for gname, grouping in GROUPINGS.items():
        groups = grouping(model)
        c = 0.05 + torch.rand(len(groups), generator=torch.Generator().manual_seed(batch),
                              dtype=DT)
        c = c[0] if groups.is_flat else c
        for wfn in (clip_weights(c), auto_s_weights(c)):
            ref = VmapEngine(max_physical_batch=4).compute(model, loss_fn, x, y, wfn, groups)
            for mode in MODES:
                res = _check(GhostEngine(norm_mode=mode), model, x, y, loss_fn, groups, wfn,
                             per_ex)
                assert_close(res.norms, ref.norms)
                # the ghost norms are upper bounds (rounding included) above vmap's by a relative
                # delta (<= 1e-10, checked by _check); min(1, C/N) and C/(N + g) then differ by
                # at most delta relative, so the sums differ by at most delta * sum_i ||w_i g_i||
                # <= delta * B * sum(C) on top of the engines' own 1e-10 agreement
                fin = torch.isfinite(ref.norms) & (ref.norms > 0)
                delta = float((res.norms[fin] / ref.norms[fin] - 1).clamp(min=0).max()) \
                    if fin.any() else 0.0
                extra = delta * batch * float(c.sum())
                for n in ref.grads:
                    scale = float(ref.grads[n].abs().max()) if ref.grads[n].numel() else 1.0
                    torch.testing.assert_close(res.grads[n], ref.grads[n], rtol=1e-10,
                                               atol=1e-12 * max(scale, 1e-3) + extra)
                assert res.loss_sum == pytest.approx(ref.loss_sum, rel=1e-10, abs=1e-12)
                assert res.engine_info == {"engine": "ghost", "requested": "ghost",
                                           "fallback": None}, (case, gname, mode)


def _norm_strategies():
    out = []
    for name, entry in sorted(STRATEGIES.items()):
        if entry.kind != "norm" or capabilities_of(entry.cls).per_example_grads:
            continue
        out.append(name)
    return out


@pytest.mark.parametrize("name", _norm_strategies())
def test_every_norm_strategy_weights(name):
    """The registered norm-based strategies' weights (flat or per layer) give the same sums."""
    assert "fixed" in _norm_strategies()
    for case in ("conv_variety", "transformer"):
        strategy = contract_strategy(name)
        model, x, y, loss_fn = make(case, 5, seed=3)
        with torch.no_grad():
            x = x * 3 if x.is_floating_point() else x
        groups = ParamGroups.flat(model) if strategy.norm_kind == "flat" else \
            ParamGroups.per_layer(model)
        if capabilities_of(strategy).per_group:  # as the trainer does: L from the model
            strategy = strategy.bind_groups(groups.names)
        state = strategy.init_state()

        def wfn(n):
            return strategy.weights(n, state)

        ref = VmapEngine().compute(model, loss_fn, x, y, wfn, groups)
        for mode in MODES:
            res = _check(GhostEngine(norm_mode=mode), model, x, y, loss_fn, groups, wfn)
            assert_close(res.norms, ref.norms)
            assert_grads_close(res.grads, ref.grads)


@pytest.mark.parametrize("mode", ["mixed", "direct"])
def test_grouped_convolution_path_for_large_patches(mode, monkeypatch):
    """Per-example conv gradients by a grouped convolution (used when the patch matrix is large)."""
    import dpclip.engine.ghost_rules as rules

    monkeypatch.setattr(rules, "_PATCH_MAX_NUMEL", 0)
    model, x, y, loss_fn = make("conv_variety", 5)
    for groups in (ParamGroups.flat(model), ParamGroups.per_parameter(model)):
        _check(GhostEngine(norm_mode=mode), model, x, y, loss_fn, groups, clip_weights(0.2))


@pytest.mark.parametrize("mode", MODES)
def test_chunking_gives_the_same_result(mode):
    model, x, y, loss_fn = make("conv_variety", 7)
    groups = ParamGroups.per_layer(model)
    wfn = clip_weights(0.3)
    # (the norms' rounding factor is taken for the public chunk size: every size here pads to 32
    # rows, as one chunk of the 7 examples does; the default, 4096 examples, gives a larger one)
    one = GhostEngine(max_physical_batch=7, norm_mode=mode).compute(model, loss_fn, x, y, wfn,
                                                                   groups)
    for size in (1, 2, 6, 7):
        many = GhostEngine(max_physical_batch=size, norm_mode=mode).compute(
            model, loss_fn, x, y, wfn, groups)
        assert_grads_close(many.grads, one.grads, rtol=1e-12)
        assert_close(many.norms, one.norms, rtol=1e-12)
        assert many.loss_sum == pytest.approx(one.loss_sum, rel=1e-12)


def test_float32_model_is_close_to_vmap():
    torch.manual_seed(0)
    model = tiny_transformer()
    x, y = torch.randint(0, 13, (9, 6)), torch.randint(0, N_CLASSES, (9,))
    groups = ParamGroups.flat(model)
    ref = VmapEngine().compute(model, ce, x, y, clip_weights(0.5), groups)
    res = GhostEngine().compute(model, ce, x, y, clip_weights(0.5), groups)
    assert res.norms.dtype == torch.float32
    # (ghost's norms are upper bounds with a rounding factor for its public chunk size, 4096
    # examples: about 2.5e-4 relative in float32; vmap's for its chunk of 256)
    torch.testing.assert_close(res.norms, ref.norms, rtol=5e-4, atol=1e-6)
    for n in ref.grads:
        torch.testing.assert_close(res.grads[n], ref.grads[n], rtol=5e-4, atol=1e-6)


# ------------------------------------------------------------------- hypothesis: shapes


@st.composite
def conv_configs(draw):
    dims = draw(st.sampled_from([1, 2]))
    groups = draw(st.sampled_from([1, 2, 3]))
    in_ch = groups * draw(st.integers(1, 2))
    out_ch = groups * draw(st.integers(1, 2))
    kernel = draw(st.integers(1, 3))
    stride = draw(st.integers(1, 2))
    dilation = draw(st.integers(1, 2))
    mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
    padding = draw(st.sampled_from([0, 1, 2, "same", "valid"]))
    if padding == "same":
        stride = 1
    size = draw(st.integers(dilation * (kernel - 1) + 3, 7))
    batch = draw(st.integers(0, 4))
    bias = draw(st.booleans())
    return dims, groups, in_ch, out_ch, kernel, stride, dilation, mode, padding, size, batch, bias


@settings(max_examples=15, deadline=None)
@given(conv_configs(), st.sampled_from(MODES), st.integers(0, 2**16))
@example(cfg=(2, 1, 1, 1, 1, 1, 1, "zeros", 1, 7, 1, False), mode="ghost", seed=0)  # cancellation
def test_conv_variety_matches_oracle(cfg, mode, seed):
    dims, groups, in_ch, out_ch, kernel, stride, dilation, pmode, padding, size, batch, bias = cfg
    torch.manual_seed(seed)
    cls = nn.Conv1d if dims == 1 else nn.Conv2d
    conv = cls(in_ch, out_ch, kernel, stride=stride, padding=padding, dilation=dilation,
               groups=groups, bias=bias, padding_mode=pmode)
    shape = (in_ch,) + (size,) * dims
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # padding='same' with an even kernel: a padded copy
        n_out = conv(torch.zeros(1, *shape)).numel()
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(n_out, 3)).to(DT)
    x = torch.randn(batch, *shape, dtype=DT)
    y = torch.randint(0, 3, (batch,))
    groups = ParamGroups.per_parameter(model)
    c = 0.1 + torch.rand(len(groups), generator=torch.Generator().manual_seed(seed), dtype=DT)
    _check(GhostEngine(norm_mode=mode), model, x, y, ce, groups, clip_weights(c))


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 5), st.integers(1, 3), st.integers(1, 4), st.integers(1, 4),
       st.integers(0, 5), st.sampled_from(MODES), st.integers(0, 2**16))
def test_linear_sequence_variety_matches_oracle(seq_len, extra, d_in, d_out, batch, mode, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(d_in, d_out), nn.Tanh(), nn.Flatten(),
                          nn.Linear(seq_len * extra * d_out, 3)).to(DT)
    x = torch.randn(batch, seq_len, extra, d_in, dtype=DT)
    y = torch.randint(0, 3, (batch,))
    _check(GhostEngine(norm_mode=mode), model, x, y, ce, ParamGroups.per_layer(model),
           clip_weights(0.2))


@settings(max_examples=10, deadline=None)
@given(st.integers(2, 9), st.integers(1, 8), st.integers(0, 5), st.booleans(),
       st.sampled_from(MODES), st.integers(0, 2**16))
def test_embedding_variety_matches_oracle(vocab, length, batch, pad, mode, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(vocab, 3, padding_idx=0 if pad else None), nn.Flatten(),
                          nn.Linear(length * 3, 3)).to(DT)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (batch, length), generator=gen)
    y = torch.randint(0, 3, (batch,), generator=gen)
    _check(GhostEngine(norm_mode=mode), model, x, y, ce, ParamGroups.flat(model),
           clip_weights(0.3))


# ----------------------------------------------------------------------- non-finite examples


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["conv_variety", "norm_variety", "seq_linear_layernorm"])
def test_nan_example_is_zeroed(case, mode):
    model, x, y, loss_fn = make(case, 6)
    x[2].view(-1)[0] = math.nan
    x[4].view(-1)[1] = math.inf
    groups = ParamGroups.per_layer(model)
    res = GhostEngine(norm_mode=mode).compute(model, loss_fn, x, y, clip_weights(0.5), groups)
    assert torch.isinf(res.norms[[2, 4]]).all() and (res.weights[[2, 4]] == 0).all()
    assert all(torch.isfinite(g).all() for g in res.grads.values())
    keep = torch.tensor([0, 1, 3, 5])
    ref = VmapEngine().compute(model, loss_fn, x[keep], y[keep], clip_weights(0.5), groups)
    assert_grads_close(res.grads, ref.grads)
    assert_close(res.norms[keep], ref.norms)


def test_nan_in_embedding_model_output_grads():
    """A non-finite output gradient (a loss that is NaN for one example) in a token model."""
    model, x, y, _ = make("transformer", 5)

    def loss_fn(out, t):  # the NaN travels with example 2 (a constant with B rows would be a
        losses = ce(out, t[0])  # position-dependent operand, refused since issue 31)
        return losses * t[1]

    groups = ParamGroups.flat(model)
    scale = torch.tensor([1.0, 1.0, math.nan, 1.0, 1.0], dtype=DT)
    res = GhostEngine().compute(model, loss_fn, x, (y, scale), clip_weights(0.5), groups)
    assert math.isinf(res.norms[2]) and res.weights[2] == 0
    keep = torch.tensor([0, 1, 3, 4])
    ref = GhostEngine().compute(model, ce, x[keep], y[keep], clip_weights(0.5), groups)
    assert_grads_close(res.grads, ref.grads)


# ----------------------------------------------------------- unsupported models and fallback


class PReLUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.act = nn.PReLU()
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.act(self.fc(x)))


class OwnParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.fc(x) * self.scale


class Functional(nn.Module):
    """The head's weight is also used functionally, outside the head's forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        return self.head(h) + F.linear(h, self.head.weight)


class Inplace(nn.Module):
    """A layer's OUTPUT changed in place (supported: ``b`` is taken at the layer's node)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.act = nn.ReLU(inplace=True)
        self.mid = nn.Linear(5, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        h = self.mid(self.act(self.fc(x)))
        h.mul_(2.0)  # mid's output, in place (autograd: MulBackward after mid's AddmmBackward)
        return self.head(torch.tanh(h))


class InplaceInput(nn.Module):
    """A layer's INPUT changed in place after the layer used it: refused (the first layer's
    input needs no gradient, so autograd itself never notices)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = x.clone()
        out = self.fc(h)
        h.mul_(2.0)
        return out


class Unbatched(nn.Module):
    """Position embedding looked up without the batch dimension (broadcast over the batch)."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(7, 4)
        self.pos = nn.Embedding(3, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head((self.tok(x) + self.pos(torch.arange(x.shape[1]))).mean(1))


def _data(model, batch=5):
    g = torch.Generator().manual_seed(0)
    if isinstance(model, Unbatched):
        x = torch.randint(0, 7, (batch, 3), generator=g)
    else:
        x = torch.randn(batch, 4, generator=g, dtype=DT)
    return x, torch.randint(0, 3, (batch,), generator=g)


# layers without a rule (PReLUNet, OwnParam) take the per-layer path since issue 31:
# tests/engine/test_ghost_per_layer.py
RUNTIME = [(Functional, "head.weight")]


@pytest.mark.parametrize("build, needle", RUNTIME)
def test_unsupported_error_and_vmap_fallback(build, needle):
    torch.manual_seed(0)
    model = build().to(DT)
    x, y = _data(model)
    groups = ParamGroups.per_layer(model)
    with pytest.raises(UnsupportedModelError) as info:
        GhostEngine().compute(model, ce, x, y, clip_weights(0.4), groups)
    assert needle in str(info.value) and "fallback='vmap'" in str(info.value)
    _assert_no_hooks(model)
    ref = VmapEngine().compute(model, ce, x, y, clip_weights(0.4), groups)
    for engine in (GhostEngine(fallback="vmap"), get_engine("auto")):
        res = engine.compute(model, ce, x, y, clip_weights(0.4), groups)
        assert_grads_close(res.grads, ref.grads)
        assert_close(res.norms, ref.norms)
        assert res.engine_info["engine"] == "vmap"
        assert res.engine_info["requested"] == engine.name
        assert needle in res.engine_info["fallback"]
        _assert_no_hooks(model)
    assert ghost_support(model)[0]  # run-time conditions only


def test_position_embedding_without_the_batch_dimension_runs_on_ghost():
    """``pos(arange(T))`` broadcast over the batch (a batch-less call, engine/batchless.py): it
    used to be refused ("first dimension"); ghost now equals vmap, with no fallback."""
    torch.manual_seed(0)
    model = Unbatched().to(DT)
    x, y = _data(model)
    groups = ParamGroups.per_layer(model)
    ref = VmapEngine().compute(model, ce, x, y, clip_weights(0.4), groups)
    for engine in (GhostEngine(), get_engine("auto")):
        res = engine.compute(model, ce, x, y, clip_weights(0.4), groups)
        assert res.engine_info["engine"] == "ghost" and not res.engine_info.get("fallback")
        assert_grads_close(res.grads, ref.grads)
        assert_close(res.norms, ref.norms)
        _assert_no_hooks(model)


def test_inplace_change_of_a_layer_output_is_supported():
    """``ReLU(inplace=True)`` and ``mul_`` on layer outputs: the ghost engine equals vmap."""
    torch.manual_seed(0)
    model = Inplace().to(DT)
    x, y = _data(model, batch=7)
    for groups in (ParamGroups.flat(model), ParamGroups.per_layer(model)):
        ref = VmapEngine().compute(model, ce, x, y, clip_weights(0.3), groups)
        res = GhostEngine().compute(model, ce, x, y, clip_weights(0.3), groups)
        assert res.engine_info["engine"] == "ghost"
        assert_grads_close(res.grads, ref.grads)
        assert_close(res.norms, ref.norms)
    _assert_no_hooks(model)


def test_inplace_change_of_a_consumed_input_is_refused():
    torch.manual_seed(0)
    model = InplaceInput().to(DT)
    x, y = _data(model)
    # (refused where the write happens since hostile review 189: no write may reach memory
    # autograd saved; before, where the layer's input was read)
    with pytest.raises(UnsupportedModelError, match="modified in place after the layer used it|"
                       "wrote the memory of a tensor autograd saved"):
        GhostEngine().compute(model, ce, x, y, clip_weights(0.4), ParamGroups.flat(model))
    _assert_no_hooks(model)


def test_norm_temporaries_in_example_slices(monkeypatch):
    """With a tiny temporaries budget every conv / sequence-linear norm path (ghost, direct, keep)
    runs slice by slice and still equals vmap."""
    import dpclip.engine.ghost_rules as rules

    monkeypatch.setattr(rules, "_TEMP_MAX_NUMEL", 64)
    assert rules._example_slices(10, 30) == [slice(i, min(i + 2, 10)) for i in range(0, 10, 2)]
    assert rules._example_slices(3, 10**9) == [slice(0, 1), slice(1, 2), slice(2, 3)]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 4, 2, stride=2),
                          nn.Flatten(), nn.Unflatten(1, (4, 4)), nn.Linear(4, 5), nn.Tanh(),
                          nn.Flatten(), nn.Linear(20, 3)).to(DT)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 2, 4, 4, generator=g, dtype=DT)
    y = torch.randint(0, 3, (7,), generator=g)
    groups = ParamGroups.per_layer(model)
    ref = VmapEngine().compute(model, ce, x, y, clip_weights(0.5), groups)
    for choice in ("ghost", "direct", "keep"):  # every layer forced to one per-layer choice
        def choose(self, calls, batch, choice=choice):
            for c in calls:
                c.choice = choice

        monkeypatch.setattr(GhostEngine, "_choose", choose)
        res = GhostEngine().compute(model, ce, x, y, clip_weights(0.5), groups)
        assert_grads_close(res.grads, ref.grads)
        assert_close(res.norms, ref.norms)


def test_embedding_max_norm_is_unsupported():
    model = nn.Sequential(nn.Embedding(5, 3, max_norm=1.0), nn.Flatten(), nn.Linear(6, 3))
    ok, reasons = ghost_support(model)
    assert not ok and "max_norm" in reasons[0]


def test_training_batchnorm_is_refused_like_vmap():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(32, 3))
    x, y = torch.randn(4, 1, 6, 6), torch.randint(0, 3, (4,))
    for engine in (GhostEngine(), GhostEngine(fallback="vmap"), AutoEngine()):
        with pytest.raises(UnsupportedModelError, match="incompatible with BatchNorm"):
            engine.compute(model, ce, x, y, clip_weights(1.0), ParamGroups.flat(model))


def test_auto_picks_ghost_for_supported_models():
    model, x, y, loss_fn = make("transformer", 5)
    res = get_engine("auto").compute(model, loss_fn, x, y, clip_weights(0.3),
                                     ParamGroups.flat(model))
    # (the graph's first step: traced for its checks, released from the graph)
    assert res.engine_info == {"engine": "ghost", "requested": "auto", "fallback": None,
                               "program": "compiled"}
    ref = VmapEngine().compute(model, loss_fn, x, y, clip_weights(0.3), ParamGroups.flat(model))
    assert_grads_close(res.grads, ref.grads)


# ------------------------------------------------------------------------- hygiene and API


def _assert_no_hooks(model):
    for name, m in model.named_modules():
        for attr in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks",
                     "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks",
                     "_forward_hooks_always_called"):
            assert not getattr(m, attr), (name, attr)


def test_no_hooks_or_attributes_left_even_after_errors():
    model, x, y, loss_fn = make("conv_variety", 4)
    before = {n: sorted(vars(m)) for n, m in model.named_modules()}
    params_before = {n: sorted(vars(p)) for n, p in model.named_parameters()}
    GhostEngine().compute(model, loss_fn, x, y, clip_weights(1.0), ParamGroups.flat(model))
    _assert_no_hooks(model)

    def bad_loss(out, t):
        raise RuntimeError("boom inside the hooked forward")

    with pytest.raises(RuntimeError, match="boom"):
        GhostEngine().compute(model, bad_loss, x, y, clip_weights(1.0), ParamGroups.flat(model))
    _assert_no_hooks(model)
    with pytest.raises(ValueError, match="reduction 'none'"):
        GhostEngine().compute(model, lambda o, t: ce(o, t).mean(), x, y, clip_weights(1.0),
                              ParamGroups.flat(model))
    _assert_no_hooks(model)
    assert before == {n: sorted(vars(m)) for n, m in model.named_modules()}
    assert params_before == {n: sorted(vars(p)) for n, p in model.named_parameters()}
    assert all(p.grad is None for p in model.parameters())


def test_registry_and_options():
    assert ENGINES["ghost"] is GhostEngine and ENGINES["auto"] is AutoEngine
    assert GhostEngine.per_example and AutoEngine.per_example
    e = get_engine("ghost", norm_mode="direct", fallback="vmap", max_physical_batch=3)
    assert (e.norm_mode, e.fallback, e.max_physical_batch) == ("direct", "vmap", 3)
    with pytest.raises(ValueError, match="norm_mode"):
        GhostEngine(norm_mode="fast")
    with pytest.raises(ValueError, match="fallback"):
        GhostEngine(fallback="naive")
    with pytest.raises(ValueError, match="max_physical_batch"):
        get_engine("auto", max_physical_batch=0)
    assert nn.Linear in SUPPORTED_LAYERS and nn.Conv2d in SUPPORTED_LAYERS


def test_subclass_overriding_forward_takes_the_per_layer_path():
    from dpclip.engine.ghost import _scan

    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    class Plain(nn.Linear):
        pass

    assert _scan(nn.Sequential(Scaled(3, 2))).per_layer == ("0",)
    assert _scan(nn.Sequential(Plain(3, 2))).per_layer == ()
    assert ghost_support(nn.Sequential(Plain(3, 2)))[0]


# ------------------------------------------------------- the model may change between calls


def _mlp64():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(),
                         nn.Linear(5, N_CLASSES)).to(DT)


class _BatchCentred(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0)


def test_model_changes_between_calls_are_seen():
    """Nothing about the model is remembered between calls: freezing, replacing a layer or a
    parameter, adding an unsupported layer, setting an Embedding's max_norm and switching a
    BatchNorm to training mode all take effect on the next call of the same engine."""
    engine = GhostEngine()
    model = _mlp64()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4, generator=g, dtype=DT), torch.randint(0, N_CLASSES, (6,), generator=g)

    def check():
        groups = ParamGroups.flat(model)
        res = _check(engine, model, x, y, ce, groups, clip_weights(0.3))
        assert set(res.grads) == {n for n, p in model.named_parameters() if p.requires_grad}
        return res

    check()
    model[0].requires_grad_(False)
    assert set(check().grads) == {"2.weight", "2.bias", "4.weight", "4.bias"}
    model[2].bias.requires_grad_(False)
    assert set(check().grads) == {"2.weight", "4.weight", "4.bias"}
    model.requires_grad_(True)
    model[2] = nn.Linear(6, 5, bias=False).to(DT)  # a new layer, without bias
    assert "2.bias" not in check().grads
    model[4].weight = nn.Parameter(torch.randn(N_CLASSES, 5, dtype=DT))  # a new parameter
    res = check()
    ref = VmapEngine().compute(model, ce, x, y, clip_weights(0.3), ParamGroups.flat(model))
    assert_grads_close(res.grads, ref.grads)
    model[1] = _BatchCentred()  # now unsupported
    with pytest.raises(UnsupportedModelError, match="mixes"):
        engine.compute(model, ce, x, y, clip_weights(0.3), ParamGroups.flat(model))
    model[1] = nn.Tanh()
    check()

    emb = nn.Sequential(nn.Embedding(7, 3), nn.Flatten(), nn.Linear(6, N_CLASSES)).to(DT)
    tokens = torch.randint(0, 7, (4, 2), generator=g)
    labels = torch.randint(0, N_CLASSES, (4,), generator=g)
    engine.compute(emb, ce, tokens, labels, clip_weights(1.0), ParamGroups.flat(emb))
    emb[0].max_norm = 1.0
    with pytest.raises(UnsupportedModelError, match="max_norm"):
        engine.compute(emb, ce, tokens, labels, clip_weights(1.0), ParamGroups.flat(emb))

    bn = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Linear(5, N_CLASSES)).to(DT).eval()
    engine.compute(bn, ce, x, y, clip_weights(1.0), ParamGroups.flat(bn))
    bn.train()
    with pytest.raises(UnsupportedModelError, match="BatchNorm"):
        engine.compute(bn, ce, x, y, clip_weights(1.0), ParamGroups.flat(bn))


def test_groups_are_checked_against_the_trainable_parameters():
    """Groups are validated on every call (from the scanned names): a missing, unknown or repeated
    name raises like ``ParamGroups.validate``; a flat group in another order is valid."""
    model = _mlp64()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(5, 4, generator=g, dtype=DT), torch.randint(0, N_CLASSES, (5,), generator=g)
    names = tuple(n for n, _ in model.named_parameters())
    engine = GhostEngine()
    bad = [ParamGroups(("all",), (names[1:],)),  # missing
           ParamGroups(("all",), (names + ("nope",),)),  # unknown
           ParamGroups(("a", "b"), (names, names[:1])),  # repeated
           ParamGroups(("all",), (names[:-1] + names[:1],))]  # one missing, one repeated
    for groups in bad:
        with pytest.raises(ValueError, match="ParamGroups"):
            engine.compute(model, ce, x, y, clip_weights(0.5), groups)
    ref = engine.compute(model, ce, x, y, clip_weights(0.5), ParamGroups(("all",), (names,)))
    res = _check(engine, model, x, y, ce, ParamGroups(("all",), (names[::-1],)), clip_weights(0.5))
    assert_grads_close(res.grads, ref.grads)
    model[0].requires_grad_(False)  # the same groups are now wrong
    with pytest.raises(ValueError, match="ParamGroups"):
        engine.compute(model, ce, x, y, clip_weights(0.5), ParamGroups(("all",), (names,)))


def test_weight_check_is_exact_when_the_sum_overflows():
    """``apply_weight_fn`` checks the weights with one sum; finite weights whose sum overflows
    pass, and one NaN or inf among them is still refused."""
    from dpclip.engine._common import apply_weight_fn

    norms = torch.ones(4, dtype=torch.float32)
    big = torch.full((4,), 3e38, dtype=torch.float32)
    assert torch.isinf(big.sum())
    assert torch.equal(apply_weight_fn(lambda n: big, norms, "ghost"), big)
    for value in (math.nan, math.inf, -math.inf):
        bad = big.clone()
        bad[2] = value
        with pytest.raises(ValueError, match="non-finite weights"):
            apply_weight_fn(lambda n: bad, norms, "ghost")
        with pytest.raises(ValueError, match="non-finite weights"):
            apply_weight_fn(lambda n: torch.where(torch.arange(4) == 1, value, 0.5), norms,
                            "ghost")


# ------------------------------------------- plain nn.Sequential chains: run without hooks


def _chain_model():
    torch.manual_seed(0)
    shared = nn.Linear(6, 6)
    frozen = nn.Linear(6, 6).requires_grad_(False)
    return nn.Sequential(
        nn.Flatten(), nn.Linear(4, 6), nn.ReLU(inplace=True),
        nn.Sequential(shared, nn.Tanh(), frozen, nn.Sequential(nn.Tanh(), shared)),
        nn.Tanh(), nn.Linear(6, N_CLASSES)).to(DT)


def _hooked_path(monkeypatch):
    import dpclip.engine.ghost_forward as forward

    monkeypatch.setattr(forward, "_plain_chain", lambda model, by_module: None)


def test_plain_chain_equals_the_hooked_forward_and_vmap(monkeypatch):
    """A nested Sequential with an in-place ReLU on a layer output, a frozen layer and a layer
    called twice runs as a plain chain; the result is bit-for-bit the hooked path's and equals
    vmap."""
    import dpclip.engine.ghost as ghost_mod

    model = _chain_model()
    scan = ghost_mod._scan(model)
    chain = ghost_forward._plain_chain(model, scan.by_module)
    assert chain is not None and len(chain) == 10
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(7, 2, 2, generator=g, dtype=DT), torch.randint(0, N_CLASSES, (7,), generator=g)
    for groups in (ParamGroups.flat(model), ParamGroups.per_layer(model)):
        fast = GhostEngine().compute(model, ce, x, y, clip_weights(0.3), groups)
        ref = VmapEngine().compute(model, ce, x, y, clip_weights(0.3), groups)
        with monkeypatch.context() as m:
            _hooked_path(m)
            hooked = GhostEngine().compute(model, ce, x, y, clip_weights(0.3), groups)
        assert torch.equal(fast.norms, hooked.norms)
        assert all(torch.equal(fast.grads[n], hooked.grads[n]) for n in hooked.grads)
        assert_grads_close(fast.grads, ref.grads)
        assert_close(fast.norms, ref.norms)
    _assert_no_hooks(model)


def test_plain_chain_is_only_used_when_it_sees_what_hooks_would():
    import dpclip.engine.ghost as ghost_mod

    def chain_of(model):
        return ghost_forward._plain_chain(model, ghost_mod._scan(model).by_module)

    class Sub(nn.Sequential):
        pass

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x)

    assert chain_of(nn.Sequential(nn.Linear(4, 4), nn.Tanh())) is not None
    assert chain_of(Sub(nn.Linear(4, 4))) is None
    assert chain_of(nn.Sequential(Block())) is None  # a container of another kind
    for kind in ("register_forward_hook", "register_forward_pre_hook"):
        for target in (0, 1):  # the root, or the layer owning the parameters
            model = nn.Sequential(nn.Linear(4, 4))
            handle = getattr(model if target == 0 else model[0], kind)(lambda *a: None)
            assert chain_of(model) is None
            handle.remove()
            assert chain_of(model) is not None
    act = nn.Tanh()
    model = nn.Sequential(nn.Linear(4, 4), act)
    handle = act.register_forward_hook(lambda *a: None)  # a parameter-free leaf: harmless
    assert chain_of(model) is not None
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert chain_of(model) is None
    finally:
        handle.remove()


def test_forward_pre_hook_changing_a_layer_input_is_seen():
    """A pre-hook that rescales the first layer's input: the layer's ``a`` is the rescaled input
    (hooked path), so the ghost result still equals vmap."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, N_CLASSES)).to(DT)
    handle = model[0].register_forward_pre_hook(lambda mod, args: (3.0 * args[0],))
    try:
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(6, 4, generator=g, dtype=DT), torch.randint(0, N_CLASSES, (6,), generator=g)
        groups = ParamGroups.flat(model)
        ref = VmapEngine().compute(model, ce, x, y, clip_weights(0.5), groups)
        res = GhostEngine().compute(model, ce, x, y, clip_weights(0.5), groups)
        assert_grads_close(res.grads, ref.grads)
        assert_close(res.norms, ref.norms)
    finally:
        handle.remove()
