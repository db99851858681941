"""The main job run by ``make demo``: ``dpclip compare --preset quick``.

Every registered norm-based clipping strategy trains the Papernot CNN on Fashion-MNIST at epsilon
2.7 with the same short budget; the runs go to the results database and a Markdown + HTML report
(with plots) is written under ``./runs`` (``$DPCLIP_OUT``). Extra arguments are passed on, e.g.
``python -m dpclip.demo --workers 2`` or ``--set train.epochs=1``.
"""

from __future__ import annotations

import sys

from dpclip.cli import main


def run() -> int:
    args = ["compare", "--preset", "quick"] + sys.argv[1:]
    print("dpclip demo: dpclip " + " ".join(args), flush=True)
    return main(args)


if __name__ == "__main__":
    from dpclip.runtime import maybe_reexec_with_jemalloc

    maybe_reexec_with_jemalloc()  # the fast allocator (DPCLIP_ALLOCATOR=system turns it off)
    sys.exit(run())
