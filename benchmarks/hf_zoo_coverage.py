"""Coverage of the Hugging Face zoo under ``engine="auto"`` on the CPU: for tiny float64 configs of
~40 ``transformers`` model classes (text classification, causal LMs, encoder-decoders, vision), which
engine ``auto`` runs (ghost, or the whole-model vmap fallback and its reason, or a refusal), which
modules took ghost's per-layer path, and the largest deviation of the clipped sum from the float64
per-example loop (relative to the sum's largest entry).

    python benchmarks/hf_zoo_coverage.py [--models bert,t5,...]      # rows -> results, then table
    python benchmarks/hf_zoo_coverage.py --table
    python benchmarks/hf_zoo_coverage.py --engine compiled   # the explicit compiled engine

With ``--engine compiled`` (rows in ``hf_zoo_coverage_compiled_cpu.json``) each model takes two
steps: the first runs the traced path for its checks (the graph's adoption) and then the compiled
graph (since session 24 its sum is the graph's), the second the compiled graph only; the row says
whether the graph ran (``compiled``) or why the engine refused, and the second step's deviation
from the loop (rows taken before session 24: the first step's sum was the traced pass's).

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


def ce(out, y):
    """Per-example cross-entropy of classification logits."""
    return F.cross_entropy(out.logits if hasattr(out, "logits") else out, y, reduction="none")


def lm(out, y):
    """Per-example mean next-token cross-entropy of a causal LM."""
    logits, tgt = out.logits[:, :-1], y[:, 1:]
    tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none")
    return tok.view(tgt.shape).mean(1)


def s2s(out, y):
    """Per-example mean token cross-entropy of an encoder-decoder against ``y``."""
    logits = out.logits
    tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
    return tok.view(y.shape).mean(1)


def ids(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``: example 0 padded (id 1) in its last two positions."""
    x = torch.randint(4, V, (B, L), generator=g)
    mask = torch.ones_like(x)
    mask[0, -2:], x[0, -2:] = 0, 1
    return x, mask


#: text classification: (config, model class, config arguments besides vocabulary and labels)
CLASSIFIERS = {
    "bert": ("BertConfig", "BertForSequenceClassification", S),
    "roberta": ("RobertaConfig", "RobertaForSequenceClassification", S),
    "distilbert": ("DistilBertConfig", "DistilBertForSequenceClassification",
                   dict(dim=16, n_heads=2, hidden_dim=32, n_layers=1)),
    "albert": ("AlbertConfig", "AlbertForSequenceClassification", dict(S, embedding_size=8)),
    "electra": ("ElectraConfig", "ElectraForSequenceClassification", S),
    "deberta": ("DebertaConfig", "DebertaForSequenceClassification", S),
    "debertav2": ("DebertaV2Config", "DebertaV2ForSequenceClassification", S),
    "mpnet": ("MPNetConfig", "MPNetForSequenceClassification", S),
    "xlmr": ("XLMRobertaConfig", "XLMRobertaForSequenceClassification", S),
    "ernie": ("ErnieConfig", "ErnieForSequenceClassification", S),
    "megatron": ("MegatronBertConfig", "MegatronBertForSequenceClassification", S),
}
#: causal language models
CAUSAL = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_positions=16, n_embd=16, n_layer=1, n_head=2)),
    "gptneo": ("GPTNeoConfig", "GPTNeoForCausalLM",
               dict(max_position_embeddings=16, hidden_size=16, num_layers=1, num_heads=2,
                    attention_types=[[["global"], 1]])),
    "opt": ("OPTConfig", "OPTForCausalLM",
            dict(max_position_embeddings=16, hidden_size=16, num_hidden_layers=1,
                 num_attention_heads=2, ffn_dim=32, word_embed_proj_dim=16)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(hidden_size=16, n_layer=1, n_head=2)),
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(S, max_position_embeddings=16, num_key_value_heads=1)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(S, max_position_embeddings=16, num_key_value_heads=1)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(S, max_position_embeddings=16, num_key_value_heads=1)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM",
              dict(S, max_position_embeddings=16, num_key_value_heads=1, head_dim=8)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(S, max_position_embeddings=16)),
    "falcon": ("FalconConfig", "FalconForCausalLM",
               dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM",
             dict(n_positions=16, n_embd=16, n_layer=1, n_head=2, rotary_dim=4)),
    "gptneox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(S, max_position_embeddings=16)),
}
#: encoder-decoders of the BART family (the same sizes for each)
SEQ2SEQ = {"bart": ("BartConfig", "BartForConditionalGeneration"),
           "mbart": ("MBartConfig", "MBartForConditionalGeneration"),
           "pegasus": ("PegasusConfig", "PegasusForConditionalGeneration"),
           "marian": ("MarianConfig", "MarianMTModel")}
BART_SIZES = dict(vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1,
                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                  decoder_ffn_dim=32, max_position_embeddings=16, pad_token_id=1)
T5_SIZES = dict(vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
#: vision: (config, model class, config arguments, image side)
VISION = {
    "vit": ("ViTConfig", "ViTForImageClassification", dict(S, image_size=8, patch_size=4), 8),
    "deit": ("DeiTConfig", "DeiTForImageClassification", dict(S, image_size=8, patch_size=4), 8),
    "beit": ("BeitConfig", "BeitForImageClassification",
             dict(S, image_size=8, patch_size=4, use_relative_position_bias=True), 8),
    "swin": ("SwinConfig", "SwinForImageClassification",
             dict(image_size=16, patch_size=2, embed_dim=8, depths=[1, 1], num_heads=[1, 2],
                  window_size=4), 16),
    "convnext": ("ConvNextConfig", "ConvNextForImageClassification",
                 dict(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2), 32),
    "resnet": ("ResNetConfig", "ResNetForImageClassification",
               dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic"),
               32),
}


class T5Classifier(nn.Module):
    """A T5 encoder with a linear head on its first position."""

    def __init__(self) -> None:
        super().__init__()
        self.e = T.T5EncoderModel(T.T5Config(**T5_SIZES))
        self.h = nn.Linear(16, 3)

    def forward(self, input_ids, attention_mask):
        out = self.e(input_ids=input_ids, attention_mask=attention_mask)
        return self.h(out.last_hidden_state[:, 0])


def build(name: str, g: torch.Generator):
    """(model, keyword inputs, targets, per-example loss) of one zoo entry."""
    labels = torch.randint(0, 3, (B,), generator=g)
    if name in CLASSIFIERS:
        cfg, cls, kw = CLASSIFIERS[name]
        model = getattr(T, cls)(getattr(T, cfg)(vocab_size=V, max_position_embeddings=16,
                                                num_labels=3, pad_token_id=1, **kw))
        x, mask = ids(g)
        return model, {"input_ids": x, "attention_mask": mask}, labels, ce
    if name in CAUSAL:
        cfg, cls, kw = CAUSAL[name]
        model = getattr(T, cls)(getattr(T, cfg)(vocab_size=V, pad_token_id=1, **kw))
        x, mask = ids(g)
        return model, {"input_ids": x, "attention_mask": mask}, x, lm
    if name in SEQ2SEQ or name == "t5":
        if name == "t5":
            model = T.T5ForConditionalGeneration(T.T5Config(
                num_decoder_layers=1, pad_token_id=1, decoder_start_token_id=1, **T5_SIZES))
        else:
            cfg, cls = SEQ2SEQ[name]
            model = getattr(T, cls)(getattr(T, cfg)(
                decoder_start_token_id=2, eos_token_id=2, bos_token_id=0, **BART_SIZES))
        x, mask = ids(g)
        y = torch.randint(4, V, (B, 4), generator=g)
        dec = torch.cat([torch.full((B, 1), 2), y[:, :-1]], 1)  # (teacher forcing)
        return model, {"input_ids": x, "attention_mask": mask, "decoder_input_ids": dec}, y, s2s
    if name == "bartcls":  # (every example ends with the eos token, as the class requires)
        model = T.BartForSequenceClassification(T.BartConfig(num_labels=3, eos_token_id=2,
                                                             **BART_SIZES))
        x = torch.randint(4, V, (B, L), generator=g)
        x[:, -1] = 2
        return model, {"input_ids": x, "attention_mask": torch.ones_like(x)}, labels, ce
    if name == "t5enc":
        x, mask = ids(g)
        return T5Classifier(), {"input_ids": x, "attention_mask": mask}, labels, ce
    if name in VISION:
        cfg, cls, kw, side = VISION[name]
        model = getattr(T, cls)(getattr(T, cfg)(num_channels=3, num_labels=3, **kw))
        return model, {"pixel_values": torch.randn(B, 3, side, side, generator=g)}, labels, ce
    raise KeyError(name)


class Kw(nn.Module):
    """The model called with its keyword inputs given positionally (the engines' batch: a tuple)."""

    def __init__(self, m: nn.Module, keys: list[str]) -> None:
        super().__init__()
        self.m = m
        self.keys = keys

    def forward(self, *a):
        return self.m(**dict(zip(self.keys, a)))


def survey_compiled(name: str) -> dict:
    """Two steps on ``engine="compiled"``: the adoption (traced) and a graph step."""
    from dpclip.engine import CompiledEngine
    from dpclip.engine import compiled as cm

    w, xs, y, loss, row, groups = _setup(name)
    real, ran = cm.Plan.run, [0]

    def counted(self, *a, **k):
        ran[0] += 1
        return real(self, *a, **k)

    cm.Plan.run = counted
    try:
        for _ in range(2):
            res = CompiledEngine().compute(w, loss, xs, y, clip_weights(0.3), groups)
    except Exception as exc:  # noqa: BLE001 - recorded: refused
        row.update(engine="refused", reason=str(exc)[:300])
        return row
    finally:
        cm.Plan.run = real
    row.update(engine="compiled" if ran[0] else "traced", reason="", per_layer=[])
    per_ex = naive_per_example_grads(w, loss, xs, y)
    ref = oracle_sum(per_ex, clip_weights(0.3)(oracle_norms(per_ex, groups, B)), groups, B)
    scale = max(float(ref[n].abs().max()) for n in ref)
    row["max_err"] = max(float((res.grads[n] - ref[n]).abs().max()) for n in ref) / scale
    return row


def _setup(name: str) -> tuple:
    """``(model called positionally, inputs, labels, loss, row, flat groups)`` of one model."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    m, x, y, loss = build(name, g)
    m = m.to(DT).eval()
    xs = tuple(v.to(DT) if v.is_floating_point() else v for v in x.values())
    w = Kw(m, list(x))
    return w, xs, y, loss, {"model": name, "class": type(m).__name__}, ParamGroups.flat(w)


def survey(name: str) -> dict:
    w, xs, y, loss, row, groups = _setup(name)
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
    which = "`compiled`" if "compiled" in OUT.name else "`auto`"
    out = [f"# Hugging Face zoo under {which} on the CPU (generated by "
           "benchmarks/hf_zoo_coverage.py)",
           "", f"transformers {rows[0].get('transformers')}, torch {rows[0].get('torch')}, "
           f"{rows[0].get('date')}; tiny float64 configs, batch 3; *error*: the largest deviation of "
           "the clipped sum from the float64 per-example loop, relative to its largest entry.", "",
           "| model | class | engine | per-layer modules | error | why not "
           + ("compiled |" if "compiled" in OUT.name else "ghost |"),
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
    ap.add_argument("--engine", choices=["auto", "compiled"], default="auto",
                    help="auto (default) or the explicit compiled engine (its own result files)")
    args = ap.parse_args()
    global OUT
    if args.engine == "compiled":
        OUT = OUT.with_name("hf_zoo_coverage_compiled_cpu.json")
    if not args.table:
        warnings.filterwarnings("ignore")
        hf_logging.set_verbosity_error()
        torch.set_num_threads(1)
        old = {r["model"]: r for r in json.loads(OUT.read_text())} if OUT.exists() else {}
        for name in args.models.split(","):
            row = survey_compiled(name) if args.engine == "compiled" else survey(name)
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
