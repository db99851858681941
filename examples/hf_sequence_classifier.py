#!/usr/bin/env python3
"""A Hugging Face ``transformers`` sequence classifier, trained privately with adaptive (quantile)
clipping on the ghost engine. The model is built from a small config: nothing is downloaded.

Needs ``pip install transformers`` (an optional extra). The model is called as transformers models
are, ``model(**inputs)``, on a dict of per-example tensors; the loss reads ``outputs.logits``. The
dict spells out what earlier releases of the ghost engine needed, and still runs:

* ``attn_implementation="eager"``;
* ``attention_mask`` as a 4-D ``(B, 1, 1, T)`` additive mask;
* ``position_ids`` and ``token_type_ids`` of shape ``(B, T)``.

None of the three is needed any more: the ghost engine runs the model as the tokenizer gives the
batch (2-D mask, default attention, the model's own ``(1, T)`` positions), see docs/own_model.md,
"Hugging Face models on the ghost engine", and ``examples/hf_bert_tokenizer.py``.

Data: ``--data FILE.pt`` with ``(input_ids (N, T) int64, labels (N,) int64)`` (pad id 0), or a
synthetic two-class task (which half of the vocabulary most tokens come from).
"""

import argparse
import json

import torch
import torch.nn.functional as F

from dpclip.training.private import make_private

try:
    from transformers import BertConfig, BertForSequenceClassification
except ImportError as e:  # an optional extra
    raise SystemExit(f"this example needs transformers: pip install transformers ({e})")


def model_inputs(input_ids, pad_id=0):
    """The dict of per-example tensors the model is called with: ``model(**model_inputs(ids))``."""
    n, t = input_ids.shape
    keep = (input_ids != pad_id)[:, None, None, :]  # (N, 1, 1, T): each example's own padding
    mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    return {"input_ids": input_ids, "attention_mask": mask,
            "position_ids": torch.arange(t).expand(n, t).contiguous(),
            "token_type_ids": torch.zeros_like(input_ids)}


def loss_fn(outputs, labels):
    return F.cross_entropy(outputs.logits, labels, reduction="none")


def synthetic(n, length, vocab, seed):
    """Class k draws 80 % of its tokens from the k-th half of the vocabulary (ids 1..vocab-1),
    the rest uniformly; random lengths, padded with 0."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (n,), generator=g)
    half = (vocab - 1) // 2
    own = 1 + labels[:, None] * half + torch.randint(0, half, (n, length), generator=g)
    anywhere = torch.randint(1, vocab, (n, length), generator=g)
    ids = torch.where(torch.rand(n, length, generator=g) < 0.8, own, anywhere)
    lengths = torch.randint(length // 2, length + 1, (n, 1), generator=g)
    ids[torch.arange(length)[None, :] >= lengths] = 0
    return ids, labels


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--data", default=None, help=".pt file of (input_ids, labels); else synthetic")
    ap.add_argument("--num-classes", type=int, default=2)
    ap.add_argument("--n", type=int, default=2000, help="synthetic: number of sequences")
    ap.add_argument("--length", type=int, default=16, help="synthetic: sequence length")
    ap.add_argument("--vocab", type=int, default=100)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--target-quantile", type=float, default=0.5, help="adaptive clipping")
    ap.add_argument("--engine", default="ghost", choices=["ghost", "auto", "vmap"])
    ap.add_argument("--epsilon", type=float, default=3.0)
    ap.add_argument("--delta", type=float, default=None, help="default: 1e-5 or below 1/N")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=128, help="expected (Poisson) batch size")
    ap.add_argument("--lr", type=float, default=5e-3, help="Adam learning rate")
    ap.add_argument("--seed", type=int, default=0, help="public: initialisation and test split")
    args = ap.parse_args(argv)

    ids, labels = torch.load(args.data) if args.data else synthetic(
        args.n, args.length, args.vocab, args.seed)
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(args.seed))
    n_test = len(labels) // 5
    test, train = perm[:n_test], perm[n_test:]

    torch.manual_seed(args.seed)
    config = BertConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                        num_hidden_layers=args.layers, num_attention_heads=args.heads,
                        intermediate_size=2 * args.hidden, max_position_embeddings=ids.shape[1],
                        num_labels=args.num_classes, pad_token_id=0, attn_implementation="eager")
    model = BertForSequenceClassification(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    inputs = model_inputs(ids)
    train_inputs = {k: v[train] for k, v in inputs.items()}
    test_inputs = {k: v[test] for k, v in inputs.items()}
    dp = make_private(model, optimizer, (train_inputs, labels[train]), loss_fn=loss_fn,
                      strategy="quantile",
                      strategy_params={"target_quantile": args.target_quantile},
                      epsilon=args.epsilon, delta=args.delta, epochs=args.epochs,
                      batch_size=args.batch_size, engine=args.engine)
    print(f"{len(train)} sequences; noise multiplier {dp.noise_multiplier:.3f}")
    for epoch in range(1, dp.epochs + 1):
        model.train()
        for xb, yb in dp.loader:
            dp.step(xb, yb)
        model.eval()
        with torch.no_grad():
            logits = model(**test_inputs).logits
            acc = (logits.argmax(1) == labels[test]).float().mean().item()
        print(f"epoch {epoch}: test accuracy {acc:.4f}, epsilon {dp.epsilon():.3f}, "
              f"clip threshold {dp.clip_threshold:.3g} (private: noised quantile)")
    print("summary:", json.dumps(dp.describe(), default=str))


if __name__ == "__main__":
    main()
