#!/usr/bin/env python3
"""LoRA adapters on a frozen Hugging Face causal language model, trained privately through
``make_private`` (engine ``auto``: ghost, with no per-example work for the frozen base).

Needs ``pip install transformers peft`` (optional extras). The base model is a small Llama built
from a config (nothing is downloaded; pass ``--layers/--hidden`` for other sizes); ``peft`` adds
rank-``r`` adapters to the attention projections and freezes every other parameter
(``requires_grad=False``). dpclip then:

* computes per-example norms and the clipped sum for the adapters only: the frozen layers are not
  hooked and get no per-example gradient, no norm and no noise (docs/engines.md, "Frozen
  parameters");
* runs the adapters' ``nn.Linear`` layers on the ghost rules, so the step costs about a non-private
  LoRA step plus the adapters' norms.

The model is called as transformers models are, ``model(**inputs)``, on a dict of per-example
tensors with ``position_ids`` spelled out and eager attention (not needed any more: the model's
own broadcast ``(1, T)`` positions are a batch-less call the ghost engine expands,
docs/engines.md). Data: a synthetic language whose
sequences count upwards modulo the vocabulary from a random start (a next-token task a small model
learns quickly); the loss is each sequence's mean next-token cross-entropy.
"""

import argparse
import json

import torch
import torch.nn.functional as F

from dpclip.training.private import make_private

try:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError as e:  # optional extras
    raise SystemExit(f"this example needs transformers and peft: pip install transformers peft "
                     f"({e})")


def model_inputs(input_ids):
    """The dict of per-example tensors the model is called with: ``model(**model_inputs(ids))``."""
    n, t = input_ids.shape
    return {"input_ids": input_ids, "position_ids": torch.arange(t).expand(n, t).contiguous()}


def loss_fn(outputs, ids):
    """Per-example mean next-token cross-entropy (reduction 'none', then a mean per sequence)."""
    logits, tgt = outputs.logits[:, :-1], ids[:, 1:]
    tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                          reduction="none")
    return tok.view(tgt.shape).mean(1)


def synthetic(n, length, vocab, seed):
    """Sequences ``s, s+1, s+2, ...`` modulo ``vocab`` from a random start ``s``."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    return (start + torch.arange(length)[None, :]) % vocab


def build(vocab, hidden, layers, heads, rank, seed):
    """The frozen base with LoRA adapters (the only trainable parameters)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=heads, max_position_embeddings=64,
                         attn_implementation="eager")
    base = LlamaForCausalLM(config)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                      target_modules=["q_proj", "v_proj"])
    return get_peft_model(base, lora)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--n", type=int, default=2000, help="number of training sequences")
    ap.add_argument("--length", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--rank", type=int, default=4, help="LoRA rank")
    ap.add_argument("--engine", default="auto", choices=["auto", "ghost", "vmap"])
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--epsilon", type=float, default=3.0)
    ap.add_argument("--delta", type=float, default=None, help="default: 1e-5 or below 1/N")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=128, help="expected (Poisson) batch size")
    ap.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    ap.add_argument("--seed", type=int, default=0, help="public: initialisation and data")
    args = ap.parse_args(argv)

    model = build(args.vocab, args.hidden, args.layers, args.heads, args.rank, args.seed)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    total = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"{n_train} trainable (LoRA) of {total} parameters in {len(trainable)} tensors")
    ids = synthetic(args.n, args.length, args.vocab, args.seed)
    test = synthetic(200, args.length, args.vocab, args.seed + 1)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    dp = make_private(model, optimizer, (model_inputs(ids), ids), loss_fn=loss_fn,
                      strategy="fixed", strategy_params={"clip_norm": args.clip},
                      epsilon=args.epsilon, delta=args.delta, epochs=args.epochs,
                      batch_size=args.batch_size, engine=args.engine)
    print(f"noise multiplier {dp.noise_multiplier:.3f}")
    for epoch in range(1, dp.epochs + 1):
        model.train()
        for xb, yb in dp.loader:
            dp.step(xb, yb)
        model.eval()
        with torch.no_grad():
            out = model(**model_inputs(test))
            acc = (out.logits[:, :-1].argmax(-1) == test[:, 1:]).float().mean().item()
            loss = loss_fn(out, test).mean().item()
        print(f"epoch {epoch}: test next-token accuracy {acc:.4f}, test loss {loss:.3f}, "
              f"epsilon {dp.epsilon():.3f}")
    print("summary:", json.dumps(dp.describe(), default=str))


if __name__ == "__main__":
    main()
