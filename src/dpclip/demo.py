"""The main job run by ``make demo``: a quick private training run on Fashion-MNIST.

Runs fixed clipping (Abadi) on the Papernot CNN at epsilon 2.7 for a couple of epochs, stores the run
in the results database and prints the result. (The full strategy comparison, ``dpclip compare
--preset quick``, replaces this once the harness lands.)
"""

from __future__ import annotations

import sys

from dpclip.cli import main


def run() -> int:
    args = [
        "train", "--dataset", "fashion-mnist", "--model", "papernot-cnn", "--strategy", "fixed",
        "--param", "clip_norm=0.1", "--epsilon", "2.7", "--delta", "1e-5", "--epochs", "3",
        "--batch-size", "1024", "--lr", "2", "--optimizer", "momentum",
    ] + sys.argv[1:]
    print("dpclip demo: dpclip " + " ".join(args), flush=True)
    return main(args)


if __name__ == "__main__":
    sys.exit(run())
