"""How loose is the Lip-DP-SGD certificate? Certified vs realised per-example gradient norms.

DIAGNOSTICS ONLY, NON-PRIVATE: the realised norms are measured on Fashion-MNIST TEST examples
(held out, never trained on) with a model whose weights are either freshly initialised or read
from a harness checkpoint of a private run; nothing here is noised or accounted, and nothing feeds
back into training.

For each model and layer ``k`` (reading R2, inputs clipped to ``X_0``, loss ``CE(z / tau)``):

* ``cert_k`` = the certificate's ``Delta_k`` (what the noise of layer k's block is calibrated to);
* per-example R2-scaled gradient norms ``||grad_k l_i|| / X_{k-1}`` (``torch.func.vmap(grad)``),
  their max and median, and ``cert_k / median`` (how many times the noise scale exceeds a typical
  example's contribution);
* whole-model: ``Delta``, the mean gradient's norm ``||(1/n) sum_i g_i||`` over the ``n`` examples
  (the signal of one step at batch ``B``), the norm of the step's noise on the mean gradient
  ``z Delta sqrt(d) / B`` with the run's ``z`` (from the harness sigma at B = 512, eps 3), and
  their ratio (noise-to-signal).

    python reproductions/lipdp_certificate_gap.py --out reproductions/results/lipdp-fmnist-orth-gap.json \
        [--checkpoint /work/lip_out/checkpoints/<fingerprint>/checkpoint.pt ...]

writes the rows (JSON) and a Markdown table generated from them (same stem, ``.md``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

import torch
from torch.func import functional_call, grad, vmap

from dpclip.data.registry import load_dataset
from dpclip.lipschitz.strategy import LipDpSgd, clip_inputs
from dpclip.models import build_model

INPUT_SHAPE = (1, 28, 28)


def measure(model: torch.nn.Module, strategy: LipDpSgd, x: torch.Tensor, y: torch.Tensor,
            sigma: float, batch: int) -> dict[str, Any]:
    model.eval()
    loss = strategy.loss()
    _, cert = strategy.certify(model, loss, INPUT_SHAPE, strategy.init_state())
    xc = clip_inputs(x, strategy.input_norm)
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}

    def one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return loss(functional_call(model, p, (xi[None],)), yi[None]).sum()

    grads = vmap(grad(one), in_dims=(None, 0, 0))(params, xc, y)
    scaled = {k: g * cert.scales[k] for k, g in grads.items()}
    layers = []
    total_sq = torch.zeros(x.shape[0], dtype=torch.float64)
    for lb in cert.bound.layers:
        names = [n for n in lb.parameter_grad_bounds if n in scaled]
        if not names:  # a frozen layer: not trained, not in the certificate
            continue
        sq = sum(scaled[n].flatten(1).double().pow(2).sum(dim=1) for n in names)
        total_sq += sq
        norms = sq.sqrt()
        med = float(norms.median())
        layers.append({
            "layer": lb.name, "operator_norm": lb.operator_norm,
            "method": lb.operator_norm_method, "cert": cert.layer_sensitivities[lb.name],
            "realised_max": float(norms.max()), "realised_median": med,
            "cert_over_max": cert.layer_sensitivities[lb.name] / float(norms.max()),
            "cert_over_median": cert.layer_sensitivities[lb.name] / med if med > 0 else math.inf,
        })
    norms = total_sq.sqrt()
    mean_grad = torch.cat([g.double().mean(dim=0).flatten() for g in scaled.values()])
    d = mean_grad.numel()
    noise = sigma * cert.sensitivity * math.sqrt(d) / batch
    with torch.no_grad():
        acc = float((model(xc).argmax(dim=1) == y).double().mean())
    return {
        "sensitivity": cert.sensitivity, "realised_max": float(norms.max()),
        "realised_median": float(norms.median()),
        "cert_over_max": cert.sensitivity / float(norms.max()),
        "cert_over_median": cert.sensitivity / float(norms.median()),
        "mean_grad_norm": float(mean_grad.norm()), "num_params": d, "sigma": sigma,
        "batch": batch, "noise_norm_on_mean": noise,
        "noise_to_signal": noise / float(mean_grad.norm()),
        "heldout_accuracy": acc, "layers": layers,
    }


def markdown(rows: list[dict[str, Any]], title: str) -> str:
    out = [f"# {title} (generated from {Path(title).name}.json by reproductions/"
           "lipdp_certificate_gap.py)", "",
           "NON-PRIVATE diagnostics on held-out TEST examples (not trained on); reading R2, "
           "X_0 = input_norm. `cert/max` = certified Delta over the largest realised per-example "
           "(scaled) gradient norm; `noise/signal` = norm of one step's noise on the mean gradient "
           "(sigma Delta sqrt(d) / B) over the norm of the mean gradient of the n examples.", "",
           "| model | weights | tau | X_0 | n | Delta | realised max | median | cert/max | "
           "cert/median | noise/signal (sigma, B) | acc on these |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['weights']} | {r['temperature']} | {r['input_norm']} | {r['n']} "
            f"| {r['sensitivity']:.3g} | {r['realised_max']:.3g} | {r['realised_median']:.3g} | "
            f"{r['cert_over_max']:.1f} | {r['cert_over_median']:.1f} | "
            f"{r['noise_to_signal']:.1f} ({r['sigma']:.3f}, {r['batch']}) | "
            f"{100 * r['heldout_accuracy']:.1f} % |")
    out += ["", "## Per layer", "",
            "| model | weights | tau | layer | operator norm (method) | Delta_k | realised max | "
            "median | cert/max | cert/median |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for lr in r["layers"]:
            out.append(
                f"| {r['model']} | {r['weights']} | {r['temperature']} | {lr['layer']} | "
                f"{lr['operator_norm']:.4f} ({lr['method']}) | {lr['cert']:.3g} | "
                f"{lr['realised_max']:.3g} | {lr['realised_median']:.3g} | "
                f"{lr['cert_over_max']:.1f} | {lr['cert_over_median']:.1f} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--checkpoint", action="append", default=[],
                    help="harness checkpoint.pt of a lip-dp-sgd run (model, config, sigma)")
    ap.add_argument("--n", type=int, default=512, help="held-out test examples")
    ap.add_argument("--sigma", type=float, default=0.7868,
                    help="noise multiplier for the init rows (eps 3, B 512, 10 epochs, PLD)")
    args = ap.parse_args()
    torch.manual_seed(0)
    data = load_dataset("fashion-mnist")
    x, y = data.test.inputs[: args.n], data.test.targets[: args.n]
    rows = []
    settings: list[tuple[str, dict[str, Any], dict[str, Any], Any, float, int]] = []
    for model_name, opts in (("lip-small-cnn", {}), ("lip-orth-cnn", {})):
        for tau in (1.0, 0.1):
            settings.append((model_name, opts, {"input_norm": 10.0, "weight_bound": 1.0,
                                                "temperature": tau}, None, args.sigma, 512))
    for ck_path in args.checkpoint:
        ck = torch.load(ck_path, weights_only=False)
        cfg = ck["config"]
        settings.append((cfg["model"], cfg.get("model_options", {}), cfg["strategy_params"],
                         (ck_path, ck), float(ck["private"]["noise_multiplier"]),
                         int(cfg["batch_size"])))
    for model_name, opts, params, ck, sigma, batch in settings:
        torch.manual_seed(0)
        model = build_model(model_name, INPUT_SHAPE, 10, **opts)
        strategy = LipDpSgd(**{k: v for k, v in params.items() if k != "num_layers"})
        if ck is None:
            strategy.post_step(model, strategy.init_state(), input_shape=INPUT_SHAPE)
            weights = "init (after ClipWeights)"
        else:
            model.load_state_dict(ck[1]["private"]["model"])
            kind = "NON-PRIVATE run (sigma 0)" if sigma == 0 else "private run"
            weights = f"{kind}, step {ck[1]['step']} ({Path(ck[0]).parent.name})"
        shown = model_name + "".join(f" {k}={v}" for k, v in sorted(opts.items()))
        row = {"model": shown, "weights": weights, "n": int(x.shape[0]),
               "nonprivate": True, "data": "fashion-mnist test[:n] (held out)", **params,
               **measure(model, strategy, x, y, sigma, batch)}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "layers"}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(rows, args.out.stem))


if __name__ == "__main__":
    main()
