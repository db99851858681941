"""Why AdaClip with noise per sample learns so little here (issue 36): a short diagnosis.

Lin et al. 2022 Table 2 reports AdaClip (their per-sample-noise reading of Pichapati et al.) at
69.6 / 71.8 / 75.5 % on Fashion-MNIST; the committed lin-table2 rows are 17.9 / 23.5 / 28.3. Every
setting below is the Papernot CNN (tanh), B 1024 (Poisson), SGD momentum 0.9, lr 0.25, the noise
multiplier of the 40-epoch eps-2.7 run (1.4693, PLD, delta 1e-5) held fixed, a few epochs, one
seed: a DIAGNOSTIC at equal sigma, not a reproduction (no tuning, a fraction of the 40 epochs).

* ``fixed C 0.4``: Abadi clipping, the reference;
* ``fixed C 0.4, noise x sqrt(B)``: the same with the noise std multiplied by sqrt(B) = 32, the
  noise that per-sample noise puts on the sum (what does the placement alone cost?);
* ``adaclip batch``: AdaClip with batch noise (dpclip's default);
* ``adaclip per_sample``: the committed lin-table2 setting (C_init 0.4, h 1e-3 / 1e-5);
* ``adaclip per_sample, s fixed``: h1 = h2 = 1e-5 (the variance estimate pinned at 1e-5, which is
  what a clamp written ``min(max(v, h1), h2)`` does with Lin's h1 = 1e-3 > h2 = 1e-5), C_init
  sqrt(d 1e-5);
* ``adaclip per_sample, no centring``: the mean estimate m held at 0 (a monkeypatch of this
  script, not an option of dpclip): is it the noisy centre fed back into every step?

Per step the script records the norm of the mean estimate m, the median coordinate scale b and
the fraction of examples clipped in whitened space (all from the privatized state or the norms the
engine already has; the fraction clipped is NOT private and stays in this diagnostic file).
Writes ``reproductions/results/adaclip_diagnosis.{json,md}``::

    OMP_NUM_THREADS=1 PYTHONPATH=src python reproductions/adaclip_diagnosis.py --epochs 2
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
from pathlib import Path

import torch

from dpclip.clipping.adaclip import AdaClip
from dpclip.training.trainer import TrainConfig, train

OUT = Path(__file__).resolve().parent / "results" / "adaclip_diagnosis"
SIGMA = 1.4693  #: the PLD noise multiplier of the 40-epoch eps-2.7 run (lin-table2-fmnist)
D_PAPERNOT = 26010  #: trainable parameters of the Papernot CNN

BASE = dict(dataset="fashion-mnist", model="papernot-cnn", batch_size=1024, lr=0.25,
            optimizer="momentum", momentum=0.9, delta=1e-5, noise_multiplier=SIGMA)
ADA = {"initial_clip_norm": 0.4, "h1": 1e-3, "h2": 1e-5}
SETTINGS: dict[str, dict] = {
    "fixed C 0.4": {"strategy": "fixed", "strategy_params": {"clip_norm": 0.4}},
    "fixed C 0.4, noise x sqrt(B)": {"strategy": "fixed", "strategy_params": {"clip_norm": 0.4},
                                     "noise_multiplier": SIGMA * 32},
    "adaclip batch": {"strategy": "adaclip", "strategy_params": {**ADA, "noise_mode": "batch"}},
    "adaclip per_sample": {"strategy": "adaclip",
                           "strategy_params": {**ADA, "noise_mode": "per_sample"}},
    "adaclip per_sample, s fixed": {
        "strategy": "adaclip",
        "strategy_params": {"initial_clip_norm": math.sqrt(D_PAPERNOT * 1e-5), "h1": 1e-5,
                            "h2": 1e-5, "noise_mode": "per_sample"}},
    "adaclip per_sample, no centring": {
        "strategy": "adaclip", "strategy_params": {**ADA, "noise_mode": "per_sample"},
        "_no_centre": True},
}

_trace: list[dict[str, float]] = []
_orig_untransform = AdaClip.untransform
_orig_weights = AdaClip.weights
_no_centre = False


def _untransform(self, mean, state, noise_std):  # type: ignore[no-untyped-def]
    grads, new = _orig_untransform(self, mean, state, noise_std)
    if _no_centre:
        new = {**new, "m": {n: [0.0] * len(v) for n, v in new["m"].items()}}
    m = torch.tensor([x for v in new["m"].values() for x in v], dtype=torch.float64)
    shapes = {n: v.shape for n, v in mean.items()}
    _, s = self.moments(new, shapes)
    b = torch.cat([v.reshape(-1) for v in self.scales(s).values()])
    _trace.append({"m_norm": float(m.norm()), "b_median": float(b.median()),
                   "update_norm": float(torch.cat([g.reshape(-1) for g in grads.values()]).norm())})
    return grads, new


def _weights(self, norms, state):  # type: ignore[no-untyped-def]
    if norms.numel():
        _trace.append({"clipped": float((norms > 1).double().mean())})
    return _orig_weights(self, norms, state)


def main(argv: list[str] | None = None) -> int:
    global _no_centre
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="*", default=None, help="setting labels to run")
    args = ap.parse_args(argv)
    AdaClip.untransform = _untransform  # type: ignore[method-assign]
    AdaClip.weights = _weights  # type: ignore[method-assign]
    rows = json.loads(OUT.with_suffix(".json").read_text())["rows"] if OUT.with_suffix(
        ".json").exists() else []
    for label, change in SETTINGS.items():
        if args.only and label not in args.only:
            continue
        change = dict(change)
        _no_centre = bool(change.pop("_no_centre", False))
        _trace.clear()
        cfg = TrainConfig(**{**BASE, **change, "epochs": args.epochs, "seed": args.seed})
        res = train(cfg, progress=False)
        s = res.summary
        late = [t for t in _trace if "m_norm" in t][-20:]
        clipped = [t["clipped"] for t in _trace if "clipped" in t][-20:]
        row = {"setting": label, "strategy": cfg.strategy, "params": cfg.strategy_params,
               "noise_multiplier": cfg.noise_multiplier, "epochs": cfg.epochs, "seed": cfg.seed,
               "lr": cfg.lr, "batch_size": cfg.batch_size, "test_accuracy": s["test_accuracy"],
               "epsilon": s["epsilon"],
               "m_norm_late": statistics.mean(t["m_norm"] for t in late) if late else None,
               "b_median_late": statistics.mean(t["b_median"] for t in late) if late else None,
               "update_norm_late": (statistics.mean(t["update_norm"] for t in late)
                                    if late else None),
               "clipped_late": statistics.mean(clipped) if clipped else None,
               "device": "cpu (2 shared cores)", "torch": torch.__version__,
               "machine": platform.machine(), "kind": "diagnostic"}
        rows = [r for r in rows if not (r["setting"] == label and r["epochs"] == cfg.epochs
                                        and r["seed"] == cfg.seed)] + [row]
        print(label, s["test_accuracy"], file=sys.stderr)
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.with_suffix(".json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    _write_md(rows)
    return 0


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _write_md(rows: list[dict]) -> None:
    lines = ["# AdaClip with noise per sample: diagnosis (generated by "
             "reproductions/adaclip_diagnosis.py)", "",
             f"Papernot CNN (tanh), Fashion-MNIST, B 1024, lr 0.25, momentum 0.9, sigma {SIGMA} "
             "held fixed (the 40-epoch eps-2.7 value); a DIAGNOSTIC at equal sigma over a few "
             "epochs, not a reproduction. Last-20-step means: |m| (norm of the mean estimate), "
             "median b (coordinate scale), |update| (norm of the privatized gradient), clipped "
             "(fraction of examples with whitened norm > 1; NOT private, diagnostic only).", "",
             "| setting | sigma | epochs | seed | test acc (%) | \\|m\\| | median b | \\|update\\| "
             "| clipped |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['setting']} | {r['noise_multiplier']:.4g} | {r['epochs']} | {r['seed']} | "
            f"{100 * r['test_accuracy']:.2f} | {_fmt(r['m_norm_late'], '.3g')} | "
            f"{_fmt(r['b_median_late'], '.3g')} | {_fmt(r['update_norm_late'], '.3g')} | "
            f"{_fmt(r['clipped_late'], '.2f')} |")
    lines += ["", "Mean +- std over the seeds run (paired: each seed is one model initialisation "
              "shared by every setting):", "", "| setting | epochs | seeds | test acc (%) |",
              "|---|---|---|---|"]
    for label in dict.fromkeys(r["setting"] for r in rows):
        for ep in sorted({r["epochs"] for r in rows if r["setting"] == label}):
            accs = [100 * r["test_accuracy"] for r in rows
                    if r["setting"] == label and r["epochs"] == ep]
            lines.append(f"| {label} | {ep} | {len(accs)} | {statistics.mean(accs):.2f} +- "
                         f"{statistics.pstdev(accs):.2f} |")
    lines.append(f"\ntorch {torch.__version__}, cpu (2 shared cores).")
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
