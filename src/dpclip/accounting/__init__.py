"""Privacy accounting for dpclip: a ledger of typed DP events -> epsilon, and calibration.

* ``Ledger``: append-only, run-length compressed record of the per-step ``dpclip.events``
  events of a run; JSON round trip for checkpoints and the results store.
* ``compute_epsilon`` / ``epsilon``: (epsilon, delta) with dp_accounting's PLD (default,
  tightest) or RDP accountants, or RDP with the classic TF-Privacy conversion
  (``"rdp-classic"``, to reproduce 2016-2021 papers). The neighbouring relation follows the
  events: add-remove-one for Poisson sampling, replace-one for sampling without replacement.
* ``calibrate_noise_multiplier`` / ``calibrate_dpsgd_noise`` / ``calibrate_steps``.
* ``dpsgd_step_event`` / ``dpsgd_event`` / ``combined_noise_multiplier``: the events of DP-SGD.
* ``to_dp_accounting``: the mapping onto ``dp_accounting.dp_event``.

This package never imports torch.
"""

from dpclip.accounting.calibration import (
    calibrate_dpsgd_noise,
    calibrate_noise_multiplier,
    calibrate_steps,
)
from dpclip.accounting.convert import (
    UnsupportedAccountingError,
    adjacency_of,
    combined_noise_multiplier,
    to_dp_accounting,
)
from dpclip.accounting.dpsgd import SAMPLING_SCHEMES, dpsgd_event, dpsgd_step_event
from dpclip.accounting.accountants import (
    ACCOUNTANTS,
    DEFAULT_PLD_DISCRETIZATION,
    EpsilonReport,
    compute_epsilon,
    epsilon,
)
from dpclip.accounting.ledger import Ledger
from dpclip.accounting import gdp  # CLT/GDP tools for reproducing Du et al. (never a guarantee)

__all__ = [
    "ACCOUNTANTS",
    "DEFAULT_PLD_DISCRETIZATION",
    "SAMPLING_SCHEMES",
    "EpsilonReport",
    "Ledger",
    "UnsupportedAccountingError",
    "adjacency_of",
    "calibrate_dpsgd_noise",
    "calibrate_noise_multiplier",
    "calibrate_steps",
    "combined_noise_multiplier",
    "compute_epsilon",
    "dpsgd_event",
    "dpsgd_step_event",
    "epsilon",
    "to_dp_accounting",
]
