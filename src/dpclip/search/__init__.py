"""Lin et al.'s greedy threshold search (Algorithm 1) and the schedules it produces.

* :func:`greedy_search` / :class:`GreedyConfig`: per-epoch greedy search on PUBLIC data (refused on
  a private dataset unless explicitly allowed; never reported with an epsilon), checkpointed after
  every candidate and resumable.
* :func:`run_or_reuse`, :func:`save_search`: schedules stored by name in the results store
  (``ResultsStore.save_schedule``; ``dpclip schedules`` lists them); :func:`same_search` matches a
  stored search across the noise multiplier's calibration round-off.
* :func:`resolve_strategy_params`: the CLI/harness boundary that turns ``transfer``'s
  ``schedule=NAME`` into ``thresholds`` and ``lin-decay``'s ``c0_from="greedy"`` into ``C0``.
* :func:`search_noise_multiplier`: the private run's sigma from its epsilon, delta, batch size,
  epochs and dataset size (the trainer's calibration).
* :mod:`dpclip.search.plots`: Lin et al. Figures 1-5 from the store.
"""

from dpclip.search import greedy as _greedy, resolve as _resolve
from dpclip.search.greedy import (
    Evaluator,
    GreedyConfig,
    GreedyResult,
    PrivateDataError,
    candidate_threshold,
    check_public,
    default_schedule_name,
    greedy_search,
    search_noise_multiplier,
)
from dpclip.search.resolve import (
    C0_RESOLVER_KEYS,
    greedy_c0,
    private_noise_multiplier,
    resolve_strategy_params,
    run_or_reuse,
    same_checkpoint,
    same_search,
    save_search,
)

__all__ = sorted({*_greedy.__all__, *_resolve.__all__})  # both modules' API, re-exported
