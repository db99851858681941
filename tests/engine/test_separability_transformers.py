"""Separability that knows transformers (issue 31, item 2): broadcast position tensors, every
``scaled_dot_product_attention`` form with example or broadcast masks, label smoothing, arange
indexing, per-token LM losses and the ordinary Hugging Face forward pass are proved separable; each
rule has an adversarial twin that must be refused. The verdict is the proof's
(:func:`dpclip.engine.separable.prove_separable`: the symbolic-batch check and the op-by-op
trace), independent of the ghost layer rules."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from dpclip.engine.separable import prove_separable

B, T, H, D = 4, 6, 2, 8


def ce(o: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(o, y, reduction="none")


def tokens(seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 50, (B, T), generator=g), torch.randint(0, 3, (B,), generator=g)


# ------------------------------------------------------------------- broadcast position tensors

class PosModel(nn.Module):
    """Token embedding plus a position term that has no batch dimension."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.tok = nn.Embedding(50, D)
        self.pos_param = nn.Parameter(torch.randn(1, T, D))
        self.pos_emb = nn.Embedding(T, D)
        self.register_buffer("pos_buf", torch.randn(1, T, D))
        self.register_buffer("ids", torch.arange(T).unsqueeze(0))
        self.head = nn.Linear(D, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.tok(x)
        if self.kind == "param":
            h = h + self.pos_param
        elif self.kind == "buffer":
            h = h + self.pos_buf
        elif self.kind == "embedding-arange":
            h = h + self.pos_emb(torch.arange(x.shape[1]))
        elif self.kind == "embedding-(1,T)-expanded":
            h = h + self.pos_emb(self.ids.expand(x.shape[0], -1))
        elif self.kind == "twin:x+x[:1]":
            h = h + h[:1]
        elif self.kind == "twin:x[0]-all-rows":
            h = h * h[0]
        elif self.kind == "twin:positions-by-row":
            h = h + self.pos_emb(torch.arange(x.shape[0]) % T)[:, None]
        return self.head(h.mean(1))


@pytest.mark.parametrize("kind", ["param", "buffer", "embedding-arange",
                                  "embedding-(1,T)-expanded"])
def test_broadcast_position_tensors_are_separable(kind):
    x, y = tokens()
    assert prove_separable(PosModel(kind), ce, x, y) is None


@pytest.mark.parametrize("kind", ["twin:x+x[:1]", "twin:x[0]-all-rows", "twin:positions-by-row"])
def test_broadcasts_that_carry_examples_or_positions_are_refused(kind):
    x, y = tokens()
    assert prove_separable(PosModel(kind), ce, x, y) is not None


# ------------------------------------------------------------------------------------- attention

class Attn(nn.Module):
    """One attention layer over (B, T, D) with a mask given in one of several forms."""

    def __init__(self, mask: str) -> None:
        super().__init__()
        self.mask = mask
        self.tok = nn.Embedding(50, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.head = nn.Linear(D, 3)

    def forward(self, x: Tensor, pad: Tensor) -> Tensor:
        b, t = x.shape
        h = self.tok(x)
        q, k, v = self.qkv(h).view(b, t, 3, H, D // H).permute(2, 0, 3, 1, 4)  # (B, H, T, d)
        keep = pad.bool()
        m: Tensor | None = None
        causal = False
        if self.mask == "none":
            pass
        elif self.mask == "causal":
            causal = True
        elif self.mask == "data(B,1,1,T)":
            m = keep[:, None, None, :]
        elif self.mask == "data(B,1,T,T)":
            m = keep[:, None, None, :] & keep[:, None, :, None] | torch.eye(t, dtype=torch.bool)
        elif self.mask == "broadcast(1,1,T,T)":
            m = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
        elif self.mask == "float-bias(B,1,1,T)":
            m = (1.0 - pad[:, None, None, :].float()) * -1e4
        elif self.mask == "twin:mask-rolled-over-batch":
            m = keep.roll(1, 0)[:, None, None, :]
        elif self.mask == "twin:(B,T,T)-mask-against-heads":
            m = (keep[:, None, :] | torch.eye(t, dtype=torch.bool))  # broadcasts B against H
        if self.mask == "twin:attention-across-batch":
            q, k, v = (z.transpose(0, 1).reshape(1, H, b * t, D // H) for z in (q, k, v))
            o = F.scaled_dot_product_attention(q, k, v).view(H, b, t, D // H).transpose(0, 1)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal)
        o = o.transpose(1, 2).reshape(b, t, D)
        return self.head(o.mean(1))


MASKS = ["none", "causal", "data(B,1,1,T)", "data(B,1,T,T)", "broadcast(1,1,T,T)",
         "float-bias(B,1,1,T)"]
TWINS = ["twin:mask-rolled-over-batch", "twin:(B,T,T)-mask-against-heads",
         "twin:attention-across-batch"]


def _backends():
    from torch.nn.attention import SDPBackend
    return [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def _verdict_under(backend, model, inputs, y):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([backend]):
        try:
            model(*inputs)
        except RuntimeError as exc:  # this CPU build has no such kernel for these inputs
            pytest.skip(f"{backend} unavailable: {str(exc).splitlines()[0][:80]}")
        return prove_separable(model, lambda o, t: ce(o, t), inputs, y)


def _attn_batch():
    x, y = tokens()
    pad = torch.ones(B, T, dtype=torch.long)
    pad[1, -2:] = 0
    pad[3, -1:] = 0
    return (x, pad), y


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("mask", MASKS)
def test_sdpa_is_separable_in_every_backend_and_mask_form(mask, backend):
    H_ = H  # B != H, so that a mis-aligned mask would fail on shapes, not only on the proof
    assert H_ != B
    inputs, y = _attn_batch()
    torch.manual_seed(0)
    assert _verdict_under(backend, Attn(mask), inputs, y) is None


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("mask", TWINS)
def test_sdpa_twins_are_refused_in_every_backend(mask, backend, monkeypatch):
    global H
    if mask == "twin:(B,T,T)-mask-against-heads":
        monkeypatch.setattr(__import__(__name__, fromlist=["H"]), "H", B)  # heads == batch
    inputs, y = _attn_batch()
    torch.manual_seed(0)
    assert _verdict_under(backend, Attn(mask), inputs, y) is not None


# ----------------------------------------------------------------------------- losses by example

class Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc = nn.Embedding(50, D), nn.Linear(D, 50)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.emb(x))  # (B, T, V)


def _lm_sum(o: Tensor, x: Tensor) -> Tensor:
    lg, t = o[:, :-1], x[:, 1:]
    return F.cross_entropy(lg.reshape(-1, lg.shape[-1]), t.reshape(-1),
                           reduction="none").view(o.shape[0], -1).sum(1)


def _lm_mean_public_t(o: Tensor, x: Tensor) -> Tensor:
    return F.cross_entropy(o.transpose(1, 2), x, reduction="none").mean(1)


def _lm_view_b_t(o: Tensor, x: Tensor) -> Tensor:
    b, t = x.shape
    return F.cross_entropy(o.reshape(b * t, -1), x.reshape(-1), reduction="none").view(b, t).sum(1)


@pytest.mark.parametrize("loss", [_lm_sum, _lm_mean_public_t, _lm_view_b_t],
                         ids=["shifted-sum", "mean-over-T", "view(B,T).sum(1)"])
def test_per_token_lm_losses_reduced_per_example_are_separable(loss):
    x, _ = tokens()
    assert prove_separable(Lin(), loss, x, x) is None


@pytest.mark.parametrize("loss", [
    lambda o, x: F.cross_entropy(o.reshape(-1, 50), x.reshape(-1), reduction="none").view(
        x.shape[1], -1).sum(1),  # (T, B) view of a (B*T,) vector: rows mix examples
    lambda o, x: F.cross_entropy(o.transpose(1, 2), x, reduction="none").mean(0),
    lambda o, x: F.cross_entropy(o.transpose(1, 2), x, reduction="none").sum(1) / x.numel(),
], ids=["view(T,B)", "mean-over-batch", "divided-by-numel"])
def test_lm_loss_twins_are_refused(loss):
    x, _ = tokens()
    assert prove_separable(Lin(), loss, x, x) is not None


def test_label_smoothing_and_arange_indexing_are_separable_flip_is_not():
    x, y = tokens()
    model = nn.Sequential(nn.Embedding(50, D), nn.Flatten(), nn.Linear(T * D, 3))
    assert prove_separable(model, lambda o, t: F.cross_entropy(
        o, t, reduction="none", label_smoothing=0.1), x, y) is None
    assert prove_separable(model, lambda o, t: -o.log_softmax(1)[
        torch.arange(o.shape[0]), t], x, y) is None
    assert prove_separable(model, lambda o, t: -o.log_softmax(1)[
        torch.arange(o.shape[0]).flip(0), t], x, y) is not None


def test_dropout_masks_are_fresh_draws_not_positions():
    x, y = tokens()
    model = nn.Sequential(nn.Embedding(50, D), nn.Dropout(0.3), nn.Flatten(), nn.Linear(T * D, 3))
    model.train()
    assert prove_separable(model, ce, x, y) is None
    # a FIXED random tensor with B rows is a position-dependent constant: refused
    fixed = torch.randn(B, 1, D)
    bad = nn.Sequential(nn.Embedding(50, D))
    assert prove_separable(lambda z: (bad(z) * fixed).flatten(1)[:, :3], ce, x, y) is not None


# -------------------------------------------------------------------------- Hugging Face models

tf = pytest.importorskip("transformers")


def _hf(name: str) -> nn.Module:
    torch.manual_seed(0)
    small = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    if name == "bert":
        return tf.BertForSequenceClassification(tf.BertConfig(
            vocab_size=50, max_position_embeddings=16, num_labels=3, **small))
    if name == "roberta":
        return tf.RobertaForSequenceClassification(tf.RobertaConfig(
            vocab_size=50, max_position_embeddings=20, num_labels=3, **small))
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2,
                                                n_positions=16, bos_token_id=0, eos_token_id=0))
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=50, num_key_value_heads=1,
                                                  max_position_embeddings=16, **small))
    return tf.ViTForImageClassification(tf.ViTConfig(image_size=8, patch_size=4, num_channels=3,
                                                     num_labels=3, **small))


def _hf_batch(name: str):
    x, y = tokens()
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, -2:] = 0  # padding in one example: the tokenizer's 2-D mask
    if name == "vit":
        g = torch.Generator().manual_seed(0)
        return {"pixel_values": torch.randn(B, 3, 8, 8, generator=g)}, y, _cls
    if name in ("gpt2", "llama"):
        return {"input_ids": x, "attention_mask": mask}, x, _causal_lm
    return {"input_ids": x, "attention_mask": mask}, y, _cls


def _cls(o, y):
    return F.cross_entropy(o.logits, y, reduction="none")


def _causal_lm(o, x):
    return _lm_sum(o.logits, x)


HF = ["bert", "roberta", "gpt2", "llama", "vit"]


@pytest.mark.parametrize("name", HF)
def test_hugging_face_forward_is_proved_separable(name):
    model = _hf(name).train()
    xs, ys, loss = _hf_batch(name)
    assert prove_separable(model, loss, xs, ys) is None


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_hf_data_independent_path_equals_the_ordinary_forward(name):
    """The mask path taken during the proof and the private step (never reading
    ``attention_mask.all()``) computes what the ordinary forward computes."""
    from dpclip.engine.batch_symbol import data_independent_paths

    model = _hf(name).eval()
    xs, _, _ = _hf_batch(name)
    for mask_all_ones in (False, True):
        batch = dict(xs)
        if mask_all_ones:
            batch["attention_mask"] = torch.ones_like(batch["attention_mask"])
        ref = model(**batch).logits
        with data_independent_paths():
            got = model(**batch).logits
        keep = batch["attention_mask"].bool()
        if name == "bert":
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        else:  # padded positions of a causal LM are don't-care rows
            torch.testing.assert_close(got[keep], ref[keep], rtol=1e-5, atol=1e-5)


def test_hf_mask_that_mixes_is_refused():
    """Twin of the HF forward: the padding mask shifted over the batch (example i attends with
    example i+1's mask) is refused."""
    model = _hf("bert").train()
    xs, ys, loss = _hf_batch("bert")
    model_fn = lambda input_ids, attention_mask: model(  # noqa: E731
        input_ids=input_ids, attention_mask=attention_mask.roll(1, 0))
    assert prove_separable(model_fn, loss, xs, ys) is not None


def test_stack_keeps_the_batch_and_refuses_position_constants():
    x, y = tokens()
    emb = nn.Embedding(50, D)
    ok = lambda z: torch.stack([emb(z), 2 * emb(z)], dim=1).flatten(1)[:, :3]  # noqa: E731
    assert prove_separable(ok, ce, x, y) is None
    rows = torch.randn(B, T, D)
    bad = lambda z: torch.stack([emb(z), rows], dim=1).flatten(1)[:, :3]  # noqa: E731
    assert prove_separable(bad, ce, x, y) is not None


def test_auto_runs_bert_called_as_the_tokenizer_gives_its_batch():
    """``input_ids`` and a 2-D ``attention_mask`` with padding: under ``auto`` the step runs (ghost
    or its vmap fallback, both with transformers' data-independent mask path) and equals the
    per-example loop; before, ``attention_mask.all()`` failed the ghost proof and the vmap
    fallback alike."""
    from dpclip.engine import AutoEngine, NaiveEngine, ParamGroups
    from tests.engine.helpers import assert_grads_close, clip_weights

    model = _hf("bert").to(torch.float64).eval()  # eval: no dropout, so the two runs compare
    xs, ys, loss = _hf_batch("bert")
    groups = ParamGroups.flat(model)
    res = AutoEngine().compute(model, loss, xs, ys, clip_weights(1.0), groups)
    ref = NaiveEngine().compute(model, loss, xs, ys, clip_weights(1.0), groups)
    assert_grads_close(res.grads, ref.grads)
