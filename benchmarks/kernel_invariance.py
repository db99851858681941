"""Does an element's value depend on where it lies in the tensor? For every pointwise operator of
torch's CPU kernels (each overload of an ``aten`` operator tagged pointwise whose required arguments are
one, two or three tensors and then scalars), the first ``L`` rows computed alone are compared with the same rows computed
inside a longer tensor, for many ``L`` (every scalar tail), at 1 and 2 threads, in four layouts
(contiguous, transposed, broadcast against a row, a 0-dim operand); prints the operators whose
rows change and exits 1 if any does. Run it under each kernel choice (``dpclip.blas_mode``):

    python benchmarks/kernel_invariance.py                           # dpclip's default (exact)
    DPCLIP_CPU_KERNELS=native python benchmarks/kernel_invariance.py # torch's vector kernels

``tests/engine/test_cpu_kernels.py`` runs it both ways.
"""

from __future__ import annotations

import argparse
import json
import sys

from dpclip import blas_mode  # (first: importing dpclip chooses torch's CPU kernels)
import torch

DOMAINS = {  # (scale, shift): normal, positive, inside (-1, 1), huge
    "normal": (3.0, 0.0), "positive": (1.5, 1.6), "unit": (0.45, 0.0), "huge": (1e16, 0.0),
}
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--json", action="store_true", help="print the findings as JSON")
    args = ap.parse_args(argv)
    found = []
    for t in (int(v) for v in args.threads.split(",")):
        found += sweep(t)
    if args.json:
        print(json.dumps({"kernels": blas_mode.kernels(),
                          "capability": torch.backends.cpu.get_cpu_capability(),
                          "operators": [len(_operators(k)) for k in (1, 2, 3)],
                          "varying": found}))
    else:
        print(f"kernels {blas_mode.kernels()} ({torch.backends.cpu.get_cpu_capability()}): "
              f"{len(_operators(1))} unary, {len(_operators(2))} binary, {len(_operators(3))} "
              "ternary pointwise operators")
        for f in found:
            print(f"  rows move: {f['op']} ({f['domain']}, {f['layout']}, {f['threads']} threads): "
                  f"{f['elements']} elements")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
