"""User-level DP-FedAvg with adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy 2021).

* :class:`DPAggregator`: the server's private step over client deltas (clip with any flat
  norm-based ``dpclip.clipping`` strategy, sum, noise once, divide by the public expected number
  of users, ledger event per round; quantile clipping with its noisy centred count and the noise
  split of Theorem 1).
* :class:`FedAvgServer`: global model + aggregator + server optimizer (SGD, momentum, Adam).
* :func:`run_fedavg`: the in-process simulation; ``dpclip.federated.flower``: the same server on
  Flower's runtime (optional extra ``dpclip[flower]``).
* ``dpclip.federated.data``: users from Fashion-MNIST / MNIST-5k / UCI (IID, label-skew,
  Dirichlet, by attribute); ``dpclip.federated.tff``: the TFF federated EMNIST / Shakespeare /
  Stack Overflow files (users = their clients; needs ``h5py``); ``dpclip.federated.models``: the
  benchmarks' EMNIST CNN and character / word LSTMs.
* ``dpclip.federated.spec``: a run as a flat mapping (CLI, Flower processes) and as a
  fingerprinted ``FederatedRunConfig`` (the harness's federated grids).
* ``dpclip.federated.tracking``: the paper's log-normal quantile-tracking simulation.

The privacy unit is the user; epsilon is computed from the ledger by ``dpclip.accounting``.
"""

from dpclip.federated.aggregator import (
    AggregateOutput,
    DPAggregator,
    UserWeights,
    check_federated_strategy,
    make_user_sampler,
    round_context,
)
from dpclip.federated.client import LocalTraining, flat_parameters, local_seed, local_update
from dpclip.federated.data import FederatedData, federate
from dpclip.federated.server import FedAvgServer, ServerOptimizer, evaluate
from dpclip.federated.simulation import (
    FedAvgConfig,
    FedAvgResult,
    build_server,
    plan_ledger,
    resolve_noise,
    run_fedavg,
)

__all__ = [
    "AggregateOutput",
    "DPAggregator",
    "FedAvgConfig",
    "FedAvgResult",
    "FedAvgServer",
    "FederatedData",
    "LocalTraining",
    "ServerOptimizer",
    "UserWeights",
    "build_server",
    "check_federated_strategy",
    "evaluate",
    "federate",
    "flat_parameters",
    "local_seed",
    "local_update",
    "make_user_sampler",
    "plan_ledger",
    "resolve_noise",
    "round_context",
    "run_fedavg",
]
