#!/usr/bin/env python3
"""A private MLP classifier on your own CSV file (stdlib csv + numpy, no pandas).

Every column except ``--target`` is a numeric feature. Features are scaled with DECLARED ranges
(``--range age=17:90``, one per feature): each value is clipped to its range and mapped to
[-1, 1]. The ranges are public knowledge you supply (a data dictionary, a form's limits): scaling
with the private data's own min/max or mean/std would publish statistics of the data without
noise or accounting (docs/privacy.md). Empty or ``NA`` cells become the range's midpoint. The
classes are declared too (``--classes no,yes``): the set of labels present is itself private.

    python examples/tabular_csv.py data.csv --target income --classes "<=50K,>50K" \
        --range age=17:90 --range hours=1:99 --strategy quantile --epsilon 2
"""

import argparse
import csv
import json

import numpy as np
import torch
from torch import nn

from dpclip.training.private import make_private

MISSING = {"", "na", "nan", "null", "?"}


def parse_ranges(items, columns):
    ranges = {}
    for item in items:
        name, _, span = item.partition("=")
        lo, _, hi = span.partition(":")
        try:
            ranges[name] = (float(lo), float(hi))
        except ValueError:
            raise SystemExit(f"--range {item!r}: expected NAME=LOW:HIGH, e.g. age=17:90")
        if not ranges[name][0] < ranges[name][1]:
            raise SystemExit(f"--range {item!r}: LOW must be below HIGH")
    missing = [c for c in columns if c not in ranges]
    if missing:
        raise SystemExit(f"declare a range for every feature: missing --range for "
                         f"{', '.join(missing)} (e.g. --range {missing[0]}=LOW:HIGH)")
    unknown = sorted(set(ranges) - set(columns))
    if unknown:
        raise SystemExit(f"--range for unknown column(s) {', '.join(unknown)}; "
                         f"features: {', '.join(columns)}")
    return ranges


def read_csv(path, target, classes, range_items):
    """(x float32 (N, d) in [-1, 1], y int64 (N,), feature names) with declared scaling only."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise SystemExit(f"{path}: no data rows")
    if target not in rows[0]:
        raise SystemExit(f"--target {target!r} is not a column of {path}: {list(rows[0])}")
    features = [c for c in rows[0] if c != target]
    ranges = parse_ranges(range_items, features)
    lo = np.array([ranges[c][0] for c in features])
    hi = np.array([ranges[c][1] for c in features])
    x = np.empty((len(rows), len(features)))
    y = np.empty(len(rows), dtype=np.int64)
    index = {c: k for k, c in enumerate(classes)}
    for i, row in enumerate(rows):
        label = row[target].strip()
        if label not in index:
            # (the label is a private value: not quoted, as the feature values below)
            raise SystemExit(f"{path} row {i + 2}: the label is not one of --classes {classes}")
        y[i] = index[label]
        for j, c in enumerate(features):
            v = row[c].strip()
            try:
                x[i, j] = (lo[j] + hi[j]) / 2 if v.lower() in MISSING else float(v)
            except ValueError:  # the value itself is private: not quoted
                raise SystemExit(
                    f"{path} row {i + 2}: column {c!r} is not numeric. This example reads "
                    "numeric features with declared ranges only; a categorical column needs a "
                    "DECLARED category list (one-hot columns read off the file let one record "
                    "with a unique value add a column): encode it beforehand with the public "
                    "list of its values plus an 'other' column (as dpclip.data.tabular."
                    "CategoryList does), or drop the column") from None
    x = 2 * (np.clip(x, lo, hi) - lo) / (hi - lo) - 1
    return torch.tensor(x, dtype=torch.float32), torch.from_numpy(y), features


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("csv", help="the CSV file (header row, one example per row)")
    ap.add_argument("--target", required=True, help="the label column")
    ap.add_argument("--classes", required=True, help="comma-separated labels (public)")
    ap.add_argument("--range", action="append", default=[], metavar="NAME=LOW:HIGH",
                    help="declared range of a feature (one per feature)")
    ap.add_argument("--test-fraction", type=float, default=0.2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--strategy", default="quantile", help="any name of `dpclip strategies`")
    ap.add_argument("--param", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--epsilon", type=float, default=2.0)
    ap.add_argument("--delta", type=float, default=None, help="default: 1e-5 or below 1/N")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=256, help="expected (Poisson) batch size")
    ap.add_argument("--lr", type=float, default=0.01, help="Adam learning rate")
    ap.add_argument("--seed", type=int, default=0, help="public: initialisation and test split")
    args = ap.parse_args(argv)
    if any("=" not in p for p in args.param):
        ap.error("--param takes KEY=VALUE, e.g. --param target_quantile=0.6")

    classes = [c.strip() for c in args.classes.split(",")]
    x, y, features = read_csv(args.csv, args.target, classes, args.range)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(args.seed))
    n_test = int(round(args.test_fraction * len(y)))
    test, train = perm[:n_test], perm[n_test:]

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(len(features), args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, len(classes)))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    dp = make_private(model, optimizer, (x[train], y[train]), strategy=args.strategy,
                      strategy_params=dict(p.split("=", 1) for p in args.param),
                      epsilon=args.epsilon, delta=args.delta, epochs=args.epochs,
                      batch_size=args.batch_size)
    print(f"{len(train)} training rows, {len(features)} features, {len(classes)} classes; "
          f"noise multiplier {dp.noise_multiplier:.3f}")
    for epoch in range(1, dp.epochs + 1):
        for xb, yb in dp.loader:
            dp.step(xb, yb)
        with torch.no_grad():
            acc = (model(x[test]).argmax(1) == y[test]).float().mean().item() if n_test else 0.0
        print(f"epoch {epoch}: test accuracy {acc:.4f}, epsilon {dp.epsilon():.3f}")
    print("summary:", json.dumps(dp.describe(), default=str))


if __name__ == "__main__":
    main()
