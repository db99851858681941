"""Can ``torch.compile``'s frontend (Dynamo) capture a training step's forward and loss as ONE graph
with a symbolic batch size, for the Hugging Face zoo? (issue 31, item 7: the road to "pay the
proof once per program, not once per operation per step")

Measurement only: nothing here is used by the engines. The ghost engine today proves a step by
tracing the user's forward on EVERY step (the real-batch separability tracer, the match against the
proved program, the memory watch: ~28 of the ~50 ms of a tiny BERT step on this CPU, and one
byte copy of every activation, which no GPU memory criterion of issue 31 survives). A graph
captured once with the guards that say when it is still the program (Dynamo's job for
``torch.compile``) would let a step run the proved graph itself: no user code in the step, so none
of the per-operation checks. This probe records, per zoo model (the tiny float64 configs of
``hf_zoo_coverage.py``, batch 3, eval mode), whether that capture works:

* ``captured``: ``torch.compile(step, backend=<record the FX graph>, fullgraph=True,
  dynamic=True)`` of ``loss_fn(model(**inputs), targets)`` succeeded (no graph break), else the
  first line of the error;
* ``nodes`` / ``param_inputs``: FX nodes of the graph, and how many graph inputs are the model's
  parameters (lifted as inputs: every use of a parameter is a node of the graph);
* ``guards``: the number of guards Dynamo installed (``torch._dynamo.explain``);
* ``batch_2``: whether a batch of 2 reused the graph (the batch dimension symbolic) or recompiled
  (a specialisation on the batch size: the graph would then depend on the private batch size);
* ``compile_s``, ``eager_ms``, ``compiled_ms``: the capture's time, and the median time of the
  eager and the captured forward + loss (the captured graph run as the FX module's Python code).

    python benchmarks/dynamo_capture_probe.py [--models bert,gpt2,...]
    python benchmarks/dynamo_capture_probe.py --table

Rows go to ``benchmarks/results/dynamo_capture_probe_cpu.json`` (torch and transformers versions,
date), the Markdown table beside it is generated from them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))
OUT = ROOT / "results" / "dynamo_capture_probe_cpu.json"

import transformers as T  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import hf_zoo_coverage as Z  # noqa: E402

DT = torch.float64


def _median_ms(fn, n: int = 15) -> float:
    for _ in range(2):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def probe(name: str) -> dict:
    import torch._dynamo as dynamo
    import torch.fx.experimental._config as fx_config

    # no duck shaping: sizes that happen to be equal (batch 3, 3 channels) are not one symbol,
    # else a check on the channels specialises the batch size too
    fx_config.use_duck_shape = False
    dynamo.reset()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    m, x, y, loss = Z.build(name, g)
    m = m.to(DT).eval()
    xs = {k: (v.to(DT) if v.is_floating_point() else v) for k, v in x.items()}
    row: dict = {"model": name, "class": type(m).__name__}
    graphs: list = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(inputs, targets):
        return loss(m(**inputs), targets)

    t0 = time.perf_counter()
    try:
        compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=True)
        compiled(xs, y)
    except Exception as exc:  # noqa: BLE001 - recorded: not captured as one graph
        row.update(captured=False, reason=f"{type(exc).__name__}: "
                   + (str(exc).strip().splitlines() or [""])[0][:240])
        return row
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    gm = graphs[-1]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    row.update(captured=True, nodes=len(gm.graph.nodes),
               param_inputs=sum("parameters" in n.name for n in placeholders),
               params=sum(1 for _ in m.parameters()))
    n_graphs = len(graphs)
    memo: dict[int, torch.Tensor] = {}  # (a causal LM's targets ARE its input ids: kept so)

    def cut(t: torch.Tensor) -> torch.Tensor:
        return memo.setdefault(id(t), t[:2])

    try:
        compiled({k: cut(v) for k, v in xs.items()}, cut(y))
        row["batch_2"] = "reused" if len(graphs) == n_graphs else "recompiled"
    except Exception as exc:  # noqa: BLE001
        row["batch_2"] = f"failed ({type(exc).__name__})"
    try:
        dynamo.reset()
        ex = dynamo.explain(step)(xs, y)
        row["guards"] = len(ex.out_guards or [])
        row["graph_breaks"] = ex.graph_break_count
    except Exception as exc:  # noqa: BLE001
        row["guards"] = None
        row["explain_error"] = f"{type(exc).__name__}"
    dynamo.reset()
    graphs.clear()
    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=True)
    row["eager_ms"] = round(_median_ms(lambda: step(xs, y)), 3)
    row["compiled_ms"] = round(_median_ms(lambda: compiled(xs, y)), 3)
    return row


def table(rows: list[dict]) -> str:
    r0 = rows[0]
    out = ["# Dynamo capture of the zoo's training forward + loss (generated by "
           "benchmarks/dynamo_capture_probe.py)", "",
           f"Measurement only. transformers {r0.get('transformers')}, torch {r0.get('torch')}, "
           f"{r0.get('date')}, CPU, 1 thread; tiny float64 configs of hf_zoo_coverage.py, batch 3, "
           "eval mode. `fullgraph=True, dynamic=True`; *batch 2*: whether a batch of 2 reused the "
           "graph (batch symbolic) or recompiled; *param inputs*: parameters lifted as graph "
           "inputs (of the model's parameters); times: medians of the eager and the captured "
           "forward + loss.", "",
           "| model | class | captured | nodes | param inputs | guards | batch 2 | compile s "
           "| eager ms | captured ms | why not |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("captured"):
            out.append(f"| {r['model']} | {r['class']} | yes | {r['nodes']} | "
                       f"{r['param_inputs']}/{r['params']} | {r.get('guards', '-')} | "
                       f"{r.get('batch_2', '-')} | {r['compile_s']} | {r['eager_ms']} | "
                       f"{r['compiled_ms']} | - |")
        else:
            why = r.get("reason", "").replace("|", "/")
            out.append(f"| {r['model']} | {r['class']} | no | - | - | - | - | - | - | - | {why} |")
    n = sum(1 for r in rows if r.get("captured"))
    reused = sum(1 for r in rows if r.get("batch_2") == "reused")
    out += ["", f"Captured as one graph: {n} of {len(rows)}; batch symbolic (a batch of 2 reused "
            f"the graph): {reused}."]
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(Z.MODELS))
    ap.add_argument("--table", action="store_true", help="only regenerate the Markdown table")
    args = ap.parse_args()
    if not args.table:
        warnings.filterwarnings("ignore")
        hf_logging.set_verbosity_error()
        torch.set_num_threads(1)
        old = {r["model"]: r for r in json.loads(OUT.read_text())} if OUT.exists() else {}
        for name in args.models.split(","):
            row = probe(name)
            row.update(torch=torch.__version__, transformers=T.__version__,
                       date=datetime.date.today().isoformat())
            old[name] = row
            print(json.dumps(row), flush=True)
        order = {m: i for i, m in enumerate(Z.MODELS)}
        rows = sorted(old.values(), key=lambda r: order.get(r["model"], len(order)))
        OUT.write_text(json.dumps(rows, indent=1) + "\n")
    rows = json.loads(OUT.read_text())
    md = table(rows)
    OUT.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
