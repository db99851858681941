"""The ghost engine's per-layer path, tied parameters and frozen parameters (issue 31, items 4-6).

Oracle: the float64 per-example loop of :func:`tests.engine.helpers.naive_per_example_grads`.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import dpclip.engine.ghost as ghost_mod
from dpclip.engine import (
    AutoEngine,
    GhostEngine,
    ParamGroups,
    UnsupportedModelError,
    naive_per_example_grads,
)
from dpclip.engine.ghost import _scan
from tests.engine.helpers import (
    DT,
    TiedNet,
    assert_grads_close,
    ce,
    clip_weights,
    oracle_norms,
    oracle_sum,
)


def check_against_oracle(engine, model, x, y, loss_fn, groups, wfn, bound=False):
    """Norms: upper bounds of the float64 per-example loop's (equal within rounding unless
    ``bound``); the sum: exactly the weighted sum of the oracle's per-example gradients."""
    per_ex = naive_per_example_grads(model, loss_fn, x, y)
    expected = oracle_norms(per_ex, groups, x.shape[0])
    res = engine.compute(model, loss_fn, x, y, wfn, groups)
    assert bool((res.norms >= expected * (1 - 1e-12)).all())
    if not bound:
        torch.testing.assert_close(res.norms, expected, rtol=1e-10, atol=1e-12)
    assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, x.shape[0]))
    return res, expected


class LearnedLeak(nn.Module):
    """A PReLU written out (the separability tracer has no rule for ``aten._prelu_kernel``)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.1, 0.3, d))

    def forward(self, x):
        return F.relu(x) - self.weight * F.relu(-x)


class PReLUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.act = LearnedLeak(5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.act(self.fc(x)))


class OwnParam(nn.Module):
    """The root module owns a learned scale read directly in its forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x):
        return self.fc(x) * self.scale


class Gate(nn.Module):
    """A custom layer owning a matrix and a vector, returning a tuple (the second output also
    carries gradient)."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d)
        self.b = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        g = torch.sigmoid(x @ self.w + self.b)
        return x * g, g.sum(-1)


class Tokens(nn.Module):
    """ViT-like: a cls token and a (1, T, d) position embedding read directly, then a custom
    layer with a tuple output (both: no ghost rule, per-layer path)."""

    def __init__(self, d=4):
        super().__init__()
        self.proj = nn.Linear(3, d)
        self.cls = nn.Parameter(torch.randn(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, 3, d))
        self.attn = Gate(d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):  # x: (B, 2, 3)
        h = self.proj(x)
        h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], 1) + self.pos
        h, aux = self.attn(h)
        return self.head(h[:, 0]) + aux[:, 1:2]


class Scaled(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


def _data(shape, batch=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, *shape, generator=g, dtype=DT), torch.randint(0, 3, (batch,),
                                                                           generator=g)


CASES = [
    (PReLUNet, (4,), ("act",)),
    (OwnParam, (4,), ("<root>",)),
    (Tokens, (2, 3), ("<root>", "attn")),
    (lambda: nn.Sequential(Scaled(4, 5), nn.Tanh(), nn.Linear(5, 3)), (4,), ("0",)),
]


@pytest.mark.parametrize("build, shape, names", CASES)
def test_layers_without_rule_take_the_per_layer_path(build, shape, names):
    """A module with no rule gets per-example gradients of its own parameters inside the ghost
    pass: equal to the float64 loop, the run stays on ghost and names the per-layer modules."""
    torch.manual_seed(0)
    model = build().to(DT)
    x, y = _data(shape)
    for groups in (ParamGroups.flat(model), ParamGroups.per_parameter(model)):
        for engine in (GhostEngine(), AutoEngine(), GhostEngine(norm_mode="ghost")):
            res, _ = check_against_oracle(engine, model, x, y, ce, groups, clip_weights(0.3))
            if "<root>" in names and isinstance(engine, AutoEngine):
                # the root on the per-layer path replays the whole forward per example: auto
                # runs vmap for its cost (GhostEngine._root_cost)
                assert res.engine_info["engine"] == "vmap"
                assert res.engine_info["fallback"].startswith("cost: the root module")
                continue
            assert res.engine_info["engine"] == "ghost"
            assert res.engine_info["fallback"] is None
            assert res.engine_info["per_layer"] == names
    for mod in model.modules():  # nothing left behind
        assert not mod._forward_hooks and not mod._forward_pre_hooks


def test_per_layer_module_called_on_its_own_output():
    torch.manual_seed(0)
    model = Twice().to(DT)
    x, y = _data((3,))
    for groups in (ParamGroups.flat(model), ParamGroups.per_parameter(model)):
        res, _ = check_against_oracle(GhostEngine(), model, x, y, ce, groups, clip_weights(0.3))
        assert res.engine_info["per_layer"] == ("act",)


def test_per_layer_with_chunks_and_non_finite_example():
    torch.manual_seed(0)
    model = Tokens().to(DT)
    x, y = _data((2, 3), batch=6)
    x[2, 0, 0] = float("nan")
    groups = ParamGroups.flat(model)
    res = GhostEngine(max_physical_batch=4).compute(model, ce, x, y, clip_weights(0.3), groups)
    assert torch.isinf(res.norms[2]) and res.weights[2] == 0
    keep = [0, 1, 3, 4, 5]
    ref = GhostEngine().compute(model, ce, x[keep], y[keep], clip_weights(0.3), groups)
    torch.testing.assert_close(res.norms[keep], ref.norms, rtol=1e-12, atol=0)
    assert_grads_close(res.grads, ref.grads)


class UsedOutside(nn.Module):
    """The per-layer module's parameter is also read outside its forward."""

    def __init__(self):
        super().__init__()
        self.act = LearnedLeak(3)
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        return self.head(self.act(x)) + x * self.act.weight


class Twice(nn.Module):
    """The per-layer module applied to its own output: one local product per call, summed."""

    def __init__(self):
        super().__init__()
        self.act = LearnedLeak(3)
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        return self.head(self.act(self.act(x)))


class Cache(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.kept = None

    def forward(self, x):
        self.kept = self.scale * 2  # derived from the parameter, used after the call
        return x * self.scale


class KeepsDerived(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = Cache()
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        h = self.c(x)
        return self.head(h + self.c.kept)


@pytest.mark.parametrize("build, needle", [
    (UsedOutside, "used outside the calls"),
    (KeepsDerived, "used outside the calls"),
])
def test_per_layer_refuses_what_one_call_cannot_show(build, needle):
    """Attacks on the per-layer path: a parameter also used outside its module, a module applied
    to its own output (the product would count the first call twice), a derived tensor kept for
    later. Refused by ghost, run on vmap by auto (equal to the loop; the kept tensor is refused
    there: each chunk runs isolated, dpclip.engine.isolation)."""
    torch.manual_seed(0)
    model = build().to(DT)
    x, y = _data((3,))
    groups = ParamGroups.flat(model)
    with pytest.raises(UnsupportedModelError, match=needle):
        GhostEngine().compute(model, ce, x, y, clip_weights(0.3), groups)
    if build is KeepsDerived:  # auto's vmap runs each chunk isolated: the kept tensor is a
        # Python attribute set in the call (docs/errors.md entry 109), refused and put back
        with pytest.raises(UnsupportedModelError, match="Python attribute 'c.kept'"):
            AutoEngine().compute(model, ce, x, y, clip_weights(0.3), groups)
        assert model.c.kept is None
        return
    res, _ = check_against_oracle(AutoEngine(), model, x, y, ce, groups, clip_weights(0.3))
    assert res.engine_info["engine"] == "vmap" and needle in res.engine_info["fallback"]


def test_per_layer_module_output_that_mixes_is_refused():
    class Mix(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return (x - x.mean(0)) * self.scale

    model = nn.Sequential(nn.Linear(3, 3), Mix(), nn.Linear(3, 3)).to(DT)
    x, y = _data((3,))
    with pytest.raises(UnsupportedModelError, match="per-example separable|mixes"):
        GhostEngine().compute(model, ce, x, y, clip_weights(0.3), ParamGroups.flat(model))


# --------------------------------------------------------------------------- tied parameters


@pytest.mark.parametrize("mode", ["mixed", "ghost", "direct"])
def test_tied_parameters_exact_formed_and_by_cross_terms(mode, monkeypatch):
    """A weight used by an Embedding and a Linear: exact when it fits (per-example gradients of the
    uses summed) and above the forming budget too (the uses' cross terms by ghost inner products,
    dpclip.engine.tied; the triangle bound before), and the clipped sum is exactly the weighted
    sum of the true per-example gradients."""
    torch.manual_seed(0)
    model = TiedNet().to(DT)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 7, (6, 5), generator=g)
    y = torch.randint(0, 7, (6,), generator=g)
    for groups in (ParamGroups.flat(model), ParamGroups.per_parameter(model)):
        check_against_oracle(GhostEngine(norm_mode=mode), model, x, y, ce, groups,
                             clip_weights(0.05))
        monkeypatch.setattr(ghost_mod, "_TIED_FORM_MAX_NUMEL", 0)
        check_against_oracle(GhostEngine(norm_mode=mode), model, x, y, ce, groups,
                             clip_weights(0.05))
        monkeypatch.setattr(ghost_mod, "_TIED_FORM_MAX_NUMEL", 1 << 16)


# -------------------------------------------------------------------------- frozen parameters


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(4, 5)
        self.norm = nn.LayerNorm(5)
        self.act = LearnedLeak(5)  # no rule: would take the per-layer path if trainable
        self.adapter = nn.Linear(5, 5, bias=False)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        h = self.act(self.norm(self.base(x)))
        return self.head(h + self.adapter(h))


def test_frozen_parameters_are_not_hooked_and_get_nothing(monkeypatch):
    """requires_grad=False: the frozen layers are not hooked, no per-example work is formed for
    them and they are absent from the result (no gradient, so no noise downstream)."""
    torch.manual_seed(0)
    model = Frozen().to(DT)
    for m in (model.base, model.norm, model.act):
        m.requires_grad_(False)
    seen = []
    real = ghost_mod._Call.__init__

    def spy(self, owner, a, out, tracer=None):
        seen.append(owner.name)
        real(self, owner, a, out, tracer)

    monkeypatch.setattr(ghost_mod._Call, "__init__", spy)
    x, y = _data((4,))
    groups = ParamGroups.flat(model)
    res, _ = check_against_oracle(GhostEngine(), model, x, y, ce, groups, clip_weights(0.3))
    assert sorted(set(seen)) == ["adapter", "head"]
    assert sorted(res.grads) == ["adapter.weight", "head.bias", "head.weight"]
    assert "per_layer" not in res.engine_info
    assert _scan(model).per_layer == ()


# ------------------------------------------------------------ docs/errors.md, entries 50-52


def _refusal(model, batch=5):
    x, y = _data((3,), batch=batch)
    with pytest.raises(UnsupportedModelError) as info:
        GhostEngine().compute(model, ce, x, y, clip_weights(0.3), ParamGroups.flat(model))
    return str(info.value)


def test_error_91_parameter_used_outside():
    torch.manual_seed(0)
    msg = _refusal(UsedOutside().to(DT))
    assert msg.startswith(
        "ghost engine: parameter(s) act.weight of per-layer module(s) are used outside the calls "
        "of the modules that own them (e.g. read by another module, or a tensor derived from them "
        "kept for later): their per-example gradient cannot be read from the module's calls; use "
        "the parameter only inside its module's forward, or engine 'vmap'. The ghost engine has "
        "rules for Linear, ")


class _Np(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.w + torch.from_numpy(x.detach().numpy() * 0)


def test_error_92_not_vmappable():
    model = nn.Sequential(_Np(), nn.Linear(3, 3)).to(DT)
    msg = _refusal(model)
    assert ("ghost engine: module '0' (_Np, per-layer path): its proved operations cannot be "
            "evaluated one example at a time by torch.func.vmap (" in msg and
            "; use engine 'vmap'" in msg) or \
        "not per-example separable" in msg  # the separability proof cannot trace .numpy()


class _Pos(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(3))  # (3,): no leading 1 to expand (a (1, 3) table
        # is a batch-less call, tests/engine/test_ghost_batchless.py)

    def forward(self, x):
        return self.pos


class _UsesPos(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = _Pos()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(x + self.p(x))


def test_error_93_output_not_batch_first():
    torch.manual_seed(0)
    model = _UsesPos().to(DT)
    msg = _refusal(model)
    assert msg.startswith(
        "ghost engine: module 'p' (_Pos, per-layer path) returned a tensor of rank 1 whose "
        "first dimension is not the batch; per-example gradients need batch-first outputs. "
        "The ghost engine has rules for Linear, ")
    x, y = _data((3,))
    res, _ = check_against_oracle(AutoEngine(), model, x, y, ce, ParamGroups.flat(model),
                                  clip_weights(0.3))
    assert res.engine_info["engine"] == "vmap"


# ------------------------------------------------ RMSNorm-like scales, recognised from the graph


class LlamaLike(nn.Module):
    """``weight * normalised`` (LlamaRMSNorm, Qwen/Mistral norms), written without the class."""

    def __init__(self, d, gemma=False):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-0.5, 1.5, d))
        self.gemma = gemma

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        if self.gemma:  # Gemma: (1 + weight) (in float32 there, a cast chain: also recognised)
            out = h * (1.0 + self.weight)
        else:
            out = self.weight * h
        return out


class NotElementwise(nn.Module):
    """Same parameter shape, but the scale mixes the features (cumsum) or the parameter also
    enters the other operand: not an elementwise scale, the general per-layer path."""

    def __init__(self, d, kind):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.kind = kind

    def forward(self, x):
        if self.kind == "cumsum":
            return x * self.weight.cumsum(0)
        return self.weight * (x * self.weight)


class NormNet(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.norm = norm
        self.head = nn.Linear(4, 3)

    def forward(self, x):  # x: (B, T, 3)
        return self.head(self.norm(self.fc(x)).mean(1))


def _norms():
    out = [LlamaLike(4), LlamaLike(4, gemma=True),
           NotElementwise(4, "cumsum"), NotElementwise(4, "twice")]
    try:
        from transformers.models.t5.modeling_t5 import T5LayerNorm
        out.append(T5LayerNorm(4))
    except ImportError:  # pragma: no cover - optional extra
        pass
    return out


@pytest.mark.parametrize("norm", _norms(), ids=lambda m: type(m).__name__ + (
    "-" + getattr(m, "kind", "") if hasattr(m, "kind") else "") + (
    "-gemma" if getattr(m, "gemma", False) else ""))
def test_rmsnorm_like_scales_recognised_by_what_they_compute(norm, monkeypatch):
    """Elementwise scales are read from the call's graph (no recomputation); what does not fit
    (a scale that mixes features, the parameter on both operands) takes the general path; both
    equal the float64 loop."""
    import dpclip.engine.per_layer as pl

    calls = {"scale": 0, "module": 0}
    real_scale, real_module = pl.scale_grads, pl.module_grads

    def spy_scale(c, batch):
        calls["scale"] += 1
        return real_scale(c, batch)

    def spy_module(c, batch):
        calls["module"] += 1
        return real_module(c, batch)

    monkeypatch.setattr(ghost_mod, "scale_grads", spy_scale)
    monkeypatch.setattr(ghost_mod, "module_grads", spy_module)
    torch.manual_seed(0)
    model = NormNet(norm).to(DT)
    x, y = _data((5, 3), batch=4)
    res, _ = check_against_oracle(GhostEngine(), model, x, y, ce, ParamGroups.per_layer(model),
                                  clip_weights(0.2))
    assert res.engine_info["per_layer"] == ("norm",)
    fits = not isinstance(norm, NotElementwise)
    assert calls == ({"scale": 1, "module": 0} if fits else {"scale": 0, "module": 1})


class OutputChangedInPlace(nn.Module):
    """A per-layer module's output changed in place afterwards: ``b`` is still the gradient with
    respect to the module's own output (taken at its autograd edge, as for ruled layers)."""

    def __init__(self, norm):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.norm = norm
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.norm(self.fc(x))
        h.mul_(3.0)
        return self.head(h.mean(1))


@pytest.mark.parametrize("norm", [LlamaLike(4), NotElementwise(4, "cumsum")],
                         ids=["scale", "general"])
def test_per_layer_output_changed_in_place(norm):
    torch.manual_seed(0)
    model = OutputChangedInPlace(norm).to(DT)
    x, y = _data((5, 3), batch=4)
    check_against_oracle(GhostEngine(), model, x, y, ce, ParamGroups.flat(model),
                         clip_weights(0.2))


# ------------------------------- state read after the forward (the per-layer recomputation)


class Rescale(nn.Module):
    """Uses a buffer, then overwrites it with the batch mean (in place or by a new attribute):
    a recomputation after the forward would read the batch mean into every example's vector."""

    def __init__(self, how):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))
        self.register_buffer("running", torch.ones(3))
        self.attr = torch.ones(3)
        self.how = how

    def forward(self, x):
        out = x * self.weight.cumsum(0) * (self.running if self.how == "buffer" else self.attr)
        if self.how == "buffer":
            self.running.copy_(x.detach().mean(0))
        else:
            self.attr = x.detach().mean(0)
        return out


@pytest.mark.parametrize("how", ["buffer", "attribute"])
def test_per_layer_state_changed_by_the_forward_is_refused(how):
    model = nn.Sequential(Rescale(how), nn.Linear(3, 3)).to(DT)  # first: autograd never sees it
    x, y = _data((3,))
    with pytest.raises(UnsupportedModelError) as info:
        GhostEngine().compute(model, ce, x, y, clip_weights(0.3), ParamGroups.flat(model))
    # the separability proof may refuse the write of batch data into the buffer first (issue 31
    # items 1-2); otherwise the per-layer path's own state check refuses it
    if "writes batch data into a tensor" in str(info.value):
        return
    # (or the write to memory autograd saved, refused where it happens since hostile review 189)
    if "wrote the memory of a tensor autograd saved" in str(info.value):
        return
    assert str(info.value).startswith(
        "ghost engine: module '0' (Rescale, per-layer path) changed its own state during the "
        "forward (a parameter, buffer or tensor attribute updated or replaced): its per-example "
        "gradient is recomputed from that state after the forward, which could then carry other "
        "examples' data; keep the forward free of state updates, or use engine 'vmap'. The ghost "
        "engine has rules for Linear, ")


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x):
        return self.weight * x


class SavedOperandMixed(nn.Module):
    """The scale's input requires grad (from the input, no trainable layer before it, so the
    backward never runs the scale's own node and autograd's version check never fires) and is
    centred over the batch in place after the call."""

    def __init__(self):
        super().__init__()
        self.scale = _Scale()
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        h = x * 1.0
        s = self.scale(h)
        h.sub_(h.mean(0))
        return self.head(s)


def test_per_layer_saved_operand_changed_in_place_is_refused():
    """The elementwise-scale rule reads the saved operand after the forward: refused when it
    changed (else example i's vector would hold the batch mean)."""
    torch.manual_seed(0)
    model = SavedOperandMixed().to(DT)
    x, y = _data((3,))
    x.requires_grad_(True)
    with pytest.raises(UnsupportedModelError) as info:
        GhostEngine().compute(model, ce, x, y, clip_weights(0.3), ParamGroups.flat(model))
    # (refused where the write happens since hostile review 189: it wrote memory autograd saved)
    if "wrote the memory of a tensor autograd saved" in str(info.value):
        return
    assert str(info.value).startswith(
        "ghost engine: the saved operand of module 'scale' (_Scale, per-layer path) was modified "
        "in place after the call; use out-of-place operations. The ghost engine has rules for "
        "Linear, ")


def test_tied_mode_does_not_depend_on_the_batch_size(monkeypatch):
    """Exact or triangle bound is decided by the parameter alone: an example's norm is the same in
    a batch of 2 and in a batch of 6 (the realised batch size is private; a switch by B * numel
    would change every example's weight when one example is added or removed)."""
    torch.manual_seed(0)
    model = TiedNet().to(DT)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 7, (6, 5), generator=g)
    y = torch.randint(0, 7, (6,), generator=g)
    numel = model.emb.weight.numel()
    monkeypatch.setattr(ghost_mod, "_TIED_FORM_MAX_NUMEL", 3 * numel)
    groups = ParamGroups.flat(model)
    small = GhostEngine().compute(model, ce, x[:2], y[:2], clip_weights(0.05), groups)
    big = GhostEngine().compute(model, ce, x, y, clip_weights(0.05), groups)
    torch.testing.assert_close(big.norms[:2], small.norms, rtol=1e-12, atol=0)


class PassThrough(nn.Module):
    """Returns its input as is plus a scaled copy; the input was computed OUTSIDE the module from
    the module's own parameter: that use is outside the module's call (refused, not counted)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, h):
        return h, h * self.scale


class UsesPassThrough(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = PassThrough()
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        h = x * self.p.scale  # outside the module's call
        a, b = self.p(h)
        return self.head(a + b)


def test_per_layer_output_created_outside_is_no_use():
    torch.manual_seed(0)
    model = UsesPassThrough().to(DT)
    x, y = _data((3,))
    with pytest.raises(UnsupportedModelError, match="used outside the calls"):
        GhostEngine().compute(model, ce, x, y, clip_weights(0.3), ParamGroups.flat(model))
    res, _ = check_against_oracle(AutoEngine(), model, x, y, ce, ParamGroups.flat(model),
                                  clip_weights(0.3))
    assert res.engine_info["engine"] == "vmap"
