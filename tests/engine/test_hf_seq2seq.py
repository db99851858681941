"""Encoder-decoder models of the Hugging Face zoo on ghost (issue 31): BART, mBART, Marian and
Pegasus for conditional generation, called as a training loop calls them (``input_ids``, a padded
2-D ``attention_mask``, ``decoder_input_ids``; the loss per example from the logits), under
``auto``: ghost, no whole-model fallback, equal to the float64 per-example loop.

They ran on whole-model vmap: the decoders build their causal mask from ``torch.ones(B, T)`` when
no decoder mask is given (``batch_symbol._uniform_index``), and BART's learned position embedding
is an ``nn.Embedding`` subclass called on 1-D positions (the per-layer path;
``separable._embedding_dense_backward``): see test_uniform_constants.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dpclip.engine import AutoEngine, ParamGroups, naive_per_example_grads
from tests.engine.helpers import DT, assert_matches_the_loop, clip_weights

T = pytest.importorskip("transformers")

B, L, VOCAB, TGT = 3, 6, 40, 4
SIZES = dict(vocab_size=VOCAB, d_model=8, encoder_layers=1, decoder_layers=1,
             encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16,
             decoder_ffn_dim=16, max_position_embeddings=16, pad_token_id=1,
             decoder_start_token_id=2, eos_token_id=2, bos_token_id=0, dropout=0.0,
             attention_dropout=0.0, activation_dropout=0.0)
CLASSES = {"bart": ("BartConfig", "BartForConditionalGeneration"),
           "mbart": ("MBartConfig", "MBartForConditionalGeneration"),
           "marian": ("MarianConfig", "MarianMTModel"),
           "pegasus": ("PegasusConfig", "PegasusForConditionalGeneration")}


class Seq2Seq(nn.Module):
    """The model called with its keyword arguments, positionally (the engines' batch is a tuple)."""

    def __init__(self, model: nn.Module, decoder_mask: bool) -> None:
        super().__init__()
        self.m = model
        self.decoder_mask = decoder_mask

    def forward(self, input_ids, attention_mask, decoder_input_ids):
        kw = {"decoder_attention_mask": torch.ones_like(decoder_input_ids)} \
            if self.decoder_mask else {}
        return self.m(input_ids=input_ids, attention_mask=attention_mask,
                      decoder_input_ids=decoder_input_ids, **kw).logits


def token_loss(logits, y):
    tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
    return tok.view(y.shape).mean(1)


def _batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (B, L), generator=g)
    mask = torch.ones_like(ids)
    ids[0, -2:], mask[0, -2:] = 1, 0  # padding in one example
    y = torch.randint(4, VOCAB, (B, TGT), generator=g)
    dec = torch.cat([torch.full((B, 1), 2), y[:, :-1]], 1)
    return (ids, mask, dec), y


def _model(name: str, decoder_mask: bool = False) -> Seq2Seq:
    cfg, cls = (getattr(T, n) for n in CLASSES[name])
    torch.manual_seed(0)
    return Seq2Seq(cls(cfg(**SIZES)).to(DT).eval(), decoder_mask=decoder_mask)


def _run(engine, model: Seq2Seq, seed: int = 1, on: str | None = "ghost") -> None:
    """``engine`` on a batch equals the float64 loop (and ran ``on`` that engine, no fallback)."""
    x, y = _batch(seed)
    groups = ParamGroups.flat(model)
    res = engine.compute(model, token_loss, x, y, clip_weights(0.05), groups)
    if on is not None:
        assert res.engine_info.get("fallback") is None, res.engine_info
        assert res.engine_info.get("engine") == on, res.engine_info
    assert_matches_the_loop(res, naive_per_example_grads(model, token_loss, x, y), groups, B)


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_encoder_decoder_runs_on_ghost(name):
    _run(AutoEngine(), _model(name))


def test_bart_with_a_decoder_mask_made_in_the_forward():
    """``decoder_attention_mask = ones_like(decoder_input_ids)``: a constant of the examples'
    shape read through the padding path (as the data's own mask would be)."""
    _run(AutoEngine(), _model("bart", decoder_mask=True), seed=2)


@pytest.mark.parametrize("name", ["bart", "marian"])
def test_engine_vmap_runs_them_too(name):
    """transformers reads ``attention_mask.all()`` into Python (to skip an all-ones mask), which
    vmap cannot evaluate: ``engine='vmap'`` failed on every encoder-decoder (auto's fallback
    already ran the data-independent path). The vmap engine now runs it, the mask applied."""
    from dpclip.engine import VmapEngine

    _run(VmapEngine(), _model(name), on=None)
