"""NON-PRIVATE diagnostics of clipping, computed on a fixed batch of training examples.

These numbers use raw per-example gradient norms and the true (unclipped) gradient, so they are
not differentially private: they are for research and debugging, logged only when asked for
(``TrainConfig.diagnostics``) and always under the ``nonprivate/`` prefix (design rule 6).

* ``nonprivate/norm_q10|q50|q90``: quantiles of the per-example gradient norms (Lin et al. Fig. 1).
* ``nonprivate/cosine``: cosine similarity between the clipped-and-weighted batch gradient
  ``sum_i w_i g_i`` and the true batch gradient ``sum_i g_i`` (Xia et al. Figs. 1 and 3).
* ``nonprivate/clip_bias``: ``|| mean_i w_i g_i - mean_i g_i ||``, the bias of the noiseless
  clipped update against the true average gradient (Barczewski & Ramon, App. C.5), and
  ``nonprivate/clip_bias_rel`` the same divided by ``|| mean_i g_i ||``.
* ``nonprivate/unclipped_fraction``: fraction of examples whose weight times norm equals their
  norm (weight >= 1 up to rounding).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dpclip.clipping.base import ClippingStrategy, State
from dpclip.engine import ParamGroups, get_engine
from dpclip.engine.base import LossFn

__all__ = ["nonprivate_diagnostics"]


def nonprivate_diagnostics(
    model: nn.Module,
    loss_fn: LossFn,
    inputs: Tensor,
    targets: Tensor,
    strategy: ClippingStrategy,
    state: State,
    groups: ParamGroups,
) -> dict[str, float]:
    """The diagnostics above for one batch (the model is not changed)."""
    engine = get_engine("vmap")
    weighted = engine.compute(model, loss_fn, inputs, targets,
                              lambda n: strategy.weights(n, state), groups)
    plain = engine.compute(model, loss_fn, inputs, targets,
                           lambda n: torch.ones_like(n), groups)
    b = max(int(inputs.shape[0]), 1)
    ws = torch.cat([g.flatten() for g in weighted.grads.values()]).double()
    ts = torch.cat([g.flatten() for g in plain.grads.values()]).double()
    norms = weighted.norms
    assert norms is not None and weighted.weights is not None
    flat = norms if norms.ndim == 1 else norms.pow(2).sum(dim=1).sqrt()
    finite = flat[torch.isfinite(flat)].double()
    out: dict[str, float] = {}
    if finite.numel():
        qs = torch.quantile(finite, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64, device=finite.device))
        out.update({"nonprivate/norm_q10": float(qs[0]), "nonprivate/norm_q50": float(qs[1]),
                    "nonprivate/norm_q90": float(qs[2])})
    denom = ws.norm() * ts.norm()
    out["nonprivate/cosine"] = float(ws @ ts / denom) if denom > 0 else float("nan")
    bias = ((ws - ts) / b).norm()
    out["nonprivate/clip_bias"] = float(bias)
    tn = (ts / b).norm()
    out["nonprivate/clip_bias_rel"] = float(bias / tn) if tn > 0 else float("nan")
    w = weighted.weights if weighted.weights.ndim == 1 else weighted.weights.min(dim=1).values
    out["nonprivate/unclipped_fraction"] = float((w >= 1 - 1e-9).double().mean()) if b else 0.0
    return out
