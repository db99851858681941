"""Leave-one-out distance of the noise-free clipped sum under each separability attack of issue 31
(tests/engine/test_separability_attacks.py), for the ghost and auto engines of whichever ``dpclip``
is importable: ``max_j ||S(X) - S(X without j)|| / C``; a sound per-example mechanism stays <= 1.

Run ``python benchmarks/separability_loo.py [--hostile | --third | --unseen] LABEL OUT.json`` (PYTHONPATH pointing at the code to
measure and at the repository root for the attack definitions); rows are appended to OUT.json and
``--table OUT.json`` writes the Markdown table beside it. "refused": the engine raised.
"""

from __future__ import annotations

import json
import platform
import sys
import time

import torch


CLIPS = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


def loo_worst(engine, model, loss, x, y) -> float:
    """The largest LOO distance over the clipping norms ``CLIPS``, in units of each C."""
    from dpclip.engine import ParamGroups
    from tests.engine.helpers import clip_weights

    def total(c, xs, ys):
        res = engine.compute(model, loss, xs, ys, clip_weights(c), ParamGroups.flat(model))
        return torch.cat([g.reshape(-1) for g in res.grads.values()])

    worst = 0.0
    for c in CLIPS:
        full = total(c, x, y)
        for j in range(x.shape[0]):
            keep = [i for i in range(x.shape[0]) if i != j]
            worst = max(worst, float((full - total(c, x[keep], y[keep])).norm()) / c)
    return worst


def hostile_attacks() -> dict:
    """The attacks of the hostile review that ghost accepted (tests/engine/test_hostile_review.py:
    two fixed by refusal, and the programs that tell the proof from the real run, fixed by the
    proved-program match; the two of the last review keep their row names)."""
    from tests.engine.test_hostile_review import DETECTING, REFUSED

    fixed = {k: REFUSED[k] for k in ("einsum-ones_like(B)", "forward-hook-mixes-output")}
    was_open = ("fake-detection-forward", "symint-detection-loss")
    return {**fixed, **{f"{k} (open)" if k in was_open else k: v for k, v in DETECTING.items()}}


def unseen_attacks() -> dict:
    """The writes through memory shared with NumPy from before the call (second hostile review's
    open hole and the attacks found while closing it: tests/engine/test_hostile_review.py), with
    the shared arrays reset before each build."""
    from tests.engine import test_hostile_review as h
    from tests.engine.test_separability_attacks import ce

    def fresh(make):
        def build():
            h.reset_unseen()
            return make()
        return build

    got = {k: (fresh(v), ce) for k, v in h.UNSEEN_WRITES.items() if k.startswith(("numpy-shared",
           "numpy-view", "numpy-write-after", "from-numpy", "data-assignment", "set-storage"))}
    got["chain-weight-written-by-the-loss"] = (fresh(h.chain_shared_with_numpy),
                                               h._loss_writes_chain_weight)
    return got


def measure(label: str, attacks: dict | None = None) -> list[dict]:
    from dpclip.engine import AutoEngine, GhostEngine
    from tests.engine.test_separability_attacks import ATTACKS, DT, data, clipped_sum

    ATTACKS = ATTACKS if attacks is None else attacks  # noqa: N806

    rows = []
    for name, (build, loss) in ATTACKS.items():
        for engine in (GhostEngine(), AutoEngine()):
            torch.manual_seed(0)
            model = build().to(DT)
            x, y = data()
            try:
                _, info = clipped_sum(engine, model, loss, x, y)
                ran = (info or {}).get("engine", engine.name)
                loo = round(loo_worst(engine, model, loss, x, y), 3)
            except Exception as exc:  # noqa: BLE001 - a refusal is the measured outcome
                ran, loo = f"refused ({type(exc).__name__})", None
            rows.append({"attack": name, "code": label, "engine": engine.name, "ran_on": ran,
                         "loo_over_C": loo, "batch_size": x.shape[0], "device": "cpu",
                         "cpu": platform.processor() or platform.machine(),
                         "torch": torch.__version__,
                         "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return rows


def measure_third(label: str) -> list[dict]:
    """The third hostile review's attacks (tests/engine/test_hostile_review.py, ``THIRD``): each
    first run honestly (its switch off) at every batch size the LOO meets, which fills the proof's
    and the chain layout caches as honest steps would, then with the switch on."""
    import contextlib

    from dpclip.engine import AutoEngine, GhostEngine, batch_symbol, ghost_forward
    from tests.engine import test_hostile_review as hr

    rows = []
    for name, (build, make_data, loss, ctx) in hr.THIRD.items():
        for engine in (GhostEngine(), AutoEngine()):
            batch_symbol._CACHE.clear()
            ghost_forward._CHAIN_LAYOUTS.clear()
            hr._SW["on"] = False
            torch.manual_seed(0)
            model = build().to(hr.DT)
            x, y = make_data()
            with ctx() if ctx is not None else contextlib.nullcontext():
                try:
                    loo_worst(engine, model, loss, x, y)
                    hr._SW["on"] = True
                    _, info = hr.clipped_sum(engine, model, loss, x, y)
                    ran = (info or {}).get("engine", engine.name)
                    loo = round(loo_worst(engine, model, loss, x, y), 3)
                except Exception as exc:  # noqa: BLE001 - a refusal is the measured outcome
                    ran, loo = f"refused ({type(exc).__name__})", None
                finally:
                    hr.third_review_cleanup()
            open_ = " (open)" if name in hr._OPEN3 else ""
            rows.append({"attack": name + open_, "code": label, "engine": engine.name,
                         "ran_on": ran, "loo_over_C": loo, "batch_size": x.shape[0],
                         "device": "cpu", "cpu": platform.processor() or platform.machine(),
                         "torch": torch.__version__,
                         "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return rows


def table(path: str) -> str:
    rows = json.load(open(path))
    attacks = list(dict.fromkeys(r["attack"] for r in rows))
    codes = list(dict.fromkeys(r["code"] for r in rows))
    head = "| attack | " + " | ".join(f"{c} {e}" for c in codes for e in ("ghost", "auto")) + " |"
    out = ["# LOO distance of the clipped sum under the separability attacks "
           "(benchmarks/separability_loo.py)", "",
           "`max over C in {0.05, 0.1, 0.2, 0.5, 1, 2} of max_j ||S(X) - S(X \\ j)|| / C`, B = 8, "
           "float64, CPU, torch "
           f"{rows[0]['torch']}; a sound per-example mechanism is <= 1. `refused`: the engine "
           "raised; the engine that ran in brackets.", "", head,
           "|---|" + "---|" * (2 * len(codes))]
    for a in attacks:
        cells = []
        for c in codes:
            for e in ("ghost", "auto"):
                r = next((r for r in rows if r["attack"] == a and r["code"] == c
                          and r["engine"] == e), None)
                if r is None:
                    cells.append("")
                elif r["loo_over_C"] is None:
                    cells.append("refused")
                else:
                    cells.append(f"{r['loo_over_C']} ({r['ran_on']})")
        out.append(f"| {a} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    if sys.argv[1] == "--table":
        md = table(sys.argv[2])
        open(sys.argv[2].rsplit(".", 1)[0] + ".md", "w").write(md)
        print(md)
    else:
        # ``--hostile LABEL OUT.json``: the hostile review's attacks instead of issue 31's;
        # ``--third``: the third hostile review's; ``--unseen``: the writes through memory
        # shared with NumPy (the memory watch)
        which = sys.argv[1] if sys.argv[1] in ("--hostile", "--third", "--unseen") else None
        label, path = sys.argv[1 + bool(which)], sys.argv[2 + bool(which)]
        try:
            old = json.load(open(path))
        except FileNotFoundError:
            old = []
        if which == "--third":
            new_rows = measure_third(label)
        else:
            new_rows = measure(label, {"--hostile": hostile_attacks,
                                       "--unseen": unseen_attacks}[which]() if which else None)
        old = [r for r in old if r["code"] != label] + new_rows
        json.dump(old, open(path, "w"), indent=1)
