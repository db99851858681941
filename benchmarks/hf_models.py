"""DP step time of Hugging Face models: non-private, dpclip (auto, ghost), Opacus (ghost, hooks).

Four models built from ``transformers`` config classes (random initialisation, nothing downloaded):
BERT sequence classification, GPT-2 language model (``wte`` tied to ``lm_head``), a Llama causal LM
and ViT image classification; with ``--models t5,bart`` also T5 and BART for conditional generation
(``input_ids``, ``attention_mask``, ``decoder_input_ids``; the mean token cross-entropy per
example), with ``--models gemma,falcon,deberta,convnext`` the zoo classes the compiled path took
in session 26 (Gemma's ``1 + w`` norm, Falcon's ``x @ W.T``, DeBERTa's split attention biases,
ConvNeXt's channels-first LayerNorm), and ``--methods ...,dpclip-vmap`` the whole-model vmap engine beside them. Every (model, method) pair gets its own copy of the model and
optimiser (SGD, lr 1e-4); dpclip runs ``dp_step`` (``FixedClip(1)``, noise multiplier 1, flat
clipping; the step of ``make_private``/``dpclip bench`` without the sampler) on a fixed batch of
``B`` examples, Opacus 1.6 its ``GradSampleModule`` (hooks) or
``GradSampleModuleFastGradientClipping`` (ghost) with ``DPOptimizer`` (noise 1, clip 1). The methods
of one model are timed INTERLEAVED, one step each per round, after warm-up steps, so that a shared
machine's load hits them alike; ratios to the non-private step are taken per round, then the
median. On CUDA each step is synchronised and the peak allocated memory of each method's steps is
recorded (on the CPU there is no per-method allocator statistic: ``peak_mem_mb`` is null).

Sizes: ``--size small`` (CPU default: hidden 64, 2 layers, sequences of 32, images 32x32) or
``--size base`` (CUDA default: ~100M-parameter models, sequences of 128, images 224x224, as the GPU
kit's table in issue 31). Text inputs spell out ``position_ids`` (and BERT's ``token_type_ids``)
with a batch dimension, as the GPU kit does; BERT also gets the tokenizer's all-ones
``attention_mask`` under transformers >= 5.25 (without one, 5.25 checks the position ids for
packed sequences in Python: a read of batch values that ghost refuses) and none before (5.17 reads
``attention_mask.all()`` in Python instead). Every model uses eager attention by default
(``--attn``). All methods get the same model and inputs, so the comparison is like for like.

    .venv/bin/python benchmarks/hf_models.py [--size small] [--rounds 10] [--models bert,gpt2]
    .venv/bin/python benchmarks/hf_models.py --table   # regenerate the .md from the .json

writes benchmarks/results/hf_models_<device>.json (one row per model x method: device, torch
version, ms per step, ratio to non-private, the engine that ran, the modules on the per-layer
path, any fallback or error) and the Markdown table beside it.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

OUT = Path(__file__).parent / "results"
METHODS = ("nonprivate", "dpclip-auto", "dpclip-ghost", "dpclip-compiled", "opacus-ghost",
           "opacus-hooks")


def sizes(size: str) -> dict[str, Any]:
    if size == "small":
        return dict(hidden=64, inter=128, layers=2, heads=2, seq=32, image=32, patch=8,
                    batch={"bert": 16, "gpt2": 16, "llama": 16, "vit": 16, "t5": 16, "bart": 16,
                           "gemma": 16, "falcon": 16, "deberta": 16, "convnext": 16},
                    vocab={"bert": 1000, "gpt2": 1000, "llama": 1000, "t5": 1000, "bart": 1000,
                           "gemma": 1000, "falcon": 1000, "deberta": 1000})
    return dict(hidden=768, inter=3072, layers=12, heads=12, seq=128, image=224, patch=16,
                batch={"bert": 32, "gpt2": 16, "llama": 16, "vit": 32, "t5": 16, "bart": 16,
                       "gemma": 16, "falcon": 16, "deberta": 32, "convnext": 32},
                vocab={"bert": 30522, "gpt2": 50257, "llama": 32000, "t5": 32128,
                       "bart": 50265, "gemma": 32000, "falcon": 65024, "deberta": 50265})


class Pixels(nn.Module):
    """ViT called positionally (``model(x)`` for ``model(pixel_values=x)``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, x):
        return self.m(pixel_values=x)


def cls_loss(out, y):
    return F.cross_entropy(out.logits, y, reduction="none")


def lm_loss(out, y):
    logits, tgt = out.logits[:, :-1], y[:, 1:]
    tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                          reduction="none")
    return tok.view(tgt.shape).mean(1)


def seq2seq_loss(out, y):
    """Per-example mean token cross-entropy of an encoder-decoder's logits against ``y``."""
    logits = out.logits
    tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
    return tok.view(y.shape).mean(1)


def _transformers_at_least(major: int, minor: int) -> bool:
    import transformers

    parts = transformers.__version__.split(".")
    return (int(parts[0]), int(parts[1])) >= (major, minor)


def build(name: str, s: dict[str, Any], attn: str):
    """(model, inputs, targets, loss_fn) of one benchmark model, batch ``s['batch'][name]``."""
    import transformers as T

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    b = s["batch"][name]
    common = dict(hidden_size=s["hidden"], intermediate_size=s["inter"],
                  num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                  attn_implementation=attn)
    if name == "vit":
        model = T.ViTForImageClassification(T.ViTConfig(
            image_size=s["image"], patch_size=s["patch"], num_labels=10, **common))
        x = torch.randn(b, 3, s["image"], s["image"], generator=g)
        return Pixels(model), x, torch.randint(0, 10, (b,), generator=g), cls_loss
    if name == "convnext":  # (4 stages, widths hidden/8 .. hidden/2 ... hidden)
        h = s["hidden"]
        model = T.ConvNextForImageClassification(T.ConvNextConfig(
            image_size=s["image"], num_labels=10, depths=[1, 1, s["layers"], 1],
            hidden_sizes=[h // 8 or 1, h // 4 or 1, h // 2 or 1, h]))
        x = torch.randn(b, 3, s["image"], s["image"], generator=g)
        return Pixels(model), x, torch.randint(0, 10, (b,), generator=g), cls_loss
    vocab, seq = s["vocab"][name], s["seq"]
    ids = torch.randint(0, vocab, (b, seq), generator=g)
    if name in ("t5", "bart"):  # as a training loop calls them: ids, mask, decoder ids
        y = torch.randint(3, vocab, (b, seq // 2), generator=g)
        dec = torch.cat([torch.full((b, 1), 2), y[:, :-1]], 1)
        x = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "decoder_input_ids": dec}
        if name == "t5":
            model = T.T5ForConditionalGeneration(T.T5Config(
                vocab_size=vocab, d_model=s["hidden"], d_kv=s["hidden"] // s["heads"],
                d_ff=s["inter"], num_layers=s["layers"], num_heads=s["heads"],
                decoder_start_token_id=2, attn_implementation=attn))
        else:
            model = T.BartForConditionalGeneration(T.BartConfig(
                vocab_size=vocab, d_model=s["hidden"], encoder_layers=s["layers"],
                decoder_layers=s["layers"], encoder_attention_heads=s["heads"],
                decoder_attention_heads=s["heads"], encoder_ffn_dim=s["inter"],
                decoder_ffn_dim=s["inter"], max_position_embeddings=max(1024, seq),
                attn_implementation=attn))
        return model, x, y, seq2seq_loss
    x = {"input_ids": ids, "position_ids": torch.arange(seq).expand(b, seq).contiguous()}
    if name == "bert":
        model = T.BertForSequenceClassification(T.BertConfig(
            vocab_size=vocab, max_position_embeddings=max(512, seq), num_labels=2, **common))
        x["token_type_ids"] = torch.zeros_like(ids)
        if _transformers_at_least(5, 25):
            x["attention_mask"] = torch.ones_like(ids)
        return model, x, torch.randint(0, 2, (b,), generator=g), cls_loss
    if name == "gpt2":
        model = T.GPT2LMHeadModel(T.GPT2Config(
            vocab_size=vocab, n_positions=max(1024, seq), n_embd=s["hidden"],
            n_layer=s["layers"], n_head=s["heads"], bos_token_id=0, eos_token_id=0,
            attn_implementation=attn))
        return model, x, ids, lm_loss
    if name == "llama":
        model = T.LlamaForCausalLM(T.LlamaConfig(
            vocab_size=vocab, max_position_embeddings=max(2048, seq),
            num_key_value_heads=s["heads"], **common))
        return model, x, ids, lm_loss
    if name == "gemma":  # (RMSNorm x * (1 + w.float()), scaled embedding tied to the head)
        model = T.GemmaForCausalLM(T.GemmaConfig(
            vocab_size=vocab, max_position_embeddings=max(2048, seq),
            num_key_value_heads=s["heads"], head_dim=s["hidden"] // s["heads"], **common))
        return model, x, ids, lm_loss
    if name == "falcon":  # (FalconLinear: x @ W.T; the parallel block's in-place residual)
        model = T.FalconForCausalLM(T.FalconConfig(
            vocab_size=vocab, hidden_size=s["hidden"], num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"], ffn_hidden_size=s["inter"],
            attn_implementation=attn))
        return model, x, ids, lm_loss
    if name == "deberta":  # (attention biases q_bias / v_bias split into heads)
        model = T.DebertaForSequenceClassification(T.DebertaConfig(
            vocab_size=vocab, max_position_embeddings=max(512, seq), num_labels=2,
            **{k: v for k, v in common.items() if k != "attn_implementation"}))
        x = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        return model, x, torch.randint(0, 2, (b,), generator=g), cls_loss
    raise KeyError(name)


def _to(x: Any, dev: torch.device) -> Any:
    return {k: v.to(dev) for k, v in x.items()} if isinstance(x, dict) else x.to(dev)


def _call(model: nn.Module, x: Any) -> Any:
    return model(**x) if isinstance(x, dict) else model(x)


def stepper(method: str, base: nn.Module, x: Any, y: torch.Tensor, loss_fn: Callable,
            dev: torch.device) -> tuple[Callable[[], None], Callable[[], dict[str, Any]]]:
    """``(step, info)``: one training step of ``method`` on its own copy of the model."""
    model = copy.deepcopy(base).to(dev).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x, y = _to(x, dev), y.to(dev)
    batch = y.shape[0]
    if method == "nonprivate":
        def step() -> None:
            opt.zero_grad(set_to_none=True)
            loss_fn(_call(model, x), y).mean().backward()
            opt.step()
        return step, dict
    if method.startswith("dpclip-"):  # as `dpclip bench` does: dp_step on the fixed batch
        from dpclip.clipping import FixedClip, StepContext
        from dpclip.engine import ParamGroups, get_engine
        from dpclip.noise import make_generator
        from dpclip.training.sampling import PoissonSampler
        from dpclip.training.step import dp_step

        engine = get_engine(method.split("-", 1)[1])
        strategy, sampler = FixedClip(1.0), PoissonSampler(60_000, float(batch))
        groups = ParamGroups.flat(model)
        gen = make_generator(None, device=dev)  # (the noise where the gradient is)
        ctx = StepContext.at(0, steps_per_epoch=sampler.steps_per_epoch, total_steps=1,
                             expected_batch_size=float(batch), base_noise_multiplier=1.0)
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        last: dict[str, Any] = {}

        def step() -> None:
            out = dp_step(model, x, y, loss_fn=loss_fn, strategy=strategy, state={},
                          engine=engine, groups=groups, sampler=sampler,
                          base_noise_multiplier=1.0, ctx=ctx, generator=gen)
            for n, p in params:
                p.grad = out.grads[n]
            opt.step()
            opt.zero_grad(set_to_none=True)
            last.update(out.engine_info or {})

        def info() -> dict[str, Any]:
            return {"engine": last.get("engine"), "fallback": last.get("fallback"),
                    "per_layer": list(last.get("per_layer") or ()) or None,
                    "program": last.get("program")}
        return step, info
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    if method == "opacus-hooks":
        gsm = GradSampleModule(model)
        dpo = DPOptimizer(opt, noise_multiplier=1.0, max_grad_norm=1.0,
                          expected_batch_size=batch)

        def step() -> None:
            dpo.zero_grad(set_to_none=True)
            loss_fn(_call(gsm, x), y).mean().backward()
            dpo.step()
        return step, dict
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    gsm = GradSampleModuleFastGradientClipping(model, max_grad_norm=1.0, use_ghost_clipping=True)
    dpo = DPOptimizerFastGradientClipping(opt, noise_multiplier=1.0, max_grad_norm=1.0,
                                          expected_batch_size=batch)

    class PerExample(nn.Module):
        reduction = "mean"

        def forward(self, out, target):
            return loss_fn(out, target)

    crit = DPLossFastGradientClipping(gsm, dpo, PerExample(), loss_reduction="mean")

    def step() -> None:
        dpo.zero_grad(set_to_none=True)
        crit(_call(gsm, x), y).backward()
        dpo.step()
    return step, dict


def measure(name: str, s: dict[str, Any], dev: torch.device, rounds: int, warm: int,
            attn: str, methods: tuple[str, ...] = METHODS) -> list[dict[str, Any]]:
    base, x, y, loss_fn = build(name, s, attn)
    nparam = sum(p.numel() for p in base.parameters())
    common = {"model": name, "params": nparam, "batch_size": y.shape[0],
              "seq": None if name == "vit" else s["seq"], "device": _device_name(dev),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "attn": attn}
    steps, infos, errors = {}, {}, {}
    for m in methods:
        try:
            step, info = stepper(m, base, x, y, loss_fn, dev)
            for _ in range(warm):
                step()
            _sync(dev)
            steps[m], infos[m] = step, info
        except Exception as exc:  # noqa: BLE001 - a method that cannot run this model: a row
            errors[m] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}" if str(exc) \
                else type(exc).__name__
            traceback.print_exc(limit=2)
    times: dict[str, list[float]] = {m: [] for m in steps}
    peak: dict[str, float] = {m: 0.0 for m in steps}
    extra: dict[str, float] = {m: 0.0 for m in steps}
    for _ in range(rounds):
        for m, step in steps.items():
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            t = time.perf_counter()
            step()
            _sync(dev)
            times[m].append(1000 * (time.perf_counter() - t))
            if dev.type == "cuda":
                top = torch.cuda.max_memory_allocated()
                peak[m] = max(peak[m], top / 2 ** 20)
                extra[m] = max(extra[m], (top - before) / 2 ** 20)
    rows = []
    for m in methods:
        row = dict(common, method=m)
        if m in errors:
            row["error"] = errors[m]
            rows.append(row)
            continue
        ts = times[m]
        ratios = [t / b for t, b in zip(ts, times.get("nonprivate", ts))] \
            if "nonprivate" in times else None
        row.update(ms_per_step=statistics.median(ts), ms_rounds=ts,
                   ratio_to_nonprivate=statistics.median(ratios) if ratios else None,
                   peak_mem_mb=peak[m] if dev.type == "cuda" else None, rounds=rounds,
                   **infos[m]())
        rows.append(row)
    if dev.type == "cuda" and "nonprivate" in peak:
        # every method's model copy is resident during every step, so the raw peak mostly counts
        # the other copies: the figure to compare is the method's own peak, i.e. its model's
        # parameters plus what its step allocates on top of what was allocated before it
        # (what each method would peak at alone; SGD without momentum keeps no state)
        own_base = sum(p.numel() * p.element_size() for p in base.parameters()) / 2 ** 20
        for r in rows:
            m = r["method"]
            if m in extra:
                r["step_extra_mb"] = extra[m]
                r["own_peak_mb"] = own_base + extra[m]
                r["mem_ratio_to_nonprivate"] = (own_base + extra[m]) / (own_base + extra["nonprivate"])
    return rows


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


def table(rows: list[dict[str, Any]], title: str) -> str:
    out = [f"# {title} (generated from the .json by benchmarks/hf_models.py)", "",
           "| model | params | batch | device | torch | method | ms/step (median) | ratio to "
           "non-private (median of rounds) | peak mem MB (own: model + step; x non-private) | "
           "engine | per-layer modules | fallback / error | run |", "|" + "---|" * 13]
    for r in rows:
        def f(v, fmt="{:.2f}"):
            return "" if v is None else fmt.format(v)

        def mem(r):
            if r.get("own_peak_mb") is not None:
                return f"{r['own_peak_mb']:.0f} (x{r['mem_ratio_to_nonprivate']:.2f})"
            return f(r.get("peak_mem_mb"), "{:.0f}")
        per = r.get("per_layer")
        per_s = f"{len(per)} ({', '.join(sorted({p.split('.')[-1] for p in per}))})" \
            if per else ""
        note = r.get("error") or r.get("fallback") or ""
        out.append(f"| {r['model']} | {r['params']:,} | {r['batch_size']} | {r['device']} | "
                   f"{r['torch']} | {r['method']} | {f(r.get('ms_per_step'))} | "
                   f"{f(r.get('ratio_to_nonprivate'))} | {mem(r)} | "
                   f"{r.get('engine') or ''}{' (compiled)' if r.get('program') else ''} | "
                   f"{per_s} | {str(note)[:160].replace('|', '/')} | "
                   f"{r.get('run', '')} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", choices=["small", "base"], default=None,
                    help="default: small on the CPU, base on CUDA")
    ap.add_argument("--models", default="bert,gpt2,llama,vit",
                    help="comma-separated: bert, gpt2, llama, vit, t5, bart, gemma, falcon, "
                         "deberta, convnext")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help="comma-separated; also dpclip-vmap (whole-model vmap: what auto ran "
                         "before a model's layers had ghost rules)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--attn", default="eager", help="attn_implementation of every model (every "
                    "method gets the same model; 'sdpa' once the separability check knows it)")
    ap.add_argument("--out", default=None, help="JSON path (default results/hf_models_<dev>.json)")
    ap.add_argument("--table", action="store_true", help="only regenerate the .md from the .json")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    path = Path(args.out) if args.out else OUT / f"hf_models_{dev.type}.json"
    title = f"Hugging Face models, DP step time ({dev.type})"
    if args.table:
        path.with_suffix(".md").write_text(table(json.loads(path.read_text()), title))
        return
    size = args.size or ("base" if dev.type == "cuda" else "small")
    attn = args.attn
    s = sizes(size)
    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        got = measure(name, s, dev, args.rounds, args.warm, attn,
                      tuple(args.methods.split(",")))
        for r in got:
            r["size"] = size
        rows.extend(got)
        path.write_text(json.dumps(rows, indent=1) + "\n")
        for r in got:
            print(json.dumps({k: v for k, v in r.items() if k != "ms_rounds"})[:400],
                  flush=True)
    md = table(rows, title)
    path.with_suffix(".md").write_text(md)
    sys.stdout.write(md)


if __name__ == "__main__":
    main()
