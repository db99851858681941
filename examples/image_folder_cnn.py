#!/usr/bin/env python3
"""Your own CNN on your own images, trained privately with any dpclip clipping strategy.

Data: a folder with one subfolder per class (``DATA/cat/*.png``, ``DATA/dog/*.jpg``; if ``DATA``
has ``train/`` and ``test/`` folders of that shape they are used as the split), or a ``.pt`` file
holding ``(images, labels)`` tensors (images ``(N, C, H, W)`` in [0, 1], labels ``(N,)`` int).
Images are read with Pillow, resized to ``--size`` and scaled with FIXED constants (pixel - 0.5)
/ 0.5: statistics of the private images (their mean and std) would leak, see docs/privacy.md.
The class list is the folder names (public: you choose them), the test split a seeded shuffle.

    python examples/image_folder_cnn.py DATA --strategy quantile --epsilon 3 --epochs 10
    python examples/image_folder_cnn.py DATA --strategy auto-s --param clip_norm=0.5
"""

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from dpclip.training.private import make_private

EXTENSIONS = {".png", ".jpg", ".jpeg", ".bmp", ".gif"}


def read_class_folders(root: Path, size: int, channels: int, classes=None):
    """Images under ``root/<class>/`` as ``(x, y, classes)``, x in [0, 1] of shape (N, C, H, W)."""
    classes = classes or sorted(p.name for p in root.iterdir() if p.is_dir())
    if not classes:
        raise SystemExit(f"{root}: no class subfolders (expected {root}/<class>/<image>.png)")
    xs, ys = [], []
    for k, name in enumerate(classes):
        for f in sorted((root / name).iterdir()):
            if f.suffix.lower() in EXTENSIONS:
                img = Image.open(f).convert("L" if channels == 1 else "RGB")
                img = img.resize((size, size), Image.BILINEAR)
                arr = np.asarray(img, dtype=np.float32).reshape(size, size, channels) / 255.0
                xs.append(torch.from_numpy(arr).permute(2, 0, 1))
                ys.append(k)
    if not xs:
        raise SystemExit(f"{root}: no images with extensions {sorted(EXTENSIONS)}")
    return torch.stack(xs), torch.tensor(ys), classes


def load(args):
    """(x_train, y_train, x_test, y_test, number of classes); inputs scaled with fixed constants."""
    path = Path(args.data)
    if path.suffix == ".pt":
        x, y = torch.load(path)
        if args.num_classes is None:  # not max(y) + 1: the class list is public, not read off
            raise SystemExit("a .pt file needs --num-classes K (the public number of classes)")
        x, y, k = x.float(), y.long(), args.num_classes
    elif (path / "train").is_dir() and (path / "test").is_dir():
        x, y, classes = read_class_folders(path / "train", args.size, args.channels)
        xt, yt, _ = read_class_folders(path / "test", args.size, args.channels, classes)
        return (x - 0.5) / 0.5, y, (xt - 0.5) / 0.5, yt, len(classes)
    else:
        x, y, classes = read_class_folders(path, args.size, args.channels)
        k = len(classes)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(args.seed))
    n_test = int(round(args.test_fraction * len(y)))
    te, tr = perm[:n_test], perm[n_test:]
    x = (x - 0.5) / 0.5
    return x[tr], y[tr], x[te], y[te], k


class SmallCNN(nn.Module):
    """GroupNorm, not BatchNorm: BatchNorm mixes the examples of a batch (refused by dpclip)."""

    def __init__(self, channels: int, num_classes: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.Tanh(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.GroupNorm(4, 32), nn.Tanh(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(32, num_classes)

    def forward(self, x):
        return self.head(self.features(x))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("data", help="folder of class subfolders, or a .pt file of (images, labels)")
    ap.add_argument("--size", type=int, default=32, help="images are resized to size x size")
    ap.add_argument("--channels", type=int, choices=[1, 3], default=3)
    ap.add_argument("--num-classes", type=int, default=None, help=".pt data: number of classes")
    ap.add_argument("--test-fraction", type=float, default=0.2)
    ap.add_argument("--strategy", default="fixed", help="any name of `dpclip strategies`")
    ap.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                    help="a strategy parameter, e.g. clip_norm=1.0 (repeatable)")
    ap.add_argument("--epsilon", type=float, default=3.0)
    ap.add_argument("--delta", type=float, default=None, help="default: 1e-5 or below 1/N")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=64, help="expected (Poisson) batch size")
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0, help="public: initialisation and test split")
    args = ap.parse_args(argv)

    x, y, x_test, y_test, k = load(args)
    torch.manual_seed(args.seed)
    model = SmallCNN(x.shape[1], k)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if any("=" not in p for p in args.param):
        ap.error("--param takes KEY=VALUE, e.g. --param clip_norm=1.0")
    params = dict(p.split("=", 1) for p in args.param)
    dp = make_private(model, optimizer, (x, y), strategy=args.strategy, strategy_params=params,
                      epsilon=args.epsilon, delta=args.delta, epochs=args.epochs,
                      batch_size=args.batch_size)
    print(f"{len(y)} training images, {k} classes; noise multiplier {dp.noise_multiplier:.3f}")
    for epoch in range(1, dp.epochs + 1):
        model.train()
        for xb, yb in dp.loader:
            dp.step(xb, yb)  # backward (clip, noise, ledger) + optimizer.step + zero_grad
        model.eval()
        with torch.no_grad():
            acc = (model(x_test).argmax(1) == y_test).float().mean().item() if len(y_test) else 0.0
        print(f"epoch {epoch}: test accuracy {acc:.4f}, epsilon {dp.epsilon():.3f}")
    print("summary:", json.dumps(dp.describe(), default=str))


if __name__ == "__main__":
    main()
