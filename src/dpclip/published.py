"""What each output of dpclip publishes, field by field, and under which rule.

Every field of the ``dpclip train --json`` summary (``dpclip.training.trainer.train``), of its per-epoch
history rows (stored in the results store by ``dpclip run`` and plotted by the report), and of the
``dpclip fl train --json`` summary and history is listed here with its class:

* ``public``: public configuration (what the user chose, the plan made from it before training,
  the public facts of the code that ran), or the dataset size, which DP-SGD treats as public (the
  sample rate is ``expected_batch_size / N``; the same convention as Opacus and TF-Privacy);
* ``accounted``: computed from released (noised) values only, and accounted in the ledger: the
  epsilon, the noise multiplier, an adaptive threshold updated from privatized statistics;
* ``heldout``: computed from the released model on the held-out test split, which is not the
  protected training data (epsilon covers the training examples only: docs/privacy.md);
* ``timing``: wall-clock time of a whole epoch or run. Not covered by epsilon (the time of a step
  depends on the realised batch size); coarse, and never per step;
* ``nonprivate``: computed from private data without noise: only under an explicit opt-in, named
  ``nonprivate/...``, off by default.

``docs/privacy.md`` ("What each output publishes") is generated from these tables
(:func:`markdown`) and ``tests/core/test_published_fields.py`` checks that a real summary has no
field outside them, that the doc is the generated text, and that removing one example (or one
user) changes no field that is not ``accounted``, ``heldout``, ``timing``, ``nonprivate`` or the
dataset size.
"""

from __future__ import annotations

from typing import Mapping

__all__ = ["CLASSES", "DATASET_SIZE_FIELDS", "FL_HISTORY", "FL_SUMMARY", "TRAIN_HISTORY", "TRAIN_SUMMARY", "classify",
           "markdown"]

CLASSES = {
    "public": "public configuration, the plan, or the dataset size",
    "accounted": "noised and accounted (computed from released values)",
    "heldout": "the released model on held-out test data (not the protected data)",
    "timing": "wall-clock time of a whole epoch or run (not covered by epsilon; never per step)",
    "nonprivate": "NON-PRIVATE: computed from private data without noise; opt-in, off by default",
}

#: ``dpclip train --json`` / ``TrainConfig`` runs (``RunResult.summary``; stored by ``dpclip run``)
TRAIN_SUMMARY: dict[str, str] = {
    "dataset": "public", "model": "public", "strategy": "public",
    "params": "public",  # the strategy's configuration (initial values; no data-derived state)
    "epsilon": "accounted", "target_epsilon": "public", "delta": "public",
    "accountant": "public", "adjacency": "public", "sampling": "public", "unit": "public",
    "sensitivity_factor": "public", "clip_groups": "public",
    "public_examples": "public", "private_examples": "public",  # dataset sizes
    "bn_stats": "public", "noise_multiplier": "accounted", "sample_rate": "public",
    "expected_batch_size": "public",
    "steps": "public", "planned_steps": "public",  # the plan and the epsilon cap decide them
    "epochs": "public", "epochs_completed": "public", "stopped_by_budget": "public",
    "test_accuracy": "heldout", "lr": "public", "lr_schedule": "public", "optimizer": "public",
    "seed": "public", "randomness": "public", "private_against_seed": "public",
    "randomness_warning": "public", "diagnostics": "public", "preprocessing": "public",
    "engine": "public", "engine_requested": "public",
    "engine_fallback": "public",  # reasons with every shape removed (private.public_reason)
    "device": "public", "distributed": "public", "model_options": "public", "augment": "public",
    "generator": "public", "train_seconds": "timing",
    "augment_multiplicity": "public", "averaging": "public",
    "wall_seconds": "timing",
    # added by `dpclip run` when it stores the summary
    "label": "public", "experiment": "public",
    "tuning": "nonprivate",  # only with [tuning]: trial scores on a validation part of the
    # private training split, NOT privacy-accounted (docs/tuning.md), opt-in
}

#: one row per epoch of a ``dpclip train`` run (``RunResult.history``; the store's history)
TRAIN_HISTORY: dict[str, str] = {
    "epoch": "public", "step": "public", "test_accuracy": "heldout", "test_loss": "heldout",
    "epsilon": "accounted", "clip_threshold": "accounted", "noise_multiplier": "accounted",
    "lr": "public", "wall_seconds": "timing",
    "heldout/*": "heldout",  # diagnostics = "test"
    "nonprivate/*": "nonprivate",  # diagnostics = "train" (NON-PRIVATE, opt-in)
}

#: ``dpclip fl train --json`` (``FedAvgResult.summary``; stored by ``dpclip run`` federated grids)
FL_SUMMARY: dict[str, str] = {
    "strategy": "public", "params": "public", "sampling": "public", "adjacency": "public",
    "num_users": "public",  # the number of users: the dataset size of user-level DP
    "expected_clients": "public", "sample_rate": "public", "noise_multiplier": "accounted",
    "weighting": "public", "weight_cap": "public", "privacy_unit": "public",
    "generator": "public",
    "randomness": "public", "private_against_seed": "public", "randomness_warning": "public",
    "server_optimizer": "public", "server_lr": "public", "server_momentum": "public",
    "dataset": "public", "partition": "public", "partition_seed": "public",
    "shards_per_user": "public", "alpha": "public", "attribute_columns": "public",
    "max_user_size": "public", "rounds": "public", "delta": "public", "accountant": "public",
    "epsilon": "accounted", "target_epsilon": "public", "local_epochs": "public",
    "local_batch_size": "public", "client_lr": "public", "seed": "public",
    "test_accuracy": "heldout", "wall_seconds": "timing",
    "nonprivate/*": "nonprivate",  # user sizes, only with log_nonprivate (off by default)
    "label": "public", "experiment": "public",  # added by `dpclip run`
}

#: one row per evaluation of a federated run
FL_HISTORY: dict[str, str] = {
    "round": "public", "test_accuracy": "heldout", "test_loss": "heldout",
    "clip_norm": "accounted", "next_clip_norm": "accounted", "epsilon": "accounted",
    "nonprivate/*": "nonprivate",  # the time per round too (which users were sampled shows)
}

#: public fields that are the dataset size or a function of it and the configuration (the plan):
#: the only ``public`` fields a neighbouring dataset may change
DATASET_SIZE_FIELDS = frozenset({"private_examples", "num_users", "sample_rate", "planned_steps",
                                 "steps", "epochs_completed", "stopped_by_budget"})

TABLES = {"dpclip train --json and dpclip run (summary; the store's runs.summary)": TRAIN_SUMMARY,
          "dpclip train history rows (the store's epochs, the report)": TRAIN_HISTORY,
          "dpclip fl train --json and federated dpclip run (summary)": FL_SUMMARY,
          "dpclip fl train history rows": FL_HISTORY}


def classify(field: str, table: Mapping[str, str]) -> str | None:
    """The class of ``field`` in ``table`` (prefix entries ``"nonprivate/*"`` match by prefix),
    or ``None`` for a field the table does not list (a field that must not be published)."""
    if field in table:
        return table[field]
    for key, cls in table.items():
        if key.endswith("/*") and field.startswith(key[:-1]):
            return cls
    return None


def markdown() -> str:
    """The section of docs/privacy.md listing every published field (generated: do not edit)."""
    lines = ["Classes: " + "; ".join(f"**{k}**: {v}" for k, v in CLASSES.items()) + ".", ""]
    for title, table in TABLES.items():
        lines.append(f"**{title}**")
        lines.append("")
        lines.append("| class | fields |")
        lines.append("|---|---|")
        for cls in CLASSES:
            fields = [f"`{f}`" for f, c in table.items() if c == cls]
            if fields:
                lines.append(f"| {cls} | {', '.join(fields)} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
