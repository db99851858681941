"""The 125th-133rd hostile reviews' engine-level attacks (session 21), measured on whichever
``dpclip`` is importable: per attack and engine, the leave-one-out distance of the noise-free
clipped sum in units of the stated sensitivity (``max_j ||S(X) - S(X without j)|| / C``; sound:
<= 1), or "refused" (the engine raised; the first words of its error are kept). The attacks are
the tests' models (tests/engine/test_review127_backward_window.py, test_review131_signed_zero.py,
test_review133_embedding_cancel.py, tests/core/test_review125_strategies.py); the attacks through
``make_private`` (reviews 128-132: the trained weights of neighbouring datasets) are in
tests/core/test_review128_grad_slot.py and tests/federated/test_review129_flower_log.py.

    MKL_CBWR=COMPATIBLE PYTHONPATH=<src to measure>:. \
        python benchmarks/review_attacks_s21.py LABEL OUT.json
    python benchmarks/review_attacks_s21.py --table OUT.json      # the Markdown beside it
"""

from __future__ import annotations

import json
import math
import platform
import sys
import time
from pathlib import Path

import torch


def _attacks():
    from dpclip.engine import get_engine
    from tests.core import test_review125_strategies as r125
    from tests.engine import test_review127_backward_window as r127
    from tests.engine import test_review131_signed_zero as r131
    from tests.engine import test_review133_embedding_cancel as r133
    from tests.engine.helpers import loo_distance

    def loo(make, loss, x, y):
        return lambda name: loo_distance(lambda: get_engine(name), make, x, y, 1.0, loss=loss)

    def r127_rewrite(name):
        x, y = r127._data()
        return loo_distance(lambda: get_engine(name), r127._fresh_rewrites, x, y, 1.0,
                            loss=r127._ce)

    def signed(make):
        torch.manual_seed(1)
        x, y = torch.randn(33, 4), torch.randn(33, 3)
        return loo(make, r131._loss, x, y)

    def r133_embedding(name):
        ids, y = r133._batch(1, 0.5, 0.5, 0.5)
        _, res = r133._release("ghost", ids, y, 1.0)
        k = float(torch.tensor(res.weights[2].item(), dtype=torch.float32) * r133._M)
        c = 2.0 ** math.ceil(math.log2(k)) / k * (1 + 1e-5)
        _, res = r133._release("ghost", ids, y, c)
        x = float(torch.tensor(res.weights[2].item(), dtype=torch.float32) * r133._M)
        g = 2.0 ** (math.floor(math.log2(x)) - 23)
        ids, y = r133._batch(16, c / 1.001 / math.sqrt(2), g / 64, 0.4921875 * g)
        full, _ = r133._release(name, ids, y, c)
        rest, _ = r133._release(name, ids[1:], y[1:], c)
        return float((full - rest).norm()) / c

    def r125_adaclip_threads(name):
        from dpclip.clipping.adaclip import AdaClip
        was = torch.get_num_threads()
        torch.set_num_threads(5)
        try:
            torch.manual_seed(0)
            x, y = torch.randn(33, 512), torch.randn(33)
            full = r125._release(r125._Compare, name, AdaClip(initial_clip_norm=1.0), x, y,
                                 r125._sq, 33.0)
            rest = r125._release(r125._Compare, name, AdaClip(initial_clip_norm=1.0), x[:32],
                                 y[:32], r125._sq, 33.0)
            return float((full - rest).norm())
        finally:
            torch.set_num_threads(was)

    three = ("ghost", "auto", "compiled")
    return [
        ("127: a finalizer in the backward rewrites a saved tensor (B 8)", r127_rewrite, three),
        ("131: the padded batch size in a zero's sign (scalar, B 33)", signed(r131._Scalar), three),
        ("131: ... in a tensor literal -0.0", signed(r131._Literal), three),
        ("131: ... in a NaN's sign bit", signed(r131._NanSign), three),
        ("132: a literal's hidden storage read by as_strided", signed(r131._HiddenStorage), three),
        ("132: a literal's stride order read by as_strided", signed(r131._OtherStrides), three),
        ("133: Embedding cancellers round the others' sums (B 1024)", r133_embedding, three),
        ("125: AdaClip at 5 intra-op threads (x sensitivity, B 33)", r125_adaclip_threads,
         ("vmap", "auto")),
    ]


def measure(label: str, out: Path) -> None:
    from dpclip.engine.errors import UnsupportedModelError

    torch.set_num_threads(2)  # (as the tests run them: tests/conftest.py; the engines' cap)

    rows = json.loads(out.read_text()) if out.exists() else []
    rows = [r for r in rows if r["code"] != label]
    for attack, fn, engines in _attacks():
        for name in engines:
            row = {"attack": attack, "code": label, "engine": name, "device": "cpu",
                   "cpu": platform.machine(), "torch": torch.__version__,
                   "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            try:
                row["value_over_C"] = round(fn(name), 4)
            except UnsupportedModelError as exc:
                row["refused"] = str(exc)[:90]
            rows.append(row)
            print(json.dumps(row), flush=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")


def table(out: Path) -> str:
    rows = json.loads(out.read_text())
    codes = list(dict.fromkeys(r["code"] for r in rows))
    lines = ["# Hostile reviews 125-133: LOO before and after (generated by "
             "benchmarks/review_attacks_s21.py)", "",
             "Noise-free leave-one-out distance of the clipped sum in units of the stated "
             "sensitivity (sound: <= 1), or the refusal; CPU, torch "
             f"{rows[0]['torch']}. Each attack's data is built against the code it was found "
             "on: review 133's Embedding data is tuned to the public-size rounding constants of "
             "session 20 (not in cf9dd41, where it hits no rounding boundary).", "",
             "| attack | engine | " + " | ".join(codes) + " |",
             "|---|---|" + "---|" * len(codes)]
    keys = list(dict.fromkeys((r["attack"], r["engine"]) for r in rows))
    for attack, engine in keys:
        cells = []
        for code in codes:
            r = next((r for r in rows if (r["attack"], r["engine"], r["code"]) ==
                      (attack, engine, code)), None)
            cells.append("-" if r is None else f"{r['value_over_C']:.3f}"
                         if "value_over_C" in r else "refused")
        lines.append(f"| {attack} | {engine} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1] == "--table":
        path = Path(sys.argv[2])
        path.with_suffix(".md").write_text(table(path))
        print(table(path))
    else:
        measure(sys.argv[1], Path(sys.argv[2]))
