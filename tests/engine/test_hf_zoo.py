"""Ghost on the Hugging Face zoo (issue 31, items 3 and 8): tiny float64 configs of
BertForSequenceClassification, RobertaForSequenceClassification, GPT2LMHeadModel, LlamaForCausalLM
and ViTForImageClassification (built from config classes, no download, a few thousand parameters)
run on ghost, with no whole-model fallback, and give the float64 per-example loop's norms and
clipped sums, for every norm strategy of the registry that runs on ghost.

The zoo fixture spells out position ids and token type ids and uses eager attention; the calls
"as the tokenizer gives them" (``input_ids`` and a 2-D ``attention_mask`` only, eager and SDPA
attention; BERT's and GPT-2's position embeddings then run on a ``(1, T)`` buffer, a batch-less
call: :mod:`dpclip.engine.batchless`) are tested below.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dpclip.clipping.capabilities import capabilities_of
from dpclip.clipping import STRATEGIES
from dpclip.engine import AutoEngine, GhostEngine, ParamGroups, naive_per_example_grads
from dpclip.engine.errors import UnsupportedModelError
from tests.clipping.contract import contract_strategy
from tests.engine.helpers import DT, assert_grads_close, oracle_norms, oracle_sum

T = pytest.importorskip("transformers")

B, L, VOCAB = 3, 5, 40
SMALL = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
             attn_implementation="eager")


def cls_loss(out, y):
    return F.cross_entropy(out.logits, y, reduction="none")


def lm_loss(out, y):
    logits, tgt = out.logits[:, :-1], y[:, 1:]
    tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                          reduction="none")
    return tok.view(tgt.shape).mean(1)


class Pixels(nn.Module):
    """ViT called positionally (``model(pixel_values=x)``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, x):
        return self.m(pixel_values=x)


def _text(kind: str, g: torch.Generator, first_pos: int = 0):
    ids = torch.randint(3, VOCAB, (B, L), generator=g)
    x = {"input_ids": ids,
         "position_ids": torch.arange(first_pos, first_pos + L).expand(B, L).contiguous()}
    if kind == "cls":
        x["token_type_ids"] = torch.zeros_like(ids)
        # as a tokenizer gives it: without a mask, transformers >= 5.25 checks the position_ids of
        # the whole batch for packed sequences in Python (test_packed_sequence_check_is_refused)
        x["attention_mask"] = torch.ones_like(ids)
        return x, torch.randint(0, 2, (B,), generator=g)
    return x, ids


def build(name: str):
    """(model, inputs, targets, loss_fn, per-layer module names expected)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "bert":
        model = T.BertForSequenceClassification(T.BertConfig(
            vocab_size=VOCAB, max_position_embeddings=16, num_labels=2, **SMALL))
        x, y = _text("cls", g)
        return model.to(DT), x, y, cls_loss, ()
    if name == "roberta":
        model = T.RobertaForSequenceClassification(T.RobertaConfig(
            vocab_size=VOCAB, max_position_embeddings=16, num_labels=2, **SMALL))
        x, y = _text("cls", g, first_pos=2)  # RoBERTa's positions start after padding_idx
        return model.to(DT), x, y, cls_loss, ()
    if name == "gpt2":
        model = T.GPT2LMHeadModel(T.GPT2Config(
            vocab_size=VOCAB, n_positions=16, n_embd=8, n_layer=1, n_head=2,
            bos_token_id=0, eos_token_id=0, attn_implementation="eager"))
        assert model.lm_head.weight is model.transformer.wte.weight  # tied
        x, y = _text("lm", g)
        return model.to(DT), x, y, lm_loss, ()
    if name == "llama":
        model = T.LlamaForCausalLM(T.LlamaConfig(
            vocab_size=VOCAB, max_position_embeddings=16, num_key_value_heads=1, **SMALL))
        x, y = _text("lm", g)
        return model.to(DT), x, y, lm_loss, ("model.layers.0.input_layernorm",
                                              "model.layers.0.post_attention_layernorm",
                                              "model.norm")
    if name == "vit":
        model = T.ViTForImageClassification(T.ViTConfig(
            image_size=8, patch_size=4, num_channels=3, num_labels=3, **SMALL))
        x = torch.randn(B, 3, 8, 8, generator=g, dtype=DT)
        return Pixels(model.to(DT)), x, torch.randint(0, 3, (B,), generator=g), cls_loss, \
            ("m.vit.embeddings",)
    raise KeyError(name)


MODELS = ["bert", "roberta", "gpt2", "llama", "vit"]


def _ghost_strategies():
    """The registered norm strategies that run on the ghost engine (as in test_ghost.py)."""
    return sorted(n for n, e in STRATEGIES.items()
                  if e.kind == "norm" and not capabilities_of(e.cls).per_example_grads)


@pytest.fixture(scope="module")
def zoo():
    out = {}
    for name in MODELS:
        model, x, y, loss_fn, per_layer = build(name)
        model.eval()  # dropout off: the loop and the batched pass see the same function
        out[name] = (model, x, y, loss_fn, per_layer,
                     naive_per_example_grads(model, loss_fn, x, y))
    return out


@pytest.mark.parametrize("name", MODELS)
def test_zoo_runs_on_ghost_equal_to_the_loop(zoo, name):
    """auto runs ghost (no whole-model fallback) on every model; every norm mode gives the loop's
    per-example norms (upper bounds within rounding) and the exactly weighted sum."""
    model, x, y, loss_fn, per_layer, per_ex = zoo[name]
    for groups in (ParamGroups.flat(model), ParamGroups.per_layer(model)):
        expected = oracle_norms(per_ex, groups, B)
        for engine in (AutoEngine(), GhostEngine(norm_mode="ghost"),
                       GhostEngine(norm_mode="direct"), GhostEngine(max_physical_batch=2),
                       GhostEngine(max_physical_batch=1)):  # (chunks of one: watched, issue 31)
            res = engine.compute(model, loss_fn, x, y, lambda n: (0.05 / n).clamp(max=1.0),
                                 groups)
            assert res.engine_info["engine"] == "ghost", res.engine_info
            assert res.engine_info["fallback"] is None
            assert res.engine_info.get("per_layer", ()) == per_layer
            assert bool((res.norms >= expected * (1 - 1e-12)).all())
            torch.testing.assert_close(res.norms, expected, rtol=1e-9, atol=1e-12)
            assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, B))


@pytest.mark.parametrize("name", MODELS)
def test_zoo_every_ghost_strategy(zoo, name):
    """Every registered norm strategy that runs on ghost: weights from the ghost norms, sums
    equal to the loop's weighted sum with those weights, norms equal to the loop's."""
    model, x, y, loss_fn, _, per_ex = zoo[name]
    for sname in _ghost_strategies():
        strategy = contract_strategy(sname)
        groups = ParamGroups.flat(model) if strategy.norm_kind == "flat" else \
            ParamGroups.per_layer(model)
        if capabilities_of(strategy).per_group:
            strategy = strategy.bind_groups(groups.names)
        state = strategy.init_state()
        res = GhostEngine().compute(model, loss_fn, x, y,
                                    lambda n: strategy.weights(n, state), groups)
        torch.testing.assert_close(res.norms, oracle_norms(per_ex, groups, B), rtol=1e-9,
                                   atol=1e-12, msg=f"{name}/{sname}")
        assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, B))


def test_gpt2_tied_embedding_exact_cross_terms(zoo, monkeypatch):
    """GPT-2's ``wte`` tied to ``lm_head`` above the forming budget (GPT-2 small's 38.6M entries):
    the norm of the sum of the two uses' gradients is exact, the cross term by a ghost inner
    product (dpclip.engine.tied; the triangle bound, which over-clips, before); the clipped sum
    is the exact weighted sum."""
    import dpclip.engine.ghost as ghost_mod

    model, x, y, loss_fn, _, per_ex = zoo["gpt2"]
    monkeypatch.setattr(ghost_mod, "_TIED_FORM_MAX_NUMEL", 0)
    groups = ParamGroups.flat(model)
    res = GhostEngine().compute(model, loss_fn, x, y, lambda n: (0.05 / n).clamp(max=1.0), groups)
    expected = oracle_norms(per_ex, groups, B)
    assert bool((res.norms >= expected * (1 - 1e-12)).all())
    torch.testing.assert_close(res.norms, expected, rtol=1e-9, atol=1e-12)
    assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, B))


def _as_the_tokenizer_gives(name: str, attn: str):
    """(model, inputs, targets, loss): ``input_ids`` and a 2-D ``attention_mask`` with padding in
    one example, no position or token type ids, the given attention implementation."""
    torch.manual_seed(0)
    small = dict(SMALL, attn_implementation=attn)
    if name == "bert":
        model = T.BertForSequenceClassification(T.BertConfig(
            vocab_size=VOCAB, max_position_embeddings=16, num_labels=2, **small))
    elif name == "roberta":  # position ids built from input_ids and padding_idx: per example
        model = T.RobertaForSequenceClassification(T.RobertaConfig(
            vocab_size=VOCAB, max_position_embeddings=16, num_labels=2, **small))
    elif name == "gpt2":
        model = T.GPT2LMHeadModel(T.GPT2Config(
            vocab_size=VOCAB, n_positions=16, n_embd=8, n_layer=1, n_head=2, bos_token_id=0,
            eos_token_id=0, attn_implementation=attn))
    else:
        model = T.LlamaForCausalLM(T.LlamaConfig(
            vocab_size=VOCAB, max_position_embeddings=16, num_key_value_heads=1, **small))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (B, L), generator=g)
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    x = {"input_ids": ids, "attention_mask": mask}
    if name in ("bert", "roberta"):
        return model.to(DT).eval(), x, torch.randint(0, 2, (B,), generator=g), cls_loss
    return model.to(DT).eval(), x, ids, lm_loss


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ["bert", "roberta", "gpt2", "llama"])
def test_as_the_tokenizer_gives_it_runs_on_ghost(name, attn):
    """``input_ids`` and a 2-D ``attention_mask`` only (BERT's and GPT-2's position embeddings
    then run on a ``(1, T)`` buffer: a batch-less call, :mod:`dpclip.engine.batchless`), eager and
    SDPA attention: auto on ghost with no fallback, flat and per-layer norms equal to the float64
    per-example loop, the sum exactly weighted; also in chunks of one (watched: issue 31)."""
    model, x, y, loss_fn = _as_the_tokenizer_gives(name, attn)
    per_ex = naive_per_example_grads(model, loss_fn, x, y)
    for groups, engine in ((ParamGroups.flat(model), AutoEngine()),
                           (ParamGroups.per_layer(model), AutoEngine()),
                           (ParamGroups.flat(model), AutoEngine(max_physical_batch=1))):
        res = engine.compute(model, loss_fn, x, y, lambda n: (0.05 / n).clamp(max=1.0), groups)
        assert res.engine_info["engine"] == "ghost", res.engine_info
        assert res.engine_info["fallback"] is None
        torch.testing.assert_close(res.norms, oracle_norms(per_ex, groups, B), rtol=1e-9,
                                   atol=1e-12)
        assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, B))


def test_bert_as_the_tokenizer_gives_it_runs_on_ghost():
    """The issue's "Done when" line: BERT with ``input_ids`` and a 2-D ``attention_mask`` only,
    default attention: auto on ghost, equal to the float64 per-example loop."""
    torch.manual_seed(0)
    model = T.BertForSequenceClassification(T.BertConfig(
        vocab_size=VOCAB, max_position_embeddings=16, num_labels=2, hidden_size=8,
        intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)).to(DT).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (B, L), generator=g)
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    x, y = {"input_ids": ids, "attention_mask": mask}, torch.randint(0, 2, (B,), generator=g)
    groups = ParamGroups.flat(model)
    res = AutoEngine().compute(model, cls_loss, x, y, lambda n: (0.05 / n).clamp(max=1.0), groups)
    assert res.engine_info["engine"] == "ghost", res.engine_info
    per_ex = naive_per_example_grads(model, cls_loss, x, y)
    torch.testing.assert_close(res.norms, oracle_norms(per_ex, groups, B), rtol=1e-9, atol=1e-12)
    assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, B))


def test_llama_rmsnorm_is_recognised_as_an_elementwise_scale(zoo, monkeypatch):
    """LlamaRMSNorm takes the graph-read elementwise-scale rule, no recomputation by vmap."""
    import dpclip.engine.ghost as ghost_mod

    def refuse(c, batch):
        raise AssertionError(f"{c.owner.name} was recomputed")

    monkeypatch.setattr(ghost_mod, "module_grads", refuse)
    model, x, y, loss_fn, _, per_ex = zoo["llama"]
    groups = ParamGroups.per_layer(model)
    res = GhostEngine().compute(model, loss_fn, x, y, lambda n: (0.05 / n).clamp(max=1.0), groups)
    torch.testing.assert_close(res.norms, oracle_norms(per_ex, groups, B), rtol=1e-9, atol=1e-12)
    assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, B))


class _WithHidden(nn.Module):
    """Calls the model with ``output_hidden_states=True`` (and ``output_attentions=True``) and
    returns logits that use the last hidden state and the attentions."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, input_ids, attention_mask):
        out = self.m(input_ids=input_ids, attention_mask=attention_mask,
                     output_hidden_states=True, output_attentions=True)
        extra = out.hidden_states[-1].pow(2).mean(-1) + out.attentions[-1].mean((1, 3))
        return out.logits + extra.mean(1).view(-1, *([1] * (out.logits.ndim - 1)))


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_output_hidden_states_runs_on_ghost_on_the_first_private_step(name):
    """transformers (>= 5) installs its output-capturing forward hooks on the first call that asks
    for hidden states or attentions: inside a private step the state guard refused that change of
    the model under every engine (fef86b2). Installed before the step's snapshot
    (``dpclip.engine.hf_hooks.prime``): a fresh model runs on ghost at its first step, equal to the loop (the
    loop runs after the engine, so the engine is the model's first call)."""
    model, x, y, loss_fn = _as_the_tokenizer_gives(name, "eager")
    wrapped = _WithHidden(model)
    loss = cls_loss if name == "bert" else lm_loss

    def wrapped_loss(out, t):
        return loss(type("O", (), {"logits": out})(), t)

    groups = ParamGroups.flat(wrapped)
    res = AutoEngine().compute(wrapped, wrapped_loss, (x["input_ids"], x["attention_mask"]), y,
                               lambda n: (0.05 / n).clamp(max=1.0), groups)
    assert res.engine_info["engine"] == "ghost", res.engine_info
    per_ex = naive_per_example_grads(wrapped, wrapped_loss, (x["input_ids"], x["attention_mask"]),
                                     y)
    torch.testing.assert_close(res.norms, oracle_norms(per_ex, groups, B), rtol=1e-9, atol=1e-12)
    assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, B))


@pytest.mark.parametrize("compiled", [False, True])
def test_gemma_scaled_embedding_runs_on_ghost_equal_to_the_loop(compiled):
    """Gemma's word embedding is an Embedding subclass with its own forward (``embedding(ids) *
    embed_scale``, ``padding_idx`` 0): the per-layer path, whose replay batches the lookup's
    gradient with offsets per example (``per_layer.RecomputeTracer``); refused before, and ``auto``
    stopped the run. Tied to ``lm_head``. With ``compiled`` (auto's default since session 26) the
    graph runs it: the lookup on the Embedding rule, the ``x * (1 + w.float())`` norms on the
    broadcast rule through their chain; those norms' gradients are float32 sums in the loop (its
    autograd) and float64 sums of the same float32 products on the graph, so the sum is compared
    at float32's resolution there."""
    torch.manual_seed(0)
    model = T.GemmaForCausalLM(T.GemmaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=16,
        attn_implementation="eager")).to(DT).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, L), generator=g)
    ids[0, :2] = 0  # padding tokens
    x = {"input_ids": ids}
    groups = ParamGroups.flat(model)
    eng = AutoEngine(compiled=compiled)
    for _ in range(2 if compiled else 1):  # (the graph's first step adopts it, the second runs it)
        res = eng.compute(model, lm_loss, x, ids, lambda n: (0.05 / n).clamp(max=1.0), groups)
    assert res.engine_info["engine"] == "ghost", res.engine_info
    assert "model.embed_tokens" in res.engine_info["per_layer"]
    assert (res.engine_info.get("program") == "compiled") is compiled, res.engine_info
    per_ex = naive_per_example_grads(model, lm_loss, x, ids)
    torch.testing.assert_close(res.norms, oracle_norms(per_ex, groups, B), rtol=1e-9, atol=1e-12)
    assert_grads_close(res.grads, oracle_sum(per_ex, res.weights, groups, B),
                       rtol=1e-6 if compiled else 1e-10)


def test_packed_sequence_check_is_refused():
    """transformers >= 5.25, given ``position_ids`` without an attention mask, decides in Python
    whether ANY row of the batch packs several sequences (``find_packed_sequence_indices``: a read
    of every example's positions that picks the mask of all): not provable, so ghost and auto
    refuse it (vmap cannot run the branch either) instead of running it; with the tokenizer's mask
    the zoo runs (test_zoo_runs_on_ghost_equal_to_the_loop)."""
    masking = pytest.importorskip("transformers.masking_utils")
    if not hasattr(masking, "find_packed_sequence_indices"):
        pytest.skip("this transformers has no packed-sequence check")
    model, x, y, loss_fn, _ = build("bert")
    model.eval()
    del x["attention_mask"]
    if "position_ids" not in inspect.signature(masking.create_bidirectional_mask).parameters:
        pytest.skip("this transformers does not check BERT's position_ids")
    for engine in (AutoEngine(), GhostEngine()):
        with pytest.raises(UnsupportedModelError):
            engine.compute(model, loss_fn, x, y, lambda n: (0.05 / n).clamp(max=1.0),
                           ParamGroups.flat(model))
