#!/usr/bin/env python3
"""A Hugging Face BERT classifier called the ordinary way: ``model(**tokenizer(texts, padding=True,
return_tensors="pt"))``, trained privately with ``engine="auto"``.

Nothing is prepared for dpclip: the batch is what the tokenizer gives (``input_ids``,
``token_type_ids`` and the 2-D ``attention_mask``), the model keeps its default attention
implementation, and the loss reads ``outputs.logits``. ``engine="auto"`` runs the ghost engine
where it proves that every example's gradient depends on that example alone, and says in one line
(an ``EngineFallbackWarning``) which layers it could not prove when it falls back to per-example
gradients (docs/own_model.md).

Needs ``pip install transformers``. The model is built from a small config and the tokenizer from
a small word-piece vocabulary written here: nothing is downloaded. Data: a synthetic two-class
task of short sentences (positive words vs negative words), or ``--texts FILE`` with one
``label<TAB>sentence`` per line.
"""

import argparse
import json
import random
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import dpclip

try:
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast
except ImportError as e:  # an optional extra
    raise SystemExit(f"this example needs transformers: pip install transformers ({e})")

POSITIVE = ["good", "great", "fine", "nice", "happy", "bright", "warm", "kind"]
NEGATIVE = ["bad", "poor", "sad", "dark", "cold", "rude", "awful", "grim"]
FILLER = ["the", "a", "day", "was", "very", "and", "it", "felt", "so", "quite"]


def synthetic(n, seed):
    """``n`` (label, sentence) pairs: label 1 when the sentence has more positive words."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        label = rng.randrange(2)
        words = [rng.choice(FILLER) for _ in range(rng.randint(2, 6))]
        words += [rng.choice(POSITIVE if label else NEGATIVE) for _ in range(rng.randint(1, 3))]
        rng.shuffle(words)
        out.append((label, " ".join(words)))
    return out


def make_tokenizer(directory):
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *POSITIVE, *NEGATIVE, *FILLER]
    path = Path(directory) / "vocab.txt"
    path.write_text("\n".join(vocab) + "\n")
    return BertTokenizerFast(vocab_file=str(path))


def loss_fn(outputs, labels):
    return F.cross_entropy(outputs.logits, labels, reduction="none")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="synthetic training sentences")
    ap.add_argument("--texts", help="label<TAB>sentence per line (instead of synthetic data)")
    ap.add_argument("--epsilon", type=float, default=4.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--engine", default="auto", choices=["auto", "ghost", "vmap"])
    args = ap.parse_args(argv)

    rows = ([(int(a), b) for a, b in (ln.split("\t", 1) for ln in
                                      Path(args.texts).read_text().splitlines() if ln.strip())]
            if args.texts else synthetic(args.n + 200, seed=0))
    train_rows, test_rows = rows[:-200], rows[-200:]
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = make_tokenizer(tmp)
    # the batch exactly as the tokenizer gives it: input_ids, token_type_ids, attention_mask
    train = dict(tokenizer([s for _, s in train_rows], padding=True, return_tensors="pt"))
    test = dict(tokenizer([s for _, s in test_rows], padding=True, return_tensors="pt"))
    y_train = torch.tensor([a for a, _ in train_rows])
    y_test = torch.tensor([a for a, _ in test_rows])

    torch.manual_seed(0)  # public: the model's initialisation
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, num_labels=2,
                        max_position_embeddings=64)
    model = BertForSequenceClassification(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    dp = dpclip.make_private(model, optimizer, (train, y_train), loss_fn=loss_fn,
                             epsilon=args.epsilon, delta=args.delta, epochs=args.epochs,
                             batch_size=args.batch_size, strategy="quantile", engine=args.engine)
    for epoch in range(dp.epochs):
        model.train()
        for x, y in dp.loader:
            dp.backward(x, y)
            optimizer.step()
        model.eval()
        with torch.no_grad():
            accuracy = (model(**test).logits.argmax(-1) == y_test).float().mean().item()
        print(f"epoch {epoch + 1}: test accuracy {accuracy:.4f}, epsilon {dp.epsilon():.3f}")
    print("summary:", json.dumps(dp.describe(), default=str))


if __name__ == "__main__":
    main()
