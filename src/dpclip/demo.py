"""The main job run by ``make demo``: ``dpclip compare --preset quick``.

Four clipping strategies (fixed C, PSAC, Andrew's quantile, AdaClip with per-sample noise) train
the Papernot CNN on Fashion-MNIST at epsilon 2.7, each with settings chosen by the tuning protocol
(``docs/tuning.md``: the same budget of trials per strategy, scored on a validation split of the
training data, never the test split), then 6 epochs with a cosine learning-rate decay; the runs go
to the results database and a Markdown + HTML report (with plots, epsilon, sigma, time per run and
the tuning table) is written under ``./runs`` (``$DPCLIP_OUT``). Extra arguments are passed on,
e.g. ``python -m dpclip.demo --workers 2`` or ``--set train.epochs=1``.
"""

from __future__ import annotations

import sys

from dpclip.cli import main
from dpclip.runtime import maybe_reexec_with_jemalloc


def run() -> int:
    args = ["compare", "--preset", "quick"] + sys.argv[1:]
    print("dpclip demo: dpclip " + " ".join(args), flush=True)
    return main(args)


if __name__ == "__main__":
    maybe_reexec_with_jemalloc()  # the fast allocator (DPCLIP_ALLOCATOR=system turns it off)
    sys.exit(run())
