"""Step time of ordinary ``torch.nn`` models that ``auto`` sent to whole-model vmap (or refused)
before the ninth session: what ``auto`` runs now, against ``vmap`` (the old fallback) and the
non-private step, on the CPU.

    python benchmarks/torchnn_models.py [--batch 64] [--rounds 3] [--steps 5] [--models a,b]
    python benchmarks/torchnn_models.py --table

Rows go to ``benchmarks/results/torchnn_models_cpu.json`` (device, torch version, engine used,
per-layer modules, ms per step as the median over interleaved rounds), the Markdown table beside
it is generated from them. The steps are ``hf_models.stepper``'s (``dp_step`` on a fixed batch,
noise multiplier 1, clip 1, SGD), one thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "results" / "torchnn_models_cpu.json"


class Encoder(nn.Module):
    """A 2-layer ``nn.TransformerEncoder`` text classifier (embedding, positions, mean pool)."""

    def __init__(self, vocab: int = 1000, d: int = 64, t: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, t, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, 4, 128, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.fc = nn.Linear(d, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.enc(self.emb(ids) + self.pos).mean(1))


class LSTMText(nn.Module):
    """An embedding and a one-layer LSTM, the last output classified."""

    def __init__(self, vocab: int = 1000, d: int = 64, h: int = 128) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn = nn.LSTM(d, h, batch_first=True)
        self.fc = nn.Linear(h, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.rnn(self.emb(ids))[0][:, -1])


class UNetish(nn.Module):
    """Down, up (``nn.Upsample``), instance norm and PReLU: a small encoder-decoder head."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.InstanceNorm2d(16, affine=True),
                                  nn.PReLU(16), nn.MaxPool2d(2))
        self.up = nn.Sequential(nn.Upsample(scale_factor=2, mode="bilinear"),
                                nn.Conv2d(16, 8, 3, padding=1), nn.PReLU())
        self.fc = nn.Linear(8 * 28 * 28, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.up(self.down(x)).flatten(1))


class STN(nn.Module):
    """A spatial transformer in front of a small CNN (``F.affine_grid``, ``F.grid_sample``)."""

    def __init__(self) -> None:
        super().__init__()
        self.loc = nn.Sequential(nn.Conv2d(1, 8, 7), nn.MaxPool2d(2), nn.ReLU(), nn.Flatten(),
                                 nn.Linear(8 * 11 * 11, 6))
        with torch.no_grad():
            self.loc[-1].weight.zero_()
            self.loc[-1].bias.copy_(torch.tensor([1.0, 0, 0, 0, 1, 0]))
        self.cnn = nn.Sequential(nn.Conv2d(1, 16, 5), nn.MaxPool2d(2), nn.ReLU(), nn.Flatten(),
                                 nn.Linear(16 * 12 * 12, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = F.affine_grid(self.loc(x).view(-1, 2, 3), list(x.shape), align_corners=False)
        return self.cnn(F.grid_sample(x, grid, align_corners=False))


MODELS = {
    "transformer-encoder": (Encoder, lambda b: torch.randint(0, 1000, (b, 32)), 4),
    "lstm-text": (LSTMText, lambda b: torch.randint(0, 1000, (b, 32)), 4),
    "unet-instancenorm-prelu": (UNetish, lambda b: torch.randn(b, 1, 28, 28), 10),
    "spatial-transformer": (STN, lambda b: torch.randn(b, 1, 28, 28), 10),
}
METHODS = ("nonprivate", "dpclip-auto", "dpclip-vmap")


def _ce(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(o, y, reduction="none")


def run(names: list[str], batch: int, rounds: int, steps: int) -> list[dict]:
    from hf_models import stepper

    rows = []
    for name in names:
        build, data, classes = MODELS[name]
        torch.manual_seed(0)
        base = build()
        x, y = data(batch), torch.randint(0, classes, (batch,))
        steps_of, infos, times = {}, {}, {m: [] for m in METHODS}
        for m in METHODS:
            try:
                step, info = stepper(m, base, x, y, _ce, torch.device("cpu"))
                step()
                step()  # warm-up: the proof, caches
                steps_of[m], infos[m] = step, info
            except Exception as exc:  # noqa: BLE001 - recorded as the row's error
                infos[m] = lambda exc=exc: {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        for _ in range(rounds):  # interleaved: the methods see the same machine
            for m, step in steps_of.items():
                t = time.perf_counter()
                for _ in range(steps):
                    step()
                times[m].append((time.perf_counter() - t) / steps * 1e3)
        base_ms = statistics.median(times["nonprivate"]) if times["nonprivate"] else None
        for m in METHODS:
            ms = statistics.median(times[m]) if times[m] else None
            rows.append({"model": name, "batch": batch, "method": m, "ms_per_step": ms,
                         "x_nonprivate": (ms / base_ms) if ms and base_ms else None,
                         "rounds": rounds, "steps_per_round": steps, **infos[m](),
                         "device": "cpu (1 thread)", "torch": torch.__version__})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["# torch.nn models that auto sent to vmap (or refused) before, CPU step time "
             "(generated from the .json by benchmarks/torchnn_models.py)", "",
             "Median of interleaved rounds, one thread, `dp_step` on a fixed batch (noise "
             "multiplier 1, clip 1, SGD). `dpclip-vmap` is what `auto` ran before for these models "
             "(for the LSTM it failed: vmap has no rule for the fused kernel).", "",
             "| model | batch | method | ms/step | x non-private | engine | per-layer modules | "
             "error | torch |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = f"{r['ms_per_step']:.1f}" if r.get("ms_per_step") else ""
        x = f"{r['x_nonprivate']:.2f}" if r.get("x_nonprivate") else ""
        pl = ", ".join(r.get("per_layer") or []) if r.get("per_layer") else ""
        lines.append(f"| {r['model']} | {r['batch']} | {r['method']} | {ms} | {x} | "
                     f"{r.get('engine') or ''} | {pl} | {r.get('error', '')} | {r['torch']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--table", action="store_true", help="only regenerate the Markdown table")
    a = ap.parse_args()
    if not a.table:
        torch.set_num_threads(1)
        rows = run(a.models.split(","), a.batch, a.rounds, a.steps)
        OUT.write_text(json.dumps(rows, indent=1) + "\n")
    rows = json.loads(OUT.read_text())
    OUT.with_suffix(".md").write_text(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
