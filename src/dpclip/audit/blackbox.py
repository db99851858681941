"""Black-box one-run audit of a whole training run (input canaries, final model only).

:func:`blackbox_audit` takes any ``dpclip train`` configuration (:class:`dpclip.training.trainer.TrainConfig`),
plants ``m`` input canaries in its training set, each included independently with probability 1/2
(the audit's fair coin), runs the real :func:`dpclip.training.trainer.train`, and scores every canary by
minus its cross-entropy loss under the FINAL model (a memorised canary has a low loss). The one-run
estimators (Steinke, Nasr & Jagielski 2023, which assumes nothing about the mechanism; Mahloujifar,
Melis & Chaudhuri 2024, Gaussian trade-off family) turn the scores into epsilon lower bounds,
compared with the run's claimed epsilon (its ledger, sampling amplification included).

Canary designs (``canary=``):

* ``"ood"`` (default; Steinke et al. 2023 sec. 6, Nasr et al. 2023): out-of-distribution inputs
  with uniformly random labels, so that only memorisation can fit them. Canary ``j``'s input is a
  random Gaussian direction scaled to ``canary_scale`` times the mean norm of the training inputs
  (far from the data: the model's behaviour there is set by the canaries themselves). Any number
  of canaries (they are synthetic).
* ``"mislabelled"``: test inputs with a wrong label (the first ``m`` test examples, removed from
  the evaluation split). In distribution, so much weaker: kept for comparison.

Power: a black-box bound is far below the claim for a correct run (the final model hides most of
what the gradients reveal); the audit's use is to catch gross failures end to end. Its ceiling is
set by the estimator: with ``m = 1000`` perfectly separated canaries the one-run bound at
``delta = 1e-5`` is at most about 3.7 and the f-DP bound about 6.2 (:func:`dpclip.audit.whitebox.
ideal_bounds`), so a broken run is detectable when the intended claim is below these. The
configuration must give each canary many clipped steps (a small training set, a high sampling
rate, many epochs, a large learning rate): docs/audit.md gives the measured settings.

``claimed_epsilon`` overrides the claim compared with: a no-noise control trains with
``noise_multiplier = 0`` (its own claim is infinite) and is compared with the intended run's claim.

The audit's coins, canary inputs and labels are seeded from ``config.seed`` (public; the canaries
are synthetic or test data, never training data). Configurations that carve a public split out of
the training set (``public_fraction``, public BatchNorm statistics, strategies with public norms)
are refused: a canary drawn into the public split would be used without accounting.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dpclip.audit.estimators import AuditResult, one_run_epsilon, one_run_fdp_epsilon
from dpclip.clipping import make_strategy
from dpclip.data import load_dataset
from dpclip.training.trainer import cross_entropy_per_example, train
from dpclip.training.units import UnitConfig, public_fraction_of
from dpclip.clipping.capabilities import capabilities_of

__all__ = ["CANARIES", "BlackBoxAudit", "blackbox_audit", "make_canaries"]

CANARIES = ("ood", "mislabelled")


@dataclass(frozen=True)
class BlackBoxAudit:
    """Lower bounds from the final model's canary losses and the claimed epsilon."""

    claimed_epsilon: float
    one_run: AuditResult
    one_run_fdp: AuditResult
    n_canaries: int
    run_summary: dict[str, Any]
    in_scores: np.ndarray
    out_scores: np.ndarray
    canary: str = "ood"
    canary_scale: float | None = None
    claim_source: str = "run"
    config: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def lower_bound(self) -> float:
        return max(self.one_run.epsilon, self.one_run_fdp.epsilon)

    @property
    def violates_claim(self) -> bool:
        return self.lower_bound > self.claimed_epsilon

    @property
    def ratio(self) -> float:
        """Lower bound / claimed epsilon (0 for an infinite claim)."""
        c = self.claimed_epsilon
        return 0.0 if math.isinf(c) or c == 0 else self.lower_bound / c

    @property
    def auc(self) -> float:
        """Area under the ROC curve of the scores (0.5: no separation; NON-PRIVATE audit data)."""
        ins, outs = self.in_scores, self.out_scores
        ranks = np.argsort(np.argsort(np.concatenate([ins, outs]), kind="stable"), kind="stable")
        r_in = ranks[: ins.size].astype(np.float64) + 1
        return float((r_in.sum() - ins.size * (ins.size + 1) / 2) / (ins.size * outs.size))

    def to_dict(self) -> dict[str, Any]:
        s, c = self.run_summary, self.config
        return {"design": "blackbox", "canary": self.canary, "canary_scale": self.canary_scale,
                "strategy": c.get("strategy", s.get("strategy")),
                "params": c.get("strategy_params", {}),
                "claimed_epsilon": self.claimed_epsilon, "claim_source": self.claim_source,
                "run_epsilon": s.get("epsilon"),
                "one_run_epsilon": self.one_run.epsilon,
                "one_run_fdp_epsilon": self.one_run_fdp.epsilon,
                "lower_bound": self.lower_bound, "ratio": self.ratio, "auc": self.auc,
                "violates_claim": self.violates_claim, "significance": self.one_run.significance,
                "canaries": self.n_canaries, "n_in": int(self.in_scores.size),
                "test_accuracy": s.get("test_accuracy"),
                "noise_multiplier": s.get("noise_multiplier"), "steps": s.get("steps"),
                "epochs": c.get("epochs"), "batch_size": c.get("batch_size"), "lr": c.get("lr"),
                "sampling": c.get("sampling"), "engine": c.get("engine"),
                "engine_ran": s.get("engine"), "dataset": s.get("dataset"),
                "model": s.get("model"), "delta": s.get("delta"), "seed": c.get("seed"),
                "randomness": s.get("randomness")}


def make_canaries(bundle: Any, m: int, canary: str, scale: float,
                  rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``m`` canaries' inputs and labels (module docstring), from the public ``rng``."""
    if canary == "ood":
        x_train = bundle.train.inputs
        d = int(np.prod(x_train.shape[1:]))
        mean_norm = float(x_train.reshape(x_train.shape[0], -1).double().norm(dim=1).mean())
        x = torch.as_tensor(rng.standard_normal((m, d)))
        x = x / x.norm(dim=1, keepdim=True) * (scale * mean_norm)
        x = x.to(x_train.dtype).reshape(m, *x_train.shape[1:])
        y = torch.as_tensor(rng.integers(0, bundle.num_classes, size=m))
        return x, y.to(bundle.train.targets.dtype)
    x = bundle.test.inputs[:m].clone()
    shift = torch.as_tensor(rng.integers(1, bundle.num_classes, size=m))
    y = (bundle.test.targets[:m] + shift) % bundle.num_classes  # always a wrong label
    return x, y.to(bundle.test.targets.dtype)


def _check_no_public_split(config: Any) -> Any:
    """Refuse configurations with a public split; returns the strategy object."""
    unit = config.unit_config
    strategy = make_strategy(config.strategy, config.strategy_params)
    if public_fraction_of(unit, strategy) > 0:
        raise ValueError(
            f"blackbox_audit: this configuration (strategy {config.strategy!r}, unit settings "
            f"{unit}) carves a public split out of the training set, and a canary drawn into it "
            "would be used without accounting; audit it with the white-box audit "
            "(dpclip audit --mode whitebox) or without the public split")
    return strategy


def blackbox_audit(config: Any, *, n_canaries: int = 1000, canary: str = "ood",
                   canary_scale: float = 3.0, significance: float = 0.05,
                   claimed_epsilon: float | None = None, progress: bool = False) -> BlackBoxAudit:
    """Train ``config`` with input canaries and audit the final model (module docstring).

    Args:
        config: a :class:`dpclip.training.trainer.TrainConfig` (any ``dpclip train`` configuration).
        n_canaries: ``m >= 8`` (``"mislabelled"``: at most the test set's size).
        canary: ``"ood"`` (random out-of-distribution inputs, random labels) or ``"mislabelled"``.
        canary_scale: ``"ood"`` inputs' norm in units of the mean training-input norm.
        significance: of every bound.
        claimed_epsilon: the claim the bounds are compared with; default the run's own epsilon.
        progress: the training progress bar.
    """
    if canary not in CANARIES:
        raise ValueError(f"canary must be one of {CANARIES}, got {canary!r}")
    if not (math.isfinite(canary_scale) and canary_scale > 0):
        raise ValueError(f"canary_scale must be finite and > 0, got {canary_scale!r}")
    if claimed_epsilon is not None and not (claimed_epsilon > 0):
        raise ValueError(f"claimed_epsilon must be > 0, got {claimed_epsilon!r}")
    strategy = _check_no_public_split(config)
    bundle = load_dataset(config.dataset, config.data_dir, seed=config.seed,
                          **config.dataset_options)
    if bundle.private_preprocessing is not None:  # the canaries would be scored uncentred
        raise ValueError("the black-box audit does not support the dataset option "
                         "centre='private' (the canaries are scored on the raw inputs); drop it")
    m = int(n_canaries)
    limit = int(bundle.test.inputs.shape[0]) if canary == "mislabelled" else 10**7
    if isinstance(n_canaries, bool) or m != n_canaries or not (8 <= m <= limit):
        what = " (test inputs are the canaries' inputs)" if canary == "mislabelled" else ""
        raise ValueError(f"n_canaries must be an integer in [8, {limit}]{what}, got "
                         f"{n_canaries!r}")
    rng = np.random.default_rng(config.seed + 7919)  # public: the canaries are synthetic
    x_c, y_c = make_canaries(bundle, m, canary, float(canary_scale), rng)
    coins = rng.random(m) < 0.5
    keep = torch.as_tensor(coins)
    train_split = dataclasses.replace(
        bundle.train, inputs=torch.cat([bundle.train.inputs, x_c[keep]]),
        targets=torch.cat([bundle.train.targets, y_c[keep]]))
    test_split = bundle.test
    if canary == "mislabelled":
        test_split = dataclasses.replace(bundle.test, inputs=bundle.test.inputs[m:],
                                         targets=bundle.test.targets[m:])
    audited = dataclasses.replace(bundle, train=train_split, test=test_split)
    result = train(config, data=audited, progress=progress)
    model = result.model.eval()
    device = next(model.parameters()).device
    # Lip-DP-SGD trains on clipped inputs
    scale_inputs = strategy.scale_inputs if capabilities_of(strategy).bound_based else None
    with torch.no_grad():
        x_eval = x_c.to(device)
        if callable(scale_inputs):
            x_eval = scale_inputs(x_eval)
        loss = cross_entropy_per_example(model(x_eval), y_c.to(device)).double().cpu()
    scores = -loss.numpy()
    delta = float(result.summary["delta"])
    claim = float(result.summary["epsilon"]) if claimed_epsilon is None else float(claimed_epsilon)
    return BlackBoxAudit(
        claimed_epsilon=claim,
        one_run=one_run_epsilon(scores[coins], scores[~coins], significance=significance,
                                delta=delta),
        one_run_fdp=one_run_fdp_epsilon(scores[coins], scores[~coins],
                                        significance=significance, delta=delta),
        n_canaries=m, run_summary=dict(result.summary), in_scores=scores[coins],
        out_scores=scores[~coins], canary=canary,
        canary_scale=float(canary_scale) if canary == "ood" else None,
        claim_source="run" if claimed_epsilon is None else "given",
        config=config.to_dict() if hasattr(config, "to_dict") else {})
