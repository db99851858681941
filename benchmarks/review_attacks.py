"""The eighth and ninth hostile reviews' attacks, measured on whichever ``dpclip`` is importable:
for each attack and engine, the leave-one-out distance of the noise-free clipped sum
(``max_j ||S(X) - S(X without j)|| / C``; sound: <= 1) or, for state carried across calls, how far
the release of one batch moves when the PREVIOUS call saw another batch (sound: 0). "refused": the
engine raised (the first words of its error are kept).

Run ``PYTHONPATH=<src to measure>:. python benchmarks/review_attacks.py LABEL OUT.json`` (rows
appended, replacing LABEL's), then ``python benchmarks/review_attacks.py --table OUT.json`` for the
Markdown table beside it. The attacks are the tests' models (tests/engine/test_review8_*.py,
test_review9_*.py).
"""

from __future__ import annotations

import json
import platform
import sys
import time

import torch


def _attacks():
    from dpclip.engine import AutoEngine, GhostEngine, NaiveEngine, VmapEngine
    from tests.engine import test_review8_carry as r8
    from tests.engine import test_review8_rounding as r8r
    from tests.engine import test_review9_tables_and_geometry as r9
    from tests.engine.helpers import DT
    from tests.engine.test_separability_attacks import C, ce, clipped_sum, data, loo_distance

    engines = {"ghost": GhostEngine, "auto": AutoEngine, "vmap": VmapEngine, "naive": NaiveEngine}

    def moved_r9(cls):
        def run(engine):
            x, y = data()
            model = r9._fresh(cls)
            got = []
            for first in (0, 1):
                model.buf.zero_()
                clipped_sum(engine(), model, ce, x[first:first + 2], y[first:first + 2])
                got.append(clipped_sum(engine(), model, ce, x[4:], y[4:]))
            r9._MODEL.clear()
            return float((got[0][0] - got[1][0]).norm()) / C, got[0][1]
        return run

    def moved_r8(cls, between=None):
        def run(engine):
            torch.manual_seed(0)
            model = cls().to(DT)
            x, y = data()
            got = []
            for first in (0, 1):
                r8._H.zero_()
                r8._PENDING.clear()
                clipped_sum(engine(), model, ce, x[first:first + 2], y[first:first + 2])
                if between is not None:
                    between()
                got.append(clipped_sum(engine(), model, ce, x[4:], y[4:]))
            r8._H.zero_()
            r8._PENDING.clear()
            return float((got[0][0] - got[1][0]).norm()) / C, got[0][1]
        return run

    def class_carry(engine):
        torch.manual_seed(0)
        model = r8._ClassCarry().to(DT)
        x, y = data()
        got = []
        try:
            for first in (0, 1):
                r8._ClassCarry.k = 0.0
                clipped_sum(engine(), model, ce, x[first:first + 2], y[first:first + 2])
                got.append(clipped_sum(engine(), model, ce, x[4:], y[4:]))
        finally:
            r8._ClassCarry.k = 0.0
        return float((got[0][0] - got[1][0]).norm()) / C, got[0][1]

    def loo(build, b=8):
        def run(engine):
            torch.manual_seed(0)
            model = build().to(DT)
            x, y = data(b=b)
            eng = engine()
            return loo_distance(eng, model, ce, x, y), clipped_sum(eng, model, ce, x, y)[1]
        return run

    four = ("ghost", "auto", "vmap", "naive")
    return engines, [
        ("8: structure-method override carries (moved)", moved_r8(r8._Override), four),
        ("8: loop writes a global between steps (moved)", moved_r8(r8._Carries, r8._release),
         ("ghost", "auto")),
        ("8: class named torch's, class attribute carry (moved)", class_carry, ("vmap",)),
        ("8: batch-dependent rounding (LOO, open)", loo(r8r._Amplifies, 16), four),
        ("9: dict-subclass _modules carries (moved)", moved_r9(r9._TableCarry), four),
        ("9: Parameter subclass property carries (moved)", moved_r9(r9._ParamCarry), four),
        ("9: as_strided_ unseen (LOO)", loo(lambda: r9._Restrides(False)), ("ghost", "auto")),
        ("9: swap_tensor_impl unseen (LOO)", loo(lambda: r9._Restrides(True)), ("ghost", "auto")),
    ]


def measure(label: str) -> list[dict]:
    engines, attacks = _attacks()
    rows = []
    for name, run, which in attacks:
        for e in which:
            row = {"attack": name, "code": label, "engine": e, "device": "cpu",
                   "cpu": platform.machine(), "torch": torch.__version__,
                   "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            try:
                value, info = run(engines[e])
                row["value_over_C"] = round(value, 4)
                row["ran_on"] = (info or {}).get("engine") or e
            except Exception as exc:  # noqa: BLE001 - a refusal is the measurement
                row["refused"] = f"{type(exc).__name__}: {str(exc)[:90]}"
            rows.append(row)
            print(name, e, row.get("value_over_C", row.get("refused")), flush=True)
    return rows


def table(path: str) -> str:
    rows = json.load(open(path))
    codes = list(dict.fromkeys(r["code"] for r in rows))
    cols = [(c, e) for c in codes for e in ("ghost", "auto", "vmap", "naive")
            if any(r["code"] == c and r["engine"] == e for r in rows)]
    out = ["# The eighth and ninth hostile reviews' attacks (benchmarks/review_attacks.py)", "",
           "Per attack and engine: LOO = `max_j ||S(X) - S(X \\ j)|| / C` (sound: <= 1) or, for a "
           "carry, how far one batch's release moves when the previous call saw another batch "
           "(sound: 0); float64, C 0.5, CPU, torch " + rows[0]["torch"] + ". `refused`: the "
           "engine raised; the engine that ran in brackets.", "",
           "| attack | " + " | ".join(f"{c} {e}" for c, e in cols) + " |",
           "|---|" + "---|" * len(cols)]
    for a in dict.fromkeys(r["attack"] for r in rows):
        cells = []
        for c, e in cols:
            r = next((r for r in rows if r["attack"] == a and r["code"] == c and r["engine"] == e),
                     None)
            cells.append("" if r is None else "refused" if "refused" in r else
                         f"{r['value_over_C']:.3f} ({r['ran_on']})")
        out.append(f"| {a} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    if sys.argv[1] == "--table":
        md = table(sys.argv[2])
        open(sys.argv[2].rsplit(".", 1)[0] + ".md", "w").write(md)
        print(md)
    else:
        label, path = sys.argv[1], sys.argv[2]
        try:
            old = json.load(open(path))
        except FileNotFoundError:
            old = []
        old = [r for r in old if r["code"] != label] + measure(label)
        json.dump(old, open(path, "w"), indent=1)
