"""Augmentation multiplicity K on the ghost engine (issue 36): each example owns K consecutive rows of
every layer's input (layout ``(0, K)``), and the ghost rules read its gradient from those rows.

Against the float64 per-example loop (the naive engine on the K-copy input: one example, its K
copies, the mean loss, one backward at a time): ghost in every norm mode, chunked, and auto give
the loop's norms (upper bounds within rounding) and its exactly weighted sum for an MLP, the
Papernot CNN, convolutions with groups / padding modes / GroupNorm / eval BatchNorm, an Embedding +
LayerNorm model and tied weights, at K = 1, 2, 3 and batches of 1 and 5; every registered norm
strategy that runs on ghost equals vmap; removing one example moves the clipped sum by at most C;
auto records no fallback; models that mix the rows of DIFFERENT examples are refused (or run on
vmap under auto, where one example still moves the sum by at most C); modules on the per-layer
path are re-evaluated on each example's K rows."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dpclip.clipping import STRATEGIES
from dpclip.clipping.capabilities import capabilities_of
from dpclip.engine import (
    AutoEngine,
    GhostEngine,
    ParamGroups,
    UnsupportedModelError,
    VmapEngine,
    get_engine,
    naive_per_example_grads,
)
from dpclip.models import build_model
from dpclip.training.multiplicity import KCopyModel, k_copy_loss
from tests.clipping.contract import contract_strategy
from tests.engine.helpers import (
    DT,
    N_CLASSES,
    assert_close,
    assert_grads_close,
    ce,
    clip_weights,
    oracle_norms,
    oracle_sum,
)

CLIP = 0.5


class _NormConv(nn.Module):
    """Convolutions (reflect padding, groups, stride), GroupNorm, eval BatchNorm, a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, 3, padding=1, padding_mode="reflect")
        self.gn = nn.GroupNorm(2, 4)
        self.c2 = nn.Conv2d(4, 4, 3, stride=2, groups=2)
        self.bn = nn.BatchNorm2d(4)
        self.c3 = nn.Conv1d(4, 3, 2)
        self.fc = nn.Linear(3, N_CLASSES)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 1.5)
        self.bn.eval()

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.gn(self.c1(x)))
        h = torch.tanh(self.bn(self.c2(h)))  # (n, 4, 2, 2)
        h = torch.tanh(self.c3(h.flatten(2)))  # (n, 3, 3)
        return self.fc(h.mean(2))


class _Text(nn.Module):
    """Embedding -> LayerNorm -> Linear on the sequence -> mean -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6, padding_idx=0)
        self.norm = nn.LayerNorm(6)
        self.proj = nn.Linear(6, 5)
        self.head = nn.Linear(5, N_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.proj(self.norm(self.emb(x)))).mean(1))


class _Tied(nn.Module):
    """One Linear applied twice (a parameter with two uses)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 5)
        self.head = nn.Linear(5, N_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.fc(torch.tanh(self.fc(x)))))


def _case(name: str, batch: int, k: int, seed: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
    """A float64 model and a K-copy batch ``(B, K, *example)`` with labels ``(B,)``."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    if name == "mlp":
        model = build_model("mlp", (1, 4, 4), N_CLASSES)
        x = torch.randn(batch, k, 1, 4, 4, generator=g, dtype=DT)
    elif name == "papernot-cnn":
        model = build_model("papernot-cnn", (1, 16, 16), N_CLASSES)
        x = torch.randn(batch, k, 1, 16, 16, generator=g, dtype=DT)
    elif name == "norm-conv":
        model = _NormConv()
        x = torch.randn(batch, k, 2, 5, 5, generator=g, dtype=DT)
    elif name == "text":
        model = _Text()
        x = torch.randint(0, 11, (batch, k, 7), generator=g)
    else:
        model = _Tied()
        x = torch.randn(batch, k, 5, generator=g, dtype=DT)
    y = torch.randint(0, N_CLASSES, (batch,), generator=g)
    return model.to(DT), x, y


MODELS = ["mlp", "papernot-cnn", "norm-conv", "text", "tied"]


def _engines() -> list:
    return [GhostEngine(), GhostEngine(norm_mode="ghost"), GhostEngine(norm_mode="direct"),
            GhostEngine(max_physical_batch=2), AutoEngine()]


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("name", MODELS)
def test_ghost_and_auto_equal_the_per_example_loop(name, k):
    for batch in (5, 1):
        model, x, y = _case(name, batch, k)
        view, loss = KCopyModel(model, k), k_copy_loss(ce, k)
        per_ex = naive_per_example_grads(view, loss, x, y)  # float64, one example at a time
        for groups in (ParamGroups.flat(model), ParamGroups.per_layer(model)):
            expected = oracle_norms(per_ex, groups, batch)
            for engine in _engines():
                res = engine.compute(view, loss, x, y, clip_weights(CLIP), groups)
                assert res.engine_info["engine"] == "ghost", (engine, res.engine_info)
                assert res.engine_info["fallback"] is None
                # upper bounds of the norms of what is summed, and close to the exact norms
                assert bool((res.norms >= expected * (1 - 1e-12)).all()), (name, k, engine)
                assert_close(res.norms, expected, rtol=1e-9)
                assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, batch),
                                   rtol=1e-9)


def test_the_k_rows_carry_the_cross_terms_of_the_copies():
    """Not the sum of the copies' norms: the norm of the MEAN of the copies' gradients (two
    opposite copies cancel in the oracle, and in ghost), so a rule that read each row alone, or
    summed the rows' squared norms, would fail here."""
    model, x, y = _case("mlp", 4, 2)
    x[:, 1] = x[:, 0]  # identical copies: the mean gradient equals one copy's
    view, loss = KCopyModel(model, 2), k_copy_loss(ce, 2)
    res = GhostEngine().compute(view, loss, x, y, clip_weights(CLIP), ParamGroups.flat(model))
    one = GhostEngine().compute(model, ce, x[:, 0], y, clip_weights(CLIP), ParamGroups.flat(model))
    assert_close(res.norms, one.norms, rtol=1e-9)  # not sqrt(2) or 2 times it
    assert_grads_close(res.grads, one.grads, rtol=1e-9)


def _ghost_strategies() -> list[str]:
    return sorted(n for n, e in STRATEGIES.items()
                  if e.kind == "norm" and not capabilities_of(e.cls).per_example_grads)


@pytest.mark.parametrize("sname", _ghost_strategies())
def test_every_ghost_strategy_equals_vmap_with_k_copies(sname):
    k = 3
    model, x, y = _case("norm-conv", 6, k, seed=2)
    x = x * 3
    view, loss = KCopyModel(model, k), k_copy_loss(ce, k)
    strategy = contract_strategy(sname)
    groups = ParamGroups.flat(model) if strategy.norm_kind == "flat" else \
        ParamGroups.per_layer(model)
    if capabilities_of(strategy).per_group:  # as the trainer does: L from the model
        strategy = strategy.bind_groups(groups.names)
    state = strategy.init_state()

    def wfn(n: Tensor) -> Tensor:
        return strategy.weights(n, state)

    ref = VmapEngine().compute(view, loss, x, y, wfn, groups)
    for engine in (GhostEngine(), AutoEngine()):
        res = engine.compute(view, loss, x, y, wfn, groups)
        assert res.engine_info["engine"] == "ghost"
        assert_close(res.norms, ref.norms, rtol=1e-9)
        assert_grads_close(res.grads, ref.grads, rtol=1e-9)


def _release(engine, model: nn.Module, x: Tensor, y: Tensor, k: int) -> tuple[Tensor, dict]:
    res = engine.compute(KCopyModel(model, k), k_copy_loss(ce, k), x, y, clip_weights(CLIP),
                         ParamGroups.flat(model))
    return torch.cat([res.grads[n].flatten() for n, _ in model.named_parameters()]), \
        res.engine_info


@pytest.mark.parametrize("engine_name", ["ghost", "auto"])
@pytest.mark.parametrize("name", ["papernot-cnn", "text"])
def test_neighbour_removing_one_example_moves_the_sum_by_at_most_c(engine_name, name):
    k, n = 3, 7
    model, x, y = _case(name, n, k, seed=4)
    if x.is_floating_point():
        x[3] *= 1e3  # a huge example: its copies' gradients far above C
    engine = get_engine(engine_name)
    full, info = _release(engine, model, x, y, k)
    assert info["engine"] == "ghost"
    worst = 0.0
    for i in range(n):
        keep = [j for j in range(n) if j != i]
        worst = max(worst, (full - _release(engine, model, x[keep], y[keep], k)[0]).norm().item())
    assert 0.5 * CLIP < worst <= CLIP * (1 + 1e-9)


class _Mix(nn.Module):
    """The Papernot-like CNN with the K-copy rows mixed by ``how`` before the first layer (the
    model sees the B K rows, as under KCopyModel)."""

    def __init__(self, how: str, k: int) -> None:
        super().__init__()
        self.how, self.k = how, k
        self.conv = nn.Conv2d(1, 2, 3)
        self.fc = nn.Linear(18, N_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        k = self.k
        if self.how == "roll-k":  # every copy moved to the NEXT example
            x = x.roll(k, 0)
        elif self.how == "roll-1":  # the last copy of example i becomes example i+1's first
            x = x.roll(1, 0)
        elif self.how == "copy-major":  # (K B) rows, example i at rows i, B + i, ...: the same
            x = x.reshape(-1, k, *x.shape[1:]).transpose(0, 1).reshape(x.shape)  # sizes
        elif self.how == "within":  # the copies of ONE example permuted: still per-example
            x = x.reshape(-1, k, *x.shape[1:]).roll(1, 1).reshape(x.shape)
        h = torch.tanh(self.conv(x))
        if self.how == "roll-k-hidden":  # between the layers: the conv's output rows moved on
            h = h.roll(k, 0)
        return self.fc(h.flatten(1))


@pytest.mark.parametrize("how", ["roll-k", "roll-1", "copy-major", "roll-k-hidden"])
def test_a_model_mixing_the_rows_of_different_examples_is_refused(how):
    k, n = 3, 6
    torch.manual_seed(0)
    model = _Mix(how, k).to(DT)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, k, 1, 5, 5, generator=g, dtype=DT)
    y = torch.randint(0, N_CLASSES, (n,), generator=g)
    x[2] *= 1e3
    with pytest.raises(UnsupportedModelError, match="mixes the examples|not per-example"):
        _release(GhostEngine(), model, x, y, k)
    # auto runs vmap (recorded): each example evaluated alone, one example moves the sum <= C
    full, info = _release(AutoEngine(), model, x, y, k)
    assert info["engine"] == "vmap" and info["fallback"]
    worst = max((full - _release(AutoEngine(), model, x[[j for j in range(n) if j != i]],
                                 y[[j for j in range(n) if j != i]], k)[0]).norm().item()
                for i in range(n))
    assert worst <= CLIP * (1 + 1e-9)


def test_permuting_the_copies_of_one_example_stays_on_ghost_and_exact():
    k, n = 3, 5
    torch.manual_seed(0)
    model = _Mix("within", k).to(DT)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(n, k, 1, 5, 5, generator=g, dtype=DT)
    y = torch.randint(0, N_CLASSES, (n,), generator=g)
    view, loss = KCopyModel(model, k), k_copy_loss(ce, k)
    groups = ParamGroups.flat(model)
    per_ex = naive_per_example_grads(view, loss, x, y)
    res = GhostEngine().compute(view, loss, x, y, clip_weights(CLIP), groups)
    assert_close(res.norms, oracle_norms(per_ex, groups, n), rtol=1e-9)
    assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, n), rtol=1e-9)


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.w


class _Mixer(nn.Module):
    """No ghost rule (the per-layer path), not an elementwise scale: recomputed by vjp."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1.0, 1.0, 16).reshape(4, 4))
        self.c = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x @ self.w) + self.c * x.mean(-1, keepdim=True)


@pytest.mark.parametrize("k", [2, 3])
def test_per_layer_modules_read_the_k_rows(k):
    """Modules without a ghost rule (an elementwise scale, read from the graph; a module
    recomputed by vjp on each example's k rows) give the loop's norms and sum on ghost and
    auto, batches of 5 and 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), _Scale(), nn.Tanh(), _Mixer(),
                          nn.Linear(4, N_CLASSES)).to(DT)
    g = torch.Generator().manual_seed(7)
    for n in (5, 1):
        x = torch.randn(n, k, 3, generator=g, dtype=DT)
        y = torch.randint(0, N_CLASSES, (n,), generator=g)
        view, loss = KCopyModel(model, k), k_copy_loss(ce, k)
        per_ex = naive_per_example_grads(view, loss, x, y)
        for groups in (ParamGroups.flat(model), ParamGroups.per_layer(model)):
            expected = oracle_norms(per_ex, groups, n)
            for engine in (GhostEngine(), AutoEngine()):
                res = engine.compute(view, loss, x, y, clip_weights(CLIP), groups)
                assert res.engine_info["engine"] == "ghost", res.engine_info
                assert res.engine_info["per_layer"] == ("1", "3")
                assert bool((res.norms >= expected * (1 - 1e-12)).all())
                assert_close(res.norms, expected, rtol=1e-9)
                assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, n),
                                   rtol=1e-9)


class _RowMean(nn.Module):
    """A per-layer module that mixes ALL rows (x.mean(0)): every example into every other."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.w + x.mean(0)


def test_a_per_layer_module_mixing_the_rows_of_different_examples_is_refused():
    k, n = 2, 6
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), _RowMean(), nn.Linear(4, N_CLASSES)).to(DT)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(n, k, 3, generator=g, dtype=DT)
    y = torch.randint(0, N_CLASSES, (n,), generator=g)
    x[1] *= 1e3
    with pytest.raises(UnsupportedModelError, match="mixes the examples"):
        _release(GhostEngine(), model, x, y, k)
    full, info = _release(AutoEngine(), model, x, y, k)
    assert info["engine"] == "vmap" and info["fallback"]
    worst = max((full - _release(AutoEngine(), model, x[[j for j in range(n) if j != i]],
                                 y[[j for j in range(n) if j != i]], k)[0]).norm().item()
                for i in range(n))
    assert worst <= CLIP * (1 + 1e-9)


@pytest.mark.parametrize("mode", ["mixed", "ghost", "direct"])
@pytest.mark.parametrize("case", ["conv_groupnorm_const_image", "conv_groupnorm_huge",
                                  "seq_linear_const", "embedding_one_token"])
def test_float32_contribution_of_each_example_is_within_the_clip_norm(case, mode):
    """tests/engine/test_ghost_rounding.py with K = 3 copies of each example (scaled 1, -1/2, 2:
    the per-position terms cancel inside every row, as there, and the rows differ): the norm that
    sets a weight bounds the float32 vector actually summed, rounding included."""
    from tests.engine.test_ghost_rounding import B, CASES, STRATEGIES, _norm
    from tests.engine.test_ghost_rounding import ce as ce32

    from dpclip.clipping import make_strategy

    k = 3
    build, inputs, classes = CASES[case]
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = build().to(torch.float32)
    x, y = inputs(g), torch.randint(0, classes, (B,), generator=g)
    if x.is_floating_point():
        x = torch.stack([x, -0.5 * x, 2 * x], 1)
    else:
        x = x.unsqueeze(1).expand(B, k, *x.shape[1:]).contiguous()
    view, loss = KCopyModel(model, k), k_copy_loss(ce32, k)
    groups = ParamGroups.flat(model)
    engine = GhostEngine(norm_mode=mode)
    for sname, (name, params) in STRATEGIES.items():
        strat = make_strategy(name, params)
        state = strat.init_state()
        c = strat.sensitivity(state)
        wf = lambda n, s=strat, st=state: s.weights(n, st)  # noqa: E731
        full = engine.compute(view, loss, x, y, wf, groups)
        assert full.engine_info["engine"] == "ghost"
        for i in range(B):
            alone = engine.compute(view, loss, x[i:i + 1], y[i:i + 1], wf, groups)
            assert _norm(alone.grads) <= c, (sname, i, _norm(alone.grads))
            keep = [j for j in range(B) if j != i]
            rest = engine.compute(view, loss, x[keep], y[keep], wf, groups)
            moved = _norm({n: full.grads[n].double() - rest.grads[n].double()
                           for n in full.grads})
            n_red = B * k * 64 * 9  # the longest reduction: examples x rows x positions
            assert moved <= c + 2 * n_red * 2.0 ** -24 * B * c, (sname, i, moved)


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("name", ["tied", "tied-embedding"])
def test_tied_weights_by_cross_terms_read_the_k_rows(name, k, monkeypatch):
    """A parameter with several uses, above the size where its per-example gradient is formed:
    the exact norm of the sum from the uses' cross terms (dpclip.engine.tied) on the folded rows."""
    import dpclip.engine.ghost as ghost_mod
    from tests.engine.helpers import TiedNet

    monkeypatch.setattr(ghost_mod, "_TIED_FORM_MAX_NUMEL", 0)
    batch = 5
    if name == "tied":
        model, x, y = _case("tied", batch, k)
    else:
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(3)
        model = TiedNet().to(DT)
        x = torch.randint(0, 7, (batch, k, 4), generator=g)
        y = torch.randint(0, N_CLASSES, (batch,), generator=g)
    view, loss = KCopyModel(model, k), k_copy_loss(ce, k)
    per_ex = naive_per_example_grads(view, loss, x, y)
    groups = ParamGroups.flat(model)
    expected = oracle_norms(per_ex, groups, batch)
    for mode in ("mixed", "ghost", "direct"):
        res = GhostEngine(norm_mode=mode).compute(view, loss, x, y, clip_weights(CLIP), groups)
        assert bool((res.norms >= expected * (1 - 1e-12)).all())
        assert_close(res.norms, expected, rtol=1e-9)
        assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, batch), rtol=1e-9)


@pytest.mark.parametrize("patch_max", [0, None])
def test_convolutions_in_slices_and_by_grouped_convolution_read_the_k_rows(patch_max,
                                                                          monkeypatch):
    """One example per temporary slice (_TEMP_MAX_NUMEL) and, with _PATCH_MAX_NUMEL 0, every
    per-example conv gradient by the grouped convolution with the rows folded into the groups."""
    import dpclip.engine.ghost_rules as rules

    monkeypatch.setattr(rules, "_TEMP_MAX_NUMEL", 1)
    if patch_max is not None:
        monkeypatch.setattr(rules, "_PATCH_MAX_NUMEL", patch_max)
    k, batch = 3, 4
    for name in ("papernot-cnn", "norm-conv"):
        model, x, y = _case(name, batch, k)
        view, loss = KCopyModel(model, k), k_copy_loss(ce, k)
        per_ex = naive_per_example_grads(view, loss, x, y)
        groups = ParamGroups.per_layer(model)
        expected = oracle_norms(per_ex, groups, batch)
        for mode in ("mixed", "ghost", "direct"):
            res = GhostEngine(norm_mode=mode).compute(view, loss, x, y, clip_weights(CLIP),
                                                      groups)
            assert bool((res.norms >= expected * (1 - 1e-12)).all())
            assert_close(res.norms, expected, rtol=1e-9)
            assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, batch),
                               rtol=1e-9)


class _PosText(nn.Module):
    """A position Embedding called without the batch ((1, T) positions) beside K-copy rows."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.pos = nn.Embedding(7, 6)
        self.head = nn.Linear(6, N_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        p = self.pos(torch.arange(x.shape[1]).unsqueeze(0))
        return self.head(torch.tanh(self.emb(x) + p).mean(1))


def test_a_batchless_call_beside_k_rows_sends_auto_to_vmap():
    """docs/engines.md: the batch-less call is expanded to B rows, which do not broadcast against
    the B K rows: ghost refuses, auto runs vmap (recorded), equal to the per-example loop."""
    k, n = 2, 5
    torch.manual_seed(0)
    model = _PosText().to(DT)
    g = torch.Generator().manual_seed(8)
    x = torch.randint(0, 11, (n, k, 7), generator=g)
    y = torch.randint(0, N_CLASSES, (n,), generator=g)
    view, loss = KCopyModel(model, k), k_copy_loss(ce, k)
    with pytest.raises(UnsupportedModelError, match="called without the batch dimension"):
        GhostEngine().compute(view, loss, x, y, clip_weights(CLIP), ParamGroups.flat(model))
    res = AutoEngine().compute(view, loss, x, y, clip_weights(CLIP), ParamGroups.flat(model))
    assert res.engine_info["engine"] == "vmap" and res.engine_info["fallback"]
    per_ex = naive_per_example_grads(view, loss, x, y)
    groups = ParamGroups.flat(model)
    assert_close(res.norms, oracle_norms(per_ex, groups, n), rtol=1e-9)
    assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, n), rtol=1e-9)
