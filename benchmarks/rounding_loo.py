"""Leave-one-out distance of the noise-free clipped sum when rounding depends on the batch
(seventy-sixth hostile review; docs/engines.md, "Rounding that depends on the batch size").

The model: ``Linear(4, 3)`` on a CONSTANT sequence (each example's first row repeated over ``T = 5``
positions), a LayerNorm over the positions (whose variance is then exactly zero, so it divides by
``sqrt(eps)``), a small side branch ``alpha * z`` and a linear head; inputs of scale 1e3, flat
clipping at C = 1e-2, cross-entropy. In exact arithmetic the Linear's gradient through the
LayerNorm cancels; computed, it is rounding noise of norm ~1e5, whose direction moves when the
backward's batched kernels round an example's row differently, which they do when another example
joins or leaves the batch. Each example's contribution is clipped to C, but which vector is
clipped for example i depends on the others: ``max_j ||S(X) - S(X without j)|| / C`` exceeds 1 by
whole multiples of C on every engine that batches, and grows with the batch (about ``0.7 sqrt(B)``),
while ``naive`` (each example alone) stays at 1 and float64 leaves nothing to amplify here.

The rows moved because MKL, without its conditional numerical reproducibility (CNR) mode, rounds
a row of a batched product by its memory alignment; ``import dpclip`` now switches MKL to CNR
``AUTO`` before its first call (``dpclip.blas_mode``). ``--mkl-first`` runs a product before
importing dpclip, as a script that computed before the import would: MKL then stays without CNR
(the rows of the table with mode ``off``).

    python benchmarks/rounding_loo.py [--engines naive,vmap,ghost,auto,compiled] [--batches 16,64]
                                      [--models linear,conv1x1] [--mkl-first] [--append]
    python benchmarks/rounding_loo.py --table

``--models conv1x1``: a 1x1 Conv2d on a constant image instead (seventy-eighth review: torch chose
the convolution's backend by the batch size; the engines now fix it for their call,
``dpclip.engine.conv_backends``); ``conv1x1-matrix``: its kernel built in the
forward from a 2-D weight (seventy-ninth review). ``--threads 2``: at batch 2, vmap ran a batch
of one off oneDNN. ``gelu``: a GELU between the Linear and the LayerNorm (seventy-ninth review:
torch's vector kernels round a tensor's last elements otherwise; ``DPCLIP_CPU_KERNELS=native``
runs them, the default runs torch's portable kernels, ``dpclip.blas_mode.kernels``).
``one-column``, ``few-rows``, ``batch-innermost``: a first stage whose rounding depends on the
number of rows (a product with one output column, products of 3 and 4 rows, a reduction with the
batch innermost in memory) scales the input of the same amplifier (eightieth review); the engines
now run every chunk on a multiple of 32 rows (``dpclip.engine.batch.padded_rows``).

Rows (model, MKL mode, engine, dtype, batch, LOO / C; device, torch version, date) go to
``benchmarks/results/rounding_loo_cpu.json`` and the Markdown table beside it. One thread.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "results" / "rounding_loo_cpu.json"
C, SCALE, EPS, ALPHA, T, D, H = 1e-2, 1e3, 1e-5, 1e-3, 5, 4, 3


class ConstantSequenceNorm(nn.Module):
    """Linear on a constant sequence, LayerNorm over the positions, a small side branch, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(D, H), nn.Linear(H * T, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.lin(x[:, :1].expand(x.shape[0], T, D)).transpose(1, 2)
        h = F.layer_norm(z, (T,), eps=EPS) * 3 + z * ALPHA
        return self.head(h.flatten(1))


class ConstantImageConv(nn.Module):
    """A 1x1 Conv2d on a constant 5x5 image, LayerNorm over the positions, a head (seventy-eighth
    review: torch ran the convolution on its own kernel below 16 examples, on oneDNN from 16 on)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv2d(D, H, 1), nn.Linear(H * 25, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.conv(x[:, 0, :, None, None].expand(x.shape[0], D, 5, 5)).flatten(2)
        return self.head((F.layer_norm(z, (25,), eps=EPS) * 3).flatten(1))


class MatrixConv(nn.Module):
    """A 1x1 convolution whose kernel its forward builds from a 2-D weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(H, D) / 2)
        self.bias = nn.Parameter(torch.zeros(H))

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return F.conv2d(v, self.weight[:, :, None, None], self.bias)


class ConstantImageConvOfAMatrix(ConstantImageConv):
    """The same with the 1x1 kernel built in the forward from a 2-D weight (seventy-ninth review:
    no look at the model's tensors tells that this call is a 1x1 convolution)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = MatrixConv()


class ConstantSequenceGelu(nn.Module):
    """A Linear on a constant sequence, GELU, a LayerNorm over the positions, a head; inputs of
    scale 1e6 and weights of 3e-6 keep GELU in its curved range (seventy-ninth review: torch's
    vector GELU computes a tensor's last elements with scalar code that rounds otherwise, and
    which examples lie there depends on the batch size; ``dpclip.blas_mode.kernels``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(D, H), nn.Linear(H * T, 5)
        with torch.no_grad():
            self.lin.weight.mul_(3e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.lin(x[:, :1].expand(x.shape[0], T, D) * 1e3).transpose(1, 2)
        return self.head((F.layer_norm(F.gelu(z), (T,), eps=EPS) * 3).flatten(1))


class ScaledBy(ConstantSequenceNorm):
    """A first stage whose rounding depends on the number of rows computes a scale ``s_i`` per
    example; the review-76 amplifier then runs on ``x_i * s_i`` (eightieth hostile review)."""

    def stage(self, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = x[:, 0, :D] * 1e-3
        s = self.stage(torch.cat([v, v * 0.7, v * 1.3, -v], 1))  # (B, 16) -> (B, 1)
        return super().forward((x[:, 1:, :] * s[:, :, None]).expand(x.shape[0], 2, D))


class OneColumn(ScaledBy):
    """``s_i = Linear(16, 1)(x_i)``: MKL's product with one output column rounds its last rows
    otherwise, which rows by the row count (2.47 C at batch 12 in review 80)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4 * D, 1)

    def stage(self, v: torch.Tensor) -> torch.Tensor:
        return self.pre(v)


class FewRows(ScaledBy):
    """``s_i`` the mean of ``Linear(16, 16)(x_i)``: MKL's products of 3 and of 4 rows round every
    row otherwise (1.92 C at batch 4 in review 80)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4 * D, 16)

    def stage(self, v: torch.Tensor) -> torch.Tensor:
        return self.pre(v).mean(1, keepdim=True)


class BatchInnermostSum(ScaledBy):
    """``s_i`` a sum over 6 features stored with the batch innermost (``(6, B)``, reduced over
    dimension 0): torch's reduction vectorises over the batch columns and sums the last ones on
    another path (4.93 C at batch 64 in review 80)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4 * D, 6)

    def stage(self, v: torch.Tensor) -> torch.Tensor:
        return self.pre(v).t().contiguous().sum(0)[:, None]


MODELS = {"linear": ConstantSequenceNorm, "conv1x1": ConstantImageConv,
          "conv1x1-matrix": ConstantImageConvOfAMatrix, "gelu": ConstantSequenceGelu,
          "one-column": OneColumn, "few-rows": FewRows, "batch-innermost": BatchInnermostSum}


def ce(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(o, y, reduction="none")


def loo(engine_name: str, batch: int, dtype: torch.dtype, seed: int = 0,
        model_name: str = "linear") -> float:
    """``max_j ||S(X) - S(X without j)|| / C`` on a later step (the engine's second call)."""
    from dpclip.engine import ParamGroups, get_engine

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(batch, 2, D, generator=g) * SCALE).to(dtype)
    y = torch.randint(0, 5, (batch,), generator=g)
    torch.manual_seed(seed)
    model = MODELS[model_name]().to(dtype)
    engine = get_engine(engine_name)
    groups = ParamGroups.flat(model)

    def weights(norms: torch.Tensor) -> torch.Tensor:
        return torch.clamp(C / norms, max=1.0)

    def total(xs, ys) -> torch.Tensor:
        res = engine.compute(model, ce, xs, ys, weights, groups)
        return torch.cat([t.reshape(-1) for t in res.grads.values()]).double()

    total(x, y)
    full = total(x, y)
    worst = 0.0
    for j in range(batch):
        keep = [i for i in range(batch) if i != j]
        worst = max(worst, float((full - total(x[keep], y[keep])).norm()) / C)
    return worst


def _loo_or_refused(engine_name: str, batch: int, dtype: torch.dtype, name: str) -> float | None:
    """:func:`loo`, or None where the engine refuses the model (the compiled engine and a module
    on the per-layer path)."""
    from dpclip.engine.errors import UnsupportedModelError

    try:
        return loo(engine_name, batch, dtype, model_name=name)
    except UnsupportedModelError:
        return None


def table(rows: list[dict]) -> str:
    meta = rows[-1]
    out = ["# Rounding that depends on the batch: leave-one-out / C (generated by "
           "benchmarks/rounding_loo.py)", "",
           f"torch {meta['torch']}, {meta['device']}, one thread, {meta['date']}; the model and "
           "setting in the script's docstring (C = 1e-2, LayerNorm eps 1e-5); a sound "
           "per-example mechanism stays at 1.", "",
           "| model | MKL mode | conv backend | torch kernels | threads | engine | dtype | batch | "
           "LOO / C |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r.get('model', 'linear')} | {r.get('mkl', '-')} | "
                   f"{r.get('conv', 'by batch size')} | {r.get('kernels', 'native')} | "
                   f"{r.get('threads', 1)} | {r['engine']} | "
                   f"{r['dtype']} | "
                   f"{r['batch']} | "
                   + ("refused" if r['loo_over_c'] is None else f"{r['loo_over_c']:.4f}") + " |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="naive,vmap,ghost,auto,compiled")
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--models", default="linear",
                    help=", ".join(MODELS) + " (comma-separated)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mkl-first", action="store_true",
                    help="run an MKL product before importing dpclip (MKL then stays without CNR)")
    ap.add_argument("--append", action="store_true", help="add to the rows instead of replacing")
    ap.add_argument("--table", action="store_true", help="only regenerate the .md from the .json")
    args = ap.parse_args()
    if not args.table:
        torch.set_num_threads(args.threads)
        if args.mkl_first:
            torch.randn(8, 8) @ torch.randn(8, 8)
        from dpclip import blas_mode

        rows = json.loads(OUT.read_text()) if args.append and OUT.exists() else []
        from dpclip.engine import _common

        # (the engines' fixed convolution backend: absent before review 78, by the model's
        # tensors in review 78's version, for every call at one thread since review 79)
        fixed = getattr(_common, "fixed_conv_backends", None)
        conv = "by batch size" if fixed is None else \
            "fixed (1x1 kernels seen)" if hasattr(_common, "_pointwise_kernel") else "fixed"
        # (torch's CPU kernels: vector ones before dpclip chose its portable ones at import)
        kernels = blas_mode.kernels() if hasattr(blas_mode, "kernels") else "native"
        cells = [(name, int(b), dt) for name in args.models.split(",")
                 for b in args.batches.split(",") for dt in (torch.float32, torch.float64)]
        for name, b, dt in cells:
            for e in args.engines.split(","):
                rows.append({"model": name, "mkl": blas_mode.mode(), "conv": conv,
                             "kernels": kernels, "engine": e,
                             "threads": args.threads,
                             "dtype": str(dt).removeprefix("torch."), "batch": b,
                             "loo_over_c": _loo_or_refused(e, b, dt, name), "device": "cpu",
                             "torch": torch.__version__,
                             "date": datetime.date.today().isoformat()})
                print(rows[-1], file=sys.stderr, flush=True)
        OUT.write_text(json.dumps(rows, indent=1) + "\n")
    rows = json.loads(OUT.read_text())
    OUT.with_suffix(".md").write_text(table(rows))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
