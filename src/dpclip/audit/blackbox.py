"""Black-box audit of a training run: input canaries, final model only.

:func:`blackbox_audit` takes a ``TrainConfig`` (any ``dpclip train`` configuration), plants
``n_canaries`` mislabelled examples (copies of test inputs with a wrong label drawn by the audit),
each included in the training set independently with probability 1/2, runs the real
:func:`dpclip.trainer.train`, and scores every canary by minus its loss under the FINAL model
(a memorised mislabelled example has a low loss). The one-run estimators (Steinke et al. 2023;
Mahloujifar et al. 2024, Gaussian trade-off) give epsilon lower bounds next to the run's claimed
epsilon (its ledger, with sampling amplification). Black-box bounds are far below the claim for
real runs (the final model hides most of what the gradients reveal); their use is to catch gross
failures end to end (a run without noise or clipping memorises its canaries). The audit's coins
and wrong labels are seeded from ``config.seed`` (public; the canaries are synthetic).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dpclip.audit.estimators import AuditResult, one_run_epsilon, one_run_fdp_epsilon

__all__ = ["BlackBoxAudit", "blackbox_audit"]


@dataclass(frozen=True)
class BlackBoxAudit:
    """Lower bounds from the final model's canary losses and the run's claimed epsilon."""

    claimed_epsilon: float
    one_run: AuditResult
    one_run_fdp: AuditResult
    n_canaries: int
    run_summary: dict[str, Any]
    in_scores: np.ndarray
    out_scores: np.ndarray

    @property
    def lower_bound(self) -> float:
        return max(self.one_run.epsilon, self.one_run_fdp.epsilon)

    @property
    def violates_claim(self) -> bool:
        return self.lower_bound > self.claimed_epsilon

    def to_dict(self) -> dict[str, Any]:
        s = self.run_summary
        return {"design": "blackbox", "claimed_epsilon": self.claimed_epsilon,
                "one_run_epsilon": self.one_run.epsilon,
                "one_run_fdp_epsilon": self.one_run_fdp.epsilon,
                "lower_bound": self.lower_bound, "violates_claim": self.violates_claim,
                "canaries": self.n_canaries, "test_accuracy": s.get("test_accuracy"),
                "noise_multiplier": s.get("noise_multiplier"), "steps": s.get("steps"),
                "engine_ran": s.get("engine"), "dataset": s.get("dataset"),
                "model": s.get("model"), "delta": s.get("delta")}


def blackbox_audit(config: Any, *, n_canaries: int = 500, significance: float = 0.05,
                   progress: bool = False) -> BlackBoxAudit:
    """Train ``config`` with mislabelled canaries and audit the final model (module docstring)."""
    from dpclip.data import load_dataset
    from dpclip.trainer import cross_entropy_per_example, train

    bundle = load_dataset(config.dataset, config.data_dir, seed=config.seed,
                          **config.dataset_options)
    m = int(n_canaries)
    if not (8 <= m <= int(bundle.test.inputs.shape[0])):
        raise ValueError(f"n_canaries must be in [8, {int(bundle.test.inputs.shape[0])}] (test "
                         f"inputs are the canaries' inputs), got {n_canaries!r}")
    rng = np.random.default_rng(config.seed + 7919)
    x_c = bundle.test.inputs[:m].clone()
    shift = torch.as_tensor(rng.integers(1, bundle.num_classes, size=m))
    y_c = (bundle.test.targets[:m] + shift) % bundle.num_classes  # always a wrong label
    coins = rng.random(m) < 0.5
    keep = torch.as_tensor(coins)
    train_split = dataclasses.replace(
        bundle.train, inputs=torch.cat([bundle.train.inputs, x_c[keep]]),
        targets=torch.cat([bundle.train.targets, y_c[keep]]))
    test_split = dataclasses.replace(bundle.test, inputs=bundle.test.inputs[m:],
                                     targets=bundle.test.targets[m:])
    audited = dataclasses.replace(bundle, train=train_split, test=test_split)
    result = train(config, data=audited, progress=progress)
    model = result.model.eval()
    with torch.no_grad():
        device = next(model.parameters()).device
        loss = cross_entropy_per_example(model(x_c.to(device)), y_c.to(device)).double().cpu()
    scores = -loss.numpy()
    delta = float(config.delta)
    return BlackBoxAudit(
        claimed_epsilon=float(result.summary["epsilon"]),
        one_run=one_run_epsilon(scores[coins], scores[~coins], significance=significance,
                                delta=delta),
        one_run_fdp=one_run_fdp_epsilon(scores[coins], scores[~coins],
                                        significance=significance, delta=delta),
        n_canaries=m, run_summary=dict(result.summary), in_scores=scores[coins],
        out_scores=scores[~coins])
