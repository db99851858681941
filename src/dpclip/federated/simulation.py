"""User-level DP-FedAvg, simulated in one process (Andrew et al. 2021, Alg. 1; algorithms.md M6).

    server = FedAvgServer(model, DPAggregator(strategy, user sampler, z, rounds, randomness))
    for t in range(rounds):
        users  = server.sample_users()                         secret (randomness.sampling)
        deltas = [local_update(model, theta_t, data[u]) ...]    E local epochs of SGD per user
        server.finish_round(deltas, users)                     clip, sum, noise, / m, ledger, step

The same :class:`FedAvgServer` drives the Flower runtime (``dpclip.federated.flower``), so a
Flower run and a simulation with the same plan and randomness record equal ledgers.

Privacy: user-level (a neighbouring dataset adds or removes one user's whole data under Poisson
sampling; replaces it under fixed-size sampling). ``epsilon`` comes from the ledger
(``dpclip.accounting``). ``FedAvgConfig.target_epsilon`` calibrates ``z`` over the planned rounds.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from dpclip.accounting import Ledger, compute_epsilon
from dpclip.clipping.base import ClippingStrategy
from dpclip.federated.aggregator import (
    DPAggregator,
    UserWeights,
    check_federated_strategy,
    make_user_sampler,
)
from dpclip.federated.client import LocalTraining, local_seed, local_update, user_key
from dpclip.federated.data import FederatedData
from dpclip.federated.server import FedAvgServer, ServerOptimizer, evaluate
from dpclip.randomness import PrivateRandomness
from dpclip.training.plan import FEDERATED_FLAGS, Plan
from dpclip.training.plan import resolve_noise as resolve_noise_of_plan

__all__ = ["FedAvgConfig", "FedAvgResult", "build_server", "declared_weights", "plan_ledger",
           "resolve_noise", "run_fedavg", "user_plan"]


@dataclass(frozen=True)
class FedAvgConfig:
    """Public plan of a DP-FedAvg run.

    Give ``noise_multiplier`` (``z``) or ``target_epsilon`` (calibrates ``z`` for ``rounds``
    rounds at ``delta``). ``accountant``: ``"pld"`` (Poisson only) or ``"rdp"`` (required for
    ``sampling="fixed-size"``). ``reproducible_noise=True`` derives the sampling and noise
    generators from ``seed``: research only, NOT private, and labelled so in the result.
    """

    rounds: int
    clients_per_round: float
    delta: float
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    sampling: str = "poisson"
    accountant: str = "pld"
    local: LocalTraining = field(default_factory=LocalTraining)
    server: ServerOptimizer = field(default_factory=ServerOptimizer)
    seed: int = 0
    reproducible_noise: bool = False
    eval_every: int = 10
    log_nonprivate: bool = False
    #: declared capped weights ``a_u = min(n_u / weight_cap, 1)`` from the users' example counts
    #: (McMahan et al. 2018; the counts are declared public); ``None``: equal weights
    weight_cap: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 1:
            raise ValueError(f"FedAvgConfig: rounds must be an int >= 1, got {self.rounds!r}")
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError(
                "FedAvgConfig: give exactly one of noise_multiplier (z) and target_epsilon")
        if not (0 < float(self.delta) < 1):
            raise ValueError(f"FedAvgConfig: delta must be in (0, 1), got {self.delta!r}")
        if self.sampling == "fixed-size" and self.accountant == "pld":
            raise ValueError(
                "FedAvgConfig: fixed-size user sampling (replace-one) is accounted with RDP; "
                "set accountant='rdp' (PLD supports Poisson sampling only)")
        if self.weight_cap is not None and (isinstance(self.weight_cap, bool) or not isinstance(
                self.weight_cap, int) or self.weight_cap < 1):
            raise ValueError(f"FedAvgConfig: weight_cap must be an int >= 1 or None, got "
                             f"{self.weight_cap!r}")
        if isinstance(self.eval_every, bool) or not isinstance(self.eval_every, int) \
                or self.eval_every < 1:
            raise ValueError(f"FedAvgConfig: eval_every must be an int >= 1, got {self.eval_every!r}")


def user_plan(strategy: ClippingStrategy, config: FedAvgConfig, num_users: int) -> Plan:
    """The public plan of the run's rounds (:meth:`dpclip.training.plan.Plan.for_rounds`): the
    same plan the aggregator checks every round against."""
    check_federated_strategy(strategy)
    sampler = make_user_sampler(config.sampling, num_users, config.clients_per_round)
    return Plan.for_rounds(strategy, sampler, config.rounds)


def plan_ledger(strategy: ClippingStrategy, config: FedAvgConfig, num_users: int,
                noise_multiplier: float) -> Ledger:
    """The ledger the run will record (every round's planned event). Raises ``ValueError``
    (named by the strategy) when ``noise_multiplier`` admits no noise split."""
    return user_plan(strategy, config, num_users).ledger(noise_multiplier)


def resolve_noise(strategy: ClippingStrategy, config: FedAvgConfig, num_users: int) -> float:
    """``z``: the configured one, or calibrated to ``target_epsilon`` over the planned rounds
    (:func:`dpclip.training.plan.resolve_noise`, the calibration of steps).

    For a quantile strategy a probed ``z >= 2 sigma_b`` admits no Theorem-1 split; such probes are
    accounted as the equivalent single ``Gaussian(z)`` round (monotone in ``z``), and the result is
    checked by building the real plan."""
    plan = user_plan(strategy, config, num_users)
    z = resolve_noise_of_plan(plan, epsilon=config.target_epsilon,
                              noise_multiplier=config.noise_multiplier, delta=config.delta,
                              accountant=config.accountant, flags=FEDERATED_FLAGS)
    if config.noise_multiplier is None:
        plan.ledger(z)  # raises (named) if the split is impossible
    return z


def declared_weights(config: FedAvgConfig, data: FederatedData) -> UserWeights | None:
    """The declared capped weights of ``config.weight_cap`` (``None``: equal weights)."""
    if config.weight_cap is None:
        return None
    return UserWeights.capped_counts(data.user_sizes(), config.weight_cap)


def build_server(model: nn.Module, strategy: ClippingStrategy, config: FedAvgConfig,
                 num_users: int, *, randomness: PrivateRandomness | None = None,
                 user_weights: UserWeights | None = None,
                 noise_multiplier: float | None = None) -> FedAvgServer:
    """The server of a run (shared by the simulation and the Flower strategy)."""
    z = resolve_noise(strategy, config, num_users) if noise_multiplier is None else noise_multiplier
    if randomness is None:
        randomness = PrivateRandomness.for_run(config.reproducible_noise, config.seed)
    sampler = make_user_sampler(config.sampling, num_users, config.clients_per_round)
    agg = DPAggregator(strategy, sampler, z, config.rounds, randomness, user_weights)
    return FedAvgServer(model, agg, config.server)


@dataclass
class FedAvgResult:
    """What a run returns: public facts, the ledger and its epsilon, and the history."""

    summary: dict[str, Any]
    history: list[dict[str, Any]]
    ledger: Ledger
    epsilon: float
    clip_history: list[float]
    model: nn.Module
    strategy_state: dict[str, Any]


def run_fedavg(data: FederatedData, model: nn.Module, strategy: ClippingStrategy,
               config: FedAvgConfig, *, randomness: PrivateRandomness | None = None,
               user_weights: UserWeights | None = None,
               loss_fn: Callable[..., torch.Tensor] | None = None,
               callback: Callable[[dict[str, Any]], None] | None = None) -> FedAvgResult:
    """Train ``model`` with user-level DP-FedAvg on ``data`` (see the module docstring).

    ``model`` is the global model (initialised by the caller, e.g. after ``torch.manual_seed``);
    it holds the final parameters on return. ``callback(row)`` is called at every evaluation.
    """
    t0 = time.perf_counter()
    loss_fn = loss_fn or data.loss_fn()
    if user_weights is None:
        user_weights = declared_weights(config, data)
    server = build_server(model, strategy, config, data.num_users, randomness=randomness,
                          user_weights=user_weights)
    worker = copy.deepcopy(model)
    history: list[dict[str, Any]] = []
    keys = [user_key(split) for split in data.users]  # (each user's own: client.local_seed)
    for r in range(config.rounds):
        users = server.sample_users()
        theta = server.theta
        # (a fresh working copy of the global model for every client: one copy reused carried
        # whatever a client's training left in the model's own state (a Python counter, a frozen
        # parameter written in forward) into the next client's delta, 3.52 C a round;
        # hundred-and-fifty-first hostile review)
        deltas = [local_update(copy.deepcopy(worker), theta, data.users[u], config.local,
                               loss_fn=loss_fn, seed=local_seed(config.seed, r, keys[u]))
                  for u in users]
        out = server.finish_round(deltas if deltas else torch.zeros(0, theta.numel()), users)
        if (r + 1) % config.eval_every == 0 or r + 1 == config.rounds:
            acc, loss = evaluate(model, data.test.inputs, data.test.targets, loss_fn=loss_fn,
                                 ignore_index=data.ignore_index)
            row: dict[str, Any] = {
                "round": r + 1, "test_accuracy": acc, "test_loss": loss,
                "clip_norm": out.clip_norm,
                "next_clip_norm": float(server.aggregator.state.get("clip_norm", out.clip_norm)),
                "epsilon": compute_epsilon(server.aggregator.ledger, config.delta,
                                           config.accountant).epsilon,
            }
            if config.log_nonprivate:
                # a round's time depends on which users were (secretly) sampled and how much
                # data they hold (twelfth hostile review: the rounds of a large user stood out
                # 10x): NON-PRIVATE, opt-in; the run's total stays in the summary
                row["nonprivate/wall_seconds"] = time.perf_counter() - t0
                row["nonprivate/clients"] = out.num_clients
                row["nonprivate/median_norm"] = (
                    float(out.norms.median()) if out.num_clients else math.nan)
            history.append(row)
            if callback is not None:
                callback(row)
    # the last evaluation is at the last round: its epsilon is the run's (one accountant call)
    eps = history[-1]["epsilon"]
    summary = {
        **server.describe(), **data.describe(nonprivate=config.log_nonprivate),
        "rounds": config.rounds, "delta": config.delta, "accountant": config.accountant,
        "epsilon": eps, "target_epsilon": config.target_epsilon,
        "local_epochs": config.local.epochs, "local_batch_size": config.local.batch_size,
        "client_lr": config.local.lr, "seed": config.seed,
        "test_accuracy": history[-1]["test_accuracy"] if history else math.nan,
        "wall_seconds": time.perf_counter() - t0,
    }
    return FedAvgResult(summary, history, server.aggregator.ledger, eps, server.clip_history,
                        model, dict(server.aggregator.state))
