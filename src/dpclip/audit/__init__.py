"""Empirical privacy auditing: epsilon lower bounds from canaries (docs/audit.md).

* ``estimators`` (numpy/scipy only): :func:`one_run_epsilon` (Steinke, Nasr & Jagielski 2023),
  :func:`one_run_fdp_epsilon` (Mahloujifar, Melis & Chaudhuri 2024, Gaussian trade-off family),
  :func:`clopper_pearson_epsilon` (repeated runs), their count-level forms and helpers.

* ``whitebox`` (torch; not imported here): :func:`dpclip.audit.whitebox.dirac_canary_audit`,
  a white-box one-run audit of ``dpclip.training.step.dp_step`` with Dirac gradient canaries.

An audit refutes privacy claims; it never proves one. ``estimators`` itself imports only numpy
and scipy (``dpclip``'s top-level package imports torch, as for every subpackage).
"""

from dpclip.audit import estimators as _estimators
from dpclip.audit.estimators import (
    AuditResult,
    GaussianShiftResult,
    Thresholds,
    clopper_pearson_epsilon,
    clopper_pearson_upper,
    gaussian_epsilon_for,
    gaussian_mu_for,
    gaussian_shift_epsilon,
    one_run_epsilon,
    one_run_epsilon_from_counts,
    one_run_fdp_epsilon,
    one_run_fdp_epsilon_from_counts,
    one_run_p_value,
    rank_grid,
    roc_hull,
)

__all__ = list(_estimators.__all__)  # the package re-exports the estimators' API
