"""A/B step time of the ghost engine on a tiny Hugging Face BERT called from a user module: the
TRACED path (the batch-size proof's match, the autograd-history and memory checks run at every
step), which the ``dpclip bench`` cells (dpclip's own known programs) do not exercise.

    python benchmarks/ab_traced_hf.py --base /tmp/base/src [--candidate src] [--rounds 3]
        [--threads 1] [--revs BASE_REV,CAND_REV] [--name cpu_session23_traced_hf]

Each round runs the baseline's and the candidate's tree in a child process, one after the other
(the same shared machine for both); a child times 5 ghost steps and 5 non-private steps (forward,
loss, backward) after 2 warm-up steps each and reports the medians. Rows go to
``benchmarks/results/<name>.json`` with a Markdown table beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from datetime import date
from pathlib import Path

CHILD = r'''
import json, sys, time
import torch
from torch import nn
torch.set_num_threads(int(sys.argv[1]))
from transformers import BertConfig, BertForSequenceClassification
from dpclip.engine import ParamGroups, get_engine
torch.manual_seed(0)
cfg = BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, max_position_embeddings=64, num_labels=2)
model = BertForSequenceClassification(cfg).eval()
B, T = 32, 32
ids = torch.randint(0, 1000, (B, T)); y = torch.randint(0, 2, (B,))
def loss(o, t):
    return nn.functional.cross_entropy(o.logits, t, reduction="none")
class Wrap(nn.Module):
    def __init__(self, m):
        super().__init__(); self.m = m
    def forward(self, x):
        return self.m(input_ids=x)
w = Wrap(model)
eng, g = get_engine("ghost"), ParamGroups.flat(w)
wf = lambda n: torch.clamp(1.0 / n, max=1.0)
def med(f):
    for _ in range(2):
        f()
    ts = []
    for _ in range(5):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return sorted(ts)[2]
info = {}
def ghost():
    info.update(eng.compute(w, loss, ids, y, wf, g).engine_info)
def nonprivate():
    model.zero_grad(); loss(w(ids), y).sum().backward()
out = {"ms_dpclip_ghost": 1e3 * med(ghost), "ms_nonprivate": 1e3 * med(nonprivate)}
out["engine"] = info.get("engine")
out["torch"] = torch.__version__
print(json.dumps(out))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the baseline's src folder")
    ap.add_argument("--candidate", default="src")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--revs", default="base,candidate")
    ap.add_argument("--name", default="cpu_traced_hf_ab")
    args = ap.parse_args()
    revs = dict(zip(("base", "candidate"), args.revs.split(",")))
    rows = []
    for r in range(args.rounds):
        for tree, src in (("base", args.base), ("candidate", args.candidate)):
            env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()),
                       OMP_NUM_THREADS=str(args.threads))
            got = subprocess.run([sys.executable, "-c", CHILD, str(args.threads)], env=env,
                                 capture_output=True, text=True, check=True)
            row = json.loads(got.stdout.strip().splitlines()[-1])
            row.update(round=r, tree=tree, revision=revs[tree], model="tiny BERT (user module)",
                       batch_size=32, seq_len=32, device="cpu", threads=args.threads,
                       date=str(date.today()))
            row["ratio_to_nonprivate"] = row["ms_dpclip_ghost"] / row["ms_nonprivate"]
            rows.append(row)
            print(f"round {r} {tree}: ghost {row['ms_dpclip_ghost']:.1f} ms, non-private "
                  f"{row['ms_nonprivate']:.1f} ms ({row['engine']})", flush=True)
    out = Path(__file__).parent / "results"
    (out / f"{args.name}.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [f"# {args.name}: ghost on a tiny BERT through a user module (traced path)", "",
             f"CPU, {args.threads} thread(s), torch {rows[0]['torch']}, {args.rounds} interleaved "
             "rounds; medians of 5 steps per child.", "",
             "| tree | revision | ms ghost (median of rounds) | ms non-private | x non-private |",
             "|---|---|---|---|---|"]
    for tree in ("base", "candidate"):
        rs = [x for x in rows if x["tree"] == tree]
        lines.append(f"| {tree} | {revs[tree]} | "
                     f"{statistics.median(x['ms_dpclip_ghost'] for x in rs):.1f} | "
                     f"{statistics.median(x['ms_nonprivate'] for x in rs):.1f} | "
                     f"{statistics.median(x['ratio_to_nonprivate'] for x in rs):.2f} |")
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
