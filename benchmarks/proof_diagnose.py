"""Why the batch-size proof refuses a Hugging Face model on this machine: runs the proof's own
export (``dpclip.engine.batch_symbol._export_check``'s call: ``torch.export`` with a symbolic batch,
the eager kernels, the compile flags of the real run) on the benchmark models with one layer, and
prints the FULL export error (not masked: random data, public) with the guard that specialised
the batch and the user frame that added it (``TORCH_LOGS=+dynamic`` style logging of
``torch.fx.experimental.symbolic_shapes``).

    python benchmarks/proof_diagnose.py [--device cuda] [--models bert,gpt2,llama,vit] [--size base]

Made for the GPU machines, where torch 2.11 refused every model with "Constraints violated
(batch)" while torch 2.13 on the CPU proves them (benchmarks/results/hf_models_cuda.md).
"""

from __future__ import annotations

import argparse
import io
import logging
import sys
import traceback
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default="bert,gpt2,llama,vit")
    ap.add_argument("--size", default="base", choices=["small", "base"])
    ap.add_argument("--layers", type=int, default=1)
    args = ap.parse_args()
    import hf_models as H
    from torch.export import Dim, export

    from dpclip.engine import batch_symbol as bs

    dev = torch.device(args.device)
    print("torch", torch.__version__, "device", dev, flush=True)
    log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    for name in args.models.split(","):
        s = H.sizes(args.size)
        s["layers"] = args.layers
        model, x, y, loss_fn = H.build(name, s, "eager")
        model = model.to(dev).train()
        x, y = H._to(x, dev), y.to(dev)
        buf = io.StringIO()
        handler = logging.StreamHandler(buf)
        handler.setLevel(logging.DEBUG)
        log.addHandler(handler)
        old = log.level
        log.setLevel(logging.DEBUG)
        try:
            traced = bs._LossOfModel(model, loss_fn, ())
            batch_dim = Dim("batch", min=2)
            dynamic = pytree.tree_map(
                lambda t: {0: batch_dim} if isinstance(t, torch.Tensor) else None, (x, y))
            with bs._eager_kernels():
                export(traced, (x, y), dynamic_shapes=dynamic, strict=False)
            print(f"== {name}: exported; verdict: {bs.batch_size_uses(model, loss_fn, x, y)}",
                  flush=True)
        except Exception as exc:  # noqa: BLE001 - the diagnosis is the point
            print(f"== {name}: {type(exc).__name__}\n{str(exc)[:4000]}", flush=True)
            print("".join(traceback.format_exception(exc)[-12:])[-3000:], flush=True)
        finally:
            log.removeHandler(handler)
            log.setLevel(old)
        # the same export with an upper bound on the batch (a guard such as 32-bit indexing bounds
        # it from above), then with the model and data on the CPU (device-dependent kernels)
        for label, dim, dev2 in (("max 2**12", Dim("batch", min=2, max=4096), dev),
                                 ("max 2**8", Dim("batch", min=2, max=256), dev),
                                 ("on the cpu", Dim("batch", min=2), torch.device("cpu"))):
            try:
                m2, x2, y2 = model.to(dev2), H._to(x, dev2), y.to(dev2)
                traced = bs._LossOfModel(m2, loss_fn, ())
                dynamic = pytree.tree_map(
                    lambda t, d=dim: {0: d} if isinstance(t, torch.Tensor) else None, (x2, y2))
                with bs._eager_kernels():
                    ep = export(traced, (x2, y2), dynamic_shapes=dynamic, strict=False)
                print(f"== {name} [{label}]: exported; graph check: {bs._check_graph(ep)}",
                      flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"== {name} [{label}]: {type(exc).__name__}: {str(exc)[:600]}", flush=True)
        model.to(dev)
        lines = [ln for ln in buf.getvalue().splitlines()
                 if "statically known" not in ln and any(
                     k in ln for k in ("guard added", "specializ", "set_replacement", "Eq("))]
        print(f"-- {name}: {len(lines)} guard / specialisation log lines (last 40):")
        print("\n".join(ln[:400] for ln in lines[-40:]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
