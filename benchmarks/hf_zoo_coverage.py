"""Coverage of the Hugging Face zoo under ``engine="auto"`` on the CPU: for tiny float64 configs of
~40 ``transformers`` model classes (text classification, causal LMs, encoder-decoders, vision), which
engine ``auto`` runs (ghost, or the whole-model vmap fallback and its reason, or a refusal), which
modules took ghost's per-layer path, and the largest deviation of the clipped sum from the float64
per-example loop (relative to the sum's largest entry).

    python benchmarks/hf_zoo_coverage.py [--models bert,t5,...]      # rows -> results, then table
    python benchmarks/hf_zoo_coverage.py --table

Inputs as a training loop gives them: ``input_ids`` with a padded 2-D ``attention_mask`` (text),
``decoder_input_ids`` (encoder-decoders), ``pixel_values`` (vision); batch 3, clip 0.3, the model in
eval mode (no dropout). Rows go to ``benchmarks/results/hf_zoo_coverage_cpu.json`` (torch and
transformers versions, date), the Markdown table beside it is generated from them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
OUT = ROOT / "results" / "hf_zoo_coverage_cpu.json"

import transformers as T  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from dpclip.engine import AutoEngine, ParamGroups, naive_per_example_grads  # noqa: E402
from tests.engine.helpers import DT, clip_weights, oracle_norms, oracle_sum  # noqa: E402

B, L, V = 3, 6, 50
S = dict(hidden_size=16, num_attention_heads=2, intermediate_size=32, num_hidden_layers=1)
MODELS = ["bert", "roberta", "distilbert", "albert", "electra", "deberta", "debertav2", "mpnet",
          "xlmr", "ernie", "megatron", "gpt2", "gptneo", "opt", "bloom", "llama", "mistral",
          "qwen2", "gemma", "phi", "falcon", "gptj", "gptneox", "t5", "t5enc", "bart", "mbart",
          "pegasus", "marian", "bartcls", "vit", "deit", "beit", "swin", "convnext", "resnet"]


def ce(o, y):
    return F.cross_entropy(o.logits if hasattr(o, "logits") else o, y, reduction="none")
def lm(o, y):
    lg, t = o.logits[:, :-1], y[:, 1:]
    return F.cross_entropy(lg.reshape(-1, lg.shape[-1]), t.reshape(-1), reduction="none").view(t.shape).mean(1)
def s2s(o, y):
    return F.cross_entropy(o.logits.reshape(-1, o.logits.shape[-1]), y.reshape(-1), reduction="none").view(y.shape).mean(1)
def ids(g, pad=True, eos=None):
    x = torch.randint(4, V, (B, L), generator=g)
    m = torch.ones_like(x)
    if pad: m[0, -2:] = 0; x[0, -2:] = 1
    if eos is not None:
        x[:, -1] = eos; 
        if pad: x[0, -3] = eos; m[0, -2:] = 1  # keep simple
    return x, m
def build(name, g):
    cls = lambda C, M, **kw: M(C(vocab_size=V, max_position_embeddings=16, num_labels=3, pad_token_id=1, **kw))
    if name in ("bert","roberta","distilbert","albert","electra","deberta","debertav2","mpnet","xlmr","ernie","megatron"):
        M = {"bert": (T.BertConfig, T.BertForSequenceClassification), "roberta": (T.RobertaConfig, T.RobertaForSequenceClassification),
             "distilbert": (T.DistilBertConfig, T.DistilBertForSequenceClassification), "albert": (T.AlbertConfig, T.AlbertForSequenceClassification),
             "electra": (T.ElectraConfig, T.ElectraForSequenceClassification), "deberta": (T.DebertaConfig, T.DebertaForSequenceClassification),
             "debertav2": (T.DebertaV2Config, T.DebertaV2ForSequenceClassification), "mpnet": (T.MPNetConfig, T.MPNetForSequenceClassification),
             "xlmr": (T.XLMRobertaConfig, T.XLMRobertaForSequenceClassification), "ernie": (T.ErnieConfig, T.ErnieForSequenceClassification),
             "megatron": (T.MegatronBertConfig, T.MegatronBertForSequenceClassification)}[name]
        kw = dict(S)
        if name == "distilbert": kw = dict(dim=16, n_heads=2, hidden_dim=32, n_layers=1)
        if name == "albert": kw["embedding_size"] = 8
        m = cls(*M, **kw)
        x, mask = ids(g)
        return m, {"input_ids": x, "attention_mask": mask}, torch.randint(0, 3, (B,), generator=g), ce
    lmcfg = {"gpt2": (T.GPT2Config, T.GPT2LMHeadModel, dict(n_positions=16, n_embd=16, n_layer=1, n_head=2)),
             "gptneo": (T.GPTNeoConfig, T.GPTNeoForCausalLM, dict(max_position_embeddings=16, hidden_size=16, num_layers=1, num_heads=2, attention_types=[[["global"],1]])),
             "opt": (T.OPTConfig, T.OPTForCausalLM, dict(max_position_embeddings=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, ffn_dim=32, word_embed_proj_dim=16)),
             "bloom": (T.BloomConfig, T.BloomForCausalLM, dict(hidden_size=16, n_layer=1, n_head=2)),
             "llama": (T.LlamaConfig, T.LlamaForCausalLM, dict(S, max_position_embeddings=16, num_key_value_heads=1)),
             "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(S, max_position_embeddings=16, num_key_value_heads=1)),
             "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(S, max_position_embeddings=16, num_key_value_heads=1)),
             "gemma": (T.GemmaConfig, T.GemmaForCausalLM, dict(S, max_position_embeddings=16, num_key_value_heads=1, head_dim=8)),
             "phi": (T.PhiConfig, T.PhiForCausalLM, dict(S, max_position_embeddings=16)),
             "falcon": (T.FalconConfig, T.FalconForCausalLM, dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2)),
             "gptj": (T.GPTJConfig, T.GPTJForCausalLM, dict(n_positions=16, n_embd=16, n_layer=1, n_head=2, rotary_dim=4)),
             "gptneox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, dict(S, max_position_embeddings=16)),
             }
    if name in lmcfg:
        C, M, kw = lmcfg[name]
        m = M(C(vocab_size=V, pad_token_id=1, **kw))
        x, mask = ids(g)
        return m, {"input_ids": x, "attention_mask": mask}, x, lm
    if name in ("t5", "bart", "mbart", "pegasus", "marian"):
        if name == "t5":
            m = T.T5ForConditionalGeneration(T.T5Config(vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2, pad_token_id=1, decoder_start_token_id=1))
        else:
            C, M = {"bart": (T.BartConfig, T.BartForConditionalGeneration), "mbart": (T.MBartConfig, T.MBartForConditionalGeneration),
                    "pegasus": (T.PegasusConfig, T.PegasusForConditionalGeneration), "marian": (T.MarianConfig, T.MarianMTModel)}[name]
            m = M(C(vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=16, pad_token_id=1, decoder_start_token_id=2, eos_token_id=2, bos_token_id=0))
        x, mask = ids(g)
        y = torch.randint(4, V, (B, 4), generator=g)
        dec = torch.cat([torch.full((B, 1), 2), y[:, :-1]], 1)
        return m, {"input_ids": x, "attention_mask": mask, "decoder_input_ids": dec}, y, s2s
    if name == "bartcls":
        m = T.BartForSequenceClassification(T.BartConfig(vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=16, num_labels=3, pad_token_id=1, eos_token_id=2))
        x = torch.randint(4, V, (B, L), generator=g); x[:, -1] = 2
        return m, {"input_ids": x, "attention_mask": torch.ones_like(x)}, torch.randint(0, 3, (B,), generator=g), ce
    if name == "t5enc":
        class W(nn.Module):
            def __init__(s):
                super().__init__(); s.e = T.T5EncoderModel(T.T5Config(vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)); s.h = nn.Linear(16, 3)
            def forward(s, input_ids, attention_mask): return s.h(s.e(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0])
        x, mask = ids(g)
        return W(), {"input_ids": x, "attention_mask": mask}, torch.randint(0, 3, (B,), generator=g), ce
    img = {"vit": (T.ViTConfig, T.ViTForImageClassification, dict(S, image_size=8, patch_size=4), 8),
           "deit": (T.DeiTConfig, T.DeiTForImageClassification, dict(S, image_size=8, patch_size=4), 8),
           "beit": (T.BeitConfig, T.BeitForImageClassification, dict(S, image_size=8, patch_size=4, use_relative_position_bias=True), 8),
           "swin": (T.SwinConfig, T.SwinForImageClassification, dict(image_size=16, patch_size=2, embed_dim=8, depths=[1,1], num_heads=[1,2], window_size=4), 16),
           "convnext": (T.ConvNextConfig, T.ConvNextForImageClassification, dict(hidden_sizes=[8,16], depths=[1,1], num_stages=2), 32),
           "resnet": (T.ResNetConfig, T.ResNetForImageClassification, dict(embedding_size=8, hidden_sizes=[8,16], depths=[1,1], layer_type="basic"), 32),
           "mobilevit": None, }
    if name in img:
        C, M, kw, sz = img[name]
        m = M(C(num_channels=3, num_labels=3, **kw))
        return m, {"pixel_values": torch.randn(B, 3, sz, sz, generator=g)}, torch.randint(0, 3, (B,), generator=g), ce
    raise KeyError(name)



class Kw(nn.Module):
    """The model called with its keyword inputs given positionally (the engines' batch: a tuple)."""

    def __init__(self, m: nn.Module, keys: list[str]) -> None:
        super().__init__()
        self.m = m
        self.keys = keys

    def forward(self, *a):
        return self.m(**dict(zip(self.keys, a)))


def survey(name: str) -> dict:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    m, x, y, loss = build(name, g)
    m = m.to(DT).eval()
    w = Kw(m, list(x))
    xs = tuple(v.to(DT) if v.is_floating_point() else v for v in x.values())
    row = {"model": name, "class": type(m).__name__}
    groups = ParamGroups.flat(w)
    try:
        res = AutoEngine().compute(w, loss, xs, y, clip_weights(0.3), groups)
    except Exception as exc:  # noqa: BLE001 - recorded: the model is refused under auto
        row.update(engine="refused", reason=str(exc)[:300])
        return row
    info = res.engine_info
    row.update(engine=info.get("engine"), reason=(info.get("fallback") or "")[:300],
               per_layer=list(info.get("per_layer") or ()))
    per_ex = naive_per_example_grads(w, loss, xs, y)
    ref = oracle_sum(per_ex, clip_weights(0.3)(oracle_norms(per_ex, groups, B)), groups, B)
    scale = max(float(ref[n].abs().max()) for n in ref)
    row["max_err"] = max(float((res.grads[n] - ref[n]).abs().max()) for n in ref) / scale
    return row


def table(rows: list[dict]) -> str:
    out = ["# Hugging Face zoo under `auto` on the CPU (generated by benchmarks/hf_zoo_coverage.py)",
           "", f"transformers {rows[0].get('transformers')}, torch {rows[0].get('torch')}, "
           f"{rows[0].get('date')}; tiny float64 configs, batch 3; *error*: the largest deviation of "
           "the clipped sum from the float64 per-example loop, relative to its largest entry.", "",
           "| model | class | engine | per-layer modules | error | why not ghost |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        pl = ", ".join(sorted({p.split(".")[-1] for p in r.get("per_layer", [])})) or "-"
        err = f"{r['max_err']:.1e}" if "max_err" in r else "-"
        why = r.get("reason", "").replace("|", "/").split(". ")[0][:160] or "-"
        out.append(f"| {r['model']} | {r['class']} | {r['engine']} | {pl} | {err} | {why} |")
    counts = {}
    for r in rows:
        counts[r["engine"]] = counts.get(r["engine"], 0) + 1
    out += ["", "Engines: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + "."]
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--table", action="store_true", help="only regenerate the Markdown table")
    args = ap.parse_args()
    if not args.table:
        warnings.filterwarnings("ignore")
        hf_logging.set_verbosity_error()
        torch.set_num_threads(1)
        old = {r["model"]: r for r in json.loads(OUT.read_text())} if OUT.exists() else {}
        for name in args.models.split(","):
            row = survey(name)
            row.update(torch=torch.__version__, transformers=T.__version__, device="cpu",
                       date=datetime.date.today().isoformat())
            old[name] = row
            print(f"{name:10s} {row['engine']:8s} {row.get('max_err', '-')} {row.get('reason', '')[:120]}",
                  flush=True)
        rows = [old[n] for n in MODELS if n in old] + [r for n, r in old.items() if n not in MODELS]
        OUT.write_text(json.dumps(rows, indent=1) + "\n")
    rows = json.loads(OUT.read_text())
    OUT.with_suffix(".md").write_text(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
