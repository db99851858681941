"""The compiled engine (``engine="compiled"``, :mod:`dpclip.engine.compiled`): the batch-size proof's
graph, proved per-example separable once, run instead of the model's code.

Oracles: the float64 per-example loop (:func:`naive_per_example_grads`) for what it accepts; the
leave-one-out distance of the clipped sum (at most C) for every attack of the traced engine's
suites, which it must refuse or run soundly; and each guard of a step (user code around the
graph, a replaced ATen operation, a reconfigured layer) refused.
"""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
from torch import Tensor, nn

from dpclip.engine import CompiledEngine, GhostEngine, ParamGroups, get_engine
from dpclip.engine import compiled as compiled_mod
from dpclip.engine.errors import UnsupportedModelError
from dpclip.engine.naive import naive_per_example_grads
from tests.engine.helpers import DT, clip_weights, oracle_norms, oracle_sum
from tests.engine.test_separability_attacks import ATTACKS, MORE, Net, ce, data, loo_distance

C = 0.5


@contextlib.contextmanager
def graph_runs():
    """Counts the steps (chunks) that ran the compiled graph (:meth:`compiled.Plan.run`)."""
    real = compiled_mod.Plan.run
    count = [0]

    def run(self, *args, **kwargs):
        count[0] += 1
        return real(self, *args, **kwargs)

    compiled_mod.Plan.run = run
    try:
        yield count
    finally:
        compiled_mod.Plan.run = real


def _check_against_the_loop(model: nn.Module, loss, x, y, groups: ParamGroups,
                            engine=None) -> None:
    """The graph's first step runs on the traced path; the next one runs the graph: both equal
    the loop."""
    engine = engine or CompiledEngine()
    for _ in range(2):
        with graph_runs() as ran:
            res = engine.compute(model, loss, x, y, clip_weights(C), groups)
        _equal_to_the_loop(res, model, loss, x, y, groups)
    assert ran[0] >= 1  # (the second step ran the graph)


def _equal_to_the_loop(res, model: nn.Module, loss, x, y, groups: ParamGroups) -> None:
    b = y.shape[0]
    per = naive_per_example_grads(model, loss, x, y)
    torch.testing.assert_close(res.norms, oracle_norms(per, groups, b), rtol=1e-10, atol=1e-12)
    ref = oracle_sum(per, res.weights, groups, b)
    for n, g in ref.items():
        torch.testing.assert_close(res.grads[n], g, rtol=1e-10, atol=1e-12)


class Block(nn.Module):
    """A pre-norm attention block on (B, T, d), mean-pooled: residuals, F.scaled_dot_product_attention
    with a broadcast causal mask, a (1, T, d) position table as a buffer."""

    def __init__(self, d: int = 8, t: int = 5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(3, d)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.RMSNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ff = nn.Linear(d, d)
        self.head = nn.Linear(d, 3)
        self.register_buffer("pos", torch.randn(1, t, d))

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x) + self.pos
        q, k, v = self.qkv(self.norm1(h)).chunk(3, dim=-1)
        split = lambda z: z.unflatten(-1, (2, 4)).transpose(1, 2)  # noqa: E731
        a = nn.functional.scaled_dot_product_attention(split(q), split(k), split(v),
                                                       is_causal=True)
        h = h + self.out(a.transpose(1, 2).flatten(2))
        h = h + self.ff(torch.relu(self.norm2(h)))
        return self.head(h.mean(1))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1 = nn.Conv2d(2, 4, 3, padding=1, stride=2)
        self.gn = nn.GroupNorm(2, 4)
        self.c2 = nn.Conv1d(4, 3, 2)
        self.fc = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.gn(self.c1(x)))  # (B, 4, 3, 3)
        h = self.c2(h.flatten(2))  # (B, 3, 8)
        return self.fc(h.mean(2))


def _seq(b: int = 6, seed: int = 1) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 5, 3, generator=g, dtype=DT), torch.randint(0, 3, (b,), generator=g)


@pytest.mark.parametrize("groups", ["flat", "per_layer"])
def test_an_attention_block_equals_the_loop(groups):
    model = Block().to(DT)
    x, y = _seq()
    _check_against_the_loop(model, ce, x, y, getattr(ParamGroups, groups)(model))


def test_convolutions_and_group_norm_equal_the_loop():
    model = ConvNet().to(DT)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(6, 2, 5, 5, generator=g, dtype=DT), torch.randint(0, 3, (6,), generator=g)
    _check_against_the_loop(model, ce, x, y, ParamGroups.flat(model))


@pytest.mark.parametrize("chunk", [None, 4, 1])
def test_chunks_equal_the_loop(chunk):
    """Chunks of 4 + 2, and of one (run as a batch of two): one graph for every batch size."""
    model = Block().to(DT)
    x, y = _seq()
    _check_against_the_loop(model, ce, x, y, ParamGroups.flat(model),
                            CompiledEngine(max_physical_batch=chunk))


@pytest.mark.parametrize("name", ["bert", "roberta", "gpt2", "llama", "vit"])
def test_hugging_face_models_equal_the_loop(name):
    """BERT and RoBERTa as the tokenizer gives the batch (ids, a 2-D attention mask; the position
    embedding's batch-less call read at the proof's expansion); GPT-2 (``transformers`` Conv1D as
    ``addmm`` on the 2-D view, each example's rows a block; ``wte`` tied to ``lm_head``); Llama
    (its RMSNorms, on ghost's per-layer path, read as an elementwise scale) and ViT (its class
    token expanded to the batch, its position embeddings added: ``_BroadcastRule``)."""
    pytest.importorskip("transformers")
    from tests.engine.test_hf_zoo import build

    model, x, y, loss, _ = build(name)
    model.eval()
    _check_against_the_loop(model, loss, x, y, ParamGroups.per_layer(model))


class Dropped(Block):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(self.drop(x))


def test_dropout_draws_what_the_traced_step_draws():
    """Train mode: the graph's dropout draws from the chunk's own generators, as the traced
    step's does, the same masks from the same seed."""
    model = Dropped().to(DT)
    model.train()
    x, y = _seq()
    got = []
    for engine in (GhostEngine(), CompiledEngine()):
        engine.compute(model, ce, x, y, clip_weights(C), ParamGroups.flat(model))
        torch.manual_seed(5)
        with graph_runs() as ran:
            got.append(engine.compute(model, ce, x, y, clip_weights(C), ParamGroups.flat(model)))
    assert ran[0] == 1
    torch.testing.assert_close(got[0].norms, got[1].norms, rtol=1e-12, atol=0)
    for n in got[0].grads:
        torch.testing.assert_close(got[0].grads[n], got[1].grads[n], rtol=1e-12, atol=1e-15)


def _attack_sound(model: nn.Module, loss, x: Tensor, y: Tensor) -> None:
    try:
        for _ in range(2):  # (the first step traced, the second on the graph)
            CompiledEngine().compute(model, loss, x, y, clip_weights(C), ParamGroups.flat(model))
    except (UnsupportedModelError, RuntimeError):
        return  # refused: sound
    assert loo_distance(CompiledEngine(), model, loss, x, y) <= 1 + 1e-9


@pytest.mark.parametrize("name", list(ATTACKS))
def test_the_traced_engines_attacks_are_refused_or_sound(name):
    build, loss = ATTACKS[name]
    torch.manual_seed(0)
    _attack_sound(build().to(DT), loss, *data())


@pytest.mark.parametrize("name", list(MORE))
def test_more_attacks_are_refused_or_sound(name):
    torch.manual_seed(0)
    _attack_sound(Net(MORE[name]).to(DT), ce, *data())


REFUSED = {
    # position-dependent constants the graph builds from the batch size
    "h*arange(B)": lambda m, h: h * torch.arange(h.shape[0], dtype=h.dtype)[:, None],
    "arange(B)%3-index": lambda m, h: h[torch.arange(h.shape[0]) % 3 + 0 * torch.arange(
        h.shape[0])],
    "batch-mean": lambda m, h: h - h.mean(0),
    "weight-outside-its-layer": lambda m, h: h @ (m.fc2.weight.t() @ m.fc2.weight),
    "buffer-write": lambda m, h: h + m.stat.add_(h.detach().mean()),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_compiled_refuses(name):
    torch.manual_seed(0)
    model = Net(REFUSED[name]).to(DT)
    model.register_buffer("stat", torch.zeros((), dtype=DT))
    x, y = data()
    with pytest.raises(UnsupportedModelError):
        for _ in range(2):
            CompiledEngine().compute(model, ce, x, y, clip_weights(C), ParamGroups.flat(model))


def test_a_uniform_constant_with_batch_rows_is_proved_by_construction():
    """``ones(B, 1)`` and an expanded row are the same for every example by the graph's
    construction (no value is read): accepted, equal to the loop."""
    model = Net(lambda m, h: h * torch.ones(h.shape[0], 1, dtype=h.dtype)
                + torch.linspace(0, 1, 6, dtype=h.dtype).expand(h.shape[0], 6)).to(DT)
    x, y = data()
    _check_against_the_loop(model, ce, x, y, ParamGroups.flat(model))


def test_tied_parameters_equal_the_loop():
    """An Embedding's table tied to a Linear's weight (GPT-2's ``wte`` / ``lm_head``): one input
    of the graph, one call per layer, the reduction's tied-parameter rule."""
    torch.manual_seed(0)
    emb = nn.Embedding(5, 5).to(DT)
    lin = nn.Linear(5, 5).to(DT)
    lin.weight = emb.weight

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.lin = emb, lin

        def forward(self, ids: Tensor) -> Tensor:
            return self.lin(torch.tanh(self.emb(ids))).mean(1)

    tied = Tied()
    g = torch.Generator().manual_seed(4)
    ids, y = torch.randint(0, 5, (6, 3), generator=g), torch.randint(0, 5, (6,), generator=g)
    _check_against_the_loop(tied, ce, ids, y, ParamGroups.flat(tied))


def test_user_code_around_the_graph_is_refused():
    model = Block().to(DT)
    x, y = _seq()
    engine = CompiledEngine()
    engine.compute(model, ce, x, y, clip_weights(C), ParamGroups.flat(model))  # proved
    sys.setprofile(lambda *a: None)
    try:
        with pytest.raises(UnsupportedModelError, match="profile"):
            engine.compute(model, ce, x, y, clip_weights(C), ParamGroups.flat(model))
    finally:
        sys.setprofile(None)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        with pytest.raises(UnsupportedModelError):
            engine.compute(model, ce, x, y, clip_weights(C), ParamGroups.flat(model))


def _release(model, x, y) -> Tensor:
    res = CompiledEngine().compute(model, ce, x, y, clip_weights(C), ParamGroups.flat(model))
    return torch.cat([g.reshape(-1) for g in res.grads.values()])


def test_patches_of_torch_do_not_reach_the_graph():
    """The graph's code calls the operations' C++ entry points taken at analysis: a replaced
    ``torch.ops.aten`` operation, a patched ``OpOverload.__call__`` and a global module pre-hook
    (each rolls the batch) change nothing in a graph step (sixty-sixth hostile review: 1.43 C and
    2.29 C when the graph ran as a GraphModule through them)."""
    model = Block().to(DT)
    x, y = _seq()
    _release(model, x, y)  # (the traced first step)
    want = _release(model, x, y)
    aten = torch.ops.aten
    real_relu, real_call = aten.relu, torch._ops.OpOverload.__call__

    class Fake:
        default = staticmethod(lambda t: torch.sigmoid(t))

    def rolled(self, *args, **kwargs):
        if self is real_relu.default:
            args = (args[0].roll(1, 0),) + args[1:]
        return real_call(self, *args, **kwargs)

    def pre(mod, args):
        return tuple(a.roll(1, 0) * 3 if isinstance(a, Tensor) and a.shape == x.shape else a
                     for a in args)

    with graph_runs() as ran:
        setattr(aten, "relu", Fake())
        torch._ops.OpOverload.__call__ = rolled
        handle = nn.modules.module.register_module_forward_pre_hook(pre)
        try:
            got = _release(model, x, y)
        finally:
            setattr(aten, "relu", real_relu)
            torch._ops.OpOverload.__call__ = real_call
            handle.remove()
    assert ran[0] == 1
    assert torch.equal(got, want)


def test_an_index_built_from_arange_by_value_changing_casts_is_refused():
    """``arange(B)`` through ``.bool().long()`` (0, 1, 1, ...) or an int8 round trip (wraps at
    128) is not the identity: refused (sixty-sixth hostile review: 8.34 C and 7.36 C)."""
    for cast in (lambda i: i.bool().long(), lambda i: i.to(torch.int8).long(),
                 lambda i: i.to(torch.int32).long()):
        model = Net(lambda m, h, cast=cast: h[cast(torch.arange(h.shape[0]))]).to(DT)
        x, y = data()
        with pytest.raises(UnsupportedModelError):
            for _ in range(2):
                CompiledEngine().compute(model, ce, x, y, clip_weights(C),
                                         ParamGroups.flat(model))
    model = Net(lambda m, h: h[torch.arange(h.shape[0]).clone().long()]).to(DT)
    _check_against_the_loop(model, ce, *data(), ParamGroups.flat(model))


def test_a_subclass_or_grad_requiring_input_is_refused():
    model = Block().to(DT)
    x, y = _seq()
    for _ in range(2):
        CompiledEngine().compute(model, ce, x, y, clip_weights(C), ParamGroups.flat(model))

    class Sub(Tensor):
        pass

    with pytest.raises(UnsupportedModelError):  # (another proof key: refused by the trace)
        CompiledEngine().compute(model, ce, x.as_subclass(Sub), y, clip_weights(C),
                                 ParamGroups.flat(model))
    with pytest.raises(UnsupportedModelError, match="requires grad"):
        CompiledEngine().compute(model, ce, x.clone().requires_grad_(), y, clip_weights(C),
                                 ParamGroups.flat(model))


def test_changed_layers_and_parameters_run_as_they_are_now():
    """A parameter swapped for another object and a convolution's stride changed between steps:
    the step runs the model as it is (re-proved where the proof's key changed), equal to the
    loop; a layer reconfigured behind the key is refused."""
    model = ConvNet().to(DT)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(6, 2, 5, 5, generator=g, dtype=DT), torch.randint(0, 3, (6,), generator=g)
    groups = ParamGroups.flat(model)
    _check_against_the_loop(model, ce, x, y, groups)
    model.fc.weight = nn.Parameter(torch.randn(3, 3, dtype=DT))
    _check_against_the_loop(model, ce, x, y, groups)
    model.c1.stride = (1, 1)
    _check_against_the_loop(model, ce, x, y, groups)


def test_reset_forgets_the_graphs():
    model = Block().to(DT)
    x, y = _seq()
    CompiledEngine().compute(model, ce, x, y, clip_weights(C), ParamGroups.flat(model))
    assert len(compiled_mod._PLANS) >= 1
    compiled_mod.reset(model)
    assert len(compiled_mod._PLANS) == 0
    _check_against_the_loop(model, ce, x, y, ParamGroups.flat(model))


def test_the_engine_is_registered_and_explicit():
    assert type(get_engine("compiled")) is CompiledEngine
    with pytest.raises(ValueError, match="fallback"):
        CompiledEngine(fallback="vmap")


def test_make_private_trains_on_the_compiled_engine():
    """``make_private(engine="compiled")``: Poisson batches of varying size, one graph for all of
    them after the first step, every parameter moved, the engine recorded."""
    import dpclip

    model = Block().to(DT)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(96, 5, 3, generator=g, dtype=DT), torch.randint(0, 3, (96,), generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp = dpclip.make_private(model, opt, (x, y), noise_multiplier=1.0, delta=1e-5, steps=4,
                             batch_size=16, engine="compiled", verbose=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with graph_runs() as ran:
        for xb, yb in dp.loader:
            dp.backward(xb, yb)
            opt.step()
            opt.zero_grad()
    assert ran[0] >= 3  # (every step after the first ran the graph)
    assert dp.describe()["engine"] == "ghost"
    for n, p in model.named_parameters():
        assert not torch.equal(p.detach(), before[n]), n


def test_layers_tied_or_frozen_after_the_graph_was_adopted():
    """Two layers' weights tied into one tensor after the graph was adopted: the proof's key
    holds the ties (review 97: before, refused as "tied otherwise", a hard stop), so the step is
    proved again with the tie (one input, two calls), never run as the graph's two separate uses.
    A layer frozen: another graph, proved and run as the model is now."""
    x, y = _seq()
    model = Block().to(DT)
    for _ in range(2):
        CompiledEngine().compute(model, ce, x, y, clip_weights(C), ParamGroups.flat(model))
    model.ff.weight = model.out.weight
    _check_against_the_loop(model, ce, x, y, ParamGroups.flat(model))
    compiled_mod.reset(model)
    _check_against_the_loop(model, ce, x, y, ParamGroups.flat(model))
    model = Block().to(DT)
    _check_against_the_loop(model, ce, x, y, ParamGroups.flat(model))
    model.ff.requires_grad_(False)
    _check_against_the_loop(model, ce, x, y, ParamGroups.flat(model))


def test_autocast_around_a_graph_step_is_refused():
    """CPU autocast (which ``torch.is_autocast_enabled()`` without a device type does not
    report) would run the graph's operations in another precision than it was proved in."""
    model = Block().to(DT)
    x, y = _seq()
    _release(model, x, y)  # (the traced first step)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(UnsupportedModelError, match="autocast"):
            _release(model, x, y)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("scale", torch.ones(5, dtype=DT))
        self.fc = nn.Linear(5, 3).to(DT)

    def forward(self, x: Tensor) -> Tensor:
        h = x * self.scale
        m = h.sum(1, keepdim=True)
        return self.fc((x + m).reshape(x.shape[0], 5))


def test_a_buffer_of_another_shape_after_adoption_is_refused():
    """The layouts were proved for the tensors the analysis ran on: a buffer of another rank
    (same values) makes ``x * scale`` broadcast to (1, B, 5) and the graph's ``sum(1)`` a sum
    over the batch (sixty-seventh hostile review: 1.87 C). Refused; after ``reset`` the new
    graph is proved (and refused here: it mixes)."""
    model = Scaled()
    x, y = data()
    _check_against_the_loop(model, ce, x, y, ParamGroups.flat(model))
    model.scale = torch.ones(1, 1, 5, dtype=DT)
    with pytest.raises(UnsupportedModelError, match="changed shape"):
        _release(model, x, y)
    compiled_mod.reset(model)
    with pytest.raises(UnsupportedModelError):
        for _ in range(2):
            _release(model, x, y)


def test_llama_lora_adapters_equal_the_loop():
    """peft LoRA adapters on a frozen tiny Llama (SDPA with a causal mask that its kernel turns
    into an additive one: uniform by construction, ``separable._structural_uniform``)."""
    pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    import transformers as T

    torch.manual_seed(0)
    base = T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)).to(DT)
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                                                      target_modules=["q_proj", "v_proj"]))
    model.eval()
    g = torch.Generator().manual_seed(0)
    ids = (torch.randint(0, 16, (6, 1), generator=g) + torch.arange(8)) % 16

    def lm_loss(out, t):
        logits = out.logits[:, :-1]
        tok = nn.functional.cross_entropy(logits.reshape(-1, 16), t[:, 1:].reshape(-1),
                                          reduction="none")
        return tok.view(t.shape[0], -1).mean(1)

    _check_against_the_loop(model, lm_loss, {"input_ids": ids}, ids, ParamGroups.flat(model))


@pytest.mark.parametrize("engine", [GhostEngine, CompiledEngine])
def test_no_engine_keeps_the_steps_batch(engine):
    """The proof's exported program kept the arguments it was traced with, the first step's
    private batch, for as long as the proof stayed cached (found by a finalizer test whose
    finalizer then never fired). Released now: nothing holds the batch after the step."""
    import gc
    import weakref

    model = Block().to(DT)
    for _ in range(3):
        x, y = _seq()
        refs = (weakref.ref(x), weakref.ref(y))
        engine().compute(model, ce, x, y, clip_weights(C), ParamGroups.flat(model))
        del x, y
        gc.collect()
        assert all(r() is None for r in refs)


class TwiceCalled(nn.Module):
    """One Linear applied twice and an Embedding shared by two inputs (an encoder and a decoder's
    shared table), its weight tied to the output layer: several calls per layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Embedding(7, 4)
        self.mix = nn.Linear(4, 4)
        self.out = nn.Linear(4, 7, bias=False)
        self.out.weight = self.shared.weight

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        h = self.mix(torch.tanh(self.mix(self.shared(src)))) + self.shared(tgt)
        return self.out(h).mean(1)


def test_layers_called_twice_equal_the_loop():
    """Each call is a call of the reduction (the exact rule for several uses of one parameter),
    as on the traced path; Pegasus and Marian run so."""
    model = TwiceCalled().to(DT)
    g = torch.Generator().manual_seed(5)
    src, tgt = torch.randint(0, 7, (6, 3), generator=g), torch.randint(0, 7, (6, 3), generator=g)
    y = torch.randint(0, 7, (6,), generator=g)
    _check_against_the_loop(model, ce, (src, tgt), y, ParamGroups.per_layer(model))


class ScaledNorm(nn.Module):
    """An RMSNorm-like module of the user's own (the per-layer path on ghost): ``weight * x``."""

    def __init__(self, d: int, mix: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.mix = mix

    def forward(self, x: Tensor) -> Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        if self.mix:  # (the operand mixes the examples: refused by the separability analysis)
            h = h - h.mean(0)
        return self.weight * h


class WithNorm(nn.Module):
    def __init__(self, mix: bool = False, twice: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.norm, self.head = nn.Linear(3, 6), ScaledNorm(6, mix), nn.Linear(6, 3)
        self.twice = twice

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(self.inp(x))
        if self.twice:  # (the module called twice: two products of its weight)
            h = self.norm(h)
        return self.head(torch.tanh(h).mean(1))


class Tokens(nn.Module):
    """A class token expanded to the batch, a (1, T + 1, d) position table added, a (1, 1, d)
    LayerScale: parameters of a module of the user's own (ghost's per-layer path) that meet the
    examples only by broadcasting. ``mix``: the expanded token summed over the batch (refused)."""

    def __init__(self, mix: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(3, 4)
        self.cls = nn.Parameter(torch.randn(1, 1, 4))
        self.pos = nn.Parameter(torch.randn(1, 6, 4))
        self.scale = nn.Parameter(torch.rand(1, 1, 4) + 0.5)
        self.head = nn.Linear(4, 3)
        self.mix = mix

    def forward(self, x: Tensor) -> Tensor:
        cls = self.cls.expand(x.shape[0], -1, -1)
        if self.mix:
            cls = cls * x.sum(0, keepdim=True)[:, :1, :1]
        h = torch.cat([cls, self.proj(x)], 1) + self.pos
        return self.head(torch.tanh(h * self.scale)[:, 0])


@pytest.mark.parametrize("build", [WithNorm, lambda: WithNorm(twice=True), Tokens],
                         ids=["scale", "scale-called-twice", "token-position-layerscale"])
def test_parameters_broadcast_to_the_examples_equal_the_loop(build):
    """Parameters of user modules on ghost's per-layer path that meet the examples only by
    broadcasting (``_BroadcastRule``): an RMSNorm-like scale (its module called once or twice),
    a class token, a position table and a LayerScale; per-parameter groups."""
    model = build().to(DT)
    x, y = _seq()
    _check_against_the_loop(model, ce, x, y, ParamGroups.per_parameter(model))


@pytest.mark.parametrize("build", [lambda: WithNorm(mix=True), lambda: Tokens(mix=True)],
                         ids=["scale-of-mixed-rows", "token-times-a-batch-sum"])
def test_a_broadcast_parameter_meeting_mixed_rows_is_refused(build):
    model = build().to(DT)
    x, y = _seq()
    with pytest.raises(UnsupportedModelError):
        for _ in range(2):
            _release(model, x, y)


class PQ(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.linspace(0.5, 1.5, 4).view(1, 1, 4))
        self.q = nn.Parameter(torch.linspace(-1.0, 1.0, 4).view(1, 1, 4))

    def forward(self) -> Tensor:
        return self.p * self.q


class TwoInOne(nn.Module):
    """Two parameters of one module in one product, then a layer on rows grouped by position
    (group 3): the two broadcast uses of the product were one node, and the analysis's layouts
    were paired with the calls by position (seventy-first hostile review: the layer after it
    would have been read with another call's group)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l, self.s, self.g = nn.Linear(3, 4), PQ(), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.l(x) + self.s()
        return self.g(h.reshape(-1, 4)).reshape(x.shape[0], -1, 3).mean(1)


def test_two_parameters_in_one_operation_are_refused():
    model = TwoInOne().to(DT)
    x, y = _seq()
    with pytest.raises(UnsupportedModelError, match="two parameters"):
        for _ in range(2):
            _release(model, x, y)
