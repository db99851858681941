"""Does an element's value depend on where it lies in the tensor? For every pointwise operator of
torch's CPU kernels (each overload of an ``aten`` operator tagged pointwise whose required arguments are
one, two or three tensors and then scalars), the first ``L`` rows computed alone are compared with the same rows computed
inside a longer tensor, for many ``L`` (every scalar tail), at 1 and 2 threads, in four layouts
(contiguous, transposed, broadcast against a row, a 0-dim operand); prints the operators whose
rows change and exits 1 if any does. Run it under each kernel choice (``dpclip.blas_mode``):

    python benchmarks/kernel_invariance.py                           # dpclip's default (exact)
    DPCLIP_CPU_KERNELS=native python benchmarks/kernel_invariance.py # torch's vector kernels

``tests/engine/test_cpu_kernels.py`` runs it both ways. ``--record`` adds the result as a row of
``benchmarks/results/kernel_invariance_cpu.json`` (the Markdown table beside it is regenerated).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

from dpclip import blas_mode  # (first: importing dpclip chooses torch's CPU kernels)
import torch

DOMAINS = {  # (scale, shift): normal, positive, inside (-1, 1), huge
    "normal": (3.0, 0.0), "positive": (1.5, 1.6), "unit": (0.45, 0.0), "huge": (1e16, 0.0),
}
OUT = Path(__file__).resolve().parent / "results" / "kernel_invariance_cpu.json"
ROWS = list(range(2, 70)) + [300, 1000, 4999]
WIDTH = 7


#: a value for each required non-tensor argument, by its type
SCALARS = {"Scalar": 0.7, "float": 0.7, "int": 2, "SymInt": 2}
OVERLOADS = ("default", "Tensor", "Tensor_Tensor", "Tensor_Scalar", "Scalar")


def _operators(n_tensors: int) -> list[tuple[str, object, tuple]]:
    """(name, operator, the required non-tensor arguments after the tensors) of every pointwise
    operator with ``n_tensors`` required tensor arguments (leading) and scalars after them."""
    found = []
    for name in sorted(dir(torch.ops.aten)):
        try:
            packet = getattr(torch.ops.aten, name)
            overloads = packet.overloads()
        except (AttributeError, RuntimeError):
            continue
        for ov in overloads:
            if ov not in OVERLOADS:
                continue
            op = getattr(packet, ov)
            if torch.Tag.pointwise not in op.tags or op._schema.is_mutable:
                continue
            req = [a for a in op._schema.arguments
                   if not a.has_default_value() and not a.kwarg_only]
            kinds = [str(a.type) for a in req]
            if kinds[:n_tensors] != ["Tensor"] * n_tensors or \
                    any(k not in SCALARS for k in kinds[n_tensors:]):
                continue
            found.append((f"{name}.{ov}", op, tuple(SCALARS[k] for k in kinds[n_tensors:])))
    return found


def _col(t: torch.Tensor) -> torch.Tensor:
    """the same values stored column by column (the rows, the batch, innermost)"""
    return t.t().contiguous().t()


#: layout -> (the operands of a batch of rows ``x``, ``y``, ``z``): each batch built as the engine
#: holds it (a tensor of its own, never a slice of a longer one)
LAYOUTS = {
    "contiguous": lambda x, y, z: (x.clone(), y.clone(), z.clone()),
    "transposed": lambda x, y, z: (_col(x), _col(y), _col(z)),
    "broadcast": lambda x, y, z: (x.clone(), y[0].clone(), z[0].clone()),
    "zero-dim": lambda x, y, z: (x.clone(), y[0, 0].clone(), z[0, 0].clone()),
}


import torch.nn.functional as F  # noqa: E402

_W3 = torch.randn(4, 3, 3, generator=torch.Generator().manual_seed(1))
_WM = torch.randn(9, 5, generator=torch.Generator().manual_seed(2))
#: operators that reduce or mix within an example's own elements: name -> f(a batch (rows, W));
#: each row's result must not depend on the other rows
ROW_OPS = {
    "softmax": lambda t: t.softmax(-1),
    "log_softmax": lambda t: t.log_softmax(-1),
    "softmax(dim=1 of 3)": lambda t: t.view(t.shape[0], -1, 1).expand(-1, -1, 3).softmax(1),
    "layer_norm": lambda t: F.layer_norm(t, t.shape[-1:]),
    "rms_norm": lambda t: F.rms_norm(t, t.shape[-1:]),
    "group_norm": lambda t: F.group_norm(t[:, None, :].expand(-1, 2, -1).contiguous(), 1),
    "sum": lambda t: t.sum(-1), "mean": lambda t: t.mean(-1), "norm": lambda t: t.norm(dim=-1),
    "var": lambda t: t.var(-1), "logsumexp": lambda t: t.logsumexp(-1),
    "amax": lambda t: t.amax(-1), "cumsum": lambda t: t.cumsum(-1),
    "cumprod": lambda t: (t / 4).cumprod(-1),
    "sort": lambda t: t.sort(-1).values,
    "avg_pool1d": lambda t: F.avg_pool1d(t[:, None, :], 2, ceil_mode=True),
    "max_pool1d": lambda t: F.max_pool1d(t[:, None, :], 2, ceil_mode=True),
    "interpolate": lambda t: F.interpolate(t[:, None, :], scale_factor=1.7, mode="linear"),
    "conv1d": lambda t: F.conv1d(t[:, None, :].expand(-1, 3, -1).contiguous(), _W3, padding=1),
    "linear": lambda t: F.linear(t[:, :5] if t.shape[1] >= 5 else F.pad(t, (0, 5 - t.shape[1])),
                                 _WM),
    "bmm": lambda t: torch.bmm(t[:, :, None], t[:, None, :]),
}
ROW_WIDTHS = (3, 7, 16, 33, 100)


def sweep_rows(threads: int) -> list[dict]:
    """:data:`ROW_OPS` on batches of rows of each width: rows computed alone against the same
    rows of a longer batch."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(3)
    varying = []
    for width in ROW_WIDTHS:
        x = torch.randn(ROWS[-1] + 1, width, generator=g) * 3
        for name, f in ROW_OPS.items():
            whole = f(x)
            moved = 0
            for rows in ROWS:
                part, ref = f(x[:rows].clone()), whole[:rows]
                moved += int(((part != ref) & ~(part.isnan() & ref.isnan())).sum())
            if moved:
                varying.append({"op": name, "domain": "normal", "layout": f"rows of {width}",
                                "threads": threads, "elements": moved})
    return varying


#: activations checked on padded batches split between threads (:func:`sweep_padded`)
PADDED_OPS = {"gelu": F.gelu, "silu": F.silu, "mish": F.mish, "softplus": F.softplus,
              "sigmoid": torch.sigmoid, "elu": F.elu, "tanh": torch.tanh, "exp": torch.exp}


def sweep_padded(threads: int, width: int = 701) -> list[dict]:
    """The engines' case: a batch of ``n`` examples padded to a multiple of 32 rows with copies
    of the first (``dpclip.engine.batch.padded_rows``), rows of an odd width (so a tensor split
    between threads ends a share inside an example), one example removed: do the others' rows
    change?"""
    from dpclip.engine.batch import pad_rows, padded_rows

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(4)
    y = torch.randn(260, width, generator=g) * 3
    varying = []
    for name, f in PADDED_OPS.items():
        moved = 0
        for n in range(2, 200, 3):
            full = f(pad_rows(y[:n], padded_rows(n)))[:n]
            for j in (0, n // 2):
                keep = [i for i in range(n) if i != j]
                less = f(pad_rows(y[keep], padded_rows(n - 1)))[:n - 1]
                moved += int((full[keep] != less).sum())
        if moved:
            varying.append({"op": f"{name} (padded rows)", "domain": "normal",
                            "layout": f"padded rows of {width}",
                            "threads": threads, "elements": moved})
    return varying


def sweep(threads: int) -> list[dict]:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    n = ROWS[-1] + 1
    varying = []
    for arity in (1, 2, 3):
        for name, op, extra in _operators(arity):
            for dom, (scale, shift) in DOMAINS.items():
                x = torch.randn(n, WIDTH, generator=g) * scale + shift
                y = torch.rand(n, WIDTH, generator=g) * 2 + 0.1
                z = torch.rand(n, WIDTH, generator=g) * 2 - 1
                for lay, make in LAYOUTS.items():
                    if arity == 1 and lay not in ("contiguous", "transposed"):
                        continue
                    args = make(x, y, z)[:arity] + extra
                    try:
                        whole = op(*args)
                    except (RuntimeError, TypeError, NotImplementedError):
                        break
                    if not isinstance(whole, torch.Tensor) or not whole.is_floating_point() or \
                            whole.shape != x.shape:
                        break
                    moved = 0
                    for rows in ROWS:
                        part = op(*make(x[:rows], y[:rows], z[:rows])[:arity], *extra)
                        ref = whole[:rows]
                        moved += int(((part != ref) & ~(part.isnan() & ref.isnan())).sum())
                    if moved:
                        varying.append({"op": name, "domain": dom, "layout": lay,
                                        "threads": threads, "elements": moved})
    return varying


def table(rows: list[dict]) -> str:
    out = ["# Pointwise operators whose elements round by their place in the batch (generated by "
           "benchmarks/kernel_invariance.py)", "",
           "Each row: one sweep of every pointwise operator of torch (unary, binary, ternary; "
           "four layouts, four value ranges, batches of 2 to 4999 rows of 7), and of operators "
           "that reduce or mix an example's own elements (`ROW_OPS`: softmax, norms, pools, "
           "convolution, products...; rows of 3 to 100), and of activations on batches padded to "
           "the engines' row block with one example removed (`PADDED_OPS`, rows of 701), under "
           "one kernel "
           "choice (`dpclip.blas_mode.kernels`); an operator moves when a row computed in a "
           "shorter batch differs, in any bit, from the same row in a longer one.", "",
           "| kernels | torch capability | pointwise operators (1/2/3 tensors) | row operators | "
           "threads | operators that move | torch | date |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        moved = ", ".join(m.removesuffix(".default") for m in r["operators_moved"]) or "none"
        out.append(f"| {r['kernels']} | {r['capability']} | "
                   f"{'/'.join(map(str, r['operators']))} | {r.get('row_operators', '-')} | "
                   f"{r['threads']} | "
                   f"{len(r['operators_moved'])}: {moved} | {r['torch']} | {r['date']} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--json", action="store_true", help="print the findings as JSON")
    ap.add_argument("--record", action="store_true",
                    help=f"add a row to {OUT.relative_to(OUT.parents[2])} and its table")
    args = ap.parse_args(argv)
    found = []
    for t in (int(v) for v in args.threads.split(",")):
        found += sweep(t) + sweep_rows(t) + sweep_padded(t)
    if args.record:
        rows = json.loads(OUT.read_text()) if OUT.exists() else []
        rows.append({"kernels": blas_mode.kernels(),
                     "capability": torch.backends.cpu.get_cpu_capability(),
                     "operators": [len(_operators(k)) for k in (1, 2, 3)],
                     "row_operators": len(ROW_OPS), "threads": args.threads,
                     "operators_moved": sorted({f["op"] for f in found}),
                     "device": "cpu", "cpu": platform.processor() or platform.machine(),
                     "torch": torch.__version__, "date": datetime.date.today().isoformat()})
        OUT.write_text(json.dumps(rows, indent=1) + "\n")
        OUT.with_suffix(".md").write_text(table(rows))
    if args.json:
        print(json.dumps({"kernels": blas_mode.kernels(),
                          "capability": torch.backends.cpu.get_cpu_capability(),
                          "operators": [len(_operators(k)) for k in (1, 2, 3)],
                          "varying": found}))
    else:
        print(f"kernels {blas_mode.kernels()} ({torch.backends.cpu.get_cpu_capability()}): "
              f"{len(_operators(1))} unary, {len(_operators(2))} binary, {len(_operators(3))} "
              f"ternary pointwise operators, {len(ROW_OPS)} row operators")
        for f in found:
            print(f"  rows move: {f['op']} ({f['domain']}, {f['layout']}, {f['threads']} threads): "
                  f"{f['elements']} elements")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
